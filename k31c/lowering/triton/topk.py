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
   - G < k <= G + E (SCAN_TIES; e.g. ReLU zeros at T): the whole buffer plus the k - G
     highest positions at T, read from the chunks with ties, top down;
   - otherwise (the sample misjudged T): the row joins the fallback list.
4. fallback, 4 digit passes + 1 emit pass over the listed rows; every program exits at once when
   the list is empty (~1 us a pass). Exact 8-bit radix select on the full row: each program
   histograms its chunk, the row's last program (atomic done counter) picks the digit and the
   remaining k; after 4 digits the k-th key is exact, every program writes its keys above it and
   the row's last program takes the remaining ties from the top of the row down.

`plan` picks the chunking and buffer sizes once; the launcher and `aot_specs` both read it.
`launch_plan` and `launch_refine` (with the jit helpers below the state words) are this
module's public surface for other selection pipelines over the same state, e.g. the fused
indexer + top-k comparison kernel in benchmarks/alternatives/.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from k31c.graph.ops.indexer import check_topk
from k31c.lowering.aot_spec import kernel_spec
from k31c.lowering.registry import register
from k31c.lowering.targets import GPU_TARGETS
from k31c.lowering.triton.unit_stride import require_unit_stride

CAP = 12288            # candidate buffer per row (k <= 2048 → ~2.5k expected, 6k safe margin)
TARGET_NUM, TARGET_DEN = 5, 2   # expected candidates = 2.5 k
SAMPLES, RUN = 8192, 8          # sampled keys per long row, in runs of 8 adjacent positions
FB_PROGRAMS = 128               # programs of each fallback pass (each takes 1/128 of a row)
ROW_STATE = 8                   # int32 words of per-row state
DEBUG_PATHS = False             # tests: record in `last_paths` the path each row took (syncs)
last_paths: list[str] = []

# per-row state words (public: selection pipelines over the same state read them)
ST_CNT = tl.constexpr(0)      # candidates appended
ST_DONE = tl.constexpr(1)     # programs finished with this row in a fallback pass
ST_OUT = tl.constexpr(2)      # outputs written by the fallback emit pass
ST_THRESH = tl.constexpr(3)   # filter threshold key (uint32 bits)
ST_MODE = tl.constexpr(4)     # 1: row already written by plan (row_len <= k)
ST_KREM = tl.constexpr(5)     # fallback: how many of the keys matching PREFIX are still to take
ST_PREFIX = tl.constexpr(6)   # fallback: digits of the k-th key found so far
ST_WORDS = tl.constexpr(ROW_STATE)


@triton.jit
def order_key(x):
    """fp32 → uint32 whose unsigned order is the float order (torch.sort's, NaN above +inf)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = tl.where(bits == 0x80000000, tl.zeros_like(bits), bits)
    key = tl.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return tl.where(x != x, tl.full(key.shape, 0xFFFFFFFF, tl.uint32), key)


# ---- selection helpers ------------------------------------------------------------------------

@triton.jit
def append_candidates(st_rows, ckey_rows, cpos_rows, key, pos, sel, cap):
    """Append the selected (key, position) of a [R, T] tile to each row's candidate buffer."""
    seli = sel.to(tl.int32)
    nsel = tl.sum(seli, 1)
    if tl.sum(nsel, 0) > 0:
        base = tl.atomic_add(st_rows + ST_CNT, nsel, mask=nsel > 0)
        idx = base[:, None] + tl.cumsum(seli, 1) - seli
        ok = sel & (idx < cap)
        tl.store(ckey_rows[:, None] + idx, key.to(tl.int32, bitcast=True), mask=ok)
        tl.store(cpos_rows[:, None] + idx, pos + tl.zeros_like(idx), mask=ok)


