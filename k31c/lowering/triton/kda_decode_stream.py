"""`k31c::kda_decode` at one row per request in one launch that streams the state (a variant to
measure against kda_decode.py's prep + state pass; not registered).

Why: the state pass holds its whole [K, BV] state slice in registers, so an SM keeps ~128 KB of
state in flight whatever the tile, and the prep (conv, norms, gates: ~7.6 us at B = 16) runs as
a launch of its own before it; every way of hiding it there lost (BENCHMARKS.md, KDA decode).
Here one program per (request, head) keeps only a [KB, K] block of its state at a time:

  pass 1, over the key rows in blocks: the block's raw conv outputs q~, k~ and decay d (made
    from the token and the cached window, no scratch), and one product
    [d·k~; d·q~] @ S_blk accumulating S^T(d·k~) and S^T(d·q~), plus |k~|², |q~|², k~·q~;
  then pred = S^T(d·k~)/|k~|, u = sigmoid(beta)·(v - pred), o = S^T(d·q~)·s/|q~| + (k·q) u
    (the delta rule of spec/model.md §4.5 with the L2 norms applied after the sums), the gated
    RMSNorm of o;
  pass 2, over the same blocks (re-read, from L2 while the program's own pass 1 is recent;
    software-pipelined too):
    S' = d·S + k u^T, stored; then the conv window update.

Pass 1's product is a tl.dot (two live rows of a 16-row operand; `dot=False`: FMA reductions);
either way Triton 3.7's sm_90a build streams the state blocks through shared memory (cp.async,
`stages` deep) while the program's prep loads are in flight. With few registers a program, many
programs share an SM and hide each other's prep.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k31c.lowering.triton.device import target_of
from k31c.lowering.triton.kda_common import (L2_EPS, conv_silu_rows, gated_rms_norm, kda_gate_math,
                                             update_windows)
from k31c.lowering.triton.kda_decode import check_decode_layout

KEY_BLOCK = 16      # key rows of the state a step
STAGES = 3          # software-pipeline stages of pass 1's state loads
WARPS = 4


@triton.jit
def _conv_row(in_ptr, conv_row, conv_w_ptr, b, ch_in, ch_conv, live, P, W: tl.constexpr):
    """Conv + SiLU of request b's one row at channels ch_in (ch_conv in the window), [C] fp32."""
    rr = tl.arange(0, 2)           # a 2-row tile, the second masked off
    return tl.sum(conv_silu_rows(in_ptr, conv_row, conv_w_ptr, 0, b - (W - 1), rr, rr < 1, ch_in,
                                 ch_conv, live, P, W), 0)


@triton.jit
def _channel_block(q_ptr, k_ptr, f_ptr, conv_w_ptr, dt_bias_ptr, conv_row, b, chb, live, P,
                   a, lower_bound, W: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr):
    """Raw conv + SiLU outputs q~, k~ and the decay d of one request's row at channels chb [KB]."""
    q = _conv_row(q_ptr, conv_row, conv_w_ptr, b, chb, chb, live, P, W)
    k = _conv_row(k_ptr, conv_row, conv_w_ptr, b, chb, P + chb, live, P, W)
    f = tl.load(f_ptr + b.to(tl.int64) * P + chb).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + chb).to(tl.float32)
    d = tl.exp(kda_gate_math(f, dt_bias, a, lower_bound, HAS_LOWER_BOUND))
    return q, k, d


