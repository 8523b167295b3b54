"""Ahead-of-time build of the Triton kernels of a GPU target, on a machine without that GPU.

Every kernel module registered for a target lists, in its `aot_specs(shapes)`, the launches its
launchers make at the K3.1 Pro shapes: the @triton.jit kernel, its signature and the launcher's
own constexprs, num_warps and num_stages. `build_kernels` compiles each one for the target's
`GPUTarget` (no ROCm/CUDA install or device needed: spec/toolchain.md §3.4) and reports the binary
size and register / shared-memory use; with `out_dir` it also writes the binaries (hsaco or cubin)
and a manifest.json (sizes and sha256).

The JIT's value specialisations are reproduced from each spec's `ints` (the integer arguments'
values at the shapes: an int equal to 1 becomes a constant, a multiple of 16 gets the
divisibility hint; a test checks that every integer argument has one), and pointers get the
16-byte alignment hint every torch allocation has. Without them a kernel builds as its generic
form, which can be other code than the launch runs (linear_group and sparse MLA: no software
pipelining, 255 registers and hundreds of bytes of spill).

Triton must not be in interpreter mode (TRITON_INTERPRET=1 turns @triton.jit into Python
functions); the tests therefore run the build in a subprocess.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

from .aot_dir import BINARY, check_out_dir, write_outputs
from .aot_spec import AotShapes, AotSpec
from .registry import kernels_for
from .targets import get_target

_TEXT = {"hip": "amdgcn", "cuda": "ptx"}


class AotBuildError(RuntimeError):
    """One or more kernels did not compile; the message lists every failure."""


@dataclass
class BuiltKernel:
    name: str             # "mla/_mla_kernel[dense,final]"
    kernel: str           # the Triton function's name
    ops: tuple            # k31c ops whose launchers use it
    target: str           # "mi350x"
    arch: str             # "gfx950", "sm_90a"
    asm_target: str       # the target line of the assembly (.amdgcn_target / .target)
    binary_kind: str      # "hsaco" or "cubin"
    size: int             # bytes of the binary
    sha256: str
    num_warps: int
    num_stages: int
    shared: int           # bytes of shared memory (LDS on AMD) per program
    n_regs: Optional[int]         # registers per thread (AMD: VGPRs incl. AGPRs), None if unknown
    scratch_bytes: Optional[int]  # per-thread private memory (spills): AMD private segment,
                                  # CUDA stack frame; None if unknown
    compile_s: float
    binary: bytes = field(repr=False, default=b"")

    def line(self) -> str:
        regs = "?" if self.n_regs is None else str(self.n_regs)
        scratch = f"  scratch {self.scratch_bytes} B" if self.scratch_bytes else ""
        return (f"{self.name:<58} {self.arch:<7} {self.size:>8} B  regs {regs:>3}  "
                f"smem {self.shared:>6} B{scratch}  ({self.compile_s:.1f} s)")


def default_shapes(target_name: str) -> AotShapes:
    from k31c.config import preset
    return AotShapes(cfg=preset("k3.1-pro"), target=get_target(target_name))


def collect_specs(target_name: str, shapes: Optional[AotShapes] = None,
                  families: Optional[Iterable[str]] = None) -> list[AotSpec]:
    """The launches of every Triton kernel registered for the target (of the given kernel
    families only: module names such as "topk"), duplicates removed."""
    target = get_target(target_name)
    if target.triton_backend is None:
        raise ValueError(f"target '{target_name}' has no Triton backend (nothing to build)")
    _require_compiler_mode()
    shapes = shapes or default_shapes(target_name)
    registered = {op: k.source for op, k in kernels_for(target_name).items() if k.backend == "triton"}
    modules = {}
    for op, source in sorted(registered.items()):
        module = importlib.import_module(source)
        if not hasattr(module, "aot_specs"):
            raise ValueError(f"{module.__name__} registers {op} for {target_name} but has no "
                             "aot_specs(): its kernels cannot be built ahead of time")
        modules[module.__name__] = module
    if families is not None:
        known = {name.rsplit(".", 1)[-1] for name in modules}
        wanted = set(families)
        if wanted - known:
            raise ValueError(f"no kernel family {sorted(wanted - known)} registered for {target_name}; "
                             f"families: {', '.join(sorted(known))}")
        modules = {n: m for n, m in modules.items() if n.rsplit(".", 1)[-1] in wanted}
    specs, seen = [], {}
    for name in sorted(modules):
        module_specs = modules[name].aot_specs(shapes)
        missing = {op for op, src in registered.items() if src == name} - \
            {op for spec in module_specs for op in spec.ops}
        if missing:
            raise ValueError(f"{name}.aot_specs() lists no launch of {sorted(missing)}")
        for spec in module_specs:
            ops = tuple(op for op in spec.ops if op in registered)
            if not ops:
                continue
            if "PDL" in spec.constexprs:    # the kernels as the target launches them (a launch
                # that is PDL by its own plan, such as a pair_launch dependent, stays so)
                spec = spec._replace(constexprs={**spec.constexprs,
                                                 "PDL": target.pdl or bool(spec.constexprs["PDL"])})
            key = (spec.kernel.__name__, json.dumps(spec.signature, sort_keys=True),
                   repr(sorted(spec.constexprs.items())), spec.num_warps, spec.num_stages,
                   spec.ints)
            if key in seen:    # one build; it lists every op whose launchers make it
                i = seen[key]
                specs[i] = specs[i]._replace(ops=tuple(dict.fromkeys((*specs[i].ops, *ops))))
            else:
                seen[key] = len(specs)
                specs.append(spec._replace(ops=ops, family=name.rsplit(".", 1)[-1]))
    return specs


def spec_name(spec: AotSpec) -> str:
    # the listing module, not where the kernel is defined: a family may launch a shared kernel
    family = spec.family or spec.kernel.fn.__module__.rsplit(".", 1)[-1]
    return f"{family}/{spec.kernel.__name__}[{spec.variant}]"


class KernelCompileError(RuntimeError):
    """A kernel did not compile; the message is the root cause (with the source line, and the
    compiler's own diagnostics where it printed them)."""


def compile_spec(spec: AotSpec, target_name: str):
    """triton.compile of one spec for the target; returns the CompiledKernel. Raises
    KernelCompileError with the root cause: Triton chains front-end errors and prints the
    MLIR/LLVM diagnostics of a failed lowering to fd 2, which is captured here."""
    with tempfile.TemporaryFile(mode="w+b") as log:
        try:
            with _stderr_to(log):
                ck = _compile(spec, target_name)
        except Exception as e:
            log.seek(0)
            raise KernelCompileError(_error_summary(e, log.read().decode(errors="replace"))) from e
        log.seek(0)
        printed = log.read()
    if printed:            # warnings of a successful compile are passed on, not swallowed
        sys.stderr.write(printed.decode(errors="replace"))
    return ck


def _compile(spec: AotSpec, target_name: str):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = get_target(target_name)
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(spec.signature.items())
             if t.startswith("*") or n in spec.divisible}
    source = ASTSource
    if _is_gluon(spec.kernel):      # a Gluon kernel (explicit layouts and warp partitions)
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn=spec.kernel, signature=spec.signature, constexprs=spec.constexprs, attrs=attrs)
    options = {"num_warps": spec.num_warps}
    if spec.num_stages is not None:
        options["num_stages"] = spec.num_stages
    if spec.constexprs.get("PDL"):
        options["launch_pdl"] = True
    if spec.maxnreg and target.triton_backend == "cuda":   # as device.register_cap
        options["maxnreg"] = spec.maxnreg
    gpu = GPUTarget(target.triton_backend, target.triton_arch, target.warp_size)
    return triton.compile(src, target=gpu, options=options)


