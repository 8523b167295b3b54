"""Done-when of the compiler core on the tiny model, for the default pipeline and for each pass
that rewrites the graph switched off: a prefill longer than index_topk, then decode steps (one
and two requests), then a verification step give the eager model's logits. The other passes
(annotate_layers, quantize without its option, superkernels, lower, verify) only write metadata
or check, so switching one off cannot change what runs; tests/passes/test_passes.py still runs
every single pass off on one layer. The graphs run op by op (`executor="fx"`) so the pipelines
share one capture per step kind. tests/test_api.py runs the same scenario through Inductor with
the default pipeline. The scenario has 32 decode steps; K31C_TEST_DECODE_STEPS=4 shortens it for
local iteration."""
import os

import pytest

import k31c.api as k31c_api
from tiny_model import close, engine_scenario, make_model

DECODE_STEPS = int(os.environ.get("K31C_TEST_DECODE_STEPS", "32"))


def scenario(model, step_fn):
    """Logits of: prefill (topk + 8 tokens) for one request and (5 tokens) for another, decode
    steps alternating one request and both, then one verification step of 3 rows for both."""
    topk = model.config.index_topk
    return engine_scenario(model, step_fn, [(0, topk + 8), (0, 5)], topk + 8, (0, 1), DECODE_STEPS)


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def reference(model):
    return scenario(model, model)


REWRITES = ("canonicalize", "indexer_prolog", "fuse_index_write", "fuse_lightning_indexer")


@pytest.mark.parametrize("off", (None,) + REWRITES)
def test_logits_match_eager_with_a_rewrite_off(model, reference, off):
    options = {"executor": "fx", **({off: {"enabled": False}} if off else {})}
    compiled = k31c_api.compile(model, "cpu", options=options)
    close(scenario(model, compiled), reference)
    assert compiled.compilations == {"prefill": 1, "decode": 1, "verify3": 1}
    skipped = {rec.name for step in compiled.report.steps.values() for rec in step.passes if rec.skipped}
    assert skipped == ({off} if off else set())
