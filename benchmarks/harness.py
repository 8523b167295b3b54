"""Shared benchmark plumbing: the physical floors measured in the same run, timing, the table, and
the bench-config model and output of the end-to-end benchmarks.

Every row reports the measured median, the floor it is compared with (bytes over the copy
bandwidth measured now, or FLOPs over the matrix rate measured now), the ratio, and the peers'
times measured in the same process. `measure_machine` also judges spec §8's G0 (the run's copy
bandwidth >= 4.0 TB/s): where it is missed, every goal verdict of the run is void (spec: "else
discard the run"), and the table and the goal list say so.
"""
from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field

import torch

from k31c.runtime.graphs import capture_guard


@dataclass
class Machine:
    copy_gbps: float          # device copy bandwidth, (read + write bytes) / s, in GB/s
    bf16_tflops: float        # dense bf16 matmul rate
    fp8_tflops: float | None  # dense fp8 matmul rate (torch._scaled_mm), None if unavailable
    name: str


def time_ms(fn, warmup: int = 5, reps: int = 30) -> float:
    """Median wall time of fn() on the current CUDA stream, in ms (CUDA events; L2 not flushed
    between reps, so kernels whose data fits L2 look faster than from HBM)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graphed(fn, calls: int = 1):
    """fn captured `calls` times in one CUDA graph; returns its replay. fn runs twice first on a
    side stream (compiles its kernels, settles the caching allocator outside the capture); every
    replay reuses fn's output tensors."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capture_guard(), torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def graph_ms(fn, calls: int = 1, warmup: int = 5, reps: int = 30) -> float:
    """Median time per call of fn replayed from a CUDA graph of `calls` calls (no Python launch
    cost, as in a decode step)."""
    return time_ms(graphed(fn, calls), warmup=warmup, reps=reps) / calls


def try_ms(fn, timer=None, **kw) -> float | None:
    """fn's time by `timer` (time_ms, or graph_ms for graph replay), or None where it fails to
    run, compile or be captured: reported on stderr, so a peer that fails is absent, not fatal."""
    try:
        return (timer or time_ms)(fn, **kw)
    except Exception as e:  # noqa: BLE001
        print(f"# failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        torch.cuda.empty_cache()
        return None


def measure_machine() -> Machine:
    dev = torch.device("cuda")
    n = 1 << 28  # 1 GiB of fp32
    src = torch.empty(n, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), reps=20)
    copy = 2 * src.numel() * 4 / (ms * 1e-3) / 1e9
    del src, dst
    m = 8192
    a = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, reps=10)
    bf16 = 2 * m ** 3 / (ms * 1e-3) / 1e12
    fp8 = None
    try:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device=dev)
        ms = time_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), reps=10)
        fp8 = 2 * m ** 3 / (ms * 1e-3) / 1e12
    except Exception:  # noqa: BLE001  (older torch without fp8 matmul: report None)
        pass
    machine = Machine(copy, bf16, fp8, torch.cuda.get_device_name())
    record_sanity(machine)
    return machine


G0_COPY_GBPS = 4000.0     # spec §8 G0: a run whose copy bandwidth is lower is discarded


def meets_g0(m: Machine) -> bool:
    return m.copy_gbps >= G0_COPY_GBPS


def record_sanity(m: Machine) -> None:
    """Record G0 for the run measured on `m` (goals recorded after a missed G0 are void)."""
    record_goal("G0 harness sanity: copy bandwidth in the run", f">= {G0_COPY_GBPS / 1e3:.1f} TB/s",
                f"{m.copy_gbps / 1e3:.2f} TB/s ({m.name})", meets_g0(m))


@dataclass
class Row:
    kernel: str
    shape: str
    ms: float
    floor_ms: float
    floor_kind: str                     # "bytes" or "flops"
    peers: dict[str, float] = field(default_factory=dict)
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.ms / self.floor_ms if self.floor_ms > 0 else float("inf")


def bytes_floor_ms(nbytes: float, m: Machine) -> float:
    """Time to move nbytes once at the measured copy bandwidth (copy moves 2 bytes per byte)."""
    return nbytes / (m.copy_gbps * 1e9) * 1e3


def flops_floor_ms(flops: float, tflops: float) -> float:
    return flops / (tflops * 1e12) * 1e3


def markdown(rows: list[Row], m: Machine) -> str:
    peers = sorted({p for r in rows for p in r.peers})
    head = ["kernel", "shape", "k31c ms", "floor ms", "floor", "ratio", *[f"{p} ms" for p in peers], "note"]
    void = "" if meets_g0(m) else \
        f" (below G0's {G0_COPY_GBPS / 1e3:.1f} TB/s: no spec §8 goal is judged from this run)"
    out = [f"Device: {m.name}; measured copy {m.copy_gbps:.0f} GB/s, bf16 {m.bf16_tflops:.0f} TFLOP/s, "
           f"fp8 {m.fp8_tflops or float('nan'):.0f} TFLOP/s{void}", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.kernel, r.shape, f"{r.ms:.4f}", f"{r.floor_ms:.4f}", r.floor_kind, f"{r.ratio:.2f}",
                 *[f"{r.peers[p]:.4f}" if p in r.peers else "" for p in peers], r.note]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


@dataclass
class Goal:
    """One spec §8 goal judged in this run: what was measured against what, and the verdict."""
    goal: str            # "G7 dense MLA, R=4, 128K"
    target: str          # ">= 600 TFLOP/s"
    measured: str        # "412 TFLOP/s (4.25 ms)"
    met: bool


GOALS: list[Goal] = []   # filled by the benchmark families as they run; printed after the table


def record_goal(goal: str, target: str, measured: str, met: bool) -> None:
    GOALS.append(Goal(goal, target, measured, met))
    print(f"# {goal}: {measured} (target {target}): {_status(GOALS[-1], GOALS)}", flush=True)


def _status(g: Goal, goals: list[Goal]) -> str:
    """met / missed, or void for any goal but G0 itself in a run whose G0 was missed."""
    if not g.goal.startswith("G0") and any(x.goal.startswith("G0") and not x.met for x in goals):
        return "void (G0 missed)"
    return "met" if g.met else "missed"


def goals_markdown(goals: list[Goal] | None = None) -> str:
    goals = GOALS if goals is None else goals
    if not goals:
        return ""
    out = ["| goal | target | measured | status |", "|---|---|---|---|"]
    out += [f"| {g.goal} | {g.target} | {g.measured} | {_status(g, goals)} |" for g in goals]
    return "\n".join(out)


def bench_model():
    """The bench config (`preset("bench")`, bf16) with seeded random weights, on the GPU: the model
    of the end-to-end benchmarks (e2e.py, prefill.py)."""
    from k31c.config import preset
    from k31c.graph.model import K31ForCausalLM
    torch.manual_seed(0)
    m = K31ForCausalLM(preset("bench"))
    m.reset_parameters(torch.Generator().manual_seed(0))
    return m.eval().cuda()


def emit(lines: list[str], out: str | None) -> None:
    """Print a benchmark's report and, with `out`, write it to that file too."""
    text = "\n".join(lines)
    print(text)
    if out:
        from pathlib import Path
        Path(out).write_text(text + "\n")
