"""Triton kernels for `k31c::kda_decode` (spec/model.md §4.2-4.7): prep, a lean state pass, norm;
the launch plan and the launcher are in kda_decode.py.

Decode is state-traffic bound (B=16, H=96: 100.7 MB of fp32 state read and written per step;
activations and windows ~2-10 MB), so the time is roughly (state bytes per SM / state bytes
resident per SM) x program lifetime: the state pass is kept lean, with nothing on a program's
latency chain but its [K, BV] state slice and the R delta-rule steps. The forms that merge the
prep into the state programs were measured slower at every tile (BENCHMARKS.md, KDA decode).

Three launches, all with grids from static shapes (CUDA-graph safe; slots read on device):
  1. prep, one program per (request, head): conv + SiLU over the cached window for the R rows,
     q/k L2 norms (q pre-scaled), decay exp(g), sigmoid(beta) -> fp32 scratch [N, P] / [N, H];
     then the per-row window snapshots and the new window (it is the window's only reader, so
     no cross-program hazard).
  2. state, one program per (request, head, V tile), flat grid with the V tile fastest (as fla's
     fused_recurrent_kda): slot -> [K, BV] state slice, R delta-rule steps on it with the rows'
     vectors loaded up front (independent of the state), raw o per row, per-row state snapshots,
     final state. With BV = K a program owns the whole head and applies the gated norm itself.
     On sm_90, when its grid fits the SMs (one request at R = 1: `DecodePlan.pairs`), it is
     launched as the prep's PDL dependent (device.pair_launch): its programs load their state
     slice while the prep runs and wait for the prep's scratch after.
  3. norm (only when BV < K): the gated RMSNorm over raw o, [N*H, K] rows.
A padding request (slot -1) reads and writes no state; its raw o is forced to 0, so its output
rows come out 0 from the norm.
"""
from __future__ import annotations

import triton
import triton.language as tl

from k31c.lowering.triton.device import let_dependent_start, wait_for_producers
from k31c.lowering.triton.kda_common import (L2_EPS, conv_silu_rows, exp_ftz, gated_rms_norm,
                                             kda_gate_math, sigmoid_ftz, update_windows)


@triton.jit
def _prep_rows(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, conv_row,
               h, H, row0_64, tok0, rr, rv, ch, live, lower_bound, scale,
               K: tl.constexpr, W: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr):
    """A request's R rows of one head, [RB, K] fp32: conv + SiLU over the cached window, q/k L2
    norms (q pre-scaled), v, decay exp(g); and sigmoid(beta) [RB]."""
    P = H * K
    q = conv_silu_rows(q_ptr, conv_row, conv_w_ptr, 0, tok0, rr, rv, ch, ch, live, P, W)
    k = conv_silu_rows(k_ptr, conv_row, conv_w_ptr, 0, tok0, rr, rv, ch, P + ch, live, P, W)
    v = conv_silu_rows(v_ptr, conv_row, conv_w_ptr, 0, tok0, rr, rv, ch, 2 * P + ch, live, P, W)
    q = q * (tl.rsqrt(tl.sum(q * q, axis=1) + L2_EPS) * scale)[:, None]
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + L2_EPS)[:, None]
    f = tl.load(f_ptr + row0_64 * P + (rr[:, None] * P + ch[None, :]), mask=rv[:, None],
                other=0.0).to(tl.float32)
    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + ch).to(tl.float32)
    decay = exp_ftz(kda_gate_math(f, dt_bias[None, :], a, lower_bound, HAS_LOWER_BOUND))
    beta = sigmoid_ftz(tl.load(beta_ptr + row0_64 * H + (rr * H + h), mask=rv,
                               other=0.0).to(tl.float32))
    return q, k, v, decay, beta


