"""Lightning indexer scan over MXFP8 index keys (the `mxfp8_indexer` format, graph/ops/fp8_layouts.py).

Same op, work split and epilogue as indexer.py's gather kernel (a program owns a tile of ROWS rows
— one request in the decode layout — and one of `splits` slices of each request's key range;
ReLU, × w, sum over heads, -inf past each row's length), with MXFP8 numerics: keys are e4m3 with
one power-of-two (E8M0) scale per 32 values, and q is quantised the same way in the prologue (per
row, head and 32-value group; the reference op does the same). A 128-wide key is then four
partial dots, one per group, each scaled by its key scale × query scale before they are summed:
  logits[s, m] = Σ_g 2^(e_k[s, g] + e_q[m, g]) · (k̂[s, g·32:(g+1)·32] · q̂[m, g·32:(g+1)·32])
On the GPU each partial dot is an FP8 tensor-core dot with an inner size of 32 (Hopper's minimum
for e4m3); the scale products are exact powers of two, so the result differs from the reference
only by fp32 accumulation order. Under the interpreter (CPU) the dots are exact fp32.

Needs d a multiple of 32 and at most 128 (four groups), checked by the indexer launcher.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k31c.graph.ops.fp8_layouts import MX_GROUP
from k31c.lowering.aot_spec import kernel_spec
from k31c.lowering.triton.cache_write import exp2_int, mx_exponent, round_to_e4m3
from k31c.lowering.triton.indexer_tile import (fill_tail, key_slots, query_rows, rows_of_tile,
                                               run_rows, run_start)
from k31c.lowering.triton.device import pdl_launch, wait_for_producers

MAX_GROUPS = 4
GROUP = tl.constexpr(MX_GROUP)       # values per E8M0 scale, inside the kernels


@triton.jit
def _query_group(q_ptr, q_row_stride, q_head_stride, q_col_stride, first_row, n_rows, g,
                 ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, H: tl.constexpr, H_PAD: tl.constexpr,
                 DOT_DTYPE: tl.constexpr):
    """Group g (32 columns) of the tile's queries, MXFP8-quantised per (row, head): the dot
    operand q̂_t [32, M] and the scales 2^e_q [M]."""
    M: tl.constexpr = ROWS_PAD * H_PAD
    m = tl.arange(0, M)
    m_row = first_row + m // H_PAD
    m_head = m % H_PAD
    m_ok = (m // H_PAD < ROWS) & (m_row < n_rows) & (m_head < H)
    cols = g * 32 + tl.arange(0, 32)
    q = tl.load(q_ptr + m_row.to(tl.int64)[:, None] * q_row_stride + m_head[:, None] * q_head_stride
                + cols[None, :] * q_col_stride, mask=m_ok[:, None], other=0.0).to(tl.float32)
    e = mx_exponent(tl.max(tl.abs(q), axis=1))
    y = tl.minimum(tl.maximum(q * exp2_int(-e)[:, None], -448.0), 448.0)   # exact: x * 2^-e
    return tl.trans(round_to_e4m3(y).to(DOT_DTYPE)), exp2_int(e)


@triton.jit
def mx_query_tile(q_ptr, q_row_stride, q_head_stride, q_col_stride, w_ptr, w_row_stride,
                  w_head_stride, first_row, n_rows, ROWS: tl.constexpr, ROWS_PAD: tl.constexpr,
                  H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """For the TMA kernel (indexer_tma.py, MX_CACHE): the tile's queries MXFP8-quantised per
    (row, head, 32-value group) and dequantised again, q̂·2^e, as one 16-bit dot operand
    (q_t [D, M], w [M]). The value is exact in bf16 (3 mantissa bits times a power of two), so one
    dot over the 128 columns with the keys dequantised the same way (`mx_dequant_keys`) sums the
    products the four partial dots of this module's kernel sum, in another order."""
    G: tl.constexpr = D // GROUP
    q, w = query_rows(q_ptr, q_row_stride, q_head_stride, q_col_stride, w_ptr, w_row_stride,
                      w_head_stride, first_row, n_rows, tl.full((D,), 1, tl.int1), ROWS, ROWS_PAD,
                      H, H_PAD, D)
    x = tl.reshape(q, (ROWS_PAD * H_PAD, G, GROUP))
    e = mx_exponent(tl.max(tl.abs(x), axis=2))                          # [M, G]
    y = tl.minimum(tl.maximum(x * exp2_int(-e)[:, :, None], -448.0), 448.0)
    q_hat = round_to_e4m3(y) * exp2_int(e)[:, :, None]
    return tl.trans(tl.reshape(q_hat, (ROWS_PAD * H_PAD, D)).to(DOT_DTYPE)), w


