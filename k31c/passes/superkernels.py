"""superkernels: group maximal same-stream chains of dense ops into regions a target may lower as
one kernel (`node.meta["k31c"]["superkernel"] = id`).

A chain is a run of consecutive dense (aten) ops in graph order, all on one stream and in the
same stream region. It ends at a k31c op (a hand-written kernel of its own, and where a cache is
read or written), at a stream marker, and wherever the stream or region changes: a superkernel
never spans two streams. Single ops stay unmarked.
"""
from __future__ import annotations

import torch

from .graph_utils import dense_runs, info
from .manager import PassResult, register_pass


@register_pass("superkernels", stage="group", after=("indexer_prolog",))
def run(gm: torch.fx.GraphModule, ctx) -> PassResult:
    """Mark maximal same-stream, same-region runs of dense ops.
    stats: superkernels, ops (in them), largest (op counts of the three largest)."""
    for node in gm.graph.nodes:
        if node.op == "call_function":
            info(node).pop("superkernel", None)
    chains = [run for run in dense_runs(gm) if len(run) > 1]
    for i, chain in enumerate(chains):
        for node in chain:
            info(node)["superkernel"] = i
    sizes = sorted((len(c) for c in chains), reverse=True)
    notes = [f"{len(chains)} superkernels over {sum(sizes)} ops; largest {sizes[:3]}"]
    return PassResult(matches=len(chains), changed=bool(chains), notes=notes,
                      stats={"superkernels": len(chains), "ops": sum(sizes), "largest": sizes[:3]})
