"""The pass manager: registry, order, switches, options, results and dumps."""
import pytest

from pass_helpers import MLALayer, capture_layer, passes, tiny_cfg
from k31c.graph.capture import clone_graph
from k31c.passes import manager
from k31c.passes.manager import (DEFAULT_PIPELINE, PassResult, register_pass, registered, resolve,
                                 run_pipeline, make_context)


@pytest.fixture(scope="module")
def captured():
    cfg = tiny_cfg()
    return capture_layer(MLALayer(cfg).eval(), cfg)


def test_default_pipeline_is_the_design_order():
    assert DEFAULT_PIPELINE == ("canonicalize", "annotate_layers", "indexer_prolog", "fuse_index_write",
                                "fuse_lightning_indexer", "quantize", "superkernels", "lower", "verify")
    assert set(DEFAULT_PIPELINE) <= set(registered())
    assert resolve().names == DEFAULT_PIPELINE
    assert resolve(["verify", "canonicalize"]).names == ("verify", "canonicalize")


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


def test_results_are_recorded_per_pass(captured):
    gm, _ = captured
    _, records, _ = passes(gm)
    assert [r.name for r in records] == list(DEFAULT_PIPELINE)
    by_name = {r.name: r.result for r in records}
    assert all(isinstance(r, PassResult) for r in by_name.values())
    assert by_name["indexer_prolog"].matches == 1 and by_name["indexer_prolog"].changed
    assert by_name["fuse_index_write"].matches == 1
    assert by_name["verify"].changed is False
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

    @register_pass("test_broken_pass")
    def broken(gm, ctx):
        """Returns the wrong thing."""
        return 3

    try:
        with pytest.raises(TypeError, match="test_broken_pass"):
            run_pipeline(clone_graph(gm), resolve(["test_broken_pass"]), make_context("cpu"))
    finally:
        manager._REGISTRY.pop("test_broken_pass")
