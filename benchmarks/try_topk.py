"""The top-k select's building blocks and its filter's launch shapes, timed on the GPU.

1. Micro-costs of one program (CUDA-graph replays of 20 launches; an empty kernel for the
   launch cost): tl.histogram levels over 2048 / 8192 register-resident keys (32 bins),
   `radix_select.select_kth` (7 levels of 5-bit digits), and the cumsum compaction the refine ends with.
2. `topk._filter_kernel` at 64 rows x 128K and x 1M over filter programs in all (1024, 4096,
   16384), score tiles (1024, 2048, 4096) and warps (4, 8), after one plan launch. Its counters
   are not reset between launches, so later launches append past the buffer (masked stores, the
   same atomics): the time is what is measured, not the result.
3. Where the filter's time goes: the same loop at the registered launch shape with its work
   added step by step (stream the keys and reduce them; + the threshold compares and tie
   counts; + one atomic per tile on the row's counter; + the cumsum compaction and the stores,
   which is the real filter; the slot wraps at the buffer size so every launch stores); and two
   variants: the cumsum alone, one atomic per selected key (its own slot) instead of it, and the
   filter with a relaxed atomic (Triton's default acq_rel one also orders the earlier stores).
   Then two whole filters that take the atomic off the tile's critical path (`_filter_variant`:
   software pipelined; two passes), first checked against the registered filter (the same
   candidates, counts and ties at a set threshold; also on the CPU under TRITON_INTERPRET=1).

4. (`stages`) the filter with its loads software-pipelined through shared memory
   (`_filter_staged`) over programs, tiles and pipeline depth.

5. (`regs`) the registered filter under register caps (`maxnreg`), over tiles and warps.

    PYTHONPATH=. python benchmarks/try_topk.py [steps | stages | regs]   (the check and part 3, 4 or 5)
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from k31c.lowering.triton import topk
from k31c.lowering.triton.radix_select import order_key, select_kth
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
def _chunk_of(state_ptr, src_ptr, src_stride, chunk, n):
    """This program's row state, threshold, chunk [lo, hi) and score row."""
    row = tl.program_id(0)
    st = state_ptr + row * topk.ROW_STATE
    thresh = tl.load(st + topk.ST_THRESH).to(tl.uint32, bitcast=True)
    lo = tl.program_id(1) * chunk
    return st, thresh, lo, tl.minimum(lo + chunk, n), src_ptr + row.to(tl.int64) * src_stride


@triton.jit
def _filter_probe(src_ptr, src_stride, state_ptr, ckey_ptr, cpos_ptr, sink_ptr, cap, chunk, n,
                  TILE: tl.constexpr, STEP: tl.constexpr):
    """topk._filter_kernel's loop with its work cut at STEP: 0 stream + reduce, 1 + compares and
    tie counts, 2 + one atomic per tile, 3 + cumsum compaction and stores (the whole filter); 4: 1
    + the cumsum alone; 5: 1 + one atomic per selected key and its stores (no cumsum); 6: 3 with
    a relaxed atomic; 7: 3 without the atomic (each program stores from a base of its own, as
    per-program candidate segments would)."""
    row = tl.program_id(0)
    st, thresh, lo, hi, src_row = _chunk_of(state_ptr, src_ptr, src_stride, chunk, n)
    acc = tl.zeros([TILE], tl.int32)
    for start in range(lo, hi, TILE):
        pos = start + tl.arange(0, TILE)
        live = pos < hi
        key = order_key(tl.load(src_row + pos, mask=live, other=0.0))
        if STEP == 0:
            acc = acc ^ key.to(tl.int32, bitcast=True)
        else:
            acc += (live & (key == thresh)).to(tl.int32)
            sel = live & (key > thresh)
            seli = sel.to(tl.int32)
            nsel = tl.sum(seli, 0)
            if STEP == 1:
                acc += nsel
            elif STEP == 5:      # one atomic per selected key: its own slot, no cumsum
                idx = tl.atomic_add(st + topk.ST_CNT + tl.zeros_like(seli), 1, mask=sel) & (cap - 1)
                tl.store(ckey_ptr + row.to(tl.int64) * cap + idx, key.to(tl.int32, bitcast=True), mask=sel)
                tl.store(cpos_ptr + row.to(tl.int64) * cap + idx, pos, mask=sel)
            elif STEP == 4:      # the cumsum alone
                acc += tl.cumsum(seli, 0)
            else:
                if STEP == 7:    # no atomic: a base of this program's own for each tile
                    base = tl.program_id(1) * 64 + start
                elif STEP == 6:  # the filter with a relaxed atomic (no fence on the stores before it)
                    base = tl.atomic_add(st + topk.ST_CNT, nsel, sem="relaxed")
                else:
                    base = tl.atomic_add(st + topk.ST_CNT, nsel)
                if STEP == 2:
                    acc += base
                else:            # the slot wraps at cap (a power of two) so every launch stores
                    idx = (base + tl.cumsum(seli, 0) - seli) & (cap - 1)
                    tl.store(ckey_ptr + row.to(tl.int64) * cap + idx, key.to(tl.int32, bitcast=True), mask=sel)
                    tl.store(cpos_ptr + row.to(tl.int64) * cap + idx, pos, mask=sel)
    tl.store(sink_ptr + row * tl.num_programs(1) + tl.program_id(1), tl.max(acc, 0))   # keeps the work live