@triton.jit
def kda_decode_prep_kernel(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, conv_w_ptr, a_log_ptr,
                           dt_bias_ptr, conv_ptr, slots_ptr, snap_conv_ptr, qs_ptr, ks_ptr, vs_ptr,
                           ds_ptr, bs_ptr, H, lower_bound, scale,
                           ROWS: tl.constexpr, RB: tl.constexpr, K: tl.constexpr, W: tl.constexpr,
                           WB: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
                           HAS_SNAP: tl.constexpr, PDL: tl.constexpr = False,
                           DEPENDENT: tl.constexpr = False):
    wait_for_producers(PDL)
    let_dependent_start(PDL, DEPENDENT)      # the state pass may load its state meanwhile
    b = tl.program_id(0)
    h = tl.program_id(1)
    P = H * K
    slot = tl.load(slots_ptr + b)
    live = slot >= 0
    slot = tl.maximum(slot, 0)
    ch = h * K + tl.arange(0, K)
    conv_row = conv_ptr + slot * (W - 1) * 3 * P
    rr = tl.arange(0, RB)
    rv = rr < ROWS
    row0_64 = (b * ROWS).to(tl.int64)
    tok0 = b * ROWS - (W - 1)                                          # token of position 0
    q, k, v, decay, beta = _prep_rows(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, conv_w_ptr, a_log_ptr,
                                      dt_bias_ptr, conv_row, h, H, row0_64, tok0, rr, rv, ch, live,
                                      lower_bound, scale, K, W, HAS_LOWER_BOUND)
    base = row0_64 * P + (rr[:, None] * P + ch[None, :])
    m2 = rv[:, None]
    tl.store(qs_ptr + base, q, mask=m2)
    tl.store(ks_ptr + base, k, mask=m2)
    tl.store(vs_ptr + base, v, mask=m2)
    tl.store(ds_ptr + base, decay, mask=m2)
    tl.store(bs_ptr + row0_64 * H + (rr * H + h), beta, mask=rv)
    update_windows(q_ptr, k_ptr, v_ptr, conv_ptr, conv_row, snap_conv_ptr, row0_64, tok0, ch, live,
                   P, HAS_SNAP, ROWS, W, WB)


@triton.jit
def _delta_row(S, q_r, k_r, d_r, v_r, beta_r, live):
    """One delta-rule row on a [K, BV] state slice: (the new slice, its o = S^T q [BV])."""
    S = S * d_r[:, None]                                               # decay the key rows
    pred = tl.sum(S * k_r[:, None], axis=0)                            # S^T k   [BV]
    S = S + k_r[:, None] * (beta_r * (v_r - pred))[None, :]
    return S, tl.where(live, tl.sum(S * q_r[:, None], axis=0), 0.0)


@triton.jit
def _emit_row(S, o, r, row0_64, h, H, live, offs_v, kv, o_ptr, gate_ptr, norm_w_ptr, snap_state_ptr,
              eps, K: tl.constexpr, HAS_SNAP: tl.constexpr, FUSE_NORM: tl.constexpr):
    """Row r's o (raw, or gated-normed with FUSE_NORM: the whole head is here) and snapshot."""
    base = (row0_64 + r) * (H * K) + h * K
    if FUSE_NORM:
        gate = tl.load(gate_ptr + base + offs_v).to(tl.float32)
        norm_w = tl.load(norm_w_ptr + offs_v).to(tl.float32)
        y = o * tl.rsqrt(tl.sum(o * o, axis=0) / K + eps) * norm_w * sigmoid_ftz(gate)
        y = tl.where(live, y, 0.0)                 # a padding row's gate may hold anything
        tl.store(o_ptr + base + offs_v, y.to(o_ptr.dtype.element_ty))
    else:
        tl.store(o_ptr + base + offs_v, o)
    if HAS_SNAP:
        snap_head = snap_state_ptr + ((row0_64 + r) * H + h) * K * K
        tl.store(snap_head + kv, S, mask=live)


@triton.jit
def _state_row(S, r, row0_64, h, H, live, offs, offs_v, kv, qs_ptr, ks_ptr, vs_ptr, ds_ptr,
               bs_ptr, o_ptr, gate_ptr, norm_w_ptr, snap_state_ptr, eps,
               K: tl.constexpr, HAS_SNAP: tl.constexpr, FUSE_NORM: tl.constexpr):
    """One row of the state pass, its vectors read from the prep launch's scratch."""
    base = (row0_64 + r) * (H * K) + h * K
    S, o = _delta_row(S, tl.load(qs_ptr + base + offs), tl.load(ks_ptr + base + offs),
                      tl.load(ds_ptr + base + offs), tl.load(vs_ptr + base + offs_v),
                      tl.load(bs_ptr + (row0_64 + r) * H + h), live)
    _emit_row(S, o, r, row0_64, h, H, live, offs_v, kv, o_ptr, gate_ptr, norm_w_ptr, snap_state_ptr,
              eps, K, HAS_SNAP, FUSE_NORM)
    return S


