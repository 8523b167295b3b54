"""Config parsing and validation: every bad config is rejected with a message naming the problem,
all problems at once, and nothing is built from a config that failed."""
import json
import random

import pytest

from k31c.config import PRESETS, ConfigError, K31Config, preset, preset_dict, to_hf_dict


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_parse_and_round_trip(name, tmp_path):
    cfg = preset(name)
    cfg.to_json(tmp_path / "config.json")
    assert K31Config.from_json(tmp_path) == cfg
    assert K31Config.from_dict(to_hf_dict(cfg)) == cfg


def test_layer_schedules():
    k3 = preset("k3.1-pro")
    assert k3.mla_layers == (*range(3, 92, 4), 92) and len(k3.kda_layers) == 69
    assert k3.has_indexer and (k3.index_n_heads, k3.index_head_dim, k3.index_topk) == (32, 128, 2048)
    assert not preset("kimi-k3").has_indexer
    kl = preset("kimi-linear-48b")
    assert kl.gate_lower_bound is None and not kl.use_full_rank_gate and kl.attn_res_block_size is None
    assert kl.q_lora_rank is None and kl.routed_expert_hidden_size is None and not kl.mla_use_output_gate
    tiny = preset("tiny")
    assert tiny.mla_layers == (3, 7) and tiny.kda_layers == (0, 1, 2, 4, 5, 6)


def test_hf_multimodal_wrapper_is_read(tmp_path):
    wrapped = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
               "vision_config": {"hidden_size": 1152}, "text_config": preset_dict("tiny")}
    (tmp_path / "config.json").write_text(json.dumps(wrapped))
    assert K31Config.from_json(tmp_path) == preset("tiny")


def bad(**edits):
    d = preset_dict("tiny")
    for k, v in edits.items():
        if v is KeyError:
            d.pop(k)
        else:
            d[k] = v
    with pytest.raises(ConfigError) as e:
        K31Config.from_dict(d)
    return str(e.value)


@pytest.mark.parametrize("edits, expected", [
    (dict(vocab_size=KeyError), "missing key 'vocab_size'"),
    (dict(index_topk=KeyError), "missing key 'index_topk'"),
    (dict(frobnicate=1), "unknown key 'frobnicate'"),
    (dict(index_rope=True), "index_rope=true"),
    (dict(index_key_norm="rmsnorm"), "index_key_norm='rmsnorm'"),
    (dict(index_dtype="float8_e4m3fn"), "FP8/FP4 indexer weights"),
    (dict(index_weight_dtype="fp8"), "FP8/FP4 indexer weights"),
    (dict(index_share_topk=True), "index_share_topk=true"),
    (dict(index_layers=[4]), "index_layers [4] differ"),
    (dict(index_head_dim=33), "index_head_dim=33"),
    (dict(index_head_dim=192), "index_head_dim=192"),
    (dict(index_topk=0), "index_topk must be a positive integer"),
    (dict(num_experts_per_token=9), "num_experts_per_token=9 > num_experts=8"),
    (dict(num_expert_group=3), "not divisible by num_expert_group=3"),
    (dict(hidden_act="gelu"), "hidden_act must be one of 'situ', 'silu', got 'gelu'"),
    (dict(q_lora_rank=None), "q_lora_rank must be set"),
    (dict(mla_use_nope=False), "mla_use_nope=false"),
])
def test_bad_config_names_the_problem(edits, expected):
    assert expected in bad(**edits)


def test_bad_layer_lists():
    d = preset_dict("tiny")
    d["linear_attn_config"] = d["linear_attn_config"] | {"full_attn_layers": [0, 9]}
    with pytest.raises(ConfigError, match=r"\[0, 9\] outside 1..8"):
        K31Config.from_dict(d)
    d = preset_dict("tiny")
    d["linear_attn_config"] = d["linear_attn_config"] | {"kda_layers": [1, 2, 3]}
    with pytest.raises(ConfigError, match="must partition"):
        K31Config.from_dict(d)
    d = preset_dict("tiny")
    d["linear_attn_config"] = d["linear_attn_config"] | {"head_dim": 24}
    with pytest.raises(ConfigError, match="head_dim=24"):
        K31Config.from_dict(d)


