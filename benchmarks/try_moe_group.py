"""The routed experts' grouping in one program, against moe_experts.py's three launches.

`k31c::moe_experts` groups its A = N·k assignments by expert with a zeroed counter buffer (a
memset), then count (atomic adds), offsets (one program) and scatter (atomic cursors): five
graph nodes before the first GEMM. At decode sizes (A <= 1024) one program can do it all in
registers: counts by a histogram over the experts, offsets and tile ends by prefix sums, and the
grouped order by sorting the keys expert·NA + a (invalid experts sort last), so no memset, no
atomics, and the order inside an expert is ascending a (deterministic). This script checks the
one-program grouping against the three launches (counts, offsets, tile ends equal; each expert's
set of assignments equal) and times both as CUDA-graph replays at K3.1 Pro's 896 experts, k = 8,
N = 1, 16, 64 rows (on the CPU: the check only, under TRITON_INTERPRET=1).

    PYTHONPATH=. python benchmarks/try_moe_group.py
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k31c.lowering.triton import moe_experts as mx
try:
    from benchmarks.harness import graph_ms
except ImportError:  # run as a script from benchmarks/
    from harness import graph_ms


@triton.jit
def _group_kernel(idx_ptr, counts_ptr, offsets_ptr, tile_end_ptr, sorted_ptr, n_assign, n_experts,
                  NA: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr):
    a = tl.arange(0, NA)
    e = tl.load(idx_ptr + a, mask=a < n_assign, other=-1)
    ok = (a < n_assign) & (e >= 0) & (e < n_experts)
    counts = tl.histogram(tl.where(ok, e, 0), EP, mask=ok)
    cols = tl.arange(0, EP)
    cm = cols < n_experts
    tl.store(counts_ptr + cols, counts, mask=cm)
    tl.store(offsets_ptr + cols, tl.cumsum(counts, axis=0) - counts, mask=cm)
    tl.store(tile_end_ptr + cols, tl.cumsum((counts + BM - 1) // BM, axis=0), mask=cm)
    grouped = tl.sort(tl.where(ok, e, n_experts) * NA + a)        # expert-major, then a
    tl.store(sorted_ptr + a, grouped % NA, mask=a < tl.sum(ok.to(tl.int32), axis=0))


def group_one_program(idx: torch.Tensor, n_experts: int, bm: int):
    n_assign = idx.numel()
    dev = idx.device
    counts, offsets, tile_end = (torch.empty(n_experts, dtype=torch.int32, device=dev) for _ in range(3))
    sorted_a = torch.empty(n_assign, dtype=torch.int32, device=dev)
    _group_kernel[(1,)](idx, counts, offsets, tile_end, sorted_a, n_assign, n_experts,
                        NA=triton.next_power_of_2(n_assign), EP=triton.next_power_of_2(n_experts), BM=bm)
    return counts, offsets, tile_end, sorted_a


def group_three_launches(idx: torch.Tensor, n_experts: int, bm: int):
    """moe_experts.launch's grouping, launch for launch."""
    n_assign = idx.numel()
    dev = idx.device
    ints = torch.zeros(2 * n_experts, dtype=torch.int32, device=dev)
    counts, cursor = ints[:n_experts], ints[n_experts:]
    offsets, tile_end = (torch.empty(n_experts, dtype=torch.int32, device=dev) for _ in range(2))
    sorted_a = torch.empty(n_assign, dtype=torch.int32, device=dev)
    groups = (triton.cdiv(n_assign, mx._GROUP_BLOCK),)
    mx._count_kernel[groups](idx, counts, n_assign, n_experts, BLOCK=mx._GROUP_BLOCK)
    mx._offsets_kernel[(1,)](counts, offsets, tile_end, n_experts, BM=bm, EP=triton.next_power_of_2(n_experts))
    mx._scatter_kernel[groups](idx, offsets, cursor, sorted_a, n_assign, n_experts, BLOCK=mx._GROUP_BLOCK)
    return counts, offsets, tile_end, sorted_a


def check(idx: torch.Tensor, n_experts: int, bm: int) -> None:
    one, three = group_one_program(idx, n_experts, bm), group_three_launches(idx, n_experts, bm)
    for name, x, y in zip(("counts", "offsets", "tile_end"), one[:3], three[:3]):
        assert torch.equal(x, y), name
    counts, offsets = three[0].tolist(), three[1].tolist()
    for ex in range(n_experts):
        lo, hi = offsets[ex], offsets[ex] + counts[ex]
        got, want = one[3][lo:hi], three[3][lo:hi]
        assert torch.equal(got, want.sort().values), f"expert {ex}: {got.tolist()} vs {want.tolist()}"
        assert bool((idx.flatten()[got.long()] == ex).all())


def graph_us(fn, launches: int = 20) -> float:
    """Median time of one launch of `fn`, replayed from a CUDA graph of `launches` launches."""
    return 1e3 * graph_ms(fn, calls=launches)


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    n_experts, k, bm = 896, 8, 16
    for n in (1, 16, 64):
        idx = torch.stack([torch.randperm(n_experts, generator=gen, device=dev)[:k] for _ in range(n)]).int()
        idx[0, 0] = -1                                   # a padding assignment: skipped
        check(idx, n_experts, bm)
        line = f"N={n} A={n * k}: one-program grouping == three launches"
        if dev == "cuda":
            line += (f"; one program {graph_us(lambda: group_one_program(idx, n_experts, bm)):.1f} us, "
                     f"three launches + memset {graph_us(lambda: group_three_launches(idx, n_experts, bm)):.1f} us")
        print(line)


if __name__ == "__main__":
    main()
