"""The seesaw of two math warp groups that the Gluon MLA kernels share: one pair of key blocks
(a, b) a step, 32-key blocks in the sparse kernel (mla_sparse_ws.py), whole 64-row cache blocks
in chunked buffers in the dense one (mla_dense_ws_kernel.py). Group 0 scores block a while
group 1 scores block b; group 0 turns its scores into weights under the running max and passes
P (over block a's rope part, dead once scored) and the max to group 1 through shared memory,
which does the same for block b and passes back. Each group accumulates both blocks' values
into its 256 output columns, rescaling when the max moves, and sums the P of its own blocks;
the sums are added at the end (`row_sums`). The sparse kernel also takes its buffers from
`seesaw_buffers`. A leaf below the kernels: registers nothing."""
from __future__ import annotations

import torch

from k31c.graph.ops.fp8_layouts import latent_fp8_row_bytes
from k31c.lowering.triton.gluon_sm90 import GLUON_ERROR
from k31c.lowering.triton.mla_common import LOG2E

WIDTH, DV = 576, 512                # the latent row the seesaw kernels are written for (K3.1 Pro)


FP8_ROW = latent_fp8_row_bytes(DV, WIDTH - DV)       # an FP8 latent row's bytes (656)
# FP8 latent rows run the latent products in f16, not bf16: the dequant is then one cvt and one
# multiply a value pair (`dequant_e4m3`), and f16 keeps 3 more mantissa bits. q is scaled by
# FP8_Q_MUL (exact) before its f16 rounding, so |q| up to 2^20 fits; `scores_scale_log2`
# divides it back out.
FP8_Q_MUL = 2.0 ** -4


def scores_scale_log2(sm_scale: float, rows_fp8: bool) -> float:
    """The kernels' scale of raw scores to log2 units: sm_scale·log2(e), with FP8_Q_MUL divided
    back out for FP8 latent rows."""
    return float(sm_scale) * LOG2E / (FP8_Q_MUL if rows_fp8 else 1.0)


def latent_reason(q, latent_cache, dv: int, fp8: bool = False) -> str | None:
    """Why a seesaw kernel cannot take these arguments by Triton, dtype and width, or None.
    fp8: the kernel also takes FP8 latent rows (a uint8 cache of FP8_ROW-byte rows)."""
    if GLUON_ERROR is not None:
        return f"this Triton has no Gluon Hopper API ({GLUON_ERROR})"
    rows_fp8 = fp8 and latent_cache.dtype == torch.uint8
    if q.dtype != torch.bfloat16 or (latent_cache.dtype != torch.bfloat16 and not rows_fp8):
        kinds = "bf16 or FP8 latent rows" if fp8 else "bf16 only"
        return f"q {q.dtype} / cache {latent_cache.dtype}: the kernel is {kinds}"
    row = FP8_ROW if rows_fp8 else WIDTH
    if q.shape[2] != WIDTH or latent_cache.shape[2] != row or dv != DV:
        return (f"width {q.shape[2]} / cache row {latent_cache.shape[2]} / dv {dv}: the kernel is "
                f"written for {WIDTH} / {row} / {DV}")
    return None


