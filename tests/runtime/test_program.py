"""The program executor on the CPU: partition into dense pieces, stream markers as events, bucket
padding, fallback counting, and the h200 program running its Triton kernels under the
interpreter (TRITON_INTERPRET=1, set by tests/conftest.py on a machine without CUDA) against eager."""
import dataclasses
import gc
import operator

import pytest
import torch

import k31c.api as k31c_api
import k31c.lowering.build as build
from k31c.graph.capture import StepKind, clone_graph
from k31c.lowering.build import build_program
from k31c.lowering.program import Dense, Kernel, Record, Wait
from k31c.lowering.targets import get_target
from k31c.lowering.triton import device
from k31c.graph.ops import is_k31c
from k31c.passes.graph_utils import dense_runs, is_marker_node, region_of, stream_of
from k31c.passes.partition import is_piece_call, partition
from k31c.runtime.engine import Engine
from k31c.runtime.executor import WeightsPiece
from k31c.runtime.graphs import DecodeGraphs, capture_guard, check_buckets
from tiny_model import close, engine_scenario, make_model

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of the GPU program")


@pytest.fixture(scope="module")
def model():
    return make_model()


def _engine(model, step_fn=None, **kw):
    return Engine(model, max_requests=4, max_seq_len=128, step_fn=step_fn, **kw)


@pytest.fixture(scope="module")
def decode_graph(model):
    """The tiny decode graph after the h200 pipeline, and the step inputs it was built for."""
    compiled = k31c_api.compile(model, target="h200")
    eng = _engine(model)
    rids = [eng.add_request() for _ in range(2)]
    eng.prefill(rids, [list(range(1, 30)), list(range(4, 9))])
    _, meta = eng._inputs(rids, [eng.length(r) for r in rids], [1, 1], [7, 7])
    program = compiled.build(StepKind("decode"), meta, eng.pool.caches(), executable=False)
    return program, eng, meta


def test_partition_keeps_only_k31c_ops_and_markers_between_pieces(decode_graph):
    program, _, _ = decode_graph
    runs = dense_runs(program.gm)
    split = partition(clone_graph(program.gm))
    assert len(split.pieces) == len(runs) and split.distinct < len(split.pieces)   # layers share code
    for node in split.gm.graph.nodes:
        if node.op == "call_function":
            assert is_k31c(node) or is_marker_node(node) or node.target is operator.getitem, node.format_node()
            if node.target is operator.getitem:
                assert is_piece_call(node.args[0]) or is_k31c(node.args[0])
    for run, piece in zip(runs, split.pieces.values()):
        assert {(stream_of(n), region_of(n)) for n in run} == {(piece.stream, piece.region)}
        assert piece.ops == len(run)
    # the indexer prolog's branches: each side stream runs dense pieces or kernels (the key branch
    # is its projection, a linear_group, and the fused key write: no dense op left on stream 1)
    kernel_streams = {stream_of(n) for n in split.gm.graph.nodes if is_k31c(n) and not is_marker_node(n)}
    assert {p.stream for p in split.pieces.values()} | kernel_streams == {0, 1, 2}


