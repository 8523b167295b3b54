"""Checkpoints: save/load round trip, accepted layouts, strict validation (the writes and their
failures: test_checkpoint_writes.py)."""
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import k31c.checkpoint as ckpt_mod
from k31c.checkpoint import CheckpointError, load_checkpoint, read_tensor_headers
from k31c.checkpoint_save import save_checkpoint
from k31c.config import ConfigError, preset
from k31c.graph.model import K31ForCausalLM
from k31c.runtime.engine import Engine

from checkpoint_helpers import assert_same_weights, model, random_model, saved  # noqa: F401 (fixtures)


def _logits(model, tokens):
    return Engine(model, max_requests=1, max_seq_len=len(tokens)).prefill_logits(tokens)


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _write_raw(directory: Path, cfg, tensors: dict) -> Path:
    """A checkpoint written by hand, bypassing save_checkpoint (to make bad ones)."""
    directory.mkdir(parents=True, exist_ok=True)
    cfg.to_json(directory / "config.json")
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(directory / "model.safetensors"))
    return directory


# ---- round trips ---------------------------------------------------------------------------------

def test_round_trip_gives_the_same_logits(model, saved):
    assert sorted(p.name for p in saved.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_checkpoint(saved)
    assert loaded.config == model.config
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    assert_same_weights(model, loaded)
    tokens = _tokens(0, 40)
    assert torch.equal(_logits(model, tokens), _logits(loaded, tokens))


def test_stored_names_are_the_model_names(model, saved):
    stored = read_tensor_headers(saved)
    expected = model.state_dict()
    assert set(stored) == set(expected)
    assert "model.layers.3.self_attn.indexer.wq_b.weight" in stored
    for n, t in expected.items():
        assert stored[n].shape == list(t.shape) and stored[n].torch_dtype == t.dtype


def test_load_converts_dtype_after_validation(model, saved):
    loaded = load_checkpoint(saved, dtype=torch.bfloat16)
    assert loaded.config.dtype == "bfloat16"
    with torch.device("meta"):
        want = K31ForCausalLM(preset("tiny").replace(dtype="bfloat16")).state_dict()
    got, orig = loaded.state_dict(), model.state_dict()
    assert {t.dtype for t in got.values()} >= {torch.bfloat16}
    for n, t in got.items():
        assert t.dtype == want[n].dtype, n
        assert torch.equal(t, orig[n].to(t.dtype)), n


def test_bfloat16_round_trip_keeps_the_float32_tensors(tmp_path):
    model = random_model(seed=4, dtype="bfloat16")
    dtypes = {t.dtype for t in model.state_dict().values()}
    assert dtypes == {torch.bfloat16, torch.float32}  # A_log, dt_bias, ... stay float32
    assert_same_weights(model, load_checkpoint(save_checkpoint(model, tmp_path / "bf16")))


def test_language_model_prefix_and_vision_tensors_accepted(model, tmp_path):
    tensors = {f"language_model.{n}": t for n, t in model.state_dict().items()}
    tensors["vision_tower.patch_embed.weight"] = torch.randn(4, 3)
    loaded = load_checkpoint(_write_raw(tmp_path / "k3", model.config, tensors))
    assert_same_weights(model, loaded)


def test_sharded_checkpoint_round_trip(model, tmp_path):
    out = save_checkpoint(model, tmp_path / "sharded", shard_max_bytes=2 * 2**20)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == shards
    assert set(index["weight_map"]) == set(model.state_dict())
    sizes = {s: sum(t.numel() * t.element_size() for t in load_file(str(out / s)).values()) for s in shards}
    big = max(t.numel() * t.element_size() for t in model.state_dict().values())
    assert all(size <= max(2 * 2**20, big) for size in sizes.values())
    assert index["metadata"]["total_size"] == sum(sizes.values())
    assert_same_weights(model, load_checkpoint(out))


# ---- strict validation -----------------------------------------------------------------------------

def test_every_tensor_problem_listed_in_one_error(model, tmp_path):
    sd = dict(model.state_dict())
    del sd["model.layers.3.self_attn.indexer.wk.weight"]                     # missing
    sd["model.layers.1.self_attn.bogus.weight"] = torch.randn(2, 2)           # unexpected
    sd["model.layers.2.mlp_res_proj.weight"] = torch.randn(2, 256)            # wrong shape
    sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.bfloat16)      # wrong dtype
    d = _write_raw(tmp_path / "bad", model.config, sd)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(d)
    msg = str(e.value)
    assert str(d) in msg and len(e.value.problems) == 4
    assert "missing tensor 'model.layers.3.self_attn.indexer.wk.weight'" in msg
    assert "unexpected tensor 'model.layers.1.self_attn.bogus.weight' in model.safetensors" in msg
    assert "'model.layers.2.mlp_res_proj.weight' in model.safetensors: shape [2, 256], expected [1, 256]" in msg
    assert "'model.norm.weight' in model.safetensors: dtype bfloat16, expected float32" in msg