@triton.jit
def _state_slice(slots_ptr, state_ptr, H, K: tl.constexpr, BV: tl.constexpr):
    """A state program's (request, head, V tile) from its flat id (the V tile fastest), its slot
    (a padding request's -1 read as slot 0, `live` false) and its [K, BV] fp32 state slice."""
    NV: tl.constexpr = K // BV
    pid = tl.program_id(0)
    vt = pid % NV
    bh = pid // NV
    b = bh // H
    h = bh % H
    slot = tl.load(slots_ptr + b)
    live = slot >= 0
    slot = tl.maximum(slot, 0)
    offs = tl.arange(0, K)
    offs_v = vt * BV + tl.arange(0, BV)
    kv = offs[:, None] * K + offs_v[None, :]
    state_head = state_ptr + (slot * H + h) * K * K
    # read once and written once a step: first out of L2 (the rows' vectors, read by every V
    # tile of a head, stay)
    S = tl.load(state_head + kv, mask=live, other=0.0, eviction_policy="evict_first")
    return b, h, slot, live, offs, offs_v, kv, state_head, S


@triton.jit
def kda_decode_state_kernel(qs_ptr, ks_ptr, vs_ptr, ds_ptr, bs_ptr, o_ptr, gate_ptr, norm_w_ptr,
                            state_ptr, slots_ptr, snap_state_ptr, H, eps,
                            ROWS: tl.constexpr, K: tl.constexpr, BV: tl.constexpr,
                            HAS_SNAP: tl.constexpr, FUSE_NORM: tl.constexpr, UNROLL: tl.constexpr,
                            PDL: tl.constexpr = False, STATE_FIRST: tl.constexpr = False):
    """STATE_FIRST (launched as the prep's PDL dependent): the slots and the state slice, written
    before the prep ran, are loaded before the wait for the prep's scratch."""
    if not STATE_FIRST:
        wait_for_producers(PDL)
    b, h, slot, live, offs, offs_v, kv, state_head, S = _state_slice(slots_ptr, state_ptr, H, K, BV)
    if STATE_FIRST:
        wait_for_producers(PDL)
    row0_64 = (b * ROWS).to(tl.int64)
    if UNROLL:
        # the rows' vector loads do not depend on the state: all can issue up front (registers)
        for r in tl.static_range(ROWS):
            S = _state_row(S, r, row0_64, h, H, live, offs, offs_v, kv, qs_ptr, ks_ptr, vs_ptr,
                           ds_ptr, bs_ptr, o_ptr, gate_ptr, norm_w_ptr, snap_state_ptr, eps,
                           K, HAS_SNAP, FUSE_NORM)
    else:
        for r in range(ROWS):
            S = _state_row(S, r, row0_64, h, H, live, offs, offs_v, kv, qs_ptr, ks_ptr, vs_ptr,
                           ds_ptr, bs_ptr, o_ptr, gate_ptr, norm_w_ptr, snap_state_ptr, eps,
                           K, HAS_SNAP, FUSE_NORM)
    tl.store(state_head + kv, S, mask=live, cache_modifier=".cs")


@triton.jit
def kda_decode_norm_kernel(o_ptr, gate_ptr, norm_w_ptr, slots_ptr, out_ptr, n_rows, H, eps,
                           ROWS: tl.constexpr, K: tl.constexpr, BR: tl.constexpr,
                           PDL: tl.constexpr = False):
    """Gated RMSNorm of raw o viewed as [N*H, K] rows (one head of one token per row); rows of a
    padding request (slot -1) come out 0 whatever their gate holds."""
    wait_for_producers(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    offs = tl.arange(0, K)
    in_range = rows < n_rows
    m = in_range[:, None]
    live = tl.load(slots_ptr + rows // H // ROWS, mask=in_range, other=-1) >= 0
    tile = rows.to(tl.int64)[:, None] * K + offs[None, :]
    o = tl.load(o_ptr + tile, mask=m, other=0.0)
    gate = tl.load(gate_ptr + tile, mask=m, other=0.0)
    norm_w = tl.load(norm_w_ptr + offs).to(tl.float32)
    y = gated_rms_norm(o, gate, norm_w, K, eps)
    y = tl.where(live[:, None], y, 0.0)
    tl.store(out_ptr + tile, y.to(out_ptr.dtype.element_ty), mask=m)
