"""Triton radix top-k (`k31c::topk_select`): the select pipeline's kernels and its launcher.

Selection (spec/model.md §6.7.4): row t keeps the k largest composites `key << 32 | position`
over its positions < row_len[t], where key is the score's order-preserving uint32 image (-0.0 ties
with +0.0, every NaN sits above +inf, as torch.sort orders them). Composites are distinct, so the
set is unique and equals the reference's: among equal scores the higher position wins.

Fixed launch sequence (no host sync; grids from static shapes; CUDA-graph safe):
1. plan, one program per row: rows with row_len <= k are written out (0..n-1, then -1). Rows
   with n <= CAP take threshold T = 0 (every position is a candidate). Longer rows gather a
   strided sample (runs of 8) and take as T the sample key ranked TARGET*SAMPLES/n (a 24-bit
   radix select), so about TARGET = 2.5k keys of the row lie above T.
2. filter, several programs per row: one pass appends each (key, position) with key > T to the
   row's candidate buffer (atomic counter) and counts the keys == T of its chunk.
3. refine, one program per row, with G keys > T buffered and E keys == T in the row:
   - k <= G <= CAP: exact top-k of the buffer (8-bit radix select on the key, then on the
     position among the keys tied at the k-th);
   - G < k <= G + E (topk_select only; e.g. ReLU zeros at T): the whole buffer plus the k - G
     highest positions at T, read from the chunks with ties, top down;
   - otherwise (the sample misjudged T): the row joins the fallback list.
4. fallback, 4 digit passes + 1 emit pass over the listed rows; every program exits at once when
   the list is empty (~1 us a pass). Exact 8-bit radix select on the full row: each program
   histograms its chunk, the row's last program (atomic done counter) picks the digit and the
   remaining k; after 4 digits the k-th key is exact, every program writes its keys above it and
   the row's last program takes the remaining ties from the top of the row down.


The fused indexer + top-k (indexer_topk.py) runs this same pipeline on scores computed in-kernel:
its own sample and filter kernels feed the plan, refine and fallback kernels here, whose key
loads switch on FUSED (topk_keys.py). Split so that this module holds the selection and
indexer_topk.py the scoring passes and the fused launcher.

Where it stands (H200, 64 rows, k = 2048, CUDA-graph replay, 2026-11-29): 0.130 ms at 128K and
0.42 ms at 1M, 1.1x / 2.0x faster than torch.topk (goals 4x / 8x). Per kernel at 128K: plan 25 us,
filter 55 us, refine 29 us: the single-program plan and refine are latency bound and the filter
streams at ~0.6 TB/s. A variant with a register-resident plan sample, shorter stream programs
and an in-register refine (commit 036f262, topk_fast.py) measured slower everywhere (0.14 ms at
128K, 0.51-0.76 ms at 1M: its stream kernel ran at half the filter's rate) and was removed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k31c.graph.ops.indexer import _check_topk
from k31c.lowering.registry import register
from k31c.lowering.triton.topk_keys import _order_key, _row_keys
from k31c.lowering.triton.unit_stride import require_unit_stride

CAP = 12288            # candidate buffer per row (k <= 2048 → ~2.5k expected, 6k safe margin)
TARGET_NUM, TARGET_DEN = 5, 2   # expected candidates = 2.5 k
SAMPLES, RUN = 8192, 8          # sampled keys per long row, in runs of 8 adjacent positions
FB_PROGRAMS = 128               # programs of each fallback pass (each takes 1/128 of a row)
ROW_STATE = 8                   # int32 words of per-row state
DEBUG_PATHS = False             # tests: record in `last_paths` the path each row took (syncs)
last_paths: list[str] = []

# per-row state words
_CNT = tl.constexpr(0)      # candidates appended
_DONE = tl.constexpr(1)     # programs finished with this row in a fallback pass
_OUT = tl.constexpr(2)      # outputs written by the fallback emit pass
_THRESH = tl.constexpr(3)   # filter threshold key (uint32 bits)
_MODE = tl.constexpr(4)     # 1: row already written by plan (row_len <= k)
_KREM = tl.constexpr(5)     # fallback: how many of the keys matching PREFIX are still to take
_PREFIX = tl.constexpr(6)   # fallback: digits of the k-th key found so far
_RS = tl.constexpr(ROW_STATE)

# ---- selection helpers ------------------------------------------------------------------------

@triton.jit
def _append(st_rows, ckey_rows, cpos_rows, key, pos, sel, cap):
    """Append the selected (key, position) of a [R, T] tile to each row's candidate buffer."""
    seli = sel.to(tl.int32)
    nsel = tl.sum(seli, 1)
    if tl.sum(nsel, 0) > 0:
        base = tl.atomic_add(st_rows + _CNT, nsel, mask=nsel > 0)
        idx = base[:, None] + tl.cumsum(seli, 1) - seli
        ok = sel & (idx < cap)
        tl.store(ckey_rows[:, None] + idx, key.to(tl.int32, bitcast=True), mask=ok)
        tl.store(cpos_rows[:, None] + idx, pos + tl.zeros_like(idx), mask=ok)