def _is_gluon(kernel) -> bool:
    try:
        from triton.experimental.gluon._runtime import GluonJITFunction
    except ImportError:
        return False
    return isinstance(kernel, GluonJITFunction)


def build_spec(spec: AotSpec, target_name: str) -> BuiltKernel:
    """One spec compiled for the target, with its size, registers, spill and shared memory
    (benchmarks' probes build launch options this way; raises KernelCompileError)."""
    start = time.perf_counter()
    ck = compile_spec(spec, target_name)
    return _describe(ck, spec, spec_name(spec), target_name, get_target(target_name).triton_backend,
                     time.perf_counter() - start)


def build_kernels(target_name: str, out_dir=None, progress: Optional[Callable] = None,
                  shapes: Optional[AotShapes] = None,
                  families: Optional[Iterable[str]] = None, jobs: int = 1) -> list[BuiltKernel]:
    """Compile every registered Triton kernel of the target (optionally of some families only)
    at the launchers' real-shape specialisations, on `jobs` processes (1: in this one);
    `progress` gets one line per kernel, in the specs' order, as soon as it and every kernel
    before it have finished. Raises AotBuildError (after trying all) if any fails; with out_dir,
    writes <name>.<hsaco|cubin> per kernel and manifest.json (only when all compiled; see
    write_outputs)."""
    target = get_target(target_name)
    if out_dir is not None:
        check_out_dir(out_dir, target_name)     # before minutes of compiling, not after
    specs = collect_specs(target_name, shapes, families)
    outcomes: dict[int, object] = {}            # spec index -> BuiltKernel, or why it failed
    shown = 0                                   # kernels whose progress line is out

    def done(i: int, outcome) -> None:
        nonlocal shown
        outcomes[i] = outcome
        while progress and shown in outcomes:
            o = outcomes[shown]
            progress(o.line() if isinstance(o, BuiltKernel) else f"{spec_name(specs[shown]):<58} FAILED: {o}")
            shown += 1
    if jobs > 1 and len(specs) > 1:
        _build_in_processes(specs, target_name, shapes, families, jobs, done)
    else:
        for i, spec in enumerate(specs):
            done(i, _build_or_why(spec, target_name))
    built = [outcomes[i] for i in range(len(specs)) if isinstance(outcomes[i], BuiltKernel)]
    failures = [f"{spec_name(specs[i])}: {outcomes[i]}" for i in range(len(specs))
                if not isinstance(outcomes[i], BuiltKernel)]   # every kernel reported, then one failure
    if failures:
        raise AotBuildError(f"{len(failures)} of {len(specs)} kernels failed to compile for "
                            f"{target_name} ({target.arch}):\n" + "\n".join(failures))
    if out_dir is not None:
        write_outputs(built, Path(out_dir), target_name, families)
    return built


