"""Gated NoPE MLA with the lightning indexer (spec/model.md §5, §6), HF K3 parameter names (§9.6).

`GatedMLA.forward(x, cache, meta, mode, attn_form)` takes the input-normed hidden rows x [N, D].
Order inside one step: the latent rows and index keys of all N rows are written first, so every
row sees itself and the earlier rows of its request written in the same step; then the indexer
scores and picks top-k; then attention. Two attention forms compute the same function:
- "absorbed" (the default of every mode, §5.4, §6.3): q̂_h = [W_UK,hᵀ q_n,h ‖ q_r,h] against the
  cached latent rows through k31c::sparse_mla over each row's own top-k selection (dense_mla over
  positions < row_len without an indexer), then o_h = W_UV,h o_lat,h. Prefill rows are ordinary
  rows here: each has its own selection and its own causal limit (row_len), so a prefill costs
  [rows, top-k] attention, not [rows, keys]. A row with row_len <= index_topk selects all its keys,
  so its sparse result is the dense one (spec §6.3);
- "mha" (§5.3, the prefill oracle): per-head keys/values expanded from the request's latent rows,
  plain torch, mask = visible (s < row_len) and selected by the top-k. It materialises
  [rows, heads, pool keys] fp32: tests only (`prefill_form = "mha"` on a layer selects it).
Both use sm_scale = (qk_nope + qk_rope)^-1/2. NoPE: q_r and k_r are used as they are.
Plain-torch parts stay capture-friendly: no .item() / .tolist() here (only inside ops).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import k31c.graph.ops  # noqa: F401  (registers torch.ops.k31c.*)
from k31c.config import K31Config
from k31c.graph.blocks.norms import RMSNorm, init_linear
from k31c.graph.ops.fp8_layouts import dequantize_latent_fp8
from k31c.graph.step import MLALayerCache, StepMeta

ATTN_FORMS = ("absorbed", "mha")
DEFAULT_FORM = {"decode": "absorbed", "verify": "absorbed", "prefill": "absorbed"}


class LightningIndexer(nn.Module):
    """DeepSeek-V3.2 indexer without RoPE (§6.2): top-k positions per row from q_I(c_q) and k(x)."""

    def __init__(self, cfg: K31Config, dtype: torch.dtype, device=None):
        super().__init__()
        if cfg.q_lora_rank is None:
            raise ValueError("cfg: the indexer reads the query latent c_q; q_lora_rank must be set")
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        kw = dict(bias=False, dtype=dtype, device=device)
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, **kw)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, **kw)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=cfg.index_key_norm_eps, dtype=torch.float32,
                                   device=device)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, **kw)

    def forward(self, x: torch.Tensor, c_q: torch.Tensor, index_cache: torch.Tensor,
                meta: StepMeta) -> torch.Tensor:
        # Key branch, deliberately unfused (LayerNorm, then the write): fuse_index_write's pattern.
        keys = self.k_norm(self.wk(x).float())
        torch.ops.k31c.index_cache_write(index_cache, keys, meta.slot_mapping)
        q = self.wq_b(c_q).unflatten(-1, (self.n_heads, self.head_dim))
        weights = self.weights_proj(x).float() * (self.n_heads * self.head_dim) ** -0.5
        scores = torch.ops.k31c.lightning_indexer(q, weights, index_cache, meta.block_table,
                                                  meta.row_req, meta.row_len)
        return torch.ops.k31c.topk_select(scores, meta.row_len, self.topk)

    def reset_parameters(self, gen: torch.Generator) -> None:
        for layer in (self.wq_b, self.wk, self.weights_proj):
            init_linear(layer, gen)
        nn.init.ones_(self.k_norm.weight)
        nn.init.zeros_(self.k_norm.bias)


class GatedMLA(nn.Module):
    """One MLA layer (§5) with its indexer (§6) when cfg.has_indexer; dense attention otherwise."""

    def __init__(self, cfg: K31Config, dtype: Optional[torch.dtype] = None, device=None):
        super().__init__()
        dtype = dtype or cfg.torch_dtype
        self.n_heads = cfg.num_attention_heads
        self.nope_dim, self.rope_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim, self.kv_rank = cfg.v_head_dim, cfg.kv_lora_rank
        self.qk_dim = cfg.qk_head_dim
        self.sm_scale = self.qk_dim ** -0.5
        d, h = cfg.hidden_size, self.n_heads
        kw = dict(bias=False, dtype=dtype, device=device)
        if cfg.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, **kw)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * self.qk_dim, **kw)
        else:
            self.q_proj = nn.Linear(d, h * self.qk_dim, **kw)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_rank + self.rope_dim, **kw)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, cfg.rms_norm_eps, dtype)
        self.kv_b_proj = nn.Linear(self.kv_rank, h * (self.nope_dim + self.v_dim), **kw)
        self.o_proj = nn.Linear(h * self.v_dim, d, **kw)
        self.g_proj = nn.Linear(d, h * self.v_dim, **kw) if cfg.mla_use_output_gate else None
        self.indexer = LightningIndexer(cfg, dtype, device) if cfg.has_indexer else None
        self.prefill_form = DEFAULT_FORM["prefill"]   # set to "mha" for the oracle form in prefill
        if device is not None:
            self.to(device)

    # ---- weights ------------------------------------------------------------------------
    def reset_parameters(self, gen: torch.Generator) -> None:
        for module in self.children():
            if isinstance(module, nn.Linear):
                init_linear(module, gen)
            elif isinstance(module, (RMSNorm, LightningIndexer)):
                module.reset_parameters(gen)

    def _kv_b_split(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [Hq, d_n, r_kv] and W_UV [Hq, d_v, r_kv] from kv_b_proj (per head rows [UK; UV])."""
        w = self.kv_b_proj.weight.unflatten(0, (self.n_heads, self.nope_dim + self.v_dim))
        return w[:, : self.nope_dim], w[:, self.nope_dim:]

    # ---- forward ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, cache: MLALayerCache, meta: StepMeta, mode: str,
                attn_form: Optional[str] = None) -> torch.Tensor:
        if mode not in DEFAULT_FORM:
            raise ValueError(f"mode must be one of {sorted(DEFAULT_FORM)}, got {mode!r}")
        if attn_form is None:
            attn_form = self.prefill_form if mode == "prefill" else DEFAULT_FORM[mode]
        if attn_form not in ATTN_FORMS:
            raise ValueError(f"attn_form must be one of {ATTN_FORMS}, got {attn_form!r}")
        if x.dim() != 2:
            raise ValueError(f"x: expected [N, hidden_size], got {tuple(x.shape)}")

        if hasattr(self, "q_a_proj"):
            c_q = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(c_q)
        else:
            c_q, q = None, self.q_proj(x)
        q = q.unflatten(-1, (self.n_heads, self.qk_dim))
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)

        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope_dim], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), k_rope], dim=-1)
        torch.ops.k31c.mla_cache_write(cache.latent, latent, meta.slot_mapping)

        idx = self.indexer(x, c_q, cache.index, meta) if self.indexer is not None else None

        if attn_form == "absorbed":
            o = self._attend_absorbed(q_nope, q_rope, cache.latent, meta, idx)
        else:
            o = self._attend_mha(q_nope, q_rope, cache.latent, meta, idx)
        o = o.flatten(1)
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def _attend_absorbed(self, q_nope, q_rope, latent_cache, meta, idx) -> torch.Tensor:
        w_uk, w_uv = self._kv_b_split()
        q_hat = torch.cat([torch.einsum("nhd,hdr->nhr", q_nope, w_uk), q_rope], dim=-1)
        if idx is not None:
            o_lat, _ = torch.ops.k31c.sparse_mla(q_hat, latent_cache, meta.block_table, meta.row_req,
                                                 idx, self.sm_scale, self.kv_rank)
        else:
            o_lat, _ = torch.ops.k31c.dense_mla(q_hat, latent_cache, meta.block_table, meta.row_req,
                                                meta.row_len, self.sm_scale, self.kv_rank)
        return torch.einsum("nhr,hvr->nhv", o_lat, w_uv)

    def _attend_mha(self, q_nope, q_rope, latent_cache, meta, idx) -> torch.Tensor:
        """§5.3 as masked dense attention: keys are every cached position of every request in the
        block table (column m = request m // S, position m % S); a row sees the columns of its own
        request that are visible and selected. No gather per row, so one request costs no extra."""
        block_size = latent_cache.shape[1]
        width = meta.block_table.shape[1] * block_size                        # S positions a request
        pos = torch.arange(width, device=q_nope.device)
        blocks = meta.block_table.long()[:, pos // block_size]                # [B, S]
        slots = (blocks.clamp_min(0) * block_size + pos % block_size).flatten()  # -1 blocks: masked
        rows = latent_cache.flatten(0, 1)[slots]
        if rows.dtype == torch.uint8:                                         # FP8 latent layout
            rows = dequantize_latent_fp8(rows, self.kv_rank + self.rope_dim)
        c_kv, k_rope = rows.split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c_kv.to(q_nope.dtype)).unflatten(-1, (self.n_heads, -1))
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)            # [B*S, Hq, *]
        scores = (torch.einsum("nhd,mhd->nhm", q_nope.float(), k_nope.float())
                  + torch.einsum("nhd,md->nhm", q_rope.float(), k_rope.float())) * self.sm_scale

        visible = pos.unsqueeze(0) < meta.row_len.unsqueeze(1)                # [N, S]
        if idx is not None:
            chosen = torch.where(idx >= 0, idx.long(), width)                 # -1 → a dropped column
            selected = torch.zeros(idx.shape[0], width + 1, dtype=torch.bool, device=idx.device)
            visible = visible & selected.scatter(1, chosen, True)[:, :width]
        columns = torch.arange(slots.shape[0], device=q_nope.device)
        own_request = (columns // width).unsqueeze(0) == meta.row_req.long().unsqueeze(1)
        mask = own_request & visible[:, columns % width]                      # [N, B*S]

        probs = torch.softmax(scores.masked_fill(~mask.unsqueeze(1), float("-inf")), dim=-1)
        probs = torch.where(mask.unsqueeze(1), probs, 0.0)                    # a row with no key → 0
        return torch.einsum("nhm,mhv->nhv", probs, v.float()).to(q_nope.dtype)
