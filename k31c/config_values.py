"""The domain of every value a config.json holds: its type, its range, finiteness.

Each check takes the raw JSON value and returns a problem ("must be ...") or None; k31c.config
prefixes the key and collects every problem before raising ConfigError.
"""
from __future__ import annotations

import math

INT_MAX = 2**31 - 1   # sizes, ids and lengths index int32 kernel arguments
DTYPES = ("float32", "bfloat16", "float16")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(lo: int, optional: bool = False):
    def check(v):
        if v is None and optional:
            return None
        if not _is_int(v) or not lo <= v <= INT_MAX:
            what = "a positive integer" if lo == 1 else "a non-negative integer"
            return f"must be {what} (at most {INT_MAX}), got {v!r}"
        return None
    return check


def _float(sign: int, optional: bool = False):
    """A finite number > 0 (sign=1) or < 0 (sign=-1)."""
    def check(v):
        if v is None and optional:
            return None
        if not _is_number(v) or not math.isfinite(v) or not v * sign > 0:
            return f"must be a finite {'positive' if sign > 0 else 'negative'} number, got {v!r}"
        return None
    return check


def _bool(v):
    return None if isinstance(v, bool) else f"must be true or false, got {v!r}"


def _choice(*allowed):
    def check(v):
        if v not in allowed or not isinstance(v, str):
            return f"must be one of {', '.join(repr(a) for a in allowed)}, got {v!r}"
        return None
    return check


def layer_list(v):
    if not isinstance(v, list) or not all(_is_int(i) for i in v):
        return f"must be a list of integer layer ids, got {v!r}"
    return None


def _string(v):
    return None if isinstance(v, str) else f"must be a string, got {v!r}"


# key -> check(value) -> problem or None. Keys absent here are required-missing or defaults.
TOP_CHECKS = {
    **{k: _int(1) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                            "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size",
                            "kda_chunk_size", "max_seq_len", "num_experts_per_token",
                            "num_expert_group", "topk_group", "max_position_embeddings")},
    **{k: _int(0) for k in ("qk_rope_head_dim", "first_k_dense_replace", "num_shared_experts",
                            "moe_intermediate_size")},
    **{k: _int(1, optional=True) for k in ("q_lora_rank", "attn_res_block_size", "num_experts",
                                           "routed_expert_hidden_size", "index_n_heads",
                                           "index_head_dim", "index_topk")},
    **{k: _bool for k in ("mla_use_nope", "mla_use_output_gate", "tie_word_embeddings",
                          "latent_moe_use_norm", "moe_renormalize", "index_rope", "index_share_topk")},
    **{k: _float(1) for k in ("rms_norm_eps", "activation_situ_beta", "routed_scaling_factor",
                              "index_key_norm_eps")},
    "activation_situ_linear_beta": _float(1, optional=True),
    "hidden_act": _choice("situ", "silu"),
    "moe_router_activation_func": _choice("sigmoid", "softmax"),
    "dtype": _choice(*DTYPES),
    "torch_dtype": _string,
    "index_key_norm": _string,
    "index_dtype": _string,
    "index_weight_dtype": _string,
    "index_layers": layer_list,
}
LINEAR_CHECKS = {
    "num_heads": _int(1), "head_dim": _int(1), "short_conv_kernel_size": _int(1),
    "gate_lower_bound": _float(-1, optional=True), "use_full_rank_gate": _bool,
    "full_attn_layers": layer_list, "kda_layers": layer_list,
}
