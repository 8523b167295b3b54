"""Triton kernel for `k31c::kda_decode` (spec/model.md §4.2-4.7): decode and multi-row verification.

One program owns one (request, head): it loads the head's fp32 state S [K, V] once, runs the
request's R rows one after another with S kept in registers, and stores it once (plus, with
snapshots, after every row). Per row it does the whole layer tail in one place: the depthwise
causal conv over the cached window + SiLU for the head's q, k, v channels, the q/k L2 norms, the
gate and beta activations, the delta-rule step, and the gated RMSNorm of the output.

The gated RMSNorm normalises over all V channels of a head, so V is not split across programs:
a program holds the head's whole [K, V] state. B = 16 requests x 96 heads = 1536 programs.

Slots are read on device (a padding request, slot -1, reads and writes no state and outputs
zeros) and the grid depends only on static shapes, so the launcher is CUDA-graph safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...graph.ops.kda import L2_NORM_EPS, _check_decode
from ..registry import register

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_L2_EPS = tl.constexpr(L2_NORM_EPS)


@triton.jit
def kda_gate_math(f, dt_bias, a, lower_bound, HAS_LOWER_BOUND: tl.constexpr):
    """Per-channel log-decay from the gate input f (fp32, without dt_bias); a = exp(A_log[h])."""
    x = f + dt_bias
    if HAS_LOWER_BOUND:
        g = lower_bound * tl.sigmoid(a * x)
    else:
        # softplus with torch's threshold (x > 20: identity)
        g = -a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    return g


@triton.jit
def window_rows(in_ptr, conv_row_ptr, row0, ext, ch_in, ch_conv, live, mask_ext,
                 P, W: tl.constexpr):
    """Rows `ext` [E] of one request's extended input (cached window ++ new rows) for a channel
    vector: ext < W-1 comes from the conv window, the rest from input row row0 + ext - (W-1).
    Returns [E, C] fp32 (zeros where mask_ext is false)."""
    from_hist = ext < W - 1
    hist = tl.load(conv_row_ptr + ext[:, None] * (3 * P) + ch_conv[None, :],
                   mask=(mask_ext & from_hist & live)[:, None], other=0.0)
    new_row = (row0 + ext - (W - 1)).to(tl.int64)
    new = tl.load(in_ptr + new_row[:, None] * P + ch_in[None, :],
                  mask=(mask_ext & ~from_hist)[:, None], other=0.0)
    return hist.to(tl.float32) + new.to(tl.float32)


@triton.jit
def _conv_silu_row(in_ptr, conv_row_ptr, w_ptr, row0, r, ch_in, ch_conv, live, P,
                   W: tl.constexpr, WP: tl.constexpr):
    """SiLU(causal conv) output of new row r for a channel vector: sum_j w[c, j] * ext[r + j]."""
    j = tl.arange(0, WP)
    x = window_rows(in_ptr, conv_row_ptr, row0, r + j, ch_in, ch_conv, live, j < W, P, W)
    w = tl.load(w_ptr + ch_conv[None, :] * W + j[:, None], mask=(j < W)[:, None], other=0.0)
    y = tl.sum(x * w.to(tl.float32), axis=0)
    return y * tl.sigmoid(y)


@triton.jit
def _copy_window(in_ptr, conv_row_ptr, dst_ptr, row0, first, ch_in, ch_conv, live, P,
                 W: tl.constexpr, WB: tl.constexpr):
    """dst[i, c] = ext[first + i, c] for the W-1 window rows (dst is [W-1, 3P])."""
    i = tl.arange(0, WB)
    rows = window_rows(in_ptr, conv_row_ptr, row0, first + i, ch_in, ch_conv, live,
                        i < W - 1, P, W)
    tl.store(dst_ptr + i[:, None] * (3 * P) + ch_conv[None, :],
             rows.to(dst_ptr.dtype.element_ty), mask=((i < W - 1) & live)[:, None])


@triton.jit
def _kda_decode_kernel(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, gate_ptr, out_ptr,
                       conv_w_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr,
                       conv_ptr, state_ptr, slots_ptr, snap_conv_ptr, snap_state_ptr,
                       H, lower_bound, eps, scale,
                       ROWS: tl.constexpr, K: tl.constexpr, W: tl.constexpr,
                       WP: tl.constexpr, WB: tl.constexpr,
                       HAS_LOWER_BOUND: tl.constexpr, HAS_SNAP: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    P = H * K
    slot = tl.load(slots_ptr + b)
    live = slot >= 0
    slot = tl.maximum(slot, 0)

    offs = tl.arange(0, K)                  # key channels == value channels (K = V)
    ch_q = h * K + offs                     # channel of q, k, v within [P]
    conv_row = conv_ptr + slot * (W - 1) * 3 * P
    state_off = (slot * H + h) * K * K + offs[:, None] * K + offs[None, :]
    S = tl.load(state_ptr + state_off, mask=live, other=0.0)          # [K, V] fp32

    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + ch_q).to(tl.float32)
    norm_w = tl.load(norm_w_ptr + offs).to(tl.float32)
    row0 = b * ROWS
    for r in tl.static_range(ROWS):
        n = (row0 + r).to(tl.int64)
        q = _conv_silu_row(q_ptr, conv_row, conv_w_ptr, row0, r, ch_q, ch_q, live, P, W, WP)
        k = _conv_silu_row(k_ptr, conv_row, conv_w_ptr, row0, r, ch_q, P + ch_q, live, P, W, WP)
        v = _conv_silu_row(v_ptr, conv_row, conv_w_ptr, row0, r, ch_q, 2 * P + ch_q, live, P, W, WP)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + _L2_EPS) * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + _L2_EPS)
        f = tl.load(f_ptr + n * P + ch_q).to(tl.float32)
        g = kda_gate_math(f, dt_bias, a, lower_bound, HAS_LOWER_BOUND)
        beta = tl.sigmoid(tl.load(beta_ptr + n * H + h).to(tl.float32))

        # delta rule: decay the key rows, then correct towards v along k
        S = S * tl.exp(g)[:, None]
        pred = tl.sum(S * k[:, None], axis=0)                          # S^T k   [V]
        S = S + k[:, None] * (beta * (v - pred))[None, :]
        o = tl.sum(S * q[:, None], axis=0)                             # S^T q   [V]

        gate = tl.load(gate_ptr + n * P + ch_q).to(tl.float32)
        o = o * tl.rsqrt(tl.sum(o * o, axis=0) / K + eps) * norm_w * tl.sigmoid(gate)
        tl.store(out_ptr + n * P + ch_q, tl.where(live, o, 0.0).to(out_ptr.dtype.element_ty))

        if HAS_SNAP:
            snap = (b * ROWS + r).to(tl.int64)
            tl.store(snap_state_ptr + (snap * H + h) * K * K + offs[:, None] * K + offs[None, :],
                     S, mask=live)
            snap_conv = snap_conv_ptr + snap * (W - 1) * 3 * P
            _copy_window(q_ptr, conv_row, snap_conv, row0, r + 1, ch_q, ch_q, live, P, W, WB)
            _copy_window(k_ptr, conv_row, snap_conv, row0, r + 1, ch_q, P + ch_q, live, P, W, WB)
            _copy_window(v_ptr, conv_row, snap_conv, row0, r + 1, ch_q, 2 * P + ch_q, live, P, W, WB)

    tl.store(state_ptr + state_off, S, mask=live)
    # The new window may still contain old window rows (ROWS < W-1): every thread must have read
    # the old window before any thread overwrites it.
    i = tl.arange(0, WB)
    win_q = window_rows(q_ptr, conv_row, row0, ROWS + i, ch_q, ch_q, live, i < W - 1, P, W)
    win_k = window_rows(k_ptr, conv_row, row0, ROWS + i, ch_q, P + ch_q, live, i < W - 1, P, W)
    win_v = window_rows(v_ptr, conv_row, row0, ROWS + i, ch_q, 2 * P + ch_q, live, i < W - 1, P, W)
    tl.debug_barrier()
    win_mask = ((i < W - 1) & live)[:, None]
    dst = conv_row + i[:, None] * (3 * P) + ch_q[None, :]
    tl.store(dst, win_q.to(conv_ptr.dtype.element_ty), mask=win_mask)
    tl.store(dst + P, win_k.to(conv_ptr.dtype.element_ty), mask=win_mask)
    tl.store(dst + 2 * P, win_v.to(conv_ptr.dtype.element_ty), mask=win_mask)


@register("k31c::kda_decode", ("h200", "mi350x"))
def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
               beta: torch.Tensor, gate: torch.Tensor, conv_weight: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, o_norm_weight: torch.Tensor,
               conv_state: torch.Tensor, recurrent: torch.Tensor, slots: torch.Tensor, rows: int,
               lower_bound: float | None, eps: float, snap_conv: torch.Tensor | None,
               snap_state: torch.Tensor | None) -> torch.Tensor:
    """Launcher with the op's signature."""
    return launch_kda_decode(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                             conv_state, recurrent, slots, rows, lower_bound, eps, snap_conv,
                             snap_state)


