"""The one-pass sparse MLA (a comparison kernel): mla.py's kernel in its sparse mode, keys from
the top-k index lists. The registered `k31c::sparse_mla` is the two-pass kernel
(k31c/lowering/triton/mla_two_pass.py), measured faster (BENCHMARKS.md, MLA)."""
from __future__ import annotations

import torch

from k31c.lowering.triton import mla
from k31c.lowering.triton.mla_two_pass import check_sparse


def sparse_mla_one_pass(q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor,
                        row_req: torch.Tensor, indices: torch.Tensor, sm_scale: float, dv: int,
                        config: dict | None = None,
                        stats: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`k31c::sparse_mla` by the one-pass kernel; config / stats as `mla.launch`."""
    check_sparse(q, latent_cache, block_table, row_req, indices, dv)
    return mla.launch(q, latent_cache, block_table, row_req, indices, None, sm_scale, dv,
                      config=config, stats=stats)
