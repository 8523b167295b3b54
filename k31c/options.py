"""Compile options: their names and defaults, their checks (errors name the bad option), and
the target record a program is built for once they are applied. What they do:

Executors (`options={"executor": ...}`):
- `program` (the default on GPU targets): `passes/partition.py` splits the graph into dense pieces
  between the k31c ops and stream markers, `lowering/build.py` compiles each distinct piece
  and binds every k31c op to its registered kernel, and `runtime/executor.py` runs the
  result on real streams; decode and verification steps replay one device graph per batch bucket
  (`runtime/graphs.py`). Its options: `dense_codegen` (who compiles the pieces: "inductor",
  "iree" (lowering/iree.py; mi350x's default, built and not run; on the cpu target it runs), or
  "fx" (none); default: the target record's), `device_graphs`,
  `buckets`, `streams`, `pdl` (programmatic dependent launch of the k31c kernels and the dense
  pieces' kernels on sm_90+: each kernel may launch while the one before it runs and waits at its
  first line; default: the target record's `pdl`). On a machine without a GPU it runs a GPU
  target's program on CPU tensors when `TRITON_INTERPRET=1` (the Triton kernels in the
  interpreter, no device graph).
- `inductor` (the default on the CPU): `compile_fx` on the rewritten graph; the k31c ops run their
  reference implementations (on the CPU those are its kernels).
- `fx`: the rewritten graph op by op (no code generation: quick to build, for tests and debugging).
The report counts the kernels each step calls from what the built program executes: a GPU-target
step run through its references says so as fallbacks.

Executors `program` (dense_codegen "inductor" or "iree") and `inductor` store what they build in
the compile cache and load it when it is there (`options={"cache": DIR | True | False}`;
cached_program.py says where by default).
Any other key names a pass's option (`passes/`; `k31c.compile`'s errors list them).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Optional

from .cached_program import cache_root
from .errors import UsageError
from .lowering import iree
from .lowering.build import DENSE_CODEGENS
from .lowering.targets import Target
from .runtime.graphs import DEFAULT_BUCKETS, check_buckets

EXECUTORS = ("inductor", "fx", "program")
COMPILE_OPTIONS = {"executor": None, "dense_codegen": None, "device_graphs": None,
                   "buckets": DEFAULT_BUCKETS, "streams": None, "pdl": None, "cache": None}


def split_options(options: Optional[dict], target: Target) -> tuple[dict, dict]:
    """Split `options` into compile options (defaults per target) and per-pass options; unknown
    keys and bad values are errors naming them."""
    from .passes.manager import registered
    compile_opts, pass_opts = dict(COMPILE_OPTIONS), {}
    passes = registered()
    if options is not None and not isinstance(options, Mapping):
        raise UsageError(f"options must be a dict of option names to values, got {options!r}")
    for key, value in (options or {}).items():
        if key in COMPILE_OPTIONS:
            compile_opts[key] = value
        elif key in passes:
            pass_opts[key] = value
        else:
            raise UsageError(f"unknown option '{key}'; compile options: {', '.join(COMPILE_OPTIONS)}; "
                             f"pass options go under a pass name: {', '.join(passes)}")
    if compile_opts["executor"] is None:
        compile_opts["executor"] = target.executor
    if compile_opts["executor"] not in EXECUTORS:
        raise UsageError(f"option executor must be one of {EXECUTORS}, got {compile_opts['executor']!r}")
    if compile_opts["dense_codegen"] is None:
        compile_opts["dense_codegen"] = target.dense_codegen
    if compile_opts["dense_codegen"] not in DENSE_CODEGENS:
        raise UsageError(f"option dense_codegen must be one of {DENSE_CODEGENS}, "
                         f"got {compile_opts['dense_codegen']!r}")
    if compile_opts["dense_codegen"] == "iree":
        if compile_opts["executor"] != "program":
            raise UsageError(f"option dense_codegen 'iree' compiles the dense pieces of executor 'program'; "
                             f"executor is {compile_opts['executor']!r}")
        iree.check_target(target)
    if compile_opts["device_graphs"] is None:
        compile_opts["device_graphs"] = target.device_graphs
    if not isinstance(compile_opts["device_graphs"], bool):
        raise UsageError(f"option device_graphs must be True or False, got {compile_opts['device_graphs']!r}")
    buckets = compile_opts["buckets"]
    try:
        compile_opts["buckets"] = check_buckets(buckets)
    except ValueError:      # check_buckets names the items it iterated (a dict's keys): name the value
        raise UsageError(f"option buckets must be a list of positive batch sizes (e.g. [1, 2, 4, 8]), "
                         f"got {buckets!r}") from None
    if compile_opts["pdl"] is None:
        compile_opts["pdl"] = target.pdl
    if not isinstance(compile_opts["pdl"], bool):
        raise UsageError(f"option pdl must be True or False, got {compile_opts['pdl']!r}")
    if compile_opts["pdl"] and target.triton_backend != "cuda":
        raise UsageError(f"option pdl: target '{target.name}' has no programmatic dependent launch "
                         "(CUDA sm_90 and later only)")
    streams = compile_opts["streams"]
    if streams is None:
        compile_opts["streams"] = target.graph_streams
    elif isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise UsageError(f"option streams must be a positive integer (1: one stream), got {streams!r}")
    cache_root(compile_opts["cache"])              # a bad value is an error naming it
    return compile_opts, pass_opts


def program_target(target: Target, compile_opts: dict) -> Target:
    """`target` with the options that its record carries applied (the program's kernels and dense
    pieces read them from the record): `pdl`."""
    if compile_opts["pdl"] == target.pdl:
        return target
    return dataclasses.replace(target, pdl=compile_opts["pdl"])
