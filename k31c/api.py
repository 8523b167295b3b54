"""`k31c.compile`: the front door. Capture → passes → executable program, per step kind.

    compiled = k31c.compile(model, target="cpu")
    logits = compiled(input_ids, meta, caches, mode="decode", rows=1)   # the model's own interface
    Engine(model, step_fn=compiled)                                      # or Engine(compiled)
    print(compiled.report)                                               # what each pass did

A program is built on the first call of each step kind (prefill, decode, verification with R
rows) for the cache pool it is called with, and serves every batch size after that: its batch
dimension is symbolic. `compilations` counts builds per step kind; a call the program does not
cover (another pool geometry, another input structure) is an error naming the input, never a
silent rebuild. `build(step, meta, caches)` builds without running (for inspection, goldens, and
targets that cannot run here).

On the CPU, dense regions run through Inductor (`executor="inductor"`, the default) and the k31c
ops through their reference implementations; `executor="fx"` runs the rewritten graph op by op
(no code generation: quick to build, for tests and debugging). IREE as a CPU executor belongs to
lowering/iree and is loaded only when asked for.

`torch.compile(module, backend="k31c")` runs the same passes on Dynamo's graph (registered below).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .graph.capture import (Captured, StepKind, capture_cached, check_model, clone_graph,
                            flat_step_inputs)
from .lowering.targets import Target, get_target
from .passes.manager import PassContext, PassRecord, Pipeline, resolve, run_pipeline

EXECUTORS = ("inductor", "fx", "iree")
COMPILE_OPTIONS = {"executor": "inductor"}


@dataclass
class StepReport:
    step: str
    capture_seconds: float
    passes: list[PassRecord]
    kernels: dict = field(default_factory=dict)      # (op, kernel) -> count
    fallbacks: dict = field(default_factory=dict)    # op -> reference fallbacks (GPU targets)
    build_seconds: float = 0.0                       # passes + code generation
    executor: str = ""

    def lines(self) -> list[str]:
        out = [f"step {self.step}: capture {self.capture_seconds:.1f}s, passes + {self.executor or 'no'} "
               f"build {self.build_seconds:.1f}s"]
        for rec in self.passes:
            r = rec.result
            out.append(f"  {rec.name:24s} matches={r.matches:<5d} changed={str(r.changed):5s} "
                       f"{rec.seconds:6.2f}s  {'; '.join(r.notes)}")
        if self.fallbacks:
            out.append("  reference fallbacks: "
                       + ", ".join(f"{op} x{n}" for op, n in sorted(self.fallbacks.items())))
        return out


@dataclass
class CompileReport:
    target: str
    pipeline: tuple[str, ...]
    options: dict[str, Any]
    steps: dict[str, StepReport] = field(default_factory=dict)

    def fallbacks(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for s in self.steps.values():
            for op, n in s.fallbacks.items():
                total[op] = total.get(op, 0) + n
        return total

    def __str__(self) -> str:
        lines = [f"k31c compile: target={self.target} passes={','.join(self.pipeline)}"]
        for s in self.steps.values():
            lines += s.lines()
        return "\n".join(lines)


@dataclass
class Program:
    captured: Captured
    gm: torch.fx.GraphModule                 # the graph after the passes
    placeholders: list[torch.fx.Node]
    fn: Optional[Any]                        # callable(*weights, *step inputs) -> (logits,)


def split_options(options: Optional[dict]) -> tuple[dict, dict]:
    """Split `options` into compile options and per-pass options; unknown keys are errors."""
    from .passes.manager import registered
    compile_opts, pass_opts = dict(COMPILE_OPTIONS), {}
    passes = registered()
    for key, value in (options or {}).items():
        if key in COMPILE_OPTIONS:
            compile_opts[key] = value
        elif key in passes:
            pass_opts[key] = value
        else:
            raise ValueError(f"unknown option '{key}'; compile options: {', '.join(COMPILE_OPTIONS)}; "
                             f"pass options go under a pass name: {', '.join(passes)}")
    if compile_opts["executor"] not in EXECUTORS:
        raise ValueError(f"option executor must be one of {EXECUTORS}, got {compile_opts['executor']!r}")
    return compile_opts, pass_opts


def make_executor(gm: torch.fx.GraphModule, example_inputs: list, executor: str, target: Target):
    """A callable running `gm` (not modified) on real inputs."""
    if executor == "fx":
        return clone_graph(gm)
    if executor == "iree":
        try:
            from .lowering.iree import executor as iree_executor  # lazy: IREE is optional
        except ImportError as e:
            raise ValueError("executor 'iree' needs k31c.lowering.iree.executor, which is not "
                             f"available here ({e})") from None
        return iree_executor.build(gm, example_inputs, target)
    from torch._inductor.compile_fx import compile_fx
    with torch.no_grad():
        return compile_fx(clone_graph(gm), example_inputs)


class CompiledModel:
    def __init__(self, model, target: Target, pipeline: Pipeline, compile_opts: dict):
        self.model = model
        self.target = target
        self.pipeline = pipeline
        self.executor = compile_opts["executor"]
        self.report = CompileReport(target.name, pipeline.names,
                                    {**compile_opts, **{k: v for k, v in pipeline.options.items() if v}})
        self.compilations: dict[str, int] = {}
        self._programs: dict[StepKind, Program] = {}

    # Engine(compiled) works like Engine(model): it reads these two.
    @property
    def config(self):
        return self.model.config

    def parameters(self):
        return self.model.parameters()

    @property
    def graphs(self) -> dict[str, torch.fx.GraphModule]:
        """Step name -> the graph after the passes."""
        return {step.name: p.gm for step, p in self._programs.items()}

    def build(self, step: StepKind, meta, caches, stop_after: Optional[str] = None,
              executable: bool = True) -> Program:
        """Capture (once per step kind) and run the passes; with `executable`, generate code."""
        if executable:
            self._check_runnable()
        captured = capture_cached(self.model, step, meta, caches)
        start = time.perf_counter()
        gm = clone_graph(captured.gm)
        ctx = PassContext(target=self.target, step=step.name, dims=captured.dims)
        records = run_pipeline(gm, self.pipeline, ctx, stop_after=stop_after)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        fn = None
        if executable:
            fn = make_executor(gm, [n.meta["val"] for n in placeholders], self.executor, self.target)
        report = StepReport(step.name, captured.seconds, records, ctx.state.get("kernels", {}),
                            ctx.state.get("fallbacks", {}), time.perf_counter() - start,
                            self.executor if executable else "")
        program = Program(captured, gm, placeholders, fn)
        if stop_after is None:
            self._programs[step] = program
            self.compilations[step.name] = self.compilations.get(step.name, 0) + 1
            self.report.steps[step.name] = report
        return program

    def _check_runnable(self) -> None:
        t = self.target
        if not t.runnable_here:
            raise ValueError(f"target '{t.name}' is compile-only here: its programs are built and "
                             "inspected, not run (use build(..., executable=False))")
        if t.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"target '{t.name}' runs on a CUDA device and this machine has none")

    def __call__(self, input_ids, meta, caches, mode: str = "prefill", rows: int = 1):
        step = StepKind(mode, rows)
        program = self._programs.get(step)
        if program is None or program.fn is None:
            program = self.build(step, meta, caches)
        flat = flat_step_inputs(program.captured, program.placeholders, input_ids, meta, caches)
        with torch.no_grad():
            out = program.fn(*flat)
        return out[0]


def compile(model, target: str = "cpu", passes=None, options: Optional[dict] = None) -> CompiledModel:
    """Compile a K3.1 model for `target` ("cpu", "h200", "mi350x").

    passes:  None for the default pipeline, or the list of pass names to run, in order
             (e.g. the default list without one pass).
    options: {"executor": "inductor" | "fx" | "iree"} and per-pass options under the pass name,
             e.g. {"quantize": {"mxfp8_indexer": True}}.
    Unknown models, targets, passes and options are errors naming them."""
    check_model(model)
    t = get_target(target) if isinstance(target, str) else target
    compile_opts, pass_opts = split_options(options)
    return CompiledModel(model, t, resolve(passes, pass_opts), compile_opts)


# ---- torch.compile(backend="k31c") ---------------------------------------------------------------

BACKEND_COMPILES: list[dict] = []      # one entry per graph the Dynamo backend compiled


def backend(target: str = "cpu", passes=None, options: Optional[dict] = None):
    """A Dynamo backend running the k31c passes: `torch.compile(m, backend=k31c.api.backend(...))`."""
    from .graph.capture import dynamo_to_aten
    t = get_target(target)
    compile_opts, pass_opts = split_options(options)
    pipeline = resolve(passes, pass_opts)

    def compile_graph(gm: torch.fx.GraphModule, example_inputs):
        start = time.perf_counter()
        aten = dynamo_to_aten(gm, example_inputs)
        ctx = PassContext(target=t, step=f"dynamo{len(BACKEND_COMPILES)}")
        records = run_pipeline(aten, pipeline, ctx)
        fn = make_executor(aten, list(example_inputs), compile_opts["executor"], t)
        BACKEND_COMPILES.append({"step": ctx.step, "nodes": len(aten.graph.nodes), "passes": records,
                                 "seconds": time.perf_counter() - start})

        def run(*args):
            with torch.no_grad():
                return fn(*args)
        return run
    return compile_graph


dynamo_backend = backend()     # the default one, registered as "k31c" (also an entry-point target)


def _register_backend() -> None:
    from torch._dynamo import list_backends, register_backend
    if "k31c" not in list_backends(exclude_tags=()):
        register_backend(name="k31c")(dynamo_backend)


_register_backend()
