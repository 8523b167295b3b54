"""partition: split a lowered graph into dense pieces between its k31c ops and stream markers.

Runs after the pass pipeline, on GPU targets (and whenever a program of bound kernels is built).
A *piece* is a maximal run of consecutive dense (aten) ops on one stream and in one stream region,
the same runs the `superkernels` pass marks; a k31c op or a marker ends a run. Each run becomes a
`call_module` of a small GraphModule (`piece_N`) whose outputs are the values used after the run,
followed by `getitem` nodes; k31c ops and markers stay at the top level, in their order (the
caches are mutated, so order matters). `lowering/build.py` turns the result into a Program.

Pieces with the same code and input shapes (every layer of a kind, mostly) get the same `key`, so
the builder compiles each distinct piece once. Why not `torch.fx.passes.split_module`: it makes
every node a submodule member (markers and k31c ops included) and names values by the original
graph, while the builder needs k31c ops and markers unwrapped and a layer-independent key per piece.
"""
from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass

import torch

from ..errors import CompilerError
from ..graph.printer import dtype_name
from .graph_utils import dense_runs, info, region_of, stream_of


@dataclass(frozen=True)
class Piece:
    name: str                 # attribute of the partitioned module ("piece_3")
    key: str                  # same key = same code and input shapes: compiled once
    stream: int
    region: int | None
    ops: int                  # dense ops inside
    superkernel: int | None   # the superkernels pass's id of this run, if it marked one


@dataclass
class Partition:
    gm: torch.fx.GraphModule             # top level: placeholders, pieces, k31c ops, markers
    pieces: dict[str, Piece]             # by submodule name, in graph order

    @property
    def distinct(self) -> int:
        return len({p.key for p in self.pieces.values()})


def _shape_text(val) -> str:
    if isinstance(val, torch.Tensor):
        dims = ",".join(str(d.node.expr) if isinstance(d, torch.SymInt) else str(d) for d in val.shape)
        strides = ",".join(str(s.node.expr) if isinstance(s, torch.SymInt) else str(s) for s in val.stride())
        return f"{dtype_name(val.dtype)}[{dims}]/({strides})@{val.device.type}"
    return type(val).__name__


def _extract(run: list[torch.fx.Node]) -> tuple[torch.fx.GraphModule, list, list]:
    """The run as a standalone GraphModule with inputs (values from outside) and outputs (values
    used outside), names made positional so that equal runs of different layers print alike."""
    members = set(run)
    inputs: list[torch.fx.Node] = []
    for node in run:
        for a in node.all_input_nodes:
            if a not in members and a not in inputs:
                inputs.append(a)
    inputs += _size_carriers(inputs, run[0].graph)
    outputs = [n for n in run if any(u not in members for u in n.users)]
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, a in enumerate(inputs):
        ph = graph.placeholder(f"in{i}")
        ph.meta["val"] = a.meta.get("val")
        env[a] = ph
    for i, node in enumerate(run):
        new = graph.node_copy(node, lambda n: env[n])
        new.name = f"v{i}"
        env[node] = new
    graph.output(tuple(env[o] for o in outputs))
    sub = torch.fx.GraphModule(torch.nn.Module(), graph)
    return sub, inputs, outputs


def _symbols(val) -> tuple[set, set]:
    """(free symbols of a value's sizes, symbols that appear as a bare size a compiled piece can
    read them from)."""
    free, bare = set(), set()
    sizes = list(val.shape) if isinstance(val, torch.Tensor) else [val] if isinstance(val, torch.SymInt) else []
    for d in sizes:
        if isinstance(d, torch.SymInt):
            expr = d.node.expr
            free |= expr.free_symbols
            if expr.is_Symbol:
                bare.add(expr)
    return free, bare


def _size_carriers(inputs: list[torch.fx.Node], graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Graph inputs to add to a piece so that every symbolic size of its inputs can be derived:
    Inductor binds a symbol from an input's size, and a piece that only sees `4*B` rows cannot
    recover B. One placeholder with the bare symbol as a size is added per missing symbol."""
    free, bare = set(), set()
    for a in inputs:
        f, b = _symbols(a.meta.get("val"))
        free |= f
        bare |= b
    missing = free - bare
    extra = []
    for ph in (n for n in graph.nodes if n.op == "placeholder"):
        if not missing:
            break
        _, b = _symbols(ph.meta.get("val"))
        if b & missing and ph not in inputs:
            extra.append(ph)
            missing -= b
    if missing:
        raise CompilerError(f"partition: no graph input carries the sizes {sorted(map(str, missing))} "
                            "a dense piece needs")
    return extra


def _key(sub: torch.fx.GraphModule, inputs: list[torch.fx.Node]) -> str:
    text = sub.code + "|" + ";".join(_shape_text(a.meta.get("val")) for a in inputs)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def partition(gm: torch.fx.GraphModule) -> Partition:
    """Rewrite `gm` in place into pieces (see the module docstring); returns the pieces."""
    pieces: dict[str, Piece] = {}
    for index, run in enumerate(dense_runs(gm)):
        marks = {(n.meta.get("k31c") or {}).get("superkernel") for n in run}
        if len(marks) > 1 and None not in marks:
            raise CompilerError(f"partition: piece {index} holds superkernels {sorted(marks)}; a "
                                "superkernel run and a piece should be the same run of ops")
        sub, inputs, outputs = _extract(run)
        name = f"piece_{index}"
        gm.add_submodule(name, sub)
        last = run[-1]
        with gm.graph.inserting_after(last):
            call = gm.graph.call_module(name, tuple(inputs))
        call.meta["k31c"] = {"stream": stream_of(last), "region": region_of(last), "piece": name}
        call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
        cursor = call
        for i, out in enumerate(outputs):
            with gm.graph.inserting_after(cursor):
                item = gm.graph.call_function(operator.getitem, (call, i))
            item.meta = {"val": out.meta.get("val"), "k31c": dict(info(out))}
            out.replace_all_uses_with(item, delete_user_cb=lambda u: u not in run)
            cursor = item
        for node in reversed(run):
            gm.graph.erase_node(node)
        mark = next(iter(marks))
        pieces[name] = Piece(name, _key(sub, inputs), stream_of(last), region_of(last), len(run),
                             mark if len(marks) == 1 else None)
    gm.graph.lint()
    gm.recompile()
    return Partition(gm, pieces)


def is_piece_call(node: torch.fx.Node) -> bool:
    return node.op == "call_module" and (node.meta.get("k31c") or {}).get("piece") is not None


