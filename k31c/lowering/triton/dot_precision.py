"""`tl.dot`'s `input_precision` per backend, one rule for every kernel."""
from __future__ import annotations

import torch


def dot_precision(fast: bool, backend: str | None = None) -> str:
    """'tf32' where the kernel asks for fast fp32-operand dots and the backend has it (NVIDIA);
    'ieee' otherwise. Triton 3.7's AMD backend rejects tf32 on gfx950 (it accepts only ieee,
    bf16x3, bf16x6). `backend` is the compile target ("cuda"/"hip"); None: the running torch's."""
    backend = backend or ("hip" if torch.version.hip else "cuda")
    return "tf32" if fast and backend == "cuda" else "ieee"
