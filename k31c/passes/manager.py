"""The pass manager: registry, the default order, per-pass switches and options, results, dumps.

A pass is a module with one entry point `run(gm, ctx) -> PassResult` registered here under its
name with its options and their defaults (DESIGN §4, §9: one place orders the passes). A pipeline
is a list of names; `resolve` validates it and the options (unknown names are errors naming
them). With `K31C_DUMP_DIR` set, `run_pipeline` writes the canonical text of the graph before and
after every pass: `<dir>/<step>/<NN>_<pass>.before.txt` and `.after.txt`.
"""
from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..graph.printer import format_graph
from ..lowering.targets import Target, get_target

DEFAULT_PIPELINE = ("canonicalize", "annotate_layers", "indexer_prolog", "fuse_index_write",
                    "fuse_lightning_indexer", "quantize", "superkernels", "lower", "verify")


@dataclass
class PassResult:
    matches: int           # how many sites the pass found (patterns matched, nodes annotated, ...)
    changed: bool          # whether the graph's nodes or their metadata changed
    notes: list[str] = field(default_factory=list)   # what a reader of the report should know


@dataclass
class PassInfo:
    name: str
    run: Callable[[torch.fx.GraphModule, "PassContext"], PassResult]
    options: dict[str, Any]          # option name -> default
    doc: str


@dataclass
class PassContext:
    target: Target
    step: str = "step"                           # "decode", "prefill", "verify4" (dump dir names)
    options: dict[str, dict[str, Any]] = field(default_factory=dict)   # pass -> resolved options
    dims: dict[str, str] = field(default_factory=dict)                 # symbol names for dumps
    state: dict[str, Any] = field(default_factory=dict)                # passes share findings here

    def opts(self, pass_name: str) -> dict[str, Any]:
        return self.options.get(pass_name, {})


@dataclass
class PassRecord:
    name: str
    result: PassResult
    seconds: float


_REGISTRY: dict[str, PassInfo] = {}


def register_pass(name: str, options: Optional[dict[str, Any]] = None):
    """Decorator on a pass module's `run`: `@register_pass("quantize", {"mxfp8_indexer": False})`."""
    def deco(fn):
        if name in _REGISTRY and _REGISTRY[name].run is not fn:
            raise ValueError(f"two passes registered as '{name}'")
        _REGISTRY[name] = PassInfo(name, fn, dict(options or {}), (fn.__doc__ or "").strip())
        return fn
    return deco


def _load_builtin() -> None:
    for name in DEFAULT_PIPELINE:
        importlib.import_module(f"{__package__}.{name}")


def registered() -> dict[str, PassInfo]:
    _load_builtin()
    return dict(_REGISTRY)


def get_pass(name: str) -> PassInfo:
    passes = registered()
    if name not in passes:
        raise ValueError(f"unknown pass '{name}'; known passes: {', '.join(passes)}")
    return passes[name]


@dataclass
class Pipeline:
    names: tuple[str, ...]
    options: dict[str, dict[str, Any]]


def resolve(passes=None, options: Optional[dict[str, dict[str, Any]]] = None) -> Pipeline:
    """Validate a pipeline. `passes`: None (the default order) or a list of pass names, run in the
    given order. `options`: {pass name: {option: value}}; options of passes not in the pipeline are
    still checked (a typo is an error, not a silent no-op)."""
    names = DEFAULT_PIPELINE if passes is None else tuple(passes)
    if isinstance(passes, str):
        raise ValueError(f"passes must be a list of pass names, got the string {passes!r}")
    seen = set()
    for name in names:
        get_pass(name)
        if name in seen:
            raise ValueError(f"pass '{name}' appears twice in the pipeline")
        seen.add(name)
    resolved = {}
    for name in registered():
        resolved[name] = dict(_REGISTRY[name].options)
    for name, opts in (options or {}).items():
        info = get_pass(name)
        if not isinstance(opts, dict):
            raise ValueError(f"options for pass '{name}' must be a dict, got {type(opts).__name__}")
        for key, value in opts.items():
            if key not in info.options:
                known = ", ".join(info.options) or "none"
                raise ValueError(f"pass '{name}' has no option '{key}'; its options: {known}")
            default = info.options[key]
            if default is not None and not isinstance(value, type(default)):
                raise ValueError(f"pass '{name}' option '{key}' must be {type(default).__name__}, "
                                 f"got {value!r}")
            resolved[name][key] = value
    return Pipeline(names, resolved)


def dump_dir() -> Optional[Path]:
    d = os.environ.get("K31C_DUMP_DIR")
    return Path(d) if d else None


def run_pipeline(gm: torch.fx.GraphModule, pipeline: Pipeline, ctx: PassContext,
                 stop_after: Optional[str] = None) -> list[PassRecord]:
    """Run the passes in order on `gm` (in place); stop after `stop_after` if given."""
    if stop_after is not None and stop_after not in pipeline.names:
        get_pass(stop_after)
        raise ValueError(f"pass '{stop_after}' is not in the pipeline {list(pipeline.names)}")
    ctx.options = pipeline.options
    out_dir = dump_dir()
    records = []
    for i, name in enumerate(pipeline.names):
        info = get_pass(name)
        title = f"{ctx.step} target={ctx.target.name}"
        if out_dir is not None:
            _dump(out_dir / ctx.step / f"{i:02d}_{name}.before.txt",
                  format_graph(gm, title=f"{title} before={name}", dims=ctx.dims))
        start = time.perf_counter()
        result = info.run(gm, ctx)
        if not isinstance(result, PassResult):
            raise TypeError(f"pass '{name}' returned {type(result).__name__}, not a PassResult")
        gm.graph.lint()
        records.append(PassRecord(name, result, time.perf_counter() - start))
        if out_dir is not None:
            _dump(out_dir / ctx.step / f"{i:02d}_{name}.after.txt",
                  format_graph(gm, title=f"{title} after={name}", dims=ctx.dims))
        if name == stop_after:
            break
    gm.recompile()
    return records


def _dump(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def make_context(target: str | Target, step: str = "step", dims=None) -> PassContext:
    t = target if isinstance(target, Target) else get_target(target)
    return PassContext(target=t, step=step, dims=dict(dims or {}))