def test_partitioned_graph_computes_what_the_graph_computes(decode_graph, model):
    program, eng, meta = decode_graph
    from k31c.graph.input_checks import flat_step_inputs
    ids = torch.tensor([3, 9])

    def run(gm):
        caches = eng.pool.caches()
        snapshot = [t.clone() for c in caches.mla for t in (c.latent, c.index)] + \
                   [t.clone() for s in caches.kda for t in (s.conv, s.recurrent)]
        flat = flat_step_inputs(program.captured, program.placeholders, ids, meta, caches)
        out = gm(*flat)[0]
        written = [t.clone() for c in caches.mla for t in (c.latent, c.index)] + \
                  [t.clone() for s in caches.kda for t in (s.conv, s.recurrent)]
        for t, s in zip([t for c in caches.mla for t in (c.latent, c.index)] +
                        [t for s in caches.kda for t in (s.conv, s.recurrent)], snapshot):
            t.copy_(s)                                   # both runs start from the same caches
        return out, written

    whole, caches_a = run(clone_graph(program.gm))
    split, caches_b = run(partition(clone_graph(program.gm)).gm)
    torch.testing.assert_close(split, whole, rtol=0, atol=0)
    for a, b in zip(caches_a, caches_b):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_markers_become_events_and_the_main_stream_is_enqueued_first(decode_graph):
    program, _, _ = decode_graph
    split = partition(clone_graph(program.gm))
    prog = build_program(split.gm, {n: p.key for n, p in split.pieces.items()}, program_target("h200"),
                         "decode", "fx")
    markers = [n for n in program.gm.graph.nodes if is_marker_node(n)
               and n.target in (torch.ops.k31c.event_record.default, torch.ops.k31c.event_wait.default)]
    events = [s for s in prog.steps if isinstance(s, (Record, Wait))]
    assert len(events) == len(markers) and prog.events == 6
    recorded = set()
    for s in prog.steps:                                 # every wait follows its record
        if isinstance(s, Record):
            recorded.add(s.event)
        elif isinstance(s, Wait):
            assert s.event in recorded
    # per stream, the steps keep the graph's order; within a fork the main stream's work comes first
    forks = [i for i, s in enumerate(prog.steps) if isinstance(s, Record) and s.stream == 0]
    for i in forks:
        j = next(k for k in range(i + 1, len(prog.steps)) if isinstance(prog.steps[k], Wait) and prog.steps[k].stream == 0)
        streams = [s.stream for s in prog.steps[i + 1:j]]
        assert streams == sorted(streams, key=lambda s: s != 0) and 0 in streams and {1, 2} <= set(streams)
    kinds = {type(s) for s in prog.steps}
    assert kinds == {Dense, Kernel, Record, Wait}
    assert prog.fallbacks() == {}
    assert {op for op, _ in prog.kernels()} == {"k31c::kda_decode", "k31c::mla_cache_write",
                                                 "k31c::index_key_norm_write", "k31c::lightning_indexer_topk",
                                                 "k31c::sparse_mla", "k31c::moe_route", "k31c::moe_experts",
                                                 "k31c::linear_group", "k31c::attn_res_norm"}


def program_target(name):
    from k31c.lowering.targets import get_target
    return get_target(name)


@pytest.mark.parametrize("pdl", [False, True])
def test_each_distinct_piece_is_compiled_once_with_the_targets_pdl(decode_graph, monkeypatch, pdl):
    program, _, _ = decode_graph
    split = partition(clone_graph(program.gm))
    keys = {n: p.key for n, p in split.pieces.items()}
    built = []
    monkeypatch.setattr(build, "compile_piece", lambda gm, codegen, target, save=None: built.append(target.pdl) or gm)
    prog = build_program(split.gm, keys, dataclasses.replace(get_target("h200"), pdl=pdl), "decode", "fx")
    assert built == [pdl] * len(set(keys.values())) == [pdl] * len(prog.pieces)
    assert {s.piece for s in prog.steps if isinstance(s, Dense)} == set(range(len(prog.pieces)))


def test_weights_piece_recomputes_in_place_when_a_weight_changes():
    calls = []
    piece = WeightsPiece(lambda a, b: calls.append(1) or (torch.cat([a, b]),), (0, 1))
    a, b = torch.randn(3), torch.randn(2)
    out = piece(a, b)[0]
    assert piece(a, b)[0] is out and len(calls) == 1
    with torch.no_grad():
        a.mul_(2)                                        # in place: the version counter moves
    assert piece(a, b)[0] is out and len(calls) == 2 and torch.equal(out, torch.cat([a, b]))
    c = torch.randn(3)                                   # another tensor: another data pointer
    assert torch.equal(piece(c, b)[0], torch.cat([c, b])) and len(calls) == 3


