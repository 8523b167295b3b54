"""The fused lightning indexer + top-k (a comparison kernel): topk_select(lightning_indexer(...),
row_len, k) without writing the [N, L] score matrix. The registered lowering of
`k31c::lightning_indexer_topk` is the scan then the select (k31c/lowering/triton/indexer_topk.py),
measured faster (BENCHMARKS.md, top-k).

The select pipeline of k31c/lowering/triton/topk.py runs on scores computed in-kernel from the
index cache (FP8 e4m3 through the block table, or BF16/F32): the sample pass here scores only the
sampled positions, the filter pass here scores each tile in registers (all rows of a request from
one key load) and keeps only candidates; topk.py's plan and refine passes run unchanged (refine
without tie scanning), and the fallback passes here rescore their rows (rare) on each pass.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k31c.graph.ops.cache_write import is_fp8_index_cache
from k31c.graph.ops.indexer import check_indexer
from k31c.lowering.triton.cache_write import e4m3_scale, quantize_e4m3
from k31c.lowering.triton.device import interpreting, sm_count
from k31c.lowering.triton import topk
from k31c.lowering.triton.topk import (ST_DONE, ST_KREM, ST_MODE, ST_OUT, ST_PREFIX,
                                       ST_THRESH, ST_WORDS, append_candidates, fallback_chunk,
                                       fallback_digit_tile, fallback_emit_tile, fallback_pick_digit,
                                       launch_plan, launch_refine, order_key, plan, pow2,
                                       sample_position, take_ties_tile)

# ---- in-kernel indexer scores -----------------------------------------------------------------

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
def _row_keys(row, pos, pos_ok, q_ptr, sq_t, sq_h, w_ptr, sw_t, cache_ptr, scale_ptr, bt_ptr, sbt,
              row_req_ptr, H, D, BLOCK_SIZE: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
              FP8: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Keys of one row at positions pos, scored from the cache."""
    rows = row + tl.zeros([1], tl.int32)
    q_t, w = _load_q(q_ptr, sq_t, sq_h, w_ptr, sw_t, rows, rows >= 0, H, D, 1, HP, DP, DOT_DTYPE)
    s = _score_tile(q_t, w, cache_ptr, scale_ptr, bt_ptr, sbt, tl.load(row_req_ptr + row), pos,
                    pos_ok, D, BLOCK_SIZE, 1, HP, DP, FP8, DOT_DTYPE)
    return order_key(tl.reshape(s, [pos.shape[0]]))


# ---- kernels ----------------------------------------------------------------------------------

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
        pos = sample_position(i, n, SAMPLES, RUN)
        key = _row_keys(row, pos, pos < n, q_ptr, sq_t, sq_h, w_ptr, sw_t, cache_ptr, scale_ptr,
                        bt_ptr, sbt, row_req_ptr, H, D, BLOCK_SIZE, HP, DP, FP8, DOT_DTYPE)
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
    st_rows = state_ptr + rows * ST_WORDS
    active = valid & (tl.load(st_rows + ST_MODE, mask=valid, other=1) == 0)
    thresh = tl.load(st_rows + ST_THRESH, mask=valid, other=0).to(tl.uint32, bitcast=True)
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
                key = order_key(_score_tile(q_t, w, cache_ptr, scale_ptr, bt_ptr, sbt, lead, pos, pos < hi,
                                             D, BLOCK_SIZE, G, HP, DP, FP8, DOT_DTYPE))
                live = mine[:, None] & (pos[None, :] < lens[:, None])
                ties += tl.sum((live & (key == thresh[:, None])).to(tl.int32), 1)
                append_candidates(st_rows, ckey_ptr + rows.to(tl.int64) * cap, cpos_ptr + rows.to(tl.int64) * cap,
                        key, pos[None, :], live & (key > thresh[:, None]), cap)
    tl.store(ties_ptr + rows * tl.num_programs(1) + tl.program_id(1), ties, mask=active)


