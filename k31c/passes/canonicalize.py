"""canonicalize: drop trace-time checks and no-op casts/views, DCE that keeps side effects, and a
stable topological order.

The pre-dispatch trace is full of `.float()` on values that already are float32 (`aten.to.dtype`
returning its input) and of the `_assert_tensor_metadata` checks export adds for them; both only
hide the patterns later passes look for. Dead-code elimination relies on `Node.is_impure`, which
keeps ops that write an argument (the cache writes) and the stream markers (registered as
side-effecting in graph/ops/streams.py).
"""
from __future__ import annotations

import torch

from .graph_utils import stable_toposort
from .manager import PassResult, register_pass

aten = torch.ops.aten
_CHECKS = (aten._assert_tensor_metadata.default,)
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unflatten.int,
          aten.flatten.using_ints, aten.expand.default, aten.alias.default)


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dim() != b.dim():
        return False
    for x, y in zip(a.shape, b.shape):
        if isinstance(x, torch.SymInt) != isinstance(y, torch.SymInt):
            return False
        if isinstance(x, torch.SymInt):
            if x.node.expr != y.node.expr:
                return False
        elif x != y:
            return False
    return True


def _noop_input(node: torch.fx.Node):
    """The input a node merely passes on, or None."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    src, out = node.args[0].meta.get("val"), node.meta.get("val")
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return None
    if node.target is aten.to.dtype:
        copy = node.kwargs.get("copy", node.args[3] if len(node.args) > 3 else False)
        fmt = node.kwargs.get("memory_format")
        if src.dtype == out.dtype and not copy and fmt is None:
            return node.args[0]
    elif node.target in _VIEWS and src.dtype == out.dtype and _same_shape(src, out):
        return node.args[0]
    return None


@register_pass("canonicalize", stage="prepare")
def run(gm: torch.fx.GraphModule, ctx) -> PassResult:
    """Remove trace checks and no-op casts/views, eliminate dead code, order stably.
    stats: checks, noops, dead (nodes removed of each kind), reordered (0/1)."""
    graph = gm.graph
    checks = noops = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _CHECKS and not node.users:
            graph.erase_node(node)
            checks += 1
            continue
        src = _noop_input(node)
        if src is not None:
            node.replace_all_uses_with(src)
            graph.erase_node(node)
            noops += 1
    before = len(graph.nodes)
    graph.eliminate_dead_code()
    dead = before - len(graph.nodes)
    reordered = stable_toposort(graph)
    notes = [f"removed {checks} trace checks, {noops} no-op casts/views, {dead} dead nodes"
             + ("; reordered" if reordered else "")]
    return PassResult(matches=checks + noops + dead, changed=bool(checks or noops or dead or reordered),
                      notes=notes, stats={"checks": checks, "noops": noops, "dead": dead,
                                          "reordered": int(reordered)})