def test_weights_only_pieces_run_once_until_a_weight_changes(model):
    """The KDA conv weights' concatenation reads weights alone: it runs on the first decode only,
    and again (into the same tensors) after one of its weights is changed in place; the logits
    follow the changed weight."""
    compiled = k31c_api.compile(model, target="h200", options={"dense_codegen": "fx"})
    eng, ref = _engine(model, compiled), _engine(model)
    for e in (eng, ref):
        e.add_request()                                  # decode from an empty prefix: no prefill program
    for tok in (5, 6):
        close(eng.decode([0], [tok]), ref.decode([0], [tok]))
    program = next(p for s, p in compiled._programs.items() if s.name == "decode")
    steps = [s for s in program.executor.program.steps if isinstance(s, Dense) and s.weights_only]
    names = program.executor.program.input_names
    assert steps and all(names[a].startswith("@") for s in steps for a in s.args)
    pieces = program.executor.weight_pieces
    assert len(pieces) == len(steps) and [p.runs for p in pieces] == [1] * len(pieces)
    weight = model.model.layers[0].self_attn.q_conv1d.weight
    try:
        with torch.no_grad():
            weight.mul_(2.0)
        close(eng.decode([0], [8]), ref.decode([0], [8]))
    finally:
        with torch.no_grad():
            weight.div_(2.0)                             # exact: the module's model is shared
    assert sorted(p.runs for p in pieces) == [1] * (len(pieces) - 1) + [2]


def test_a_failing_step_says_which_and_what_it_was_given(model):
    compiled = k31c_api.compile(model, target="h200", options={"dense_codegen": "fx"})
    eng = _engine(model, compiled)
    rid = eng.add_request()
    eng.decode([rid], [5])
    executor = next(p for s, p in compiled._programs.items() if s.name == "decode").executor
    i = next(j for j, step in enumerate(executor.steps) if step[0] == 0)     # a dense piece

    def broken(*args):
        raise ValueError("piece broke")
    executor.steps[i] = executor.steps[i][:2] + (broken,) + executor.steps[i][3:]
    with pytest.raises(ValueError, match="piece broke") as info:
        eng.decode([rid], [6])
    [note] = info.value.__notes__
    assert note.startswith(f"k31c: in program decode, step {i} (broken), called with: ")
    assert "torch.float32 (" in note and "stride (" in note


def test_h200_program_runs_its_kernels_and_matches_eager(model):
    compiled = k31c_api.compile(model, target="h200", options={"dense_codegen": "fx"})
    topk = model.config.index_topk
    scenario = lambda fn: engine_scenario(model, fn, [(0, topk + 8), (0, 5), (7, 18)], 100, (0, 2), 2)  # noqa: E731
    close(scenario(compiled), scenario(model), tol=5e-4)
    for step in ("prefill", "decode", "verify3"):
        report = compiled.report.steps[step]
        assert report.fallbacks == {} and report.kernels
        assert all(k.startswith("triton:") for _, k in report.kernels)
    assert "reference fallbacks: none" in str(compiled.report)
    assert compiled.graph_stats() == {}                  # no device graphs on CPU tensors


def test_a_missing_kernel_is_a_counted_fallback(model, monkeypatch):
    """Also: the program's kernels run under its own target record (here with the `pdl` option,
    which the launchers read from it; on CPU tensors they launch without PDL)."""
    lookup, seen = build.lookup, []

    def spy(op, t):
        if op == "k31c::sparse_mla":
            return None
        k = lookup(op, t)
        if op != "k31c::lightning_indexer_topk":
            return k
        return dataclasses.replace(k, fn=lambda *a: seen.append(device._OVERRIDE.get()) or k.fn(*a))
    monkeypatch.setattr(build, "lookup", spy)
    compiled = k31c_api.compile(model, target="h200", options={"dense_codegen": "fx", "pdl": True})
    eng, ref = _engine(model, compiled), _engine(model)
    for e in (eng, ref):
        r = e.add_request()
        e.prefill([r], [list(range(1, 20))])
    close(eng.decode([0], [5]), ref.decode([0], [5]))
    assert compiled.report.steps["decode"].fallbacks == {"k31c::sparse_mla": 2}
    assert compiled.report.steps["prefill"].fallbacks == {"k31c::sparse_mla": 2}   # sparse prefill
    assert compiled.report.fallbacks() == {"k31c::sparse_mla": 4}
    executor = next(p.executor for s, p in compiled._programs.items() if s.name == "decode")
    assert executor.reference_calls == 2                 # counted from the runs, per call
    assert "reference fallbacks: k31c::sparse_mla x2" in str(compiled.report)
    assert seen and all(t is compiled.target for t in seen)
    assert compiled.target.name == "h200" and compiled.target.pdl and not get_target("h200").pdl
    with device.using_target(compiled.target):
        assert device.pdl_launch(torch.device("cpu")) == {}


