"""Each pass on one gated-MLA layer of the tiny config: what it matches, what it leaves alone,
and that the rewritten graph computes what the eager layer computes (outputs and cache writes)."""
import pytest
import torch

from pass_helpers import MLALayer, capture_layer, eager_and_graph, nodes, passes, step_inputs, tiny_cfg
from k31c.graph.blocks.mla import LightningIndexer
from k31c.graph.capture import clone_graph
from k31c.graph.ops import is_k31c
from k31c.passes.graph_utils import info, stable_toposort, stream_of
from k31c.passes.manager import DEFAULT_PIPELINE
from k31c.passes.quantize import mxfp8_quant_dequant
from k31c.passes.verify import GraphVerificationError

K = torch.ops.k31c
aten = torch.ops.aten


@pytest.fixture(scope="module")
def cfg():
    return tiny_cfg()


@pytest.fixture(scope="module")
def layer(cfg):
    return MLALayer(cfg).eval()


@pytest.fixture(scope="module")
def captured(layer, cfg):
    return capture_layer(layer, cfg)


def assert_same(a, b):
    (out_a, cache_a), (out_b, cache_b) = a, b
    assert torch.allclose(out_a, out_b, rtol=1e-5, atol=1e-6)
    assert torch.equal(cache_a.latent, cache_b.latent) or torch.allclose(cache_a.latent, cache_b.latent)
    assert torch.allclose(cache_a.index, cache_b.index, rtol=1e-5, atol=1e-6)


def test_capture_records_no_stack_traces(captured):
    """k31c names nodes by module path: the Python stack trace export records on each node by
    default (a tenth or more of a trace's time) is off on every supported torch."""
    gm, _ = captured
    assert len(gm.graph.nodes) > 10
    assert [n.name for n in gm.graph.nodes if n.meta.get("stack_trace")] == []


def test_full_pipeline_keeps_the_layer_exact(layer, captured, cfg):
    gm, weights = captured
    out, records, _ = passes(gm)
    assert [r.name for r in records] == list(DEFAULT_PIPELINE)
    for batch in (1, 3):                        # the batch dim is symbolic: 1 and 3 both run
        ref, got = eager_and_graph(layer, out, weights, cfg, batch=batch)
        assert_same(ref, got)


def test_canonicalize_drops_noops_and_keeps_side_effects(captured):
    gm, _ = captured
    g = clone_graph(gm)
    assert any(n.target is aten.to.dtype for n in g.graph.nodes)
    with g.graph.inserting_before(list(g.graph.nodes)[-1]):       # an unused marker and an unused op
        marker = g.graph.call_function(K.event_record.default, (7, 0))
        dead = g.graph.call_function(aten.relu.default, (list(g.graph.nodes)[0],))
    out, records, _ = passes(g, ["canonicalize"])
    targets = [n.target for n in out.graph.nodes]
    assert aten.to.dtype not in targets and aten._assert_tensor_metadata.default not in targets
    assert K.event_record.default in targets
    assert aten.relu.default not in targets
    assert len(nodes(out, "mla_cache_write")) == 1 and len(nodes(out, "index_cache_write")) == 1
    assert records[0].result.changed


def test_stable_toposort_keeps_valid_orders_and_repairs_broken_ones(captured):
    gm, _ = captured
    g = clone_graph(gm)
    before = list(g.graph.nodes)
    assert not stable_toposort(g.graph)
    assert list(g.graph.nodes) == before
    write = nodes(g, "index_cache_write")[0]
    first_placeholder_user = next(n for n in g.graph.nodes if n.op == "call_function")
    first_placeholder_user.prepend(write)                         # the write before its inputs
    assert stable_toposort(g.graph)
    order = {n: i for i, n in enumerate(g.graph.nodes)}
    assert all(order[a] < order[write] for a in write.all_input_nodes)
    scorer = nodes(g, "lightning_indexer")[0]
    assert order[write] < order[scorer]                           # the reader stays after the write
    g.graph.lint()


