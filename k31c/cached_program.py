"""Step programs in the compile cache (compile_cache.py): what a key depends on, what an entry
holds, and loading one without capture, passes or code generation.

The programs keep the batch symbolic, so one entry serves every batch size of its step kind and
cache pool. An entry holds:
- executor "inductor" (the cpu target's default): `program.bin`, the whole step graph after the
  passes as one Inductor artifact (`lowering/build.py: save_artifact`: `standalone_compile` with
  the graph's own shapes, saved in Inductor's binary format);
- executor "program" (the GPU targets'): `pieces/<i>.bin`, each distinct dense piece as such an
  artifact (with dense_codegen "iree": `pieces/<i>.vmfb`, its IREE module), and in the manifest
  the program's steps (`lowering/program_record.py`; the kernels are bound again from the
  registry on load) and a decode step's per-step inputs (the device graphs stage them, and are
  captured at load);
- `inductor/`: Inductor's cache directory while the artifacts were built (generated code and, on
  the CPU, the compiled C++ libraries), so a load under it compiles nothing;
- `graph.txt`: the graph after the passes, in canonical text (what `k31c inspect` prints);
- `manifest.json`: the factors and files (compile_cache.py) and what a load needs besides the
  artifacts: the weights by name, the step inputs' shape checks, the pass report, the kernels.

Where: `options={"cache": ...}` of `k31c.compile`: a directory, True (the default one), False
(off); left out, `$K31C_COMPILE_CACHE` decides (a directory, or `off`), else the default one,
`<k31c home>/compile-cache`.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import platform
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import sympy
import torch

from .compile_cache import CompileCache, Damaged, Entry, Unwritable
from .errors import UsageError
from .graph.capture import Captured, GraphInput, StepKind, cache_geometry, canonical_path, clone_graph
from .graph.input_checks import leaf_checks_from_record, leaf_checks_record
from .graph.printer import format_graph
from .graph.step import caches_device
from .lowering import iree
from .lowering.build import piece_file, save_artifact
from .passes.manager import PassRecord, PassResult
from .paths import compile_cache_dir
from .runtime import kernel_store
from .runtime.staging import StepInputs

CACHE_ENV = "K31C_COMPILE_CACHE"
_OFF = ("0", "off", "false", "no")
ROOT = Path(__file__).resolve().parent


def cache_root(option) -> Optional[Path]:
    """The cache directory the `cache` option asks for, or None (off)."""
    env = os.environ.get(CACHE_ENV, "").strip()
    if option is None:
        if env.lower() in _OFF:
            return None
        option = True
    if option is True:
        return Path(env).expanduser() if env and env.lower() not in _OFF else compile_cache_dir()
    if option is False:
        return None
    if isinstance(option, (str, os.PathLike)) and str(option):
        return Path(option).expanduser()
    raise UsageError(f"option cache must be a directory, True (the default one) or False, got {option!r}")


@functools.lru_cache(maxsize=1)
def source_digests() -> dict[str, str]:
    """k31c's own sources a compiled graph depends on (all but the command line), per file; its
    version is in one of them (__init__.py)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith("cli/") and rel != "__main__.py":
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return out


def _machine(device: torch.device) -> str:
    """What generated code depends on: the CPU's vector ISA, or the GPU's architecture and the
    CUDA and Triton versions its kernels are built with."""
    if device.type == "cuda":
        import triton
        return "sm_%d%d CUDA %s Triton %s" % (*torch.cuda.get_device_capability(device), torch.version.cuda,
                                              triton.__version__)
    # ATen's CPU capability (AVX512, AVX2, ...): the ISA Inductor's C++ is built for follows it,
    # and asking Inductor itself (`pick_vec_isa`) compiles probe programs, seconds per process
    return f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()}"