@triton.jit
def mx_dequant_keys(k, scale_ptr, block, block_stride, offs, BLOCK_SIZE: tl.constexpr,
                    D: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """A cache block's keys k [BLOCK_SIZE, D] (e4m3) times their E8M0 group scales (the bytes
    after the block's values; scale_ptr is the cache as bytes), as DOT_DTYPE (exact in bf16); a
    -1 block (k zero-filled) reads no scales."""
    G: tl.constexpr = D // GROUP
    g = tl.arange(0, G)
    at = block.to(tl.int64) * block_stride + BLOCK_SIZE * D + offs[:, None] * G + g[None, :]
    e = tl.load(scale_ptr + at, mask=(block >= 0) & (offs >= 0)[:, None], other=127).to(tl.int32) - 127
    x = tl.reshape(k.to(tl.float32), (BLOCK_SIZE, G, GROUP)) * exp2_int(e)[:, :, None]
    return tl.reshape(x, (BLOCK_SIZE, D)).to(DOT_DTYPE)


@triton.jit
def _group_dot(cache_ptr, scale_ptr, key_at, scale_at, key_ok, g, q_t, q_scale,
               DOT_DTYPE: tl.constexpr):
    """One partial dot: keys' group g [KEYS, 32] x q̂_t [32, M], times both scales."""
    cols = g * 32 + tl.arange(0, 32)
    k = tl.load(cache_ptr + key_at[:, None] + cols[None, :], mask=key_ok[:, None], other=0.0)
    if cache_ptr.dtype.element_ty == tl.uint8:          # interpreter: bytes, reinterpreted
        k = k.to(tl.float8e4nv, bitcast=True)
    e = tl.load(scale_ptr + scale_at + g, mask=key_ok, other=127).to(tl.int32) - 127
    if DOT_DTYPE == tl.float32:
        part = tl.dot(k.to(tl.float32), q_t, input_precision="ieee")
    else:
        part = tl.dot(k.to(DOT_DTYPE), q_t)
    return part * (exp2_int(e)[:, None] * q_scale[None, :])


@triton.jit
def _indexer_mx_kernel(q_ptr, q_row_stride, q_head_stride, q_col_stride, w_ptr, w_row_stride,
                       w_head_stride, cache_ptr, scale_ptr, block_stride, table_ptr, table_stride,
                       row_req_ptr, row_len_ptr, out_ptr, n_rows, n_req, capacity, n_splits,
                       ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, H: tl.constexpr,
                       H_PAD: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       KEYS: tl.constexpr, TAIL: tl.constexpr, DOT_DTYPE: tl.constexpr,
                       NUM_STAGES: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    GROUPS: tl.constexpr = D // 32
    tile = tl.program_id(0)
    split = tl.program_id(1)
    first_row = tile * ROWS

    # the tile's queries, quantised once: four groups (repeats of the last one past GROUPS, unused)
    q0, s0 = _query_group(q_ptr, q_row_stride, q_head_stride, q_col_stride, first_row, n_rows, 0,
                          ROWS, ROWS_PAD, H, H_PAD, DOT_DTYPE)
    q1, s1 = _query_group(q_ptr, q_row_stride, q_head_stride, q_col_stride, first_row, n_rows,
                          1 % GROUPS, ROWS, ROWS_PAD, H, H_PAD, DOT_DTYPE)
    q2, s2 = _query_group(q_ptr, q_row_stride, q_head_stride, q_col_stride, first_row, n_rows,
                          2 % GROUPS, ROWS, ROWS_PAD, H, H_PAD, DOT_DTYPE)
    q3, s3 = _query_group(q_ptr, q_row_stride, q_head_stride, q_col_stride, first_row, n_rows,
                          3 % GROUPS, ROWS, ROWS_PAD, H, H_PAD, DOT_DTYPE)
    M: tl.constexpr = ROWS_PAD * H_PAD
    m = tl.arange(0, M)
    m_row = first_row + m // H_PAD
    m_ok = (m // H_PAD < ROWS) & (m_row < n_rows) & (m % H_PAD < H)
    w = tl.load(w_ptr + m_row.to(tl.int64) * w_row_stride + (m % H_PAD) * w_head_stride, mask=m_ok,
                other=0.0)

    row_ok, req_of_row, len_of_row, out_row = rows_of_tile(row_req_ptr, row_len_ptr, out_ptr,
                                                           first_row, n_rows, capacity, ROWS, ROWS_PAD)
    minus_inf = tl.full((ROWS_PAD, TAIL), float("-inf"), tl.float32)

    for j in range(ROWS):
        row = first_row + j
        if row < n_rows:
            req, starts_run = run_start(row_req_ptr, row, j)
            if starts_run:
                sel, lens, length, table_row = run_rows(req, row_ok, req_of_row, len_of_row, n_req,
                                                        table_ptr, table_stride)
                n_steps = tl.cdiv(length, KEYS)
                for step in tl.range(split * n_steps // n_splits, (split + 1) * n_steps // n_splits,
                                     num_stages=NUM_STAGES):
                    pos, key_ok, block, offset, key_at = key_slots(table_row, step, length,
                                                                   block_stride, KEYS, BLOCK_SIZE, D)
                    scale_at = block * block_stride + BLOCK_SIZE * D + offset * GROUPS
                    logits = _group_dot(cache_ptr, scale_ptr, key_at, scale_at, key_ok, 0, q0, s0,
                                        DOT_DTYPE)
                    if GROUPS > 1:
                        logits += _group_dot(cache_ptr, scale_ptr, key_at, scale_at, key_ok, 1, q1,
                                             s1, DOT_DTYPE)
                    if GROUPS > 2:
                        logits += _group_dot(cache_ptr, scale_ptr, key_at, scale_at, key_ok, 2, q2,
                                             s2, DOT_DTYPE)
                    if GROUPS > 3:
                        logits += _group_dot(cache_ptr, scale_ptr, key_at, scale_at, key_ok, 3, q3,
                                             s3, DOT_DTYPE)
                    logits = tl.maximum(logits, 0.0) * w[None, :]
                    scores = tl.sum(tl.reshape(logits, (KEYS, ROWS_PAD, H_PAD)), axis=2)
                    scores = tl.where(pos[:, None] < lens[None, :], scores, float("-inf"))
                    tl.store(out_row[None, :] + pos[:, None], scores,
                             mask=sel[None, :] & (pos < capacity)[:, None])
                fill_tail(out_row, sel, capacity, n_steps * KEYS, split, n_splits, minus_inf, TAIL)


def constexprs(rows: int, rows_pad: int, heads: int, d: int, block_size: int, keys: int,
               on_gpu: bool, exact_dot: bool, num_stages: int) -> dict:
    return dict(ROWS=rows, ROWS_PAD=rows_pad, H=heads, H_PAD=triton.next_power_of_2(heads), D=d,
                BLOCK_SIZE=block_size, KEYS=keys, TAIL=(4096 if on_gpu else 256) // rows_pad,
                DOT_DTYPE=tl.float8e4nv if on_gpu and not exact_dot else tl.float32,
                NUM_STAGES=num_stages)


def check_mx_width(d: int) -> None:
    if d % MX_GROUP or d > MAX_GROUPS * MX_GROUP:
        raise ValueError(f"q: the MXFP8 indexer needs index_head_dim a multiple of {MX_GROUP} and at "
                         f"most {MAX_GROUPS * MX_GROUP}, got {d}")


def launch_indexer_mx(q, weights, index_cache, block_table, row_req, row_len, scores, *,
                      block_size: int, rows: int, rows_pad: int, keys: int, splits: int,
                      num_warps: int, num_stages: int, exact_dot: bool = False) -> torch.Tensor:
    """Launch on checked arguments (`indexer.launch_indexer` derives the tiles and splits from
    its plan for an FP8 cache). exact_dot: fp32 dots on the GPU too (tests)."""
    n, heads, d = q.shape
    check_mx_width(d)
    on_gpu = q.device.type == "cuda"
    raw = index_cache.view(torch.uint8)
    values = index_cache if on_gpu else raw      # e4m3 loads on the GPU; bytes in the interpreter
    _indexer_mx_kernel[(triton.cdiv(n, rows), splits)](
        q, q.stride(0), q.stride(1), q.stride(2), weights, weights.stride(0), weights.stride(1),
        values, raw, raw.stride(0), block_table, block_table.stride(0), row_req, row_len, scores,
        n, block_table.shape[0], scores.shape[1], splits,
        **constexprs(rows, rows_pad, heads, d, block_size, keys, on_gpu, exact_dot, num_stages),
        num_warps=num_warps, **pdl_launch(q.device))
    return scores


def aot_spec(p, block_size: int, ptrs: dict, variant: str, op: str, ints: dict | None = None):
    """The AOT build of the launch for `indexer.plan`'s IndexerPlan p (GPU) on an MXFP8 cache;
    `ints`: the launch's integers (aot_spec.kernel_spec)."""
    return kernel_spec(
        _indexer_mx_kernel, op, variant,
        constexprs(p.rows, p.rows_pad, p.heads, p.d, block_size, p.keys, True, False, p.num_stages),
        dict(ptrs, cache_ptr=torch.float8_e4m3fn, scale_ptr=torch.uint8), num_warps=p.num_warps,
        ints=ints)