def test_all_problems_reported_at_once():
    msg = bad(vocab_size=KeyError, index_rope=True, index_share_topk=True, frobnicate=1)
    for part in ("missing key 'vocab_size'", "index_rope", "index_share_topk", "frobnicate"):
        assert part in msg


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config file"):
        K31Config.from_json(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        K31Config.from_json(tmp_path)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        preset("huge")


# ---- every value's type, range and finiteness -----------------------------------------------------

def _with(key: str, value, d: dict | None = None):
    """The tiny preset's dict (or a copy of d) with key (dotted: inside linear_attn_config) set."""
    d = dict(d) if d is not None else preset_dict("tiny")
    if key.startswith("linear_attn_config."):
        inner = d.get("linear_attn_config")        # an earlier random edit may have replaced it
        d["linear_attn_config"] = (inner if isinstance(inner, dict) else {}) | {key.split(".", 1)[1]: value}
    else:
        d[key] = value
    return d


@pytest.mark.parametrize("key, value, expected", [
    ("rms_norm_eps", "1e-5", "rms_norm_eps must be a finite positive number, got '1e-5'"),
    ("max_seq_len", "4096", "max_seq_len must be a positive integer"),
    ("max_seq_len", 0, "max_seq_len must be a positive integer"),
    ("routed_scaling_factor", float("inf"), "routed_scaling_factor must be a finite positive number"),
    ("index_key_norm_eps", float("nan"), "index_key_norm_eps must be a finite positive number"),
    ("activation_situ_beta", 0, "activation_situ_beta must be a finite positive number"),
    ("hidden_size", 2**40, "hidden_size must be a positive integer (at most 2147483647)"),
    ("vocab_size", True, "vocab_size must be a positive integer"),
    ("num_experts", 8.0, "num_experts must be a positive integer"),
    ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false"),
    ("dtype", ["float32"], "dtype must be one of"),
    ("index_layers", [4, "8"], "index_layers must be a list of integer layer ids"),
    ("linear_attn_config.gate_lower_bound", "low", "linear_attn_config.gate_lower_bound must be a finite negative"),
    ("linear_attn_config.gate_lower_bound", 5.0, "linear_attn_config.gate_lower_bound must be a finite negative"),
    ("linear_attn_config.full_attn_layers", 4, "linear_attn_config.full_attn_layers must be a list"),
    ("linear_attn_config.full_attn_layers", [4, 8.5], "linear_attn_config.full_attn_layers must be a list"),
    ("linear_attn_config.num_heads", -4, "linear_attn_config.num_heads must be a positive integer"),
    ("max_position_embeddings", "long", "max_position_embeddings must be a positive integer"),
    ("first_k_dense_replace", 9, "first_k_dense_replace=9 > num_hidden_layers=8"),
    ("linear_attn_config", [1], "linear_attn_config must be an object"),
])
def test_values_of_the_wrong_type_or_range_are_named(key, value, expected):
    with pytest.raises(ConfigError) as e:
        K31Config.from_dict(_with(key, value))
    assert expected in str(e.value)


def test_type_problems_reported_together():
    d = _with("rms_norm_eps", "1e-5") | {"max_seq_len": 0, "hidden_act": 3}
    with pytest.raises(ConfigError) as e:
        K31Config.from_dict(d)
    assert sorted(p.split()[0] for p in e.value.problems) == ["hidden_act", "max_seq_len", "rms_norm_eps"]


# What each key the config reads accepts (the oracle of the random test below, written from the
# spec's domains, not from config.py's tables).
_POS_INT = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
            "qk_nope_head_dim", "v_head_dim", "intermediate_size", "kda_chunk_size", "max_seq_len",
            "num_experts_per_token", "num_expert_group", "topk_group", "q_lora_rank",
            "attn_res_block_size", "num_experts", "routed_expert_hidden_size", "index_n_heads",
            "index_head_dim", "index_topk", "max_position_embeddings",
            "linear_attn_config.num_heads", "linear_attn_config.head_dim",
            "linear_attn_config.short_conv_kernel_size"]
_NONNEG_INT = ["qk_rope_head_dim", "first_k_dense_replace", "num_shared_experts", "moe_intermediate_size"]
_POS_FLOAT = ["rms_norm_eps", "activation_situ_beta", "routed_scaling_factor", "index_key_norm_eps",
              "activation_situ_linear_beta"]
_BOOL = ["mla_use_nope", "mla_use_output_gate", "tie_word_embeddings", "latent_moe_use_norm",
         "moe_renormalize", "index_rope", "index_share_topk", "linear_attn_config.use_full_rank_gate"]
