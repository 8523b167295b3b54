"""What a config costs: parameters per part of the model and cache bytes (what `k31c info` prints).

Parameters are counted on the meta device (nothing is allocated) from one decoder layer of each
kind (KDA or MLA, dense or MoE) times the layers of that kind, plus the model's outer parts taken
from a one-layer model of the same widths; building all 93 layers of K3.1 Pro would take a minute.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import K31Config

EMBEDDING = "embedding + lm_head"
OTHER = "MLP / shared / router / norms"


def part_of(name: str, is_mla_layer: bool) -> str:
    """The part of the model a parameter name belongs to (`model.layers.3.self_attn.wq.weight`)."""
    if ".indexer." in name:
        return "indexer"
    if ".experts." in name:
        return "routed experts"
    if ".self_attn." in name:
        return "attention (MLA)" if is_mla_layer else "KDA"
    if "embed_tokens" in name or "lm_head" in name:
        return EMBEDDING
    return OTHER


def _add(groups: dict[str, int], part: str, n: int) -> None:
    groups[part] = groups.get(part, 0) + n


def parameter_groups(cfg: K31Config) -> dict[str, int]:
    """Part name -> number of parameters, largest first."""
    from .model import DecoderLayer, K31ForCausalLM
    groups: dict[str, int] = {}
    kinds: dict[tuple[bool, bool], list[int]] = {}
    for i in range(cfg.num_hidden_layers):
        kinds.setdefault((cfg.is_mla_layer(i), cfg.is_moe_layer(i)), []).append(i)
    with torch.device("meta"):
        for (is_mla, _), layers in kinds.items():
            for name, p in DecoderLayer(cfg, layers[0]).named_parameters():
                _add(groups, part_of(f"model.layers.{layers[0]}.{name}", is_mla), p.numel() * len(layers))
        outer = K31ForCausalLM(cfg.replace(num_hidden_layers=1, full_attn_layers=(1,),
                                           first_k_dense_replace=1))
    for name, p in outer.named_parameters():
        if not name.startswith("model.layers."):
            _add(groups, part_of(name, False), p.numel())
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]))


@dataclass(frozen=True)
class CacheBytes:
    latent_per_token: dict       # CachePool latent_cache format -> bytes a token, all MLA layers
    index_per_token: dict        # index_cache format -> bytes a token (empty without an indexer)
    kda_state_per_request: int   # KDA recurrent state (fp32) + short-conv windows


def cache_bytes(cfg: K31Config) -> CacheBytes:
    """Cache bytes in each of the pool's formats (runtime/kv.py allocates these rows)."""
    from .ops.cache_write import index_row_bytes
    from .ops.fp8_layouts import latent_fp8_row_bytes, mx_row_bytes
    itemsize = torch.empty((), dtype=cfg.torch_dtype).element_size()
    n_mla, n_kda = len(cfg.mla_layers), len(cfg.kda_layers)
    P, K, d = cfg.kda_proj_dim, cfg.kda_head_dim, cfg.index_head_dim
    float_keys = 4 if cfg.torch_dtype == torch.float32 else 2     # the pool's "bf16" keys (fp32 in fp32)
    index = ({"bf16": d * float_keys, "fp8": index_row_bytes(d), "mxfp8": mx_row_bytes(d)}
             if cfg.has_indexer else {})
    return CacheBytes(
        latent_per_token={"model": n_mla * cfg.latent_dim * itemsize,
                          "fp8": n_mla * latent_fp8_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim)},
        index_per_token={k: n_mla * v for k, v in index.items()},
        kda_state_per_request=n_kda * (cfg.kda_num_heads * K * K * 4
                                       + (cfg.short_conv_kernel_size - 1) * 3 * P * itemsize))
