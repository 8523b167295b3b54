"""Compile targets: every fact about a target in one record (DESIGN §5).

A new GPU is one `Target` below (and its name in `GPU_TARGETS` when the Triton kernels should be
registered for it): the launchers, the AOT build, the `lower` pass and the runtime read what they
need from the record, never from a table of their own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import UsageError


@dataclass(frozen=True)
class Target:
    name: str
    device: str                              # torch device type the program runs on
    arch: str                                # arch string in cache keys: host, sm_90a, gfx950
    triton_backend: Optional[str] = None     # GPUTarget backend for AOT builds ("cuda", "hip")
    triton_arch: Optional[object] = None     # GPUTarget arch (90, "gfx950")
    warp_size: int = 32
    sm_count: int = 4                        # SMs / CUs the launchers size grids for (the CPU:
                                             # what the Triton interpreter's grids stand for)
    dense_codegen: str = "inductor"          # who compiles the dense (non-k31c) ops
    executor: str = "inductor"               # k31c.compile's default executor (api.py lists them)
    fast_dot_precision: str = "ieee"         # tl.dot input_precision of fp32 operands where a
                                             # kernel asks for fast dots ("tf32" on NVIDIA;
                                             # Triton 3.7's AMD backend has no tf32 on gfx950)
    exact_dot_precision: str = "ieee"        # tl.dot input_precision where fp32 operands need
                                             # fp32 accuracy: "tf32x3" on NVIDIA (three tf32
                                             # tensor-core products), else "ieee" (FMA)
    default_variants: tuple[tuple[str, str], ...] = ()   # (op, kernel variant) where an op has several
    device_graphs: bool = False              # replay decode as CUDA/HIP graphs
    graph_streams: int = 1                   # streams one captured device graph may use
    runnable_here: bool = True               # False: artifacts are built and inspected, not run
    device_names: tuple[str, ...] = ()       # substrings of torch.cuda.get_device_name() that
                                             # identify this GPU when a launcher runs on it
    shared_memory: int = 0                   # bytes of shared memory one program may use (0: not
                                             # stated; launchers that size tiles by it skip the check)
    pdl: bool = False                        # programmatic dependent launch of the k31c kernels
                                             # (lowering/triton/device.py; sm_90+)
    kda_prefill_chunk: int = 0               # rows per chunk the KDA prefill kernels walk (0: the
                                             # model's kda_chunk_size; the chunked form is exact
                                             # for any size, only bf16 rounding moves)

    @property
    def pdl_capable(self) -> bool:
        """Whether the hardware has programmatic dependent launch (NVIDIA sm_90 and later)."""
        return self.triton_backend == "cuda" and isinstance(self.triton_arch, int) and self.triton_arch >= 90

    def dot_precision(self, fast: bool) -> str:
        """`tl.dot`'s input_precision: the fast one where the kernel asks for it, else exact."""
        return self.fast_dot_precision if fast else "ieee"

    def variant(self, op: str, default: str) -> str:
        """The kernel variant this target runs for `op` ("k31c::lightning_indexer"): the one the
        record names, else `default` (the launcher's own)."""
        return dict(self.default_variants).get(op, default)


TARGETS = {
    "cpu": Target("cpu", "cpu", "host"),
    "h200": Target("h200", "cuda", "sm_90a", "cuda", 90, warp_size=32, sm_count=132,
                   executor="program", fast_dot_precision="tf32", exact_dot_precision="tf32x3",
                   # dense_mla: "warp_specialized" (mla_dense_ws.py; it hands the calls it
                   # declines to mla_dense.py's split kernel), "split" (mla_dense.py) or
                   # "one_pass" (mla.py)
                   default_variants=(("k31c::lightning_indexer", "warp_specialized"),
                                     ("k31c::dense_mla", "warp_specialized"),
                                     ("k31c::sparse_mla", "warp_specialized")),
                   device_graphs=True, graph_streams=3, device_names=("H200",),
                   shared_memory=232448,       # sm_90: 227 KB a block (opt-in)
                   kda_prefill_chunk=16),      # T = 8192: 2.73 ms vs 3.81-4.18 at 64 (BENCHMARKS.md, KDA)
    # The TMA indexer AOT-compiles for gfx950 (descriptor loads become masked pointer loads, as
    # gfx950 has no TMA unit); untimed on an MI350X: "gather" here is the switch if it loses.
    # One stream per graph: dual-stream HIP-graph capture has known runtime bugs.
    "mi350x": Target("mi350x", "cuda", "gfx950", "hip", "gfx950", warp_size=64, sm_count=256,
                     dense_codegen="iree", executor="program",
                     default_variants=(("k31c::lightning_indexer", "tma"),),
                     device_graphs=True, graph_streams=1, runnable_here=False,
                     device_names=("MI350", "MI355")),
}

GPU_TARGETS: tuple[str, ...] = tuple(n for n, t in TARGETS.items() if t.triton_backend is not None)


# the variant an op runs where a target's record names none (ops with several kernel modules)
DEFAULT_VARIANTS = {"k31c::dense_mla": "one_pass", "k31c::sparse_mla": "two_pass"}


def targets_running(op: str, variant: str) -> tuple[str, ...]:
    """The GPU targets whose record picks `variant` for `op` (the registration list of the kernel
    module that implements that variant), so the choice lives in the target record alone."""
    return tuple(n for n in GPU_TARGETS if TARGETS[n].variant(op, DEFAULT_VARIANTS[op]) == variant)


def get_target(name: str) -> Target:
    # a UsageError (a ValueError too, for callers catching that): the CLI reports it as bad input
    if not isinstance(name, str) or name not in TARGETS:
        raise UsageError(f"unknown target {name!r}; known targets: {', '.join(TARGETS)}")
    return TARGETS[name]