if GLUON_ERROR is None:
    from k31c.lowering.triton.gluon_sm90 import (fence_async_shared, gl, gluon, mbarrier, sync,
                                                 warpgroup_mma, warpgroup_mma_wait)

    Q_MUL_FP8 = gl.constexpr(FP8_Q_MUL)
    BK = gl.constexpr(32)               # keys a block (a buffer)
    NB = gl.constexpr(4)                # buffers: two pairs of blocks
    # a math group's scores [64, 32] and its half of the output [64, 256], and their rows
    S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, 32, 16]))
    O_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, 256, 16]))
    ROW_S = gl.constexpr(gl.SliceLayout(1, S_L))
    ROW_O = gl.constexpr(gl.SliceLayout(1, O_L))
    # the FP8 dequant's [32, 128] e4m3 groups: a half warp a row, so each bf16 store fills whole
    # 128-byte swizzle rows (16 values a thread put two rows' half rows in each store: 2-way
    # bank conflicts)
    DEQUANT_L = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))

    @gluon.jit
    def dequant_e4m3(x, scl, g: gl.constexpr, LAYOUT: gl.constexpr, DT: gl.constexpr):
        """Staged e4m3 bytes x [rows, 128] (one scale group) -> f16: e4m3 to f16 exactly (one
        cvt a value pair), times each row's scale g of scl ([rows, 4] fp32 in shared memory)
        rounded to f16 (one HMUL2 a pair), then to DT, the buffer's type (f16; Triton 3.6
        traces this in the bf16 builds too, as dead code, so it must type-check there).
        Against the fp32 product: 2^-10 relative error (bf16 rounding alone is 2^-9) and 2^-25
        absolute (products below f16's normals) where the scale is an f16 normal (a group max
        >= 0.0273); up to 1.3e-5 absolute more where it is not
        (tests/lowering/test_triton_mla_fp8.py)."""
        s = scl.slice(g, 1, dim=1).load(LAYOUT)                               # [rows, 1] fp32
        return (x.to(gl.float8e4nv, bitcast=True).to(gl.float16) * s.to(gl.float16)).to(DT)

    @gluon.jit
    def seesaw_buffers(READY_COUNT: gl.constexpr, VDT: gl.constexpr):
        """The shared memory of a seesaw program: q [64, 512] + [64, 64] (with a leading
        dimension of 1: the math groups index it with an opaque 0, or its loop-invariant wgmma
        descriptors are hoisted and spill), NB [32, 512] + [32, 64] key buffers, the exchanged
        maxima and row sums, and the barriers, initialised: ready (READY_COUNT arrivals a fill),
        empty (both groups' values read the buffer), p_bar (each group's P), fin (the sums).
        q's latent part, the key buffers and P are VDT (f16 for FP8 latent rows, else bf16);
        q's rope part bf16."""
        SH_W: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 512], VDT)
        SH_R: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
        qv_smem = gl.allocate_shared_memory(VDT, [1, 64, 512], SH_W)
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 64], SH_R)
        SH_BW: gl.constexpr = gl.NVMMASharedLayout.get_default_for([32, 512], VDT)
        SH_BR: gl.constexpr = gl.NVMMASharedLayout.get_default_for([32, 64], gl.bfloat16)
        kv_bufs = gl.allocate_shared_memory(VDT, [NB, BK, 512], SH_BW)
        kr_bufs = gl.allocate_shared_memory(gl.bfloat16, [NB, BK, 64], SH_BR)
        VEC: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        m_a = gl.allocate_shared_memory(gl.float32, [64], VEC)
        m_b = gl.allocate_shared_memory(gl.float32, [64], VEC)
        l_a = gl.allocate_shared_memory(gl.float32, [64], VEC)
        l_b = gl.allocate_shared_memory(gl.float32, [64], VEC)
        ready = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
        p_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        fin = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for b in gl.static_range(NB):
            mbarrier.init(ready.index(b), count=READY_COUNT)
            mbarrier.init(empty.index(b), count=2)
        for b in gl.static_range(2):
            mbarrier.init(p_bar.index(b), count=1)
        mbarrier.init(fin, count=2)
        return qv_smem, qr_smem, kv_bufs, kr_bufs, m_a, m_b, l_a, l_b, ready, empty, p_bar, fin

    @gluon.jit
    def store_q(qv_smem, qr_smem, q_at, q_mask, Q_MUL: gl.constexpr):
        """q's 64 rows (pointers q_at [64, 64] to each row's first 64 columns; masked rows
        read zeros) times Q_MUL (a power of two, exact) into shared memory in its buffers'
        types, fenced for the wgmmas."""
        for j in gl.static_range(8):
            x = gl.load(q_at + 64 * j, mask=q_mask, other=0.0)
            if Q_MUL != 1.0:
                x = x * Q_MUL
            qv_smem.index(0).slice(64 * j, 64, dim=1).store(x.to(qv_smem.dtype))
        x = gl.load(q_at + 512, mask=q_mask, other=0.0)
        if Q_MUL != 1.0:
            x = x * Q_MUL
        qr_smem.index(0).store(x.to(qr_smem.dtype))
        fence_async_shared()
        sync()

    @gluon.jit
    def weights(s, keep, m_ref, scale_log2, p_smem, m_smem, bar):
        # a block's scores -> its weights P under the running max m = max(m_ref, the block's):
        # P (the value type, over the block's rope part) and m go to shared memory for the
        # other group
        s = gl.where(keep, s * scale_log2, float("-inf"))
        m = gl.maximum(m_ref, gl.max(s, 1))
        m_use = gl.where(m == float("-inf"), 0.0, m)      # no key yet: weights 0
        p = gl.exp2(s - gl.expand_dims(m_use, 1))
        p_smem.store(p.to(p_smem.dtype))
        m_smem.store(m)
        fence_async_shared()
        sync()
        mbarrier.arrive(bar, count=1)
        return m, m_use, p

    @gluon.jit
    def zero_tail(buf, first, limit, COL0: gl.constexpr):
        # a block's rows at positions >= limit (past every selected row's length), in this
        # group's value columns, set to 0: unwritten slots may hold NaN, and 0 x NaN is NaN in
        # P @ V. Called once no wgmma reads those columns of the block but this group's next.
        Z_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        KEYS: gl.constexpr = buf.shape[0]
        keep = gl.expand_dims(first + gl.arange(0, KEYS, gl.SliceLayout(1, Z_L)) < limit, 1)
        for c in gl.static_range(4):
            part = buf.slice(COL0 + 64 * c, 64, dim=1)
            x = part.load(Z_L)
            part.store(gl.where(keep, x, gl.zeros_like(x)))
        fence_async_shared()
        sync()

    @gluon.jit
    def pair_views(ROLE: gl.constexpr, kv_bufs, kr_bufs, ba):
        """The pair's P (over each block's rope part: [64 pairs, the block's keys]) and this
        group's value columns of each block, in buffers ba (block a) and ba + 1 (block b)."""
        KEYS: gl.constexpr = kv_bufs.shape[1]
        VDT: gl.constexpr = kv_bufs.dtype
        P_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, KEYS], VDT)
        pa = kr_bufs.index(ba)._reinterpret(VDT, [64, KEYS], P_SH)
        pb = kr_bufs.index(ba + 1)._reinterpret(VDT, [64, KEYS], P_SH)
        va = kv_bufs.index(ba).slice(ROLE * 256, 256, dim=1)
        vb = kv_bufs.index(ba + 1).slice(ROLE * 256, 256, dim=1)
        return pa, pb, va, vb

    @gluon.jit
    def release_chunks(empty, G0: gl.constexpr, G1: gl.constexpr, ROPE: gl.constexpr):
        """One arrival on a chunked buffer's value chunk groups G0..G1-1 (`empty`: its three
        barriers, values 0-3, values 4-7, the rope part) and on its rope group if ROPE;
        callers sync their warp group first."""
        for g in gl.static_range(G0, G1):
            mbarrier.arrive(empty[g], count=1)
        if ROPE:
            mbarrier.arrive(empty[2], count=1)

    @gluon.jit
    def _release_scored(ROLE: gl.constexpr, empty, CHUNKED: gl.constexpr):
        # the scorer is done with its block's value chunks (chunked buffers only)
        if CHUNKED:
            release_chunks(empty[ROLE], 0, 2, False)

    @gluon.jit
    def _release_read(ROLE: gl.constexpr, empty, ba, B: gl.constexpr, CHUNKED: gl.constexpr):
        # this group is done with block B of the pair (its P @ V): its value columns and P
        if CHUNKED:
            release_chunks(empty[B], ROLE, ROLE + 1, True)
        else:
            mbarrier.arrive(empty.index(ba + B), count=1)

    @gluon.jit
    def seesaw_pair(ROLE: gl.constexpr, s, keep, m_i, l_i, acc, views, kv_bufs, ba, m_a, m_b,
                    p_bar, empty, ph, scale_log2, TAIL: gl.constexpr, tail, first, limit,
                    CHUNKED: gl.constexpr):
        """One pair's step for math group ROLE, from its block's scores `s` (wgmma issued, not
        waited) and their key mask `keep`: returns the running max, row sum and accumulator
        after both blocks. `views`: `pair_views` of buffers ba (block a) and ba + 1 (block b).
        TAIL: zero the value rows at positions >= limit (`zero_tail`) where the runtime `tail`
        says the pair holds any. `empty`: the buffers' release barriers, one a buffer (both
        groups arrive once they have read it), or CHUNKED (the dense kernel's 64-row blocks):
        a pair (block a's, block b's) of `release_chunks` groups, a value chunk group released
        by its block's scorer and its owner, the rope part (P) by both groups."""
        col0: gl.constexpr = ROLE * 256
        KEYS: gl.constexpr = kv_bufs.shape[1]
        ROW: gl.constexpr = m_i.type.layout
        pa, pb, va, vb = views
        if ROLE == 0:
            s = warpgroup_mma_wait(0, deps=(s,))
            if TAIL:
                if tail:                                # block a: scored (by this group)
                    zero_tail(kv_bufs.index(ba), first, limit, col0)
            m0, m0_use, p = weights(s, keep, m_i, scale_log2, pa, m_a, p_bar.index(0))
            _release_scored(0, empty, CHUNKED)
            alpha = gl.exp2(m_i - m0_use)
            l_i = l_i * alpha + gl.sum(p, 1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
            acc = warpgroup_mma(pa, va, acc, is_async=True)
            mbarrier.wait(p_bar.index(1), ph)
            m1 = m_b.load(ROW)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            if TAIL:
                if tail:                                # block b: group 1 has scored it
                    zero_tail(kv_bufs.index(ba + 1), first + KEYS, limit, col0)
            sync()
            _release_read(0, empty, ba, 0, CHUNKED)
            m1_use = gl.where(m1 == float("-inf"), 0.0, m1)
            beta = gl.exp2(m0 - m1_use)
            l_i = l_i * beta
            acc = acc * gl.expand_dims(gl.convert_layout(beta, ROW_O), 1)
        else:
            mbarrier.wait(p_bar.index(0), ph)
            m0 = m_a.load(ROW)
            m0_use = gl.where(m0 == float("-inf"), 0.0, m0)
            alpha = gl.exp2(m_i - m0_use)
            l_i = l_i * alpha
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
            if TAIL:
                if tail:                                # block a: group 0 has scored it
                    zero_tail(kv_bufs.index(ba), first, limit, col0)
            acc = warpgroup_mma(pa, va, acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s,))
            if TAIL:
                if tail:                                # block b: scored (by this group)
                    zero_tail(kv_bufs.index(ba + 1), first + KEYS, limit, col0)
            m1, m1_use, p = weights(s, keep, m0, scale_log2, pb, m_b, p_bar.index(1))
            _release_scored(1, empty, CHUNKED)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            sync()
            _release_read(1, empty, ba, 0, CHUNKED)
            beta = gl.exp2(m0 - m1_use)
            l_i = l_i * beta + gl.sum(p, 1)
            acc = acc * gl.expand_dims(gl.convert_layout(beta, ROW_O), 1)
        # block b's values, then its buffer is free as far as this group goes
        acc = warpgroup_mma(pb, vb, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        sync()
        _release_read(ROLE, empty, ba, 1, CHUNKED)
        return m1, l_i, acc

    @gluon.jit
    def row_sums(ROLE: gl.constexpr, l_i, acc, l_a, l_b, fin):
        """After the last pair: the row sums of both groups' blocks (each summed its own), and
        this group's output columns normalised by them (0 where a row saw no key)."""
        if ROLE == 0:
            l_a.store(l_i)
        else:
            l_b.store(l_i)
        sync()
        mbarrier.arrive(fin, count=1)
        mbarrier.wait(fin, 0)
        l_i = l_a.load(l_i.type.layout) + l_b.load(l_i.type.layout)
        has = l_i > 0
        out = acc / gl.expand_dims(gl.convert_layout(gl.where(has, l_i, 1.0), ROW_O), 1)
        return out, l_i, has
