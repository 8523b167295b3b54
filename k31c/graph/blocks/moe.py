"""Feed-forward blocks (spec/model.md §7): the dense MLP of the first layers, the sigmoid
`noaux_tc` router with expert groups, and Stable LatentMoE with shared experts."""
from __future__ import annotations

import torch
from torch import nn

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


class Expert(nn.Module):
    """A routed expert, HF names w1 (gate), w3 (up), w2 (down)."""

    def __init__(self, cfg: K31Config, dim: int, inter: int):
        super().__init__()
        dt = cfg.torch_dtype
        self.act = (cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        self.w1 = nn.Linear(dim, inter, bias=False, dtype=dt)
        self.w3 = nn.Linear(dim, inter, bias=False, dtype=dt)
        self.w2 = nn.Linear(inter, dim, bias=False, dtype=dt)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.w2(glu_activation(self.w1(z), self.w3(z), *self.act))

    def reset_parameters(self, gen: torch.Generator) -> None:
        for m in (self.w1, self.w3, self.w2):
            init_linear(m, gen)


class Router(nn.Module):
    """Sigmoid (or softmax) scores; selection on score + correction bias, optionally restricted to
    the best `topk_group` of `num_expert_group` groups (group score = sum of its top-2); weights
    are the unbiased scores, renormalised and scaled (spec §7.1)."""

    def __init__(self, cfg: K31Config):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=cfg.torch_dtype))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        logits = x.float() @ self.weight.float().t()
        scores = torch.sigmoid(logits) if c.moe_router_activation_func == "sigmoid" \
            else torch.softmax(logits, dim=-1)
        choice = scores + self.e_score_correction_bias
        if c.num_expert_group > 1 and c.num_expert_group > c.topk_group:
            grouped = choice.view(-1, c.num_expert_group, c.num_experts // c.num_expert_group)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)              # [N, G]
            keep = group_score.topk(c.topk_group, dim=-1).indices
            mask = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, keep, True)
            choice = grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view_as(choice)
        idx = choice.topk(c.num_experts_per_token, dim=-1).indices
        w = scores.gather(1, idx)
        if c.num_experts_per_token > 1 and c.moe_renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * c.routed_scaling_factor

    def reset_parameters(self, gen: torch.Generator) -> None:
        init_linear(self, gen)
        nn.init.zeros_(self.e_score_correction_bias)


class LatentMoE(nn.Module):
    """Stable LatentMoE (K3): route on x, run experts in the latent width, RMSNorm the combined
    latent, project up, add the shared experts. Without `routed_expert_hidden_size` (Kimi Linear,
    DeepSeek) the experts run at width D and there is no latent norm.

    Experts are applied densely (every expert on every row, weighted by its routing weight, zero
    when unselected): the same sum as sparse dispatch, and it keeps shapes static for capture.
    Serving-size expert dispatch is a kernel's job, not this reference's.
    """

    def __init__(self, cfg: K31Config):
        super().__init__()
        self.cfg = cfg
        dt, d = cfg.torch_dtype, cfg.hidden_size
        latent = cfg.routed_expert_hidden_size
        width = latent or d
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(Expert(cfg, width, cfg.moe_intermediate_size)
                                     for _ in range(cfg.num_experts))
        if cfg.num_shared_experts:
            self.shared_experts = GatedMLP(cfg, d, cfg.moe_intermediate_size * cfg.num_shared_experts)
        if latent is not None:
            self.routed_expert_down_proj = nn.Linear(d, latent, bias=False, dtype=dt)
            self.routed_expert_up_proj = nn.Linear(latent, d, bias=False, dtype=dt)
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(latent, cfg.rms_norm_eps, dt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, w = self.gate(x)
        latent = self.cfg.routed_expert_hidden_size is not None
        z = self.routed_expert_down_proj(x) if latent else x
        # combine[n, e] = routing weight of expert e for row n (0 when not selected)
        combine = torch.zeros(x.shape[0], self.cfg.num_experts, dtype=torch.float32, device=x.device)
        combine = combine.scatter_add(1, idx, w)
        u = torch.zeros(z.shape, dtype=torch.float32, device=x.device)
        for e, expert in enumerate(self.experts):
            u = u + combine[:, e:e + 1] * expert(z).float()
        u = u.to(x.dtype)
        if latent:
            if self.cfg.latent_moe_use_norm:
                u = self.routed_expert_norm(u)
            u = self.routed_expert_up_proj(u)
        if self.cfg.num_shared_experts:
            u = u + self.shared_experts(x)
        return u

    def reset_parameters(self, gen: torch.Generator) -> None:
        for m in self.children():
            if isinstance(m, nn.Linear):
                init_linear(m, gen)
            elif isinstance(m, nn.ModuleList):
                for e in m:
                    e.reset_parameters(gen)
            else:
                m.reset_parameters(gen)
