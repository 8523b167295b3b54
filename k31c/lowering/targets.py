"""Compile targets: what each one runs on and how its kernels are built (DESIGN §5)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Target:
    name: str
    device: str                              # torch device type the program runs on
    arch: str                                # arch string in cache keys: host, sm_90a, gfx950
    triton_backend: Optional[str] = None     # GPUTarget backend for AOT builds ("cuda", "hip")
    triton_arch: Optional[object] = None     # GPUTarget arch (90, "gfx950")
    warp_size: int = 32
    device_graphs: bool = False              # replay decode as CUDA/HIP graphs
    runnable_here: bool = True               # False: artifacts are built and inspected, not run


TARGETS = {
    "cpu": Target("cpu", "cpu", "host"),
    "h200": Target("h200", "cuda", "sm_90a", "cuda", 90, 32, device_graphs=True),
    "mi350x": Target("mi350x", "cuda", "gfx950", "hip", "gfx950", 64, device_graphs=True,
                     runnable_here=False),
}


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise ValueError(f"unknown target '{name}'; known targets: {', '.join(TARGETS)}")
    return TARGETS[name]
