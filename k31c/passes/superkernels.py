"""superkernels: group maximal same-stream chains of dense ops into regions a target may lower as
one kernel (`node.meta["k31c"]["superkernel"] = id`).

A chain is a run of consecutive dense (aten) ops in graph order, all on one stream and in the
same stream region. It ends at a k31c op (a hand-written kernel of its own, and where a cache is
read or written), at a stream marker, and wherever the stream or region changes: a superkernel
never spans two streams. Single ops stay unmarked.
"""
from __future__ import annotations

import operator

import torch

from ..graph.ops import is_k31c
from .graph_utils import info, region_of, stream_of
from .manager import PassResult, register_pass


def is_dense(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or is_k31c(node):
        return False
    if node.target is operator.getitem:      # a view of a multi-output op: dense unless the op is k31c
        src = node.args[0]
        return not (isinstance(src, torch.fx.Node) and is_k31c(src))
    return True


@register_pass("superkernels", stage="group", after=("indexer_prolog",))
def run(gm: torch.fx.GraphModule, ctx) -> PassResult:
    """Mark maximal same-stream, same-region runs of dense ops.
    stats: superkernels, ops (in them), largest (op counts of the three largest)."""
    chains, current, key = [], [], None
    for node in gm.graph.nodes:
        if node.op == "call_function":
            info(node).pop("superkernel", None)
        here = (stream_of(node), region_of(node)) if is_dense(node) else None
        if here is None or here != key:
            if len(current) > 1:
                chains.append(current)
            current, key = [], here
        if here is not None:
            current.append(node)
    if len(current) > 1:
        chains.append(current)
    for i, chain in enumerate(chains):
        for node in chain:
            info(node)["superkernel"] = i
    sizes = sorted((len(c) for c in chains), reverse=True)
    notes = [f"{len(chains)} superkernels over {sum(sizes)} ops; largest {sizes[:3]}"]
    return PassResult(matches=len(chains), changed=bool(chains), notes=notes,
                      stats={"superkernels": len(chains), "ops": sum(sizes), "largest": sizes[:3]})