@triton.jit
def _store_tile(ckey_row, cpos_row, key, pos, seli, base, cap, WRAP: tl.constexpr):
    """A tile's selected (key, position) at base.. of the row's buffer, in tile order (WRAP: the
    slot wraps at cap, a power of two, for timing loops that never reset the counter)."""
    idx = base + tl.cumsum(seli, 0) - seli
    ok = seli > 0
    if WRAP:
        idx = idx & (cap - 1)
    else:
        ok = ok & (idx < cap)
    tl.store(ckey_row + idx, key.to(tl.int32, bitcast=True), mask=ok)
    tl.store(cpos_row + idx, pos, mask=ok)


@triton.jit
def _tile_keys(src_row, start, hi, TILE: tl.constexpr):
    pos = start + tl.arange(0, TILE)
    live = pos < hi
    return pos, live, order_key(tl.load(src_row + pos, mask=live, other=0.0))


@triton.jit
def _filter_variant(src_ptr, src_stride, state_ptr, ckey_ptr, cpos_ptr, ties_ptr, cap, chunk, n,
                    TILE: tl.constexpr, FORM: tl.constexpr, WRAP: tl.constexpr):
    """topk._filter_kernel with the atomic off the tile's critical path. FORM 0: software
    pipelined (tile i's atomic is issued before tile i-1's stores, whose base came back during
    tile i's load); FORM 1: two passes over the chunk (count, one atomic per program, then the
    stores from a running offset; the second read mostly hits L2)."""
    row = tl.program_id(0)
    st, thresh, lo, hi, src_row = _chunk_of(state_ptr, src_ptr, src_stride, chunk, n)
    ckey_row = ckey_ptr + row.to(tl.int64) * cap
    cpos_row = cpos_ptr + row.to(tl.int64) * cap
    ties = tl.zeros([TILE], tl.int32)
    if FORM == 0:
        pkey = tl.zeros([TILE], tl.uint32)
        ppos = tl.zeros([TILE], tl.int32)
        psel = tl.zeros([TILE], tl.int32)
        pbase = tl.zeros((), tl.int32)
        for start in range(lo, hi, TILE):
            pos, live, key = _tile_keys(src_row, start, hi, TILE)
            ties += (live & (key == thresh)).to(tl.int32)
            seli = (live & (key > thresh)).to(tl.int32)
            base = tl.atomic_add(st + topk.ST_CNT, tl.sum(seli, 0), sem="relaxed")
            _store_tile(ckey_row, cpos_row, pkey, ppos, psel, pbase, cap, WRAP)
            pkey, ppos, psel, pbase = key, pos, seli, base
        _store_tile(ckey_row, cpos_row, pkey, ppos, psel, pbase, cap, WRAP)
    else:
        total = tl.zeros((), tl.int32)
        for start in range(lo, hi, TILE):
            pos, live, key = _tile_keys(src_row, start, hi, TILE)
            ties += (live & (key == thresh)).to(tl.int32)
            total += tl.sum((live & (key > thresh)).to(tl.int32), 0)
        off = tl.atomic_add(st + topk.ST_CNT, total, sem="relaxed")
        for start in range(lo, hi, TILE):
            pos, live, key = _tile_keys(src_row, start, hi, TILE)
            seli = (live & (key > thresh)).to(tl.int32)
            _store_tile(ckey_row, cpos_row, key, pos, seli, off, cap, WRAP)
            off += tl.sum(seli, 0)
    tl.store(ties_ptr + row * tl.num_programs(1) + tl.program_id(1), tl.sum(ties, 0))


