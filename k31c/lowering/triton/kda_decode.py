"""Triton kernels for `k31c::kda_decode` (spec/model.md §4.2-4.7): prep, a lean state pass, norm.

Decode is state-traffic bound (B=16, H=96: 100.7 MB of fp32 state read and written per step;
activations and windows ~2-10 MB), so the time is roughly (state bytes per SM / state bytes
resident per SM) x program lifetime: the state pass is kept lean, with nothing on a program's
latency chain but its [K, BV] state slice and the R delta-rule steps. A kernel that also runs
the conv, the norms and the gates in every state-tile program, and meets its head's other tiles
through an atomic counter for the gated norm, was measured slower at every tile (110.6 / 213.0
us at R = 1 / 4, BENCHMARKS.md) and removed (git history has it).

Three launches, all with grids from static shapes (CUDA-graph safe; slots read on device):
  1. prep, one program per (request, head): conv + SiLU over the cached window for the R rows,
     q/k L2 norms (q pre-scaled), decay exp(g), sigmoid(beta) -> fp32 scratch [N, P] / [N, H];
     then the per-row window snapshots and the new window (it is the window's only reader, so
     no cross-program hazard).
  2. state, one program per (request, head, V tile), flat grid with the V tile fastest (as fla's
     fused_recurrent_kda): slot -> [K, BV] state slice, R delta-rule steps on it with the rows'
     vectors loaded up front (independent of the state), raw o per row, per-row state snapshots,
     final state. With BV = K a program owns the whole head and applies the gated norm itself.
  3. norm (only when BV < K): the gated RMSNorm over raw o, [N*H, K] rows.
The one-launch form (`one_launch=True`, `_kda_head_kernel`) runs all three in one program per
(request, head), walking the head's [K, BV] state slices in turn: the prep is computed once and
never leaves registers, and only the raw o rows go through (L2-resident) scratch.
A padding request (slot -1) reads and writes no state; its raw o is forced to 0, so its output
rows come out 0 from the norm.

`plan` picks the launch configuration once; the launcher and `aot_specs` both read it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from k31c.graph.ops.kda import check_decode
from k31c.lowering.aot_spec import kernel_spec
from k31c.lowering.registry import register
from k31c.lowering.targets import GPU_TARGETS
from k31c.lowering.triton.kda_common import (L2_EPS, check_kda_layout, conv_silu_rows, gated_rms_norm,
                                             kda_gate_math, update_windows)
from k31c.lowering.triton.unit_stride import require_unit_stride
from k31c.lowering.triton.device import pdl_launch, wait_for_producers

PREP_WARPS = 4            # prep and norm launches: not tuned (small next to the state pass)
NORM_WARPS = 4
NORM_ROWS = 16            # [N*H, K] rows per norm program


@triton.jit
def _prep_rows(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, conv_row,
               h, H, row0_64, tok0, rr, rv, ch, live, lower_bound, scale,
               K: tl.constexpr, W: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
               WITH_V: tl.constexpr = True):
    """A request's R rows of one head, [RB, K] fp32: conv + SiLU over the cached window, q/k L2
    norms (q pre-scaled), v (WITH_V, else 0), decay exp(g); and sigmoid(beta) [RB]."""
    P = H * K
    q = conv_silu_rows(q_ptr, conv_row, conv_w_ptr, 0, tok0, rr, rv, ch, ch, live, P, W)
    k = conv_silu_rows(k_ptr, conv_row, conv_w_ptr, 0, tok0, rr, rv, ch, P + ch, live, P, W)
    v = 0.0
    if WITH_V:
        v = conv_silu_rows(v_ptr, conv_row, conv_w_ptr, 0, tok0, rr, rv, ch, 2 * P + ch, live, P, W)
    q = q * (tl.rsqrt(tl.sum(q * q, axis=1) + L2_EPS) * scale)[:, None]
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + L2_EPS)[:, None]
    f = tl.load(f_ptr + row0_64 * P + (rr[:, None] * P + ch[None, :]), mask=rv[:, None],
                other=0.0).to(tl.float32)
    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + ch).to(tl.float32)
    decay = tl.exp(kda_gate_math(f, dt_bias[None, :], a, lower_bound, HAS_LOWER_BOUND))
    beta = tl.sigmoid(tl.load(beta_ptr + row0_64 * H + (rr * H + h), mask=rv,
                              other=0.0).to(tl.float32))
    return q, k, v, decay, beta


@triton.jit
def _kda_prep_kernel(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr,
                     conv_ptr, slots_ptr, snap_conv_ptr, qs_ptr, ks_ptr, vs_ptr, ds_ptr, bs_ptr,
                     H, lower_bound, scale,
                     ROWS: tl.constexpr, RB: tl.constexpr, K: tl.constexpr, W: tl.constexpr,
                     WB: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr, HAS_SNAP: tl.constexpr,
                     PDL: tl.constexpr = False):
    wait_for_producers(PDL)
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
        y = o * tl.rsqrt(tl.sum(o * o, axis=0) / K + eps) * norm_w * tl.sigmoid(gate)
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
def _kda_state_kernel(qs_ptr, ks_ptr, vs_ptr, ds_ptr, bs_ptr, o_ptr, gate_ptr, norm_w_ptr,
                      state_ptr, slots_ptr, snap_state_ptr, H, eps,
                      ROWS: tl.constexpr, K: tl.constexpr, BV: tl.constexpr,
                      HAS_SNAP: tl.constexpr, FUSE_NORM: tl.constexpr, UNROLL: tl.constexpr,
                      PDL: tl.constexpr = False):
    wait_for_producers(PDL)
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
    S = tl.load(state_head + kv, mask=live, other=0.0)                 # [K, BV] fp32
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
    tl.store(state_head + kv, S, mask=live)


@triton.jit
def _kda_head_kernel(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, gate_ptr, conv_w_ptr, a_log_ptr,
                     dt_bias_ptr, norm_w_ptr, conv_ptr, state_ptr, slots_ptr, o_raw_ptr, out_ptr,
                     snap_conv_ptr, snap_state_ptr, H, lower_bound, scale, eps,
                     ROWS: tl.constexpr, RB: tl.constexpr, K: tl.constexpr, BV: tl.constexpr,
                     W: tl.constexpr, WB: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
                     HAS_SNAP: tl.constexpr, PDL: tl.constexpr = False):
    """The one-launch form, one program per (request, head): the prep's q, k, decay and beta
    once, in registers; the state's [K, BV] slices one after another (v convolved per slice),
    raw o to scratch; then the gated norm of the head's rows and the new windows (the program
    is its windows' only reader)."""
    wait_for_producers(PDL)
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    P = H * K
    slot = tl.load(slots_ptr + b)
    live = slot >= 0
    slot = tl.maximum(slot, 0)
    offs = tl.arange(0, K)
    ch = h * K + offs
    conv_row = conv_ptr + slot * (W - 1) * 3 * P
    rr = tl.arange(0, RB)
    rv = rr < ROWS
    row0_64 = (b * ROWS).to(tl.int64)
    tok0 = b * ROWS - (W - 1)
    q, k, _, decay, beta = _prep_rows(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, conv_w_ptr, a_log_ptr,
                                      dt_bias_ptr, conv_row, h, H, row0_64, tok0, rr, rv, ch, live,
                                      lower_bound, scale, K, W, HAS_LOWER_BOUND, False)
    state_head = state_ptr + (slot * H + h) * K * K
    for vt in tl.static_range(K // BV):
        offs_v = vt * BV + tl.arange(0, BV)
        ch_v = h * K + offs_v
        kv = offs[:, None] * K + offs_v[None, :]
        S = tl.load(state_head + kv, mask=live, other=0.0)             # [K, BV] fp32
        v = conv_silu_rows(v_ptr, conv_row, conv_w_ptr, 0, tok0, rr, rv, ch_v, 2 * P + ch_v, live,
                           P, W)
        for r in tl.static_range(ROWS):
            sel = (rr == r)[:, None]
            S, o = _delta_row(S, tl.sum(tl.where(sel, q, 0.0), axis=0),
                              tl.sum(tl.where(sel, k, 0.0), axis=0),
                              tl.sum(tl.where(sel, decay, 0.0), axis=0),
                              tl.sum(tl.where(sel, v, 0.0), axis=0),
                              tl.sum(tl.where(rr == r, beta, 0.0), axis=0), live)
            _emit_row(S, o, r, row0_64, h, H, live, offs_v, kv, o_raw_ptr, gate_ptr, norm_w_ptr,
                      snap_state_ptr, eps, K, HAS_SNAP, False)
        tl.store(state_head + kv, S, mask=live)
    tl.debug_barrier()                           # the head's raw o rows, written by all threads
    tile = row0_64 * P + (rr[:, None] * P + ch[None, :])
    o = tl.load(o_raw_ptr + tile, mask=rv[:, None], other=0.0)
    gate = tl.load(gate_ptr + tile, mask=rv[:, None], other=0.0)
    y = gated_rms_norm(o, gate, tl.load(norm_w_ptr + offs).to(tl.float32), K, eps)
    tl.store(out_ptr + tile, tl.where(live, y, 0.0).to(out_ptr.dtype.element_ty), mask=rv[:, None])
    update_windows(q_ptr, k_ptr, v_ptr, conv_ptr, conv_row, snap_conv_ptr, row0_64, tok0, ch, live,
                   P, HAS_SNAP, ROWS, W, WB)


@triton.jit
def _kda_norm_kernel(o_ptr, gate_ptr, norm_w_ptr, slots_ptr, out_ptr, n_rows, H, eps,
                     ROWS: tl.constexpr, K: tl.constexpr, BR: tl.constexpr, PDL: tl.constexpr = False):
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


# ---- launch plan ----------------------------------------------------------------------------

# (BV, num_warps) of the state pass by rows per request: the fastest measured on the H200 at
# B=16, H=96 (BENCHMARKS.md, KDA); (32, 4) for one row is the steadier of two near-equal tiles.
_TILE_ONE_ROW, _TILE_ROWS = (32, 4), (32, 2)
_ONE_LAUNCH_ROWS: frozenset[int] = frozenset()     # rows per request that default to one launch


@dataclass(frozen=True)
class DecodePlan:
    """The launch configuration of one `kda_decode` call shape."""
    rows: int            # rows per request
    K: int               # head dim (= V)
    W: int               # conv kernel width
    block_v: int         # value channels per state program (K: the norm is fused, no norm launch)
    num_warps: int       # state pass
    prep_warps: int = PREP_WARPS
    norm_rows: int = NORM_ROWS
    unroll_rows: bool = True
    one_launch: bool = False     # prep, state and norm in one program per (request, head)

    @property
    def fuse_norm(self) -> bool:
        """The state pass normalises o itself (one program holds the head's whole o rows)."""
        return self.block_v == self.K or self.one_launch

    def prep_constexprs(self, has_lower_bound: bool, has_snap: bool) -> dict:
        return dict(ROWS=self.rows, RB=max(triton.next_power_of_2(self.rows), 2), K=self.K, W=self.W,
                    WB=triton.next_power_of_2(max(self.W - 1, 1)), HAS_LOWER_BOUND=has_lower_bound,
                    HAS_SNAP=has_snap)

    def head_constexprs(self, has_lower_bound: bool, has_snap: bool) -> dict:
        return dict(self.prep_constexprs(has_lower_bound, has_snap), BV=self.block_v)

    def state_constexprs(self, has_snap: bool) -> dict:
        return dict(ROWS=self.rows, K=self.K, BV=self.block_v, HAS_SNAP=has_snap,
                    FUSE_NORM=self.fuse_norm, UNROLL=bool(self.unroll_rows))

    def norm_constexprs(self) -> dict:
        return dict(ROWS=self.rows, K=self.K, BR=self.norm_rows)


def decode_tile(rows: int, K: int, block_v: int | None = None,
                num_warps: int | None = None) -> tuple[int, int]:
    """(BV, num_warps) of the state pass: the explicit ones, else the default for one row or for
    more. BV is capped at K."""
    bv, nw = _TILE_ONE_ROW if rows == 1 else _TILE_ROWS
    BV = min(bv if block_v is None else block_v, K)
    if BV < 1 or K % BV or BV & (BV - 1):
        raise ValueError(f"block_v: expected a power of two dividing K={K}, got {block_v}")
    nw = nw if num_warps is None else num_warps
    if nw < 1 or nw & (nw - 1):
        raise ValueError(f"num_warps: expected a power of two, got {num_warps}")
    return BV, nw


def plan(rows: int, K: int, W: int, block_v: int | None = None, num_warps: int | None = None,
         prep_warps: int = PREP_WARPS, norm_rows: int = NORM_ROWS,
         unroll_rows: bool = True, one_launch: bool | None = None) -> DecodePlan:
    """one_launch None: the measured default for `rows` (`_ONE_LAUNCH_ROWS`)."""
    if one_launch is None:
        one_launch = rows in _ONE_LAUNCH_ROWS
    BV, nw = decode_tile(rows, K, block_v, num_warps)
    return DecodePlan(rows, K, W, BV, nw, prep_warps, norm_rows, unroll_rows, one_launch)


# ---- launcher -------------------------------------------------------------------------------

@register("k31c::kda_decode", GPU_TARGETS)
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


def check_decode_layout(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                        conv_state, recurrent, slots, rows, snap_conv, snap_state):
    """The op's checks and the kernels' layout needs; returns (N, H, K, W)."""
    N, H, K, W = check_decode(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                              conv_state, recurrent, slots, rows, snap_conv, snap_state)
    check_kda_layout(q, K, conv_state, recurrent)
    require_unit_stride(slots=slots)
    if snap_conv is not None and not (snap_conv.is_contiguous() and snap_state.is_contiguous()):
        raise ValueError("snap_conv, snap_state: expected contiguous buffers (written in place)")
    return N, H, K, W


def launch_kda_decode(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                      conv_state, recurrent, slots, rows, lower_bound, eps, snap_conv, snap_state,
                      block_v: int | None = None, num_warps: int | None = None,
                      prep_warps: int = PREP_WARPS, norm_rows: int = NORM_ROWS,
                      unroll_rows: bool = True, stages: str = "psn",
                      one_launch: bool | None = None) -> torch.Tensor:
    """The launches, with the tuning knobs exposed for benchmarks. block_v, num_warps: tile of
    the state pass (default: `decode_tile`; block_v = K: one program per head, gated norm fused,
    no norm launch). unroll_rows: unroll the row loop (all rows' vector loads early) or not
    (fewer registers). one_launch: the whole step in one program per (request, head) (default:
    `plan`'s). stages:
    which of prep / state / norm to launch (benchmarks time them alone; anything but "psn"
    leaves the output unfinished; the one-launch form runs when "s" is among them)."""
    N, H, K, W = check_decode_layout(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias,
                                     o_norm_weight, conv_state, recurrent, slots, rows, snap_conv,
                                     snap_state)
    if not stages or set(stages) - set("psn"):
        raise ValueError(f"stages: expected letters of 'psn' (prep, state, norm), got {stages!r}")
    p = plan(rows, K, W, block_v, num_warps, prep_warps, norm_rows, unroll_rows, one_launch)
    q, k, v, f, beta, gate = (t.contiguous() for t in (q, k, v, f, beta, gate))
    return _run(p, q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight, conv_state,
                recurrent, slots, lower_bound, eps, snap_conv, snap_state, N, H, stages)


def _run(p: DecodePlan, q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
         conv_state, recurrent, slots, lower_bound, eps, snap_conv, snap_state, N, H,
         stages) -> torch.Tensor:
    B = slots.shape[0]
    K = p.K
    P = H * K
    dev = q.device
    pdl = pdl_launch(dev)
    has_snap = snap_conv is not None
    lb = 0.0 if lower_bound is None else float(lower_bound)
    if p.one_launch:
        out = torch.empty_like(q)
        if "s" in stages:
            o_raw = torch.empty(N, P, device=dev, dtype=torch.float32)
            _kda_head_kernel[(B * H,)](
                q, k, v, f, beta, gate, conv_weight.contiguous(), A_log.contiguous(),
                dt_bias.contiguous(), o_norm_weight.contiguous(), conv_state, recurrent, slots,
                o_raw, out, snap_conv if has_snap else conv_state,
                snap_state if has_snap else recurrent, H, lb, K ** -0.5, float(eps),
                **p.head_constexprs(lower_bound is not None, has_snap), num_warps=p.num_warps, **pdl)
        return out
    qs, ks, vs, ds = (torch.empty(N, P, device=dev, dtype=torch.float32) for _ in range(4))
    bs = torch.empty(N, H, device=dev, dtype=torch.float32)
    if "p" in stages:
        _kda_prep_kernel[(B, H)](
            q, k, v, f, beta, conv_weight.contiguous(), A_log.contiguous(), dt_bias.contiguous(),
            conv_state, slots, snap_conv if has_snap else conv_state, qs, ks, vs, ds, bs,
            H, lb, K ** -0.5,
            **p.prep_constexprs(lower_bound is not None, has_snap), num_warps=p.prep_warps, **pdl)
    out = torch.empty_like(q)
    o_raw = out if p.fuse_norm else torch.empty(N, P, device=dev, dtype=torch.float32)
    norm_w = o_norm_weight.contiguous()
    if "s" in stages:
        _kda_state_kernel[(B * H * (K // p.block_v),)](
            qs, ks, vs, ds, bs, o_raw, gate, norm_w, recurrent, slots,
            snap_state if has_snap else recurrent, H, float(eps),
            **p.state_constexprs(has_snap), num_warps=p.num_warps, **pdl)
    if "n" in stages and not p.fuse_norm:
        _kda_norm_kernel[(triton.cdiv(N * H, p.norm_rows),)](
            o_raw, gate, norm_w, slots, out, N * H, H, float(eps), **p.norm_constexprs(),
            num_warps=NORM_WARPS, **pdl)
    return out


def aot_specs(shapes, one_launch_rows=None) -> list:
    """The launches of `kda_decode` at `shapes` (aot_spec.AotShapes), for the ahead-of-time build,
    from `plan`'s defaults; dtypes as the KDA block passes them: for every rows-per-request count,
    prep and state with and without per-row snapshots, and the norm (one build per R: it maps
    rows to requests); or, for the rows in one_launch_rows (default: `_ONE_LAUNCH_ROWS`), the
    one-launch kernel."""
    one_launch_rows = _ONE_LAUNCH_ROWS if one_launch_rows is None else one_launch_rows
    cfg = shapes.cfg
    dt, f32, op = cfg.torch_dtype, torch.float32, "k31c::kda_decode"
    K, W, H = cfg.kda_head_dim, cfg.short_conv_kernel_size, cfg.kda_num_heads
    lb = cfg.gate_lower_bound is not None
    prep_types = dict(q_ptr=dt, k_ptr=dt, v_ptr=dt, f_ptr=dt, beta_ptr=dt, conv_w_ptr=f32,
                      a_log_ptr=f32, dt_bias_ptr=f32, conv_ptr=dt, slots_ptr=torch.int64,
                      snap_conv_ptr=dt, qs_ptr=f32, ks_ptr=f32, vs_ptr=f32, ds_ptr=f32,
                      bs_ptr=f32, lower_bound="fp32", scale="fp32")
    head_types = dict(q_ptr=dt, k_ptr=dt, v_ptr=dt, f_ptr=dt, beta_ptr=dt, gate_ptr=dt,
                      conv_w_ptr=f32, a_log_ptr=f32, dt_bias_ptr=f32, norm_w_ptr=dt, conv_ptr=dt,
                      state_ptr=f32, slots_ptr=torch.int64, o_raw_ptr=f32, out_ptr=dt, snap_conv_ptr=dt,
                      snap_state_ptr=f32, lower_bound="fp32", scale="fp32", eps="fp32")
    specs = []
    for rows in shapes.rows_per_request:
        p = plan(rows, K, W, one_launch=rows in one_launch_rows)
        state_types = dict(qs_ptr=f32, ks_ptr=f32, vs_ptr=f32, ds_ptr=f32, bs_ptr=f32,
                           o_ptr=dt if p.fuse_norm else f32, gate_ptr=dt, norm_w_ptr=dt,
                           state_ptr=f32, slots_ptr=torch.int64, snap_state_ptr=f32, eps="fp32")
        for snap in (False, True):
            tag = f"R={rows}{',snap' if snap else ''}"
            if p.one_launch:
                specs.append(kernel_spec(_kda_head_kernel, op, f"{tag},BV={p.block_v},one launch",
                                         p.head_constexprs(lb, snap), head_types,
                                         num_warps=p.num_warps, ints=dict(H=H)))
                continue
            specs.append(kernel_spec(_kda_prep_kernel, op, tag, p.prep_constexprs(lb, snap),
                                     prep_types, num_warps=p.prep_warps, ints=dict(H=H)))
            specs.append(kernel_spec(_kda_state_kernel, op, f"{tag},BV={p.block_v}",
                                     p.state_constexprs(snap), state_types, num_warps=p.num_warps,
                                     ints=dict(H=H)))
        if not p.fuse_norm:
            specs.append(kernel_spec(
                _kda_norm_kernel, op, f"R={rows},BR={p.norm_rows}", p.norm_constexprs(),
                dict(o_ptr=f32, gate_ptr=dt, norm_w_ptr=dt, slots_ptr=torch.int64, out_ptr=dt,
                     eps="fp32"),
                num_warps=NORM_WARPS, ints=dict(n_rows=shapes.batch * rows * H, H=H)))
    return specs
