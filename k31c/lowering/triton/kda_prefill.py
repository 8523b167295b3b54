"""Triton kernels for `k31c::kda_prefill` (spec/model.md §4.2-4.5): the chunked WY form for varlen
requests that continue from their slot's conv window and recurrent state.

Three launches (four when the state pass splits V):
0. `kda_conv_kernel` (kda_chunk.py), one program per (block of `conv_rows` rows, 16 by default;
   head): causal conv + SiLU over the window and the new rows, q / k L2 norms; q̂, k̂, v̂ go into
   the scratch buffers that step 1 overwrites in place (q̂ → q⊙exp(Γ), k̂ → k⊙exp(Γ_C - Γ),
   v̂ → U). Out of the chunk pass because there the conv's loads and registers sat in every block
   of a serial chain (BENCHMARKS.md, KDA).
1. `kda_chunk_kernel` (kda_chunk.py), one program per (chunk, head), all chunks in parallel:
   gates and betas, then the intra-chunk WY solve. The chunk is
   walked in blocks of BC = 16 rows; block I is solved by block forward substitution
       X_I = (I + M_II)^-1 (β_I B_I - Σ_{J<I} M_IJ X_J),   X = [W | U],  B = [exp(Γ)⊙K | V]
   with the earlier blocks' X_J and keys read back from the scratch the program just wrote;
   (I + M_II)^-1 by doubling inverted sub-blocks with fp32 products.
   Decay factors exp(Γ_r - Γ_i) are never formed as exp(Γ_r)/exp(Γ_i): across blocks both factors
   are taken relative to the boundary Γ_b between them (each ≤ 1); inside a diagonal block either
   relative to its middle row (bounded gate, |lower_bound|·BC/2 small: one MMA) or, for the
   unbounded softplus gate, exactly column by column.
   Writes per token: q⊙exp(Γ), k⊙exp(Γ_C - Γ), W, U, the causal A_qk row; per block the Γ at its end.
2. `_kda_state_kernel`, one program per (request, head[, V tile]), walks the request's chunks in
   order with the [K, V] state in registers: V_new = U - W S, O = (Q⊙exp Γ) S + A_qk V_new,
   S = exp(Γ_C) S + (exp(Γ_C - Γ)⊙K)ᵀ V_new; then the gated RMSNorm of O (whole V row on chip),
   the final state and the new conv window. (Optionally V is split into tiles for more programs;
   then the raw O goes to the output, rounded to its dtype as fla's chain rounds it, and
   `_gated_norm_kernel` normalises it in place: no scratch.)
(The fla / FlashKDA structure, a state pass writing each chunk's starting state for a parallel
output pass, is no faster (BENCHMARKS.md, KDA) and needs a [chunks, H, K, K] state scratch,
400 MB at T = 8192.)

Chunks restart at every request. The chunk grid is sized from static shapes (T tokens, B
requests); each program finds its request from cu_seqlens on device (CUDA-graph safe).
`plan` picks the launch configuration once; the launcher and `aot_specs` both read it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from k31c.graph.ops.kda import check_prefill
from k31c.lowering.aot_spec import kernel_spec
from k31c.lowering.registry import register
from k31c.lowering.targets import GPU_TARGETS, Target
from k31c.lowering.triton.device import pdl_launch, target_of, wait_for_producers
from k31c.lowering.triton.kda_chunk import (BC, SAFE_EXPONENT, chunk_request, kda_chunk_kernel,
                                            kda_conv_kernel, pick, request_chunks)
from k31c.lowering.triton.kda_common import check_kda_layout, gated_rms_norm, window_rows
from k31c.lowering.triton.unit_stride import require_unit_stride


@triton.jit
def _kda_state_kernel(qg_ptr, kg_ptr, w_ptr, u_ptr, aqk_ptr, ge_ptr,
                      q_ptr, k_ptr, v_ptr, gate_ptr, norm_w_ptr, out_ptr,
                      conv_ptr, state_ptr, slots_ptr, cu_ptr, B, H, eps,
                      C: tl.constexpr, BC: tl.constexpr, K: tl.constexpr, BV: tl.constexpr,
                      W: tl.constexpr, WB: tl.constexpr, BP: tl.constexpr, PREC: tl.constexpr,
                      PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    vt = tl.program_id(2)
    FUSED_NORM: tl.constexpr = BV == K      # the whole o row is here: gated norm in place
    P = H * K
    NB: tl.constexpr = C // BC
    DT = qg_ptr.dtype.element_ty
    j, start, length, n_chunks, first = request_chunks(cu_ptr, B, C, BP)
    s = pick(j, b, start)
    L = pick(j, b, length)
    n = pick(j, b, n_chunks)
    c_first = pick(j, b, first)
    slot = tl.load(slots_ptr + b)
    live = slot >= 0
    slot = tl.maximum(slot, 0)

    offs = tl.arange(0, K)
    offs_v = vt * BV + tl.arange(0, BV)
    ch = h * K + offs
    ch_v = h * K + offs_v
    rows = tl.arange(0, C)
    # scalar int64 bases + small int32 tile offsets keep the address registers few
    kv = offs[:, None] * K + offs_v[None, :]
    state_head = state_ptr + (slot * H + h) * K * K
    S = tl.load(state_head + kv, mask=live, other=0.0)                # [K, BV] fp32
    norm_w = tl.load(norm_w_ptr + offs_v).to(tl.float32)
    causal = rows[:, None] >= rows[None, :]
    rk = rows[:, None] * (H * K) + offs[None, :]          # [C, K] tile of a [T, H, K] buffer
    rc = rows[:, None] * (H * C) + rows[None, :]          # [C, C] tile of [T, H, C] (aqk)
    rp = rows[:, None] * P                                # rows of a [T, P] tensor
    for i in range(n):
        p = i * C + rows
        rv = (p < L) & live
        tc = (s + i * C).to(tl.int64)                     # token of the chunk's first row
        blk_k = (tc * H + h) * K
        m2 = rv[:, None]
        rkv = rows[:, None] * (H * K) + offs_v[None, :]     # [C, BV] tile of [T, H, K]
        w_c = tl.load(w_ptr + blk_k + rk, mask=m2, other=0.0)
        u_c = tl.load(u_ptr + blk_k + rkv, mask=m2, other=0.0).to(tl.float32)
        kg = tl.load(kg_ptr + blk_k + rk, mask=m2, other=0.0)
        g_c = tl.load(ge_ptr + (((c_first + i) * NB + NB - 1) * H + h) * K + offs, mask=live,
                      other=0.0)

        S_dot = S.to(DT)
        v_new = u_c - tl.dot(w_c, S_dot, input_precision=PREC)
        v_dot = v_new.to(DT)
        qg = tl.load(qg_ptr + blk_k + rk, mask=m2, other=0.0)
        a_qk = tl.load(aqk_ptr + (tc * H + h) * C + rc, mask=m2 & causal, other=0.0)
        o = tl.dot(qg, S_dot, input_precision=PREC)
        o = tl.dot(a_qk, v_dot, o, input_precision=PREC)
        S = S * tl.exp(g_c)[:, None] + tl.dot(tl.trans(kg), v_dot, input_precision=PREC)

        if FUSED_NORM:
            gate = tl.load(gate_ptr + tc * P + (rp + ch[None, :]), mask=m2, other=0.0)
            o = gated_rms_norm(o, gate, norm_w, K, eps)
            tl.store(out_ptr + tc * P + (rp + ch[None, :]),
                     tl.where(m2, o, 0.0).to(out_ptr.dtype.element_ty), mask=(p < L)[:, None])
        else:                                    # raw o; _gated_norm_kernel finishes the rows
            tl.store(out_ptr + tc * P + (rp + ch_v[None, :]),
                     tl.where(m2, o, 0.0).to(out_ptr.dtype.element_ty), mask=(p < L)[:, None])
    tl.store(state_head + kv, S, mask=live)

    if vt == 0:                              # one V tile writes the head's new conv window
        # new conv window = last W-1 rows of (old window ++ new tokens); it may reuse old rows
        conv_row = conv_ptr + slot * (W - 1) * 3 * P
        wi = tl.arange(0, WB)
        wm = wi < W - 1
        tok0 = s + L - (W - 1)                   # token of window position L
        win_q = window_rows(q_ptr, conv_row, L, tok0, wi, ch, ch, live, wm, P, W)
        win_k = window_rows(k_ptr, conv_row, L, tok0, wi, ch, P + ch, live, wm, P, W)
        win_v = window_rows(v_ptr, conv_row, L, tok0, wi, ch, 2 * P + ch, live, wm, P, W)
        tl.debug_barrier()
        dst = conv_row + (wi[:, None] * (3 * P) + ch[None, :])
        win_mask = (wm & live)[:, None]
        tl.store(dst, win_q.to(conv_ptr.dtype.element_ty), mask=win_mask)
        tl.store(dst + P, win_k.to(conv_ptr.dtype.element_ty), mask=win_mask)
        tl.store(dst + 2 * P, win_v.to(conv_ptr.dtype.element_ty), mask=win_mask)


@triton.jit
def _gated_norm_kernel(out_ptr, gate_ptr, norm_w_ptr, T, H, eps,
                       K: tl.constexpr, BT: tl.constexpr, PDL: tl.constexpr = False):
    """out = RMSNorm(out)·w·σ(gate) in place, per (token, head), when the state pass split V."""
    wait_for_producers(PDL)
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, K)
    m2 = (t < T)[:, None]
    idx = t[:, None] * (H * K) + h * K + offs[None, :]
    o = tl.load(out_ptr + idx, mask=m2, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + idx, mask=m2, other=0.0)
    norm_w = tl.load(norm_w_ptr + offs).to(tl.float32)
    y = gated_rms_norm(o, gate, norm_w, K, eps)
    tl.store(out_ptr + idx, y.to(out_ptr.dtype.element_ty), mask=m2)


@dataclass(frozen=True)
class PrefillPlan:
    """The launch configuration of one `kda_prefill` call shape."""
    B: int                   # requests
    C: int                   # chunk size
    K: int                   # head dim (= V)
    W: int                   # conv kernel width
    lower_bound: float | None
    scratch: torch.dtype     # bf16 inputs: bf16 scratch and MMAs (as fla); else fp32, exact products
    precision: str           # tl.dot input_precision
    block_v: int             # value channels per state program (< K: a norm launch follows)
    chunk_warps: int
    state_warps: int
    state_stages: int        # software-pipeline stages (`launch_defaults` picks them)
    conv_warps: int
    conv_rows: int           # rows per conv program (a power of two dividing the chunk)
    chunk_stages: int | None  # None: the backend's default software pipelining
    norm_rows: int           # rows per program of the norm launch (when V is split)
    norm_warps: int
    inverse_precision: str   # input_precision of the chunk pass's fp32 block inverse

    def conv_constexprs(self) -> dict:
        return dict(C=self.C, RB=self.conv_rows, K=self.K, W=self.W,
                    BP=triton.next_power_of_2(self.B + 1))

    def chunk_constexprs(self) -> dict:
        lb = self.lower_bound
        return dict(C=self.C, BC=BC, K=self.K, BP=triton.next_power_of_2(self.B + 1),
                    HAS_LOWER_BOUND=lb is not None,
                    SAFE_DIAG=lb is not None and -lb * (BC // 2) <= SAFE_EXPONENT,
                    PREC=self.precision, INV_PREC=self.inverse_precision)

    def chunk_stage_option(self) -> dict:
        return {} if self.chunk_stages is None else dict(num_stages=self.chunk_stages)

    def state_constexprs(self) -> dict:
        return dict(C=self.C, BC=BC, K=self.K, BV=self.block_v, W=self.W,
                    WB=triton.next_power_of_2(max(self.W - 1, 1)),
                    BP=triton.next_power_of_2(self.B + 1), PREC=self.precision)


# Two pipeline stages of the state pass at BV = K take 172 KB of shared memory (sm_90a builds,
# Triton 3.6-3.8); targets with less run it unpipelined.
PIPELINED_SMEM = 176 * 1024


def launch_defaults(target: Target, chunk_size: int) -> dict:
    """The target's tuning knobs for chunks of `chunk_size` rows: the fastest measured at
    T = 8192 on the H200 (BENCHMARKS.md, KDA). Where the state pass's stages fit: chunks of one
    16-row block run the state pass on 4 warps over 64-column value blocks, 4 stages deep,
    longer chunks on 8 warps over all columns, 2 stages; the chunk pass on 2 stages."""
    if target.shared_memory < PIPELINED_SMEM:
        return dict(state_stages=1, chunk_stages=None, state_warps=8, block_v=None)
    if chunk_size == BC:
        return dict(state_stages=4, chunk_stages=2, state_warps=4, block_v=64)
    return dict(state_stages=2, chunk_stages=2, state_warps=8, block_v=None)


def kernel_chunk(target: Target, chunk_size: int) -> int:
    """The rows per chunk the kernels walk: the target record's where it names one, else the
    model's `chunk_size`."""
    return target.kda_prefill_chunk or chunk_size


