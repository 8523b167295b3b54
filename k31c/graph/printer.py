"""Canonical text of a captured graph: the form of dumps, goldens and `k31c inspect`.

Deterministic by construction: names come from the module path and the op
(`layers.3.self_attn.indexer.wk/linear`, then `#1`, `#2` for repeats), never from addresses or
trace counters; symbolic sizes are printed by meaning (`B` requests, `T` prefill tokens) and
unnamed ones as s0, s1, ... in order of appearance; metadata is sorted; every op shows
`stream=N`. Inputs are `%name`, weights `@path`.

    %layers.3.self_attn.indexer.wk/linear = aten.linear(%layers.3.input_layernorm/mul#1,
        @layers.3.self_attn.indexer.wk.weight) : f32[B, 32]  stream=1  {branch=key, kind=mla, ...}
"""
from __future__ import annotations

import operator
from typing import Optional

import sympy
import torch

from .capture import module_path
from .ops import is_k31c

_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64",
           torch.float8_e4m3fn: "f8e4m3", torch.float8_e5m2: "f8e5m2", torch.int64: "i64",
           torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "bool"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPES.get(dtype, str(dtype).replace("torch.", ""))


def op_name(target) -> str:
    """Qualified op name: `aten.linear`, `aten.mul.Tensor`, `k31c.sparse_mla`, `getitem`."""
    if isinstance(target, torch._ops.OpOverload):
        ns, name = target.namespace, target._schema.name.split("::")[-1]
        overload = target._overloadname
        return f"{ns}.{name}" if overload == "default" else f"{ns}.{name}.{overload}"
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, str):            # call_method
        return f".{target}"
    return getattr(target, "__name__", str(target))


def short_op(target) -> str:
    """The op part of a node name: `linear`, `index_cache_write`."""
    name = op_name(target)
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return name.lstrip(".")


class _Symbols:
    """Prints sympy expressions with meaningful symbol names, the rest as s0, s1, ..."""

    def __init__(self, dims: Optional[dict[str, str]]):
        self.names = {k: v for k, v in (dims or {}).items()}
        self.count = 0

    def expr(self, e) -> str:
        e = sympy.sympify(e)
        subs = {}
        for s in sorted(e.free_symbols, key=lambda s: s.name):
            if s.name not in self.names:
                self.names[s.name] = f"s{self.count}"
                self.count += 1
            subs[s] = sympy.Symbol(self.names[s.name], positive=True, integer=True)
        return str(e.xreplace(subs))

    def size(self, d) -> str:
        return self.expr(d.node.expr) if isinstance(d, torch.SymInt) else str(d)


def node_names(gm) -> dict[torch.fx.Node, str]:
    """The canonical name of every node of a graph (or graph module), as dumps print them."""
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    names, seen = {}, {}
    for node in graph.nodes:
        if node.op == "placeholder":
            base = node.meta.get("k31c_input", node.name)
            names[node] = ("@" if node.meta.get("k31c_weight") else "%") + base
            continue
        if node.op == "output":
            continue
        path = module_path(node)
        base = f"{path}/{short_op(node.target)}" if path else short_op(node.target)
        k = seen.get(base, 0)
        seen[base] = k + 1
        names[node] = "%" + (base if k == 0 else f"{base}#{k}")
    return names


def display_name(node: torch.fx.Node) -> str:
    """A node's name as the dumps print it (`%layers.3.self_attn.indexer.k_norm/layer_norm`,
    `%meta.slot_mapping`, `@lm_head.weight`): what error messages call it."""
    if node.op == "output":
        return "output"
    return node_names(node.graph).get(node, node.name)


def _value_type(val, sym: _Symbols) -> str:
    if isinstance(val, torch.Tensor):
        return f"{dtype_name(val.dtype)}[{', '.join(sym.size(d) for d in val.shape)}]"
    if isinstance(val, (list, tuple)):
        return "(" + ", ".join(_value_type(v, sym) for v in val) + ")"
    if isinstance(val, torch.SymInt):
        return f"sym({sym.size(val)})"
    if val is None:
        return ""
    return type(val).__name__


def _arg(a, names, sym: _Symbols) -> str:
    if isinstance(a, torch.fx.Node):
        return names.get(a, a.name)
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x, names, sym) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, torch.dtype):
        return dtype_name(a)
    if isinstance(a, str):
        return repr(a)
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return sym.expr(a.node.expr)
    if isinstance(a, float):
        return repr(a)
    return str(a)


def _meta(node) -> str:
    info = node.meta.get("k31c") or {}
    items = [f"{k}={info[k]}" for k in sorted(info) if k != "stream" and info[k] is not None]
    return "  {" + ", ".join(items) + "}" if items else ""


def format_graph(gm: torch.fx.GraphModule, *, title: str = "",
                 dims: Optional[dict[str, str]] = None, only_k31c: bool = False,
                 layer: Optional[int] = None) -> str:
    """The canonical text. `only_k31c`: just the k31c ops and stream markers (what lowering
    decides per target), without inputs, weights and dense ops. `layer`: just the ops of that
    decoder layer (`meta["k31c"]["layer"]`, set by annotate_layers), without inputs and weights.
    Names and symbols are those of the whole graph either way."""
    sym = _Symbols(dims)
    names = node_names(gm)
    lines = ["# k31c graph" + (f": {title}" if title else "")]
    inputs, weights, body, output = [], [], [], ""
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            row = f"  {names[node]} : {_value_type(node.meta.get('val'), sym)}"
            (weights if node.meta.get("k31c_weight") else inputs).append(row)
        elif node.op == "output":
            output = f"output {_arg(node.args[0], names, sym)}"
        else:
            if (only_k31c and not is_k31c(node)) or \
                    (layer is not None and (node.meta.get("k31c") or {}).get("layer") != layer):
                _value_type(node.meta.get("val"), sym)       # keep s0, s1, ... numbering stable
                continue
            args = [_arg(a, names, sym) for a in node.args]
            args += [f"{k}={_arg(v, names, sym)}" for k, v in sorted(node.kwargs.items())]
            typ = _value_type(node.meta.get("val"), sym)
            stream = (node.meta.get("k31c") or {}).get("stream", 0)
            body.append(f"  {names[node]} = {op_name(node.target)}({', '.join(args)})"
                        + (f" : {typ}" if typ else "") + f"  stream={stream}" + _meta(node))
    if not only_k31c and layer is None:
        lines += ["inputs:"] + inputs + ["weights:"] + weights
    lines += ["nodes:"] + body + [output]
    return "\n".join(lines) + "\n"
