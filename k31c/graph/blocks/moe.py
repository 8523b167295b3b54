"""Feed-forward blocks (spec/model.md §7): the dense MLP of the first layers, the sigmoid
`noaux_tc` router with expert groups, the stacked routed experts, and Stable LatentMoE with
shared experts."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import k31c.graph.ops  # noqa: F401  (registers torch.ops.k31c.*)
from ...config import K31Config
from .norms import RMSNorm, glu_activation, init_linear


class GatedMLP(nn.Module):
    """down(act([gate(x) ‖ up(x)])): the dense layer-0 MLP and the shared experts."""

    def __init__(self, cfg: K31Config, dim: int, inter: int):
        super().__init__()
        dt = cfg.torch_dtype
        self.act = (cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        self.gate_proj = nn.Linear(dim, inter, bias=False, dtype=dt)
        self.up_proj = nn.Linear(dim, inter, bias=False, dtype=dt)
        self.down_proj = nn.Linear(inter, dim, bias=False, dtype=dt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu_activation(self.gate_proj(x), self.up_proj(x), *self.act))

    def reset_parameters(self, gen: torch.Generator) -> None:
        for m in (self.gate_proj, self.up_proj, self.down_proj):
            init_linear(m, gen)


class StackedExperts(nn.Module):
    """The routed experts as two stacked parameters, `w13 [E, 2I, W]` (each expert's gate rows,
    then its up rows) and `w2 [E, W, I]`, so the expert op reads [E, ...] tensors directly.

    The state dict keeps the HF per-expert names `{e}.w1.weight` (gate), `{e}.w3.weight` (up) and
    `{e}.w2.weight` (down), as views of the stacks; loading accepts those names (stacked on load)
    or the stacked ones.
    """

    def __init__(self, cfg: K31Config, dim: int, inter: int):
        super().__init__()
        dt, e = cfg.torch_dtype, cfg.num_experts
        self.num_experts, self.inter = e, inter
        self.w13 = nn.Parameter(torch.empty(e, 2 * inter, dim, dtype=dt))
        self.w2 = nn.Parameter(torch.empty(e, dim, inter, dtype=dt))
        self._register_state_dict_hook(_per_expert_state)
        self.register_load_state_dict_pre_hook(_stack_per_expert_state)

    def per_expert(self, stacked: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF name (relative to this module) -> view of the stacked tensors `w13`, `w2`."""
        w13, w2, i = stacked["w13"], stacked["w2"], self.inter
        out = {}
        for e in range(self.num_experts):
            out.update({f"{e}.w1.weight": w13[e, :i], f"{e}.w3.weight": w13[e, i:],
                        f"{e}.w2.weight": w2[e]})
        return out

    def reset_parameters(self, gen: torch.Generator) -> None:
        # expert by expert, w1, w3, w2: the draws of one nn.Linear per weight (spec §9.5)
        with torch.no_grad():
            for name, view in self.per_expert({"w13": self.w13, "w2": self.w2}).items():
                w = torch.empty(view.shape, dtype=torch.float32, device=gen.device).normal_(0.0, 0.02, generator=gen)
                view.copy_(w.to(view.dtype))


def _per_expert_state(module: StackedExperts, state: dict, prefix: str, local_metadata) -> None:
    """state_dict hook: the stacked entries become the per-expert HF names."""
    stacked = {name: state.pop(prefix + name) for name in ("w13", "w2")}
    for name, view in module.per_expert(stacked).items():
        state[prefix + name] = view