def plan(target: Target, B: int, chunk_size: int, K: int, W: int, dtype: torch.dtype,
         lower_bound: float | None, chunk_warps: int = 2, conv_warps: int = 4,
         conv_rows: int = BC, norm_rows: int = 16, norm_warps: int = 4,
         inverse_precision: str | None = None, **knobs) -> PrefillPlan:
    """The launch configuration; its keywords are the launcher's tuning knobs: `knobs` (state_stages,
    chunk_stages, state_warps, block_v) given and not None replace `launch_defaults`' (the
    target's); `inverse_precision` None: the target's `exact_dot_precision` (FMA for fp32
    inputs). Defaults: the fastest measured at T = 8192 (BENCHMARKS.md, KDA): the chunk pass on
    2 warps, the conv pass on 4 over 16-row blocks."""
    C = chunk_size
    if C < BC or C & (C - 1):
        raise ValueError(f"chunk_size: the kernel needs a power of two >= {BC}, got {C}")
    if conv_rows < 1 or conv_rows & (conv_rows - 1) or conv_rows > C:
        raise ValueError(f"conv_rows: expected a power of two <= chunk_size {C}, got {conv_rows}")
    if norm_rows < 1 or norm_rows & (norm_rows - 1):
        raise ValueError(f"norm_rows: expected a power of two, got {norm_rows}")
    if inverse_precision not in (None, "ieee", "tf32x3"):
        raise ValueError(f"inverse_precision: expected 'ieee' or 'tf32x3' (fp32-accurate), got "
                         f"{inverse_precision!r}")
    defaults = launch_defaults(target, C)
    unknown = sorted(set(knobs) - set(defaults))
    if unknown:
        raise TypeError(f"kda_prefill plan: unknown tuning knobs {unknown}")
    kn = {**defaults, **{n: v for n, v in knobs.items() if v is not None}}
    BV = min(kn["block_v"] or K, K)
    if BV < 16 or BV & (BV - 1):
        raise ValueError(f"block_v: expected a power of two >= 16, got {kn['block_v']}")
    scratch = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    return PrefillPlan(B, C, K, W, lower_bound, scratch,
                       target.dot_precision(fast=scratch == torch.bfloat16), BV, chunk_warps,
                       kn["state_warps"], kn["state_stages"], conv_warps, conv_rows,
                       kn["chunk_stages"], norm_rows, norm_warps,
                       inverse_precision or ("ieee" if scratch == torch.float32
                                             else target.exact_dot_precision))


