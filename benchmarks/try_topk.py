"""The top-k select's building blocks and its filter's launch shapes, timed on the GPU.

1. Micro-costs of one program (CUDA-graph replays of 20 launches; an empty kernel for the
   launch cost): tl.histogram levels over 2048 / 8192 register-resident keys (32 bins),
   `radix_select.select_kth` (7 levels of 5-bit digits), and the cumsum compaction the refine ends with.
2. `topk._filter_kernel` at 64 rows x 128K and x 1M over filter programs in all (1024, 4096,
   16384), score tiles (256 to 2048) and warps (2, 4, 8), after one plan launch; the counter is
   reset before every launch so each appends as the real one does.

3. (`regs`) the registered filter under register caps (`maxnreg`), over tiles and warps.

The filter's earlier form (one scan over the whole tile, stores re-laid out through shared
memory) and the probes that took it apart step by step are in git history (BENCHMARKS.md, top-k).

    PYTHONPATH=. python benchmarks/try_topk.py [regs]
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from k31c.lowering.triton import topk, topk_plan
from k31c.lowering.triton.device import sm_count
from k31c.lowering.triton.radix_select import select_kth
try:
    from benchmarks.harness import graph_ms
except ImportError:  # run as a script from benchmarks/
    from harness import graph_ms


@triton.jit
def _hist_levels(x_ptr, out_ptr, N: tl.constexpr, LEVELS: tl.constexpr, BINS: tl.constexpr):
    offs = tl.arange(0, N)
    v = tl.load(x_ptr + tl.program_id(0) * N + offs).to(tl.uint32, bitcast=True)
    acc = tl.zeros([BINS], tl.int32)
    live = offs < N
    for level in range(LEVELS):
        d = ((v >> (level * 3).to(tl.uint32)) & (BINS - 1)).to(tl.int32)
        acc += tl.histogram(d, BINS, mask=live)
        live = live & (d != 3)            # a mask that changes per level, as in select_kth
    tl.store(out_ptr + tl.program_id(0) * BINS + tl.arange(0, BINS), acc)


@triton.jit
def _select(x_ptr, out_ptr, k, N: tl.constexpr):
    offs = tl.arange(0, N)
    v = tl.load(x_ptr + tl.program_id(0) * N + offs).to(tl.uint32, bitcast=True)
    t, _, _ = select_kth(v, offs < N, k, 7)
    tl.store(out_ptr + tl.program_id(0), t.to(tl.int32, bitcast=True))


@triton.jit
def _compact(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    sel = (tl.load(x_ptr + tl.program_id(0) * N + offs) > 0).to(tl.int32)
    tl.store(out_ptr + tl.program_id(0) * N + tl.cumsum(sel, 0) - sel, offs, mask=sel > 0)


@triton.jit
def _empty(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 1)


def graph_us(fn, launches: int = 20) -> float:
    """Median time of one launch of `fn`, replayed from a CUDA graph of `launches` launches."""
    return 1e3 * graph_ms(fn, calls=launches)


def micro_costs() -> None:
    out = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
    print(f"empty kernel: {graph_us(lambda: _empty[(1,)](out)):.1f} us")
    for n in (2048, 8192):
        x = torch.randn(n, device="cuda")
        for warps in ((4, 16) if n == 2048 else (8, 16)):
            one = graph_us(lambda: _hist_levels[(1,)](x, out, N=n, LEVELS=1, BINS=32, num_warps=warps))
            seven = graph_us(lambda: _hist_levels[(1,)](x, out, N=n, LEVELS=7, BINS=32, num_warps=warps))
            sel = graph_us(lambda: _select[(1,)](x, out, 2048 if n > 2048 else 500, N=n, num_warps=warps))
            comp = graph_us(lambda: _compact[(1,)](x, out, N=n, num_warps=warps))
            print(f"{n} keys, {warps} warps: histogram 1 level {one:.1f} us, 7 levels {seven:.1f} us; "
                  f"select_kth {sel:.1f} us; cumsum compaction {comp:.1f} us")


def _planned(scores: torch.Tensor, **plan_args):
    """The plan and workspace of a top-k over `scores` (64 rows, k = 2048), the plan launch run."""
    n_rows, ctx = scores.shape
    row_len = torch.full((n_rows,), ctx, dtype=torch.int32, device="cuda")
    out = torch.empty(n_rows, 2048, dtype=torch.int32, device="cuda")
    p = topk_plan.plan(n_rows, ctx, 2048, sm_count(scores.device), **plan_args)
    ws = p.workspace("cuda")
    topk.launch_plan(scores, row_len, out, p, ws, PTX=True)
    return row_len, p, ws


def _filter(scores, row_len, p, ws, q, tile: int, warps: int, **extra):
    """One filter launch of plan `q` on the state and candidate buffers of plan `p` (its programs'
    own slots and tie counts at q's chunking), the rows' candidate counters reset first (so it
    appends as the real launch does); returns the compiled kernel."""
    ws["state"].view(scores.shape[0], topk_plan.ROW_STATE)[:, 0].zero_()
    own = q.workspace("cuda")
    return topk._filter_kernel[(scores.shape[0], q.n_chunks)](
        scores, scores.stride(0), row_len, ws["state"], ws["ckey"], ws["cpos"], own["hkey"], own["hpos"],
        own["ties"], p.cap, q.chunk, TILE=tile, SLOTS=q.slots, PTX=True, num_warps=warps, **extra)


def filter_sweep() -> None:
    for ctx in (128 << 10, 1 << 20):
        scores = torch.randn(64, ctx, device="cuda")
        row_len, p, ws = _planned(scores)
        for programs in (1024, 4096, 16384):
            for tile in (256, 512, 1024, 2048):
                q = topk_plan.plan(64, ctx, 2048, sm_count(scores.device), tile=tile, programs=programs)
                for warps in (2, 4, 8):
                    us = graph_us(lambda: _filter(scores, row_len, p, ws, q, tile, warps), launches=10)
                    print(f"filter 64x{ctx >> 10}K: {programs} programs, tile {tile}, {warps} warps "
                          f"(chunk {q.chunk}): {us:.1f} us")


def filter_regs() -> None:
    """The registered filter under register caps, over tiles and warps; the counter is reset
    before every launch."""
    for ctx in (128 << 10, 1 << 20):
        scores = torch.randn(64, ctx, device="cuda")
        row_len, p, ws = _planned(scores)
        for tile, warps in ((512, 2), (512, 4), (1024, 4), (1024, 8), (2048, 8)):
            q = topk_plan.plan(64, ctx, 2048, tile=tile)
            for cap in (None, 96, 72, 64, 48, 40):
                extra = {} if cap is None else {"maxnreg": cap}

                def launch():
                    return _filter(scores, row_len, p, ws, q, tile, warps, **extra)
                try:
                    ck = launch()
                    us = graph_us(launch, launches=10)
                except Exception as e:  # noqa: BLE001  (a cap that does not compile is reported)
                    print(f"filter 64x{ctx >> 10}K tile {tile} warps {warps} maxnreg {cap}: {type(e).__name__}")
                    continue
                print(f"filter 64x{ctx >> 10}K tile {tile}, {warps} warps, maxnreg {cap}: {us:.1f} us "
                      f"({ck.n_regs} registers, {ck.n_spills} spilled)")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("try_topk.py times kernels on a CUDA device; none is visible")
    if sys.argv[1:] == ["regs"]:
        filter_regs()
    else:
        micro_costs()
        filter_sweep()
