"""A Program (program.py) as a JSON-able record, and back: what the compile cache stores of a
program besides its compiled dense pieces.

The steps are plain data; a Kernel step's callable is not stored but bound again on load from
the registry (the kernel the op has on the target) or, for "reference", the op itself. The
registry's code is part of the cache key (the k31c sources), so the kernel found is the one the
program was built with; one that is gone is an error. Constant arguments keep their Python type
(tuples, dtypes); a constant of another type makes the program unrecordable (ValueError).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .program import Dense, Kernel, Program, Record, Ref, Refs, Wait
from .registry import lookup
from .targets import Target

_SCALARS = (bool, int, float, str, type(None))


def _arg(a) -> Any:
    if isinstance(a, Ref):
        return {"ref": a.slot}
    if isinstance(a, Refs):
        return {"refs": list(a.slots)}
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).replace("torch.", "")}
    if isinstance(a, (tuple, list)):
        return {"tuple" if isinstance(a, tuple) else "list": [_arg(x) for x in a]}
    if isinstance(a, _SCALARS) and not (isinstance(a, float) and a != a):
        return a
    raise ValueError(f"a kernel argument of type {type(a).__name__} ({a!r}) has no record")


def _unarg(a) -> Any:
    if not isinstance(a, dict):
        return a
    (kind, v), = a.items()
    if kind == "ref":
        return Ref(v)
    if kind == "refs":
        return Refs(tuple(v))
    if kind == "dtype":
        return getattr(torch, v)
    return (tuple if kind == "tuple" else list)(_unarg(x) for x in v)


def program_record(p: Program) -> dict:
    steps = []
    for s in p.steps:
        if isinstance(s, Dense):
            steps.append({"dense": [s.piece, s.stream, list(s.args), list(s.outs), list(s.free), s.weights_only]})
        elif isinstance(s, Kernel):
            steps.append({"kernel": [s.op, s.kernel, s.stream, [_arg(a) for a in s.args], list(s.outs),
                                     list(s.free)]})
        else:
            steps.append({type(s).__name__.lower(): [s.event, s.stream, list(s.free)]})
    return {"name": p.name, "target": p.target, "steps": steps, "piece_names": p.piece_names,
            "n_inputs": p.n_inputs, "n_slots": p.n_slots, "outputs": list(p.outputs),
            "dense_codegen": p.dense_codegen, "stats": p.stats, "input_names": p.input_names}


def _bind(op: str, kernel: str, target: Target) -> Callable:
    if kernel == "reference":
        return getattr(torch.ops.k31c, op.split("::")[-1]).default
    registered = lookup(op, target.name)
    if registered is None:
        raise ValueError(f"{op}: the program calls {kernel}, and {target.name} has no kernel for it now")
    return registered.fn


def program_from_record(r: dict, pieces: list[Callable], target: Target) -> Program:
    """The Program of a record, its dense pieces given (compiled, loaded), its kernels bound."""
    steps = []
    for s in r["steps"]:
        (kind, v), = s.items()
        if kind == "dense":
            piece, stream, args, outs, free, weights_only = v
            steps.append(Dense(piece, stream, tuple(args), tuple(outs), tuple(free), weights_only))
        elif kind == "kernel":
            op, kernel, stream, args, outs, free = v
            steps.append(Kernel(op, kernel, _bind(op, kernel, target), stream, tuple(_unarg(a) for a in args),
                                tuple(outs), tuple(free)))
        else:
            event, stream, free = v
            steps.append((Record if kind == "record" else Wait)(event, stream, tuple(free)))
    if len(pieces) != len(r["piece_names"]):
        raise ValueError(f"the program has {len(r['piece_names'])} dense pieces, {len(pieces)} were loaded")
    return Program(r["name"], r["target"], steps, pieces, r["piece_names"], r["n_inputs"], r["n_slots"],
                   tuple(r["outputs"]), r["dense_codegen"], r["stats"], r["input_names"])
