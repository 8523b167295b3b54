"""The preset configs, as the HF-style dicts `K31Config.from_dict` reads (spec/model.md §9).

`tiny` (CPU tests, §9.5), `k3.1-pro` (full size, §9.1), `bench` (real attention and KDA widths,
few layers), `kimi-k3` (no indexer: dense MLA), `kimi-linear-48b` (§9.2). Plain data: `k31c.config`
parses them (`preset(name)`).
"""
from __future__ import annotations

from typing import Any

def _k3_text_config() -> dict[str, Any]:
    return {
        "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 93, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0, "attn_res_block_size": 12,
        "linear_attn_config": {"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                               "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                               "full_attn_layers": [*range(4, 93, 4), 93]},
        "num_attention_heads": 96, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
        "mla_use_output_gate": True, "first_k_dense_replace": 1, "intermediate_size": 33792,
        "moe_layer_freq": 1, "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
        "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 1.0,
        "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "use_grouped_topk": True,
        "num_nextn_predict_layers": 0, "max_position_embeddings": 1048576,
    }


_INDEXER_K31 = {"index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048, "index_rope": False,
                "index_key_norm": "layernorm", "index_dtype": "bfloat16"}


def _tiny() -> dict[str, Any]:
    return {
        "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 8, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0, "attn_res_block_size": 3,
        "linear_attn_config": {"num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4,
                               "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                               "full_attn_layers": [4, 8]},
        "num_attention_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16, "v_head_dim": 32, "mla_use_nope": True, "mla_use_output_gate": True,
        "index_n_heads": 4, "index_head_dim": 32, "index_topk": 16, "first_k_dense_replace": 1,
        "intermediate_size": 512, "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
        "moe_intermediate_size": 64, "routed_expert_hidden_size": 128, "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 1.0,
        "num_expert_group": 1, "topk_group": 1, "kda_chunk_size": 16, "dtype": "float32",
        "max_seq_len": 4096,
    }


def _kimi_linear_48b() -> dict[str, Any]:
    return {
        "vocab_size": 163840, "hidden_size": 2304, "num_hidden_layers": 27, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "hidden_act": "silu",
        "linear_attn_config": {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
                               "full_attn_layers": [4, 8, 12, 16, 20, 24, 27]},
        "num_attention_heads": 32, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True, "first_k_dense_replace": 1,
        "intermediate_size": 9216, "num_experts": 256, "num_experts_per_token": 8,
        "num_shared_experts": 1, "moe_intermediate_size": 1024, "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True, "routed_scaling_factor": 2.446, "num_expert_group": 1, "topk_group": 1,
        "max_position_embeddings": 1048576,
    }


def _bench() -> dict[str, Any]:
    # Real attention / KDA / indexer widths (what the kernels see), 4 layers (3 KDA + 1 MLA),
    # few small experts so a layer fits a benchmark without the 1T parameters of the MoE.
    d = _k3_text_config() | _INDEXER_K31
    d.update(num_hidden_layers=4, attn_res_block_size=2, vocab_size=4096,
             linear_attn_config=d["linear_attn_config"] | {"full_attn_layers": [4]},
             intermediate_size=4096, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
             moe_intermediate_size=512)
    return d


PRESETS = {
    "tiny": _tiny,
    "k3.1-pro": lambda: _k3_text_config() | _INDEXER_K31,
    "bench": _bench,
    "kimi-k3": _k3_text_config,
    "kimi-linear-48b": _kimi_linear_48b,
}
