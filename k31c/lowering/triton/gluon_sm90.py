"""Gluon's Hopper API for the sm_90a kernels written in Gluon (mla_sparse_ws, mla_dense_ws,
indexer_ws), imported once: `GLUON_ERROR` is None where this Triton has it, else why not; and the
device reasons such a kernel cannot run (`why_not_sm90`). A leaf: registers nothing."""
from __future__ import annotations

import functools

import torch

from k31c.lowering.triton.device import interpreting

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    sync = getattr(gl, "barrier", None) or gl.thread_barrier     # renamed after Triton 3.6
    GLUON_ERROR = None
except ImportError as e:                       # a Triton without Gluon's Hopper API
    GLUON_ERROR = f"{type(e).__name__}: {e}"


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)       # once a device, not once a call


def why_not_sm90(device: torch.device) -> str | None:
    """Why a Gluon sm_90a kernel cannot run on `device` (no Gluon, not an NVIDIA GPU, not
    sm_90), or None."""
    if GLUON_ERROR is not None:
        return f"this Triton has no Gluon Hopper API ({GLUON_ERROR})"
    if interpreting() or device.type != "cuda" or torch.version.hip:
        return "not an NVIDIA GPU (the kernel is sm_90a code)"
    if _capability(device) != (9, 0):
        return f"compute capability {_capability(device)} is not sm_90"
    return None
