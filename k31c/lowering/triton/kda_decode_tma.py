"""KDA decode's state pass streamed through a TMA ring (Gluon, sm_90a): the h200 form of launch 2
in kda_decode_kernels.py, for whole heads of K = 128.

The Triton state pass holds its [K, BV] fp32 slice in registers from its load to its store, so
the bytes in flight an SM are bounded by the register file and a program's lifetime (load, R
delta-rule rows, store) is on the stream's critical path. Here a persistent program an SM walks
the (request, head) items i, i + G, ... and the state arrives by TMA into a ring of NS [K, K]
stages in shared memory: while one item's rows run, the next items' states are already on their
way, and the registers hold only the item being updated. The new state leaves from registers
(streaming stores) and the stage is refilled once every warp has read it.

Each program takes whole heads, so the gated RMSNorm over the head's K output values is fused at
every R (no norm launch). The rows' vectors come from the prep launch's fp32 scratch, as in the
Triton state pass. Layout of the state in registers: a warp holds 128 whole value columns of K/8
key rows (each thread [K/8, 4]), so a row of the ring stage is one 512-byte read a warp and the
sums over keys are in-thread sums plus one cross-warp step.
"""
from __future__ import annotations

import torch

from k31c.lowering.triton.gluon_sm90 import GLUON_ERROR

K_TMA = 128             # the head dim this form is written for (K3.1 Pro)
NUM_WARPS = 8
STAGES = 2              # ring stages of [K, K] fp32 (64 KB each)