def test_indexer_prolog_builds_one_region_on_three_streams(layer, captured, cfg):
    gm, weights = captured
    out, records, ctx = passes(gm, ["canonicalize", "annotate_layers", "indexer_prolog"])
    assert records[-1].result.matches == 1
    branch = {}
    for n in out.graph.nodes:
        meta = n.meta.get("k31c") or {}
        if "branch" in meta:
            branch.setdefault(meta["branch"], []).append(n)
    assert {k: {stream_of(n) for n in v} for k, v in branch.items()} == {"query": {0}, "key": {1}, "weights": {2}}
    key_ops = [n.target for n in branch["key"]]
    assert key_ops == [aten.linear.default, aten.layer_norm.default, K.index_cache_write.default]
    assert [n.target for n in branch["weights"]] == [aten.linear.default, aten.mul.Tensor]
    assert [n.target for n in branch["query"]] == [aten.linear.default, aten.unflatten.int]
    order = {n: i for i, n in enumerate(out.graph.nodes)}
    enter, = nodes(out, "region_enter")
    leave, = nodes(out, "region_exit")
    scorer, = nodes(out, "lightning_indexer")
    assert order[enter] < min(order[n] for v in branch.values() for n in v)
    assert max(order[n] for v in branch.values() for n in v) < order[leave] < order[scorer]
    q_proj = next(n for n in out.graph.nodes if "q_a_proj" in str(n.meta.get("nn_module_stack")))
    assert order[branch["key"][0]] < order[q_proj]                # the key branch starts early
    records_ = [(n.args[0], n.args[1]) for n in nodes(out, "event_record")]
    waits = [(n.args[0], n.args[1]) for n in nodes(out, "event_wait")]
    fork = records_[0][0]
    assert (fork, 1) in waits and (fork, 2) in waits                # fork to both side streams
    for event, stream in records_[1:]:
        assert (event, 0) in waits and stream in (1, 2)               # each joined back to stream 0
    ref, got = eager_and_graph(layer, out, weights, cfg)
    assert_same(ref, got)


def test_fuse_index_write_replaces_the_chain(layer, captured, cfg):
    gm, weights = captured
    out, records, _ = passes(gm, ["canonicalize", "fuse_index_write"])
    assert records[-1].result.matches == 1
    assert not nodes(out, "index_cache_write") and len(nodes(out, "index_key_norm_write")) == 1
    assert not any(n.target is aten.layer_norm.default for n in out.graph.nodes)
    ref, got = eager_and_graph(layer, out, weights, cfg)
    assert_same(ref, got)


def test_fuse_index_write_never_fuses_across_streams(captured):
    gm, _ = captured
    g, _, _ = passes(gm, ["canonicalize"])
    ln = next(n for n in g.graph.nodes if n.target is aten.layer_norm.default)
    info(ln)["stream"] = 1
    info(ln)["region"] = 0
    out, records, _ = passes(g, ["fuse_index_write"])
    assert records[0].result.matches == 0 and "stream" in " ".join(records[0].result.notes)
    assert len(nodes(out, "index_cache_write")) == 1


def test_fuse_index_write_leaves_a_shared_layernorm(captured):
    gm, _ = captured
    g, _, _ = passes(gm, ["canonicalize"])
    ln = next(n for n in g.graph.nodes if n.target is aten.layer_norm.default)
    out_node = next(n for n in g.graph.nodes if n.op == "output")
    out_node.args = ((out_node.args[0][0], ln),)               # a second user of the normed key
    out, records, _ = passes(g, ["fuse_index_write"])
    assert records[0].result.matches == 0 and len(nodes(out, "index_cache_write")) == 1


def test_fuse_lightning_indexer(layer, captured, cfg):
    gm, weights = captured
    out, records, _ = passes(gm, ["fuse_lightning_indexer"])
    assert records[0].result.matches == 1
    assert not nodes(out, "lightning_indexer") and not nodes(out, "topk_select")
    assert len(nodes(out, "lightning_indexer_topk")) == 1
    ref, got = eager_and_graph(layer, out, weights, cfg)
    assert_same(ref, got)


def test_fuse_lightning_indexer_needs_the_same_row_lengths(captured):
    gm, _ = captured
    g = clone_graph(gm)
    topk, = nodes(g, "topk_select")
    with g.graph.inserting_before(topk):
        other = g.graph.call_function(aten.clone.default, (topk.args[1],))
    topk.args = (topk.args[0], other, topk.args[2])
    out, records, _ = passes(g, ["fuse_lightning_indexer"])
    assert records[0].result.matches == 0 and nodes(out, "topk_select")


