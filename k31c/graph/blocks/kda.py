"""The KDA attention block (spec/model.md §4), parameters named as in the HF K3 checkpoint (§9.6).

Token-local projections are plain modules; the convolution, gates, delta rule and gated norm run
inside `k31c::kda_prefill` / `k31c::kda_decode`, which own the per-request state.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

import k31c.graph.ops.kda  # noqa: F401  (registers torch.ops.k31c.kda_*)
from k31c.config import K31Config
from k31c.graph.blocks.norms import init_linear
from k31c.graph.ops.kda import gated_rms_norm
from k31c.graph.step import KDALayerState, KDASnapshots, StepMeta


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm with a sigmoid output gate (`o_norm`); holds the checkpoint's `.weight`."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, self.weight, gate, self.eps).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: K31Config, device=None):
        super().__init__()
        H, K, W, D = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size, cfg.hidden_size
        P = H * K
        self.num_heads, self.head_dim, self.kernel_size = H, K, W
        self.lower_bound = cfg.gate_lower_bound
        self.chunk_size = cfg.kda_chunk_size
        self.eps = cfg.rms_norm_eps
        dt = dict(dtype=cfg.torch_dtype, device=device)
        f32 = dict(dtype=torch.float32, device=device)

        def linear(i, o):
            return nn.Linear(i, o, bias=False, **dt)

        self.q_proj, self.k_proj, self.v_proj = linear(D, P), linear(D, P), linear(D, P)
        # depthwise conv weights [P, 1, W], fp32 as in the K3 checkpoint
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(P, P, W, groups=P, bias=False, **f32) for _ in range(3))
        self.f_a_proj, self.f_b_proj = linear(D, K), linear(K, P)
        self.b_proj = linear(D, H)
        if cfg.use_full_rank_gate:
            self.g_proj = linear(D, P)
        else:
            self.g_a_proj, self.g_b_proj = linear(D, K), linear(K, P)
        self.dt_bias = nn.Parameter(torch.zeros(P, **f32))
        self.A_log = nn.Parameter(torch.zeros(H, **f32))
        self.o_norm = GatedRMSNorm(K, cfg.rms_norm_eps, **dt)
        self.o_proj = linear(P, D)

    def output_gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "g_proj"):
            return self.g_proj(x)
        return self.g_b_proj(self.g_a_proj(x))

    def conv_weight(self) -> torch.Tensor:
        """q|k|v depthwise conv weights as one [3P, W] tensor (the ops' layout)."""
        return torch.cat([c.weight.squeeze(1) for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)])

    def forward(self, x: torch.Tensor, state: KDALayerState, meta: StepMeta, mode: str,
                rows: int = 1, snapshots: Optional[KDASnapshots] = None) -> torch.Tensor:
        """x [N, D] (already input-normed) -> [N, D] in x's dtype; updates `state` in place."""
        args = (self.q_proj(x), self.k_proj(x), self.v_proj(x), self.f_b_proj(self.f_a_proj(x)),
                self.b_proj(x), self.output_gate_logits(x), self.conv_weight(), self.A_log,
                self.dt_bias, self.o_norm.weight, state.conv, state.recurrent, meta.kda_slots)
        if mode == "prefill":
            if snapshots is not None:
                raise ValueError("snapshots: only decode/verify steps write per-row snapshots")
            o = torch.ops.k31c.kda_prefill(*args, meta.cu_seqlens, self.lower_bound, self.eps,
                                           self.chunk_size)
        elif mode == "decode":
            snap_conv = snapshots.conv if snapshots is not None else None
            snap_state = snapshots.recurrent if snapshots is not None else None
            o = torch.ops.k31c.kda_decode(*args, rows, self.lower_bound, self.eps, snap_conv, snap_state)
        else:
            raise ValueError(f"mode: expected 'prefill' or 'decode', got {mode!r}")
        return self.o_proj(o.to(self.o_proj.weight.dtype)).to(x.dtype)

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator) -> None:
        """Random init of spec §9.5 (fla `KimiDeltaAttention.__init__` for A_log and dt_bias)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                init_linear(m, gen)
        bound = 1.0 / math.sqrt(self.kernel_size)
        for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            w = torch.empty(c.weight.shape, device=gen.device).uniform_(-bound, bound, generator=gen)
            c.weight.copy_(w)
        self.A_log.copy_(torch.empty(self.A_log.shape, device=gen.device).uniform_(1.0, 16.0, generator=gen).log())
        u = torch.empty(self.dt_bias.shape, device=gen.device).uniform_(math.log(1e-3), math.log(1e-1), generator=gen)
        dt = u.exp().clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))   # softplus^-1(dt)
        nn.init.ones_(self.o_norm.weight)
