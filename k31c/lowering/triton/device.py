"""What a launcher asks about where it runs: which target's facts apply, and whether Triton
interprets the kernels.

A launcher is called at run time with tensors, not with a target. `target_of(device)` names the
`Target` record whose facts (SM count, dot precision, default variants) it uses: the one set by
`using_target` around the call when a caller knows better (a program built for a target), else
the current device's: the `cpu` record for CPU tensors (the Triton interpreter); on a GPU the
record of torch's backend (ROCm: "hip", CUDA: "cuda") whose `device_names` match the device's
name, else that backend's first GPU target (h200 for CUDA, mi350x for ROCm). A new GPU is thus
one record in targets.py.

Programmatic dependent launch (PDL, sm_90 and later): every k31c kernel starts with
`wait_for_producers(PDL)` and every launcher passes `**pdl_launch(device)`. With PDL on, a kernel
may be launched while the one before it in its stream still runs; its programs wait at their
first line until that kernel has finished and its writes are visible, then let the next kernel
launch. Waiting before the first memory access makes this safe whatever the kernel reads, and
the wait is transitive (the kernel before waited for its own predecessor before it finished).
`Target.pdl` switches it (`k31c.compile(..., options={"pdl": True})` sets it for one program,
whose executor runs under `using_target`).

A launcher may also use PDL for one pair of its own launches whatever `Target.pdl` says
(`pair_launch`): the second kernel is launched as a dependent and does its own wait, after the
loads that do not depend on the first (the KDA decode state pass loads its state slice while the
prep launch runs). It may read before its wait only what kernels before the first one wrote:
the first kernel let it launch only after its own wait (or, launched plainly, it started after
them).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch
import triton
import triton.language as tl

from k31c.lowering.targets import GPU_TARGETS, Target, get_target

_OVERRIDE: contextvars.ContextVar[Target | None] = contextvars.ContextVar("k31c_target", default=None)


def interpreting() -> bool:
    """TRITON_INTERPRET=1: @triton.jit functions run in Triton's CPU interpreter (no compiler)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def upcast_dots(dtype: torch.dtype) -> bool:
    """Whether a kernel casts its `tl.dot` operands to fp32: for fp32 data, and for any dtype under
    the interpreter, whose bf16 `tl.dot` gives wrong products."""
    return dtype == torch.float32 or interpreting()


def target_of(device: torch.device) -> Target:
    """The target record a launcher takes its facts from for tensors on `device`."""
    chosen = _OVERRIDE.get()
    if chosen is not None and chosen.device == device.type:
        return chosen
    if device.type != "cuda":
        return get_target("cpu")
    return _gpu_target(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _gpu_target(index: int) -> Target:
    backend = "hip" if torch.version.hip else "cuda"
    candidates = [get_target(n) for n in GPU_TARGETS if get_target(n).triton_backend == backend]
    name = torch.cuda.get_device_name(index)
    for t in candidates:
        if any(part in name for part in t.device_names):
            return t
    return candidates[0]


@contextlib.contextmanager
def using_target(target: Target):
    """Launchers called inside take `target`'s facts for tensors on its device type."""
    token = _OVERRIDE.set(target)
    try:
        yield target
    finally:
        _OVERRIDE.reset(token)


def sm_count(device: torch.device) -> int:
    """SMs / CUs to size a grid for, from the target record (the CPU: the interpreter's stand-in)."""
    return target_of(device).sm_count


def pdl_launch(device: torch.device) -> dict:
    """Launch arguments for programmatic dependent launch: the kernels' PDL constexpr and Triton's
    launch_pdl option when the target record in force has `pdl` and the device is sm_90+; else
    none (the kernels' PDL defaults to off)."""
    if not target_of(device).pdl or not inline_ptx(device):
        return {}        # the record's flag first: launches pay one attribute read when it is off
    index = device.index if device.index is not None else torch.cuda.current_device()
    return PDL_ON if _sm90(index) else {}


# a launch with PDL: the kernel waits for its producer, and is launched as a dependent
PDL_ON = {"PDL": True, "launch_pdl": True}


def register_cap(device: torch.device, maxnreg: int | None) -> dict:
    """Launch arguments capping a kernel's registers per thread at `maxnreg` (Triton's option,
    which only its CUDA backend has: the interpreter and ROCm get none, where passing it would be
    refused as an unknown keyword); none when maxnreg is 0 or None."""
    if not maxnreg or not inline_ptx(device):
        return {}
    return {"maxnreg": maxnreg}


def inline_ptx(device: torch.device) -> bool:
    """Whether launches on `device` are compiled by Triton's CUDA backend (not the interpreter,
    not ROCm): what inline PTX and CUDA-only launch options need."""
    return device.type == "cuda" and not interpreting() and not torch.version.hip


def pair_launch(device: torch.device) -> bool:
    """Whether a launcher may launch the second kernel of a pair as a PDL dependent of the first
    (CUDA sm_90+, compiled kernels), whatever the target record's `pdl` says."""
    if not inline_ptx(device):
        return False
    return _sm90(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


@triton.jit
def wait_for_producers(PDL: tl.constexpr):
    """With PDL: wait until the kernel before this one in the stream has finished (its writes
    visible), then let the next kernel launch. A kernel calls it before any memory access."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def let_dependent_start(PDL: tl.constexpr, DEPENDENT: tl.constexpr):
    """The first kernel of a `pair_launch` pair, after its `wait_for_producers(PDL)`: let the
    dependent launch now (with PDL the wait already did)."""
    if DEPENDENT and not PDL:
        tl.extra.cuda.gdc_launch_dependents()
