"""Block Attention Residuals (spec/model.md §3): each layer mixes the completed block snapshots
and the current partial block with a softmax over one learned pseudo-query per layer."""
from __future__ import annotations

import torch


def attn_res(partial: torch.Tensor, bank: list[torch.Tensor], norm: torch.nn.Module,
             proj: torch.nn.Linear) -> torch.Tensor:
    """softmax_i(<rmsnorm(V_i), norm_w ⊙ proj_w>) · V_i over V = bank + [partial], in fp32.

    `norm` (RMSNorm, `*_res_norm`) and `proj` (`*_res_proj`, weight [1, D]) are the layer's two
    parameters; the softmax weights use the normalised candidates, the mix the raw ones (HF
    `_apply_attn_res`).
    """
    values = torch.stack([*bank, partial], dim=1).float()                  # [T, n+1, D]
    keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + norm.eps)
    query = norm.weight.float() * proj.weight.float().reshape(-1)                     # [D]
    # a broadcast product, not `keys @ query`: torch 2.11's fake matmul of a 3-D tensor with
    # a symbolic size by a vector calls numel() and fails in the graph's fake re-propagation
    alpha = torch.softmax((keys * query).sum(-1), dim=1)                    # [T, n+1]
    return (alpha.unsqueeze(-1) * values).sum(1).to(partial.dtype)