def test_per_expert_tensors_fill_the_stacked_experts(model, tmp_path):
    """HF stores routed experts one by one; the model stacks them (w13 = [w1; w3], w2) on load,
    and a missing or misshapen expert tensor is named as stored."""
    sd = dict(model.state_dict())
    loaded = load_checkpoint(_write_raw(tmp_path / "ok", model.config, sd))
    moe = loaded.model.layers[2].block_sparse_moe.experts
    inter = model.config.moe_intermediate_size
    prefix = "model.layers.2.block_sparse_moe.experts.5."
    assert torch.equal(moe.w13[5, :inter], sd[prefix + "w1.weight"])
    assert torch.equal(moe.w13[5, inter:], sd[prefix + "w3.weight"])
    assert torch.equal(moe.w2[5], sd[prefix + "w2.weight"])
    del sd[prefix + "w3.weight"]
    sd[prefix + "w2.weight"] = sd[prefix + "w2.weight"][:, :7]
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(_write_raw(tmp_path / "bad", model.config, sd))
    assert f"missing tensor '{prefix}w3.weight'" in str(e.value)
    assert f"'{prefix}w2.weight' in model.safetensors: shape [128, 7], expected [128, {inter}]" in str(e.value)


def test_nothing_is_read_when_validation_fails(model, tmp_path, monkeypatch):
    sd = {n: t for n, t in model.state_dict().items() if n != "lm_head.weight"}
    d = _write_raw(tmp_path / "bad", model.config, sd)
    opened = []
    real = ckpt_mod.safe_open
    monkeypatch.setattr(ckpt_mod, "safe_open", lambda *a, **k: opened.append(a) or real(*a, **k))
    with pytest.raises(CheckpointError, match="missing tensor 'lm_head.weight'"):
        load_checkpoint(d)
    assert len(opened) == 1  # the header pass only; the data pass never started


def test_long_problem_lists_are_cut_with_a_count(model, tmp_path):
    sd = {n: t for n, t in model.state_dict().items() if not n.startswith("model.layers.")}
    n_missing = len(model.state_dict()) - len(sd)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(_write_raw(tmp_path / "bad", model.config, sd))
    assert len(e.value.problems) == ckpt_mod.MAX_LISTED + 1
    assert f"... and {n_missing - ckpt_mod.MAX_LISTED} more missing tensors" in str(e.value)


def test_mixed_prefix_is_unexpected(model, tmp_path):
    sd = {f"language_model.{n}": t for n, t in model.state_dict().items()}
    sd["model.norm.weight"] = model.state_dict()["model.norm.weight"].clone()
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.norm.weight'"):
        load_checkpoint(_write_raw(tmp_path / "bad", model.config, sd))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_weights_file_named(saved, tmp_path, damage):
    d = tmp_path / "corrupt"
    d.mkdir()
    (d / "config.json").write_bytes((saved / "config.json").read_bytes())
    data = (saved / "model.safetensors").read_bytes()
    data = {"truncate": data[: len(data) // 2], "garbage": os.urandom(4096), "empty": b""}[damage]
    (d / "model.safetensors").write_bytes(data)
    with pytest.raises(CheckpointError, match="model.safetensors") as e:
        load_checkpoint(d)
    assert str(d / "model.safetensors") in str(e.value)


def test_missing_paths_named(saved, tmp_path):
    with pytest.raises(CheckpointError, match="no such directory") as e:
        load_checkpoint(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path / "empty")
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_bytes((saved / "config.json").read_bytes())
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        load_checkpoint(tmp_path / "noweights")


def test_bad_index_named(model, tmp_path):
    out = save_checkpoint(model, tmp_path / "sharded", shard_max_bytes=4 * 2**20)
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00009.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="names shard 'model-00001-of-00009.safetensors'"):
        load_checkpoint(out)
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["model.norm.weight"] = first
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"maps 'model.norm.weight' to {first}, which has no such"):
        load_checkpoint(out)
    index_path.write_text("{not json")
    with pytest.raises(CheckpointError, match="not a JSON object"):
        load_checkpoint(out)


def test_invalid_config_raises_config_error(saved, tmp_path):
    d = tmp_path / "badcfg"
    d.mkdir()
    cfg = json.loads((saved / "config.json").read_text())
    cfg["index_rope"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").symlink_to(saved / "model.safetensors")
    with pytest.raises(ConfigError, match="index_rope"):
        load_checkpoint(d)
