"""The per-chunk passes of `k31c::kda_prefill` (kda_prefill.py: the pipeline, the state and
output passes, the launcher): `kda_conv_kernel`, the conv + norms of each block of rows, and
`kda_chunk_kernel`, the intra-chunk solve, one program per (chunk, head), all chunks in parallel;
and the per-request chunk bookkeeping every pass of the prefill shares (`request_chunks`,
`chunk_request`, `pick`). The math is in kda_prefill.py's docstring, steps 0 and 1."""
from __future__ import annotations

import triton
import triton.language as tl

from k31c.lowering.triton.device import wait_for_producers
from k31c.lowering.triton.kda_common import (L2_EPS, conv_silu_rows, conv_silu_tokens, kda_gate_math,
                                             row_of)

BC = 16                                   # rows per block inside a chunk (MMA M granularity)
SAFE_EXPONENT = 60.0                      # exp(±60) stays well inside fp32/bf16 range


@triton.jit
def request_chunks(cu_ptr, B, C: tl.constexpr, BP: tl.constexpr):
    """Per request j < B: start token, length, number of chunks and index of its first chunk."""
    j = tl.arange(0, BP)
    m = j < B
    start = tl.load(cu_ptr + j, mask=m, other=0)
    length = tl.load(cu_ptr + j + 1, mask=m, other=0) - start
    n_chunks = (length + C - 1) // C
    first = tl.cumsum(n_chunks, axis=0) - n_chunks
    return j, start, length, n_chunks, first


@triton.jit
def chunk_request(cid, first, n_chunks, B):
    """The request global chunk `cid` belongs to, and whether cid is a chunk in use at all."""
    req = tl.minimum(tl.sum((first + n_chunks <= cid).to(tl.int32), axis=0), B - 1)
    return req, cid < tl.sum(n_chunks, axis=0)


@triton.jit
def pick(j, sel, x):
    return tl.sum(tl.where(j == sel, x, 0), axis=0)