def test_quantize_records_and_validates_cache_formats(cfg):
    layer = MLALayer(cfg).eval()
    gm, _ = capture_layer(layer, cfg, fp8=True)
    out, records, _ = passes(gm, ["quantize"])
    write, = nodes(out, "index_cache_write")
    assert info(write)["index_cache"] == "fp8"
    assert info(nodes(out, "mla_cache_write")[0])["latent_cache"] == "f32"
    bad = clone_graph(gm)                                   # an FP8 cache too narrow for the keys
    cache = next(n for n in bad.graph.nodes if n.meta.get("k31c_input") == "cache.index")
    cache.meta["val"] = cache.meta["val"][:, :100]
    with pytest.raises(ValueError, match="FP8 index cache"):
        passes(bad, ["quantize"])


@pytest.mark.parametrize("fused", [False, True])
def test_quantize_mxfp8_option_rewrites_q_and_k(layer, captured, cfg, fused):
    gm, weights = captured
    names = ["canonicalize", "fuse_index_write", "quantize"] if fused else ["canonicalize", "quantize"]
    out, records, _ = passes(gm, names, options={"quantize": {"mxfp8_indexer": True}})
    qdq = [n for n in out.graph.nodes if n.target is mxfp8_quant_dequant]
    assert len(qdq) == 2
    assert not nodes(out, "index_key_norm_write")           # no fused MXFP8 key write exists
    write, = nodes(out, "index_cache_write")
    assert write.args[1].target is mxfp8_quant_dequant
    scorer, = nodes(out, "lightning_indexer")
    assert scorer.args[0].target is mxfp8_quant_dequant
    (ref_out, ref_cache), (got_out, got_cache) = eager_and_graph(layer, out, weights, cfg)
    x, meta, _ = step_inputs(cfg)
    written = meta.slot_mapping
    ref_keys = ref_cache.index.view(-1, cfg.index_head_dim)[written]
    got_keys = got_cache.index.view(-1, cfg.index_head_dim)[written]
    assert torch.allclose(got_keys, mxfp8_reference(ref_keys))
    # the layer's output: the eager layer with its index q and keys quantised by the loop below
    indexer = next(m for m in layer.modules() if isinstance(m, LightningIndexer))
    hooks = [m.register_forward_hook(lambda mod, args, out: mxfp8_reference(out.flatten(0, -2)).view_as(out))
             for m in (indexer.k_norm, indexer.wq_b)]
    try:
        want, _ = eager_and_graph(layer, out, weights, cfg)[0]
    finally:
        for h in hooks:
            h.remove()
    torch.testing.assert_close(got_out, want, rtol=1e-5, atol=1e-6)   # (here it moves no top-16 pick)


def mxfp8_reference(x, group=32):
    """Per-group loop: scale = the smallest power of two with amax / scale <= 448."""
    out = torch.empty_like(x)
    for row in range(x.shape[0]):
        for g0 in range(0, x.shape[1], group):
            chunk = x[row, g0:g0 + group]
            amax = float(chunk.abs().max())
            scale = 2.0 ** -126
            while amax / scale > 448.0:
                scale *= 2.0
            out[row, g0:g0 + group] = (chunk / scale).to(torch.float8_e4m3fn).float() * scale
    return out


def test_mxfp8_quant_dequant_matches_a_per_group_loop():
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4)) * torch.logspace(-3, 3, 64)
    assert torch.equal(mxfp8_quant_dequant(x), mxfp8_reference(x))
    assert (mxfp8_quant_dequant(x) - x).abs().max() > 0                 # it does quantize


def test_superkernels_stay_on_one_stream(captured):
    gm, _ = captured
    out, records, ctx = passes(gm, ["canonicalize", "annotate_layers", "indexer_prolog", "superkernels"])
    groups = {}
    for n in out.graph.nodes:
        sk = (n.meta.get("k31c") or {}).get("superkernel")
        if sk is not None:
            groups.setdefault(sk, []).append(n)
    assert len(groups) == records[-1].result.matches >= 3
    for members in groups.values():
        assert len({stream_of(n) for n in members}) == 1
        assert not any(is_k31c(n) for n in members)
    order = list(out.graph.nodes)
    for members in groups.values():                            # consecutive runs in graph order
        idx = [order.index(n) for n in members]
        assert idx == list(range(idx[0], idx[0] + len(idx)))


