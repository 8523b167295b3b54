"""Parameter counts of a K3.1 model from its config alone (nothing is built, not even on `meta`).

The groups are the ones `k31c info` prints: the indexer, the routed experts, MLA attention (the
indexer excluded), KDA, embedding + lm_head, and the rest (dense MLPs, shared experts, routers,
the latent MoE projections, norms, AttnRes). Each term mirrors a block's `__init__` in
graph/blocks/ and graph/model.py; tests check the sum against the built model.
"""
from __future__ import annotations

from ..config import K31Config

GROUPS = ("indexer", "routed experts", "attention (MLA)", "KDA", "embedding + lm_head",
          "MLP / shared / router / norms")


def _kda(cfg: K31Config) -> int:
    H, K, W, D = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size, cfg.hidden_size
    P = H * K
    gate = D * P if cfg.use_full_rank_gate else D * K + K * P
    return (3 * D * P            # q, k, v projections
            + 3 * P * W          # depthwise convs
            + D * K + K * P      # f_a, f_b
            + D * H              # b_proj
            + gate
            + P + H              # dt_bias, A_log
            + K                  # o_norm
            + P * D)             # o_proj


def _mla(cfg: K31Config) -> int:
    d, h = cfg.hidden_size, cfg.num_attention_heads
    qk, v, rank = cfg.qk_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank is not None:
        q = d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * qk
    else:
        q = d * h * qk
    return (q + d * (rank + cfg.qk_rope_head_dim) + rank + rank * h * (cfg.qk_nope_head_dim + v)
            + h * v * d + (d * h * v if cfg.mla_use_output_gate else 0))


def _indexer(cfg: K31Config) -> int:
    if not cfg.has_indexer:
        return 0
    heads, dim, d = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size
    return cfg.q_lora_rank * heads * dim + d * dim + 2 * dim + d * heads


def _moe(cfg: K31Config) -> tuple[int, int]:
    """(routed experts, the rest of one MoE layer: router, shared experts, latent projections)."""
    d, inter = cfg.hidden_size, cfg.moe_intermediate_size
    latent = cfg.routed_expert_hidden_size
    width = latent or d
    experts = cfg.num_experts * 3 * width * inter
    rest = cfg.num_experts * d + cfg.num_experts                      # router weight + bias
    if cfg.num_shared_experts:
        rest += 3 * d * inter * cfg.num_shared_experts
    if latent is not None:
        rest += 2 * d * latent + (latent if cfg.latent_moe_use_norm else 0)
    return experts, rest


def count_parameters(cfg: K31Config) -> dict[str, int]:
    """Parameters per group (GROUPS, in that order) of `K31ForCausalLM(cfg)`."""
    d = cfg.hidden_size
    out = dict.fromkeys(GROUPS, 0)
    res = 2 * (d + d) if cfg.attn_res_block_size is not None else 0   # per layer: 2 x (norm + proj)
    for i in range(cfg.num_hidden_layers):
        if cfg.is_mla_layer(i):
            out["attention (MLA)"] += _mla(cfg)
            out["indexer"] += _indexer(cfg)
        else:
            out["KDA"] += _kda(cfg)
        if cfg.is_moe_layer(i):
            experts, rest = _moe(cfg)
            out["routed experts"] += experts
            out["MLP / shared / router / norms"] += rest
        else:
            out["MLP / shared / router / norms"] += 3 * d * cfg.intermediate_size
        out["MLP / shared / router / norms"] += 2 * d + res             # the layer's two RMSNorms
    out["MLP / shared / router / norms"] += d + (2 * d if cfg.attn_res_block_size is not None else 0)
    out["embedding + lm_head"] = 2 * cfg.vocab_size * d
    return out
