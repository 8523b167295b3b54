"""K31Config: the K3.1 Pro architecture's configuration, read from an HF-style config.json.

Keys follow Kimi K3's `text_config` (spec/model.md §9) plus the indexer keys `index_*`.
Validation first checks every value's type, range and finiteness (config_values.py), then how the
values fit together; it collects every problem of a stage before raising, so a user fixes a
config in one pass. Presets (their dicts in presets.py): `tiny` (CPU tests, §9.5), `k3.1-pro`
(full size, §9.1), `bench` (real attention and KDA widths, few layers), `kimi-k3` (no indexer:
dense MLA), `kimi-linear-48b` (§9.2).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

from .config_values import DTYPES, LINEAR_CHECKS, TOP_CHECKS, layer_list
from .errors import InputError, UsageError


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
            raw = json.loads(path.read_bytes().decode("utf-8"))
        except OSError as e:
            raise ConfigError([f"cannot read it: {e.strerror}"], str(path)) from None
        except UnicodeDecodeError as e:
            raise ConfigError([f"not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})"],
                              str(path)) from None
        except json.JSONDecodeError as e:
            raise ConfigError([f"not valid JSON: {e}"], str(path)) from None
        except RecursionError:
            raise ConfigError(["JSON nested too deeply"], str(path)) from None
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


# ---- validation: every value's type and range first, then how the values fit together ----------

_FLOAT_FIELDS = {"rms_norm_eps", "activation_situ_beta", "routed_scaling_factor", "index_key_norm_eps",
                 "activation_situ_linear_beta"}
_LINEAR_FIELDS = {"kda_num_heads", "kda_head_dim", "full_attn_layers", "short_conv_kernel_size",
                  "gate_lower_bound", "use_full_rank_gate"}
_OPTION_KEYS = {"index_rope", "index_key_norm", "index_share_topk", "index_layers",
                "index_weight_dtype"}


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
            raise ConfigError([f"text_config must be an object, got {raw!r:.60}"], source)

    known = {f.name for f in fields(K31Config)} - _LINEAR_FIELDS
    for k in sorted(raw):
        if k not in known and k not in _IGNORED_KEYS and k not in _OPTION_KEYS \
                and k != "linear_attn_config":
            problems.append(f"unknown key '{k}'")
    for k in _REQUIRED:
        if raw.get(k) is None:
            problems.append(f"missing key '{k}'")
    for k, check in TOP_CHECKS.items():  # null means "the default" (HF configs write it)
        bad = check(raw[k]) if raw.get(k) is not None else None
        if bad:
            problems.append(f"{k} {bad}")

    lin = raw.get("linear_attn_config")
    if lin is None:
        lin = {}
    elif not isinstance(lin, dict):
        problems.append(f"linear_attn_config must be an object, got {lin!r:.60}")
        lin = {}
    for k in sorted(set(lin) - _LINEAR_KEYS):
        problems.append(f"unknown key 'linear_attn_config.{k}'")
    for k in ("num_heads", "head_dim", "full_attn_layers"):
        if raw.get("linear_attn_config") is not None and lin.get(k) is None:
            problems.append(f"missing key 'linear_attn_config.{k}'")
    for k, check in LINEAR_CHECKS.items():
        if k in lin and (lin[k] is not None or k == "gate_lower_bound"):
            bad = check(lin[k])
            if bad:
                problems.append(f"linear_attn_config.{k} {bad}")

    # ---- indexer options: the K3.1 Pro indexer is fixed in shape; name each departure.
    present = [k for k in _INDEX_CORE if raw.get(k) is not None]
    if present and len(present) < len(_INDEX_CORE):
        for k in _INDEX_CORE:
            if raw.get(k) is None:
                problems.append(f"missing key '{k}' (the indexer needs {', '.join(_INDEX_CORE)})")
    if raw.get("index_rope") is True:
        problems.append("index_rope=true: the K3.1 Pro indexer uses no RoPE (NoPE MLA)")
    norm = raw.get("index_key_norm", "layernorm")
    if isinstance(norm, str) and norm != "layernorm":
        problems.append(f"index_key_norm='{norm}': the indexer key norm must be 'layernorm'")
    for k in ("index_dtype", "index_weight_dtype"):
        v = raw.get(k)
        if not isinstance(v, str):
            continue
        if "8" in v or "fp4" in v:
            problems.append(f"{k}='{v}': FP8/FP4 indexer weights are not supported (BF16 or FP32)")
        elif v not in DTYPES:
            problems.append(f"{k}='{v}' is not a known dtype")
    if raw.get("index_share_topk") is True:
        problems.append("index_share_topk=true: every MLA layer computes its own top-k; "
                        "a top-k shared across layers is not the K3.1 Pro architecture")
    fal, idx = lin.get("full_attn_layers"), raw.get("index_layers")
    if layer_list(idx) is None and layer_list(fal) is None and sorted(idx) != sorted(fal):
        problems.append(f"index_layers {idx} differ from linear_attn_config.full_attn_layers {fal}: "
                        "every MLA layer (and only those) is sparse")
    tdt = raw.get("torch_dtype")
    if isinstance(tdt, str) and tdt not in DTYPES and "dtype" not in raw:
        problems.append(f"torch_dtype='{tdt}' is not {', '.join(DTYPES)} (or give 'dtype')")

    if problems:
        raise ConfigError(problems, source)

    kw: dict[str, Any] = {k: raw[k] for k in known if k in raw and raw[k] is not None}
    for k in ("q_lora_rank", "routed_expert_hidden_size", "attn_res_block_size",
              "activation_situ_linear_beta"):
        if k in raw:  # None is meaningful here: the feature is off
            kw[k] = raw[k]
    for k in _FLOAT_FIELDS & set(kw):
        if kw[k] is not None:
            kw[k] = float(kw[k])
    if raw.get("torch_dtype") in DTYPES and "dtype" not in raw:
        kw["dtype"] = raw["torch_dtype"]
    if raw.get("max_position_embeddings") and "max_seq_len" not in raw:
        kw["max_seq_len"] = raw["max_position_embeddings"]
    glb = lin.get("gate_lower_bound")
    kw.update(kda_num_heads=lin["num_heads"], kda_head_dim=lin["head_dim"],
              full_attn_layers=tuple(lin["full_attn_layers"]),
              short_conv_kernel_size=lin.get("short_conv_kernel_size", 4),
              gate_lower_bound=None if glb is None else float(glb),
              use_full_rank_gate=lin.get("use_full_rank_gate", False))
    cfg = K31Config(**kw)
    problems = _check(cfg, lin)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def _check(c: K31Config, lin: dict) -> list[str]:
    """How the (individually valid) values fit together: layer lists, groups, kernel widths."""
    p: list[str] = []
    L = c.num_hidden_layers
    if not c.full_attn_layers:
        p.append("linear_attn_config.full_attn_layers is empty: a K3.1-family model has MLA layers")
    bad = [i for i in c.full_attn_layers if not 1 <= i <= L]
    if bad:
        p.append(f"linear_attn_config.full_attn_layers {bad} outside 1..{L} (the list is 1-based)")
    if len(set(c.full_attn_layers)) != len(c.full_attn_layers):
        p.append("linear_attn_config.full_attn_layers has duplicates")
    if lin.get("kda_layers") is not None:
        kda = sorted(lin["kda_layers"])
        if sorted(set(kda) | set(c.full_attn_layers)) != list(range(1, L + 1)) or \
                set(kda) & set(c.full_attn_layers) or len(set(kda)) != len(kda):
            p.append("linear_attn_config.kda_layers and full_attn_layers must partition layers 1.."
                     f"{L}; got kda_layers={kda}")
    if not c.mla_use_nope:
        p.append("mla_use_nope=false: RoPE MLA is not the K3 architecture (k31c runs NoPE MLA)")
    if c.first_k_dense_replace > L:
        p.append(f"first_k_dense_replace={c.first_k_dense_replace} > num_hidden_layers={L}")
    if c.num_experts is not None:
        if c.num_experts_per_token > c.num_experts:
            p.append(f"num_experts_per_token={c.num_experts_per_token} > num_experts={c.num_experts}")
        if c.num_experts % c.num_expert_group:
            p.append(f"num_experts={c.num_experts} not divisible by num_expert_group={c.num_expert_group}")
        elif c.topk_group > c.num_expert_group:
            p.append(f"topk_group={c.topk_group} > num_expert_group={c.num_expert_group}")
        elif c.num_expert_group > 1 and \
                c.num_experts_per_token > c.topk_group * (c.num_experts // c.num_expert_group):
            p.append("num_experts_per_token exceeds the experts in the kept groups")
        if c.moe_intermediate_size < 1:
            p.append(f"moe_intermediate_size must be a positive integer with num_experts set, "
                     f"got {c.moe_intermediate_size}")
    if c.has_indexer:
        if c.index_head_dim % 16:
            p.append(f"index_head_dim={c.index_head_dim} must be a multiple of 16 (FP8 key rows)")
        if c.index_head_dim > 128 and c.index_head_dim % 128:
            p.append(f"index_head_dim={c.index_head_dim}: keys above 128 wide must be multiples of 128 "
                     "(one FP8 scale per 128 values)")
        if c.q_lora_rank is None:
            p.append("the indexer reads the MLA query latent: q_lora_rank must be set")
    if c.kda_head_dim % 16:
        p.append(f"linear_attn_config.head_dim={c.kda_head_dim} must be a multiple of 16")
    return p


from .presets import PRESETS  # noqa: E402  (plain data, no import of this module)


def preset(name: str) -> K31Config:
    if name not in PRESETS:
        raise ConfigError([f"unknown preset '{name}'; known: {', '.join(sorted(PRESETS))}"], "preset")
    return K31Config.from_dict(PRESETS[name](), f"preset '{name}'")


def preset_dict(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise ConfigError([f"unknown preset '{name}'; known: {', '.join(sorted(PRESETS))}"], "preset")
    return PRESETS[name]()


def config_from_name_or_path(name_or_path: str | Path) -> K31Config:
    """A preset name (`tiny`, `k3.1-pro`, ...) or a config.json / checkpoint directory: how every
    `--config` is read. Anything else is a UsageError listing the presets."""
    name = str(name_or_path)
    if name in PRESETS:
        return preset(name)
    if not Path(name).exists():
        raise UsageError(f"--config {name!r} is neither a preset ({', '.join(PRESETS)}) nor an "
                         "existing config.json or checkpoint directory")
    return K31Config.from_json(name)
