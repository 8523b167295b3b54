"""Config parsing and validation: every bad config is rejected with a message naming the problem,
all problems at once, and nothing is built from a config that failed."""
import json

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
