"""Norms and activations shared by the blocks (spec/model.md §1)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Kimi's RMSNorm: normalise in fp32, cast back to the input dtype, then scale by the weight
    (HF `KimiRMSNorm`; the order only matters in bf16)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor, addends: list[torch.Tensor] | None = None,
                bank: list[torch.Tensor] | None = None, res_norm: "RMSNorm | None" = None,
                res_proj: nn.Linear | None = None):
        """The norm of x; with `bank` (Block AttnRes, graph/blocks/attn_res.py), the norm of the
        mix over bank + [x + addends] with the layer's `res_norm` and `res_proj`, returned with
        s = x + addends as (s, normed). The mix runs inside this module's call so its graph nodes
        carry the norm's name (`layers.3.input_layernorm/attn_res_norm`)."""
        if bank is None:
            return self.weight * rms_normalize(x, self.eps)
        s, normed = torch.ops.k31c.attn_res_norm(x, addends or [], bank, res_norm.weight, res_proj.weight,
                                                 self.weight, res_norm.eps, self.eps)
        return (s if addends else x), normed

    def reset_parameters(self, gen: torch.Generator) -> None:
        nn.init.ones_(self.weight)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) computed in fp32, returned in x's dtype (no weight)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def glu_activation(gate: torch.Tensor, up: torch.Tensor, act: str, beta: float,
                   linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU (`hidden_act="situ"`, K3) or SiLU-GLU (`"silu"`), computed in fp32 (spec §1.1)."""
    g, u = gate.float(), up.float()
    if act == "situ":
        a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
        if linear_beta is not None:
            u = linear_beta * torch.tanh(u / linear_beta)
    elif act == "silu":
        a = torch.nn.functional.silu(g)
    else:
        raise ValueError(f"unknown hidden_act '{act}'")
    return (a * u).to(gate.dtype)


def init_linear(layer: nn.Linear, gen: torch.Generator, std: float = 0.02) -> None:
    """Random init used for checkpoints made by `k31c init` (spec §9.5: N(0, 0.02))."""
    with torch.no_grad():
        w = torch.empty(layer.weight.shape, dtype=torch.float32, device=gen.device).normal_(0.0, std, generator=gen)
        layer.weight.copy_(w.to(layer.weight.dtype))