def factors(compiled, step: StepKind, meta, caches) -> dict:
    """Everything a step program depends on, in clear text (no paths, host names or device index)."""
    model = compiled.model
    weights = [(canonical_path(n), list(t.shape), str(t.dtype)) for n, t in _named_tensors(model)]
    options = {k: v for k, v in compiled.options.items() if k != "cache"}
    return {
        "torch": torch.__version__, "python": "%d.%d" % sys.version_info[:2],
        "machine": _machine(caches_device(caches)) if options.get("dense_codegen") != "iree"
                   else iree.machine(compiled.target),
        "target": compiled.target.name, "options": options,
        "passes": list(compiled.pipeline.names), "pass_options": compiled.pipeline.options,
        "config": dataclasses.asdict(model.config),
        "weights": hashlib.sha256(repr(weights).encode()).hexdigest()[:16],
        "step": step.name, "geometry": repr(cache_geometry(meta, caches)),
        "source": source_digests(),
    }


def stale(entry_factors: dict) -> Optional[str]:
    """Why no compile of this k31c, torch and Python can ever load an entry with these factors
    (None: it may be loaded)."""
    if entry_factors.get("torch") != torch.__version__:
        return f"built with torch {entry_factors.get('torch')}"
    if entry_factors.get("python") != "%d.%d" % sys.version_info[:2]:
        return f"built with Python {entry_factors.get('python')}"
    theirs, ours = entry_factors.get("source") or {}, source_digests()
    changed = [f for f in sorted(set(theirs) | set(ours)) if theirs.get(f) != ours.get(f)]
    if changed:
        return f"built from other k31c sources ({len(changed)} files differ, e.g. {changed[0]})"
    return None


def _named_tensors(model):
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


@contextmanager
def _writable_copy(directory: Path) -> Iterator[Path]:
    """`directory`, or where it is read-only (a prebuilt cache shipped read-only) a temporary copy
    of it: loading an artifact rewrites Inductor's cache entries and takes locks there. The copy
    is removed after the load (what it loaded stays mapped)."""
    if os.access(directory, os.W_OK):
        yield directory
        return
    tmp = Path(tempfile.mkdtemp(prefix="k31c-load-"))
    try:
        shutil.copytree(directory, tmp / "inductor")
        for path in [tmp / "inductor", *(tmp / "inductor").rglob("*")]:   # copies keep the modes
            path.chmod(path.stat().st_mode | 0o700 if path.is_dir() else path.stat().st_mode | 0o600)
        yield tmp / "inductor"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@dataclasses.dataclass
class Loaded:
    """A step's program from an entry: for executor "inductor" `fn`, the whole graph's artifact;
    for executor "program" `pieces` (the dense pieces' artifacts) and `info["program"]`."""
    captured: Captured
    records: list[PassRecord]
    kernels: dict
    info: dict
    fn: Optional[Callable] = None
    pieces: Optional[list] = None
    seconds: float = 0.0


def _records_info(records: list[PassRecord]) -> list[dict]:
    return [{"name": r.name, "matches": r.result.matches, "changed": r.result.changed,
             "notes": list(r.result.notes), "seconds": r.seconds, "skipped": r.skipped} for r in records]


def _records(info: list[dict]) -> list[PassRecord]:
    return [PassRecord(r["name"], PassResult(r["matches"], r["changed"], r["notes"]), r["seconds"], r["skipped"])
            for r in info]


def step_inputs_record(s: StepInputs) -> dict:
    return {"per_step": s.per_step, "names": s.names, "shapes": [[str(d) for d in shape] for shape in s.shapes],
            "snapshots": s.snapshots, "batch": s.batch_symbol.name, "rows": s.rows}


def step_inputs_from_record(r: dict) -> StepInputs:
    batch = sympy.Symbol(r["batch"], integer=True, positive=True)
    shapes = [tuple(int(d) if d.lstrip("-").isdigit() else sympy.sympify(d, locals={batch.name: batch})
                    for d in shape) for shape in r["shapes"]]
    return StepInputs(r["per_step"], r["names"], shapes, r["snapshots"], batch, r["rows"])


