"""Small graph helpers the passes share: k31c metadata, marker tests, slices, mutation, ordering
(whether a node is a k31c op: `k31c.graph.ops.is_k31c`)."""
from __future__ import annotations

import heapq
import operator
import re
from typing import Iterable, Optional

import torch

from ..errors import CompilerError
from ..graph.capture import module_path
from ..graph.ops import is_k31c
from ..graph.ops.streams import is_marker

K31C = torch.ops.k31c
INDEXER_OPS = (K31C.lightning_indexer.default, K31C.lightning_indexer_topk.default)
INDEX_WRITES = (K31C.index_cache_write.default, K31C.index_key_norm_write.default)


def info(node: torch.fx.Node) -> dict:
    """The node's k31c metadata (created on first use): layer, kind, stream, region, ..."""
    meta = node.meta.setdefault("k31c", {})
    meta.setdefault("stream", 0)
    return meta


def stream_of(node: torch.fx.Node) -> int:
    return (node.meta.get("k31c") or {}).get("stream", 0)


def region_of(node: torch.fx.Node) -> Optional[int]:
    return (node.meta.get("k31c") or {}).get("region")


def is_marker_node(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and is_marker(node.target)


def is_dense(node: torch.fx.Node) -> bool:
    """An op the dense code generator compiles: not a k31c op or marker, not a k31c op's output."""
    if node.op != "call_function" or is_k31c(node):
        return False
    if node.target is operator.getitem:      # a view of a multi-output op: dense unless the op is k31c
        src = node.args[0]
        return not (isinstance(src, torch.fx.Node) and is_k31c(src))
    return True


def dense_runs(gm: torch.fx.GraphModule) -> list[list[torch.fx.Node]]:
    """Maximal runs of consecutive dense nodes sharing (stream, region), in graph order: the
    superkernels pass marks those of more than one op, partition makes each one a piece."""
    runs, current, key = [], [], None
    for node in gm.graph.nodes:
        here = (stream_of(node), region_of(node)) if is_dense(node) else None
        if here is None or here != key:
            if current:
                runs.append(current)
            current, key = [], here
        if here is not None:
            current.append(node)
    if current:
        runs.append(current)
    return runs


def layer_of(node: torch.fx.Node) -> Optional[int]:
    m = re.match(r"layers\.(\d+)(\.|$)", module_path(node))
    return int(m.group(1)) if m else None


def inherit(new: torch.fx.Node, like: torch.fx.Node, **k31c) -> None:
    """Give a node created by a pass the module path and k31c metadata of the node it stands for."""
    for key in ("nn_module_stack", "stack_trace"):
        if key in like.meta:
            new.meta[key] = like.meta[key]
    new.meta["k31c"] = {**dict(like.meta.get("k31c") or {}), **k31c}
    info(new)


def mutated_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The graph values a call writes in place, from the op's schema."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    out = []
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, torch.fx.Node):
                out.append(value)
    return out


def exclusive_slice(roots: Iterable[torch.fx.Node], sink: torch.fx.Node) -> list[torch.fx.Node]:
    """The compute nodes that only feed `sink` through `roots`: the roots (if `sink` is their only
    user) and, transitively, every producer whose users are all in the slice. In graph order."""
    roots = [r for r in roots if isinstance(r, torch.fx.Node)]
    candidates = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n in candidates or n.op != "call_function":
            continue
        candidates.add(n)
        stack.extend(a for a in n.all_input_nodes)
    chosen = {sink}
    for n in reversed(list(sink.graph.nodes)):      # users before producers: one sweep suffices
        if n in candidates and n.users and all(u in chosen or is_check(u) for u in n.users) \
                and not is_marker_node(n) and not mutated_args(n):
            chosen.add(n)
    chosen.discard(sink)
    # checks on the slice's values (export's _assert_tensor_metadata) travel with it
    chosen |= {u for n in chosen for u in n.users if is_check(u)
               and all(a in chosen or a.op != "call_function" for a in u.all_input_nodes)}
    return [n for n in sink.graph.nodes if n in chosen]


def is_check(node: torch.fx.Node) -> bool:
    """An op with no users that only checks its inputs (writes nothing, marks nothing)."""
    return node.op == "call_function" and not node.users and not is_marker_node(node) \
        and not mutated_args(node)


def stable_toposort(graph: torch.fx.Graph) -> bool:
    """Reorder nodes topologically, keeping the current order wherever it is valid (so a valid
    graph is left as it is). Besides data edges, a node that writes a value in place is ordered
    after earlier users of that value and before later ones, and stream markers keep their place
    relative to every other node on any stream (they define regions by position).
    Returns whether the order changed."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    deps: dict[torch.fx.Node, set] = {n: set(n.all_input_nodes) for n in nodes}
    last_marker = None
    touched: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in nodes:
        if last_marker is not None:
            deps[n].add(last_marker)
        if is_marker_node(n):
            deps[n].update(m for m in nodes[:index[n]])
            last_marker = n
        written = mutated_args(n)
        for value in set(written) | set(a for a in n.all_input_nodes if a in touched):
            for prev in touched.get(value, []):
                if prev is not n and (written or mutated_args(prev)):
                    deps[n].add(prev)
        for value in set(written) | set(n.all_input_nodes):
            touched.setdefault(value, []).append(n)
    users: dict[torch.fx.Node, list] = {n: [] for n in nodes}
    waiting = {n: len(deps[n]) for n in nodes}
    for n in nodes:
        for d in deps[n]:
            users[d].append(n)
    ready = [(index[n], n.name, n) for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, _, n = heapq.heappop(ready)
        order.append(n)
        for u in users[n]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (index[u], u.name, u))
    if len(order) != len(nodes):
        raise CompilerError("canonicalize: the graph has a cycle; cannot order it")
    if order == nodes:
        return False
    cursor = order[0]
    for n in order[1:]:
        cursor.append(n)
        cursor = n
    return True


def insert_after(cursor: torch.fx.Node, target, args, like: torch.fx.Node, **k31c) -> torch.fx.Node:
    """A new call_function node right after `cursor`, with `like`'s path and k31c metadata."""
    with cursor.graph.inserting_after(cursor):
        new = cursor.graph.call_function(target, tuple(args))
    inherit(new, like, **k31c)
    return new