def test_padding_requests_read_and_write_nothing(model):
    """A bucket's static inputs: a batch of 2 in a bucket of 4 gives the unpadded logits and caches;
    a batch of 1 after it pads row 1 again."""
    compiled = k31c_api.compile(model, target="h200", options={"dense_codegen": "fx"})
    a, b = _engine(model, compiled), _engine(model, compiled)
    for e in (a, b):
        rids = [e.add_request() for _ in range(2)]
        e.prefill(rids, [list(range(1, 30)), list(range(4, 9))])
    want = a.decode([0, 1], [3, 9])
    step = StepKind("decode")
    program = compiled._programs[step]
    from k31c.graph.input_checks import flat_step_inputs
    from k31c.runtime.staging import decode_step_inputs
    inputs = decode_step_inputs(program.captured, program.placeholders, step.rows)
    graphs = DecodeGraphs(program.executor, inputs, (4,), None, b.pool.max_blocks_per_req)
    _, meta = b._inputs([0, 1], [b.length(0), b.length(1)], [1, 1], [3, 9])
    flat = flat_step_inputs(program.captured, program.placeholders, torch.tensor([3, 9]), meta, b.pool.caches())
    statics = graphs.static_inputs(4, flat)
    statics.fill(flat)
    statics.stage()
    got = program.executor(statics.bind(flat))[0]
    assert got.shape[0] == 4
    close(got[:2], want, tol=1e-5)
    for ca, cb in zip(a.pool.mla, b.pool.mla):
        torch.testing.assert_close(ca.latent, cb.latent)
        torch.testing.assert_close(ca.index, cb.index)      # the padding rows wrote no index key
    for sa, sb in zip(a.pool.kda, b.pool.kda):
        torch.testing.assert_close(sa.recurrent, sb.recurrent)
        torch.testing.assert_close(sa.conv, sb.conv)
    _, one = b._inputs([0], [b.length(0) + 1], [1], [4])
    flat1 = flat_step_inputs(program.captured, program.placeholders, torch.tensor([4]), one, b.pool.caches())
    statics.fill(flat1)
    statics.stage()
    slots = statics.buffers[statics.inputs.names.index("meta.kda_slots")]
    assert slots.tolist() == [flat1[statics.inputs.per_step[statics.inputs.names.index("meta.kda_slots")]][0].item(), -1, -1, -1]


def test_buckets():
    assert check_buckets([8, 1, 2, 2]) == (1, 2, 8)
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.buckets = (1, 2, 4, 8)
    assert [graphs.bucket(b) for b in (1, 3, 8, 9)] == [1, 4, 8, None]
    for bad in ([], [0], "1,2", [1.5]):
        with pytest.raises(ValueError, match="buckets"):
            check_buckets(bad)
    with pytest.raises(ValueError, match="buckets"):
        k31c_api.compile(make_model(), target="h200", options={"buckets": [0, 2]})


def test_capture_guard_holds_off_collection():
    """A dead cycle is collected before a capture and none during it (a collection that frees an
    old CUDAGraph mid-capture invalidates the capture); the collector's state comes back after."""
    freed = []

    class Cycle:
        def __init__(self):
            self.me = self

        def __del__(self):
            freed.append(1)

    gc_was = gc.isenabled()
    gc.enable()
    try:
        Cycle()
        with capture_guard():
            assert freed == [1] and not gc.isenabled()
            Cycle()
            junk = [[i] for i in range(100 * gc.get_threshold()[0])]   # would trigger collections
            assert freed == [1] and junk
        assert gc.isenabled()
    finally:
        gc.enable() if gc_was else gc.disable()


def test_gpu_target_without_a_gpu_or_interpreter_is_an_error(model, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    compiled = k31c_api.compile(model, target="h200")
    eng = _engine(model, compiled)
    r = eng.add_request()
    with pytest.raises(ValueError, match="CUDA device.*TRITON_INTERPRET"):
        eng.prefill([r], [[1, 2, 3]])
