"""The pass manager: registry, order, switches, options, results and dumps."""
import sys

import pytest

from pass_helpers import MLALayer, capture_layer, passes, tiny_cfg
from k31c.graph.capture import clone_graph
from k31c.passes import manager
from k31c.errors import CompilerError, UsageError
from k31c.passes.manager import (DEFAULT_PIPELINE, STAGES, PassResult, check_order, register_pass,
                                 registered, resolve, run_pipeline, make_context)


@pytest.fixture(scope="module")
def captured():
    cfg = tiny_cfg()
    return capture_layer(MLALayer(cfg).eval(), cfg)


def test_default_pipeline_is_the_design_order():
    assert DEFAULT_PIPELINE == ("canonicalize", "annotate_layers", "indexer_prolog", "fuse_index_write",
                                "fuse_lightning_indexer", "quantize", "merge_projections", "superkernels",
                                "lower", "verify")
    assert set(DEFAULT_PIPELINE) <= set(registered())
    assert resolve().names == DEFAULT_PIPELINE
    check_order(DEFAULT_PIPELINE)                      # the default order keeps every declaration
    assert resolve(["canonicalize", "verify"]).names == ("canonicalize", "verify")
    assert [STAGES.index(registered()[p].stage) for p in DEFAULT_PIPELINE] == \
        sorted(STAGES.index(registered()[p].stage) for p in DEFAULT_PIPELINE)


def test_an_order_against_stage_or_after_is_an_error():
    with pytest.raises(UsageError, match="'canonicalize' .*cannot run after 'verify'"):
        resolve(["verify", "canonicalize"])
    with pytest.raises(UsageError, match="'fuse_index_write' must run after 'indexer_prolog'"):
        resolve(["fuse_index_write", "indexer_prolog"])
    with pytest.raises(UsageError, match="'indexer_prolog' must run after 'annotate_layers'"):
        resolve(["canonicalize", "indexer_prolog", "annotate_layers"])
    # `after` constrains order only: a pass may run without the ones it follows
    assert resolve(["fuse_index_write"]).names == ("fuse_index_write",)


def test_every_pass_has_enabled_and_disable_switches_passes_off(captured):
    assert all(info.options.get("enabled") is True for info in registered().values())
    pipeline = resolve(disable=["superkernels", "quantize"])
    assert pipeline.names == DEFAULT_PIPELINE                 # nothing else to list
    assert not pipeline.enabled("superkernels") and not pipeline.enabled("quantize")
    assert pipeline.enabled("lower")
    gm, _ = captured
    out, records, _ = passes(gm, disable=["superkernels"])
    by_name = {r.name: r for r in records}
    assert [r.name for r in records] == list(DEFAULT_PIPELINE)
    assert by_name["superkernels"].skipped and by_name["superkernels"].result.notes == ["skipped: disabled"]
    assert not any(r.skipped for n, r in by_name.items() if n != "superkernels")
    assert not any("superkernel" in (n.meta.get("k31c") or {}) for n in out.graph.nodes)
    _, records, _ = passes(gm, options={"superkernels": {"enabled": False}})   # the same, as an option
    assert [r.name for r in records if r.skipped] == ["superkernels"]
    with pytest.raises(UsageError, match="cannot disable unknown passes 'superkernel', 'nope'"):
        resolve(disable=["superkernel", "nope"])
    with pytest.raises(UsageError, match="list of pass names"):
        resolve(disable="lower")


def test_all_pass_modules_are_loaded_and_a_pass_can_be_off_by_default(captured, monkeypatch):
    import k31c.passes as pkg
    from pathlib import Path
    modules = {p.stem for p in Path(pkg.__file__).parent.glob("*.py") if not p.stem.startswith("_")}
    assert {m for m in modules if m not in ("manager", "graph_utils")} >= set(DEFAULT_PIPELINE)
    assert all(f"k31c.passes.{m}" in sys.modules for m in modules)

    @register_pass("test_off_by_default", stage="group", after=("superkernels",), options={"enabled": False})
    def off(gm, ctx):
        """Counts nodes."""
        return PassResult(len(gm.graph.nodes), False, stats={"nodes": len(gm.graph.nodes)})

    after_superkernels = DEFAULT_PIPELINE.index("superkernels") + 1
    monkeypatch.setattr(manager, "DEFAULT_PIPELINE", DEFAULT_PIPELINE[:after_superkernels]
                        + ("test_off_by_default",) + DEFAULT_PIPELINE[after_superkernels:])
    try:
        gm, _ = captured
        _, records, _ = passes(gm)
        assert [r.name for r in records if r.skipped] == ["test_off_by_default"]
        _, records, ctx = passes(gm, options={"test_off_by_default": {"enabled": True}})
        assert not any(r.skipped for r in records)
        assert ctx.stats("test_off_by_default")["nodes"] > 0
    finally:
        manager._REGISTRY.pop("test_off_by_default")


