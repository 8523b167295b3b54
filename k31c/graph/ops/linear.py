"""Projections that share an input (the decode step's horizontal fusion, passes/merge_projections.py).

Op (namespace k31c):
- `linear_group(x, weights)` → [y_0, ..., y_{n-1}], y_i = x · weights[i]ᵀ in x's dtype, as
  `nn.functional.linear(x, weights[i])` without a bias. x [..., K]; each weight [N_i, K] in x's
  dtype; y_i [..., N_i], each its own contiguous tensor.

A decode step reads every projection weight once for a handful of rows; one launch over all the
weights that read the same x streams them back to back, where one GEMV per weight pays a launch,
a ramp and (in cuBLAS at these shapes) a split-K reduction each. The reference is the per-weight
linear it replaces.
"""
from __future__ import annotations

import torch

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def check_linear_group(x: torch.Tensor, weights: list[torch.Tensor]) -> None:
    if x.dtype not in _FLOATS or x.dim() < 1:
        raise ValueError(f"x: expected a float [..., K] tensor, got {x.dtype} {tuple(x.shape)}")
    if not weights:
        raise ValueError("weights: expected at least one [N, K] weight, got none")
    k = x.shape[-1]
    for i, w in enumerate(weights):
        if w.dim() != 2 or w.shape[1] != k or w.dtype != x.dtype:
            raise ValueError(f"weights[{i}]: expected {x.dtype} [N, {k}] (x's dtype and width), "
                             f"got {w.dtype} {tuple(w.shape)}")
        if w.device != x.device:
            raise ValueError(f"weights[{i}]: on {w.device}, x on {x.device}")


@torch.library.custom_op("k31c::linear_group", mutates_args=())
def linear_group(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    check_linear_group(x, weights)
    return [torch.nn.functional.linear(x, w) for w in weights]


@linear_group.register_fake
def _(x, weights):
    check_linear_group(x, weights)
    return [x.new_empty((*x.shape[:-1], w.shape[0])) for w in weights]
