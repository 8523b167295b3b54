"""`k31c inspect`, `bench` and `build-kernels`: flags that would be ignored are refused, bad values
are named, and a kernel build replaces its output directory whole. In-process calls (no kernel
is compiled: TRITON_INTERPRET is on here; write_outputs gets made-up kernels)."""
import json
import os
import re

import pytest

import k31c.cli.inspect as inspect_cli
from k31c.cli import main
from k31c.config import preset
from k31c.errors import UsageError
from k31c.lowering import aot, aot_dir


@pytest.fixture(scope="module")
def meta_model():
    return inspect_cli.shape_model(preset("tiny"))


@pytest.fixture
def quick_model(meta_model, monkeypatch):
    """One tiny meta-device model for every inspect run of this file (its capture is reused)."""
    monkeypatch.setattr(inspect_cli, "shape_model", lambda cfg: meta_model)


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("k31c: error: ") and "Traceback" not in err and err.count("\n") == 1, err
    return err


# ---- inspect -------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--format", "svg", "--layer", "999", "-o", "{tmp}/g.svg"], "--layer 999: the model has 8 decoder layers, 0 to 7"),
    (["--format", "svg", "--layer", "-3", "-o", "{tmp}/g.svg"], "--layer -3: the model has 8 decoder layers, 0 to 7"),
    (["--passes", ","], "--passes ',' names no pass"),
    (["--passes", ""], "--passes '' names no pass"),
    (["--disable", ","], "--disable ',' names no pass"),
    (["--step", "decode", "--rows", "3"], "--rows applies to --step verify only, not --step decode"),
    (["--step", "prefill", "--rows", "2"], "--rows applies to --step verify only, not --step prefill"),
    (["--format", "program", "--layer", "1"], "--layer applies to --format text or svg, not --format program"),
    (["--format", "svg", "--k31c-only", "-o", "{tmp}/g.svg"], "--k31c-only applies to --format text only, not --format svg"),
    (["--format", "program", "--k31c-only"], "--k31c-only applies to --format text only, not --format program"),
    (["--option", "buckets.x=1"], "'buckets' is not a pass; passes: canonicalize"),
])
def test_inspect_refuses_what_it_would_ignore(capsys, tmp_path, monkeypatch, argv, message):
    def built(*a, **k):
        raise AssertionError("the graph was built before the arguments were checked")
    monkeypatch.setattr(inspect_cli, "_compile", built)
    err = _error(capsys, ["inspect", *[a.replace("{tmp}", str(tmp_path)) for a in argv]])
    assert message in err
    assert not os.listdir(tmp_path)


def test_inspect_layer_of_a_graph_without_layers(capsys, quick_model):
    err = _error(capsys, ["inspect", "--after", "canonicalize", "--layer", "2"])
    assert "--layer 2: no op of this graph is in layer 2" in err


def test_inspect_text_layer_takes_effect(capsys, quick_model):
    assert main(["inspect", "--layer", "2"]) == 0
    body = capsys.readouterr().out.split("nodes:\n")[1].splitlines()[:-1]
    assert body and all(re.search(r"\blayer=2[,}]", line) for line in body)


def test_inspect_latent_cache_option_gets_its_pool(capsys, quick_model):
    # the pool is allocated as Engine(compiled) would: not an error telling a CLI user to call CachePool
    assert main(["inspect", "--option", "quantize.latent_cache=fp8"]) == 0
    assert "fp8" in capsys.readouterr().out


def test_svg_of_an_empty_layer_is_a_usage_error():
    import torch
    from k31c.graph.svg import draw_svg
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    with pytest.raises(UsageError, match="no ops to draw in layer 5"):
        draw_svg(gm, layer=5)


# ---- bench ---------------------------------------------------------------------------------------

def test_bench_without_a_suite_names_the_suites(capsys):
    err = _error(capsys, ["bench"])
    assert "kernels" in err and "e2e" in err and "rest" not in err


# ---- build-kernels -------------------------------------------------------------------------------

def test_build_checks_out_and_only_before_compiling(capsys, tmp_path, monkeypatch):
    def compiled(*a, **k):
        raise AssertionError("kernels were collected before the arguments were checked")
    monkeypatch.setattr(aot, "collect_specs", compiled)
    afile = tmp_path / "afile"
    afile.write_text("mine")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    base = ["build-kernels", "--target", "h200", "--only", "cache_write", "--out"]
    err = _error(capsys, [*base, str(afile)])                    # one line, exit 2, no traceback
    assert f"--out {afile} exists and is not a directory" in err and "Traceback" not in err
    assert f"--out {tmp_path}/notes is not empty and not an earlier h200 build (no manifest.json)" \
        in _error(capsys, [*base, str(tmp_path / "notes")])
    assert "--only '' names no kernel family" in _error(
        capsys, ["build-kernels", "--target", "h200", "--only", "", "--out", str(tmp_path / "new")])
    assert afile.read_text() == "mine" and os.listdir(tmp_path / "notes") == ["todo.txt"]
    assert sorted(os.listdir(tmp_path)) == ["afile", "notes"]


def _kernel(name: str) -> aot.BuiltKernel:
    return aot.BuiltKernel(name=f"{name}/_k[v]", kernel="_k", ops=("k31c::x",), target="h200",
                           arch="sm_90a", asm_target="sm_90a", binary_kind="cubin", size=3, sha256="",
                           num_warps=4, num_stages=1, shared=0, n_regs=None, scratch_bytes=None,
                           compile_s=0.0, binary=name.encode())


def test_a_rebuild_replaces_the_whole_directory(tmp_path):
    out = tmp_path / "kernels"
    aot_dir.write_outputs([_kernel("a"), _kernel("b"), _kernel("c")], out, "h200")
    aot_dir.write_outputs([_kernel("b")], out, "h200", families=["b"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(os.listdir(out)) == ["b._k_v.cubin", "manifest.json"]      # no unlisted binary
    assert [k["file"] for k in manifest["kernels"]] == ["b._k_v.cubin"] and manifest["families"] == ["b"]
    assert os.listdir(tmp_path) == ["kernels"]                               # no temporaries
    with pytest.raises(UsageError, match="not an earlier mi350x build .*for target 'h200'"):
        aot_dir.write_outputs([_kernel("b")], out, "mi350x")


def test_an_interrupted_rebuild_leaves_the_earlier_build(tmp_path, monkeypatch):
    out = tmp_path / "kernels"
    aot_dir.write_outputs([_kernel("a"), _kernel("b")], out, "h200")
    before = {p: (out / p).read_bytes() for p in os.listdir(out)}

    def interrupted():      # Ctrl-C after the binaries, before the manifest
        raise KeyboardInterrupt
    monkeypatch.setattr(aot_dir, "_triton_version", interrupted)
    with pytest.raises(KeyboardInterrupt):
        aot_dir.write_outputs([_kernel("c")], out, "h200")
    assert {p: (out / p).read_bytes() for p in os.listdir(out)} == before
    assert os.listdir(tmp_path) == ["kernels"]
