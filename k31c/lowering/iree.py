"""IREE as the dense code generator (DESIGN §5): a program's dense pieces as IREE modules.

A dense piece (aten ops only: the k31c ops are the program's kernel steps) is imported into MLIR's
torch dialect by IREE's own FX importer, its batch dimension left dynamic (`?`), and compiled by
`iree-compile`:
- `llvm-cpu` for the host (the cpu target): the module runs here, through IREE's local-task
  driver, on the CPU tensors of the step;
- `rocm` for gfx950 (the mi350x target): the module holds the HSACO and is built and inspected
  here, not run (no HIP device on these machines; spec/toolchain.md Q2).
IREE 3.12 is pinned (pyproject.toml): 3.13 crashes on gfx950 bf16 batched mat-vec. IREE generates
no sm_90 code (spec/toolchain.md), so h200 keeps Inductor.
"""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Optional

import torch

from ..errors import KernelBindError, UsageError
from .targets import Target

# iree-compile's flags per target architecture ("host": the cpu target)
COMPILE_FLAGS = {
    "host": ["--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
             "--iree-llvmcpu-target-cpu=host"],
    "gfx950": ["--iree-hal-target-device=hip", "--iree-rocm-target=gfx950"],
}
_NUMPY_DTYPES = {torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16,
                 torch.int8, torch.uint8, torch.bool}


def _modules():
    try:
        import iree.compiler as compiler
        import iree.runtime as runtime
        from iree.compiler.extras.fx_importer import FxImporter
    except ImportError as e:
        raise UsageError(f"dense_codegen 'iree' needs iree-base-compiler and iree-base-runtime 3.12.0 "
                         f"(pyproject.toml; `bash scripts/setup.sh` installs them): {e}") from None
    return compiler, runtime, FxImporter


def check_target(target: Target) -> None:
    """UsageError unless IREE generates code for `target`'s architecture."""
    if target.arch not in COMPILE_FLAGS:
        raise UsageError(f"dense_codegen 'iree': IREE has no code generation for target "
                         f"'{target.name}' ({target.arch}; IREE 3.9-3.13 emit no sm_90 code); "
                         f"use dense_codegen 'inductor'")


def machine(target: Target) -> str:
    """What an IREE module depends on besides the graph (a compile-cache key factor): the
    compiler's version and the architecture; for the host, the CPU model (`target-cpu=host`)."""
    from iree.compiler.version import VERSION
    where = f"rocm {target.arch}" if target.arch != "host" else f"llvm-cpu {_cpu_model()}"
    return f"IREE {VERSION} {where}"


def _cpu_model() -> str:
    import platform
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def piece_mlir(gm: torch.fx.GraphModule) -> str:
    """The piece as a torch-dialect MLIR module with one function, `main` (symbolic dimensions
    of the placeholders' fake values become dynamic ones)."""
    _, _, FxImporter = _modules()
    importer = FxImporter()
    importer.import_stateless_graph(gm.graph, func_name="main")
    return str(importer.module)


def compile_piece(gm: torch.fx.GraphModule, target: Target, save: Optional[str] = None) -> "IreePiece":
    """The piece compiled by IREE for `target` (its vmfb also written to `save`, for the compile
    cache); KernelBindError naming the piece where IREE cannot import or compile it."""
    check_target(target)
    compiler, _, _ = _modules()
    nodes = len(gm.graph.nodes)
    try:
        mlir = piece_mlir(gm)
        vmfb = compiler.compile_str(mlir, input_type="torch", extra_args=COMPILE_FLAGS[target.arch])
    except Exception as e:
        raise KernelBindError(f"build: IREE failed on a dense piece ({nodes} nodes) for {target.arch}: "
                              f"{type(e).__name__}: {_first_error(str(e))}") from e
    if save is not None:
        Path(save).write_bytes(vmfb)
    return IreePiece(vmfb, target)


def load_piece(path: str, target: Target) -> "IreePiece":
    """A piece saved by `compile_piece(..., save=path)`."""
    return IreePiece(Path(path).read_bytes(), target)


def _first_error(text: str) -> str:
    """iree-compile's first `error:` line (its diagnostics come after pages of invocation text)."""
    match = re.search(r"error: (.*)", text)
    return match.group(1).strip() if match else (text.splitlines() or [""])[0]


class IreePiece:
    """A compiled piece: called with the step's tensors, returns its outputs as a tuple (as an
    Inductor piece does). Only host modules run here; a gfx950 module is built, not run."""

    def __init__(self, vmfb: bytes, target: Target):
        self.vmfb = vmfb
        self.arch = target.arch
        self._main = None
        self.calls = 0
        self.seconds = 0.0                 # time inside the module (the IREE runtime)

    def _load(self):
        _, runtime, _ = _modules()
        if self.arch != "host":
            raise UsageError(f"an IREE module for {self.arch} is built here, not run (no HIP device)")
        config = _host_config()
        context = runtime.SystemContext(config=config)
        context.add_vm_module(runtime.VmModule.copy_buffer(config.vm_instance, self.vmfb))
        return context.modules.module["main"]

    def __call__(self, *args) -> tuple:
        if self._main is None:
            self._main = self._load()
        start = time.perf_counter()
        result = self._main(*[_to_numpy(a) for a in args])
        self.calls += 1
        self.seconds += time.perf_counter() - start
        results = result if isinstance(result, (tuple, list)) else (result,)
        return tuple(_to_torch(r) for r in results)


_CONFIG = None


def _host_config():
    """One IREE runtime configuration (the local-task driver's thread pool) for the process."""
    global _CONFIG
    if _CONFIG is None:
        _, runtime, _ = _modules()
        _CONFIG = runtime.Config("local-task")
    return _CONFIG


def _to_numpy(x):
    if not isinstance(x, torch.Tensor):
        return x
    if x.device.type != "cpu":
        raise UsageError(f"an IREE host module runs on CPU tensors, got one on {x.device}")
    if x.dtype == torch.bfloat16:            # numpy has no bfloat16: its bits, as IREE's type
        import ml_dtypes
        return x.detach().contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if x.dtype not in _NUMPY_DTYPES:
        raise UsageError(f"an IREE host module cannot take a {x.dtype} tensor")
    return x.detach().contiguous().numpy()      # a weight may require grad: its values alone


def _to_torch(r) -> torch.Tensor:
    import numpy as np
    array = np.array(r.to_host(), copy=True)   # owned and writable (a kept weights piece is written)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
