"""The pass manager: registry, the default order, per-pass switches and options, results, dumps.

A pass is a module under k31c/passes/ with one entry point `run(gm, ctx) -> PassResult`,
registered here with `@register_pass(name, stage=..., after=(...), options={...})` (DESIGN §4,
§9: one place orders the passes). Every module of the package is loaded by the registry, so a
pass need not be in the default pipeline to exist; modules that register nothing (helpers) are
loaded too and simply add no pass.

Order is declared twice over, and `resolve` rejects a pipeline that breaks either:
- `stage`: the coarse phase (STAGES, in order); a pipeline never goes back to an earlier stage;
- `after`: passes that must run before this one whenever both are in the pipeline.
Every pass has the option `enabled` (default True unless its registration says otherwise); a
disabled pass stays in the pipeline, is skipped, and its record says so. `disable=[names]`
switches passes off without listing the others.

With `K31C_DUMP_DIR` set, `run_pipeline` writes the canonical text of the graph before and after
every pass that runs: `<dir>/<step>/<NN>_<pass>.before.txt` and `.after.txt`.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

from ..errors import CompilerError, UsageError
from ..graph.printer import format_graph
from ..lowering.targets import Target, get_target

STAGES = ("prepare", "schedule", "rewrite", "group", "lower", "verify")
DEFAULT_PIPELINE = ("canonicalize", "annotate_layers", "indexer_prolog", "fuse_index_write",
                    "fuse_lightning_indexer", "quantize", "merge_projections", "superkernels", "lower",
                    "verify")


@dataclass
class PassResult:
    matches: int           # how many sites the pass found (patterns matched, nodes annotated, ...)
    changed: bool          # whether the graph's nodes or their metadata changed
    notes: list[str] = field(default_factory=list)        # what a reader of the report should know
    stats: dict[str, Any] = field(default_factory=dict)   # machine-readable counts, per pass (its docstring)


@dataclass
class PassInfo:
    name: str
    run: Callable[[torch.fx.GraphModule, "PassContext"], PassResult]
    stage: str
    after: tuple[str, ...]           # passes that run before this one when both are in a pipeline
    options: dict[str, Any]          # option name -> default (always has "enabled")
    doc: str


@dataclass
class PassRecord:
    name: str
    result: PassResult
    seconds: float
    skipped: bool = False            # the pass was disabled: it did not run


@dataclass
class PassContext:
    target: Target
    step: str = "step"                           # "decode", "prefill", "verify4" (dump dir names)
    options: dict[str, dict[str, Any]] = field(default_factory=dict)   # pass -> resolved options
    dims: dict[str, str] = field(default_factory=dict)                 # symbol names for dumps
    records: list[PassRecord] = field(default_factory=list)            # what ran so far, in order

    def opts(self, pass_name: str) -> dict[str, Any]:
        return self.options.get(pass_name, {})

    def stats(self, pass_name: str) -> dict[str, Any]:
        """The stats of `pass_name`'s record in this run ({} if it did not run)."""
        for rec in self.records:
            if rec.name == pass_name and not rec.skipped:
                return rec.result.stats
        return {}

    @property
    def state(self) -> dict[str, Any]:
        """Read-only view of the `lower` record's stats (`kernels`, `fallbacks`) for callers that
        still read them from the context; new code reads `PassRecord.result.stats`."""
        return dict(self.stats("lower"))


_REGISTRY: dict[str, PassInfo] = {}
_loaded = False


def register_pass(name: str, *, stage: str, after: Iterable[str] = (),
                  options: Optional[dict[str, Any]] = None):
    """Decorator on a pass module's `run`:
    `@register_pass("quantize", stage="rewrite", after=("fuse_index_write",), options={"mxfp8_indexer": False})`.
    `options={"enabled": False}` registers a pass that is off unless a pipeline enables it."""
    if stage not in STAGES:
        raise CompilerError(f"pass '{name}': unknown stage '{stage}'; stages: {', '.join(STAGES)}")
    opts = {"enabled": True, **dict(options or {})}

    def deco(fn):
        if name in _REGISTRY and _REGISTRY[name].run is not fn:
            raise CompilerError(f"two passes registered as '{name}'")
        _REGISTRY[name] = PassInfo(name, fn, stage, tuple(after), opts, (fn.__doc__ or "").strip())
        return fn
    return deco


def _load_all() -> None:
    """Import every module of this package once (each pass module registers its pass)."""
    global _loaded
    if _loaded:
        return
    for mod in sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).resolve().parent)])):
        if not mod.startswith("_"):
            importlib.import_module(f"{__package__}.{mod}")
    _loaded = True


def registered() -> dict[str, PassInfo]:
    """Every registered pass: the default pipeline's in its order, then the others by name."""
    _load_all()
    for info in _REGISTRY.values():
        unknown = [a for a in info.after if a not in _REGISTRY]
        if unknown:
            raise CompilerError(f"pass '{info.name}' runs after {unknown}, which are not registered")
    rank = {n: i for i, n in enumerate(DEFAULT_PIPELINE)}
    return {n: _REGISTRY[n] for n in sorted(_REGISTRY, key=lambda n: (rank.get(n, len(rank)), n))}