class ProgramCache:
    """The compile cache as `CompiledModel` uses it: `load` a step's program, or `store` one."""

    def __init__(self, root: Path, say: Callable[[str], None], target):
        self.entries = CompileCache(root)
        self.say = say                     # a line to the user (stderr): damaged entries, misses
        self.target = target               # what the programs are built for (loads its pieces)
        self._kernels: Optional[str] = None   # the kernel store, once asked for ("" = not used)

    @property
    def root(self) -> Path:
        return self.entries.root

    def kernel_store(self) -> Optional[str]:
        """The directory the GPU programs' Triton kernels are kept in (runtime/kernel_store.py),
        or None (and said once) where the cache cannot take them."""
        if self._kernels is None:
            why = None
            try:
                self.entries.prepare()
            except Unwritable as e:
                why = f"it cannot take them ({e})"
            why = why or kernel_store.install()
            if why:
                self.say(f"compile cache: the k31c kernels' Triton binaries stay in Triton's own cache: {why}")
            self._kernels = "" if why else str(self.root / kernel_store.STORE_DIR)
        return self._kernels or None

    def name(self, step: StepKind, facts: dict) -> str:
        return self.entries.name(step.name, facts)

    def load(self, model, step: StepKind, name: str) -> tuple[Optional[Loaded], str]:
        """(the program of entry `name`, what happened): None with the reason on a miss."""
        start = time.perf_counter()
        try:
            entry = self.entries.lookup(name)
            if entry is None:
                return None, "miss"
            loaded = self._load(entry, model, step)
        except Damaged as e:
            self.say(f"compile cache: entry {e}; building it again")
            return None, "damaged entry rebuilt"
        except Exception as e:             # an artifact Inductor cannot load is damaged too
            self.say(f"compile cache: entry {name} does not load ({type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''}); building it again")
            return None, "unloadable entry rebuilt"
        loaded.seconds = time.perf_counter() - start
        return loaded, f"hit {name} (loaded in {loaded.seconds:.2f}s)"

    def miss_reason(self, step: StepKind, facts: dict) -> str:
        near = self.entries.nearest(step.name, facts)
        if near is None:
            return f"no {step.name} entry in {self.root}"
        return f"the nearest entry, {near[0]}, differs in: {', '.join(near[1])}"

    def _load(self, entry: Entry, model, step: StepKind) -> Loaded:
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
        info = entry.manifest["info"]
        named = {canonical_path(n): t for n, t in _named_tensors(model)}
        missing = [n for n, w in info["inputs"] if w and n not in named]
        if missing:
            raise Damaged(f"{entry.name}: the model has no weight {missing[0]}")
        inputs = [GraphInput(n, w, named[n] if w else None) for n, w in info["inputs"]]
        captured = Captured(None, step, inputs, None, dict(info["dims"]),
                            leaf_checks=leaf_checks_from_record(info["checks"]))
        loaded = Loaded(captured, _records(info["passes"]), {(op, k): n for op, k, n in info["kernels"]}, info)
        with _writable_copy(entry.path / "inductor") as inductor_dir, temporary_cache_dir(str(inductor_dir)), \
                _vec_isa_as_built(info.get("vec_isa")):
            if "program" in info:
                loaded.pieces = [_load_piece(str(entry.path / "pieces" / piece_file(i, info["program"]["dense_codegen"])),
                                             info["program"]["dense_codegen"], self.target)
                                 for i in range(len(info["program"]["piece_names"]))]
            else:
                loaded.fn = _load_piece(str(entry.path / "program.bin"), "inductor", self.target)
        return loaded

    def store(self, model, name: str, facts: dict, step: StepKind, captured: Captured, placeholders: list,
              gm: torch.fx.GraphModule, records: list[PassRecord], kernels: Callable[[Any], dict],
              build: Callable[[Path], tuple[Any, dict]]) -> tuple[Any, Optional[Loaded]]:
        """Build entry `name` and return (what `build` made, None); `build(dir)` compiles into `dir`
        (under Inductor's cache directory `dir/inductor`) and returns (its result, what the
        manifest's info adds). A builder that held the lock first may have written the entry
        meanwhile: then (None, the entry loaded)."""
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
        with self.entries.locked(name):
            try:
                entry = self.entries.lookup(name)
                if entry is not None:          # a builder that held the lock first stored it
                    return None, self._load(entry, model, step)
            except Exception:                  # damaged or unloadable: `publish` replaces it
                pass
            unnamed = [i.name for i in captured.inputs if i.is_weight and i.tensor is None]
            if unnamed:
                raise UsageError(f"compile cache: the graph has a constant input that is not a weight "
                                 f"of the model ({unnamed[0]}); compile with options={{'cache': False}}")
            with self.entries.building(name) as tmp:
                (tmp / "inductor").mkdir()     # a load runs under it, even where Inductor wrote nothing
                with temporary_cache_dir(str(tmp / "inductor")), torch.no_grad():
                    result, extra = build(tmp)
                (tmp / "graph.txt").write_text(format_graph(gm, title=f"{step.name} after the passes",
                                                            dims=captured.dims) + "\n")
                info = {"inputs": [[i.name, i.is_weight] for i in captured.inputs], "dims": captured.dims,
                        "vec_isa": _picked_vec_isa(),
                        "checks": leaf_checks_record(captured, placeholders), "passes": _records_info(records),
                        "kernels": [[op, k, n] for (op, k), n in sorted(kernels(result).items())], **extra}
                self.entries.publish(tmp, name, facts, info)
        return result, None


