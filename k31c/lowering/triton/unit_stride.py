"""One argument check the Triton launchers share: index-like tensors (lengths, request ids,
slots, block tables) are read by the kernels with unit stride along their last dimension."""
from __future__ import annotations

import torch


def require_unit_stride(**tensors: torch.Tensor) -> None:
    """ValueError naming the first tensor whose last dimension is not contiguous (a strided
    view would be read as if it were packed: wrong values, no error)."""
    for name, t in tensors.items():
        if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: the Triton kernels read it with unit stride along its last "
                             f"dimension; got strides {t.stride()} (pass .contiguous())")