@pytest.mark.parametrize("target", ["cpu", "h200", "mi350x"])
def test_lower_assigns_registry_kernels_and_counts_fallbacks(captured, target):
    from k31c.lowering.build import example_args
    from k31c.lowering.registry import lookup
    gm, _ = captured
    out, records, ctx = passes(gm, target=target)
    expected_fallbacks = 0
    for n in out.graph.nodes:
        if not is_k31c(n):
            continue
        op = f"k31c::{n.target._schema.name.split('::')[-1]}"
        if op.split("::")[1] in ("region_enter", "region_exit", "event_record", "event_wait"):
            assert info(n)["kernel"] == ("noop" if target == "cpu" else "stream")
            continue
        kernel = lookup(op, target)
        # the launcher's own name, or (sparse_mla on h200) the kernel it hands these args to:
        # the tiny config's 64-wide fp32 rows run the two-pass kernel there
        runs = kernel.runs(*example_args(n)) if kernel is not None and kernel.runs else None
        fn = runs or (kernel.fn if kernel is not None else None)
        assert info(n)["kernel"] == ("reference" if kernel is None else f"{kernel.backend}:"
                                     f"{fn.__module__}.{fn.__name__}")
        if op == "k31c::sparse_mla" and target == "h200":
            assert info(n)["kernel"].endswith("mla_two_pass.sparse_mla")
        expected_fallbacks += kernel is None and target != "cpu"
    assert sum(ctx.stats("lower")["fallbacks"].values()) == expected_fallbacks
    assert ctx.state == ctx.stats("lower")             # the context's read-only view of the same


def _verified(gm):
    out, _, _ = passes(gm, ["canonicalize", "annotate_layers", "indexer_prolog", "superkernels"])
    return out


def test_verify_accepts_the_pipeline_and_rejects_an_unjoined_region(captured):
    gm, _ = captured
    passes(_verified(gm), ["verify"])
    broken = _verified(gm)
    join = [n for n in nodes(broken, "event_wait") if n.args[1] == 0][0]
    broken.graph.erase_node(join)
    with pytest.raises(GraphVerificationError, match="without waiting|joined"):
        passes(broken, ["verify"])


def test_verify_rejects_a_side_stream_outside_a_region_and_a_double_write(captured):
    gm, _ = captured
    g, _, _ = passes(gm, ["canonicalize"])
    info(next(n for n in g.graph.nodes if n.target is aten.linear.default))["stream"] = 2
    with pytest.raises(GraphVerificationError, match="outside any region"):
        passes(g, ["verify"])
    g, _, _ = passes(gm, ["canonicalize"])
    write, = nodes(g, "mla_cache_write")
    with g.graph.inserting_after(write):
        g.graph.call_function(K.mla_cache_write.default, write.args)
    with pytest.raises(GraphVerificationError, match="written by 2 ops"):
        passes(g, ["verify"])


def test_verify_rejects_a_superkernel_across_streams(captured):
    gm, _ = captured
    g = _verified(gm)
    side = next(n for n in g.graph.nodes if stream_of(n) == 2 and n.target is aten.mul.Tensor)
    main = next(n for n in g.graph.nodes if (n.meta.get("k31c") or {}).get("superkernel") is not None
                and stream_of(n) == 0)
    info(side)["superkernel"] = info(main)["superkernel"]
    with pytest.raises(GraphVerificationError, match="superkernel"):
        passes(g, ["verify"])


def test_verify_rejects_an_op_whose_shape_changed(captured):
    gm, _ = captured
    g, _, _ = passes(gm, ["canonicalize"])
    lin = next(n for n in g.graph.nodes if n.target is aten.linear.default)
    lin.meta["val"] = lin.meta["val"][:, :3]                 # what capture recorded no longer holds
    with pytest.raises(GraphVerificationError, match="changed its result"):
        passes(g, ["verify"])


def test_every_single_pass_off_keeps_the_layer_exact(layer, captured, cfg):
    gm, weights = captured
    for off in DEFAULT_PIPELINE:
        out, _, _ = passes(gm, [p for p in DEFAULT_PIPELINE if p != off])
        ref, got = eager_and_graph(layer, out, weights, cfg)
        assert_same(ref, got)
