"""Block Attention Residuals (spec/model.md §3): each layer mixes the completed block snapshots
and the current partial block with a softmax over one learned pseudo-query per layer, and the
RMSNorm that follows the mix runs in the same op (`k31c::attn_res_norm`, graph/ops/attn_res.py)."""
from __future__ import annotations

import torch

from .norms import RMSNorm


def attn_res_norm(partial: torch.Tensor, addends: list[torch.Tensor], bank: list[torch.Tensor],
                  res_norm: RMSNorm, res_proj: torch.nn.Linear,
                  norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, norm(mix)): s = partial + addends (the partial sum with the output still to be added,
    one term or a MoE layer's two; partial itself when there is none), the mix over bank + [s]
    with the layer's `*_res_norm` and `*_res_proj`, then `norm` of it, called through `norm` so
    the graph names the op after it."""
    return norm(partial, addends=addends, bank=bank, res_norm=res_norm, res_proj=res_proj)