@triton.jit
def kda_decode_stream_kernel(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, gate_ptr, conv_w_ptr, a_log_ptr,
                             dt_bias_ptr, norm_w_ptr, conv_ptr, state_ptr, slots_ptr, out_ptr,
                             H, lower_bound, scale, eps,
                             K: tl.constexpr, W: tl.constexpr, WB: tl.constexpr, KB: tl.constexpr,
                             HAS_LOWER_BOUND: tl.constexpr, PREC: tl.constexpr,
                             STAGES: tl.constexpr, STAGES_2: tl.constexpr, DOT: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    P = H * K
    slot = tl.load(slots_ptr + b)
    live = slot >= 0
    slot = tl.maximum(slot, 0)
    conv_row = conv_ptr + slot * (W - 1) * 3 * P
    ch = h * K + tl.arange(0, K)
    offs_v = tl.arange(0, K)
    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    state_head = state_ptr + (slot * H + h).to(tl.int64) * K * K
    rows16 = tl.arange(0, 16)
    acc = tl.zeros([16, K], tl.float32)        # DOT: row 0 S^T(d·k~), row 1 S^T(d·q~)
    acc_k = tl.zeros([K], tl.float32)          # else the same two sums, by FMA
    acc_q = tl.zeros([K], tl.float32)
    kk = tl.zeros([KB], tl.float32)
    qq = tl.zeros([KB], tl.float32)
    kq = tl.zeros([KB], tl.float32)
    for kb in tl.range(0, K, KB, num_stages=STAGES):
        rows_k = kb + tl.arange(0, KB)
        S = tl.load(state_head + (rows_k[:, None] * K + offs_v[None, :]), mask=live, other=0.0)
        q, k, d = _channel_block(q_ptr, k_ptr, f_ptr, conv_w_ptr, dt_bias_ptr, conv_row, b,
                                 h * K + rows_k, live, P, a, lower_bound, W, HAS_LOWER_BOUND)
        if DOT:
            lhs = tl.where(rows16[:, None] == 0, (d * k)[None, :],
                           tl.where(rows16[:, None] == 1, (d * q)[None, :], 0.0))
            acc = tl.dot(lhs, S, acc, input_precision=PREC)
        else:
            acc_k += tl.sum(S * (d * k)[:, None], 0)
            acc_q += tl.sum(S * (d * q)[:, None], 0)
        kk += k * k
        qq += q * q
        kq += k * q
    if DOT:
        acc_k = tl.sum(tl.where(rows16[:, None] == 0, acc, 0.0), 0)
        acc_q = tl.sum(tl.where(rows16[:, None] == 1, acc, 0.0), 0)
    inv_k = tl.rsqrt(tl.sum(kk, 0) + L2_EPS)
    inv_q = tl.rsqrt(tl.sum(qq, 0) + L2_EPS) * scale
    v = _conv_row(v_ptr, conv_row, conv_w_ptr, b, ch, 2 * P + ch, live, P, W)
    beta = tl.sigmoid(tl.load(beta_ptr + b * H + h).to(tl.float32))
    pred = acc_k * inv_k
    u = beta * (v - pred)
    kq_normed = tl.sum(kq, 0) * inv_k * inv_q
    o = acc_q * inv_q + kq_normed * u
    base = b.to(tl.int64) * P + h * K
    gate = tl.load(gate_ptr + base + offs_v)
    norm_w = tl.load(norm_w_ptr + offs_v).to(tl.float32)
    y = tl.sum(gated_rms_norm(o[None, :], gate[None, :], norm_w, K, eps), 0)
    y = tl.where(live, y, 0.0)                 # a padding row's gate may hold anything
    tl.store(out_ptr + base + offs_v, y.to(out_ptr.dtype.element_ty))
    for kb in tl.range(0, K, KB, num_stages=STAGES_2):
        rows_k = kb + tl.arange(0, KB)
        kv = rows_k[:, None] * K + offs_v[None, :]
        S = tl.load(state_head + kv, mask=live, other=0.0)
        _, k, d = _channel_block(q_ptr, k_ptr, f_ptr, conv_w_ptr, dt_bias_ptr, conv_row, b,
                                 h * K + rows_k, live, P, a, lower_bound, W, HAS_LOWER_BOUND)
        tl.store(state_head + kv, S * d[:, None] + (k * inv_k)[:, None] * u[None, :], mask=live)
    tl.debug_barrier()          # every thread's window reads (both passes) before the update
    update_windows(q_ptr, k_ptr, v_ptr, conv_ptr, conv_row, conv_ptr, b.to(tl.int64),
                   b - (W - 1), ch, live, P, False, 1, W, WB)


def launch_kda_decode_stream(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                             conv_state, recurrent, slots, rows, lower_bound, eps, snap_conv,
                             snap_state, key_block: int = KEY_BLOCK, stages: int = STAGES,
                             num_warps: int = WARPS, stages_2: int | None = None,
                             dot: bool = True) -> torch.Tensor:
    """The op's signature; one row per request, no per-row snapshots (those calls need the
    registered launcher). stages / stages_2: software-pipeline stages of pass 1 / pass 2's state
    loads (stages_2 None: as pass 1; 1: not pipelined). dot False: pass 1's two sums by FMA
    reductions instead of the tl.dot (Triton then does not stage its loads in shared memory)."""
    N, H, K, W = check_decode_layout(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias,
                                     o_norm_weight, conv_state, recurrent, slots, rows, snap_conv,
                                     snap_state)
    if rows != 1 or snap_conv is not None:
        raise ValueError(f"kda_decode stream form: one row per request and no snapshots, got "
                         f"rows={rows}, snapshots={snap_conv is not None}")
    if key_block < 16 or key_block & (key_block - 1) or K % key_block:
        raise ValueError(f"key_block: expected a power of two >= 16 dividing K={K}, got "
                         f"{key_block}")
    B = slots.shape[0]
    target = target_of(q.device)
    prec = target.exact_dot_precision if q.device.type == "cuda" else "ieee"
    q, k, v, f, beta, gate = (t.contiguous() for t in (q, k, v, f, beta, gate))
    out = torch.empty_like(q)
    lb = 0.0 if lower_bound is None else float(lower_bound)
    kda_decode_stream_kernel[(B * H,)](
        q, k, v, f, beta, gate, conv_weight.contiguous(), A_log.contiguous(), dt_bias.contiguous(),
        o_norm_weight.contiguous(), conv_state, recurrent, slots, out, H, lb, K ** -0.5,
        float(eps),
        K=K, W=W, WB=triton.next_power_of_2(max(W - 1, 1)), KB=key_block,
        HAS_LOWER_BOUND=lower_bound is not None, PREC=prec, STAGES=stages,
        STAGES_2=stages if stages_2 is None else stages_2, DOT=dot, num_warps=num_warps)
    return out