@triton.jit
def radix_select(key_ptr, pos_ptr, count, krem, tie_key, POS_PHASE: tl.constexpr, TILE: tl.constexpr,
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
def sample_position(i, n, SAMPLES: tl.constexpr, RUN: tl.constexpr):
    """Position of sample i of a row of n > SAMPLES keys: runs of RUN spread evenly."""
    return ((i // RUN).to(tl.int64) * n // (SAMPLES // RUN) + i % RUN).to(tl.int32)


@triton.jit
def _take_top_ties(row, lo, hi, thresh, take, out_row, base, src_ptr, src_stride, TILE: tl.constexpr):
    """Write the `take` highest positions in [lo, hi) whose key == thresh to out_row[base:]
    (one program, reading tiles from the top down); returns the new base."""
    top = hi
    while (take > 0) & (top > lo):
        pos = top - TILE + tl.arange(0, TILE)
        live = (pos >= lo) & (pos < top)
        key = order_key(tl.load(src_ptr + row.to(tl.int64) * src_stride + pos, mask=live, other=0.0))
        base, take = take_ties_tile(key, pos, live, thresh, take, out_row, base)
        top -= TILE
    return base


@triton.jit
def take_ties_tile(key, pos, live, thresh, take, out_row, base):
    """Of one tile, the `take` highest live positions whose key == thresh, written to
    out_row[base:]; returns (base, take) after it."""
    tie = (live & (key == thresh)).to(tl.int32)
    sel = (tie > 0) & (tl.sum(tie, 0) - tl.cumsum(tie, 0) < take)    # ties above it in the tile
    seli = sel.to(tl.int32)
    tl.store(out_row + base + tl.cumsum(seli, 0) - seli, pos, mask=sel)
    return base + tl.sum(seli, 0), take - tl.sum(seli, 0)


@triton.jit
def fallback_digit_tile(key, pos, hi, prefix, LEVEL: tl.constexpr):
    """The digit-LEVEL histogram of a tile's keys that match the digits found so far."""
    match = pos < hi
    if LEVEL > 0:
        match = match & ((key >> (32 - 8 * LEVEL)) == (prefix >> (32 - 8 * LEVEL)))
    return tl.histogram(((key >> (24 - 8 * LEVEL)) & 0xFF).to(tl.int32), 256, mask=match)


@triton.jit
def fallback_pick_digit(st, hrow, hist, prefix, LEVEL: tl.constexpr, NP: tl.constexpr):
    """Add this program's histogram to the row's; the row's last program picks digit LEVEL of
    the k-th key and the count still to take, and clears the histogram for the next level."""
    bins = tl.arange(0, 256)
    tl.atomic_add(hrow, hist, mask=hist > 0)
    tl.debug_barrier()
    if tl.atomic_add(st + ST_DONE, 1) == NP - 1:     # last program: choose the digit
        tl.store(st + ST_DONE, 0)
        # read and clear for the next level (and-with-0 = exchange with 0; AMD's buffer atomics
        # have no exchange in Triton 3.7)
        total = tl.atomic_and(hrow, tl.zeros_like(hist))
        krem = tl.load(st + ST_KREM)
        suffix = tl.sum(total, 0) - tl.cumsum(total, 0) + total  # keys with digit >= d
        best = tl.max(tl.where(suffix >= krem, bins, 0), 0)
        tl.store(st + ST_KREM, krem - tl.sum(tl.where(bins > best, total, 0), 0))
        tl.store(st + ST_PREFIX, (prefix | (best.to(tl.uint32) << (24 - 8 * LEVEL))).to(tl.int32, bitcast=True))


@triton.jit
def fallback_emit_tile(st, out_row, key, pos, hi, thresh):
    """Write a tile's positions whose key is above the (exact) k-th key thresh."""
    sel = (pos < hi) & (key > thresh)
    seli = sel.to(tl.int32)
    n_sel = tl.sum(seli, 0)
    if n_sel > 0:
        base = tl.atomic_add(st + ST_OUT, n_sel)
        tl.store(out_row + base + tl.cumsum(seli, 0) - seli, pos, mask=sel)


# ---- kernels ----------------------------------------------------------------------------------

@triton.jit
def _plan_kernel(src_ptr, src_stride, row_len_ptr, out_ptr, out_stride, state_ptr, fb_ptr,
                 sample_ptr, hist_ptr, k, cap, target, PRESAMPLED: tl.constexpr, SAMPLES: tl.constexpr,
                 RUN: tl.constexpr, TILE: tl.constexpr):
    """Per row: reset its state; write it out if row_len <= k; else choose the filter threshold."""
    row = tl.program_id(0)
    n = tl.load(row_len_ptr + row)
    st = state_ptr + row * ST_WORDS
    if row == 0:
        tl.store(fb_ptr, 0)
    tl.store(st + ST_CNT, 0)
    tl.store(st + ST_DONE, 0)
    tl.store(st + ST_OUT, 0)
    tl.store(hist_ptr + row * 256 + tl.arange(0, 256), tl.zeros([256], tl.int32))
    thresh = tl.zeros((), tl.uint32)
    if n <= k:       # every visible position, then -1
        tl.store(st + ST_MODE, 1)
        for start in range(0, k, TILE):
            j = start + tl.arange(0, TILE)
            tl.store(out_ptr + row.to(tl.int64) * out_stride + j, tl.where(j < n, j, -1), mask=j < k)
    else:
        tl.store(st + ST_MODE, 0)
        if n > cap:  # threshold from a sample; shorter rows keep 0 (all positions are candidates)
            samples = sample_ptr + row.to(tl.int64) * SAMPLES
            if not PRESAMPLED:   # one gather of the whole sample, then the radix passes read it back
                i = tl.arange(0, SAMPLES)
                x = tl.load(src_ptr + row.to(tl.int64) * src_stride + sample_position(i, n, SAMPLES, RUN))
                tl.store(samples + i, order_key(x).to(tl.int32, bitcast=True))
                tl.debug_barrier()
            rank = tl.minimum((target.to(tl.int64) * SAMPLES + n - 1) // n, SAMPLES).to(tl.int32)
            thresh, _, _ = radix_select(samples, samples, SAMPLES, rank, 0, False, SAMPLES, 3)  # 24 bits
    tl.store(st + ST_THRESH, thresh.to(tl.int32, bitcast=True))


@triton.jit
def _filter_kernel(src_ptr, src_stride, row_len_ptr, state_ptr, ckey_ptr, cpos_ptr, ties_ptr, cap,
                   chunk, TILE: tl.constexpr):
    """One pass over a chunk of a row: append keys > threshold, count keys == threshold."""
    row = tl.program_id(0)
    rows = row + tl.zeros([1], tl.int32)
    st_rows = state_ptr + rows * ST_WORDS
    if tl.load(state_ptr + row * ST_WORDS + ST_MODE) == 0:
        n = tl.load(row_len_ptr + row)
        thresh = tl.load(st_rows + ST_THRESH).to(tl.uint32, bitcast=True)
        lo = tl.program_id(1) * chunk
        hi = tl.minimum(lo + chunk, n)
        src_row = src_ptr + row.to(tl.int64) * src_stride
        ties = tl.zeros([1, TILE], tl.int32)
        nxt = tl.load(src_row + lo + tl.arange(0, TILE), mask=lo + tl.arange(0, TILE) < hi, other=0.0)
        for start in range(lo, hi, TILE):
            pos = start + tl.arange(0, TILE)
            x = nxt          # the next tile's load is in flight while this one is filtered
            nxt = tl.load(src_row + pos + TILE, mask=pos + TILE < hi, other=0.0)
            key = order_key(x)[None, :]
            live = (pos < hi)[None, :]
            ties += (live & (key == thresh[:, None])).to(tl.int32)
            append_candidates(st_rows, ckey_ptr + rows.to(tl.int64) * cap, cpos_ptr + rows.to(tl.int64) * cap,
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
    st = state_ptr + row * ST_WORDS
    if tl.load(st + ST_MODE) == 0:
        count = tl.load(st + ST_CNT)
        thresh = tl.load(st + ST_THRESH).to(tl.uint32, bitcast=True)
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
                key_t, krem, exact = radix_select(ckey, cpos, count, k, 0, False, TILE)
                if exact == 0:
                    pos_t, _, _ = radix_select(ckey, cpos, count, krem, key_t, True, TILE)
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
                                              out_row, base, src_ptr, src_stride, STILE)
                    need -= take
                    j -= 1
        else:
            slot = tl.atomic_add(fb_ptr, 1)
            tl.store(fb_ptr + 1 + slot, row)
            tl.store(st + ST_PREFIX, 0)
            tl.store(st + ST_KREM, k)


@triton.jit
def fallback_chunk(n, NP: tl.constexpr, TILE: tl.constexpr):
    """This program's [lo, hi) share of a fallback row of n keys (whole tiles)."""
    chunk = tl.cdiv(tl.cdiv(n, NP), TILE) * TILE
    lo = tl.program_id(0) * chunk
    return lo, tl.minimum(lo + chunk, n)


@triton.jit
def _fb_digit_kernel(src_ptr, src_stride, row_len_ptr, state_ptr, fb_ptr, hist_ptr,
                     LEVEL: tl.constexpr, NP: tl.constexpr, TILE: tl.constexpr):
    """Fallback digit LEVEL (bits 31-8*LEVEL .. 24-8*LEVEL of the k-th key) of every listed row."""
    for j in range(tl.load(fb_ptr)):
        row = tl.load(fb_ptr + 1 + j)
        st = state_ptr + row * ST_WORDS
        lo, hi = fallback_chunk(tl.load(row_len_ptr + row), NP, TILE)
        prefix = tl.load(st + ST_PREFIX).to(tl.uint32, bitcast=True)
        hist = tl.zeros([256], tl.int32)
        for start in range(lo, hi, TILE):
            pos = start + tl.arange(0, TILE)
            key = order_key(tl.load(src_ptr + row.to(tl.int64) * src_stride + pos, mask=pos < hi,
                                     other=0.0))
            hist += fallback_digit_tile(key, pos, hi, prefix, LEVEL)
        fallback_pick_digit(st, hist_ptr + row * 256 + tl.arange(0, 256), hist, prefix, LEVEL, NP)


@triton.jit
def _fb_emit_kernel(src_ptr, src_stride, row_len_ptr, out_ptr, out_stride, state_ptr, fb_ptr,
                    NP: tl.constexpr, TILE: tl.constexpr):
    """Fallback output: every program writes its keys above the (exact) k-th key T; the row's last
    program then takes the remaining ties at T from the top of the row down."""
    for j in range(tl.load(fb_ptr)):
        row = tl.load(fb_ptr + 1 + j)
        st = state_ptr + row * ST_WORDS
        n = tl.load(row_len_ptr + row)
        lo, hi = fallback_chunk(n, NP, TILE)
        thresh = tl.load(st + ST_PREFIX).to(tl.uint32, bitcast=True)
        out_row = out_ptr + row.to(tl.int64) * out_stride
        for start in range(lo, hi, TILE):
            pos = start + tl.arange(0, TILE)
            key = order_key(tl.load(src_ptr + row.to(tl.int64) * src_stride + pos, mask=pos < hi,
                                     other=0.0))
            fallback_emit_tile(st, out_row, key, pos, hi, thresh)
        tl.debug_barrier()
        if tl.atomic_add(st + ST_DONE, 1) == NP - 1:
            _take_top_ties(row, 0, n, thresh, tl.load(st + ST_KREM), out_row, tl.atomic_add(st + ST_OUT, 0),
                           src_ptr, src_stride, TILE)


# ---- launch plan ------------------------------------------------------------------------------

SCORE_TILE, REFINE_TILE = 2048, 2048      # positions per filter tile; per refine / fallback tile
FILTER_PROGRAMS = 4096                    # filter programs in all (about)


def pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def chunking(width: int, groups: int, tile: int, programs: int) -> tuple[int, int]:
    """Positions per filter program (whole tiles) and programs per row group, ~`programs` in all."""
    per_group = max(1, programs // max(groups, 1))
    chunk = max(tile, triton.cdiv(triton.cdiv(width, per_group), tile) * tile)
    return chunk, triton.cdiv(width, chunk)


@dataclass(frozen=True)
class TopkPlan:
    """How one call splits its rows: filter chunks and the candidate buffer (the constants are
    read when planned, so tests may shrink them)."""
    n_rows: int
    width: int
    k: int
    chunk: int           # positions per filter program
    n_chunks: int        # filter programs per row
    cap: int             # candidate buffer per row
    samples: int         # sampled keys per long row
    run: int
    fb_programs: int
    target: int          # expected candidates above the threshold

    def workspace(self, device) -> dict:
        """Scratch for one call (one int32 allocation): per-row state, fallback list, candidate
        buffers, samples, per-chunk tie counts and the fallback's digit histograms."""
        n = self.n_rows
        sizes = {"state": n * ROW_STATE, "fb": n + 1, "ckey": n * self.cap, "cpos": n * self.cap,
                 "samples": n * self.samples if self.width > self.cap else 1,
                 "ties": n * self.n_chunks, "hist": n * 256}
        flat = torch.empty(sum(sizes.values()), dtype=torch.int32, device=device)
        return dict(zip(sizes, flat.split(list(sizes.values()))))


def row_paths(ws, row_len, k: int, cap: int) -> list[str]:
    """The path each row of a finished call took, read back from its workspace: "direct"
    (row_len <= k), "all" (row_len <= cap: every position a candidate), "sampled" (a sampled
    threshold, settled from the buffer), "ties" (the buffer plus keys at the threshold), "fallback"."""
    state = ws["state"].view(-1, ROW_STATE).cpu()
    listed = set(ws["fb"][1:1 + int(ws["fb"][0])].tolist())
    paths = []
    for row, n in enumerate(row_len.tolist()):
        if int(state[row, ST_MODE.value]) == 1:
            paths.append("direct")
        elif row in listed:
            paths.append("fallback")
        elif int(state[row, ST_CNT.value]) < k:           # fewer candidates than k
            paths.append("ties")
        else:
            paths.append("all" if n <= cap else "sampled")
    return paths


def plan(n_rows: int, width: int, k: int, groups: int | None = None, tile: int = SCORE_TILE,
         programs: int = FILTER_PROGRAMS) -> TopkPlan:
    """The plan of `n_rows` rows of `width` keys (filter programs shared by `groups` row groups,
    default one per row)."""
    width = max(width, 1)
    chunk, n_chunks = chunking(width, n_rows if groups is None else groups, tile, programs)
    cap = min(max(CAP, 6 * k), width)
    return TopkPlan(n_rows, width, k, chunk, n_chunks, cap, SAMPLES, RUN, FB_PROGRAMS,
                    TARGET_NUM * k // TARGET_DEN)


# ---- launchers --------------------------------------------------------------------------------

def launch_plan(p: TopkPlan, src, src_stride: int, row_len, out, ws: dict, presampled: bool) -> None:
    """Plan pass: reset each row's state, write out rows with row_len <= k, pick the thresholds
    (from a sample the kernel gathers from src, or one already in ws["samples"])."""
    _plan_kernel[(p.n_rows,)](src, src_stride, row_len, out, out.stride(0), ws["state"], ws["fb"],
                              ws["samples"], ws["hist"], p.k, p.cap, p.target, PRESAMPLED=presampled,
                              SAMPLES=p.samples, RUN=p.run, TILE=REFINE_TILE, num_warps=8)


def launch_refine(p: TopkPlan, src, src_stride: int, row_len, out, ws: dict, scan_ties: bool) -> None:
    """Refine pass: exact top-k of each row's candidates (ties at T read from src with
    scan_ties); rows it cannot settle join the fallback list."""
    _refine_kernel[(p.n_rows,)](src, src_stride, row_len, out, out.stride(0), ws["state"], ws["fb"],
                                ws["ckey"], ws["cpos"], ws["ties"], p.k, p.cap, p.chunk, p.n_chunks,
                                SCAN_TIES=scan_ties, CP=pow2(p.n_chunks), TILE=REFINE_TILE,
                                STILE=REFINE_TILE, num_warps=8)


@register("k31c::topk_select", GPU_TARGETS)
def topk_select(scores: torch.Tensor, row_len: torch.Tensor, k: int) -> torch.Tensor:
    """The k best visible positions of each row (any order; -1 fills rows with row_len < k)."""
    check_topk(scores, row_len, k)
    require_unit_stride(row_len=row_len)
    n_rows, width = scores.shape
    out = torch.empty((n_rows, k), dtype=torch.int32, device=scores.device)
    if n_rows == 0:
        return out
    if width and scores.stride(1) != 1:
        scores = scores.contiguous()
    p = plan(n_rows, width, k)
    ws = p.workspace(scores.device)
    launch_plan(p, scores, scores.stride(0), row_len, out, ws, presampled=False)
    if width == 0:
        return out
    _filter_kernel[(n_rows, p.n_chunks)](scores, scores.stride(0), row_len, ws["state"], ws["ckey"],
                                         ws["cpos"], ws["ties"], p.cap, p.chunk, TILE=SCORE_TILE,
                                         num_warps=8)
    launch_refine(p, scores, scores.stride(0), row_len, out, ws, scan_ties=True)
    # the exact radix passes for the rows the candidates could not settle (usually none: they
    # then exit at once)
    for level in range(4):
        _fb_digit_kernel[(p.fb_programs,)](scores, scores.stride(0), row_len, ws["state"], ws["fb"],
                                           ws["hist"], LEVEL=level, NP=p.fb_programs,
                                           TILE=REFINE_TILE, num_warps=8)
    _fb_emit_kernel[(p.fb_programs,)](scores, scores.stride(0), row_len, out, out.stride(0), ws["state"],
                                      ws["fb"], NP=p.fb_programs, TILE=REFINE_TILE, num_warps=8)
    if DEBUG_PATHS:
        last_paths[:] = row_paths(ws, row_len, k, p.cap)
    return out


def aot_specs(shapes) -> list:
    """The launches of `topk_select` on the GPU at `shapes` (aot_spec.AotShapes), for the
    ahead-of-time build: batch x R rows of `context` fp32 scores, constexprs from `plan`."""
    op = "k31c::topk_select"
    p = plan(shapes.batch * max(shapes.rows_per_request), shapes.context, shapes.cfg.index_topk)
    f32, i32 = torch.float32, torch.int32
    ws = dict(state_ptr=i32, fb_ptr=i32, ckey_ptr=i32, cpos_ptr=i32, ties_ptr=i32, hist_ptr=i32,
              sample_ptr=i32, out_ptr=i32, row_len_ptr=i32, src_ptr=f32)

    def spec(kernel, variant, consts):
        names = set(kernel.arg_names)
        return kernel_spec(kernel, op, variant, consts, {n: t for n, t in ws.items() if n in names},
                           num_warps=8)
    specs = [spec(_plan_kernel, "scores", dict(PRESAMPLED=False, SAMPLES=p.samples, RUN=p.run,
                                               TILE=REFINE_TILE)),
             spec(_filter_kernel, "scores", dict(TILE=SCORE_TILE)),
             spec(_refine_kernel, f"scores,CP={pow2(p.n_chunks)}",
                  dict(SCAN_TIES=True, CP=pow2(p.n_chunks), TILE=REFINE_TILE, STILE=REFINE_TILE))]
    for level in range(4):
        specs.append(spec(_fb_digit_kernel, f"scores,LEVEL={level}",
                          dict(LEVEL=level, NP=p.fb_programs, TILE=REFINE_TILE)))
    specs.append(spec(_fb_emit_kernel, "scores", dict(NP=p.fb_programs, TILE=REFINE_TILE)))
    return specs
