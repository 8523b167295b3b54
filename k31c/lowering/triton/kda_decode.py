"""Triton kernel for `k31c::kda_decode` (spec/model.md §4.2-4.7): the fused one-launch variant.

Not the default: `launch_kda_decode` (the registered launcher) runs the split variant
(kda_decode_split.py: prep launch, lean state pass, norm launch) unless asked for
variant="fused"; this kernel stays for benchmarks and as the split one's cross-check.
Measured 2026-11-29 on the H200 with `PYTHONPATH=.:/tmp/vend python benchmarks/try_kda.py`
(CUDA-graph replay, B=16, H=96, K=V=128, bf16 activations, fp32 state), best tile of each:
  R=1: fused 110.6 us, split 65.4 us (BV=64, 4 warps), fla fused_recurrent_kda 66 us;
  R=4: fused 213.0 us, split 82.4 us (BV=32, 2 warps), fla 150.2 us;
  R=4 with snapshots: fused 322.0 us, split 201.5 us.

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
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...graph.ops.kda import L2_NORM_EPS, check_decode
from ..registry import register
from .unit_stride import require_unit_stride

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
def window_rows(in_ptr, conv_row_ptr, pos0, tok0, rel, ch_in, ch_conv, live, mask_rel, P,
                W: tl.constexpr):
    """ext[pos0 + rel] for a channel vector, [E, C] fp32 (0 where mask_rel is false).

    ext is one request's cached window (positions < W-1, conv_row_ptr) followed by its new
    rows; tok0 is the token index that position pos0 would have (request start + pos0 - (W-1),
    possibly negative). Addresses are a scalar base plus small int32 offsets (few registers)."""
    ext = pos0 + rel
    from_hist = ext < W - 1
    hist_row = tl.where(from_hist, ext, 0)
    hist = tl.load(conv_row_ptr + (hist_row[:, None] * (3 * P) + ch_conv[None, :]),
                   mask=(mask_rel & from_hist & live)[:, None], other=0.0)
    new = tl.load(in_ptr + tok0.to(tl.int64) * P + (rel[:, None] * P + ch_in[None, :]),
                  mask=(mask_rel & ~from_hist)[:, None], other=0.0)
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
    return acc * tl.sigmoid(acc)


@triton.jit
def _copy_window(in_ptr, conv_row_ptr, dst_ptr, pos0, tok0, ch_in, ch_conv, live, P,
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
            _copy_window(q_ptr, conv_row, snap_conv, r + 1, tok, ch, ch, live, P, W, WB)
            _copy_window(k_ptr, conv_row, snap_conv, r + 1, tok, ch, P + ch, live, P, W, WB)
            _copy_window(v_ptr, conv_row, snap_conv, r + 1, tok, ch, 2 * P + ch, live, P, W, WB)
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
    q = q * (tl.rsqrt(tl.sum(q * q, axis=1) + _L2_EPS) * scale)[:, None]
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + _L2_EPS)[:, None]
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
                      block_v: int | None = None, num_warps: int | None = None,
                      variant: str = "split", **split_knobs) -> torch.Tensor:
    """The launch itself, with the tuning knobs exposed for benchmarks.
    variant: "split" (the default: kda_decode_split's prep, lean state pass, norm; split_knobs go
    to its launcher) or "fused" (this module's one-kernel launch). block_v / num_warps default
    to the variant's best tile measured on the H200 at B=16, H=96 (`decode_tile`)."""
    N, H, K, W = check_decode(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                               conv_state, recurrent, slots, rows, snap_conv, snap_state)
    check_kda_layout(q, K, conv_state, recurrent)
    require_unit_stride(slots=slots)
    if snap_conv is not None and not (snap_conv.is_contiguous() and snap_state.is_contiguous()):
        raise ValueError("snap_conv, snap_state: expected contiguous buffers (written in place)")
    if variant != "split" and (variant != "fused" or split_knobs):
        raise ValueError(f"variant: expected 'split' or 'fused' (knobs {sorted(split_knobs)} "
                         f"only with 'split'), got {variant!r}")
    BV, num_warps = decode_tile(rows, K, variant, block_v, num_warps)
    q, k, v, f, beta, gate = (t.contiguous() for t in (q, k, v, f, beta, gate))
    if variant == "split":
        from .kda_decode_split import launch_split
        return launch_split(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                            conv_state, recurrent, slots, rows, lower_bound, eps, snap_conv,
                            snap_state, N, H, K, W, block_v=BV, num_warps=num_warps,
                            **split_knobs)
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


def decode_tile(rows: int, K: int, variant: str = "split", block_v: int | None = None,
                num_warps: int | None = None) -> tuple[int, int]:
    """(BV, num_warps) a launch uses: the explicit ones, else the variant's best measured on the
    H200 (module docstring): split (32, 4) for one row (67.0 / 67.3 us in two runs; (64, 4) gave
    65.4 / 70.6) and (32, 2) for verify rows; fused (32, 4) / (64, 4). BV is capped at K."""
    if variant == "split":
        bv, nw = (32, 4) if rows == 1 else (32, 2)
    else:
        bv, nw = (32 if rows == 1 else 64), 4
    BV = min(bv if block_v is None else block_v, K)
    if BV < 1 or K % BV or BV & (BV - 1):
        raise ValueError(f"block_v: expected a power of two dividing K={K}, got {block_v}")
    nw = nw if num_warps is None else num_warps
    if nw < 1 or nw & (nw - 1):
        raise ValueError(f"num_warps: expected a power of two, got {num_warps}")
    return BV, nw


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


def aot_specs(shapes) -> list:
    """The launches of `kda_decode` at `shapes` (lowering.aot.AotShapes), for the ahead-of-time
    build, at `launch_kda_decode`'s default tiles; dtypes as the KDA block passes them. Split
    (the default variant; kda_decode_split.split_specs): every rows-per-request count with and
    without per-row snapshots. Fused (variant="fused", benchmarks): one row per request (plain
    decode) and R rows with snapshots (verification)."""
    from k31c.lowering.aot import kernel_spec

    from .kda_decode_split import split_specs
    cfg = shapes.cfg
    dt, f32 = cfg.torch_dtype, torch.float32
    K, W = cfg.kda_head_dim, cfg.short_conv_kernel_size
    types = dict(q_ptr=dt, k_ptr=dt, v_ptr=dt, f_ptr=dt, beta_ptr=dt, gate_ptr=dt, out_ptr=dt,
                 o_raw_ptr=f32, count_ptr=torch.int32, conv_w_ptr=f32, a_log_ptr=f32,
                 dt_bias_ptr=f32, norm_w_ptr=dt, conv_ptr=dt, state_ptr=f32, slots_ptr=torch.int64,
                 snap_conv_ptr=dt, snap_state_ptr=f32, lower_bound="fp32", eps="fp32", scale="fp32")
    specs = split_specs(shapes)
    for rows in shapes.rows_per_request:
        snap = rows > 1                       # verification rows write snapshots
        BV, num_warps = decode_tile(rows, K, "fused")
        specs.append(kernel_spec(
            _kda_decode_kernel, "k31c::kda_decode", f"fused,R={rows}{',snap' if snap else ''}",
            dict(ROWS=rows, RB=max(triton.next_power_of_2(rows), 2), K=K, BV=BV, W=W,
                 WB=triton.next_power_of_2(max(W - 1, 1)),
                 HAS_LOWER_BOUND=cfg.gate_lower_bound is not None, HAS_SNAP=snap),
            types, num_warps=num_warps))
    return specs
