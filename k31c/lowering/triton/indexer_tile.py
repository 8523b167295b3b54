"""What the Triton lightning-indexer kernels share (indexer.py gathers keys row by row,
indexer_tma.py bulk-copies whole cache blocks, indexer_mxfp8.py gathers MXFP8 keys): the hardware
e4m3 quantisation of q, the query tile loaded once per program, the tile's rows and requests, the
runs of rows of one request that one pass over the keys serves, and the scoring of one block of
keys against the tile (ReLU, head weights, key scale, row-length mask, store). Inlined into each
kernel by Triton."""
from __future__ import annotations

import triton
import triton.language as tl

from k31c.lowering.triton.cache_write import e4m3_scale, quantize_e4m3


@triton.jit
def e4m3_hw(x, scale, RCP: tl.constexpr):
    """x / scale (scale [M], one per row of x) clamped to ±448, to e4m3 by the hardware
    conversion (cvt.rn.satfinite, nearest-even), as the reference quantises.

    RCP: the quotient as y0 = x · (1/scale) plus one FMA correction, y0 + (x - y0·scale)/scale,
    instead of a division per element (each a branchy div.rn sequence, no overlap across a
    [128, 128] tile); the same values as x / scale (BENCHMARKS.md, indexer). ptxas then wants 255
    registers for the prologue, so the launcher caps them (maxnreg 168: 3 programs per SM, a few
    one-time spills in the prologue)."""
    if RCP:
        inv = tl.div_rn(1.0, scale)[:, None]
        y0 = x * inv
        y = tl.fma(tl.fma(-y0, scale[:, None], x), inv, y0)
    else:
        y = tl.div_rn(x, scale[:, None])
    return tl.minimum(tl.maximum(y, -448.0), 448.0).to(tl.float8e4nv)


