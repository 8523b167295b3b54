"""The one-kernel KDA decode (a comparison kernel; the lowering is k31c/lowering/triton/kda_decode.py).

One launch does the whole layer tail. A program owns one (request, head, tile of BV value
channels): it loads its [K, BV] slice of the fp32 state once, runs the request's R rows one
after another with the slice in registers, and stores it once (plus, with snapshots, after
every row). Per program, for all R rows at once: the depthwise causal conv over the cached
window + SiLU (q, k: all K channels, v: its BV), the q/k L2 norms, gate and beta; then per row
the delta-rule step on its state columns and its columns of o.

The gated RMSNorm needs all V channels of a head, so the V tiles of a (request, head) meet at
the end: each writes its raw o (fp32 scratch) and bumps a per-(request, head) counter; the
program that arrives last (acq_rel atomic; nobody waits, so no deadlock) reads the head's whole
o row, applies the gated norm, writes the output, and writes the new conv window (and the
per-row window snapshots): only then may the old window be overwritten, since every tile read
it. B = 16 x 96 heads x V/BV tiles = 6144 programs at BV = 32.

Slots are read on device (a padding request, slot -1, reads and writes no state and outputs
zeros) and the grid depends only on static shapes, so the launcher is CUDA-graph safe.
Measured slower than the registered three-launch kernels at every tile (BENCHMARKS.md, KDA);
kept so the benchmarks can time it beside them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k31c.lowering.triton.kda_common import L2_EPS, conv_silu_rows, kda_gate_math, row_of, update_windows
from k31c.lowering.triton.kda_decode import check_decode_layout, decode_tile

# (BV, num_warps) for one row and for more per request: the best measured on the H200 at B=16, H=96
FUSED_TILES = ((32, 4), (64, 4))


@triton.jit
def _kda_decode_kernel(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, gate_ptr, out_ptr, o_raw_ptr,
                       count_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr,
                       conv_ptr, state_ptr, slots_ptr, snap_conv_ptr, snap_state_ptr,
                       H, lower_bound, eps, scale,
                       ROWS: tl.constexpr, RB: tl.constexpr, K: tl.constexpr, BV: tl.constexpr,
                       W: tl.constexpr, WB: tl.constexpr,
                       HAS_LOWER_BOUND: tl.constexpr, HAS_SNAP: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vt = tl.program_id(2)
    NV: tl.constexpr = K // BV
    P = H * K
    slot = tl.load(slots_ptr + b)
    live = slot >= 0
    slot = tl.maximum(slot, 0)

    offs = tl.arange(0, K)                     # key channels (K = V)
    offs_v = vt * BV + tl.arange(0, BV)        # this program's value channels
    ch = h * K + offs
    ch_v = h * K + offs_v
    # scalar int64 bases + small int32 tile offsets keep the address registers few
    conv_row = conv_ptr + slot * (W - 1) * 3 * P
    kv = offs[:, None] * K + offs_v[None, :]
    state_head = state_ptr + (slot * H + h) * K * K
    S = tl.load(state_head + kv, mask=live, other=0.0)                 # [K, BV] fp32

    # token-parallel part for all rows at once (one round of loads)
    rr = tl.arange(0, RB)
    rv = rr < ROWS
    row0 = b * ROWS
    rows_p = rr[:, None] * P                                           # row offsets in [N, P]
    row0_64 = row0.to(tl.int64)
    tok0 = row0 - (W - 1)                                              # token of position 0
    q = conv_silu_rows(q_ptr, conv_row, conv_w_ptr, 0, tok0, rr, rv, ch, ch, live, P, W)
    k = conv_silu_rows(k_ptr, conv_row, conv_w_ptr, 0, tok0, rr, rv, ch, P + ch, live, P, W)
    v = conv_silu_rows(v_ptr, conv_row, conv_w_ptr, 0, tok0, rr, rv, ch_v, 2 * P + ch_v, live,
                       P, W)
    q = q * (tl.rsqrt(tl.sum(q * q, axis=1) + L2_EPS) * scale)[:, None]
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + L2_EPS)[:, None]
    f = tl.load(f_ptr + row0_64 * P + (rows_p + ch[None, :]), mask=rv[:, None], other=0.0)
    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + ch).to(tl.float32)
    decay = tl.exp(kda_gate_math(f.to(tl.float32), dt_bias[None, :], a, lower_bound,
                                 HAS_LOWER_BOUND))
    beta = tl.sigmoid(tl.load(beta_ptr + row0_64 * H + (rr * H + h), mask=rv,
                              other=0.0).to(tl.float32))

    o_raw_rows = o_raw_ptr + row0_64 * P
    for r in range(ROWS):
        k_r = row_of(k, rr, r)
        S = S * row_of(decay, rr, r)[:, None]                           # decay the key rows
        pred = tl.sum(S * k_r[:, None], axis=0)                        # S^T k   [BV]
        beta_r = tl.sum(tl.where(rr == r, beta, 0.0), axis=0)
        S = S + k_r[:, None] * (beta_r * (row_of(v, rr, r) - pred))[None, :]
        o = tl.sum(S * row_of(q, rr, r)[:, None], axis=0)               # S^T q   [BV]
        tl.store(o_raw_rows + (r * P + ch_v), o)
        if HAS_SNAP:
            snap_head = snap_state_ptr + ((row0_64 + r) * H + h) * K * K
            tl.store(snap_head + kv, S, mask=live)

    # the last V tile of this (request, head) to finish does the per-head tail; the state store
    # comes after the release so that the release does not wait for it to drain
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + b * H + h, 1, sem="acq_rel", scope="gpu")
    tl.store(state_head + kv, S, mask=live)
    if arrived == NV - 1:
        tl.debug_barrier()
        m2 = rv[:, None]
        tile = rows_p + ch[None, :]
        o = tl.load(o_raw_rows + tile, mask=m2, other=0.0, cache_modifier=".cg")  # via L2
        gate = tl.load(gate_ptr + row0_64 * P + tile, mask=m2, other=0.0)
        norm_w = tl.load(norm_w_ptr + offs).to(tl.float32)
        y = o * tl.rsqrt(tl.sum(o * o, axis=1) / K + eps)[:, None] * norm_w[None, :] \
            * tl.sigmoid(gate.to(tl.float32))
        tl.store(out_ptr + row0_64 * P + tile,
                 tl.where(live, y, 0.0).to(out_ptr.dtype.element_ty), mask=m2)
        update_windows(q_ptr, k_ptr, v_ptr, conv_ptr, conv_row, snap_conv_ptr, row0_64, tok0, ch,
                       live, P, HAS_SNAP, ROWS, W, WB)
        tl.atomic_xchg(count_ptr + b * H + h, 0)                      # ready for the next call


def kda_decode_fused(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                     conv_state, recurrent, slots, rows, lower_bound, eps, snap_conv, snap_state,
                     block_v: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """`k31c::kda_decode` in one launch (same arguments and checks as the registered launcher)."""
    N, H, K, W = check_decode_layout(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias,
                                     o_norm_weight, conv_state, recurrent, slots, rows, snap_conv,
                                     snap_state)
    BV, num_warps = decode_tile(rows, K, block_v, num_warps, FUSED_TILES)
    q, k, v, f, beta, gate = (t.contiguous() for t in (q, k, v, f, beta, gate))
    B = slots.shape[0]
    out = torch.empty_like(q)
    o_raw = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    arrivals = torch.zeros(B * H, device=q.device, dtype=torch.int32)
    has_snap = snap_conv is not None
    _kda_decode_kernel[(B, H, K // BV)](
        q, k, v, f, beta, gate, out, o_raw, arrivals,
        conv_weight.contiguous(), A_log.contiguous(), dt_bias.contiguous(),
        o_norm_weight.contiguous(), conv_state, recurrent, slots,
        snap_conv if has_snap else conv_state, snap_state if has_snap else recurrent,
        H, 0.0 if lower_bound is None else float(lower_bound), float(eps), K ** -0.5,
        ROWS=rows, RB=max(triton.next_power_of_2(rows), 2), K=K, BV=BV, W=W,
        WB=triton.next_power_of_2(max(W - 1, 1)),
        HAS_LOWER_BOUND=lower_bound is not None, HAS_SNAP=has_snap, num_warps=num_warps)
    return out
