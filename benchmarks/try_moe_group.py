"""moe_experts.py's two groupings of the routed assignments, checked against each other and timed.

At decode sizes (A <= GROUP_ONE_MAX) `k31c::moe_experts` groups its A = N·k assignments in one
program (`_group_kernel`: a histogram, prefix sums, a sort of expert-major keys); larger A zero
two counter arrays (a memset) and launch count, offsets and scatter: four graph nodes instead of
one. This script checks the two against each other (counts, offsets, tile ends equal; each
expert's set of assignments equal) and times both as CUDA-graph replays at K3.1 Pro's 896
experts, k = 8, N = 1, 16, 64 rows (on the CPU: the check only, under TRITON_INTERPRET=1).

    PYTHONPATH=. python benchmarks/try_moe_group.py
"""
from __future__ import annotations

import torch

from k31c.lowering.triton import moe_experts as mx
try:
    from benchmarks.harness import graph_ms
except ImportError:  # run as a script from benchmarks/
    from harness import graph_ms


def group_one_program(idx: torch.Tensor, n_experts: int, bm: int):
    return mx.group(idx, n_experts, bm, "one", {})


def group_three_launches(idx: torch.Tensor, n_experts: int, bm: int):
    return mx.group(idx, n_experts, bm, "three", {})


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