@triton.jit
def query_rows(q_ptr, q_row_stride, q_head_stride, q_col_stride, w_ptr, w_row_stride, w_head_stride,
               first_row, n_rows, q_mask_cols, ROWS: tl.constexpr, ROWS_PAD: tl.constexpr,
               H: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr):
    """The tile's queries, a row per (tile row, head): (q [M, D_PAD] fp32, w [M]); 0 where a row,
    head or column (q_mask_cols [D_PAD]) does not exist."""
    M: tl.constexpr = ROWS_PAD * H_PAD
    m = tl.arange(0, M)
    m_row = first_row + m // H_PAD
    m_head = m % H_PAD
    m_ok = (m // H_PAD < ROWS) & (m_row < n_rows) & (m_head < H)
    cols = tl.arange(0, D_PAD)
    q = tl.load(q_ptr + m_row.to(tl.int64)[:, None] * q_row_stride + m_head[:, None] * q_head_stride
                + cols[None, :] * q_col_stride, mask=m_ok[:, None] & q_mask_cols[None, :],
                other=0.0).to(tl.float32)
    w = tl.load(w_ptr + m_row.to(tl.int64) * w_row_stride + m_head * w_head_stride, mask=m_ok, other=0.0)
    return q, w


@triton.jit
def query_tile(q_ptr, q_row_stride, q_head_stride, q_col_stride, w_ptr, w_row_stride, w_head_stride,
               first_row, n_rows, q_mask_cols, ROWS: tl.constexpr, ROWS_PAD: tl.constexpr,
               H: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr, QUANT_Q: tl.constexpr,
               HW_CVT: tl.constexpr, Q_RCP: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """The tile's queries as one tl.dot operand, a column per (row, head): (q_t [D_PAD, M], w [M]),
    q quantised to e4m3 per (row, head) when QUANT_Q, its scale folded into w (ReLU(s·x) =
    s·ReLU(x) for s > 0). q_mask_cols: [D_PAD] columns that exist."""
    q, w = query_rows(q_ptr, q_row_stride, q_head_stride, q_col_stride, w_ptr, w_row_stride,
                      w_head_stride, first_row, n_rows, q_mask_cols, ROWS, ROWS_PAD, H, H_PAD, D_PAD)
    if QUANT_Q:
        q_scale = e4m3_scale(tl.max(tl.abs(q), axis=1))
        w = w * q_scale
        if HW_CVT:
            q_t = tl.trans(e4m3_hw(q, q_scale, Q_RCP).to(DOT_DTYPE))
        else:
            q_t = tl.trans(quantize_e4m3(q, q_scale[:, None]).to(DOT_DTYPE))
    else:
        q_t = tl.trans(q.to(DOT_DTYPE))
    return q_t, w


@triton.jit
def rows_of_tile(row_req_ptr, row_len_ptr, out_ptr, first_row, n_rows, capacity, ROWS: tl.constexpr,
              OUT: tl.constexpr):
    """The tile's rows (OUT slots, the first ROWS used): which exist, their requests, their
    visible lengths (capped at the row capacity) and their score rows."""
    r = tl.arange(0, OUT)
    rows = first_row + r
    row_ok = (r < ROWS) & (rows < n_rows)
    req_of_row = tl.load(row_req_ptr + rows, mask=row_ok, other=-1)
    len_of_row = tl.minimum(tl.load(row_len_ptr + rows, mask=row_ok, other=0), capacity)
    return row_ok, req_of_row, len_of_row, out_ptr + rows.to(tl.int64) * capacity


@triton.jit
def run_start(row_req_ptr, row, j):
    """Row `row`, the j-th of its tile: its request, and whether it starts a run of the tile's
    rows of one request (the first row, or a request other than the previous row's)."""
    req = tl.load(row_req_ptr + row)
    prev_req = tl.load(row_req_ptr + row - 1, mask=j > 0, other=-1)
    return req, (j == 0) | (req != prev_req)


@triton.jit
def run_rows(req, row_ok, req_of_row, len_of_row, n_req, table_ptr, table_stride):
    """The tile's rows of request `req` (sel), their visible lengths (lens, 0 elsewhere and for a
    request outside [0, n_req)), the longest of them and the request's block-table row: what
    one pass over the request's keys reads."""
    sel = row_ok & (req_of_row == req)
    req_ok = (req >= 0) & (req < n_req)
    lens = tl.where(sel & req_ok, len_of_row, 0)
    return sel, lens, tl.max(lens, axis=0), table_ptr + req.to(tl.int64) * table_stride


@triton.jit
def key_slots(table_row, step, length, block_stride, KEYS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
              D: tl.constexpr):
    """Step `step`'s KEYS key positions through the block table row (the gather kernels):
    (pos, key_ok: below `length` in a mapped block, block, offset in it, the key's byte/element
    offset in the cache)."""
    pos = step * KEYS + tl.arange(0, KEYS)
    pos_ok = pos < length
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_ok, other=-1).to(tl.int64)
    key_ok = pos_ok & (block >= 0)
    offset = pos % BLOCK_SIZE
    return pos, key_ok, block, offset, block * block_stride + offset * D


@triton.jit
def head_weights(w, ROWS_PAD: tl.constexpr, H_PAD: tl.constexpr, OUT: tl.constexpr,
                 HEAD_DTYPE: tl.constexpr):
    """W [M, OUT] with W[m, r] = w[m] where m is a head of tile row r: the weighted head sum as a
    second tl.dot (HEAD_DOT)."""
    m = tl.arange(0, ROWS_PAD * H_PAD)
    out_col = tl.arange(0, OUT)
    return tl.where((m // H_PAD)[:, None] == out_col[None, :], w[:, None], 0.0).to(HEAD_DTYPE)


@triton.jit
def score_keys(k, q_t, w, w_mat, k_scale, pos, lens, out_row, sel, capacity, KEYS: tl.constexpr,
               ROWS_PAD: tl.constexpr, H_PAD: tl.constexpr, FP8_CACHE: tl.constexpr,
               DOT_DTYPE: tl.constexpr, HEAD_DOT: tl.constexpr, HEAD_DTYPE: tl.constexpr):
    """Scores of KEYS keys (k [KEYS, D_PAD], positions pos) for the tile's rows: ReLU(k·q) times
    the head weights summed per row, times the key's scale (FP8), -inf at or past each row's
    length, stored to the selected rows (sel) of out_row."""
    if DOT_DTYPE == tl.float32:
        logits = tl.dot(k.to(tl.float32), q_t, input_precision="ieee")
    else:
        logits = tl.dot(k.to(DOT_DTYPE), q_t)                  # [KEYS, M] fp32
    if HEAD_DOT:
        relu = tl.maximum(logits, 0.0).to(HEAD_DTYPE)
        if HEAD_DTYPE == tl.float32:
            scores = tl.dot(relu, w_mat, input_precision="ieee")   # [KEYS, OUT]
        else:
            scores = tl.dot(relu, w_mat)
    else:
        logits = tl.maximum(logits, 0.0) * w[None, :]
        scores = tl.sum(tl.reshape(logits, (KEYS, ROWS_PAD, H_PAD)), axis=2)
    if FP8_CACHE:
        scores = scores * k_scale[:, None]
    scores = tl.where(pos[:, None] < lens[None, :], scores, float("-inf"))
    tl.store(out_row[None, :] + pos[:, None], scores, mask=sel[None, :] & (pos < capacity)[:, None])


@triton.jit
def fill_tail(out_row, sel, capacity, tail_start, split, n_splits, minus_inf, TAIL: tl.constexpr):
    """-inf over the row positions past the scored blocks, shared out over the split programs."""
    n_tail = tl.cdiv(capacity - tail_start, TAIL)
    for chunk in range(split * n_tail // n_splits, (split + 1) * n_tail // n_splits):
        pos = tail_start + chunk * TAIL + tl.arange(0, TAIL)
        tl.store(out_row[:, None] + pos[None, :], minus_inf,
                 mask=sel[:, None] & (pos < capacity)[None, :])