def _stack_per_expert_state(module: StackedExperts, state: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook: per-expert HF names are stacked into `w13` and `w2` when every
    expert's three tensors are there (else they stay, and strict loading names what is missing)."""
    names = [[f"{prefix}{e}.{w}.weight" for w in ("w1", "w3", "w2")]
             for e in range(module.num_experts)]
    if not all(n in state for row in names for n in row):
        return
    w1, w3, w2 = ([state.pop(row[j]) for row in names] for j in range(3))
    state[prefix + "w13"] = torch.stack([torch.cat(pair) for pair in zip(w1, w3)])
    state[prefix + "w2"] = torch.stack(w2)


class Router(nn.Module):
    """Sigmoid (or softmax) scores; selection on score + correction bias, optionally restricted to
    the best `topk_group` of `num_expert_group` groups (group score = sum of its top-2); weights
    are the unbiased scores, renormalised and scaled (spec §7.1; op `k31c::moe_route`)."""

    def __init__(self, cfg: K31Config):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=cfg.torch_dtype))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor, row_len: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(idx int32 [N, k], weights fp32 [N, k]); rows with row_len <= 0 (padding) get idx -1."""
        c = self.cfg
        return torch.ops.k31c.moe_route(x, self.weight, self.e_score_correction_bias,
                                        c.num_experts_per_token, c.num_expert_group, c.topk_group,
                                        c.moe_router_activation_func, c.moe_renormalize,
                                        float(c.routed_scaling_factor), row_len)

    def reset_parameters(self, gen: torch.Generator) -> None:
        init_linear(self, gen)
        nn.init.zeros_(self.e_score_correction_bias)


class LatentMoE(nn.Module):
    """Stable LatentMoE (K3): route on x, run experts in the latent width, RMSNorm the combined
    latent, project up, add the shared experts. Without `routed_expert_hidden_size` (Kimi Linear,
    DeepSeek) the experts run at width D and there is no latent norm.

    Routing and the routed experts are the k31c ops `moe_route` and `moe_experts` (graph/ops/moe.py:
    kernels read only the selected experts' weights); the latent projections, the norm and the
    shared experts stay dense.
    """

    def __init__(self, cfg: K31Config):
        super().__init__()
        self.cfg = cfg
        dt, d = cfg.torch_dtype, cfg.hidden_size
        latent = cfg.routed_expert_hidden_size
        width = latent or d
        self.gate = Router(cfg)
        self.experts = StackedExperts(cfg, width, cfg.moe_intermediate_size)
        self.act = (cfg.hidden_act, float(cfg.activation_situ_beta),
                    None if cfg.activation_situ_linear_beta is None else float(cfg.activation_situ_linear_beta))
        if cfg.num_shared_experts:
            self.shared_experts = GatedMLP(cfg, d, cfg.moe_intermediate_size * cfg.num_shared_experts)
        if latent is not None:
            self.routed_expert_down_proj = nn.Linear(d, latent, bias=False, dtype=dt)
            self.routed_expert_up_proj = nn.Linear(latent, d, bias=False, dtype=dt)
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(latent, cfg.rms_norm_eps, dt)

    def forward(self, x: torch.Tensor, row_len: Optional[torch.Tensor] = None, terms: bool = False):
        """x [N, D]; `row_len` (the step's keys per row) marks a device graph's padding rows
        (row_len 0), which then read no expert. With `terms`, the routed and the shared experts'
        outputs as a list, not yet added (Block AttnRes adds them inside its next mix)."""
        latent = self.cfg.routed_expert_hidden_size is not None
        # the down projection first: the dense ops before the two k31c ops form one piece
        z = self.routed_expert_down_proj(x) if latent else x
        idx, w = self.gate(x, row_len)
        u = torch.ops.k31c.moe_experts(z, idx, w, self.experts.w13, self.experts.w2, *self.act)
        if latent:
            if self.cfg.latent_moe_use_norm:
                u = self.routed_expert_norm(u)
            u = self.routed_expert_up_proj(u)
        if not self.cfg.num_shared_experts:
            return [u] if terms else u
        shared = self.shared_experts(x)
        return [u, shared] if terms else u + shared

    def reset_parameters(self, gen: torch.Generator) -> None:
        for m in self.children():
            if isinstance(m, nn.Linear):
                init_linear(m, gen)
            else:
                m.reset_parameters(gen)
