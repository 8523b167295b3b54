"""What the KDA kernels share (kda_decode.py, kda_prefill.py; spec/model.md §4.2-4.7): the gate's
log-decay, the causal conv + SiLU over a request's cached window and new rows, the conv-window
update with its per-row snapshots, and the layout checks beyond the ops' own. Inlined into each
kernel by Triton; no kernels or launchers here."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k31c.graph.ops.kda import L2_NORM_EPS

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
L2_EPS = tl.constexpr(L2_NORM_EPS)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def exp_ftz(x):
    """e^x as 2^(x log2 e): Triton lowers exp2 to PTX ex2.approx.ftz (one MUFU op) but exp to the
    non-ftz form, which adds a denormal-range fixup (a compare, two multiplies) per value. Only
    results below 2^-126 differ: they flush to 0."""
    return tl.exp2(x * LOG2E)


@triton.jit
def sigmoid_ftz(x):
    """1 / (1 + e^-x) through exp_ftz (tl.sigmoid uses the non-ftz exp)."""
    return 1.0 / (1.0 + tl.exp2(x * -LOG2E))


@triton.jit
def gated_rms_norm(o, gate, norm_w, K: tl.constexpr, eps):
    """The output's gated RMSNorm over rows of K values: o·rsqrt(mean(o²) + eps)·w·σ(gate)."""
    return o * tl.rsqrt(tl.sum(o * o, axis=1) / K + eps)[:, None] * norm_w[None, :] \
        * sigmoid_ftz(gate.to(tl.float32))


@triton.jit
def kda_gate_math(f, dt_bias, a, lower_bound, HAS_LOWER_BOUND: tl.constexpr):
    """Per-channel log-decay from the gate input f (fp32, without dt_bias); a = exp(A_log[h])."""
    x = f + dt_bias
    if HAS_LOWER_BOUND:
        g = lower_bound * sigmoid_ftz(a * x)
    else:
        # softplus with torch's threshold (x > 20: identity)
        g = -a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    return g


@triton.jit
def window_rows(in_ptr, conv_row_ptr, pos0, tok0, rel, ch_in, ch_conv, live, mask_rel, P,
                W: tl.constexpr):
    """ext[pos0 + rel] for a channel vector, [E, C] fp32 (0 where mask_rel is false).

    ext is one request's cached window (positions < W-1, conv_row_ptr) followed by its new
    rows; tok0 is the token index that position pos0 would have (request start + pos0 - (W-1),
    possibly negative). Addresses are a scalar base plus small int32 offsets (few registers).
    Where the window and the inputs share a dtype, each element is one load from the address
    its row selects (not two masked loads and an add)."""
    ext = pos0 + rel
    from_hist = ext < W - 1
    hist_row = tl.where(from_hist, ext, 0)
    hist_ptrs = conv_row_ptr + (hist_row[:, None] * (3 * P) + ch_conv[None, :])
    new_ptrs = in_ptr + tok0.to(tl.int64) * P + (rel[:, None] * P + ch_in[None, :])
    if in_ptr.dtype.element_ty == conv_row_ptr.dtype.element_ty:
        return tl.load(tl.where(from_hist[:, None], hist_ptrs, new_ptrs),
                       mask=(mask_rel & (live | ~from_hist))[:, None], other=0.0).to(tl.float32)
    else:
        hist = tl.load(hist_ptrs, mask=(mask_rel & from_hist & live)[:, None], other=0.0)
        new = tl.load(new_ptrs, mask=(mask_rel & ~from_hist)[:, None], other=0.0)
        return hist.to(tl.float32) + new.to(tl.float32)


@triton.jit
def conv_silu_rows(in_ptr, conv_row, w_ptr, pos0, tok0, rel, rv, ch_in, ch_conv, live, P,
                   W: tl.constexpr):
    """SiLU(causal conv) of the new rows at positions pos0 + rel [M] (rv valid; tok0 as in
    window_rows) for a channel vector: y[p, c] = sum_j w[c, j] * ext[p + j, c]. [M, C] fp32."""
    acc = tl.zeros([rel.shape[0], ch_in.shape[0]], dtype=tl.float32)
    for j in tl.static_range(W):
        x = window_rows(in_ptr, conv_row, pos0, tok0, rel + j, ch_in, ch_conv, live, rv, P, W)
        acc += x * tl.load(w_ptr + ch_conv * W + j).to(tl.float32)[None, :]
    return acc * sigmoid_ftz(acc)