def get_pass(name: str) -> PassInfo:
    passes = registered()
    if name not in passes:
        raise UsageError(f"unknown pass '{name}'; known passes: {', '.join(passes)}")
    return passes[name]


@dataclass
class Pipeline:
    names: tuple[str, ...]
    options: dict[str, dict[str, Any]]

    def enabled(self, name: str) -> bool:
        return bool(self.options.get(name, {}).get("enabled", True))


def check_order(names: Iterable[str]) -> None:
    """Reject an order that goes back a stage or runs a pass before one it is declared after."""
    names = tuple(names)
    position = {n: i for i, n in enumerate(names)}
    for i, name in enumerate(names):
        info = get_pass(name)
        for prev in names[:i]:
            if STAGES.index(get_pass(prev).stage) > STAGES.index(info.stage):
                raise UsageError(f"pass '{name}' (stage {info.stage}) cannot run after '{prev}' "
                                 f"(stage {get_pass(prev).stage}); stages run in the order {', '.join(STAGES)}")
        for dep in info.after:
            if dep in position and position[dep] > i:
                raise UsageError(f"pass '{name}' must run after '{dep}', but the pipeline {list(names)} "
                                 "puts it before")


def resolve(passes=None, options: Optional[dict[str, dict[str, Any]]] = None,
            disable: Iterable[str] = ()) -> Pipeline:
    """Validate a pipeline. `passes`: None (the default order) or a list of pass names, run in the
    given order (which must respect every pass's stage and `after`). `options`:
    {pass name: {option: value}}; options of passes not in the pipeline are still checked (a typo
    is an error, not a silent no-op). `disable`: pass names to switch off (their `enabled`
    option becomes False). Errors are UsageErrors naming what is wrong."""
    if isinstance(passes, str):
        raise UsageError(f"passes must be a list of pass names, got the string {passes!r}")
    if isinstance(disable, str):
        raise UsageError(f"disable must be a list of pass names, got the string {disable!r}")
    names = DEFAULT_PIPELINE if passes is None else tuple(passes)
    seen = set()
    for name in names:
        get_pass(name)
        if name in seen:
            raise UsageError(f"pass '{name}' appears twice in the pipeline")
        seen.add(name)
    check_order(names)
    resolved = {name: dict(info.options) for name, info in registered().items()}
    for name, opts in (options or {}).items():
        info = get_pass(name)
        if not isinstance(opts, dict):
            raise UsageError(f"options for pass '{name}' must be a dict, got {type(opts).__name__}")
        for key, value in opts.items():
            if key not in info.options:
                known = ", ".join(info.options)
                raise UsageError(f"pass '{name}' has no option '{key}'; its options: {known}")
            default = info.options[key]
            if default is not None and not isinstance(value, type(default)):
                raise UsageError(f"pass '{name}' option '{key}' must be {type(default).__name__}, "
                                 f"got {value!r}")
            resolved[name][key] = value
    disable = list(disable)
    unknown = [d for d in disable if d not in resolved]
    if unknown:
        raise UsageError(f"cannot disable unknown passes {', '.join(map(repr, unknown))}; known passes: "
                         f"{', '.join(resolved)}")
    for name in disable:
        resolved[name]["enabled"] = False
    return Pipeline(names, resolved)


def dump_dir() -> Optional[Path]:
    d = os.environ.get("K31C_DUMP_DIR")
    return Path(d) if d else None


def run_pipeline(gm: torch.fx.GraphModule, pipeline: Pipeline, ctx: PassContext,
                 stop_after: Optional[str] = None) -> list[PassRecord]:
    """Run the enabled passes in order on `gm` (in place), recording a skipped one as such; stop
    after `stop_after` if given. The records are returned and kept in `ctx.records`."""
    if stop_after is not None and stop_after not in pipeline.names:
        get_pass(stop_after)
        raise UsageError(f"pass '{stop_after}' is not in the pipeline {list(pipeline.names)}")
    ctx.options = pipeline.options
    ctx.records = []
    out_dir = dump_dir()
    for i, name in enumerate(pipeline.names):
        info = get_pass(name)
        if not pipeline.enabled(name):
            ctx.records.append(PassRecord(name, PassResult(0, False, ["skipped: disabled"]), 0.0, skipped=True))
        else:
            title = f"{ctx.step} target={ctx.target.name}"
            if out_dir is not None:
                _dump(out_dir / ctx.step / f"{i:02d}_{name}.before.txt",
                      format_graph(gm, title=f"{title} before={name}", dims=ctx.dims))
            start = time.perf_counter()
            result = info.run(gm, ctx)
            if not isinstance(result, PassResult):
                raise CompilerError(f"pass '{name}' returned {type(result).__name__}, not a PassResult")
            gm.graph.lint()
            ctx.records.append(PassRecord(name, result, time.perf_counter() - start))
            if out_dir is not None:
                _dump(out_dir / ctx.step / f"{i:02d}_{name}.after.txt",
                      format_graph(gm, title=f"{title} after={name}", dims=ctx.dims))
        if name == stop_after:
            break
    gm.recompile()
    return list(ctx.records)


def _dump(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def make_context(target: str | Target, step: str = "step", dims=None) -> PassContext:
    t = target if isinstance(target, Target) else get_target(target)
    return PassContext(target=t, step=step, dims=dict(dims or {}))
