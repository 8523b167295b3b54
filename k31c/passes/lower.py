"""lower: pick the kernel of every k31c op for the target, from lowering/registry.py.

`node.meta["k31c"]["kernel"]` becomes `<backend>:<module>.<function>` for a registered kernel, or
`reference` for the op's plain-PyTorch implementation. On the CPU the reference ops are the
kernels. On a GPU target every reference fallback is counted per op and reported: nothing falls
back silently. Stream markers lower to `stream` (events on a target with device graphs) or `noop`
(the CPU has one stream); dense ops are left to the dense code generator (the `dense_codegen`
option: Inductor, or IREE; the report's program line says which built the pieces).
"""
from __future__ import annotations

from collections import Counter

import torch

from ..graph.ops import is_k31c
from ..lowering.build import bind, op_name
from .graph_utils import info, is_marker_node
from .manager import PassResult, register_pass


@register_pass("lower", stage="lower")
def run(gm: torch.fx.GraphModule, ctx) -> PassResult:
    """Assign each k31c op its kernel for the target; count reference fallbacks.
    stats: kernels ({(op, kernel name): ops}), fallbacks ({op: ops lowered to the reference on a
    GPU target})."""
    target = ctx.target
    on_gpu = target.device != "cpu"
    kernels, fallbacks = Counter(), Counter()
    for node in gm.graph.nodes:
        if is_marker_node(node):
            info(node)["kernel"] = "stream" if target.device_graphs else "noop"
            continue
        if not is_k31c(node):
            continue
        op = op_name(node.target)
        name, _ = bind(node, target)            # the name of what runs, as the program binds it
        info(node)["kernel"] = name
        kernels[(op, name)] += 1
        if name == "reference" and on_gpu:
            fallbacks[op] += 1
    notes = [f"{op} -> {name} x{n}" for (op, name), n in sorted(kernels.items())]
    if fallbacks:
        notes.append("reference fallbacks on " + target.name + ": "
                     + ", ".join(f"{op} x{n}" for op, n in sorted(fallbacks.items())))
    return PassResult(matches=sum(kernels.values()), changed=bool(kernels), notes=notes,
                      stats={"kernels": dict(kernels), "fallbacks": dict(fallbacks)})
