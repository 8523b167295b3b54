"""`k31c.compile`: the front door. Capture → passes → executable program, per step kind.

    compiled = k31c.compile(model, target="cpu")
    logits = compiled(input_ids, meta, caches, mode="decode", rows=1)   # the model's own interface
    Engine(model, step_fn=compiled)                                      # or Engine(compiled)
    print(compiled.report)                                               # what each pass did

The step's token ids and metadata may be device or host tensors (the Engine passes host ones: a
replayed decode graph stages them itself, runtime/staging.py; other calls copy them over once).
A program is built on the first call of each step kind (prefill, decode, verification with R
rows) for the cache pool it is called with, and serves every batch size after that: its batch
dimension is symbolic. `compilations` counts builds per step kind; a call the program does not
cover (another pool geometry, another input structure) is an error naming the input, never a
silent rebuild. `build(step, meta, caches)` builds without running (for inspection, goldens, and
targets that cannot run here).

The options (`options={...}`: the executors, the compile cache, the passes' own) are described in
options.py.
`torch.compile(module, backend="k31c")` runs the same passes on Dynamo's graph (backend.py).
"""
from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .backend import make_executor
from .cached_program import (Loaded, ProgramCache, cache_root, compile_graph, factors, step_inputs_from_record,
                             step_inputs_record)
from .compile_cache import Unwritable
from .compile_report import CompileReport, StepReport, changed_options, describe_program, reference_counts
from .errors import ArtifactError, CompilerError, UsageError
from .graph.capture import Captured, StepKind, capture_cached, check_model, clone_graph
from .graph.input_checks import flat_step_inputs
from .graph.step import caches_device, step_meta, step_to_device
from .lowering.build import build_program
from .lowering.program import Program as KernelProgram
from .lowering.program_record import program_from_record, program_record
from .lowering.targets import Target, get_target
from .lowering.triton.device import interpreting
from .options import program_target, split_options
from .passes.manager import PassContext, Pipeline, resolve, run_pipeline
from .passes.partition import partition
from .runtime.executor import Executor
from .runtime.graphs import DecodeGraphs
from .runtime.jit_ahead import compile_ahead, default_workers
from .runtime.staging import StepInputs, decode_step_inputs

@dataclass
class Program:
    captured: Captured
    gm: Optional[torch.fx.GraphModule]       # the graph after the passes (None: loaded from the cache)
    placeholders: list[torch.fx.Node]
    fn: Optional[Any]                        # callable(*weights, *step inputs) -> (logits,)
    kernels: Optional[KernelProgram] = None  # the program executor's steps
    executor: Optional[Executor] = None
    graphs: Optional[DecodeGraphs] = None    # device graphs of a decode step kind


def _say(message: str) -> None:
    print(f"k31c: {message}", file=sys.stderr, flush=True)


def _progress(message: str) -> None:
    if sys.stderr.isatty():
        print(f"\r\033[Kk31c: {message}", end="", file=sys.stderr, flush=True)