if GLUON_ERROR is None:
    from k31c.lowering.triton.gluon_sm90 import fence_async_shared, gl, gluon, mbarrier, sync, tma
    from k31c.lowering.triton.indexer_ws_ring import gdc_launch_dependents, gdc_wait

    @gluon.jit
    def _issue_state(item, slot, stage, state_desc, ring, ready, H, K: gl.constexpr):
        """Start item `item`'s state on its way into ring stage `stage` (a padding request's
        stage, slot < 0, is marked ready by hand: no state is read for it)."""
        if slot >= 0:
            mbarrier.expect(ready.index(stage), state_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(state_desc, [(slot * H + item % H) * K, 0],
                                            ready.index(stage), ring.index(stage))
        else:
            mbarrier.arrive(ready.index(stage), count=1)

    @gluon.jit
    def _issue_vectors(item, stage, q_desc, k_desc, d_desc, v_desc, g_desc, qv, kv_, dv, vv, gv,
                       vready, H, ROWS: gl.constexpr, K: gl.constexpr):
        """Item `item`'s rows of the prep's scratch (q, k, decay, v) and of the gate, [ROWS, K]
        boxes, into stage `stage` of the vector ring."""
        b = item // H
        h = item % H
        bar = vready.index(stage)
        mbarrier.expect(bar, ROWS * K * (4 * 4 + 2))
        tma.async_copy_global_to_shared(q_desc, [b * ROWS, h * K], bar, qv.index(stage))
        tma.async_copy_global_to_shared(k_desc, [b * ROWS, h * K], bar, kv_.index(stage))
        tma.async_copy_global_to_shared(d_desc, [b * ROWS, h * K], bar, dv.index(stage))
        tma.async_copy_global_to_shared(v_desc, [b * ROWS, h * K], bar, vv.index(stage))
        tma.async_copy_global_to_shared(g_desc, [b * ROWS, h * K], bar, gv.index(stage))

    @gluon.jit
    def _row(buf, stage, r, layout: gl.constexpr, ROWS: gl.constexpr, K: gl.constexpr):
        """Row r of a vector-ring stage ([ROWS, K], as TMA wrote it: no swizzle, so rows are
        contiguous) as a [K] vector in `layout`."""
        FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        flat = buf.index(stage)._reinterpret(buf.dtype, [ROWS * K], FLAT)
        return flat.slice(r * K, K).load(layout)

    @gluon.jit
    def kda_state_tma_kernel(state_desc, q_desc, k_desc, d_desc, v_desc, g_desc, bs_ptr, o_ptr,
                             norm_w_ptr, state_ptr, slots_ptr, snap_state_ptr, n_items, H, eps,
                             ROWS: gl.constexpr, K: gl.constexpr, NS: gl.constexpr,
                             HAS_SNAP: gl.constexpr, PDL: gl.constexpr,
                             STATE_FIRST: gl.constexpr):
        """Items (request, head) = b * H + h, program p taking p, p + G, ...; STATE_FIRST (the
        prep's PDL dependent): the first NS states, written before the prep ran, are requested
        before the wait for the prep's scratch, their vectors after it."""
        NW: gl.constexpr = gl.num_warps()
        L: gl.constexpr = gl.BlockedLayout([K // NW, K // 32], [1, 32], [NW, 1], [1, 0])
        KL: gl.constexpr = gl.SliceLayout(1, L)          # along the keys
        VL: gl.constexpr = gl.SliceLayout(0, L)          # along the values
        SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        SH16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
        ring = gl.allocate_shared_memory(gl.float32, [NS, K, K], SH)
        qv = gl.allocate_shared_memory(gl.float32, [NS, ROWS, K], SH)
        kv_ = gl.allocate_shared_memory(gl.float32, [NS, ROWS, K], SH)
        dv = gl.allocate_shared_memory(gl.float32, [NS, ROWS, K], SH)
        vv = gl.allocate_shared_memory(gl.float32, [NS, ROWS, K], SH)
        gv = gl.allocate_shared_memory(gl.bfloat16, [NS, ROWS, K], SH16)
        ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        vready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NS):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(vready.index(s), count=1)
        fence_async_shared()
        sync()
        if PDL and not STATE_FIRST:
            gdc_wait()
            gdc_launch_dependents()
        pid = gl.program_id(0)
        G = gl.num_programs(0)
        n_mine = gl.cdiv(n_items - pid, G)
        for s in gl.static_range(NS):
            if s < n_mine:
                item = pid + s * G
                _issue_state(item, gl.load(slots_ptr + item // H).to(gl.int32), s, state_desc, ring,
                             ready, H, K)
        if PDL and STATE_FIRST:
            gdc_wait()
            gdc_launch_dependents()
        for s in gl.static_range(NS):
            if s < n_mine:
                _issue_vectors(pid + s * G, s, q_desc, k_desc, d_desc, v_desc, g_desc, qv, kv_, dv,
                               vv, gv, vready, H, ROWS, K)
        P = H * K
        offs_k = gl.arange(0, K, KL)
        offs_v = gl.arange(0, K, VL)
        kv = offs_k[:, None] * K + offs_v[None, :]
        norm_w = gl.load(norm_w_ptr + offs_v).to(gl.float32)
        RB: gl.constexpr = 1 if ROWS == 1 else (2 if ROWS == 2 else (4 if ROWS <= 4 else 8))
        rr = gl.arange(0, RB, gl.BlockedLayout([RB], [32], [NW], [0]))
        slot = gl.load(slots_ptr + pid // H)
        for i in range(n_mine):
            item = pid + i * G
            b = item // H
            h = item % H
            live = slot >= 0
            nxt = item + NS * G                 # the item this stage takes next: its slot early
            slot_nxt = gl.load(slots_ptr + gl.minimum(nxt, n_items - 1) // H).to(gl.int32)
            slot_after = gl.load(slots_ptr + gl.minimum(item + G, n_items - 1) // H)
            row0 = (b * ROWS).to(gl.int64)
            betas = gl.load(bs_ptr + (row0 + rr) * H + h, mask=rr < ROWS, other=0.0)
            stage = i % NS
            mbarrier.wait(ready.index(stage), (i // NS) & 1)
            S = ring.index(stage).load(L)
            sync()                       # every warp has its rows of the state: refill the stage
            fence_async_shared()
            if nxt < n_items:
                _issue_state(nxt, slot_nxt, stage, state_desc, ring, ready, H, K)
            S = gl.where(live, S, 0.0)
            mbarrier.wait(vready.index(stage), (i // NS) & 1)
            for r in gl.static_range(ROWS):
                base = (row0 + r) * P + h * K
                beta = gl.sum(gl.where(rr == r, betas, 0.0), axis=0)
                q = _row(qv, stage, r, KL, ROWS, K)
                k = _row(kv_, stage, r, KL, ROWS, K)
                d = _row(dv, stage, r, KL, ROWS, K)
                v = _row(vv, stage, r, VL, ROWS, K)
                gate = _row(gv, stage, r, VL, ROWS, K).to(gl.float32)
                S = S * d[:, None]                                   # decay the key rows
                pred = gl.sum(S * k[:, None], axis=0)                # S^T k
                S = S + k[:, None] * (beta * (v - pred))[None, :]
                o = gl.sum(S * q[:, None], axis=0)
                y = o * gl.rsqrt(gl.sum(o * o, axis=0) / K + eps) * norm_w * \
                    (1.0 / (1.0 + gl.exp(-gate)))
                y = gl.where(live, y, 0.0)      # a padding row's gate may hold anything
                gl.store(o_ptr + base + offs_v, y.to(o_ptr.dtype.element_ty))
                if HAS_SNAP:
                    if live:
                        gl.store(snap_state_ptr + ((row0 + r) * H + h) * K * K + kv, S)
            sync()                       # every warp is done with the item's vectors
            fence_async_shared()
            if nxt < n_items:
                _issue_vectors(nxt, stage, q_desc, k_desc, d_desc, v_desc, g_desc, qv, kv_, dv, vv,
                               gv, vready, H, ROWS, K)
            if live:
                gl.store(state_ptr + (slot * H + h).to(gl.int64) * K * K + kv, S,
                         cache_modifier=".cs")
            slot = slot_after


def why_not(K: int, device: torch.device) -> str | None:
    """Why the TMA state pass cannot run this call, or None."""
    from k31c.lowering.triton.gluon_sm90 import why_not_sm90
    if K != K_TMA:
        return f"the TMA state pass is written for K = {K_TMA}, not {K}"
    return why_not_sm90(device)


def shared_layout(bits: int = 32):
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=bits, rank=2)


def _descriptor(t: torch.Tensor, block: list):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    return TensorDescriptor(t, list(t.shape), [t.shape[1], 1], block,
                            shared_layout(t.element_size() * 8))


def descriptors(recurrent: torch.Tensor, rows: int, qs, ks, ds, vs, gate) -> list:
    """The recurrent state [slots, H, K, K] fp32 as [slots * H * K, K] rows (boxes of a head),
    and the prep's scratch and the gate, [N, H * K], in boxes of a request's rows of a head."""
    K = recurrent.shape[-1]
    state = recurrent.view(recurrent.numel() // K, K)
    return [_descriptor(state, [K, K])] + [_descriptor(t, [rows, K]) for t in (qs, ks, ds, vs, gate)]


def launch_state(rows: int, qs, ks, vs, ds, bs, out, gate, norm_w, recurrent, slots, snap_state,
                 H: int, eps: float, sm_count: int, pdl: bool, state_first: bool,
                 stages: int = STAGES, programs: int | None = None) -> None:
    """The state pass over B requests x H heads into `out` (normed, the output dtype), one
    program an SM (`programs` overrides); callers check `why_not` first. pdl: launched as the
    PDL dependent of the prep (state_first: its first states requested before the wait)."""
    K = recurrent.shape[-1]
    n_items = slots.shape[0] * H
    grid = max(1, min(n_items, programs or sm_count))
    has_snap = snap_state is not None
    kda_state_tma_kernel[(grid,)](
        *descriptors(recurrent, rows, qs, ks, ds, vs, gate), bs, out, norm_w, recurrent, slots,
        snap_state if has_snap else recurrent, n_items, H, float(eps),
        ROWS=rows, K=K, NS=stages, HAS_SNAP=has_snap, PDL=pdl, STATE_FIRST=pdl and state_first,
        num_warps=NUM_WARPS, **({"launch_pdl": True} if pdl else {}))