@register("k31c::kda_prefill", GPU_TARGETS)
def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
                beta: torch.Tensor, gate: torch.Tensor, conv_weight: torch.Tensor,
                A_log: torch.Tensor, dt_bias: torch.Tensor, o_norm_weight: torch.Tensor,
                conv_state: torch.Tensor, recurrent: torch.Tensor, slots: torch.Tensor,
                cu_seqlens: torch.Tensor, lower_bound: float | None, eps: float,
                chunk_size: int) -> torch.Tensor:
    """Launcher with the op's signature; the chunk size is the target's (`kernel_chunk`)."""
    return launch_kda_prefill(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                              conv_state, recurrent, slots, cu_seqlens, lower_bound, eps,
                              kernel_chunk(target_of(q.device), chunk_size))


def launch_kda_prefill(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                       conv_state, recurrent, slots, cu_seqlens, lower_bound, eps, chunk_size,
                       stages: str = "vcsn", **knobs) -> torch.Tensor:
    """The launches themselves, with the tuning knobs (`plan`'s keywords) exposed for
    benchmarks. block_v < K splits the state pass over V tiles (more programs when B·H is
    small) and adds a norm launch.
    stages: which of the conv pass, the chunk pass, the state pass and the norm launch to run
    (benchmarks time them alone; anything but "vcsn" leaves the output unfinished)."""
    if not stages or set(stages) - set("vcsn"):
        raise ValueError("stages: expected letters of 'vcsn' (conv, chunk, state, norm), "
                         f"got {stages!r}")
    T, H, K, W = check_prefill(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                               conv_state, recurrent, slots, cu_seqlens, chunk_size)
    check_kda_layout(q, K, conv_state, recurrent)
    require_unit_stride(slots=slots, cu_seqlens=cu_seqlens)
    B = slots.shape[0]
    p = plan(target_of(q.device), B, chunk_size, K, W, q.dtype, lower_bound, **knobs)
    C, BV, dt = p.C, p.block_v, p.scratch
    q, k, v, f, beta, gate = (t.contiguous() for t in (q, k, v, f, beta, gate))
    conv_weight, A_log, dt_bias, o_norm_weight = (
        t.contiguous() for t in (conv_weight, A_log, dt_bias, o_norm_weight))
    n_chunks_max = (T + B * (C - 1)) // C               # Σ ceil(len_b / C) over any split of T
    NB = C // BC
    qg, kg, w, u = (torch.empty(T, H, K, device=q.device, dtype=dt) for _ in range(4))
    aqk = torch.empty(T, H, C, device=q.device, dtype=dt)
    ge = torch.empty(n_chunks_max, NB, H, K, device=q.device, dtype=torch.float32)
    out = torch.empty_like(q)
    lb = 0.0 if lower_bound is None else float(lower_bound)
    pdl = pdl_launch(q.device)
    if n_chunks_max > 0 and "v" in stages:      # q̂, k̂, v̂ into the qg, kg, u buffers
        kda_conv_kernel[(n_chunks_max * (C // p.conv_rows), H)](
            q, k, v, conv_weight, conv_state, slots, cu_seqlens, qg, kg, u, B, H, K ** -0.5,
            **p.conv_constexprs(), num_warps=p.conv_warps, **pdl)
    if n_chunks_max > 0 and "c" in stages:
        kda_chunk_kernel[(n_chunks_max, H)](
            f, beta, A_log, dt_bias, slots, cu_seqlens, qg, kg, w, u, aqk, ge, B, H, lb,
            **p.chunk_constexprs(), num_warps=p.chunk_warps, **p.chunk_stage_option(), **pdl)
    if "s" in stages:
        _kda_state_kernel[(B, H, K // BV)](
            qg, kg, w, u, aqk, ge, q, k, v, gate, o_norm_weight, out,
            conv_state, recurrent, slots, cu_seqlens, B, H, float(eps), **p.state_constexprs(),
            num_warps=p.state_warps, num_stages=p.state_stages, **pdl)
    if "n" in stages and BV < K and T > 0:
        _gated_norm_kernel[(triton.cdiv(T, p.norm_rows), H)](
            out, gate, o_norm_weight, T, H, float(eps), K=K, BT=p.norm_rows,
            num_warps=p.norm_warps, **pdl)
    return out


def aot_specs(shapes) -> list:
    """The launches of `kda_prefill` at `shapes` (aot_spec.AotShapes), for the ahead-of-time
    build: the conv, chunk and state passes from `plan`'s defaults, and the norm launch where
    the state pass splits V; dtypes as the KDA block passes them."""
    cfg = shapes.cfg
    dt, f32, B = cfg.torch_dtype, torch.float32, shapes.prefill_requests
    p = plan(shapes.target, B, kernel_chunk(shapes.target, cfg.kda_chunk_size), cfg.kda_head_dim,
             cfg.short_conv_kernel_size, dt, cfg.gate_lower_bound)
    scratch, split = p.scratch, p.block_v < p.K
    conv = kernel_spec(
        kda_conv_kernel, "k31c::kda_prefill", f"B={B}", p.conv_constexprs(),
        dict(q_ptr=dt, k_ptr=dt, v_ptr=dt, conv_w_ptr=f32, conv_ptr=dt, slots_ptr=torch.int64,
             cu_ptr=torch.int32, qn_ptr=scratch, kn_ptr=scratch, vc_ptr=scratch, scale="fp32"),
        num_warps=p.conv_warps, ints=dict(B=B, H=cfg.kda_num_heads))
    chunk = kernel_spec(
        kda_chunk_kernel, "k31c::kda_prefill", f"B={B}", p.chunk_constexprs(),
        dict(f_ptr=dt, beta_ptr=dt, a_log_ptr=f32, dt_bias_ptr=f32, slots_ptr=torch.int64,
             cu_ptr=torch.int32, qg_ptr=scratch, kg_ptr=scratch, w_ptr=scratch, u_ptr=scratch,
             aqk_ptr=scratch, ge_ptr=f32, lower_bound="fp32"),
        num_warps=p.chunk_warps, num_stages=p.chunk_stages, ints=dict(B=B, H=cfg.kda_num_heads))
    state = kernel_spec(
        _kda_state_kernel, "k31c::kda_prefill", f"B={B},BV={p.block_v}", p.state_constexprs(),
        dict(qg_ptr=scratch, kg_ptr=scratch, w_ptr=scratch, u_ptr=scratch, aqk_ptr=scratch, ge_ptr=f32,
             q_ptr=dt, k_ptr=dt, v_ptr=dt, gate_ptr=dt, norm_w_ptr=dt, out_ptr=dt,
             conv_ptr=dt, state_ptr=f32, slots_ptr=torch.int64, cu_ptr=torch.int32, eps="fp32"),
        num_warps=p.state_warps, num_stages=p.state_stages, ints=dict(B=B, H=cfg.kda_num_heads))
    if not split:
        return [conv, chunk, state]
    norm = kernel_spec(
        _gated_norm_kernel, "k31c::kda_prefill", f"B={B},BV={p.block_v}", dict(K=p.K, BT=p.norm_rows),
        dict(out_ptr=dt, gate_ptr=dt, norm_w_ptr=dt, eps="fp32"),
        num_warps=p.norm_warps, ints=dict(T=shapes.prefill_tokens, H=cfg.kda_num_heads))
    return [conv, chunk, state, norm]
