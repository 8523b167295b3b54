"""What a launcher asks about where it runs: which target's facts apply, and whether Triton
interprets the kernels.

A launcher is called at run time with tensors, not with a target. `target_of(device)` names the
`Target` record whose facts (SM count, dot precision, default variants) it uses: the one set by
`using_target` around the call when a caller knows better (a program built for a target), else
the current device's: the `cpu` record for CPU tensors (the Triton interpreter), `mi350x` under
a ROCm build of torch, `h200` under CUDA.
"""
from __future__ import annotations

import contextlib
import contextvars
import os

import torch

from k31c.lowering.targets import Target, get_target

_OVERRIDE: contextvars.ContextVar[Target | None] = contextvars.ContextVar("k31c_target", default=None)


def interpreting() -> bool:
    """TRITON_INTERPRET=1: @triton.jit functions run in Triton's CPU interpreter (no compiler)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def target_of(device: torch.device) -> Target:
    """The target record a launcher takes its facts from for tensors on `device`."""
    chosen = _OVERRIDE.get()
    if chosen is not None and chosen.device == device.type:
        return chosen
    if device.type != "cuda":
        return get_target("cpu")
    return get_target("mi350x" if torch.version.hip else "h200")


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