@triton.jit
def unit_lower_inverse_doubling(m, rows, BC: tl.constexpr, PREC: tl.constexpr):
    """(I + m)^-1 for a strictly lower triangular [BC, BC] m by doubling the inverted diagonal
    blocks: with X the inverse of the b-blocks, the 2b-blocks' inverse is X - X N X, N being m's
    lower-left b-block of each 2b-block (the block formula [A 0; C D]^-1 = [A^-1 0; -D^-1 C A^-1
    D^-1]). The 1-blocks are 1, so the 2-blocks' inverse is I - N; then log2(BC) - 1 levels of
    two fp32 products each; every level's X is made of exact diagonal blocks of the inverse.
    PREC: an fp32-accurate input_precision (the target's `exact_dot_precision`: "tf32x3", three
    tensor-core products, where the backend has it; "ieee", FMA, elsewhere).
    (Forward substitution, BC - 1 serial row steps, made the T = 8192 prefill 9% slower:
    BENCHMARKS.md, KDA.)"""
    i, j = rows[:, None], rows[None, :]
    inv = (i == j).to(tl.float32) - tl.where((i // 2 == j // 2) & (i > j), m, 0.0)
    for lv in tl.static_range(1, 8):                  # b = 2, 4, ... while b < BC (BC <= 256)
        b = 1 << lv
        if b < BC:
            n = tl.where((i // (2 * b) == j // (2 * b)) & (i // b > j // b), m, 0.0)
            xn = tl.dot(inv, n, input_precision=PREC)
            inv = inv - tl.dot(xn, inv, input_precision=PREC)
    return inv


@triton.jit
def kda_conv_kernel(q_ptr, k_ptr, v_ptr, conv_w_ptr, conv_ptr, slots_ptr, cu_ptr,
                    qn_ptr, kn_ptr, vc_ptr, B, H, scale,
                    C: tl.constexpr, RB: tl.constexpr, K: tl.constexpr, W: tl.constexpr,
                    BP: tl.constexpr, PDL: tl.constexpr = False):
    """One program per (block of RB rows of a chunk, head): causal conv + SiLU over the request's
    window and new rows, then q / k L2-normalised (q also scaled). Writes q̂, k̂, v̂ into the
    buffers the chunk pass later overwrites with q⊙exp(Γ), k⊙exp(Γ_C - Γ) and U."""
    wait_for_producers(PDL)
    NB: tl.constexpr = C // RB
    cid = tl.program_id(0) // NB
    blk = tl.program_id(0) % NB
    h = tl.program_id(1)
    P = H * K
    DT = qn_ptr.dtype.element_ty
    j, start, length, n_chunks, first = request_chunks(cu_ptr, B, C, BP)
    req, in_range = chunk_request(cid, first, n_chunks, B)
    slot = tl.load(slots_ptr + req)
    s = pick(j, req, start)
    L = pick(j, req, length)
    pb = (cid - pick(j, req, first)) * C + blk * RB     # position of the block's first row
    if in_range & (slot >= 0) & (pb < L):
        conv_row = conv_ptr + slot * (W - 1) * 3 * P
        offs = tl.arange(0, K)
        ch = h * K + offs
        rows = tl.arange(0, RB)
        rv = pb + rows < L
        tb = (s + pb).to(tl.int64)                      # token of the block's first row
        tok0 = tb - (W - 1)
        if pb >= W - 1:         # every tap is a token of the request: one load a tap, no window
            q = conv_silu_tokens(q_ptr, conv_w_ptr, tok0, rows, rv, ch, ch, P, W)
            k = conv_silu_tokens(k_ptr, conv_w_ptr, tok0, rows, rv, ch, P + ch, P, W)
            v = conv_silu_tokens(v_ptr, conv_w_ptr, tok0, rows, rv, ch, 2 * P + ch, P, W)
        else:
            q = conv_silu_rows(q_ptr, conv_row, conv_w_ptr, pb, tok0, rows, rv, ch, ch, True, P, W)
            k = conv_silu_rows(k_ptr, conv_row, conv_w_ptr, pb, tok0, rows, rv, ch, P + ch, True,
                               P, W)
            v = conv_silu_rows(v_ptr, conv_row, conv_w_ptr, pb, tok0, rows, rv, ch, 2 * P + ch,
                               True, P, W)
        q = q * tl.rsqrt(tl.sum(q * q, axis=1) + L2_EPS)[:, None] * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=1) + L2_EPS)[:, None]
        rk = (tb * H + h) * K + (rows[:, None] * (H * K) + offs[None, :])
        tl.store(qn_ptr + rk, q.to(DT), mask=rv[:, None])
        tl.store(kn_ptr + rk, k.to(DT), mask=rv[:, None])
        tl.store(vc_ptr + rk, v.to(DT), mask=rv[:, None])


@triton.jit
def kda_chunk_kernel(f_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, slots_ptr, cu_ptr,
                      qg_ptr, kg_ptr, w_ptr, u_ptr, aqk_ptr, ge_ptr,
                      B, H, lower_bound,
                      C: tl.constexpr, BC: tl.constexpr, K: tl.constexpr,
                      BP: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr, SAFE_DIAG: tl.constexpr,
                      PREC: tl.constexpr, INV_PREC: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    cid = tl.program_id(0)
    h = tl.program_id(1)
    P = H * K
    NB: tl.constexpr = C // BC
    DT = qg_ptr.dtype.element_ty
    j, start, length, n_chunks, first = request_chunks(cu_ptr, B, C, BP)
    req, in_range = chunk_request(cid, first, n_chunks, B)
    slot = tl.load(slots_ptr + req)
    if in_range & (slot >= 0):
        s = pick(j, req, start)
        L = pick(j, req, length)
        c0 = (cid - pick(j, req, first)) * C          # first position of this chunk
        offs = tl.arange(0, K)
        ch = h * K + offs
        rows = tl.arange(0, BC)
        a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + ch).to(tl.float32)
        lower = rows[:, None] > rows[None, :]
        causal = rows[:, None] >= rows[None, :]
        # scalar int64 bases per block + these small int32 tile offsets (few address registers)
        rk = rows[:, None] * (H * K) + offs[None, :]        # [BC, K] tile of a [T, H, K] buffer
        rc = rows[:, None] * (H * C) + rows[None, :]        # [BC, BC] tile of [T, H, C] (aqk)
        t_chunk = (s + c0).to(tl.int64)                      # token of the chunk's first row

        g_b = tl.zeros([K], dtype=tl.float32)          # Γ at the end of the previous block
        for I in range(NB):
            pb = c0 + I * BC                             # position of the block's first row
            rv = pb + rows < L
            tb = t_chunk + I * BC                        # its token
            blk_k = (tb * H + h) * K                     # block base in [T, H, K] scratch
            blk_c = (tb * H + h) * C                     # ... and in [T, H, C]
            # the conv pass's q̂, k̂, v̂, read before this block's outputs overwrite them
            q = tl.load(qg_ptr + blk_k + rk, mask=rv[:, None], other=0.0).to(tl.float32)
            k = tl.load(kg_ptr + blk_k + rk, mask=rv[:, None], other=0.0).to(tl.float32)
            v = tl.load(u_ptr + blk_k + rk, mask=rv[:, None], other=0.0).to(tl.float32)
            f = tl.load(f_ptr + tb * P + (rows[:, None] * P + ch[None, :]), mask=rv[:, None],
                        other=0.0)
            g = tl.where(rv[:, None], kda_gate_math(f.to(tl.float32), dt_bias[None, :], a,
                                                    lower_bound, HAS_LOWER_BOUND), 0.0)
            beta = tl.sigmoid(tl.load(beta_ptr + tb * H + (rows * H + h), mask=rv,
                                      other=0.0).to(tl.float32))
            beta = tl.where(rv, beta, 0.0)
            G = g_b[None, :] + tl.cumsum(g, axis=0)      # Γ (from the chunk start) [BC, K]
            g_e = g_b + tl.sum(g, axis=0)                # Γ at the end of this block

            e_g = tl.exp(G)
            to_end = tl.exp(g_e[None, :] - G)            # e^(Γ_e - Γ) ≤ 1
            tl.debug_barrier()                           # every thread has read q̂, k̂, v̂
            tl.store(qg_ptr + blk_k + rk, (q * e_g).to(DT), mask=rv[:, None])
            tl.store(kg_ptr + blk_k + rk, (k * to_end).to(DT), mask=rv[:, None])
            tl.store(ge_ptr + ((cid * NB + I) * H + h) * K + offs, g_e)

            # earlier blocks: both factors relative to the boundary Γ_b (each ≤ 1)
            if NB == 1:
                to_b = e_g                               # Γ_b = 0: the chunk's one block
            else:
                to_b = tl.exp(G - g_b[None, :])
            qb = (q * to_b).to(DT)
            kb = (k * to_b).to(DT)
            rhs_w = beta[:, None] * e_g * k
            rhs_u = beta[:, None] * v
            for J in range(I):
                rvj = c0 + J * BC + rows < L
                blk_kj = ((t_chunk + J * BC) * H + h) * K
                kj = tl.load(kg_ptr + blk_kj + rk, mask=rvj[:, None], other=0.0)
                g_ej = tl.load(ge_ptr + ((cid * NB + J) * H + h) * K + offs)
                kj = (kj.to(tl.float32) * tl.exp(g_b - g_ej)[None, :]).to(DT)
                m_ij = tl.dot(kb, tl.trans(kj), input_precision=PREC) * beta[:, None]
                a_ij = tl.dot(qb, tl.trans(kj), input_precision=PREC)
                tl.store(aqk_ptr + blk_c + J * BC + rc, a_ij.to(DT), mask=rv[:, None])
                w_j = tl.load(w_ptr + blk_kj + rk, mask=rvj[:, None], other=0.0)
                u_j = tl.load(u_ptr + blk_kj + rk, mask=rvj[:, None], other=0.0)
                rhs_w -= tl.dot(m_ij, w_j.to(tl.float32), input_precision=PREC)
                rhs_u -= tl.dot(m_ij, u_j.to(tl.float32), input_precision=PREC)

            # the diagonal block
            if SAFE_DIAG:
                # e^(Γ_i - Γ_j) split at the block's middle row m, each factor within
                # e^(±BC/2·|lower_bound|), from the per-element exps above and two per-column
                # ones: e^(Γ - Γ_m) = to_b·e^(Γ_b - Γ_m), e^(Γ_m - Γ) = to_end·e^(Γ_m - Γ_e)
                g_m = row_of(G, rows, BC // 2)
                up = tl.exp(g_b - g_m)[None, :]
                from_m = (k * to_end * tl.exp(g_m - g_e)[None, :]).to(DT)
                m_ii = tl.dot((k * to_b * up).to(DT), tl.trans(from_m), input_precision=PREC)
                a_ii = tl.dot((q * to_b * up).to(DT), tl.trans(from_m), input_precision=PREC)
            else:
                m_ii = tl.zeros([BC, BC], dtype=tl.float32)
                a_ii = tl.zeros([BC, BC], dtype=tl.float32)
                for c in range(BC):
                    k_c = row_of(k, rows, c)
                    diff = tl.minimum(G - row_of(G, rows, c)[None, :], 0.0)   # ≤ 0 where used
                    decay = tl.where(rows[:, None] >= c, tl.exp(diff), 0.0)
                    kd = k_c[None, :] * decay
                    m_ii = tl.where(rows[None, :] == c, tl.sum(k * kd, axis=1)[:, None], m_ii)
                    a_ii = tl.where(rows[None, :] == c, tl.sum(q * kd, axis=1)[:, None], a_ii)
            m_ii = tl.where(lower, m_ii, 0.0) * beta[:, None]
            a_ii = tl.where(causal, a_ii, 0.0)
            tl.store(aqk_ptr + blk_c + I * BC + rc, a_ii.to(DT), mask=rv[:, None])

            inv = unit_lower_inverse_doubling(m_ii, rows, BC, INV_PREC)
            w_i = tl.dot(inv, rhs_w, input_precision=PREC)
            u_i = tl.dot(inv, rhs_u, input_precision=PREC)
            tl.store(w_ptr + blk_k + rk, w_i.to(DT), mask=rv[:, None])
            tl.store(u_ptr + blk_k + rk, u_i.to(DT), mask=rv[:, None])
            tl.debug_barrier()                           # block I's scratch is read by block I+1
            g_b = g_e

        # keys relative to the chunk end, exp(Γ_C - Γ)⊙k, in place of the per-block ones (a
        # chunk of one block already has them: its block ends where the chunk does)
        if NB > 1:
            for J in range(NB):
                rvj = c0 + J * BC + rows < L
                ptrs = kg_ptr + ((t_chunk + J * BC) * H + h) * K + rk
                g_ej = tl.load(ge_ptr + ((cid * NB + J) * H + h) * K + offs)
                kj = tl.load(ptrs, mask=rvj[:, None], other=0.0).to(tl.float32)
                tl.store(ptrs, (kj * tl.exp(g_b - g_ej)[None, :]).to(DT), mask=rvj[:, None])
