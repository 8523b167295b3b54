"""K31Config: the K3.1 Pro architecture's configuration, read from an HF-style config.json.

Keys follow Kimi K3's `text_config` (spec/model.md §9) plus the indexer keys `index_*`.
Validation collects every problem before raising, so a user fixes a config in one pass.
Presets: `tiny` (CPU tests, §9.5), `k3.1-pro` (full size, §9.1), `bench` (real attention and
KDA widths, few layers), `kimi-k3` (no indexer: dense MLA), `kimi-linear-48b` (§9.2).
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from .errors import InputError


class ConfigError(InputError):
    """A config that cannot describe a K3.1-family model; the message lists every problem."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = problems
        super().__init__(f"invalid {source}:\n" + "\n".join(f"  - {p}" for p in problems))


# HF bookkeeping keys that carry no architecture: accepted and ignored.
_IGNORED_KEYS = {
    "architectures", "auto_map", "model_type", "transformers_version", "torch_dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache",
    "quantization_config", "name_or_path", "_name_or_path", "return_dict", "output_attentions",
    "output_hidden_states", "tokenizer_class", "is_encoder_decoder", "dtype",
    "num_nextn_predict_layers", "topk_method", "use_grouped_topk", "moe_layer_freq",
    "max_position_embeddings", "rope_theta", "rope_scaling",
}
# Keys of the multimodal wrapper (KimiK3ForConditionalGeneration) around `text_config`.
_WRAPPER_KEYS = {"vision_config", "media_placeholder_token_id", "ignore_index", "image_token_index",
                 "projector_hidden_act", "vision_feature_layer", "text_config"}

_REQUIRED = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
             "intermediate_size", "linear_attn_config"]
_INDEX_CORE = ["index_n_heads", "index_head_dim", "index_topk"]
_LINEAR_KEYS = {"num_heads", "head_dim", "short_conv_kernel_size", "gate_lower_bound",
                "use_full_rank_gate", "full_attn_layers", "kda_layers"}


@dataclass(frozen=True)
class K31Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    # KDA (linear_attn_config)
    kda_num_heads: int
    kda_head_dim: int
    full_attn_layers: tuple[int, ...]          # 1-based, as in HF configs
    short_conv_kernel_size: int = 4
    gate_lower_bound: Optional[float] = None   # None: softplus gate (Kimi Linear); K3: -5.0
    use_full_rank_gate: bool = False           # K3: g_proj [P, D]; else g_a/g_b low rank
    kda_chunk_size: int = 64
    # MLA
    q_lora_rank: Optional[int] = None
    mla_use_nope: bool = True
    mla_use_output_gate: bool = False
    # norms / activation / residuals
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: Optional[float] = 25.0
    attn_res_block_size: Optional[int] = None
    tie_word_embeddings: bool = False
    # MoE
    first_k_dense_replace: int = 1
    num_experts: Optional[int] = None
    num_experts_per_token: int = 1
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    routed_expert_hidden_size: Optional[int] = None   # LatentMoE width; None = experts at width D
    latent_moe_use_norm: bool = False
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    num_expert_group: int = 1
    topk_group: int = 1
    # lightning indexer (None = no indexer: dense MLA, i.e. Kimi K3 itself)
    index_n_heads: Optional[int] = None
    index_head_dim: Optional[int] = None
    index_topk: Optional[int] = None
    index_key_norm_eps: float = 1e-6
    index_dtype: str = "bfloat16"
    # runtime defaults
    dtype: str = "bfloat16"
    max_seq_len: int = 1048576

    # ---- derived --------------------------------------------------------------------------
    @property
    def has_indexer(self) -> bool:
        return self.index_n_heads is not None

    @property
    def mla_layers(self) -> tuple[int, ...]:
        """0-based MLA layer ids."""
        return tuple(i - 1 for i in self.full_attn_layers)

    @property
    def kda_layers(self) -> tuple[int, ...]:
        mla = set(self.mla_layers)
        return tuple(i for i in range(self.num_hidden_layers) if i not in mla)

    def is_mla_layer(self, i: int) -> bool:
        return i in self.mla_layers

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts is not None and i >= self.first_k_dense_replace

    @property
    def kda_proj_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached MLA row: [c_kv ‖ k_rope]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def torch_dtype(self):
        import torch
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]

    def replace(self, **changes) -> "K31Config":
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(changes)
        return K31Config.from_dict(to_hf_dict(K31Config(**d)))

    # ---- construction ------------------------------------------------------------------------
    @staticmethod
    def from_dict(raw: dict[str, Any], source: str = "config") -> "K31Config":
        return _parse(raw, source)

    @staticmethod
    def from_json(path: str | Path) -> "K31Config":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError([f"no config file at {path}"], str(path))
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError([f"not valid JSON: {e}"], str(path)) from None
        return _parse(raw, str(path))

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(to_hf_dict(self), indent=2, sort_keys=True) + "\n")


