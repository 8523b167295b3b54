"""Routed experts of the MoE layers (spec/model.md §7.1, §7.2).

Ops (namespace k31c):
- `moe_route(x, weight, bias, k, n_group, topk_group, scoring, renormalize, scaling, row_len)` →
  (idx int32 [N, k], weights fp32 [N, k]): the `noaux_tc` router. logits = x_f32 · weight_f32ᵀ;
  scores = sigmoid (or softmax) of them; selection on scores + bias (fp32 [E]), restricted to the
  best `topk_group` of `n_group` groups (group score: the sum of its top-2) when
  n_group > topk_group > 0; weights are the unbiased scores of the selected experts, renormalised
  (k > 1 and renormalize) and multiplied by `scaling`.
  Tie rule: among equal choices (and equal group scores) the lower index wins. Reference order:
  choice descending, then index ascending (kernels may return any order; idx and weights pair up).
  `row_len` (optional, int32 [N]: the step's keys per row): a row with row_len <= 0 is a padding
  row of a device-graph bucket; it gets idx -1 and weight 0, so no expert is read for it.
- `moe_experts(z, idx, weights, w13, w2, act, beta, linear_beta)` → u [N, W] in z's dtype:
  u[n] = Σ_j weights[n, j] · E_{idx[n, j]}(z[n]), accumulated in fp32, where
  E_e(z) = w2[e] · GLU(w13[e, :I] · z, w13[e, I:] · z) with norms.glu_activation
  (`act` "situ" or "silu"). Shapes: z [N, W], w13 [E, 2I, W] (gate rows, then up rows), w2 [E, W, I].
  Each expert's gate/up/down outputs are rounded to the weights' dtype, as nn.Linear's are.
  idx -1 selects no expert (a padding row's routing); any other index outside 0..E-1 is an error.

The reference applies every expert to every row weighted by its routing weight (zero when not
selected): the same sum, in expert order, as a sparse dispatch. Kernels read only the selected
experts' weights.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..blocks.norms import glu_activation

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
SCORING = ("sigmoid", "softmax")
ACTIVATIONS = ("situ", "silu")


# ---- argument checks (metadata only, shared by the real and the fake implementations) ------

def check_route(x, weight, bias, k, n_group, topk_group, scoring, renormalize, scaling,
                row_len=None) -> None:
    if x.dim() != 2 or x.dtype not in _FLOATS:
        raise ValueError(f"x: expected a float [N, D] tensor, got {x.dtype} {tuple(x.shape)}")
    if weight.dim() != 2 or weight.dtype not in _FLOATS or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight: expected a float [E, {x.shape[1]}] tensor, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    e = weight.shape[0]
    if bias.dtype != torch.float32 or tuple(bias.shape) != (e,):
        raise ValueError(f"bias: expected float32 [{e}], got {bias.dtype} {tuple(bias.shape)}")
    if scoring not in SCORING:
        raise ValueError(f"scoring must be one of {SCORING}, got {scoring!r}")
    if not isinstance(n_group, int) or n_group < 1 or e % n_group:
        raise ValueError(f"n_group must be a positive divisor of the {e} experts, got {n_group!r}")
    grouped = n_group > topk_group
    if not isinstance(topk_group, int) or topk_group < 1 or topk_group > n_group:
        raise ValueError(f"topk_group must be in 1..{n_group}, got {topk_group!r}")
    eligible = topk_group * (e // n_group) if grouped else e
    if not isinstance(k, int) or k < 1 or k > eligible:
        raise ValueError(f"k must be in 1..{eligible} (the experts the kept groups hold), got {k!r}")
    if grouped and e // n_group < 2:
        raise ValueError(f"groups of {e // n_group} expert: the group score needs the top 2")
    if row_len is not None and (row_len.dtype != torch.int32 or tuple(row_len.shape) != (x.shape[0],)):
        raise ValueError(f"row_len: expected int32 [{x.shape[0]}], got {row_len.dtype} "
                         f"{tuple(row_len.shape)}")


def check_experts(z, idx, weights, w13, w2, act, beta, linear_beta) -> None:
    if z.dim() != 2 or z.dtype not in _FLOATS:
        raise ValueError(f"z: expected a float [N, W] tensor, got {z.dtype} {tuple(z.shape)}")
    n, width = z.shape
    if idx.dtype != torch.int32 or idx.dim() != 2 or idx.shape[0] != n:
        raise ValueError(f"idx: expected int32 [{n}, k], got {idx.dtype} {tuple(idx.shape)}")
    if weights.dtype != torch.float32 or tuple(weights.shape) != tuple(idx.shape):
        raise ValueError(f"weights: expected float32 {list(idx.shape)}, got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    if w13.dim() != 3 or w13.dtype not in _FLOATS or w13.shape[2] != width or w13.shape[1] % 2:
        raise ValueError(f"w13: expected a float [E, 2I, {width}] tensor, got {w13.dtype} "
                         f"{tuple(w13.shape)}")
    e, inter = w13.shape[0], w13.shape[1] // 2
    if w13.dtype != z.dtype:
        raise ValueError(f"w13: dtype {w13.dtype} differs from z's {z.dtype}")
    if w2.dtype != w13.dtype or tuple(w2.shape) != (e, width, inter):
        raise ValueError(f"w2: expected {w13.dtype} [{e}, {width}, {inter}], got {w2.dtype} "
                         f"{tuple(w2.shape)}")
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {ACTIVATIONS}, got {act!r}")
    if act == "situ" and not beta > 0:
        raise ValueError(f"beta must be positive for SiTU, got {beta!r}")


# ---- references ------------------------------------------------------------------------------

def _top(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest of each row, largest first; the lower index wins ties."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def route(x, weight, bias, k, n_group, topk_group, scoring, renormalize, scaling, row_len=None):
    check_route(x, weight, bias, k, n_group, topk_group, scoring, renormalize, scaling, row_len)
    logits = x.float() @ weight.float().t()
    scores = torch.sigmoid(logits) if scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores + bias
    if n_group > topk_group:
        grouped = choice.view(-1, n_group, weight.shape[0] // n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)              # [N, G]
        keep = _top(group_score, topk_group)
        mask = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, keep, True)
        choice = grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view_as(choice)
    idx = _top(choice, k)
    w = scores.gather(1, idx)
    if k > 1 and renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    idx, w = idx.to(torch.int32), w * scaling
    if row_len is not None:                                   # padding rows select no expert
        live = (row_len > 0).unsqueeze(1)
        idx, w = torch.where(live, idx, -1), torch.where(live, w, 0.0)
    return idx, w


def expert_outputs(z: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, e: int, act: str,
                   beta: float, linear_beta: Optional[float]) -> torch.Tensor:
    """E_e(z) for every row of z, in the weights' dtype (each product rounded as nn.Linear's)."""
    inter = w13.shape[1] // 2
    gate = z @ w13[e, :inter].t()
    up = z @ w13[e, inter:].t()
    return glu_activation(gate, up, act, beta, linear_beta) @ w2[e].t()


def experts(z, idx, weights, w13, w2, act, beta, linear_beta):
    check_experts(z, idx, weights, w13, w2, act, beta, linear_beta)
    n_experts = w13.shape[0]
    if idx.numel() and (bool((idx < -1).any()) or bool((idx >= n_experts).any())):
        raise ValueError(f"idx: an expert index is outside 0..{n_experts - 1} (or -1: none)")
    # combine[n, e] = routing weight of expert e for row n (0 when not selected; -1 selects none)
    combine = torch.zeros(z.shape[0], n_experts, dtype=torch.float32, device=z.device)
    combine = combine.scatter_add(1, idx.long().clamp_min(0), torch.where(idx >= 0, weights, 0.0))
    u = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
    for e in range(n_experts):
        u = u + combine[:, e:e + 1] * expert_outputs(z, w13, w2, e, act, beta, linear_beta).float()
    return u.to(z.dtype)


# ---- ops -------------------------------------------------------------------------------------

@torch.library.custom_op("k31c::moe_route", mutates_args=())
def moe_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, n_group: int,
              topk_group: int, scoring: str, renormalize: bool, scaling: float,
              row_len: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return route(x, weight, bias, k, n_group, topk_group, scoring, renormalize, scaling, row_len)


@moe_route.register_fake
def _(x, weight, bias, k, n_group, topk_group, scoring, renormalize, scaling, row_len=None):
    check_route(x, weight, bias, k, n_group, topk_group, scoring, renormalize, scaling, row_len)
    n = x.shape[0]
    return x.new_empty((n, k), dtype=torch.int32), x.new_empty((n, k), dtype=torch.float32)


@torch.library.custom_op("k31c::moe_experts", mutates_args=())
def moe_experts(z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, act: str, beta: float, linear_beta: Optional[float]) -> torch.Tensor:
    return experts(z, idx, weights, w13, w2, act, beta, linear_beta)


@moe_experts.register_fake
def _(z, idx, weights, w13, w2, act, beta, linear_beta):
    check_experts(z, idx, weights, w13, w2, act, beta, linear_beta)
    return torch.empty_like(z)
