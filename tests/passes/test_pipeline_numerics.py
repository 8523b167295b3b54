"""Done-when of the compiler core on the tiny model, for every pipeline with one pass switched
off: a prefill longer than index_topk, then decode steps (one and two requests), then a
verification step give the eager model's logits. The graphs run op by op (`executor="fx"`) so
the ten pipelines share one capture per step kind. tests/test_api.py runs the same scenario
through Inductor with the default pipeline. The issue's scenario has 32 decode steps (about 70 s
for the ten pipelines on two cores); K31C_TEST_DECODE_STEPS=4 shortens it for local iteration."""
import os

import pytest

import k31c.api as k31c_api
from k31c.passes.manager import DEFAULT_PIPELINE
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


@pytest.mark.parametrize("off", (None,) + DEFAULT_PIPELINE)
def test_logits_match_eager_with_any_single_pass_off(model, reference, off):
    passes = [p for p in DEFAULT_PIPELINE if p != off]
    compiled = k31c_api.compile(model, "cpu", passes=passes, options={"executor": "fx"})
    close(scenario(model, compiled), reference)
    assert compiled.compilations == {"prefill": 1, "decode": 1, "verify3": 1}