@triton.jit
def _filter_staged(src_ptr, src_stride, row_len_ptr, state_ptr, ckey_ptr, cpos_ptr, ties_ptr, cap,
                   chunk, TILE: tl.constexpr, STAGES: tl.constexpr):
    """topk._filter_kernel with its loads left to Triton's software pipeliner (`tl.range`,
    STAGES deep through shared memory: bytes in flight that hold no registers) instead of the
    one-tile register prefetch."""
    row = tl.program_id(0)
    rows = row + tl.zeros([1], tl.int32)
    st_rows = state_ptr + rows * topk.ROW_STATE
    n = tl.load(row_len_ptr + row)
    thresh = tl.load(st_rows + topk.ST_THRESH).to(tl.uint32, bitcast=True)
    lo = tl.program_id(1) * chunk
    hi = tl.minimum(lo + chunk, n)
    src_row = src_ptr + row.to(tl.int64) * src_stride
    ties = tl.zeros([1, TILE], tl.int32)
    for start in tl.range(lo, hi, TILE, num_stages=STAGES):
        pos = start + tl.arange(0, TILE)
        live = (pos < hi)[None, :]
        key = order_key(tl.load(src_row + pos, mask=pos < hi, other=0.0))[None, :]
        ties += (live & (key == thresh[:, None])).to(tl.int32)
        topk.append_candidates(st_rows, ckey_ptr + rows.to(tl.int64) * cap, cpos_ptr + rows.to(tl.int64) * cap,
                               key, pos[None, :], live & (key > thresh[:, None]), cap)
    tl.store(ties_ptr + rows * tl.num_programs(1) + tl.program_id(1), tl.sum(ties, 1))


def check_filter_variants(device: str = "cuda") -> None:
    """Both variants append the same candidates (as a set), count and ties as the registered
    filter, at a set threshold (scores > 0.5 and == 0.5) over rows with planted ties."""
    rows, width = 3, 5000
    scores = torch.randn(rows, width, device=device)
    scores[:, ::7] = 0.5
    p = topk.plan(rows, width, 64, programs=8)
    key_half = 0x3F000000 | 0x80000000          # order_key(0.5)
    results = []
    for form in (None, 0, 1, "staged"):
        ws = p.workspace(device)
        ws["state"].zero_()
        ws["state"].view(rows, topk.ROW_STATE)[:, 1] = key_half - (1 << 32)
        row_len = torch.full((rows,), width, dtype=torch.int32, device=device)
        args = (scores, scores.stride(0))
        if form == "staged":
            _filter_staged[(rows, p.n_chunks)](*args, row_len, ws["state"], ws["ckey"], ws["cpos"], ws["ties"],
                                               p.cap, p.chunk, TILE=topk.SCORE_TILE, STAGES=3)
        elif form is None:
            topk._filter_kernel[(rows, p.n_chunks)](*args, row_len, ws["state"], ws["ckey"], ws["cpos"],
                                                    ws["ties"], p.cap, p.chunk, TILE=topk.SCORE_TILE)
        else:
            _filter_variant[(rows, p.n_chunks)](*args, ws["state"], ws["ckey"], ws["cpos"], ws["ties"], p.cap,
                                                p.chunk, width, TILE=topk.SCORE_TILE, FORM=form, WRAP=False)
        count = ws["state"].view(rows, topk.ROW_STATE)[:, 0].tolist()
        sets = [set(zip(ws["ckey"].view(rows, -1)[r, :count[r]].tolist(), ws["cpos"].view(rows, -1)[r, :count[r]].tolist()))
                for r in range(rows)]
        results.append((count, sets, ws["ties"].view(rows, -1).sum(1).tolist()))
    want = results[0]
    assert all(c == int((scores[r] > 0.5).sum()) for r, c in enumerate(want[0])), want[0]
    for form, got in zip((0, 1, "staged"), results[1:]):
        assert got == want, f"form {form} differs from the registered filter"
    print(f"filter variants == the registered filter (counts {want[0]}, ties {want[2]})")


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
    p = topk.plan(n_rows, ctx, 2048, **plan_args)
    ws = p.workspace("cuda")
    topk._plan_kernel[(n_rows,)](scores, scores.stride(0), row_len, out, out.stride(0), ws["state"],
                                 p.k, p.cap, p.target, SAMPLES=p.samples, RUN=p.run,
                                 TILE=topk.REFINE_TILE, num_warps=topk._warps(p.samples))
    return row_len, p, ws