_CHOICE = {"hidden_act": {"situ", "silu"}, "moe_router_activation_func": {"sigmoid", "softmax"},
           "dtype": {"float32", "bfloat16", "float16"}, "index_dtype": {"bfloat16", "float32", "float16"},
           "index_weight_dtype": {"bfloat16", "float32", "float16"}, "index_key_norm": {"layernorm"},
           "torch_dtype": {"float32", "bfloat16", "float16"}}
_LAYER_LIST = ["index_layers", "linear_attn_config.full_attn_layers", "linear_attn_config.kda_layers"]


def _acceptable(key: str, v) -> bool:
    is_int = isinstance(v, int) and not isinstance(v, bool)
    if key in _POS_INT:
        return is_int and 1 <= v < 2**31
    if key in _NONNEG_INT:
        return is_int and 0 <= v < 2**31
    if key in _POS_FLOAT:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")
    if key == "linear_attn_config.gate_lower_bound":
        return isinstance(v, (int, float)) and not isinstance(v, bool) and -float("inf") < v < 0
    if key in _BOOL:
        return isinstance(v, bool)
    if key in _CHOICE:
        return isinstance(v, str) and v in _CHOICE[key]
    assert key in _LAYER_LIST, key
    if key == "linear_attn_config.full_attn_layers":   # tiny: 8 layers, at least one MLA layer
        return isinstance(v, list) and v != [] and \
            all(isinstance(i, int) and not isinstance(i, bool) and 1 <= i <= 8 for i in v) and \
            len(set(v)) == len(v)
    return v == ([4, 8] if key == "index_layers" else [1, 2, 3, 5, 6, 7])


def _random_value(rng):
    return rng.choice([
        rng.randint(-2**40, 2**40), rng.randint(-3, 3), 2**31, 2**63, 10**30, rng.uniform(-10, 10),
        float("nan"), float("inf"), -float("inf"), 0.0, 1e-300, True, False, "", "4096", "1e-5",
        "low", "float32", [], [rng.randint(-5, 20)], [1.5], ["a"], {}, {"a": 1}, [[1]],
    ])


def test_random_wrong_values_in_every_key_are_named_config_errors():
    rng = random.Random(0)
    keys = _POS_INT + _NONNEG_INT + _POS_FLOAT + _BOOL + list(_CHOICE) + _LAYER_LIST + \
        ["linear_attn_config.gate_lower_bound"]
    checked = 0
    for key in keys:
        for _ in range(40):
            value = _random_value(rng)
            if _acceptable(key, value):
                continue
            try:
                K31Config.from_dict(_with(key, value))
            except ConfigError as e:
                leaf = key.split(".")[-1]
                assert leaf in str(e), (key, value, str(e))
                checked += 1
                continue
            # accepted: only a value that is wrong in a way with no effect (a dtype name where
            # `dtype` decides, an HF position limit where max_seq_len decides) may be
            assert key in ("torch_dtype", "max_position_embeddings"), (key, value)
    assert checked > 1000


def test_random_values_anywhere_never_raise_anything_but_config_error():
    rng = random.Random(1)
    d0 = preset_dict("tiny")
    keys = [*d0, *(f"linear_attn_config.{k}" for k in d0["linear_attn_config"]), "text_config",
            "architectures", "index_rope", "index_layers", "torch_dtype", "max_position_embeddings"]
    for _ in range(2000):
        d = preset_dict("tiny")
        for key in rng.sample(keys, rng.randint(1, 3)):     # the edits accumulate
            d = _with(key, _random_value(rng), d)
        try:
            K31Config.from_dict(d)
        except ConfigError:
            pass


def test_config_file_that_is_not_text(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        K31Config.from_json(tmp_path)
    (tmp_path / "config.json").write_text("[" * 100000)
    with pytest.raises(ConfigError, match="nested too deeply|not valid JSON"):
        K31Config.from_json(tmp_path)
    (tmp_path / "config.json").write_text('{"rms_norm_eps": NaN}')
    with pytest.raises(ConfigError, match="rms_norm_eps must be a finite positive number, got nan"):
        K31Config.from_json(tmp_path)


def test_config_from_name_or_path_lists_the_presets(tmp_path):
    from k31c.config import config_from_name_or_path
    from k31c.errors import UsageError
    with pytest.raises(UsageError, match="neither a preset \\(tiny, k3.1-pro, bench, kimi-k3, kimi-linear-48b\\)"):
        config_from_name_or_path("nosuch")
    assert config_from_name_or_path("tiny") == preset("tiny")
