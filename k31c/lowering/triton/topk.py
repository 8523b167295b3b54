"""Triton top-k (`k31c::topk_select`) and fused indexer + top-k (`k31c::lightning_indexer_topk`).

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

The fused op runs the same pipeline on scores computed in-kernel from the index cache (FP8 e4m3
through the block table, or BF16/F32); the [N, L] score matrix is never written. The sample
pass scores only the sampled positions, the filter pass scores each tile in registers (all rows
of a request from one key load) and keeps only candidates, and fallback rows (rare) are rescored
on each of their passes. The scoring is this module's own (not shared with triton/indexer.py).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from k31c.graph.ops.cache_write import index_row_bytes, is_fp8_index_cache
from k31c.graph.ops.indexer import _check_indexer, _check_topk
from k31c.lowering.registry import register
from k31c.lowering.triton.cache_write import e4m3_scale, quantize_e4m3

CAP = 12288            # candidate buffer per row (k <= 2048 → ~2.5k expected, 6k safe margin)
TARGET_NUM, TARGET_DEN = 5, 2   # expected candidates = 2.5 k
SAMPLES, RUN = 8192, 8          # sampled keys per long row, in runs of 8 adjacent positions
FB_PROGRAMS = 128               # programs of each fallback pass (each takes 1/128 of a row)
ROW_STATE = 8                   # int32 words of per-row state

# per-row state words
_CNT = tl.constexpr(0)      # candidates appended
_DONE = tl.constexpr(1)     # programs finished with this row in a fallback pass
_OUT = tl.constexpr(2)      # outputs written by the fallback emit pass
_THRESH = tl.constexpr(3)   # filter threshold key (uint32 bits)
_MODE = tl.constexpr(4)     # 1: row already written by plan (row_len <= k)
_KREM = tl.constexpr(5)     # fallback: how many of the keys matching PREFIX are still to take
_PREFIX = tl.constexpr(6)   # fallback: digits of the k-th key found so far
_RS = tl.constexpr(ROW_STATE)

# ---- keys and selection helpers ---------------------------------------------------------------

@triton.jit
def _order_key(x):
    """fp32 → uint32 whose unsigned order is the float order (torch.sort's, NaN above +inf)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = tl.where(bits == 0x80000000, tl.zeros_like(bits), bits)
    key = tl.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return tl.where(x != x, tl.full(key.shape, 0xFFFFFFFF, tl.uint32), key)


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


# ---- in-kernel indexer scores (fused op) ------------------------------------------------------

@triton.jit
def _load_q(q_ptr, sq_t, sq_h, w_ptr, sw_t, rows, ok, H, D, G: tl.constexpr, HP: tl.constexpr,
            DP: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """q of G rows as one transposed MMA operand [DP, G*HP] and their head weights [G*HP] (0
    where masked). For an FP8 dot q is quantised per (row, head) as the keys are (scale folded
    into w), exactly as the Triton indexer does, so fused and unfused scores agree."""
    gh = tl.arange(0, G * HP)
    sel = (gh // HP)[:, None] == tl.arange(0, G)[None, :]
    row = tl.sum(tl.where(sel, rows[None, :], 0), 1)
    h = gh % HP
    use = (tl.sum(tl.where(sel, ok[None, :].to(tl.int32), 0), 1) > 0) & (h < H)
    d = tl.arange(0, DP)
    q = tl.load(q_ptr + row.to(tl.int64)[:, None] * sq_t + h[:, None] * sq_h + d[None, :],
                mask=use[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + row.to(tl.int64) * sw_t + h, mask=use, other=0.0)
    if DOT_DTYPE == tl.float8e4nv:
        q_scale = e4m3_scale(tl.max(tl.abs(q), 1))
        q = quantize_e4m3(q, q_scale[:, None])
        w = w * q_scale                     # ReLU(s·x) = s·ReLU(x) for s > 0
    return tl.trans(q.to(DOT_DTYPE)), w


@triton.jit
def _score_tile(q_t, w, cache_ptr, scale_ptr, bt_ptr, sbt, req, pos, pos_ok, D,
                BLOCK_SIZE: tl.constexpr, G: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
                FP8: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """[G, BS] scores Σ_h w[g,h]·ReLU(q[g,h]·key[pos]) of request req's keys at positions pos."""
    blk = tl.load(bt_ptr + req.to(tl.int64) * sbt + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    off = pos % BLOCK_SIZE
    d = tl.arange(0, DP)
    kmask = pos_ok[:, None] & (d < D)[None, :]
    if FP8:
        base = blk * (BLOCK_SIZE * (D + 4))
        keys = tl.load(cache_ptr + (base + off * D)[:, None] + d[None, :], mask=kmask, other=0.0)
        if cache_ptr.dtype.element_ty == tl.uint8:      # the interpreter gets the raw bytes
            keys = keys.to(tl.float8e4nv, bitcast=True)
        scale = tl.load(scale_ptr + (base + BLOCK_SIZE * D) // 4 + off, mask=pos_ok, other=0.0)
    else:
        keys = tl.load(cache_ptr + ((blk * BLOCK_SIZE + off) * D)[:, None] + d[None, :], mask=kmask,
                       other=0.0)
    if DOT_DTYPE == tl.float32:
        s = tl.dot(keys.to(tl.float32), q_t, input_precision="ieee")      # [BS, G*HP]
    else:
        s = tl.dot(keys.to(DOT_DTYPE), q_t)
    s = tl.sum(tl.reshape(tl.maximum(s, 0.0) * w[None, :], [pos.shape[0], G, HP]), 2)
    if FP8:
        s = s * scale[:, None]            # the key's scale > 0 factors out of ReLU and the head sum
    return tl.trans(s)


@triton.jit
def _row_keys(row, pos, pos_ok, src_ptr, src_stride, q_ptr, sq_t, sq_h, w_ptr, sw_t, cache_ptr,
              scale_ptr, bt_ptr, sbt, row_req_ptr, H, D, FUSED: tl.constexpr,
              BLOCK_SIZE: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, FP8: tl.constexpr,
              DOT_DTYPE: tl.constexpr):
    """Keys of one row at positions pos: read from the scores, or scored from the cache."""
    if FUSED:
        rows = row + tl.zeros([1], tl.int32)
        q_t, w = _load_q(q_ptr, sq_t, sq_h, w_ptr, sw_t, rows, rows >= 0, H, D, 1, HP, DP, DOT_DTYPE)
        s = _score_tile(q_t, w, cache_ptr, scale_ptr, bt_ptr, sbt, tl.load(row_req_ptr + row), pos,
                        pos_ok, D, BLOCK_SIZE, 1, HP, DP, FP8, DOT_DTYPE)
        key = _order_key(tl.reshape(s, [pos.shape[0]]))
    else:
        key = _order_key(tl.load(src_ptr + row.to(tl.int64) * src_stride + pos, mask=pos_ok, other=0.0))
    return key


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
def _fused_sample_kernel(q_ptr, sq_t, sq_h, w_ptr, sw_t, cache_ptr, scale_ptr, bt_ptr, sbt, row_req_ptr,
                         H, D, row_len_ptr, sample_ptr, cap, SAMPLES: tl.constexpr, RUN: tl.constexpr,
                         BS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HP: tl.constexpr,
                         DP: tl.constexpr, FP8: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Order keys of the sampled positions of each long row (the plan pass reads them)."""
    row = tl.program_id(0)
    n = tl.load(row_len_ptr + row)
    if n > cap:
        i = tl.program_id(1) * BS + tl.arange(0, BS)
        pos = _sample_pos(i, n, SAMPLES, RUN)
        key = _row_keys(row, pos, pos < n, q_ptr, 0, q_ptr, sq_t, sq_h, w_ptr, sw_t, cache_ptr,
                        scale_ptr, bt_ptr, sbt, row_req_ptr, H, D, True, BLOCK_SIZE, HP, DP, FP8, DOT_DTYPE)
        tl.store(sample_ptr + row.to(tl.int64) * SAMPLES + i, key.to(tl.int32, bitcast=True))


@triton.jit
def _fused_filter_kernel(q_ptr, sq_t, sq_h, w_ptr, sw_t, cache_ptr, scale_ptr, bt_ptr, sbt, row_req_ptr,
                         H, D, row_len_ptr, state_ptr, ckey_ptr, cpos_ptr, ties_ptr, n_rows, cap, chunk,
                         G: tl.constexpr, BS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HP: tl.constexpr,
                         DP: tl.constexpr, FP8: tl.constexpr, DOT_DTYPE: tl.constexpr,
                         NUM_STAGES: tl.constexpr):
    """Score G consecutive rows over one chunk of positions, keeping the candidates. Rows of one
    request share each key load (one MMA with G*HP query columns); a group spanning several
    requests makes one pass per request."""
    r = tl.arange(0, G)
    rows = tl.program_id(0) * G + r
    valid = rows < n_rows
    reqs = tl.load(row_req_ptr + rows, mask=valid, other=-1)
    lens = tl.load(row_len_ptr + rows, mask=valid, other=0)
    st_rows = state_ptr + rows * _RS
    active = valid & (tl.load(st_rows + _MODE, mask=valid, other=1) == 0)
    thresh = tl.load(st_rows + _THRESH, mask=valid, other=0).to(tl.uint32, bitcast=True)
    lo = tl.program_id(1) * chunk
    ties = tl.zeros([G], tl.int32)
    for j in range(G):
        lead = tl.sum(tl.where(r == j, reqs, 0), 0)
        first = tl.sum(tl.where((r < j) & active & (reqs == lead), 1, 0), 0) == 0
        if first & (tl.sum(tl.where(r == j, active.to(tl.int32), 0), 0) > 0):
            mine = active & (reqs == lead)
            hi = tl.minimum(lo + chunk, tl.max(tl.where(mine, lens, 0), 0))
            q_t, w = _load_q(q_ptr, sq_t, sq_h, w_ptr, sw_t, rows, mine, H, D, G, HP, DP, DOT_DTYPE)
            for start in tl.range(lo, hi, BS, num_stages=NUM_STAGES):
                pos = start + tl.arange(0, BS)
                key = _order_key(_score_tile(q_t, w, cache_ptr, scale_ptr, bt_ptr, sbt, lead, pos, pos < hi,
                                             D, BLOCK_SIZE, G, HP, DP, FP8, DOT_DTYPE))
                live = mine[:, None] & (pos[None, :] < lens[:, None])
                ties += tl.sum((live & (key == thresh[:, None])).to(tl.int32), 1)
                _append(st_rows, ckey_ptr + rows.to(tl.int64) * cap, cpos_ptr + rows.to(tl.int64) * cap,
                        key, pos[None, :], live & (key > thresh[:, None]), cap)
    tl.store(ties_ptr + rows * tl.num_programs(1) + tl.program_id(1), ties, mask=active)


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


# ---- launchers --------------------------------------------------------------------------------

def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


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


_SCORE_TILE, _REFINE_TILE = 2048, 2048


@register("k31c::topk_select", ("h200", "mi350x"))
def topk_select(scores: torch.Tensor, row_len: torch.Tensor, k: int) -> torch.Tensor:
    """The k best visible positions of each row (any order; -1 fills rows with row_len < k)."""
    _check_topk(scores, row_len, k)
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


def _dot_dtype(q: torch.Tensor, cache: torch.Tensor, fp8: bool):
    """MMA input type, as the Triton indexer picks it: FP8 (q quantised like the keys) for an FP8
    cache on the GPU; a 16-bit dot where q and the keys are exact in it; fp32 otherwise and under
    the interpreter (its 16-bit and fp8 dots are not trusted)."""
    if _interpreting() or q.device.type != "cuda":
        return tl.float32
    if fp8:
        return tl.float8e4nv
    for torch_t, tl_t in ((torch.bfloat16, tl.bfloat16), (torch.float16, tl.float16)):
        if q.dtype == torch_t and cache.dtype == torch_t:
            return tl_t
    return tl.float32


_FUSED_TILE = 128      # positions per scoring tile


@register("k31c::lightning_indexer_topk", ("h200", "mi350x"))
def lightning_indexer_topk(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                           block_table: torch.Tensor, row_req: torch.Tensor, row_len: torch.Tensor,
                           k: int) -> torch.Tensor:
    """topk_select(lightning_indexer(...), row_len, k) without writing the scores out."""
    block_size = _check_indexer(q, weights, index_cache, block_table, row_req, row_len)
    if not isinstance(k, int) or k <= 0:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    n_rows, heads, d = q.shape
    if d > 128:
        raise ValueError(f"q: index_head_dim {d} > 128 (one FP8 scale group) is not supported by the "
                         "fused kernel")
    if not index_cache.is_contiguous():
        raise ValueError("index_cache: the fused kernel needs a contiguous cache tensor")
    fp8 = is_fp8_index_cache(index_cache)
    if fp8 and (block_size * d) % 4:
        raise ValueError(f"index_cache: block_size*d = {block_size * d} is not a multiple of 4 "
                         "(unaligned fp32 scales)")
    width = block_table.shape[1] * block_size
    out = torch.empty((n_rows, k), dtype=torch.int32, device=q.device)
    if n_rows == 0:
        return out
    groups = min(4, 1 << (max(1, n_rows // block_table.shape[0]).bit_length() - 1))  # rows per request
    n_groups = triton.cdiv(n_rows, groups)
    chunk, n_chunks = _chunking(max(width, 1), n_groups, _FUSED_TILE, programs=2 * _sm_count(q.device))
    cap, ws = _workspace(n_rows, max(width, 1), k, n_chunks, q.device)
    if q.stride(2) != 1:
        q = q.contiguous()
    dot = _dot_dtype(q, index_cache, fp8)
    scale_view = index_cache.view(torch.float32) if fp8 else index_cache
    if dot == tl.float8e4nv:   # e4m3 loads feed the tensor cores directly (no byte bitcast)
        index_cache = index_cache.view(torch.float8_e4m3fn)
    hp1 = max(_pow2(heads), 16)
    dp = max(32 if dot == tl.float8e4nv else 16, _pow2(d))     # an fp8 MMA needs K >= 32 (zero-padded)
    shape = dict(BLOCK_SIZE=block_size, DP=dp, FP8=fp8, DOT_DTYPE=dot)
    src = (q, q.stride(0), q.stride(1), weights, weights.stride(0), index_cache, scale_view, block_table,
           block_table.stride(0), row_req, heads, d)
    if width > cap:
        _fused_sample_kernel[(n_rows, SAMPLES // 64)](*src, row_len, ws["samples"], cap, SAMPLES=SAMPLES,
                                                      RUN=RUN, BS=64, HP=hp1, **shape, num_warps=4)
    _plan_kernel[(n_rows,)](q, 0, row_len, out, out.stride(0), ws["state"], ws["fb"], ws["samples"],
                            ws["hist"], k, cap, TARGET_NUM * k // TARGET_DEN, PRESAMPLED=True,
                            SAMPLES=SAMPLES, RUN=RUN, TILE=_REFINE_TILE, num_warps=8)
    if width == 0:
        return out
    _fused_filter_kernel[(n_groups, n_chunks)](
        *src, row_len, ws["state"], ws["ckey"], ws["cpos"], ws["ties"], n_rows, cap, chunk, G=groups,
        BS=_FUSED_TILE, HP=max(_pow2(heads), 16 // groups), **shape, NUM_STAGES=3, num_warps=8)
    _finish((weights, 0, *src), row_len, out, ws, k, cap, chunk, n_chunks, False,
            dict(TILE=64, FUSED=True, HP=hp1, **shape, num_warps=4))
    return out


def aot_specs(shapes) -> list:
    """The launches of both launchers on the GPU at `shapes` (lowering.aot.AotShapes), for the
    ahead-of-time build: `topk_select` over batch x R rows of `context` fp32 scores, and the fused
    op over FP8 (e4m3 view) and BF16 index caches; constexprs as the launchers derive them."""
    from k31c.lowering.aot import kernel_spec
    cfg, width = shapes.cfg, shapes.context
    i32, f32 = torch.int32, torch.float32
    ws = dict(state_ptr=i32, fb_ptr=i32, ckey_ptr=i32, cpos_ptr=i32, ties_ptr=i32, hist_ptr=i32,
              sample_ptr=i32, out_ptr=i32, row_len_ptr=i32)

    def spec(kernel, op, variant, consts, types, **opts):
        names = set(kernel.arg_names)
        return kernel_spec(kernel, op, variant, consts,
                           {n: t for n, t in ({**ws, **types}).items() if n in names}, **opts)

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

    # lightning_indexer_topk: scores computed from the index cache
    op = "k31c::lightning_indexer_topk"
    heads, d = cfg.index_n_heads, cfg.index_head_dim
    hp1 = max(_pow2(heads), 16)
    for fp8 in (True, False):
        cache_dt = torch.float8_e4m3fn if fp8 else torch.bfloat16
        dot = tl.float8e4nv if fp8 else tl.bfloat16
        dp = max(32 if dot == tl.float8e4nv else 16, _pow2(d))
        shape = dict(BLOCK_SIZE=shapes.block_size, DP=dp, FP8=fp8, DOT_DTYPE=dot)
        src = dict(q_ptr=cfg.torch_dtype, w_ptr=f32, cache_ptr=cache_dt,
                   scale_ptr=f32 if fp8 else cache_dt, bt_ptr=i32, row_req_ptr=i32)
        tag = "fp8" if fp8 else "bf16"
        specs.append(spec(_fused_sample_kernel, op, tag,
                          dict(SAMPLES=SAMPLES, RUN=RUN, BS=64, HP=hp1, **shape), src, num_warps=4))
        specs.append(spec(_plan_kernel, op, "presampled",
                          dict(PRESAMPLED=True, SAMPLES=SAMPLES, RUN=RUN, TILE=_REFINE_TILE),
                          dict(src_ptr=cfg.torch_dtype), num_warps=8))
        for r in shapes.rows_per_request:
            n_rows = shapes.batch * r
            groups = min(4, 1 << (max(1, n_rows // shapes.batch).bit_length() - 1))
            chunk, n_chunks = _chunking(width, triton.cdiv(n_rows, groups), _FUSED_TILE,
                                        programs=2 * shapes.sms)
            specs.append(spec(_fused_filter_kernel, op, f"{tag},G={groups}",
                              dict(G=groups, BS=_FUSED_TILE, HP=max(_pow2(heads), 16 // groups),
                                   **shape, NUM_STAGES=3), src, num_warps=8))
            specs.append(spec(_refine_kernel, op, f"fused,CP={_pow2(n_chunks)}",
                              dict(SCAN_TIES=False, CP=_pow2(n_chunks), TILE=_REFINE_TILE,
                                   STILE=_REFINE_TILE), dict(src_ptr=f32), num_warps=8))
        fb = dict(TILE=64, FUSED=True, HP=hp1, **shape)
        fb_src = dict(src_ptr=f32, **src)
        for level in range(4):
            specs.append(spec(_fb_digit_kernel, op, f"{tag},LEVEL={level}",
                              dict(LEVEL=level, NP=FB_PROGRAMS, **fb), fb_src, num_warps=4))
        specs.append(spec(_fb_emit_kernel, op, tag, dict(NP=FB_PROGRAMS, **fb), fb_src, num_warps=4))
    return specs

