"""merge_projections: the bias-free linears that read one x become one `k31c::linear_group`.

    q = aten.linear(x, Wq); k = aten.linear(x, Wk); ...
becomes
    ys = k31c.linear_group(x, [Wq, Wk, ...]); q = ys[0]; k = ys[1]; ...

inserted where the first of them was. A decode step reads each projection weight once for a few
rows: one launch over a layer's KDA inputs (q, k, v, f_a, b, g), an MLA layer's (q_a, kv_a, g),
a MoE's (latent down projection, shared gate and up) or a dense MLP's (gate, up) streams the
weights back to back instead of a GEMV (and a split-K reduction) each. With `singles` (default),
a linear whose x no other linear reads becomes a group of one, so every decode projection runs
the same GEMV kernel (it measured faster than cuBLAS at every decode shape of the bench config,
BENCHMARKS.md).

Only linears on one stream and in one stream region merge (never across an indexer branch), with
a weight that is a graph input (a parameter) in x's dtype. The pass runs only for a target that
registers a `k31c::linear_group` kernel; elsewhere the graph keeps its linears (the CPU's dense
code generator runs them as they are).
"""
from __future__ import annotations

import operator

import torch

from ..lowering.registry import lookup
from .graph_utils import K31C, inherit, region_of, stream_of
from .manager import PassResult, register_pass

aten = torch.ops.aten


def _mergeable(node: torch.fx.Node) -> bool:
    """A bias-free linear whose weight is a graph input (a parameter) in x's dtype."""
    if node.op != "call_function" or node.target is not aten.linear.default:
        return False
    args = list(node.args) + [None] * (3 - len(node.args))
    x, w, bias = args[0], args[1], node.kwargs.get("bias", args[2])
    if bias is not None or not isinstance(w, torch.fx.Node) or w.op not in ("placeholder", "get_attr"):
        return False
    xv, wv = x.meta.get("val") if isinstance(x, torch.fx.Node) else None, w.meta.get("val")
    return xv is not None and wv is not None and wv.dim() == 2 and wv.dtype == xv.dtype


@register_pass("merge_projections", stage="rewrite", after=("indexer_prolog",),
               options={"singles": True})
def run(gm: torch.fx.GraphModule, ctx) -> PassResult:
    """Group the linears reading one x (same stream and region) into linear_group ops.
    stats: groups (linear_group ops made), linears (linears they replace), largest (weights in
    the largest group)."""
    if lookup("k31c::linear_group", ctx.target.name) is None:
        return PassResult(matches=0, changed=False,
                          notes=[f"no linear_group kernel on {ctx.target.name}: linears kept"],
                          stats={"groups": 0, "linears": 0, "largest": 0})
    singles = ctx.opts("merge_projections").get("singles", True)
    graph = gm.graph
    groups: dict[tuple, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if _mergeable(node):
            groups.setdefault((node.args[0], stream_of(node), region_of(node)), []).append(node)
    made, replaced, largest = 0, 0, 0
    now = {}                            # a linear already merged -> the getitem that stands for it
    for (x, _, _), linears in groups.items():
        if len(linears) < 2 and not singles:
            continue
        x, first = now.get(x, x), linears[0]
        with graph.inserting_before(first):
            group = graph.call_function(K31C.linear_group.default, (x, [n.args[1] for n in linears]))
            inherit(group, first, merged=len(linears))
            group.meta["val"] = [n.meta["val"] for n in linears]
            for i, linear in enumerate(linears):
                out = graph.call_function(operator.getitem, (group, i))
                inherit(out, linear)
                out.meta["val"] = linear.meta["val"]
                linear.replace_all_uses_with(out)
                now[linear] = out
        for linear in linears:
            graph.erase_node(linear)
        made, replaced, largest = made + 1, replaced + len(linears), max(largest, len(linears))
    return PassResult(matches=made, changed=made > 0,
                      notes=[f"{replaced} linears in {made} linear_group ops (largest: {largest} weights)"],
                      stats={"groups": made, "linears": replaced, "largest": largest})
