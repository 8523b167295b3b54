"""Triton lowering of `k31c::lightning_indexer_topk`: the indexer's scan, then the top-k select.

indexer.py's scan writes the [N, L] fp32 scores to a workspace, topk.py's select reads them. A
single fused kernel that selected from scores computed in-kernel, never writing them out, was
measured 2.6x slower at 128K and removed (BENCHMARKS.md, top-k).
"""
from __future__ import annotations

import torch

from k31c.lowering.registry import register
from k31c.lowering.targets import GPU_TARGETS
from k31c.lowering.triton import indexer, topk

_OP = "k31c::lightning_indexer_topk"


@register(_OP, GPU_TARGETS)
def lightning_indexer_topk(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                           block_table: torch.Tensor, row_req: torch.Tensor, row_len: torch.Tensor,
                           k: int) -> torch.Tensor:
    """topk_select(lightning_indexer(...), row_len, k) as the two Triton launchers: the scores
    live in a workspace [N, L] fp32 between them (allocated per call from the caching allocator,
    so a CUDA graph capture keeps it in the graph's pool)."""
    if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    scores = indexer.lightning_indexer(q, weights, index_cache, block_table, row_req, row_len)
    return topk.topk_select(scores, row_len, k)


def aot_specs(shapes) -> list:
    """The launches for `k31c::lightning_indexer_topk` at `shapes` (aot_spec.AotShapes): the
    indexer's and the top-k's own, tagged with this op too."""
    return [s._replace(ops=tuple(dict.fromkeys((*s.ops, _OP))))
            for s in (*indexer.aot_specs(shapes), *topk.aot_specs(shapes))]