def filter_sweep() -> None:
    for ctx in (128 << 10, 1 << 20):
        scores = torch.randn(64, ctx, device="cuda")
        for programs in (1024, 4096, 16384):
            for tile in (1024, 2048, 4096):
                row_len, p, ws = _planned(scores, tile=tile, programs=programs)
                for warps in (4, 8):
                    us = graph_us(lambda: topk._filter_kernel[(64, p.n_chunks)](
                        scores, scores.stride(0), row_len, ws["state"], ws["ckey"], ws["cpos"], ws["ties"],
                        p.cap, p.chunk, TILE=tile, num_warps=warps), launches=10)
                    print(f"filter 64x{ctx >> 10}K: {programs} programs, tile {tile}, {warps} warps "
                          f"(chunk {p.chunk}): {us:.1f} us")


def filter_steps() -> None:
    for ctx in (128 << 10, 1 << 20):
        scores = torch.randn(64, ctx, device="cuda")
        _, p, ws = _planned(scores)
        sink = torch.empty(64 * p.n_chunks, dtype=torch.int32, device="cuda")
        floor_us = 64 * ctx * 4 / 4.1e6     # bytes over ~4.1 TB/s
        for step, what in enumerate(("stream + reduce", "+ compares, tie counts", "+ atomic per tile",
                                     "+ cumsum, stores (the filter)", "1 + cumsum alone",
                                     "1 + atomic per key, stores", "3 with a relaxed atomic",
                                     "3 without the atomic (a base of its own)")):
            us = graph_us(lambda: _filter_probe[(64, p.n_chunks)](
                scores, scores.stride(0), ws["state"], ws["ckey"], ws["cpos"], sink, p.cap, p.chunk, ctx,
                TILE=topk.SCORE_TILE, STEP=step, num_warps=topk.FILTER_WARPS), launches=10)
            print(f"filter steps 64x{ctx >> 10}K (chunk {p.chunk}, tile {topk.SCORE_TILE}): {what}: "
                  f"{us:.1f} us (read floor ~{floor_us:.1f})")
        for form, what in enumerate(("pipelined (atomic before the previous tile's stores)",
                                     "two passes (count, one atomic, stores)")):
            us = graph_us(lambda: _filter_variant[(64, p.n_chunks)](
                scores, scores.stride(0), ws["state"], ws["ckey"], ws["cpos"], ws["ties"], p.cap, p.chunk, ctx,
                TILE=topk.SCORE_TILE, FORM=form, WRAP=True, num_warps=topk.FILTER_WARPS), launches=10)
            print(f"filter variant 64x{ctx >> 10}K: {what}: {us:.1f} us")


