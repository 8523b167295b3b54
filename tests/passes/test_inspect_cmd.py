"""`k31c inspect`: argument handling and output (the model is captured once for the file)."""
import argparse
import xml.dom.minidom

import pytest

import k31c.cli.inspect as inspect_cli
from k31c.config import preset


@pytest.fixture(scope="module")
def meta_model():
    return inspect_cli.shape_model(preset("tiny"))


@pytest.fixture
def run(meta_model, monkeypatch, capsys):
    monkeypatch.setattr(inspect_cli, "shape_model", lambda cfg: meta_model)

    def call(*argv):
        parser = argparse.ArgumentParser()
        inspect_cli.add(parser.add_subparsers())
        args = parser.parse_args(["inspect", *argv])
        assert args.run(args) == 0
        return capsys.readouterr().out
    return call


def test_text_after_indexer_prolog(run):
    out = run("--config", "tiny", "--step", "decode", "--after", "indexer_prolog")
    assert out.startswith("# k31c graph: decode target=cpu after=indexer_prolog\n")
    assert out.count("k31c.region_enter(") == 2
    assert "k31c.index_cache_write(" in out and "index_key_norm_write" not in out   # not fused yet
    assert "stream=1" in out and "stream=2" in out


def test_k31c_only_and_options(run):
    out = run("--step", "prefill", "--target", "h200", "--k31c-only", "--option", "quantize.mxfp8_indexer=true",
              "--index-cache", "bf16")
    body = out.split("nodes:\n")[1].splitlines()[:-1]
    assert "inputs:" not in out and body and all(" = k31c." in line for line in body)
    # MXFP8 on a bf16 pool is emulated in the graph: it splits the fused write
    assert "kernel=stream" in out and "k31c.index_cache_write(" in out


def test_the_pool_follows_the_quantize_options(run):
    """Without --index-cache the pool is what Engine(compiled) would allocate: MXFP8 keys for
    mxfp8_indexer (the ops quantise, the fused write stays), FP8 keys for index_cache=fp8."""
    out = run("--step", "prefill", "--target", "h200", "--k31c-only", "--option", "quantize.mxfp8_indexer=true")
    assert "index_cache=mxfp8" in out and "k31c.index_cache_write(" not in out
    out = run("--step", "decode", "--option", "quantize.index_cache=fp8")
    assert "index_cache=fp8" in out and "index_cache=bf16" not in out


def test_svg_output_file(run, tmp_path):
    path = tmp_path / "g.svg"
    assert run("--format", "svg", "--layer", "3", "-o", str(path)) == ""
    doc = xml.dom.minidom.parse(str(path))
    assert doc.documentElement.tagName == "svg"


@pytest.mark.parametrize("argv, message", [
    (("--after", "indexer_prolgo"), "unknown pass 'indexer_prolgo'"),
    (("--passes", "canonicalize,nope"), "unknown pass 'nope'"),
    (("--option", "quantize.fp4=true"), "has no option 'fp4'"),
    (("--option", "quantize"), "PASS.OPTION=VALUE"),
    (("--config", "huge"), "neither a preset"),
    (("--target", "tpu"), "unknown target 'tpu'"),
])
def test_errors_name_what_is_wrong(run, argv, message):
    from k31c.errors import UsageError
    with pytest.raises(UsageError, match=message):
        run(*argv)


def test_disable_runs_the_default_pipeline_without_those_passes(run):
    from k31c.passes.manager import DEFAULT_PIPELINE
    fused = run("--step", "decode")
    assert "index_key_norm_write" in fused
    out = run("--step", "decode", "--disable", "fuse_index_write")
    assert "index_key_norm_write" not in out and "k31c.index_cache_write(" in out
    last = [p for p in DEFAULT_PIPELINE if p != "fuse_index_write"][-1]
    assert out.startswith(f"# k31c graph: decode target=cpu after={last}\n")


def test_program_format_lists_the_executor_steps(run):
    out = run("--step", "decode", "--target", "h200", "--format", "program")
    assert out.startswith("program decode target=h200:") and "streams [0, 1, 2]" in out
    lines = out.splitlines()[1:]
    kernels = [ln for ln in lines if " k31c::" in ln]
    assert all("[triton:" in ln for ln in kernels)                          # no reference op
    groups = [ln for ln in kernels if " k31c::linear_group[" in ln]
    assert len(kernels) - len(groups) == 44 and groups      # the projections: merge_projections
    assert sum(" record e" in ln for ln in lines) == 6 and sum(" wait e" in ln for ln in lines) == 8
    assert "%meta.slot_mapping" in out and "@layers.3.self_attn.indexer.wk.weight" in out
    cpu = run("--step", "decode", "--format", "program")
    assert "[reference]" in cpu and "[triton:" not in cpu       # the CPU's kernels are the references