class CompiledModel:
    def __init__(self, model, target: Target, pipeline: Pipeline, compile_opts: dict):
        self.model = model
        self.target = target
        self.pipeline = pipeline
        self.options = compile_opts
        self.executor = compile_opts["executor"]
        self.report = CompileReport(target.name, pipeline.names, {**compile_opts, **changed_options(pipeline)})
        self.compilations: dict[str, int] = {}
        self._programs: dict[StepKind, Program] = {}
        self._graph_pool = None
        self._graphs_off = False        # a dry run (prebuild's compile ahead) runs eagerly
        cached = self.executor == "inductor" or (self.executor == "program" and compile_opts["dense_codegen"] != "fx")
        root = cache_root(compile_opts["cache"]) if cached else None
        self.cache = ProgramCache(root, _say, target) if root is not None else None

    # Engine(compiled) works like Engine(model): it reads these two.
    @property
    def config(self):
        return self.model.config

    def parameters(self):
        return self.model.parameters()

    # Engine(compiled) passes a step's token ids and metadata as host tensors: a replayed device
    # graph stages them itself (runtime/staging.py); any other call moves them to the device here.
    host_step_inputs = True

    @property
    def cache_formats(self) -> dict[str, str]:
        """Pool formats the quantize options ask for (Engine(compiled) allocates its pool so)."""
        q = self.pipeline.options.get("quantize", {})
        index = "mxfp8" if q.get("mxfp8_indexer") else q.get("index_cache", "auto")
        return {**({"latent_cache": q["latent_cache"]} if q.get("latent_cache", "auto") != "auto" else {}),
                **({"index_cache": index} if index != "auto" else {})}

    @property
    def graphs(self) -> dict[str, torch.fx.GraphModule]:
        """Step name -> the graph after the passes (a program loaded from the compile cache has
        none in memory: its entry's graph.txt holds its text; `build(..., executable=False)`
        captures it)."""
        return {step.name: p.gm for step, p in self._programs.items() if p.gm is not None}

    @property
    def programs(self) -> dict[str, KernelProgram]:
        """Step name -> the program executor's program (executor "program" only)."""
        return {step.name: p.kernels for step, p in self._programs.items() if p.kernels is not None}

    def graph_stats(self) -> dict[str, dict[str, int]]:
        """Step name -> device-graph captures, replays and uncaptured calls."""
        return {step.name: vars(p.graphs.stats) for step, p in self._programs.items() if p.graphs is not None}

    def build(self, step: StepKind, meta, caches, stop_after: Optional[str] = None,
              executable: bool = True) -> Program:
        """Capture (once per step kind) and run the passes; with `executable`, generate code (or
        load the program from the compile cache)."""
        if executable and self.target.runnable_here:
            self._check_device(meta)
        cache = self.cache if executable and stop_after is None else None
        stored = None
        if cache is not None:
            facts = factors(self, step, meta, caches)
            name = cache.name(step, facts)
            loaded, cache_note = cache.load(self.model, step, name)
            if loaded is not None:
                return self._from_cache(step, meta, loaded, cache_note)
            if cache_note == "miss":
                cache_note = "miss: " + cache.miss_reason(step, facts)
            _say(f"compiling the {step.name} step for {self.target.name} (compile cache {cache_note})")
        captured = capture_cached(self.model, step, meta, caches)
        start = time.perf_counter()
        gm = clone_graph(captured.gm)
        ctx = PassContext(target=self.target, step=step.name, dims=captured.dims)
        records = run_pipeline(gm, self.pipeline, ctx, stop_after=stop_after)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        program = Program(captured, gm, placeholders, None)
        report = StepReport(step.name, captured.seconds, records, executor=self.executor if executable else "")
        if executable:
            store = None if cache is None else functools.partial(
                cache.store, self.model, name, facts, step, captured, placeholders, gm, records)
            builder = self._build_program if self.executor == "program" else self._build_graph
            stored = builder(program, step, meta, report, store)
        if cache is not None and not report.cache:
            report.cache = f"{cache_note}; stored as {name}"
        if self.target.device != "cpu":
            report.fallbacks = {op: n for (op, k), n in report.kernels.items() if k == "reference"}
        report.build_seconds = time.perf_counter() - start
        if stored is not None:               # another process stored it first: its program runs
            return self._from_cache(step, meta, stored, f"{cache_note}; loaded {name}, built meanwhile")
        if stop_after is None:
            self._register(step, program, report)
        return program

    def _build_program(self, program: Program, step: StepKind, meta, report: StepReport,
                       store) -> Optional[Loaded]:
        """Executor "program": partition the graph, compile its dense pieces (with `store`, as
        artifacts into the cache entry), bind the kernels, attach the executor. Returns the
        entry another process stored meanwhile, if so (then nothing was built here)."""
        split = partition(clone_graph(program.gm))
        keys = {n: p.key for n, p in split.pieces.items()}
        inputs = (decode_step_inputs(program.captured, program.placeholders, step.rows)
                  if step.mode == "decode" else None)

        def build(save_pieces=None):
            kp = build_program(split.gm, keys, self.target, step.name, self.options["dense_codegen"],
                               progress=_progress, save_pieces=save_pieces)
            if sys.stderr.isatty():
                print(file=sys.stderr)
            return kp

        def build_into(tmp):
            (tmp / "pieces").mkdir()
            kp = build(str(tmp / "pieces"))
            try:
                info = {"program": program_record(kp)}
            except ValueError as e:
                raise CompilerError(f"compile cache: the {step.name} program: {e}") from None
            if inputs is not None:
                info["step_inputs"] = step_inputs_record(inputs)
            return kp, info
        kp, stored = (build(), None) if store is None else \
            self._store(store, build_into, lambda kp: kp.kernels(), build, report, step)
        if stored is None:
            self._attach(program, step, meta, kp, inputs)
            report.kernels = kp.kernels()
            report.program = describe_program(program.kernels, program.executor, program.graphs is not None)
        return stored

    def _build_graph(self, program: Program, step: StepKind, meta, report: StepReport,
                     store) -> Optional[Loaded]:
        """The whole-graph executors: the graph as one callable (with `store`, one Inductor
        artifact in the cache entry). Returns the entry another process stored meanwhile, if so."""
        gm, placeholders = program.gm, program.placeholders
        report.kernels = reference_counts(gm)

        def build():
            return make_executor(gm, [n.meta["val"] for n in placeholders], self.executor, self.target)
        if store is None:
            program.fn = build()
            return None
        program.fn, stored = self._store(store, lambda tmp: (compile_graph(gm, placeholders, tmp), {}),
                                         lambda fn: report.kernels, build, report, step)
        return stored

    @staticmethod
    def _store(store, build_into, kernels, build, report: StepReport, step: StepKind):
        """`store(build_into, kernels)`; where Inductor cannot make standalone artifacts of this
        program, it is built without the cache (`build()`), and the report and stderr say so."""
        try:
            return store(kernels=kernels, build=build_into)
        except ArtifactError as e:
            why = f"Inductor could not make a standalone artifact ({e})"
        except Unwritable as e:
            why = f"the compile cache cannot take it ({e}; choose another with options={{'cache': DIR}} " \
                  "or $K31C_COMPILE_CACHE)"
        _say(f"compile cache: the {step.name} program is not stored: {why}; building it without the cache")
        report.cache = f"not stored: {why}"
        return build(), None

    def _from_cache(self, step: StepKind, meta, loaded: Loaded, note: str) -> Program:
        program = Program(loaded.captured, None, [], loaded.fn)
        report = StepReport(step.name, 0.0, loaded.records, loaded.kernels, executor=self.executor,
                            build_seconds=loaded.seconds, cache=note)
        if loaded.pieces is not None:
            kp = program_from_record(loaded.info["program"], loaded.pieces, self.target)
            inputs = loaded.info.get("step_inputs")
            self._attach(program, step, meta, kp, step_inputs_from_record(inputs) if inputs else None)
            report.program = describe_program(program.kernels, program.executor, program.graphs is not None)
        if self.target.device != "cpu":
            report.fallbacks = {op: n for (op, k), n in report.kernels.items() if k == "reference"}
        self._register(step, program, report)
        return program

    def _register(self, step: StepKind, program: Program, report: StepReport) -> None:
        self._programs[step] = program
        self.compilations[step.name] = self.compilations.get(step.name, 0) + 1
        self.report.steps[step.name] = report

    def _attach(self, program: Program, step: StepKind, meta, kp: KernelProgram,
                inputs: Optional[StepInputs]) -> None:
        """Run `kp` for `program`: on real streams, decode steps by device graphs (`inputs`: the
        step's per-step inputs, which the graphs stage)."""
        device = meta.slot_mapping.device
        program.kernels = kp
        if not self.target.runnable_here:      # built (and stored) for another machine, not run here
            return
        store = self.cache.kernel_store() if self.cache is not None and device.type == "cuda" else None
        program.executor = Executor(kp, device, self.target, self.options["streams"], kernel_store=store)
        program.fn = lambda *flat: program.executor(list(flat))
        if step.mode == "decode" and self.options["device_graphs"] and device.type == "cuda":
            if kp.fallbacks():
                raise UsageError(f"device graphs: the {step.name} step runs reference ops on "
                                 f"{self.target.name} ({kp.fallbacks()}), which cannot be captured; "
                                 "compile with options={'device_graphs': False}")
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            program.graphs = DecodeGraphs(program.executor, inputs, self.options["buckets"],
                                          self._graph_pool, meta.block_table.shape[1])

    def prebuild(self, engine, steps: Sequence[str], jit_workers: Optional[int] = None) -> bool:
        """Build the programs of `steps` (names: "prefill", "decode", "verify4") for `engine`'s
        cache pool: with the compile cache on, a later process that compiles the same model for an
        Engine of the same geometry loads them. On a GPU this target runs on, each step then runs
        once on a throwaway request (`Engine.run_once`), so the Triton kernels its program
        launches are compiled now, into the compile cache's kernel store, not at the later
        process's first step. Where a step was built here (not loaded from the cache), those
        kernels are compiled first on `jit_workers` threads, from a dry run of the steps
        (runtime/jit_ahead.py; None: `default_workers()`, 0: each at its first launch, one after
        another). Returns whether the steps ran."""
        if jit_workers is None:
            jit_workers = default_workers()
        if isinstance(jit_workers, bool) or not isinstance(jit_workers, int) or jit_workers < 0:
            raise UsageError(f"jit_workers must be a non-negative integer (0: compile at first launch), "
                             f"got {jit_workers!r}")
        kinds = []
        for name in steps:
            try:
                kinds.append(StepKind.parse(name))
            except ValueError as e:
                raise UsageError(str(e)) from None
        pool = engine.pool
        for step in kinds:
            n = 2 * step.rows                        # two requests (the trace's own example size)
            meta = step_meta(slot_mapping=list(range(n)), block_table=torch.zeros(2, pool.block_table.shape[1]),
                             row_req=[0] * n, row_len=[1] * n, kda_slots=[0, 1], cu_seqlens=[0, n // 2, n],
                             device=engine.device)
            snaps = pool.new_snapshots(2, step.rows) if step.snapshots else None
            self.build(step, meta, pool.caches(snaps))
        # the cpu target's kernels are built with its program; a GPU's compile at first launch
        if not (self.target.runnable_here and engine.device.type == "cuda" and engine.step_fn is self):
            return False
        runs = [(s.mode, s.rows) for s in kinds]
        # a program loaded from the cache finds its kernels in the cache's kernel store (each
        # loaded at its first launch, not compiled), so only steps built here compile ahead
        built = [s for s in kinds if not self.report.steps[s.name].cache.startswith("hit")]
        if jit_workers and built:
            self._compile_ahead(engine, runs, jit_workers)
        engine.run_once(runs)
        return True

    def _compile_ahead(self, engine, runs, workers: int) -> None:
        """The steps' Triton kernels compiled on `workers` threads from a dry run of them (device
        graphs off: a dry run's launches are skipped), before their real first run."""
        self._graphs_off = True
        try:
            ahead = compile_ahead(lambda: engine.run_once(runs), workers, _say)
        finally:
            self._graphs_off = False
        torch.cuda.synchronize(engine.device)
        stopped = f"; the dry run stopped early ({ahead.stopped})" if ahead.stopped else ""
        failed = f"; {ahead.failed} failed, left to their first launch" if ahead.failed else ""
        _say(f"compiled {ahead.kernels - ahead.failed} Triton kernels ahead in {ahead.seconds:.1f}s{failed}{stopped}")

    def _check_device(self, meta) -> None:
        t = self.target
        if t.device == "cuda" and meta.slot_mapping.device.type != "cuda":
            if self.executor == "program" and interpreting():
                return
            if not torch.cuda.is_available():
                raise UsageError(f"target '{t.name}' runs on a CUDA device and this machine has none "
                                 "(TRITON_INTERPRET=1 runs its program on CPU tensors)")
            raise UsageError(f"target '{t.name}' runs on a CUDA device; the step's tensors are on "
                             f"{meta.slot_mapping.device}")

    def __call__(self, input_ids, meta, caches, mode: str = "prefill", rows: int = 1):
        if not self.target.runnable_here:
            raise UsageError(f"target '{self.target.name}' is compile-only here: its programs are built "
                             "(build(step, meta, caches)) and inspected, not run")
        step = StepKind(mode, rows)
        program = self._programs.get(step)
        if getattr(input_ids, "device", None) is not None and input_ids.device.type == "cpu":
            device = caches_device(caches)
            graphs = program.graphs if program is not None and program.fn is not None and not self._graphs_off else None
            staged = graphs is not None and graphs.bucket(meta.block_table.shape[0]) is not None
            if device.type != "cpu" and not staged:     # no device graph to stage them
                input_ids, meta = step_to_device(input_ids, meta, device)
        if program is None or program.fn is None:
            program = self.build(step, meta, caches)
        graphs = program.graphs if not self._graphs_off else None
        flat = flat_step_inputs(program.captured, program.placeholders, input_ids, meta, caches,
                                host_step_inputs=graphs is not None)
        with torch.no_grad():
            if graphs is not None:
                return graphs(flat, meta.block_table.shape[0])
            out = program.fn(*flat)
        return out[0]


def compile(model, target: str = "cpu", passes=None, options: Optional[dict] = None,
            disable=()) -> CompiledModel:
    """Compile a K3.1 model for `target` ("cpu", "h200", "mi350x").

    passes:  None for the default pipeline, or the list of pass names to run, in order.
    disable: pass names to switch off (the rest of `passes` runs in its order).
    options: compile options (executor, dense_codegen, device_graphs, buckets, streams, pdl; see the
             module docstring) and per-pass options under the pass name,
             e.g. {"quantize": {"mxfp8_indexer": True}}.
    Unknown models, targets, passes and options are errors naming them."""
    check_model(model)
    t = target if isinstance(target, Target) else get_target(target)   # names a non-str target too
    compile_opts, pass_opts = split_options(options, t)
    t = program_target(t, compile_opts)
    if isinstance(disable, str):
        disable = [disable]
    try:
        names = list(disable)
    except TypeError:       # not iterable (disable=5)
        names = None
    if names is None or not all(isinstance(d, str) for d in names):
        raise UsageError(f"disable must be a pass name or a list of pass names, got {disable!r}")
    disable = names
    return CompiledModel(model, t, resolve(passes, pass_opts, disable=disable), compile_opts)