def filter_stages() -> None:
    """The staged filter (loads pipelined through shared memory) over programs in all and depth,
    beside the registered filter at its launch shape, after one plan launch (the counter is reset
    before every replay so each launch appends as the real one does)."""
    for ctx in (128 << 10, 1 << 20):
        scores = torch.randn(64, ctx, device="cuda")
        row_len, p, ws = _planned(scores)
        cnt = ws["state"].view(64, topk.ROW_STATE)[:, 0]
        reg = graph_us(lambda: (cnt.zero_(), topk._filter_kernel[(64, p.n_chunks)](
            scores, scores.stride(0), row_len, ws["state"], ws["ckey"], ws["cpos"], ws["ties"], p.cap, p.chunk,
            TILE=topk.SCORE_TILE, num_warps=topk.FILTER_WARPS)), launches=10)
        print(f"filter 64x{ctx >> 10}K registered (+ counter reset): {reg:.1f} us")
        for programs in (1024, 2048, 4096):
            for tile, warps in ((1024, 4), (2048, 8)):
                q = topk.plan(64, ctx, 2048, tile=tile, programs=programs)
                for stages in (2, 3, 4):
                    try:
                        us = graph_us(lambda: (cnt.zero_(), _filter_staged[(64, q.n_chunks)](
                            scores, scores.stride(0), row_len, ws["state"], ws["ckey"], ws["cpos"], ws["ties"],
                            p.cap, q.chunk, TILE=tile, STAGES=stages, num_warps=warps)), launches=10)
                    except Exception as e:  # noqa: BLE001  (a shape that does not compile is reported)
                        print(f"staged {programs} programs tile {tile} stages {stages}: {type(e).__name__}")
                        continue
                    print(f"filter 64x{ctx >> 10}K staged: {programs} programs (chunk {q.chunk}), tile {tile}, "
                          f"{warps} warps, {stages} stages: {us:.1f} us")


def filter_regs() -> None:
    """The registered filter under register caps (its 110 registers a thread at tile 1024 / 4
    warps allow 4 programs an SM: 25% occupancy), over tiles and warps; the counter is reset
    before every launch."""
    for ctx in (128 << 10, 1 << 20):
        scores = torch.randn(64, ctx, device="cuda")
        row_len, p, ws = _planned(scores)
        cnt = ws["state"].view(64, topk.ROW_STATE)[:, 0]
        for tile, warps in ((512, 2), (512, 4), (1024, 4), (1024, 8), (2048, 8)):
            q = topk.plan(64, ctx, 2048, tile=tile)
            for cap in (None, 96, 72, 64, 48, 40):
                extra = {} if cap is None else {"maxnreg": cap}

                def launch():
                    cnt.zero_()
                    return topk._filter_kernel[(64, q.n_chunks)](
                        scores, scores.stride(0), row_len, ws["state"], ws["ckey"], ws["cpos"], ws["ties"],
                        p.cap, q.chunk, TILE=tile, num_warps=warps, **extra)
                try:
                    ck = launch()
                    us = graph_us(launch, launches=10)
                except Exception as e:  # noqa: BLE001  (a cap that does not compile is reported)
                    print(f"filter 64x{ctx >> 10}K tile {tile} warps {warps} maxnreg {cap}: {type(e).__name__}")
                    continue
                print(f"filter 64x{ctx >> 10}K tile {tile}, {warps} warps, maxnreg {cap}: {us:.1f} us "
                      f"({ck.n_regs} registers, {ck.n_spills} spilled)")


if __name__ == "__main__":
    if not torch.cuda.is_available():       # the CPU (TRITON_INTERPRET=1): the variants' check only
        check_filter_variants("cpu")
        sys.exit(0)
    check_filter_variants()
    if sys.argv[1:] == ["regs"]:
        filter_regs()
        sys.exit(0)
    if sys.argv[1:] == ["stages"]:
        filter_stages()
        sys.exit(0)
    if sys.argv[1:] != ["steps"]:
        micro_costs()
        filter_sweep()
    filter_steps()