def to_hf_dict(cfg: K31Config) -> dict[str, Any]:
    """The HF-style flat text config that `from_dict` reads back to an equal config."""
    d: dict[str, Any] = {}
    for f in fields(cfg):
        if f.name in ("kda_num_heads", "kda_head_dim", "full_attn_layers", "short_conv_kernel_size",
                      "gate_lower_bound", "use_full_rank_gate"):
            continue
        v = getattr(cfg, f.name)
        if f.name.startswith("index_") and not cfg.has_indexer:
            continue
        d[f.name] = v
    lin = {"num_heads": cfg.kda_num_heads, "head_dim": cfg.kda_head_dim,
           "short_conv_kernel_size": cfg.short_conv_kernel_size,
           "use_full_rank_gate": cfg.use_full_rank_gate,
           "full_attn_layers": list(cfg.full_attn_layers),
           "kda_layers": [i + 1 for i in cfg.kda_layers]}
    if cfg.gate_lower_bound is not None:
        lin["gate_lower_bound"] = cfg.gate_lower_bound
    d["linear_attn_config"] = lin
    if cfg.has_indexer:
        d.update(index_rope=False, index_key_norm="layernorm", index_share_topk=False,
                 index_layers=list(cfg.full_attn_layers))
    return d


def _parse(raw: dict[str, Any], source: str) -> K31Config:
    if not isinstance(raw, dict):
        raise ConfigError([f"expected a JSON object, got {type(raw).__name__}"], source)
    problems: list[str] = []
    raw = copy.deepcopy(raw)
    if "text_config" in raw:  # multimodal wrapper: the language model's config is inside
        outer_unknown = sorted(set(raw) - _WRAPPER_KEYS - _IGNORED_KEYS)
        problems += [f"unknown key '{k}' beside text_config" for k in outer_unknown]
        raw = raw["text_config"]
        if not isinstance(raw, dict):
            raise ConfigError(["text_config is not an object"], source)

    known = {f.name for f in fields(K31Config)} - {"kda_num_heads", "kda_head_dim", "full_attn_layers",
                                                    "short_conv_kernel_size", "gate_lower_bound",
                                                    "use_full_rank_gate"}
    option_keys = {"index_rope", "index_key_norm", "index_share_topk", "index_layers",
                   "index_weight_dtype", "mla_use_nope"}
    for k in sorted(raw):
        if k not in known and k not in _IGNORED_KEYS and k not in option_keys and k != "linear_attn_config":
            problems.append(f"unknown key '{k}'")
    for k in _REQUIRED:
        if raw.get(k) is None:
            problems.append(f"missing key '{k}'")

    lin = raw.get("linear_attn_config") or {}
    if not isinstance(lin, dict):
        problems.append("linear_attn_config must be an object")
        lin = {}
    for k in sorted(set(lin) - _LINEAR_KEYS):
        problems.append(f"unknown key 'linear_attn_config.{k}'")
    for k in ("num_heads", "head_dim", "full_attn_layers"):
        if raw.get("linear_attn_config") is not None and lin.get(k) is None:
            problems.append(f"missing key 'linear_attn_config.{k}'")

    # ---- indexer options: the K3.1 Pro indexer is fixed in shape; name each departure.
    present = [k for k in _INDEX_CORE if raw.get(k) is not None]
    if present and len(present) < len(_INDEX_CORE):
        for k in _INDEX_CORE:
            if raw.get(k) is None:
                problems.append(f"missing key '{k}' (the indexer needs {', '.join(_INDEX_CORE)})")
    if raw.get("index_rope"):
        problems.append("index_rope=true: the K3.1 Pro indexer uses no RoPE (NoPE MLA)")
    norm = raw.get("index_key_norm", "layernorm")
    if norm != "layernorm":
        problems.append(f"index_key_norm='{norm}': the indexer key norm must be 'layernorm'")
    for k in ("index_dtype", "index_weight_dtype"):
        v = raw.get(k)
        if v is not None and ("8" in str(v) or "fp4" in str(v)):
            problems.append(f"{k}='{v}': FP8/FP4 indexer weights are not supported (BF16 or FP32)")
        elif v is not None and v not in ("bfloat16", "float32", "float16"):
            problems.append(f"{k}='{v}' is not a known dtype")
    if raw.get("index_share_topk"):
        problems.append("index_share_topk=true: every MLA layer computes its own top-k; "
                        "a top-k shared across layers is not the K3.1 Pro architecture")
    fal = lin.get("full_attn_layers")
    if raw.get("index_layers") is not None and fal is not None and \
            sorted(raw["index_layers"]) != sorted(fal):
        problems.append(f"index_layers {raw['index_layers']} differ from "
                        f"linear_attn_config.full_attn_layers {fal}: every MLA layer (and only those) is sparse")

    if problems:
        raise ConfigError(problems, source)

    kw: dict[str, Any] = {k: raw[k] for k in known if k in raw and raw[k] is not None}
    kw.pop("index_dtype", None)
    if raw.get("index_dtype") is not None:
        kw["index_dtype"] = raw["index_dtype"]
    if "mla_use_nope" in raw:
        kw["mla_use_nope"] = bool(raw["mla_use_nope"])
    if "q_lora_rank" in raw:
        kw["q_lora_rank"] = raw["q_lora_rank"]
    if "routed_expert_hidden_size" in raw:
        kw["routed_expert_hidden_size"] = raw["routed_expert_hidden_size"]
    if "attn_res_block_size" in raw:
        kw["attn_res_block_size"] = raw["attn_res_block_size"]
    if "activation_situ_linear_beta" in raw:
        kw["activation_situ_linear_beta"] = raw["activation_situ_linear_beta"]
    if raw.get("torch_dtype") in ("float32", "bfloat16", "float16") and "dtype" not in raw:
        kw["dtype"] = raw["torch_dtype"]
    if raw.get("max_position_embeddings") and "max_seq_len" not in raw:
        kw["max_seq_len"] = int(raw["max_position_embeddings"])
    kw.update(kda_num_heads=lin["num_heads"], kda_head_dim=lin["head_dim"],
              full_attn_layers=tuple(int(i) for i in lin["full_attn_layers"]),
              short_conv_kernel_size=lin.get("short_conv_kernel_size", 4),
              gate_lower_bound=lin.get("gate_lower_bound"),
              use_full_rank_gate=bool(lin.get("use_full_rank_gate", False)))
    try:
        cfg = K31Config(**kw)
    except TypeError as e:
        raise ConfigError([str(e)], source) from None
    problems = _check(cfg, lin)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def _check(c: K31Config, lin: dict) -> list[str]:
    """Value checks on a parsed config: shapes that must fit together."""
    p: list[str] = []

    def pos(name, v):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            p.append(f"{name} must be a positive integer, got {v!r}")
            return False
        return True

    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size",
                 "kda_num_heads", "kda_head_dim", "short_conv_kernel_size", "kda_chunk_size"):
        pos(name, getattr(c, name))
    if not isinstance(c.qk_rope_head_dim, int) or c.qk_rope_head_dim < 0:
        p.append(f"qk_rope_head_dim must be a non-negative integer, got {c.qk_rope_head_dim!r}")
    if c.q_lora_rank is not None:
        pos("q_lora_rank", c.q_lora_rank)
    L = c.num_hidden_layers if isinstance(c.num_hidden_layers, int) else 0
    bad = [i for i in c.full_attn_layers if not 1 <= i <= L]
    if bad:
        p.append(f"linear_attn_config.full_attn_layers {bad} outside 1..{L} (the list is 1-based)")
    if len(set(c.full_attn_layers)) != len(c.full_attn_layers):
        p.append("linear_attn_config.full_attn_layers has duplicates")
    if lin.get("kda_layers") is not None and isinstance(lin["kda_layers"], list):
        kda = sorted(int(i) for i in lin["kda_layers"])
        if sorted(set(kda) | set(c.full_attn_layers)) != list(range(1, L + 1)) or \
                set(kda) & set(c.full_attn_layers):
            p.append("linear_attn_config.kda_layers and full_attn_layers must partition layers 1.."
                     f"{L}; got kda_layers={kda}")
    if not c.mla_use_nope:
        p.append("mla_use_nope=false: RoPE MLA is not the K3 architecture (k31c runs NoPE MLA)")
    if c.hidden_act not in ("situ", "silu"):
        p.append(f"hidden_act='{c.hidden_act}' is not 'situ' or 'silu'")
    if c.gate_lower_bound is not None and not c.gate_lower_bound < 0:
        p.append(f"linear_attn_config.gate_lower_bound must be negative, got {c.gate_lower_bound}")
    if c.attn_res_block_size is not None:
        pos("attn_res_block_size", c.attn_res_block_size)
    if c.dtype not in ("float32", "bfloat16", "float16"):
        p.append(f"dtype='{c.dtype}' is not float32, bfloat16 or float16")
    if c.num_experts is not None:
        if pos("num_experts", c.num_experts) and pos("num_experts_per_token", c.num_experts_per_token):
            if c.num_experts_per_token > c.num_experts:
                p.append(f"num_experts_per_token={c.num_experts_per_token} > num_experts={c.num_experts}")
            if pos("num_expert_group", c.num_expert_group) and c.num_experts % c.num_expert_group:
                p.append(f"num_experts={c.num_experts} not divisible by num_expert_group={c.num_expert_group}")
            elif c.topk_group > c.num_expert_group:
                p.append(f"topk_group={c.topk_group} > num_expert_group={c.num_expert_group}")
            elif c.num_expert_group > 1 and \
                    c.num_experts_per_token > c.topk_group * (c.num_experts // c.num_expert_group):
                p.append("num_experts_per_token exceeds the experts in the kept groups")
        pos("moe_intermediate_size", c.moe_intermediate_size)
        if c.moe_router_activation_func not in ("sigmoid", "softmax"):
            p.append(f"moe_router_activation_func='{c.moe_router_activation_func}' unknown")
        if c.routed_expert_hidden_size is not None:
            pos("routed_expert_hidden_size", c.routed_expert_hidden_size)
    if c.has_indexer:
        ok = pos("index_n_heads", c.index_n_heads) & pos("index_head_dim", c.index_head_dim) \
            & pos("index_topk", c.index_topk)
        if ok and c.index_head_dim % 16:
            p.append(f"index_head_dim={c.index_head_dim} must be a multiple of 16 (FP8 key rows)")
        if ok and c.index_head_dim > 128 and c.index_head_dim % 128:
            p.append(f"index_head_dim={c.index_head_dim}: keys above 128 wide must be multiples of 128 "
                     "(one FP8 scale per 128 values)")
        if c.q_lora_rank is None:
            p.append("the indexer reads the MLA query latent: q_lora_rank must be set")
    if c.kda_head_dim and c.kda_head_dim % 16:
        p.append(f"linear_attn_config.head_dim={c.kda_head_dim} must be a multiple of 16")
    if not math.isfinite(c.rms_norm_eps) or c.rms_norm_eps <= 0:
        p.append(f"rms_norm_eps must be positive, got {c.rms_norm_eps}")
    return p


# ---- presets ------------------------------------------------------------------------------

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


def preset(name: str) -> K31Config:
    if name not in PRESETS:
        raise ConfigError([f"unknown preset '{name}'; known: {', '.join(sorted(PRESETS))}"], "preset")
    return K31Config.from_dict(PRESETS[name](), f"preset '{name}'")


def preset_dict(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise ConfigError([f"unknown preset '{name}'; known: {', '.join(sorted(PRESETS))}"], "preset")
    return PRESETS[name]()
