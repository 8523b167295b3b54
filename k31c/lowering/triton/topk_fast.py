"""Triton radix top-k, streaming variant (`k31c::topk_select` path="fast"): kernels and launcher.

Same selection and tie rule as topk.py (the k largest composites `key << 32 | position`), and the
same single read of the scores, but built so that no phase is latency bound per row:
1. plan, one program per row: resets the row's state, writes rows with row_len <= k, and takes
   the filter threshold T from a strided sample held in registers (radix select on registers;
   topk.py's plan writes the sample out and reads it back for each digit).
2. stream, many short programs per row (grid chunks x rows, one or a few tiles each; each tile
   costs one atomic when it has candidates): appends every (key, position) with key > T to the
   row's candidate buffer and counts the keys == T of its chunk. With FUSE_REFINE the row's last
   program (atomic done counter) refines the row at once, so the refine of early rows overlaps
   the streaming of later ones and one launch goes.
3. refine, one program per row (or fused into 2): the G candidates are loaded into registers once
   (G <= RT) and the k-th composite is found by radix select on registers (key digits, then
   positions among the keys tied at the k-th); G > RT uses topk.py's buffer-reading select.
   G < k <= G + E (ReLU zeros at T) takes the whole buffer plus the highest positions at T;
   anything else joins topk.py's exact fallback passes (shared, unchanged).

Status: passes the interpreter tests (tests/lowering/test_triton_topk.py); not yet timed on the
H200 (benchmarks/try_topk.py times it against topk.py's path and torch.topk).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k31c.graph.ops.indexer import _check_topk
from k31c.lowering.triton import topk   # tunables read as topk.X at call time (the tests shrink them)
from k31c.lowering.triton.topk import (_CNT, _DONE, _KREM, _MODE, _OUT, _PREFIX, _RS, _THRESH,
                                       _fb_digit_kernel, _fb_emit_kernel, _pow2, _radix_select,
                                       _sample_pos, _take_top_ties)
from k31c.lowering.triton.topk_keys import _order_key

_FDONE = tl.constexpr(7)    # stream programs finished with this row (FUSE_REFINE), state word 7


@triton.jit
def _select_regs(val, m, krem, BITS: tl.constexpr, LEVELS: tl.constexpr):
    """Radix select on a register tile (BITS-bit digits, top first) over the uint32 `val` where m:
    the krem-th largest, as topk._radix_select returns it: (t, krem, exact); exact → exactly krem
    entries have val >= t (t's undecided low bits 0); else t is decided to LEVELS digits and krem
    of the entries equal to t there are still to take."""
    NB: tl.constexpr = 1 << BITS
    bins = tl.arange(0, NB)
    prefix = tl.zeros((), tl.uint32)
    level = 0
    exact = level < 0
    while (level < LEVELS) & (exact == 0):
        decided = 32 - BITS * level                       # bits >= decided are fixed by prefix
        shift = tl.maximum(decided - BITS, 0)
        high = (tl.full((), 0xFFFFFFFF, tl.uint64) << decided.to(tl.uint64)).to(tl.uint32)
        mm = m & ((val & high) == (prefix & high))
        hist = tl.histogram(((val >> shift.to(tl.uint32)) & (NB - 1)).to(tl.int32), NB, mask=mm)
        suffix = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist        # entries with digit >= d
        best = tl.max(tl.where(suffix >= krem, bins, 0), 0)
        krem -= tl.sum(tl.where(bins > best, hist, 0), 0)
        prefix = prefix | (best.to(tl.uint32) << shift.to(tl.uint32))
        exact = tl.sum(tl.where(bins == best, hist, 0), 0) == krem
        level += 1
    return prefix, krem, exact


@triton.jit
def _plan_kernel(src_ptr, src_stride, row_len_ptr, out_ptr, out_stride, state_ptr, fb_ptr, hist_ptr, k, cap,
                 target, SAMPLES: tl.constexpr, RUN: tl.constexpr, TILE: tl.constexpr):
    """Per row: reset its state; write it out if row_len <= k; else choose the threshold T."""
    row = tl.program_id(0)
    n = tl.load(row_len_ptr + row)
    st = state_ptr + row * _RS
    if row == 0:
        tl.store(fb_ptr, 0)
    tl.store(st + _CNT, 0)
    tl.store(st + _DONE, 0)
    tl.store(st + _OUT, 0)
    tl.store(st + _FDONE, 0)
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
            i = tl.arange(0, SAMPLES)
            key = _order_key(tl.load(src_ptr + row.to(tl.int64) * src_stride + _sample_pos(i, n, SAMPLES, RUN)))
            rank = tl.minimum((target.to(tl.int64) * SAMPLES + n - 1) // n, SAMPLES).to(tl.int32)
            thresh, _, _ = _select_regs(key, i >= 0, rank, 8, 3)          # 24 bits, as topk.py
    tl.store(st + _THRESH, thresh.to(tl.int32, bitcast=True))


@triton.jit
def _refine_row(row, src_ptr, src_stride, row_len_ptr, out_ptr, out_stride, state_ptr, fb_ptr, ckey_ptr,
                cpos_ptr, ties_ptr, k, cap, chunk, n_chunks, CP: tl.constexpr, RT: tl.constexpr,
                BITS: tl.constexpr, TILE: tl.constexpr):
    """Exact top-k of one row from its G candidates (> T) and per-chunk tie counts (== T), or the
    row joins the fallback list. Buffers are read with .cg: other programs of a fused launch
    wrote them."""
    LEVELS: tl.constexpr = (32 + BITS - 1) // BITS
    st = state_ptr + row * _RS
    count = tl.atomic_add(st + _CNT, 0)
    thresh = tl.load(st + _THRESH).to(tl.uint32, bitcast=True)
    c = tl.arange(0, CP)
    ties = tl.load(ties_ptr + row * n_chunks + c, mask=c < n_chunks, other=0, cache_modifier=".cg")
    need = k - count
    ckey = ckey_ptr + row.to(tl.int64) * cap
    cpos = cpos_ptr + row.to(tl.int64) * cap
    out_row = out_ptr + row.to(tl.int64) * out_stride
    use_ties = (need > 0) & (need <= tl.sum(ties, 0)) & (count <= cap)
    if ((count >= k) & (count <= cap)) | use_ties:
        base = 0
        if count <= RT:      # the whole buffer in registers: every digit without reloads
            offs = tl.arange(0, RT)
            m = offs < count
            key = tl.load(ckey + offs, mask=m, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
            key_t = tl.zeros((), tl.uint32)
            pos_t = tl.zeros((), tl.uint32)
            if need <= 0:
                key_t, krem, exact = _select_regs(key, m, k, BITS, LEVELS)
                if exact == 0:
                    tie = m & (key == key_t)
                    tpos = tl.load(cpos + offs, mask=tie, other=0, cache_modifier=".cg").to(tl.uint32)
                    pos_t, _, _ = _select_regs(tpos, tie, krem, BITS, LEVELS)
            pos = tl.load(cpos + offs, mask=m, other=0, cache_modifier=".cg")
            sel = m & ((key > key_t) | ((key == key_t) & (pos.to(tl.uint32) >= pos_t)))
            seli = sel.to(tl.int32)
            tl.store(out_row + tl.cumsum(seli, 0) - seli, pos, mask=sel)
            base = tl.sum(seli, 0)
        else:                # topk.py's select, reading the buffer for each digit
            key_t = tl.zeros((), tl.uint32)
            pos_t = tl.zeros((), tl.uint32)
            if need <= 0:
                key_t, krem, exact = _radix_select(ckey, cpos, count, k, 0, False, TILE)
                if exact == 0:
                    pos_t, _, _ = _radix_select(ckey, cpos, count, krem, key_t, True, TILE)
            for start in range(0, count, TILE):
                offs = start + tl.arange(0, TILE)
                m = offs < count
                key = tl.load(ckey + offs, mask=m, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
                pos = tl.load(cpos + offs, mask=m, other=0, cache_modifier=".cg")
                sel = m & ((key > key_t) | ((key == key_t) & (pos.to(tl.uint32) >= pos_t)))
                seli = sel.to(tl.int32)
                tl.store(out_row + base + tl.cumsum(seli, 0) - seli, pos, mask=sel)
                base += tl.sum(seli, 0)
        # G < k: chunks from the top, each giving its highest positions at T
        j = n_chunks - 1
        n = tl.load(row_len_ptr + row)
        while (need > 0) & (j >= 0):
            take = tl.minimum(tl.sum(tl.where(c == j, ties, 0), 0), need)
            if take > 0:
                base = _take_top_ties(row, j * chunk, tl.minimum(j * chunk + chunk, n), thresh, take, out_row,
                                      base, src_ptr, src_stride, src_ptr, 0, 0, src_ptr, 0, src_ptr, src_ptr,
                                      src_ptr, 0, src_ptr, 0, 0, False, 1, 16, 16, False, tl.float32, TILE)
            need -= take
            j -= 1
    else:
        slot = tl.atomic_add(fb_ptr, 1)
        tl.store(fb_ptr + 1 + slot, row)
        tl.store(st + _PREFIX, 0)
        tl.store(st + _KREM, k)


@triton.jit
def _stream_kernel(src_ptr, src_stride, row_len_ptr, out_ptr, out_stride, state_ptr, fb_ptr, ckey_ptr, cpos_ptr,
                   ties_ptr, k, cap, chunk, n_chunks, TILE: tl.constexpr, ITERS: tl.constexpr,
                   FUSE_REFINE: tl.constexpr, CP: tl.constexpr, RT: tl.constexpr, BITS: tl.constexpr,
                   RTILE: tl.constexpr):
    """Program (chunk, row): append the keys > T of ITERS tiles, count the keys == T; with
    FUSE_REFINE the row's last program then refines the row."""
    row = tl.program_id(1)
    c = tl.program_id(0)
    st = state_ptr + row * _RS
    if tl.load(st + _MODE) == 0:
        n = tl.load(row_len_ptr + row)
        thresh = tl.load(st + _THRESH).to(tl.uint32, bitcast=True)
        lo = c * chunk
        src_row = src_ptr + row.to(tl.int64) * src_stride
        ckey = ckey_ptr + row.to(tl.int64) * cap
        cpos = cpos_ptr + row.to(tl.int64) * cap
        ties = tl.zeros([TILE], tl.int32)
        nxt = tl.load(src_row + lo + tl.arange(0, TILE), mask=lo + tl.arange(0, TILE) < n, other=0.0)
        for it in tl.static_range(ITERS):
            pos = lo + it * TILE + tl.arange(0, TILE)
            x = nxt
            if it + 1 < ITERS:   # the next tile's load is in flight while this one is filtered
                nxt = tl.load(src_row + pos + TILE, mask=pos + TILE < n, other=0.0)
            live = pos < n
            key = _order_key(x)
            ties += (live & (key == thresh)).to(tl.int32)
            sel = live & (key > thresh)
            seli = sel.to(tl.int32)
            nsel = tl.sum(seli, 0)
            if nsel > 0:
                base = tl.atomic_add(st + _CNT, nsel)
                idx = base + tl.cumsum(seli, 0) - seli
                ok = sel & (idx < cap)
                tl.store(ckey + idx, key.to(tl.int32, bitcast=True), mask=ok)
                tl.store(cpos + idx, pos, mask=ok)
        tl.store(ties_ptr + row * n_chunks + c, tl.sum(ties, 0))
        if FUSE_REFINE:
            tl.debug_barrier()
            if tl.atomic_add(st + _FDONE, 1) == n_chunks - 1:
                _refine_row(row, src_ptr, src_stride, row_len_ptr, out_ptr, out_stride, state_ptr, fb_ptr,
                            ckey_ptr, cpos_ptr, ties_ptr, k, cap, chunk, n_chunks, CP, RT, BITS, RTILE)


@triton.jit
def _refine_kernel(src_ptr, src_stride, row_len_ptr, out_ptr, out_stride, state_ptr, fb_ptr, ckey_ptr,
                   cpos_ptr, ties_ptr, k, cap, chunk, n_chunks, CP: tl.constexpr, RT: tl.constexpr,
                   BITS: tl.constexpr, RTILE: tl.constexpr):
    row = tl.program_id(0)
    if tl.load(state_ptr + row * _RS + _MODE) == 0:
        _refine_row(row, src_ptr, src_stride, row_len_ptr, out_ptr, out_stride, state_ptr, fb_ptr, ckey_ptr,
                    cpos_ptr, ties_ptr, k, cap, chunk, n_chunks, CP, RT, BITS, RTILE)


# ---- launcher ---------------------------------------------------------------------------------

DEFAULT_CONFIG = dict(tile=4096, iters=1, warps=8, fuse_refine=False, rt=8192, bits=8, refine_warps=8,
                      plan_warps=8)


def topk_select_fast(scores: torch.Tensor, row_len: torch.Tensor, k: int, **config) -> torch.Tensor:
    """topk_select by the streaming pipeline; config overrides DEFAULT_CONFIG (launch tuning)."""
    _check_topk(scores, row_len, k)
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise ValueError(f"config: unknown keys {sorted(unknown)}")
    cfg = {**DEFAULT_CONFIG, **config}
    n_rows, width = scores.shape
    out = torch.empty((n_rows, k), dtype=torch.int32, device=scores.device)
    if n_rows == 0:
        return out
    if width and scores.stride(1) != 1:
        scores = scores.contiguous()
    tile, rt = cfg["tile"], cfg["rt"]
    chunk = tile * cfg["iters"]
    n_chunks = triton.cdiv(max(width, 1), chunk)
    cap, ws = topk._workspace(n_rows, max(width, 1), k, n_chunks, scores.device)
    _plan_kernel[(n_rows,)](scores, scores.stride(0), row_len, out, out.stride(0), ws["state"], ws["fb"],
                            ws["hist"], k, cap, topk.TARGET_NUM * k // topk.TARGET_DEN, SAMPLES=topk.SAMPLES,
                            RUN=topk.RUN, TILE=topk._REFINE_TILE, num_warps=cfg["plan_warps"])
    if width == 0:
        return out
    bufs = (ws["state"], ws["fb"], ws["ckey"], ws["cpos"], ws["ties"], k, cap, chunk, n_chunks)
    # CP at least 256: one compiled refine for every width up to 1M at the default tile
    refine = dict(CP=max(_pow2(n_chunks), 256), RT=rt, BITS=cfg["bits"], RTILE=topk._REFINE_TILE)
    _stream_kernel[(n_chunks, n_rows)](scores, scores.stride(0), row_len, out, out.stride(0), *bufs, TILE=tile,
                                       ITERS=cfg["iters"], FUSE_REFINE=cfg["fuse_refine"], **refine,
                                       num_warps=cfg["warps"])
    if not cfg["fuse_refine"]:
        _refine_kernel[(n_rows,)](scores, scores.stride(0), row_len, out, out.stride(0), *bufs, **refine,
                                  num_warps=cfg["refine_warps"])
    src = (scores, scores.stride(0), scores, 0, 0, scores, 0, scores, scores, scores, 0, scores, 0, 0, row_len)
    fb = dict(NP=topk.FB_PROGRAMS, TILE=topk._REFINE_TILE, FUSED=False, BLOCK_SIZE=1, HP=16, DP=16, FP8=False,
              DOT_DTYPE=tl.float32, num_warps=8)
    for level in range(4):
        _fb_digit_kernel[(topk.FB_PROGRAMS,)](*src, ws["state"], ws["fb"], ws["hist"], LEVEL=level, **fb)
    _fb_emit_kernel[(topk.FB_PROGRAMS,)](*src, out, out.stride(0), ws["state"], ws["fb"], **fb)
    return out