def _build_or_why(spec: AotSpec, target_name: str):
    """The BuiltKernel, or the root cause of its failure (a string)."""
    try:
        return build_spec(spec, target_name)
    except KernelCompileError as e:
        return str(e)


def _build_in_processes(specs, target_name, shapes, families, jobs: int, done: Callable) -> None:
    """`done(i, outcome)` for every spec, built on `jobs` spawned processes (each collects the
    specs itself: a @triton.jit function does not pickle; the names are checked to agree). Each
    process has its own fd 2, where `compile_spec` catches the compiler's diagnostics."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool
    names = [spec_name(s) for s in specs]
    with ProcessPoolExecutor(min(jobs, len(specs)), mp_context=multiprocessing.get_context("spawn"),
                             initializer=_worker_start, initargs=(target_name, shapes, families, names)) as pool:
        futures = {pool.submit(_worker_build, i, target_name): i for i in range(len(specs))}
        try:
            for future in as_completed(futures):
                done(futures[future], future.result())
        except BrokenProcessPool as e:
            raise AotBuildError(f"a build process for {target_name} failed to start or died: {e}") from None


_WORKER_SPECS: list = []       # a build process's own collect_specs


def _worker_start(target_name, shapes, families, names) -> None:
    global _WORKER_SPECS
    _WORKER_SPECS = collect_specs(target_name, shapes, families)
    if [spec_name(s) for s in _WORKER_SPECS] != names:
        raise RuntimeError("a build process collected other kernels than its parent")


def _worker_build(i: int, target_name: str):
    return _build_or_why(_WORKER_SPECS[i], target_name)


# ---- metadata -------------------------------------------------------------------------------

def _describe(ck, spec, name, target_name, backend, seconds) -> BuiltKernel:
    md = ck.metadata
    binary = ck.asm[BINARY[backend]]
    text = ck.asm[_TEXT[backend]]
    if backend == "hip":
        regs, scratch = _amd_registers(text)
        line = re.search(r'\.amdgcn_target\s+"([^"]+)"', text)
    else:
        regs, scratch = _cuda_registers(binary)
        line = re.search(r"^\s*\.target\s+(\S+)", text, re.M)
    return BuiltKernel(name=name, kernel=spec.kernel.__name__, ops=spec.ops, target=target_name,
                       arch=get_target(target_name).arch, asm_target=line.group(1) if line else "",
                       binary_kind=BINARY[backend], size=len(binary),
                       sha256=hashlib.sha256(binary).hexdigest(), num_warps=md.num_warps,
                       num_stages=md.num_stages, shared=md.shared, n_regs=regs, scratch_bytes=scratch,
                       compile_s=round(seconds, 2), binary=binary)


def _amd_registers(amdgcn: str) -> tuple[Optional[int], Optional[int]]:
    """VGPRs per lane (the unified count, AGPRs included) and private-segment bytes, from the
    code object metadata at the end of the assembly."""
    def field_(key):
        m = re.search(rf"^\s*\.{key}:\s+(\d+)", amdgcn, re.M)
        return int(m.group(1)) if m else None
    return field_("vgpr_count"), field_("private_segment_fixed_size")


def _cuda_registers(cubin: bytes) -> tuple[Optional[int], Optional[int]]:
    """Registers per thread and stack-frame bytes from `cuobjdump -res-usage` (shipped with
    Triton)."""
    try:
        import triton
        tool = triton.knobs.nvidia.cuobjdump.path
    except Exception:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                                 timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None, None
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


# ---- helpers --------------------------------------------------------------------------------

def _require_compiler_mode() -> None:
    from .triton.device import interpreting
    if interpreting():
        raise ValueError("TRITON_INTERPRET=1: Triton runs kernels in its interpreter and cannot "
                         "compile them; unset it to build kernels ahead of time")


@contextlib.contextmanager
def _stderr_to(file):
    """Point fd 2 at `file` (the compiler's C++ diagnostics bypass sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(file.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _error_summary(e: BaseException, printed: str) -> str:
    """Root cause of a failed compile in a line or two: the innermost chained exception, the
    kernel source line of the innermost Triton CompilationError, the compiler's error lines."""
    from triton.compiler.errors import CompilationError
    chain = [e]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    root = chain[-1]
    if isinstance(root, CompilationError):
        msg = root.error_message or type(root).__name__
    else:
        msg = f"{type(root).__name__}: {str(root).strip() or '(no message)'}"
    located = [c for c in chain if isinstance(c, CompilationError) and c.src and hasattr(c.node, "lineno")]
    if located:
        line = located[-1].src.split("\n")[located[-1].node.lineno - 1].strip()
        msg += f" [at: {line}]"
    errors = [ln.strip() for ln in printed.splitlines() if "error:" in ln]
    errors = list(dict.fromkeys(errors))     # the same diagnostic may be printed more than once
    return msg + "".join(f"\n    {ln}" for ln in errors[:4])