@triton.jit
def conv_silu_tokens(in_ptr, w_ptr, tok0, rel, rv, ch_in, ch_conv, P, W: tl.constexpr):
    """conv_silu_rows where no tap reaches the cached window (pos0 >= W - 1): each tap one
    masked load of the request's own rows, tok0 + rel + j."""
    acc = tl.zeros([rel.shape[0], ch_in.shape[0]], dtype=tl.float32)
    base = in_ptr + tok0.to(tl.int64) * P
    for j in tl.static_range(W):
        x = tl.load(base + ((rel + j)[:, None] * P + ch_in[None, :]), mask=rv[:, None], other=0.0)
        acc += x.to(tl.float32) * tl.load(w_ptr + ch_conv * W + j).to(tl.float32)[None, :]
    return acc * sigmoid_ftz(acc)


@triton.jit
def copy_window(in_ptr, conv_row_ptr, dst_ptr, pos0, tok0, ch_in, ch_conv, live, P,
                 W: tl.constexpr, WB: tl.constexpr):
    """dst[i, c] = ext[pos0 + i, c] for the W-1 window rows (dst is [W-1, 3P])."""
    i = tl.arange(0, WB)
    rows = window_rows(in_ptr, conv_row_ptr, pos0, tok0, i, ch_in, ch_conv, live, i < W - 1, P, W)
    tl.store(dst_ptr + (i[:, None] * (3 * P) + ch_conv[None, :]),
             rows.to(dst_ptr.dtype.element_ty), mask=((i < W - 1) & live)[:, None])


@triton.jit
def update_windows(q_ptr, k_ptr, v_ptr, conv_ptr, conv_row, snap_conv_ptr, row0_64, tok0, ch, live,
                   P, HAS_SNAP: tl.constexpr, ROWS: tl.constexpr, W: tl.constexpr,
                   WB: tl.constexpr):
    """The conv windows of channels ch after the request's ROWS rows: per-row snapshots (when
    HAS_SNAP) and the new window in place. The new window may still hold old window rows
    (ROWS < W-1), so every thread reads the old window before any thread overwrites it."""
    if HAS_SNAP:
        for r in range(ROWS):
            snap_conv = snap_conv_ptr + (row0_64 + r) * (W - 1) * 3 * P
            tok = tok0 + r + 1
            copy_window(q_ptr, conv_row, snap_conv, r + 1, tok, ch, ch, live, P, W, WB)
            copy_window(k_ptr, conv_row, snap_conv, r + 1, tok, ch, P + ch, live, P, W, WB)
            copy_window(v_ptr, conv_row, snap_conv, r + 1, tok, ch, 2 * P + ch, live, P, W, WB)
    i = tl.arange(0, WB)
    wm = i < W - 1
    tok = tok0 + ROWS
    win_q = window_rows(q_ptr, conv_row, ROWS, tok, i, ch, ch, live, wm, P, W)
    win_k = window_rows(k_ptr, conv_row, ROWS, tok, i, ch, P + ch, live, wm, P, W)
    win_v = window_rows(v_ptr, conv_row, ROWS, tok, i, ch, 2 * P + ch, live, wm, P, W)
    tl.debug_barrier()
    win_mask = (wm & live)[:, None]
    dst = conv_row + (i[:, None] * (3 * P) + ch[None, :])
    tl.store(dst, win_q.to(conv_ptr.dtype.element_ty), mask=win_mask)
    tl.store(dst + P, win_k.to(conv_ptr.dtype.element_ty), mask=win_mask)
    tl.store(dst + 2 * P, win_v.to(conv_ptr.dtype.element_ty), mask=win_mask)


@triton.jit
def row_of(x, rows, r):
    """Row r of a 2-D tile as a vector (rows = arange over dim 0)."""
    return tl.sum(tl.where(rows[:, None] == r, x, 0.0), axis=0)


def check_kda_layout(q: torch.Tensor, K: int, conv_state: torch.Tensor,
                     recurrent: torch.Tensor) -> None:
    """What the KDA kernels need beyond the ops' own checks (check_decode / check_prefill)."""
    if q.dtype not in FLOATS:
        raise ValueError(f"q: expected one of {FLOATS}, got {q.dtype}")
    if K < 16 or K & (K - 1):
        raise ValueError(f"o_norm_weight: the head dim K={K} must be a power of two >= 16")
    for name, t in (("conv_state", conv_state), ("recurrent", recurrent)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor (updated in place)")