@triton.jit
def _fused_fb_digit_kernel(q_ptr, sq_t, sq_h, w_ptr, sw_t, cache_ptr, scale_ptr, bt_ptr, sbt,
                           row_req_ptr, H, D, row_len_ptr, state_ptr, fb_ptr, hist_ptr,
                           LEVEL: tl.constexpr, NP: tl.constexpr, TILE: tl.constexpr,
                           BLOCK_SIZE: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
                           FP8: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """topk.py's fallback digit pass, rescoring the listed rows."""
    for j in range(tl.load(fb_ptr)):
        row = tl.load(fb_ptr + 1 + j)
        st = state_ptr + row * ST_WORDS
        lo, hi = fallback_chunk(tl.load(row_len_ptr + row), NP, TILE)
        prefix = tl.load(st + ST_PREFIX).to(tl.uint32, bitcast=True)
        hist = tl.zeros([256], tl.int32)
        for start in range(lo, hi, TILE):
            pos = start + tl.arange(0, TILE)
            key = _row_keys(row, pos, pos < hi, q_ptr, sq_t, sq_h, w_ptr, sw_t, cache_ptr, scale_ptr,
                            bt_ptr, sbt, row_req_ptr, H, D, BLOCK_SIZE, HP, DP, FP8, DOT_DTYPE)
            hist += fallback_digit_tile(key, pos, hi, prefix, LEVEL)
        fallback_pick_digit(st, hist_ptr + row * 256 + tl.arange(0, 256), hist, prefix, LEVEL, NP)


@triton.jit
def _fused_fb_emit_kernel(q_ptr, sq_t, sq_h, w_ptr, sw_t, cache_ptr, scale_ptr, bt_ptr, sbt,
                          row_req_ptr, H, D, row_len_ptr, out_ptr, out_stride, state_ptr, fb_ptr,
                          NP: tl.constexpr, TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          HP: tl.constexpr, DP: tl.constexpr, FP8: tl.constexpr,
                          DOT_DTYPE: tl.constexpr):
    """topk.py's fallback emit pass, rescoring the listed rows; the row's last program takes the
    remaining ties at T from the top of the row down."""
    for j in range(tl.load(fb_ptr)):
        row = tl.load(fb_ptr + 1 + j)
        st = state_ptr + row * ST_WORDS
        n = tl.load(row_len_ptr + row)
        lo, hi = fallback_chunk(n, NP, TILE)
        thresh = tl.load(st + ST_PREFIX).to(tl.uint32, bitcast=True)
        out_row = out_ptr + row.to(tl.int64) * out_stride
        for start in range(lo, hi, TILE):
            pos = start + tl.arange(0, TILE)
            key = _row_keys(row, pos, pos < hi, q_ptr, sq_t, sq_h, w_ptr, sw_t, cache_ptr, scale_ptr,
                            bt_ptr, sbt, row_req_ptr, H, D, BLOCK_SIZE, HP, DP, FP8, DOT_DTYPE)
            fallback_emit_tile(st, out_row, key, pos, hi, thresh)
        tl.debug_barrier()
        if tl.atomic_add(st + ST_DONE, 1) == NP - 1:
            take = tl.load(st + ST_KREM)
            base = tl.atomic_add(st + ST_OUT, 0)
            top = n
            while (take > 0) & (top > 0):
                pos = top - TILE + tl.arange(0, TILE)
                live = (pos >= 0) & (pos < top)
                key = _row_keys(row, pos, live, q_ptr, sq_t, sq_h, w_ptr, sw_t, cache_ptr, scale_ptr,
                                bt_ptr, sbt, row_req_ptr, H, D, BLOCK_SIZE, HP, DP, FP8, DOT_DTYPE)
                base, take = take_ties_tile(key, pos, live, thresh, take, out_row, base)
                top -= TILE


# ---- launcher ---------------------------------------------------------------------------------

def _dot_dtype(q: torch.Tensor, cache: torch.Tensor, fp8: bool):
    """MMA input type, as the Triton indexer picks it: FP8 (q quantised like the keys) for an FP8
    cache on the GPU; a 16-bit dot where q and the keys are exact in it; fp32 otherwise and under
    the interpreter (its 16-bit and fp8 dots are not trusted)."""
    if interpreting() or q.device.type != "cuda":
        return tl.float32
    if fp8:
        return tl.float8e4nv
    for torch_t, tl_t in ((torch.bfloat16, tl.bfloat16), (torch.float16, tl.float16)):
        if q.dtype == torch_t and cache.dtype == torch_t:
            return tl_t
    return tl.float32


_FUSED_TILE = 128      # positions per scoring tile


def lightning_indexer_topk_fused(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                                 block_table: torch.Tensor, row_req: torch.Tensor, row_len: torch.Tensor,
                                 k: int) -> torch.Tensor:
    """`k31c::lightning_indexer_topk` with the scores never written out."""
    block_size = check_indexer(q, weights, index_cache, block_table, row_req, row_len)
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
    p = plan(n_rows, width, k, groups=n_groups, tile=_FUSED_TILE, programs=2 * sm_count(q.device))
    ws = p.workspace(q.device)
    if q.stride(2) != 1:
        q = q.contiguous()
    dot = _dot_dtype(q, index_cache, fp8)
    scale_view = index_cache.view(torch.float32) if fp8 else index_cache
    if dot == tl.float8e4nv:   # e4m3 loads feed the tensor cores directly (no byte bitcast)
        index_cache = index_cache.view(torch.float8_e4m3fn)
    hp1 = max(pow2(heads), 16)
    dp = max(32 if dot == tl.float8e4nv else 16, pow2(d))     # an fp8 MMA needs K >= 32 (zero-padded)
    shape = dict(BLOCK_SIZE=block_size, DP=dp, FP8=fp8, DOT_DTYPE=dot)
    src = (q, q.stride(0), q.stride(1), weights, weights.stride(0), index_cache, scale_view, block_table,
           block_table.stride(0), row_req, heads, d)
    if width > p.cap:
        _fused_sample_kernel[(n_rows, p.samples // 64)](*src, row_len, ws["samples"], p.cap,
                                                        SAMPLES=p.samples, RUN=p.run, BS=64, HP=hp1,
                                                        **shape, num_warps=4)
    launch_plan(p, q, 0, row_len, out, ws, presampled=True)
    if width == 0:
        return out
    _fused_filter_kernel[(n_groups, p.n_chunks)](
        *src, row_len, ws["state"], ws["ckey"], ws["cpos"], ws["ties"], n_rows, p.cap, p.chunk,
        G=groups, BS=_FUSED_TILE, HP=max(pow2(heads), 16 // groups), **shape, NUM_STAGES=3,
        num_warps=8)
    launch_refine(p, weights, 0, row_len, out, ws, scan_ties=False)
    for level in range(4):
        _fused_fb_digit_kernel[(p.fb_programs,)](*src, row_len, ws["state"], ws["fb"], ws["hist"],
                                                 LEVEL=level, NP=p.fb_programs, TILE=64, HP=hp1,
                                                 **shape, num_warps=4)
    _fused_fb_emit_kernel[(p.fb_programs,)](*src, row_len, out, out.stride(0), ws["state"], ws["fb"],
                                            NP=p.fb_programs, TILE=64, HP=hp1, **shape, num_warps=4)
    if topk.DEBUG_PATHS:
        topk.last_paths[:] = topk.row_paths(ws, row_len, k, p.cap)
    return out
