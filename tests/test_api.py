"""`k31c.compile` on the CPU: the done-when scenario through Inductor, compilation counting, and
the errors of the front door. Inductor's first compile of the three tiny-model graphs takes a
few minutes on two cores; its cache (.inductor-cache/ in the repo) makes later runs quick."""
import os
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".inductor-cache"))

import pytest  # noqa: E402
import torch  # noqa: E402

import k31c.api as k31c_api  # noqa: E402
from k31c.runtime.engine import Engine  # noqa: E402
from tiny_model import close, engine_scenario, make_model  # noqa: E402

DECODE_STEPS = 32


def scenario(model, step_fn):
    """Prefill of index_topk + 8 tokens (and of 5 and 11 tokens for two more requests), then
    DECODE_STEPS decode steps alternating 1 and 3 requests, then a 3-row verification step."""
    topk = model.config.index_topk
    return engine_scenario(model, step_fn, [(0, topk + 8), (0, 5), (7, 18)], 100, (0, 2),
                           DECODE_STEPS)


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def compiled_run(model):
    compiled = k31c_api.compile(model, target="cpu")
    return compiled, scenario(model, compiled)


def test_compiled_logits_equal_eager(model, compiled_run):
    compiled, got = compiled_run
    close(got, scenario(model, model))


def test_one_program_per_step_kind_serves_every_batch_size(compiled_run):
    compiled, _ = compiled_run
    # decode ran with 1 and 3 requests, prefill with 3: one build each, no retrace
    assert compiled.compilations == {"prefill": 1, "decode": 1, "verify3": 1}
    assert compiled.executor == "inductor"
    decode = compiled.graphs["decode"]
    symbols = {s for n in decode.graph.nodes if n.op == "placeholder"
               for d in n.meta["val"].shape if isinstance(d, torch.SymInt) for s in d.node.expr.free_symbols}
    assert len(symbols) == 1                                 # one symbolic size: the batch
    assert sum(1 for n in decode.graph.nodes if n.target is torch.ops.k31c.region_enter.default) == 2


def test_report_says_what_each_pass_did(compiled_run):
    compiled, _ = compiled_run
    report = compiled.report
    assert set(report.steps) == {"prefill", "decode", "verify3"}
    decode = {r.name: r.result for r in report.steps["decode"].passes}
    assert decode["indexer_prolog"].matches == 2 and decode["fuse_index_write"].matches == 2
    # what runs: on the CPU every k31c op runs its reference implementation (the CPU's kernels),
    # which is not a fallback (tests/runtime/test_program.py counts those on the h200 program)
    kernels = report.steps["decode"].kernels
    assert kernels and {k for _, k in kernels} == {"reference"}
    assert kernels[("k31c::kda_decode", "reference")] == 6 and report.fallbacks() == {}
    text = str(report)
    assert "indexer_prolog" in text and "2 indexer regions" in text


def test_engine_takes_the_compiled_model_directly(compiled_run, model):
    compiled, _ = compiled_run
    eng, ref = Engine(compiled, max_requests=4, max_seq_len=128), Engine(model, max_requests=4, max_seq_len=128)
    prompt = list(range(30, 50))
    close(eng.prefill_logits(prompt), ref.prefill_logits(prompt))


def test_another_pool_is_an_error_not_a_retrace(compiled_run, model):
    compiled, _ = compiled_run
    eng = Engine(model, max_requests=2, max_seq_len=64, step_fn=compiled)
    r = eng.add_request()
    with pytest.raises(ValueError, match="new compile"):
        eng.prefill([r], [[1, 2, 3]])
    assert compiled.compilations["prefill"] == 1


def test_errors_name_the_model_target_pass_and_option(model):
    with pytest.raises(ValueError, match=r"K31ForCausalLM.*torch\.nn\.modules\.linear\.Linear"):
        k31c_api.compile(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown target 'tpu7'"):
        k31c_api.compile(model, target="tpu7")
    with pytest.raises(ValueError, match="unknown pass 'fuse_everything'"):
        k31c_api.compile(model, passes=["canonicalize", "fuse_everything"])
    with pytest.raises(ValueError, match="unknown option 'exector'"):
        k31c_api.compile(model, options={"exector": "fx"})
    with pytest.raises(ValueError, match="pass 'quantize' has no option 'fp4'"):
        k31c_api.compile(model, options={"quantize": {"fp4": True}})
    with pytest.raises(ValueError, match="executor must be one of"):
        k31c_api.compile(model, options={"executor": "tvm"})
    for bad in ("on", 1, "outside_regions"):       # the last: a mode measured no better, removed
        with pytest.raises(ValueError, match=f"option pdl must be True or False, got {bad!r}"):
            k31c_api.compile(model, target="h200", options={"pdl": bad})
    assert k31c_api.compile(model, target="h200", options={"pdl": True}).target.pdl
    with pytest.raises(ValueError, match="target 'mi350x' has no programmatic dependent launch"):
        k31c_api.compile(model, target="mi350x", options={"pdl": True})


def test_compile_only_targets_build_but_do_not_run(model, compiled_run):
    from k31c.graph.capture import StepKind
    compiled = k31c_api.compile(model, target="mi350x")
    eng = Engine(model, max_requests=4, max_seq_len=128, step_fn=compiled)   # the scenario's pool
    r = eng.add_request()
    program = compiled.build(StepKind("prefill"), eng._inputs([r], [0], [3], [1, 2, 3])[1], eng.pool.caches(),
                             executable=False)
    kernels = {(n.meta.get("k31c") or {}).get("kernel") for n in program.gm.graph.nodes}
    assert "stream" in kernels
    with pytest.raises(ValueError, match="compile-only"):
        eng.prefill([r], [[1, 2, 3]])


def test_caches_are_written_like_eager(model, compiled_run):
    compiled, _ = compiled_run
    a = Engine(model, max_requests=4, max_seq_len=128, step_fn=compiled)
    b = Engine(model, max_requests=4, max_seq_len=128)
    for eng in (a, b):
        r = eng.add_request()
        eng.prefill([r], [list(range(1, 30))])
        eng.decode([r], [7])
    for ca, cb in zip(a.pool.mla, b.pool.mla):
        close(ca.latent, cb.latent)
        close(ca.index, cb.index)
    for sa, sb in zip(a.pool.kda, b.pool.kda):
        close(sa.recurrent, sb.recurrent)
        close(sa.conv, sb.conv)


@pytest.mark.parametrize("kwargs, message", [
    ({"target": "nope"}, "unknown target 'nope'"),
    ({"target": None}, "unknown target None"),
    ({"target": 5}, "unknown target 5"),
    ({"options": ["x"]}, r"options must be a dict .* got \['x'\]"),
    ({"disable": 5}, "disable must be a pass name or a list of pass names, got 5"),
    ({"disable": [5]}, r"disable must be .* got \[5\]"),
])
def test_bad_arguments_are_usage_errors_naming_them(model, kwargs, message):
    from k31c.errors import UsageError
    with pytest.raises(UsageError, match=message):
        k31c_api.compile(model, **kwargs)
