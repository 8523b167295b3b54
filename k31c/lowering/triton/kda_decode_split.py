"""Split variant of `k31c::kda_decode` (variant="split" of `launch_kda_decode`): state pass kept lean.

Why: the fused kernel (kda_decode.py) makes every state tile program also run the conv, the q/k
L2 norms and gates (redundantly for every V tile), then meet its head's other tiles through an
atomic counter so the last one can run the gated norm and rewrite the conv window. All of that
sits on each program's latency chain while its [K, BV] state slice holds registers. Decode is
state-traffic bound (B=16, H=96: 100.7 MB of fp32 state read + written = ~50 us on the H200;
activations and windows ~2-10 MB), so the time is roughly (state bytes per SM / state bytes
resident per SM) x program lifetime: lifetime and non-state registers are what to cut.

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
A padding request (slot -1) reads and writes no state; its raw o is forced to 0, so its output
rows come out 0 from the norm.

Status: the default variant of the registered launcher, at the per-R tile below. Measured
2026-11-29 on the H200 with `PYTHONPATH=.:/tmp/vend python benchmarks/try_kda.py` (CUDA-graph
replay, B=16, H=96, K=V=128; fused = the one-kernel variant at its best tile; fla =
fused_recurrent_kda alone, conv and norm not included):
  R=1: (BV, warps) (64, 4) 65.4 us, (32, 4) 67.0, (32, 2) 67.3; fused 110.6 us; fla 66 us.
  R=4: (32, 2) 82.4 us (row loop rolled: 83.4), (64, 4) 92.3, (16, 2) 95.6; fused 213.0 us;
       fla 150.2 us. With per-row snapshots: (32, 2) 201.5 us, fused 322.0 us.
Second run (`k31c bench kernels`, same day): R=1 (64, 4) 70.6 us, (32, 4) 67.3, (32, 2) 67.8,
fla 66.5; R=4 (32, 2) 84.5 us, fla 150.1. Defaults (kda_decode.decode_tile): (32, 4) for one row
per request (the steadier of the two across runs), (32, 2) for more. Agrees
with the reference op at that shape: max |split - ref| 3.9e-3 on the bf16 output, 7e-7 on the
state.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kda_decode import _L2_EPS, conv_silu_rows, decode_tile, kda_gate_math, update_windows

PREP_WARPS = 4            # prep and norm launches: not tuned (small next to the state pass)
NORM_WARPS = 4
NORM_ROWS = 16            # [N*H, K] rows per norm program


@triton.jit
def _kda_prep_kernel(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr,
                     conv_ptr, slots_ptr, snap_conv_ptr, qs_ptr, ks_ptr, vs_ptr, ds_ptr, bs_ptr,
                     H, lower_bound, scale,
                     ROWS: tl.constexpr, RB: tl.constexpr, K: tl.constexpr, W: tl.constexpr,
                     WB: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr, HAS_SNAP: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    P = H * K
    slot = tl.load(slots_ptr + b)
    live = slot >= 0
    slot = tl.maximum(slot, 0)
    offs = tl.arange(0, K)
    ch = h * K + offs
    conv_row = conv_ptr + slot * (W - 1) * 3 * P
    rr = tl.arange(0, RB)
    rv = rr < ROWS
    row0 = b * ROWS
    row0_64 = row0.to(tl.int64)
    tok0 = row0 - (W - 1)                                              # token of position 0
    tile = rr[:, None] * P + ch[None, :]
    m2 = rv[:, None]
    q = conv_silu_rows(q_ptr, conv_row, conv_w_ptr, 0, tok0, rr, rv, ch, ch, live, P, W)
    k = conv_silu_rows(k_ptr, conv_row, conv_w_ptr, 0, tok0, rr, rv, ch, P + ch, live, P, W)
    v = conv_silu_rows(v_ptr, conv_row, conv_w_ptr, 0, tok0, rr, rv, ch, 2 * P + ch, live, P, W)
    q = q * (tl.rsqrt(tl.sum(q * q, axis=1) + _L2_EPS) * scale)[:, None]
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + _L2_EPS)[:, None]
    f = tl.load(f_ptr + row0_64 * P + tile, mask=m2, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + ch).to(tl.float32)
    decay = tl.exp(kda_gate_math(f, dt_bias[None, :], a, lower_bound, HAS_LOWER_BOUND))
    beta = tl.sigmoid(tl.load(beta_ptr + row0_64 * H + (rr * H + h), mask=rv,
                              other=0.0).to(tl.float32))
    base = row0_64 * P + tile
    tl.store(qs_ptr + base, q, mask=m2)
    tl.store(ks_ptr + base, k, mask=m2)
    tl.store(vs_ptr + base, v, mask=m2)
    tl.store(ds_ptr + base, decay, mask=m2)
    tl.store(bs_ptr + row0_64 * H + (rr * H + h), beta, mask=rv)
    update_windows(q_ptr, k_ptr, v_ptr, conv_ptr, conv_row, snap_conv_ptr, row0_64, tok0, ch, live,
                   P, HAS_SNAP, ROWS, W, WB)


@triton.jit
def _state_row(S, r, row0_64, h, H, live, offs, offs_v, kv, qs_ptr, ks_ptr, vs_ptr, ds_ptr,
               bs_ptr, o_ptr, gate_ptr, norm_w_ptr, snap_state_ptr, eps,
               K: tl.constexpr, HAS_SNAP: tl.constexpr, FUSE_NORM: tl.constexpr):
    """One delta-rule row on the [K, BV] slice; stores its o (raw, or normed with FUSE_NORM)."""
    base = (row0_64 + r) * (H * K) + h * K
    q_r = tl.load(qs_ptr + base + offs)
    k_r = tl.load(ks_ptr + base + offs)
    d_r = tl.load(ds_ptr + base + offs)
    v_r = tl.load(vs_ptr + base + offs_v)
    beta_r = tl.load(bs_ptr + (row0_64 + r) * H + h)
    S = S * d_r[:, None]                                               # decay the key rows
    pred = tl.sum(S * k_r[:, None], axis=0)                            # S^T k   [BV]
    S = S + k_r[:, None] * (beta_r * (v_r - pred))[None, :]
    o = tl.where(live, tl.sum(S * q_r[:, None], axis=0), 0.0)          # S^T q   [BV]
    if FUSE_NORM:                                                      # BV == K: whole head here
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
    return S


@triton.jit
def _kda_state_kernel(qs_ptr, ks_ptr, vs_ptr, ds_ptr, bs_ptr, o_ptr, gate_ptr, norm_w_ptr,
                      state_ptr, slots_ptr, snap_state_ptr, H, eps,
                      ROWS: tl.constexpr, K: tl.constexpr, BV: tl.constexpr,
                      HAS_SNAP: tl.constexpr, FUSE_NORM: tl.constexpr, UNROLL: tl.constexpr):
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
def _kda_norm_kernel(o_ptr, gate_ptr, norm_w_ptr, slots_ptr, out_ptr, n_rows, H, eps,
                     ROWS: tl.constexpr, K: tl.constexpr, BR: tl.constexpr):
    """Gated RMSNorm of raw o viewed as [N*H, K] rows (one head of one token per row); rows of a
    padding request (slot -1) come out 0 whatever their gate holds."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    offs = tl.arange(0, K)
    in_range = rows < n_rows
    m = in_range[:, None]
    live = tl.load(slots_ptr + rows // H // ROWS, mask=in_range, other=-1) >= 0
    tile = rows.to(tl.int64)[:, None] * K + offs[None, :]
    o = tl.load(o_ptr + tile, mask=m, other=0.0)
    gate = tl.load(gate_ptr + tile, mask=m, other=0.0).to(tl.float32)
    norm_w = tl.load(norm_w_ptr + offs).to(tl.float32)
    y = o * tl.rsqrt(tl.sum(o * o, axis=1) / K + eps)[:, None] * norm_w[None, :] * tl.sigmoid(gate)
    y = tl.where(live[:, None], y, 0.0)
    tl.store(out_ptr + tile, y.to(out_ptr.dtype.element_ty), mask=m)


def launch_split(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight, conv_state,
                 recurrent, slots, rows, lower_bound, eps, snap_conv, snap_state, N, H, K, W,
                 block_v: int | None = None, num_warps: int | None = None,
                 prep_warps: int = PREP_WARPS, norm_rows: int = NORM_ROWS,
                 unroll_rows: bool = True, stages: str = "psn") -> torch.Tensor:
    """The three launches; arguments already checked by `launch_kda_decode`. block_v, num_warps:
    tile of the state pass (default: decode_tile's per-R best; block_v = K: one program per
    head, gated norm fused, no norm launch). unroll_rows: unroll the row loop (all rows' vector
    loads early) or not (fewer registers). stages: which of prep / state / norm to launch
    (benchmarks time them alone; anything but "psn" leaves the output unfinished)."""
    if not stages or set(stages) - set("psn"):
        raise ValueError(f"stages: expected letters of 'psn' (prep, state, norm), got {stages!r}")
    B = slots.shape[0]
    P = H * K
    BV, num_warps = decode_tile(rows, K, "split", block_v, num_warps)
    dev = q.device
    qs, ks, vs, ds = (torch.empty(N, P, device=dev, dtype=torch.float32) for _ in range(4))
    bs = torch.empty(N, H, device=dev, dtype=torch.float32)
    has_snap = snap_conv is not None
    if "p" in stages:
        _kda_prep_kernel[(B, H)](
            q, k, v, f, beta, conv_weight.contiguous(), A_log.contiguous(), dt_bias.contiguous(),
            conv_state, slots, snap_conv if has_snap else conv_state, qs, ks, vs, ds, bs,
            H, 0.0 if lower_bound is None else float(lower_bound), K ** -0.5,
            ROWS=rows, RB=max(triton.next_power_of_2(rows), 2), K=K, W=W,
            WB=triton.next_power_of_2(max(W - 1, 1)), HAS_LOWER_BOUND=lower_bound is not None,
            HAS_SNAP=has_snap, num_warps=prep_warps)
    out = torch.empty_like(q)
    fuse = BV == K
    o_raw = out if fuse else torch.empty(N, P, device=dev, dtype=torch.float32)
    norm_w = o_norm_weight.contiguous()
    if "s" in stages:
        _kda_state_kernel[(B * H * (K // BV),)](
            qs, ks, vs, ds, bs, o_raw, gate, norm_w, recurrent, slots,
            snap_state if has_snap else recurrent, H, float(eps),
            ROWS=rows, K=K, BV=BV, HAS_SNAP=has_snap, FUSE_NORM=fuse, UNROLL=bool(unroll_rows),
            num_warps=num_warps)
    if "n" in stages and not fuse:
        _kda_norm_kernel[(triton.cdiv(N * H, norm_rows),)](
            o_raw, gate, norm_w, slots, out, N * H, H, float(eps), ROWS=rows, K=K, BR=norm_rows,
            num_warps=NORM_WARPS)
    return out


def split_specs(shapes) -> list:
    """The split variant's launches at `shapes` (lowering.aot.AotShapes) with `launch_split`'s
    defaults, for kda_decode.aot_specs (the module that registers the op lists them): for every
    rows-per-request count, prep and state with and without per-row snapshots, and the norm
    (one build per R: it maps rows to requests)."""
    from k31c.lowering.aot import kernel_spec
    cfg = shapes.cfg
    dt, f32, op = cfg.torch_dtype, torch.float32, "k31c::kda_decode"
    K, W = cfg.kda_head_dim, cfg.short_conv_kernel_size
    prep_types = dict(q_ptr=dt, k_ptr=dt, v_ptr=dt, f_ptr=dt, beta_ptr=dt, conv_w_ptr=f32,
                      a_log_ptr=f32, dt_bias_ptr=f32, conv_ptr=dt, slots_ptr=torch.int64,
                      snap_conv_ptr=dt, qs_ptr=f32, ks_ptr=f32, vs_ptr=f32, ds_ptr=f32,
                      bs_ptr=f32, lower_bound="fp32", scale="fp32")
    specs = []
    for rows in shapes.rows_per_request:
        BV, num_warps = decode_tile(rows, K, "split")
        fuse = BV == K
        state_types = dict(qs_ptr=f32, ks_ptr=f32, vs_ptr=f32, ds_ptr=f32, bs_ptr=f32,
                           o_ptr=dt if fuse else f32, gate_ptr=dt, norm_w_ptr=dt, state_ptr=f32,
                           slots_ptr=torch.int64, snap_state_ptr=f32, eps="fp32")
        for snap in (False, True):
            tag = f"R={rows}{',snap' if snap else ''}"
            specs.append(kernel_spec(
                _kda_prep_kernel, op, tag,
                dict(ROWS=rows, RB=max(triton.next_power_of_2(rows), 2), K=K, W=W,
                     WB=triton.next_power_of_2(max(W - 1, 1)),
                     HAS_LOWER_BOUND=cfg.gate_lower_bound is not None, HAS_SNAP=snap),
                prep_types, num_warps=PREP_WARPS))
            specs.append(kernel_spec(
                _kda_state_kernel, op, f"{tag},BV={BV}",
                dict(ROWS=rows, K=K, BV=BV, HAS_SNAP=snap, FUSE_NORM=fuse, UNROLL=True),
                state_types, num_warps=num_warps))
        if not fuse:
            specs.append(kernel_spec(
                _kda_norm_kernel, op, f"R={rows},BR={NORM_ROWS}", dict(ROWS=rows, K=K, BR=NORM_ROWS),
                dict(o_ptr=f32, gate_ptr=dt, norm_w_ptr=dt, slots_ptr=torch.int64, out_ptr=dt,
                     eps="fp32"),
                num_warps=NORM_WARPS))
    return specs
