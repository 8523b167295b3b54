"""The checks of a captured step's inputs: what each flattened input must look like (dtype, rank,
device, fixed sizes, sizes bound to a symbol or derived from others), built once per capture or
read back from a compile-cache record, and `flat_step_inputs`, which checks a call's inputs
against them before the program runs (a mismatch is an error naming the input, not a wrong
result)."""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch

from .capture import Captured
from .step import step_leaves


@dataclass(frozen=True)
class _LeafCheck:
    name: str
    dtype: torch.dtype
    ndim: int
    device: str
    static: tuple                      # (dim, size) of fixed sizes
    binds: tuple                       # (dim, symbol name) of sizes that are a bare symbol
    derived: tuple                     # (dim, text, fn(*sizes of syms) -> size, syms) of the other sizes


def _leaf_checks(captured: Captured, placeholders: list[torch.fx.Node]) -> list[_LeafCheck]:
    """What each step input must look like, with symbolic sizes compiled to functions once (a
    sympy substitution per size and call cost most of a decode step's host time)."""
    if captured.leaf_checks is None:
        checks = []
        for node, info in zip(placeholders, captured.inputs):
            if info.is_weight:
                continue
            val = node.meta["val"]
            static, binds, derived = [], [], []
            for d, want in enumerate(val.shape):
                if not isinstance(want, torch.SymInt):
                    static.append((d, want))
                elif isinstance(want.node.expr, sympy.Symbol):
                    binds.append((d, want.node.expr.name))
                else:
                    expr = want.node.expr
                    syms = sorted(expr.free_symbols, key=lambda x: x.name)
                    fn = sympy.lambdify([sympy.Symbol(x.name) for x in syms],
                                        expr.xreplace({x: sympy.Symbol(x.name) for x in syms}), "math")
                    derived.append((d, str(expr), fn, tuple(x.name for x in syms)))
            checks.append(_LeafCheck(info.name, val.dtype, val.dim(), val.device.type, tuple(static),
                                     tuple(binds), tuple(derived)))
        captured.leaf_checks = checks
    return captured.leaf_checks


def leaf_checks_record(captured: Captured, placeholders: list[torch.fx.Node]) -> list[dict]:
    """The step inputs' checks as JSON-able records (the compile cache stores them)."""
    return [{"name": c.name, "dtype": str(c.dtype).replace("torch.", ""), "ndim": c.ndim, "device": c.device,
             "static": [list(s) for s in c.static], "binds": [list(b) for b in c.binds],
             "derived": [[d, text, list(syms)] for d, text, _, syms in c.derived]}
            for c in _leaf_checks(captured, placeholders)]


def leaf_checks_from_record(records: list[dict]) -> list[_LeafCheck]:
    """`leaf_checks_record`'s records as checks again (the derived sizes compiled once more)."""
    checks = []
    for r in records:
        dtype = getattr(torch, r["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{r['name']}: unknown dtype {r['dtype']!r}")
        derived = []
        for d, text, syms in r["derived"]:
            symbols = [sympy.Symbol(s) for s in syms]
            expr = sympy.sympify(text, locals={s.name: s for s in symbols})
            derived.append((d, text, sympy.lambdify(symbols, expr, "math"), tuple(syms)))
        checks.append(_LeafCheck(r["name"], dtype, r["ndim"], r["device"], tuple(map(tuple, r["static"])),
                                 tuple(map(tuple, r["binds"])), tuple(derived)))
    return checks


def flat_step_inputs(captured: Captured, placeholders: list[torch.fx.Node], input_ids, meta, caches,
                     host_step_inputs: bool = False):
    """Weights + flattened step inputs in placeholder order, after checking that the program covers
    these shapes (a mismatch would need a new capture: it is an error naming the input). With
    `host_step_inputs`, token ids and metadata may also be host tensors (device graphs stage them)."""
    try:
        leaves = step_leaves(input_ids, meta, caches)
    except AttributeError as e:
        raise ValueError(f"step inputs: expected (input_ids, StepMeta, Caches): {e}") from None
    checks = _leaf_checks(captured, placeholders)
    if (caches.kda_snapshots is not None) != captured.step.snapshots or len(leaves) != len(checks):
        raise ValueError(f"step inputs: their structure differs from the captured {captured.step.name} "
                         f"step's (kda_snapshots present: {caches.kda_snapshots is not None}; "
                         f"the graph was captured with {captured.step.snapshots})")
    bound: dict[str, int] = {}
    passed = captured.passed_leaves
    for i, (c, t) in enumerate(zip(checks, leaves)):
        if passed.get(i) is t:               # the same pool tensor as last step: sizes cannot differ
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != c.dtype or t.dim() != c.ndim:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{c.name}: expected {c.dtype} with {c.ndim} dims, got {got}")
        if t.device.type != c.device and not (host_step_inputs and t.device.type == "cpu"
                                              and (c.name == "input_ids" or c.name.startswith("meta."))):
            raise ValueError(f"{c.name}: on {t.device}, the program runs on {c.device}")
        shape = t.shape
        for d, want in c.static:
            if shape[d] != want:
                raise ValueError(f"{c.name}: dim {d} is {shape[d]}, the {captured.step.name} program was "
                                 f"captured for {want} (a different cache pool needs a new compile)")
        for d, sym in c.binds:
            bound.setdefault(sym, shape[d])
        if not c.binds and not c.derived:
            passed[i] = t
    for c, t in zip(checks, leaves):
        for d, sym in c.binds:
            if t.shape[d] != bound[sym] or t.shape[d] < 1:
                raise ValueError(f"{c.name}: dim {d} is {t.shape[d]}, expected {bound[sym]} ({sym}) "
                                 "from the other inputs")
        for d, text, fn, syms in c.derived:
            expect = int(fn(*(bound[x] for x in syms)))
            if expect != t.shape[d] or t.shape[d] < 1:
                raise ValueError(f"{c.name}: dim {d} is {t.shape[d]}, expected {expect} ({text}) "
                                 "from the other inputs")
    return captured.weights + leaves
