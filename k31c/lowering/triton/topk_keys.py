"""Where the top-k select pipeline's keys come from (spec/model.md §6.7.4).

A key is a score's order-preserving uint32 image. `_row_keys` gives the keys of one row at some
positions either read from a score row (topk_select) or scored in-kernel from the FP8/BF16 index
cache (the fused lightning_indexer_topk), switching on its FUSED constexpr. The pipeline kernels
of topk.py and the fused kernels of indexer_topk.py both load keys through it, so it and the
scoring helpers live here, below both, with no kernels of their own (no import cycle). The
scoring is this module's own (not shared with triton/indexer.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

from k31c.lowering.triton.cache_write import e4m3_scale, quantize_e4m3


@triton.jit
def _order_key(x):
    """fp32 → uint32 whose unsigned order is the float order (torch.sort's, NaN above +inf)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = tl.where(bits == 0x80000000, tl.zeros_like(bits), bits)
    key = tl.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return tl.where(x != x, tl.full(key.shape, 0xFFFFFFFF, tl.uint32), key)


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