def test_unknown_pass_and_bad_options_are_errors_naming_them():
    with pytest.raises(ValueError, match="unknown pass 'fuse_everything'"):
        resolve(["canonicalize", "fuse_everything"])
    with pytest.raises(ValueError, match="appears twice"):
        resolve(["lower", "lower"])
    with pytest.raises(ValueError, match="pass 'quantize' has no option 'fp4'"):
        resolve(options={"quantize": {"fp4": True}})
    with pytest.raises(ValueError, match="option 'mxfp8_indexer' must be bool"):
        resolve(options={"quantize": {"mxfp8_indexer": "yes"}})
    with pytest.raises(ValueError, match="unknown pass 'nope'"):
        resolve(options={"nope": {}})
    with pytest.raises(ValueError, match="list of pass names"):
        resolve("canonicalize")
    with pytest.raises(UsageError, match="pass 'lower' option 'enabled' must be bool"):
        resolve(options={"lower": {"enabled": 0}})


def test_results_are_recorded_per_pass(captured):
    gm, _ = captured
    _, records, _ = passes(gm)
    assert [r.name for r in records] == list(DEFAULT_PIPELINE)
    by_name = {r.name: r.result for r in records}
    assert all(isinstance(r, PassResult) for r in by_name.values())
    assert by_name["indexer_prolog"].matches == 1 and by_name["indexer_prolog"].changed
    assert by_name["fuse_index_write"].matches == 1
    assert by_name["verify"].changed is False
    assert by_name["fuse_index_write"].stats == {"fused": 1, "left": 0}
    assert by_name["indexer_prolog"].stats["regions"][0]["key"] == 3
    assert by_name["verify"].stats["regions"] == 1
    lower = by_name["lower"].stats
    assert set(lower) == {"kernels", "fallbacks"} and lower["fallbacks"] == {}
    assert sum(lower["kernels"].values()) == by_name["lower"].matches
    _, again, _ = passes(gm, ["fuse_lightning_indexer"])
    assert again[0].result.matches == 1


def test_stop_after_and_unknown_stop(captured):
    gm, _ = captured
    _, records, _ = passes(gm, stop_after="indexer_prolog")
    assert [r.name for r in records] == ["canonicalize", "annotate_layers", "indexer_prolog"]
    with pytest.raises(ValueError, match="unknown pass 'prolog'"):
        passes(gm, stop_after="prolog")
    with pytest.raises(ValueError, match="not in the pipeline"):
        passes(gm, ["canonicalize"], stop_after="verify")


def test_dump_dir_holds_one_before_after_pair_per_pass(captured, tmp_path, monkeypatch):
    gm, _ = captured
    monkeypatch.setenv("K31C_DUMP_DIR", str(tmp_path))
    passes(gm, [p for p in DEFAULT_PIPELINE if p != "superkernels"])
    files = sorted(p.name for p in (tmp_path / "test").iterdir())
    expected = [p for p in DEFAULT_PIPELINE if p != "superkernels"]
    assert files == sorted(f"{i:02d}_{n}.{w}.txt" for i, n in enumerate(expected) for w in ("before", "after"))
    before = (tmp_path / "test" / "02_indexer_prolog.before.txt").read_text()
    after = (tmp_path / "test" / "02_indexer_prolog.after.txt").read_text()
    assert "region_enter" not in before and "region_enter" in after
    assert after.startswith("# k31c graph: test target=cpu after=indexer_prolog")


def test_a_pass_must_return_a_pass_result(captured):
    gm, _ = captured

    @register_pass("test_broken_pass", stage="verify")
    def broken(gm, ctx):
        """Returns the wrong thing."""
        return 3

    try:
        with pytest.raises(CompilerError, match="test_broken_pass"):
            run_pipeline(clone_graph(gm), resolve(["test_broken_pass"]), make_context("cpu"))
    finally:
        manager._REGISTRY.pop("test_broken_pass")


def test_registration_errors():
    with pytest.raises(CompilerError, match="unknown stage 'cleanup'"):
        register_pass("test_bad_stage", stage="cleanup")

    @register_pass("test_after_nothing", stage="verify", after=("canonicalise",))
    def after_nothing(gm, ctx):
        """Follows a pass that does not exist."""
        return PassResult(0, False)

    try:
        with pytest.raises(CompilerError, match=r"'test_after_nothing' runs after \['canonicalise'\]"):
            registered()
    finally:
        manager._REGISTRY.pop("test_after_nothing")