def _picked_vec_isa() -> Optional[str]:
    """The CPU vector ISA Inductor built this process's C++ for (None where it has not probed
    one: a GPU program's pieces, or a torch without the probe's cache)."""
    from torch._inductor import cpu_vec_isa
    probed = getattr(cpu_vec_isa.valid_vec_isa_list, "cache_info", None)
    if probed is None or probed().currsize == 0:
        return None
    return str(cpu_vec_isa.pick_vec_isa())


@contextmanager
def _vec_isa_as_built(built: Optional[str]) -> Iterator[None]:
    """Loading an entry's C++ libraries under the ISA they were built for, without Inductor's
    probe: `pick_vec_isa` (the libraries' cache key) first builds and dlopens a test program per
    candidate ISA, each in a child Python, about 1.2 s a process; the entry's build ran that
    probe. Where this process has not probed yet and the ISA the CPU reports (Inductor's
    `vec_isa_ok`: the probe skipped) is the one the entry was built for, the load takes it; the
    unprobed list is dropped after, so a later compile in this process probes as it would have."""
    from torch._inductor import config, cpu_vec_isa
    isas = cpu_vec_isa.valid_vec_isa_list
    if built is None or not hasattr(isas, "cache_clear") or isas.cache_info().currsize:
        yield
        return
    with config.patch({"cpp.vec_isa_ok": True}):
        if str(cpu_vec_isa.pick_vec_isa()) == built:
            try:
                yield
            finally:
                isas.cache_clear()
            return
    isas.cache_clear()                 # built for another ISA: Inductor probes, as without k31c
    yield


def _load_piece(path: str, codegen: str, target):
    if codegen == "iree":
        return iree.load_piece(path, target)
    from torch._inductor import CompiledArtifact
    return CompiledArtifact.load(path=path, format="binary")


def compile_graph(gm: torch.fx.GraphModule, placeholders: list, into: Path) -> Callable:
    """The whole step graph as one Inductor artifact, saved as `into/program.bin`."""
    return save_artifact(clone_graph(gm), [n.meta["val"] for n in placeholders], str(into / "program.bin"))
