"""Graph goldens of the tiny model and structural checks beside them.

tests/golden/<step>.<target>.txt holds the k31c ops and stream markers of the whole graph after
the default pipeline, as `k31c inspect --config tiny --step <step> --target <target> --k31c-only`
prints it: what lowering decides per target. tests/golden/<step>.layer<N>.txt holds every op of
one decoder layer of each kind on the CPU (the first KDA layer, the first MLA layer with its
indexer region): `format_graph(gm, layer=N)`. The per-pass detail lives in the lit tests
(tests/passes/test_<pass>_lit.py); the goldens catch any change of the end result.

A golden differs: the test fails with a diff. If the change is intended, review the diff and
rewrite the goldens with `pytest tests/passes/test_goldens.py --update-goldens`."""
import difflib
import re
from pathlib import Path

import pytest
import torch

from k31c.config import preset
from k31c.cli.inspect import inspect_graph, render, shape_model
from k31c.graph.printer import format_graph
from k31c.passes.manager import DEFAULT_PIPELINE
from k31c.passes.graph_utils import INDEX_WRITES, info, stream_of
from k31c.passes.verify import check_streams, check_superkernels

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "golden"
STEPS = ("decode", "prefill")
TARGETS = ("cpu", "h200", "mi350x")
K = torch.ops.k31c


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    return cfg, shape_model(cfg)


@pytest.fixture(scope="module")
def graphs(tiny):
    cfg, model = tiny
    return {(step, target): inspect_graph(cfg, step, target=target, model=model)
            for step in STEPS for target in TARGETS}


def layers_of_each_kind(cfg) -> tuple[int, int]:
    return cfg.kda_layers[0], cfg.mla_layers[0]


def check_golden(path: Path, text: str, what: str, update_goldens: bool) -> None:
    if update_goldens:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    if not path.exists():
        pytest.fail(f"{path} is missing; create it with --update-goldens")
    want = path.read_text()
    if text != want:
        diff = list(difflib.unified_diff(want.splitlines(), text.splitlines(), f"golden/{path.name}",
                                         "current graph", n=2, lineterm=""))
        shown = "\n".join(diff[:120]) + (f"\n... ({len(diff) - 120} more diff lines)" if len(diff) > 120 else "")
        pytest.fail(f"{what} differs from {path}:\n{shown}\n"
                    "if intended, review and run pytest --update-goldens")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("step", STEPS)
def test_golden_k31c_ops(graphs, step, target, update_goldens):
    gm, captured = graphs[(step, target)]
    text = render(gm, captured, "text", f"{step} target={target} after=verify", k31c_only=True)
    check_golden(GOLDEN_DIR / f"{step}.{target}.txt", text, f"the {step} graph's k31c ops for {target}",
                 update_goldens)


@pytest.mark.parametrize("kind", ["kda", "mla"])
@pytest.mark.parametrize("step", STEPS)
def test_golden_layer(tiny, graphs, step, kind, update_goldens):
    cfg, _ = tiny
    layer = dict(zip(("kda", "mla"), layers_of_each_kind(cfg)))[kind]
    gm, captured = graphs[(step, "cpu")]
    text = format_graph(gm, title=f"{step} target=cpu after=verify layer={layer}", dims=captured.dims,
                        layer=layer)
    if kind == "mla":
        assert "k31c.region_enter(" in text and "stream=1" in text and "stream=2" in text
    else:
        assert "k31c.kda_decode(" in text or "k31c.kda_prefill(" in text
    check_golden(GOLDEN_DIR / f"{step}.layer{layer}.txt", text, f"layer {layer} of the {step} graph",
                 update_goldens)


def test_no_stale_goldens(tiny):
    cfg, _ = tiny
    expected = {f"{s}.{t}.txt" for s in STEPS for t in TARGETS} | \
        {f"{s}.layer{n}.txt" for s in STEPS for n in layers_of_each_kind(cfg)}
    assert {p.name for p in GOLDEN_DIR.iterdir()} == expected


def _ops(gm, op):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op]


@pytest.mark.parametrize("step", STEPS)
def test_one_joined_indexer_region_on_three_streams_per_mla_layer(tiny, graphs, step):
    cfg, _ = tiny
    gm, _ = graphs[(step, "cpu")]
    enters = _ops(gm, K.region_enter.default)
    assert sorted(info(n)["layer"] for n in enters) == sorted(cfg.mla_layers)
    for enter in enters:
        region = enter.args[0]
        streams = {stream_of(n) for n in gm.graph.nodes if (n.meta.get("k31c") or {}).get("region") == region}
        assert streams == {0, 1, 2}, f"region {region}: streams {streams}"
        branches = {info(n).get("branch") for n in gm.graph.nodes if info(n).get("region") == region} - {None}
        assert branches == {"query", "key", "weights"}
    assert check_streams(gm) == len(cfg.mla_layers)          # every region exits joined


@pytest.mark.parametrize("step", STEPS)
def test_no_unfused_key_chain_and_no_fusion_across_streams(tiny, graphs, step):
    cfg, _ = tiny
    gm, _ = graphs[(step, "cpu")]
    assert not _ops(gm, K.index_cache_write.default) and not _ops(gm, torch.ops.aten.layer_norm.default)
    fused_writes = _ops(gm, K.index_key_norm_write.default)
    assert len(fused_writes) == len(cfg.mla_layers)
    assert len(_ops(gm, K.lightning_indexer_topk.default)) == len(cfg.mla_layers)
    assert not _ops(gm, K.lightning_indexer.default) and not _ops(gm, K.topk_select.default)
    for write in fused_writes:
        assert write.target in INDEX_WRITES
        assert stream_of(write.args[1]) == stream_of(write) == 1     # norm and write on the key stream
    assert check_superkernels(gm) > 0                                 # raises if one spans two streams


def test_targets_differ_only_in_kernels_and_merged_projections(tiny, graphs):
    """Same graph on every target but for the kernels, and, on the GPU targets (which have a
    linear_group kernel), the projections merge_projections grouped."""
    cfg, model = tiny
    unmerged = [p for p in DEFAULT_PIPELINE if p != "merge_projections"]
    for step in STEPS:
        texts = {t: render(*graphs[(step, t)], "text", step) for t in TARGETS}
        strip = {t: [line.split("  stream=")[0] for line in text.splitlines()] for t, text in texts.items()}
        assert strip["h200"] == strip["mi350x"]
        assert "k31c.linear_group(" not in texts["cpu"] and "k31c.linear_group(" in texts["h200"]
        plain = render(*inspect_graph(cfg, step, target="h200", model=model, passes=unmerged), "text", step)
        assert strip["cpu"] == [line.split("  stream=")[0] for line in plain.splitlines()]
        assert "kernel=noop" in texts["cpu"] and "kernel=stream" in texts["h200"]