@triton.jit
def _radix_select(key_ptr, pos_ptr, count, krem, tie_key, POS_PHASE: tl.constexpr, TILE: tl.constexpr,
                  LEVELS: tl.constexpr = 4):
    """In-program radix select (8-bit digits, top first) over the first `count` buffer entries of
    value = key, or (POS_PHASE) value = position among the entries whose key == tie_key.
    Returns (t, krem, exact): exact → exactly krem entries have value >= t (t a digit boundary);
    else t is the value to LEVELS digits (all 4: the full value) and krem of the entries at t are
    still to take."""
    prefix = tl.zeros((), tl.uint32)
    bins = tl.arange(0, 256)
    level = 0
    exact = level < 0
    while (level < LEVELS) & (exact == 0):
        shift = 24 - 8 * level
        high = (tl.full((), 0xFFFFFFFF, tl.uint64) << (shift + 8).to(tl.uint64)).to(tl.uint32)
        hist = tl.zeros([256], tl.int32)
        for start in range(0, count, TILE):
            offs = start + tl.arange(0, TILE)
            m = offs < count
            key = tl.load(key_ptr + offs, mask=m, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
            if POS_PHASE:
                m = m & (key == tie_key)
                val = tl.load(pos_ptr + offs, mask=m, other=0, cache_modifier=".cg").to(tl.uint32)
            else:
                val = key
            m = m & ((val & high) == (prefix & high))
            hist += tl.histogram(((val >> shift) & 0xFF).to(tl.int32), 256, mask=m)
        suffix = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist        # entries with digit >= d
        best = tl.max(tl.where(suffix >= krem, bins, 0), 0)
        krem -= tl.sum(tl.where(bins > best, hist, 0), 0)
        prefix = prefix | (best.to(tl.uint32) << shift)
        exact = tl.sum(tl.where(bins == best, hist, 0), 0) == krem
        level += 1
    return prefix, krem, exact


@triton.jit
def _sample_pos(i, n, SAMPLES: tl.constexpr, RUN: tl.constexpr):
    """Position of sample i of a row of n > SAMPLES keys: runs of RUN spread evenly."""
    return ((i // RUN).to(tl.int64) * n // (SAMPLES // RUN) + i % RUN).to(tl.int32)


@triton.jit
def _take_top_ties(row, lo, hi, thresh, take, out_row, base, src_ptr, src_stride, q_ptr, sq_t, sq_h,
                   w_ptr, sw_t, cache_ptr, scale_ptr, bt_ptr, sbt, row_req_ptr, H, D,
                   FUSED: tl.constexpr, BLOCK_SIZE: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
                   FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, TILE: tl.constexpr):
    """Write the `take` highest positions in [lo, hi) whose key == thresh to out_row[base:]
    (one program, reading tiles from the top down); returns the new base."""
    top = hi
    while (take > 0) & (top > lo):
        pos = top - TILE + tl.arange(0, TILE)
        live = (pos >= lo) & (pos < top)
        key = _row_keys(row, pos, live, src_ptr, src_stride, q_ptr, sq_t, sq_h, w_ptr, sw_t, cache_ptr,
                        scale_ptr, bt_ptr, sbt, row_req_ptr, H, D, FUSED, BLOCK_SIZE, HP, DP, FP8, DOT_DTYPE)
        tie = (live & (key == thresh)).to(tl.int32)
        sel = (tie > 0) & (tl.sum(tie, 0) - tl.cumsum(tie, 0) < take)    # ties above it in the tile
        seli = sel.to(tl.int32)
        tl.store(out_row + base + tl.cumsum(seli, 0) - seli, pos, mask=sel)
        base += tl.sum(seli, 0)
        take -= tl.sum(seli, 0)
        top -= TILE
    return base


# ---- kernels ----------------------------------------------------------------------------------

@triton.jit
def _plan_kernel(src_ptr, src_stride, row_len_ptr, out_ptr, out_stride, state_ptr, fb_ptr,
                 sample_ptr, hist_ptr, k, cap, target, PRESAMPLED: tl.constexpr, SAMPLES: tl.constexpr,
                 RUN: tl.constexpr, TILE: tl.constexpr):
    """Per row: reset its state; write it out if row_len <= k; else choose the filter threshold."""
    row = tl.program_id(0)
    n = tl.load(row_len_ptr + row)
    st = state_ptr + row * _RS
    if row == 0:
        tl.store(fb_ptr, 0)
    tl.store(st + _CNT, 0)
    tl.store(st + _DONE, 0)
    tl.store(st + _OUT, 0)
    tl.store(hist_ptr + row * 256 + tl.arange(0, 256), tl.zeros([256], tl.int32))
    thresh = tl.zeros((), tl.uint32)
    if n <= k:       # every visible position, then -1
        tl.store(st + _MODE, 1)
        for start in range(0, k, TILE):
            j = start + tl.arange(0, TILE)
            tl.store(out_ptr + row.to(tl.int64) * out_stride + j, tl.where(j < n, j, -1), mask=j < k)
    else:
        tl.store(st + _MODE, 0)
        if n > cap:  # threshold from a sample; shorter rows keep 0 (all positions are candidates)
            samples = sample_ptr + row.to(tl.int64) * SAMPLES
            if not PRESAMPLED:   # one gather of the whole sample, then the radix passes read it back
                i = tl.arange(0, SAMPLES)
                x = tl.load(src_ptr + row.to(tl.int64) * src_stride + _sample_pos(i, n, SAMPLES, RUN))
                tl.store(samples + i, _order_key(x).to(tl.int32, bitcast=True))
                tl.debug_barrier()
            rank = tl.minimum((target.to(tl.int64) * SAMPLES + n - 1) // n, SAMPLES).to(tl.int32)
            thresh, _, _ = _radix_select(samples, samples, SAMPLES, rank, 0, False, SAMPLES, 3)  # 24 bits
    tl.store(st + _THRESH, thresh.to(tl.int32, bitcast=True))


@triton.jit
def _filter_kernel(src_ptr, src_stride, row_len_ptr, state_ptr, ckey_ptr, cpos_ptr, ties_ptr, cap,
                   chunk, TILE: tl.constexpr):
    """One pass over a chunk of a row: append keys > threshold, count keys == threshold."""
    row = tl.program_id(0)
    rows = row + tl.zeros([1], tl.int32)
    st_rows = state_ptr + rows * _RS
    if tl.load(state_ptr + row * _RS + _MODE) == 0:
        n = tl.load(row_len_ptr + row)
        thresh = tl.load(st_rows + _THRESH).to(tl.uint32, bitcast=True)
        lo = tl.program_id(1) * chunk
        hi = tl.minimum(lo + chunk, n)
        src_row = src_ptr + row.to(tl.int64) * src_stride
        ties = tl.zeros([1, TILE], tl.int32)
        nxt = tl.load(src_row + lo + tl.arange(0, TILE), mask=lo + tl.arange(0, TILE) < hi, other=0.0)
        for start in range(lo, hi, TILE):
            pos = start + tl.arange(0, TILE)
            x = nxt          # the next tile's load is in flight while this one is filtered
            nxt = tl.load(src_row + pos + TILE, mask=pos + TILE < hi, other=0.0)
            key = _order_key(x)[None, :]
            live = (pos < hi)[None, :]
            ties += (live & (key == thresh[:, None])).to(tl.int32)
            _append(st_rows, ckey_ptr + rows.to(tl.int64) * cap, cpos_ptr + rows.to(tl.int64) * cap,
                    key, pos[None, :], live & (key > thresh[:, None]), cap)
        tl.store(ties_ptr + rows * tl.num_programs(1) + tl.program_id(1), tl.sum(ties, 1))


@triton.jit
def _refine_kernel(src_ptr, src_stride, row_len_ptr, out_ptr, out_stride, state_ptr, fb_ptr, ckey_ptr,
                   cpos_ptr, ties_ptr, k, cap, chunk, n_chunks, SCAN_TIES: tl.constexpr,
                   CP: tl.constexpr, TILE: tl.constexpr, STILE: tl.constexpr):
    """Per row, with G keys > threshold T in the buffer and E keys == T in the row:
    k <= G <= CAP: exact top-k of the buffer (key digits, then positions among ties);
    G < k <= G + E (SCAN_TIES): the whole buffer plus the k - G highest positions at T, found by
    reading chunks of the scores from the top; anything else goes to the fallback passes."""
    row = tl.program_id(0)
    st = state_ptr + row * _RS
    if tl.load(st + _MODE) == 0:
        count = tl.load(st + _CNT)
        thresh = tl.load(st + _THRESH).to(tl.uint32, bitcast=True)
        c = tl.arange(0, CP)
        ties = tl.load(ties_ptr + row * n_chunks + c, mask=c < n_chunks, other=0)
        need = k - count
        ckey = ckey_ptr + row.to(tl.int64) * cap
        cpos = cpos_ptr + row.to(tl.int64) * cap
        out_row = out_ptr + row.to(tl.int64) * out_stride
        use_ties = SCAN_TIES & (need > 0) & (need <= tl.sum(ties, 0)) & (count <= cap)
        if ((count >= k) & (count <= cap)) | use_ties:
            key_t = tl.zeros((), tl.uint32)
            pos_t = tl.zeros((), tl.uint32)
            if need <= 0:
                key_t, krem, exact = _radix_select(ckey, cpos, count, k, 0, False, TILE)
                if exact == 0:
                    pos_t, _, _ = _radix_select(ckey, cpos, count, krem, key_t, True, TILE)
            base = 0
            for start in range(0, count, TILE):
                offs = start + tl.arange(0, TILE)
                m = offs < count
                key = tl.load(ckey + offs, mask=m, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
                pos = tl.load(cpos + offs, mask=m, other=0, cache_modifier=".cg")
                sel = m & ((key > key_t) | ((key == key_t) & (pos.to(tl.uint32) >= pos_t)))
                seli = sel.to(tl.int32)
                tl.store(out_row + base + tl.cumsum(seli, 0) - seli, pos, mask=sel)
                base += tl.sum(seli, 0)
            if SCAN_TIES:  # chunks from the top, each giving its highest positions at T (need > 0 only)
                j = n_chunks - 1
                n = tl.load(row_len_ptr + row)
                while (need > 0) & (j >= 0):
                    take = tl.minimum(tl.sum(tl.where(c == j, ties, 0), 0), need)
                    if take > 0:
                        base = _take_top_ties(row, j * chunk, tl.minimum(j * chunk + chunk, n), thresh, take,
                                              out_row, base, src_ptr, src_stride, src_ptr, 0, 0, src_ptr, 0,
                                              src_ptr, src_ptr, src_ptr, 0, src_ptr, 0, 0, False, 1, 16, 16,
                                              False, tl.float32, STILE)
                    need -= take
                    j -= 1
        else:
            slot = tl.atomic_add(fb_ptr, 1)
            tl.store(fb_ptr + 1 + slot, row)
            tl.store(st + _PREFIX, 0)
            tl.store(st + _KREM, k)


@triton.jit
def _fb_chunk(n, NP: tl.constexpr, TILE: tl.constexpr):
    """This program's [lo, hi) share of a fallback row of n keys (whole tiles)."""
    chunk = tl.cdiv(tl.cdiv(n, NP), TILE) * TILE
    lo = tl.program_id(0) * chunk
    return lo, tl.minimum(lo + chunk, n)


@triton.jit
def _fb_digit_kernel(src_ptr, src_stride, q_ptr, sq_t, sq_h, w_ptr, sw_t, cache_ptr, scale_ptr, bt_ptr, sbt,
                     row_req_ptr, H, D, row_len_ptr, state_ptr, fb_ptr, hist_ptr,
                     LEVEL: tl.constexpr, NP: tl.constexpr, TILE: tl.constexpr,
                     FUSED: tl.constexpr, BLOCK_SIZE: tl.constexpr, HP: tl.constexpr,
                     DP: tl.constexpr, FP8: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Fallback digit LEVEL (bits 31-8*LEVEL .. 24-8*LEVEL of the k-th key) of every listed row."""
    bins = tl.arange(0, 256)
    for j in range(tl.load(fb_ptr)):
        row = tl.load(fb_ptr + 1 + j)
        st = state_ptr + row * _RS
        lo, hi = _fb_chunk(tl.load(row_len_ptr + row), NP, TILE)
        prefix = tl.load(st + _PREFIX).to(tl.uint32, bitcast=True)
        hist = tl.zeros([256], tl.int32)
        for start in range(lo, hi, TILE):
            pos = start + tl.arange(0, TILE)
            key = _row_keys(row, pos, pos < hi, src_ptr, src_stride, q_ptr, sq_t, sq_h, w_ptr, sw_t,
                            cache_ptr, scale_ptr, bt_ptr, sbt, row_req_ptr, H, D, FUSED, BLOCK_SIZE, HP, DP,
                            FP8, DOT_DTYPE)
            match = pos < hi
            if LEVEL > 0:
                match = match & ((key >> (32 - 8 * LEVEL)) == (prefix >> (32 - 8 * LEVEL)))
            hist += tl.histogram(((key >> (24 - 8 * LEVEL)) & 0xFF).to(tl.int32), 256, mask=match)
        hrow = hist_ptr + row * 256 + bins
        tl.atomic_add(hrow, hist, mask=hist > 0)
        tl.debug_barrier()
        if tl.atomic_add(st + _DONE, 1) == NP - 1:     # last program: choose the digit
            tl.store(st + _DONE, 0)
            # read and clear for the next level (and-with-0 = exchange with 0; AMD's buffer atomics
            # have no exchange in Triton 3.7)
            total = tl.atomic_and(hrow, tl.zeros_like(hist))
            krem = tl.load(st + _KREM)
            suffix = tl.sum(total, 0) - tl.cumsum(total, 0) + total  # keys with digit >= d
            best = tl.max(tl.where(suffix >= krem, bins, 0), 0)
            tl.store(st + _KREM, krem - tl.sum(tl.where(bins > best, total, 0), 0))
            tl.store(st + _PREFIX, (prefix | (best.to(tl.uint32) << (24 - 8 * LEVEL))).to(tl.int32, bitcast=True))


@triton.jit
def _fb_emit_kernel(src_ptr, src_stride, q_ptr, sq_t, sq_h, w_ptr, sw_t, cache_ptr, scale_ptr, bt_ptr, sbt,
                    row_req_ptr, H, D, row_len_ptr, out_ptr, out_stride, state_ptr, fb_ptr,
                    NP: tl.constexpr, TILE: tl.constexpr, FUSED: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
                    FP8: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Fallback output: every program writes its keys above the (exact) k-th key T; the row's last
    program then takes the remaining ties at T from the top of the row down."""
    for j in range(tl.load(fb_ptr)):
        row = tl.load(fb_ptr + 1 + j)
        st = state_ptr + row * _RS
        n = tl.load(row_len_ptr + row)
        lo, hi = _fb_chunk(n, NP, TILE)
        thresh = tl.load(st + _PREFIX).to(tl.uint32, bitcast=True)
        out_row = out_ptr + row.to(tl.int64) * out_stride
        for start in range(lo, hi, TILE):
            pos = start + tl.arange(0, TILE)
            key = _row_keys(row, pos, pos < hi, src_ptr, src_stride, q_ptr, sq_t, sq_h, w_ptr, sw_t,
                            cache_ptr, scale_ptr, bt_ptr, sbt, row_req_ptr, H, D, FUSED, BLOCK_SIZE, HP, DP,
                            FP8, DOT_DTYPE)
            sel = (pos < hi) & (key > thresh)
            seli = sel.to(tl.int32)
            n_sel = tl.sum(seli, 0)
            if n_sel > 0:
                base = tl.atomic_add(st + _OUT, n_sel)
                tl.store(out_row + base + tl.cumsum(seli, 0) - seli, pos, mask=sel)
        tl.debug_barrier()
        if tl.atomic_add(st + _DONE, 1) == NP - 1:
            _take_top_ties(row, 0, n, thresh, tl.load(st + _KREM), out_row, tl.atomic_add(st + _OUT, 0),
                           src_ptr, src_stride, q_ptr, sq_t, sq_h, w_ptr, sw_t, cache_ptr, scale_ptr, bt_ptr,
                           sbt, row_req_ptr, H, D, FUSED, BLOCK_SIZE, HP, DP, FP8, DOT_DTYPE, TILE)


# ---- launchers --------------------------------------------------------------------------------

def _pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _workspace(n_rows: int, width: int, k: int, n_chunks: int, device) -> tuple[int, dict]:
    """Scratch for one call (one int32 allocation): per-row state, fallback list, candidate
    buffers, samples, per-chunk tie counts and the fallback's digit histograms."""
    cap = min(max(CAP, 6 * k), width)
    sizes = {"state": n_rows * ROW_STATE, "fb": n_rows + 1, "ckey": n_rows * cap, "cpos": n_rows * cap,
             "samples": n_rows * SAMPLES if width > cap else 1, "ties": n_rows * n_chunks,
             "hist": n_rows * 256}
    flat = torch.empty(sum(sizes.values()), dtype=torch.int32, device=device)
    return cap, dict(zip(sizes, flat.split(list(sizes.values()))))


def _chunking(width: int, groups: int, tile: int, programs: int) -> tuple[int, int]:
    """Positions per filter program (whole tiles) and programs per row group, ~`programs` in all."""
    per_group = max(1, programs // max(groups, 1))
    chunk = max(tile, triton.cdiv(triton.cdiv(width, per_group), tile) * tile)
    return chunk, triton.cdiv(width, chunk)


def _finish(src: tuple, row_len, out, ws, k: int, cap: int, chunk: int, n_chunks: int, scan_ties: bool,
            fb_args: dict) -> None:
    """Refine every row from its candidates, then the exact radix passes for the rows the
    candidates could not settle (usually none: those passes then exit at once)."""
    n_rows = out.shape[0]
    _refine_kernel[(n_rows,)](src[0], src[1], row_len, out, out.stride(0), ws["state"], ws["fb"], ws["ckey"],
                              ws["cpos"], ws["ties"], k, cap, chunk, n_chunks, SCAN_TIES=scan_ties,
                              CP=_pow2(n_chunks), TILE=_REFINE_TILE, STILE=_REFINE_TILE, num_warps=8)
    common = (*src, row_len)
    for level in range(4):
        _fb_digit_kernel[(FB_PROGRAMS,)](*common, ws["state"], ws["fb"], ws["hist"], LEVEL=level,
                                         NP=FB_PROGRAMS, **fb_args)
    _fb_emit_kernel[(FB_PROGRAMS,)](*common, out, out.stride(0), ws["state"], ws["fb"], NP=FB_PROGRAMS,
                                    **fb_args)
    if DEBUG_PATHS:
        last_paths[:] = row_paths(ws, row_len, k, cap)


def row_paths(ws, row_len, k: int, cap: int) -> list[str]:
    """The path each row of a finished call took, read back from its workspace: "direct"
    (row_len <= k), "all" (row_len <= cap: every position a candidate), "sampled" (a sampled
    threshold, settled from the buffer), "ties" (the buffer plus keys at the threshold), "fallback"."""
    state = ws["state"].view(-1, ROW_STATE).cpu()
    listed = set(ws["fb"][1:1 + int(ws["fb"][0])].tolist())
    paths = []
    for row, n in enumerate(row_len.tolist()):
        if int(state[row, 4]) == 1:                       # _MODE
            paths.append("direct")
        elif row in listed:
            paths.append("fallback")
        elif int(state[row, 0]) < k:                      # _CNT: fewer candidates than k
            paths.append("ties")
        else:
            paths.append("all" if n <= cap else "sampled")
    return paths


_SCORE_TILE, _REFINE_TILE = 2048, 2048


@register("k31c::topk_select", ("h200", "mi350x"))
def topk_select(scores: torch.Tensor, row_len: torch.Tensor, k: int) -> torch.Tensor:
    """The k best visible positions of each row (any order; -1 fills rows with row_len < k)."""
    _check_topk(scores, row_len, k)
    require_unit_stride(row_len=row_len)
    n_rows, width = scores.shape
    out = torch.empty((n_rows, k), dtype=torch.int32, device=scores.device)
    if n_rows == 0:
        return out
    if width and scores.stride(1) != 1:
        scores = scores.contiguous()
    chunk, n_chunks = _chunking(max(width, 1), n_rows, _SCORE_TILE, programs=4096)
    cap, ws = _workspace(n_rows, max(width, 1), k, n_chunks, scores.device)
    _plan_kernel[(n_rows,)](scores, scores.stride(0), row_len, out, out.stride(0), ws["state"], ws["fb"],
                            ws["samples"], ws["hist"], k, cap, TARGET_NUM * k // TARGET_DEN, PRESAMPLED=False,
                            SAMPLES=SAMPLES, RUN=RUN, TILE=_REFINE_TILE, num_warps=8)
    if width == 0:
        return out
    _filter_kernel[(n_rows, n_chunks)](scores, scores.stride(0), row_len, ws["state"], ws["ckey"], ws["cpos"],
                                       ws["ties"], cap, chunk, TILE=_SCORE_TILE, num_warps=8)
    src = (scores, scores.stride(0), scores, 0, 0, scores, 0, scores, scores, scores, 0, scores, 0, 0)
    _finish(src, row_len, out, ws, k, cap, chunk, n_chunks, True,
            dict(TILE=_REFINE_TILE, FUSED=False, BLOCK_SIZE=1, HP=16, DP=16, FP8=False,
                 DOT_DTYPE=tl.float32, num_warps=8))
    return out


_AOT_WORKSPACE = dict(state_ptr=torch.int32, fb_ptr=torch.int32, ckey_ptr=torch.int32, cpos_ptr=torch.int32,
                      ties_ptr=torch.int32, hist_ptr=torch.int32, sample_ptr=torch.int32,
                      out_ptr=torch.int32, row_len_ptr=torch.int32)


def _aot_spec(kernel, op, variant, consts, types, **opts):
    """kernel_spec with the workspace pointers typed, keeping only the kernel's own arguments."""
    from k31c.lowering.aot import kernel_spec
    names = set(kernel.arg_names)
    return kernel_spec(kernel, op, variant, consts,
                       {n: t for n, t in ({**_AOT_WORKSPACE, **types}).items() if n in names}, **opts)


def aot_specs(shapes) -> list:
    """The launches of `topk_select` on the GPU at `shapes` (lowering.aot.AotShapes), for the
    ahead-of-time build: batch x R rows of `context` fp32 scores; constexprs as the launcher
    derives them. The fused op's launches are indexer_topk.aot_specs."""
    width = shapes.context
    f32 = torch.float32
    spec = _aot_spec
    specs = []
    # topk_select: scores [N, width] fp32; the src tuple fills every scoring pointer with scores
    op = "k31c::topk_select"
    n_rows = shapes.batch * max(shapes.rows_per_request)
    chunk, n_chunks = _chunking(width, n_rows, _SCORE_TILE, programs=4096)
    scores = dict(src_ptr=f32, q_ptr=f32, w_ptr=f32, cache_ptr=f32, scale_ptr=f32, bt_ptr=f32,
                  row_req_ptr=f32)
    specs.append(spec(_plan_kernel, op, "scores", dict(PRESAMPLED=False, SAMPLES=SAMPLES, RUN=RUN,
                                                       TILE=_REFINE_TILE), scores, num_warps=8))
    specs.append(spec(_filter_kernel, op, "scores", dict(TILE=_SCORE_TILE), scores, num_warps=8))
    specs.append(spec(_refine_kernel, op, f"scores,CP={_pow2(n_chunks)}",
                      dict(SCAN_TIES=True, CP=_pow2(n_chunks), TILE=_REFINE_TILE, STILE=_REFINE_TILE),
                      scores, num_warps=8))
    fb = dict(TILE=_REFINE_TILE, FUSED=False, BLOCK_SIZE=1, HP=16, DP=16, FP8=False, DOT_DTYPE=tl.float32)
    for level in range(4):
        specs.append(spec(_fb_digit_kernel, op, f"scores,LEVEL={level}",
                          dict(LEVEL=level, NP=FB_PROGRAMS, **fb), scores, num_warps=8))
    specs.append(spec(_fb_emit_kernel, op, "scores", dict(NP=FB_PROGRAMS, **fb), scores, num_warps=8))
    return specs