def launch_kda_decode(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                      conv_state, recurrent, slots, rows, lower_bound, eps, snap_conv, snap_state,
                      num_warps: int = 8) -> torch.Tensor:
    """The launch itself, with the tuning knob exposed for benchmarks (8 warps: state 64 regs/thread)."""
    N, H, K, W = _check_decode(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                               conv_state, recurrent, slots, rows, snap_conv, snap_state)
    check_kda_layout(q, K, conv_state, recurrent)
    if snap_conv is not None and not (snap_conv.is_contiguous() and snap_state.is_contiguous()):
        raise ValueError("snap_conv, snap_state: expected contiguous buffers (written in place)")
    B = slots.shape[0]
    q, k, v, f, beta, gate = (t.contiguous() for t in (q, k, v, f, beta, gate))
    out = torch.empty_like(q)
    has_snap = snap_conv is not None
    _kda_decode_kernel[(B, H)](
        q, k, v, f, beta, gate, out,
        conv_weight.contiguous(), A_log.contiguous(), dt_bias.contiguous(),
        o_norm_weight.contiguous(), conv_state, recurrent, slots,
        snap_conv if has_snap else conv_state, snap_state if has_snap else recurrent,
        H, 0.0 if lower_bound is None else float(lower_bound), float(eps), K ** -0.5,
        ROWS=rows, K=K, W=W, WP=triton.next_power_of_2(W), WB=triton.next_power_of_2(max(W - 1, 1)),
        HAS_LOWER_BOUND=lower_bound is not None, HAS_SNAP=has_snap, num_warps=num_warps)
    return out


def check_kda_layout(q: torch.Tensor, K: int, conv_state: torch.Tensor,
                     recurrent: torch.Tensor) -> None:
    """What the KDA kernels need beyond the op's own checks (shared with kda_prefill)."""
    if q.dtype not in _FLOATS:
        raise ValueError(f"q: expected one of {_FLOATS}, got {q.dtype}")
    if K < 16 or K & (K - 1):
        raise ValueError(f"o_norm_weight: the head dim K={K} must be a power of two >= 16")
    for name, t in (("conv_state", conv_state), ("recurrent", recurrent)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor (updated in place)")
