"""The K3.1 Pro reference model: decoder layers (KDA or gated MLA + indexer, dense MLP or
LatentMoE) wired with Block Attention Residuals (spec/model.md §2). Eager PyTorch is the oracle
every compiled program is compared with; parameter names are the HF K3 checkpoint names.

One forward is one step over N rows (graph/step.py): `mode="prefill"` (new tokens of B requests,
KDA in chunked form, MLA in the absorbed sparse form) or `mode="decode"` (B requests x `rows` rows: plain
decode at rows=1, speculative verification at rows>1 with KDA snapshots in `caches`).
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import K31Config
from . import ops  # noqa: F401  (registers torch.ops.k31c.*)
from .blocks.attn_res import attn_res_norm
from .blocks.kda import KimiDeltaAttention
from .blocks.mla import GatedMLA
from .blocks.moe import GatedMLP, LatentMoE
from .blocks.norms import RMSNorm, init_linear
from .step import Caches, StepMeta

MODES = ("prefill", "decode")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: K31Config, layer_id: int):
        super().__init__()
        dt, d, eps = cfg.torch_dtype, cfg.hidden_size, cfg.rms_norm_eps
        self.layer_id = layer_id
        self.is_mla = cfg.is_mla_layer(layer_id)
        self.self_attn = GatedMLA(cfg) if self.is_mla else KimiDeltaAttention(cfg)
        if cfg.is_moe_layer(layer_id):
            self.block_sparse_moe = LatentMoE(cfg)
        else:
            self.mlp = GatedMLP(cfg, d, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(d, eps, dt)
        self.post_attention_layernorm = RMSNorm(d, eps, dt)
        if cfg.attn_res_block_size is not None:
            self.self_attention_res_norm = RMSNorm(d, eps, dt)
            self.self_attention_res_proj = nn.Linear(d, 1, bias=False, dtype=dt)
            self.mlp_res_norm = RMSNorm(d, eps, dt)
            self.mlp_res_proj = nn.Linear(d, 1, bias=False, dtype=dt)

    def ffn(self, x: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        if hasattr(self, "block_sparse_moe"):
            return self.block_sparse_moe(x, meta.row_len)      # padding rows read no expert
        return self.mlp(x)

    def ffn_terms(self, x: torch.Tensor, meta: StepMeta) -> list[torch.Tensor]:
        """The FFN's output as the terms it sums (a MoE layer: routed and shared experts)."""
        if hasattr(self, "block_sparse_moe"):
            return self.block_sparse_moe(x, meta.row_len, terms=True)
        return [self.mlp(x)]

    def mixer(self, x, caches: Caches, meta: StepMeta, mode: str, rows: int, slot: int):
        if self.is_mla:
            return self.self_attn(x, caches.mla[slot], meta, mode)
        snaps = caches.kda_snapshots[slot] if caches.kda_snapshots is not None else None
        return self.self_attn(x, caches.kda[slot], meta, mode, rows=rows, snapshots=snaps)


class K31Model(nn.Module):
    def __init__(self, cfg: K31Config):
        super().__init__()
        self.config = cfg
        dt, d = cfg.torch_dtype, cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d, dtype=dt)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dt)
        if cfg.attn_res_block_size is not None:
            self.output_attn_res_norm = RMSNorm(d, cfg.rms_norm_eps, dt)
            self.output_attn_res_proj = nn.Linear(d, 1, bias=False, dtype=dt)
        # cache slot of each layer within Caches.mla / Caches.kda
        self.cache_slot = []
        n_mla = n_kda = 0
        for layer in self.layers:
            self.cache_slot.append(n_mla if layer.is_mla else n_kda)
            n_mla, n_kda = n_mla + layer.is_mla, n_kda + (not layer.is_mla)

    def forward(self, input_ids: torch.Tensor, meta: StepMeta, caches: Caches, mode: str,
                rows: int = 1) -> torch.Tensor:
        cfg = self.config
        block = cfg.attn_res_block_size
        p = self.embed_tokens(input_ids)
        if block is None:  # plain pre-norm residual stream (Kimi Linear)
            for i, layer in enumerate(self.layers):
                x = layer.input_layernorm(p)
                p = p + layer.mixer(x, caches, meta, mode, rows, self.cache_slot[i])
                p = p + layer.ffn(layer.post_attention_layernorm(p), meta)
            return self.norm(p)
        # the residual stream is partial + the pending terms: each output is added inside the next
        # mix (attn_res_norm), which also applies the norm after it
        bank: list[torch.Tensor] = []
        partial: torch.Tensor | None = p
        pending: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if bank:
                partial, x = attn_res_norm(partial, pending, bank, layer.self_attention_res_norm,
                                           layer.self_attention_res_proj, layer.input_layernorm)
            else:
                x = layer.input_layernorm(partial)
            if i % block == 0:  # block boundary: snapshot the un-aggregated partial sum, reset
                bank.append(partial)
                partial = None
            a = layer.mixer(x, caches, meta, mode, rows, self.cache_slot[i])
            partial, pending = (a, []) if partial is None else (partial, [a])
            partial, x = attn_res_norm(partial, pending, bank, layer.mlp_res_norm, layer.mlp_res_proj,
                                       layer.post_attention_layernorm)
            pending = layer.ffn_terms(x, meta)
        return attn_res_norm(partial, pending, bank, self.output_attn_res_norm, self.output_attn_res_proj,
                             self.norm)[1]


class K31ForCausalLM(nn.Module):
    """`model.*` + `lm_head`: logits (float32) for every row of a step."""

    def __init__(self, cfg: K31Config):
        super().__init__()
        self.config = cfg
        self.model = K31Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=cfg.torch_dtype)

    def forward(self, input_ids: torch.Tensor, meta: StepMeta, caches: Caches, mode: str = "prefill",
                rows: int = 1) -> torch.Tensor:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "decode" and input_ids.shape[0] % rows:
            raise ValueError(f"decode rows={rows} does not divide the {input_ids.shape[0]} input rows")
        return self.lm_head(self.model(input_ids, meta, caches, mode, rows)).float()

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator) -> None:
        """The random init of spec §9.5 (deterministic for a seeded generator). The values are
        drawn on the generator's device: a CUDA generator initialises a model already on the GPU
        in seconds (other values than a CPU generator's, which checkpoints use)."""
        m = self.model
        embed = torch.empty(m.embed_tokens.weight.shape, device=gen.device).normal_(0, 0.02, generator=gen)
        m.embed_tokens.weight.copy_(embed)
        init_linear(self.lm_head, gen)
        m.norm.reset_parameters(gen)
        for layer in m.layers:
            for child in layer.children():
                if isinstance(child, nn.Linear):   # AttnRes projections: zeros (spec §3.2)
                    nn.init.zeros_(child.weight)
                else:
                    child.reset_parameters(gen)
        if hasattr(m, "output_attn_res_proj"):
            m.output_attn_res_norm.reset_parameters(gen)
            nn.init.zeros_(m.output_attn_res_proj.weight)

