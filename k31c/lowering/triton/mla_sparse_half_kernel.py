"""The half-release seesaw's Gluon kernel (sm_90a): the sparse MLA for bf16 latent rows over 64-key
blocks. Its launch plan, launcher and ahead-of-time builds are in mla_sparse_half.py.

One program per (query row, 64-head tile, key split), as in mla_sparse_ws.py. Shared memory: q
[64, 576] and two [64, 576] key buffers (a pair's block a in buffer 0, block b in buffer 1), each
in two halves with their own `ready` / `free` barriers: L = value columns 0-255, R = value
columns 256-511 with the rope part. Beside the rows, each buffer's 64 selected positions (copied
with them), from which the math groups make their key masks after the scores' wait. P of block a
lives over buffer 0's rope part once block a is scored, P of block b in a buffer of its own.

- group 0 scores block a (L, then R), takes its row max m0, hands it over, runs P0 (registers)
  @ V0[:, :256] and frees 0.L; takes the pair max m01 back, rescales P0 to it and stores it for
  group 1; then P1 (shared) @ V1[:, :256]; issues the next block a's scores and frees 1.L once
  its value product is done.
- group 1 scores block b (R first), takes m0, makes m01, hands it back, stores P1, then runs
  P0 (shared) @ V0[:, 256:] and P1 (registers) @ V1[:, 256:]; frees 0.R, then 1.R.
- the producer refills block a whole, then block b (0.L, 0.R, 1.R, 1.L), each row piece a
  16-byte cp.async of threads [4 rows, 8 columns]: a warp copies four whole 128-byte lines an
  instruction (as [8, 4], half lines of eight rows, the gathers alone ran 1.66x slower), and a
  half's value columns are one [64, 256] copy, so a thread issues a row's four lines one after
  another (four [64, 64] copies issued line c of each of its rows, then line c + 1). The next
  pair's positions load at an iteration's start, its block-table entries halfway, so no copy's
  address waits on a global load issued just before it.
The next block a cannot be scored before 0.R, the last half its value products free, is refilled:
that refill is the loop's critical path, so group 1 frees 0.R first and the producer copies it
second, not in the order the halves are freed.
Each group owns 256 output columns, so each value half is read by one group only, and a half is
refilled while the other half of the same block is still being read.

The schedule is the one FlashMLA's SM90 sparse prefill kernel uses (read, not copied). What it
and its variants measured: BENCHMARKS.md, "Whole-line gathers" and "The half seesaw registered,
refilling block a whole first".
"""
from __future__ import annotations

from k31c.lowering.triton.gluon_sm90 import GLUON_ERROR
from k31c.lowering.triton.mla_seesaw import DV, WIDTH

HEADS_TILE = 64                     # one wgmma M: the heads a program takes
KEYS_STEP = 128                     # selected rows a pair of blocks holds (a split's unit)

if GLUON_ERROR is None:
    from k31c.lowering.triton.gluon_sm90 import (async_copy, fence_async_shared, gl, gluon, mbarrier,
                                                 sync, warpgroup_mma, warpgroup_mma_wait)
    # the output layout is the seesaw's: its row_sums normalises this kernel's accumulators
    from k31c.lowering.triton.mla_seesaw import O_L, ROW_O, row_sums, store_q

    V_COLS = gl.constexpr(DV)               # the constants below, as the kernels see them
    ROW_W = gl.constexpr(WIDTH)
    PAIR_KEYS = gl.constexpr(KEYS_STEP)
    TILE_HEADS = gl.constexpr(HEADS_TILE)
    MATH_REGS = gl.constexpr(224)   # each math group's; the producer runs on the 64 left
    S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, 64, 16]))
    ROW_S = gl.constexpr(gl.SliceLayout(1, S_L))
    P_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2))
    G_L = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))   # copies: whole 128-byte lines

    @gluon.jit
    def _buffers():
        SH_W: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 512], gl.bfloat16)
        SH_R: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
        # q with a leading dimension of 1, indexed by an opaque 0 (mla_seesaw.seesaw_buffers)
        qv = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 512], SH_W)
        qr = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 64], SH_R)
        kv = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 512], SH_W)
        kr = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], SH_R)
        s1 = gl.allocate_shared_memory(gl.bfloat16, [64, 64], SH_R)
        # each buffer's positions beside its rows: no key mask held in registers across a wait
        pos_s = gl.allocate_shared_memory(gl.int32, [2, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        VEC: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        m_a = gl.allocate_shared_memory(gl.float32, [64], VEC)
        m_b = gl.allocate_shared_memory(gl.float32, [64], VEC)
        l_a = gl.allocate_shared_memory(gl.float32, [64], VEC)
        l_b = gl.allocate_shared_memory(gl.float32, [64], VEC)
        # ready / free: [buffer * 2 + half] (half 0: L, 1: R); xbar: m0, m01, P0 stored, P1 stored
        ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        xbar = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        fin = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(4):
            mbarrier.init(ready.index(i), count=128)
            mbarrier.init(free.index(i), count=1)
            mbarrier.init(xbar.index(i), count=1)
        mbarrier.init(fin, count=2)
        return qv, qr, kv, kr, s1, pos_s, m_a, m_b, l_a, l_b, ready, free, xbar, fin

    @gluon.jit
    def _positions(idx_row, n_keys, blk_i, rows):
        return gl.load(idx_row + blk_i * 64 + rows, mask=blk_i * 64 + rows < n_keys, other=-1)

    @gluon.jit
    def _table(table_row, pos, BLOCK_SIZE: gl.constexpr):
        # the cache block of each position (issued half an iteration before its rows are needed)
        return gl.load(table_row + gl.maximum(pos, 0) // BLOCK_SIZE, mask=pos >= 0, other=0)

    @gluon.jit
    def _lookup(pos, blk, BLOCK_SIZE: gl.constexpr):
        # the cache row, int32 (2^31 rows would be 2.4 TB), widened where it is used: the
        # producer runs on the registers the math groups leave it
        return gl.maximum(blk, 0) * BLOCK_SIZE + gl.maximum(pos, 0) % BLOCK_SIZE

    @gluon.jit
    def _copy_half(cache_ptr, pos, row, kv, kr, ready, free, i: gl.constexpr, HALF: gl.constexpr,
                   phase, pos_s, idx_at, n_keys):
        # rows `row` (pos < 0: zero-filled) into half HALF of buffer i, once it is free
        # the half's 256 value columns as one [64, 256] copy, so each thread issues a row's four
        # 128-byte pieces one after another; the rope part as a [64, 64] copy
        row_at = gl.expand_dims(gl.multiple_of(row.to(gl.int64) * ROW_W, 64), 1)
        cols = gl.max_contiguous(gl.multiple_of(gl.arange(0, 256, gl.SliceLayout(0, G_L)), 8), 8)
        live = gl.expand_dims(pos >= 0, 1)
        mbarrier.wait(free.index(i * 2 + HALF), phase)
        async_copy.async_copy_global_to_shared(
            kv.index(i).slice(256 * HALF, 256, dim=1), cache_ptr + row_at + gl.expand_dims(cols, 0)
            + 256 * HALF, mask=live & gl.expand_dims(cols >= 0, 0))
        if HALF == 1:
            rope = gl.max_contiguous(gl.multiple_of(gl.arange(0, 64, gl.SliceLayout(0, G_L)), 8), 8)
            async_copy.async_copy_global_to_shared(
                kr.index(i), cache_ptr + row_at + gl.expand_dims(rope, 0) + V_COLS,
                mask=live & gl.expand_dims(rope >= 0, 0))
        if HALF == 1 - i:       # the positions, with the half its group waits for first
            P_L: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])
            k = gl.max_contiguous(gl.multiple_of(gl.arange(0, 64, P_L), 2), 2)
            async_copy.async_copy_global_to_shared(pos_s.index(i), idx_at + k, mask=k < n_keys)
        async_copy.mbarrier_arrive(ready.index(i * 2 + HALF), increment_count=False)

    @gluon.jit
    def _producer(cache_ptr, table_row, idx_row, n_keys, kv, kr, pos_s, ready, free, n_pairs,
                  BLOCK_SIZE: gl.constexpr):
        rows = gl.arange(0, 64, gl.SliceLayout(1, G_L))
        pos_a = _positions(idx_row, n_keys, 0, rows)
        pos_b = _positions(idx_row, n_keys, 1, rows)
        blk_a = _table(table_row, pos_a, BLOCK_SIZE)
        blk_b = _table(table_row, pos_b, BLOCK_SIZE)
        for j in range(n_pairs):
            phase = (j & 1) ^ 1
            pos_a2 = _positions(idx_row, n_keys, 2 * j + 2, rows)
            pos_b2 = _positions(idx_row, n_keys, 2 * j + 3, rows)
            row_a = _lookup(pos_a, blk_a, BLOCK_SIZE)
            row_b = _lookup(pos_b, blk_b, BLOCK_SIZE)
            at_a, left_a = idx_row + (2 * j) * 64, n_keys - (2 * j) * 64
            at_b, left_b = idx_row + (2 * j + 1) * 64, n_keys - (2 * j + 1) * 64
            _copy_half(cache_ptr, pos_a, row_a, kv, kr, ready, free, 0, 0, phase, pos_s, at_a, left_a)
            _copy_half(cache_ptr, pos_a, row_a, kv, kr, ready, free, 0, 1, phase, pos_s, at_a, left_a)
            blk_a = _table(table_row, pos_a2, BLOCK_SIZE)
            blk_b = _table(table_row, pos_b2, BLOCK_SIZE)
            _copy_half(cache_ptr, pos_b, row_b, kv, kr, ready, free, 1, 1, phase, pos_s, at_b, left_b)
            _copy_half(cache_ptr, pos_b, row_b, kv, kr, ready, free, 1, 0, phase, pos_s, at_b, left_b)
            pos_a, pos_b = pos_a2, pos_b2

    @gluon.jit
    def _scores_l(qv, kv, zr, i: gl.constexpr, s, FIRST: gl.constexpr):
        return warpgroup_mma(qv.index(zr).slice(0, 256, dim=1),
                             kv.index(i).slice(0, 256, dim=1).permute((1, 0)),
                             s, use_acc=not FIRST, is_async=True)

    @gluon.jit
    def _scores_r(qv, qr, kv, kr, zr, i: gl.constexpr, s, FIRST: gl.constexpr):
        s = warpgroup_mma(qv.index(zr).slice(256, 256, dim=1),
                          kv.index(i).slice(256, 256, dim=1).permute((1, 0)),
                          s, use_acc=not FIRST, is_async=True)
        return warpgroup_mma(qr.index(zr), kr.index(i).permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _arrive(bar):
        sync()
        mbarrier.arrive(bar, count=1)

    @gluon.jit
    def _masked(s, pos_s, i: gl.constexpr, first_key, n_keys, scale_log2):
        # scores in log2 units; -inf where the position is -1 or past the row's keys
        key = gl.arange(0, 64, gl.SliceLayout(0, S_L))
        keep = (pos_s.index(i).load(gl.SliceLayout(0, S_L)) >= 0) & (first_key + key < n_keys)
        return gl.where(gl.expand_dims(keep, 0), s * scale_log2, float("-inf"))

    @gluon.jit
    def _group0(qv, qr, kv, kr, s1, pos_s, m_a, m_b, l_a, l_b, ready, free, xbar, fin, n_keys,
                n_pairs, scale_log2, out_ptr, lse_ptr, head0, n_heads, empty_lse):
        P_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
        s0_smem = kr.index(0)._reinterpret(gl.bfloat16, [64, 64], P_SH)     # over block a's rope
        m_i = gl.full([64], float("-inf"), gl.float32, ROW_S)
        l_i = gl.zeros([64], gl.float32, ROW_S)
        acc = gl.zeros([64, 256], gl.float32, O_L)
        zero_s = gl.zeros([64, 64], gl.float32, S_L)
        some = n_pairs > 0                               # (no pair: scores of nothing, discarded)
        mbarrier.wait(ready.index(0), 0, pred=some)
        s = _scores_l(qv, kv, 0, 0, zero_s, True)
        mbarrier.wait(ready.index(1), 0, pred=some)
        s = _scores_r(qv, qr, kv, kr, 0, 0, s, False)
        for j in range(n_pairs):
            ph = j & 1
            zr = j // (n_pairs + 1)                      # the opaque 0
            sv = _masked(warpgroup_mma_wait(0, deps=(s,)), pos_s, 0, 2 * j * 64, n_keys, scale_log2)
            m0 = gl.maximum(m_i, gl.max(sv, 1))
            m0_use = gl.where(m0 == float("-inf"), 0.0, m0)
            m_a.store(m0)
            _arrive(xbar.index(0))                       # m0 to group 1
            p = gl.exp2(sv - gl.expand_dims(m0_use, 1))
            alpha = gl.exp2(m_i - m0_use)
            l_i = l_i * alpha + gl.sum(p, 1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
            acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), P_OP),
                                kv.index(0).slice(0, 256, dim=1), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            _arrive(free.index(0))                       # 0.L
            mbarrier.wait(xbar.index(1), ph)             # the pair max
            m01 = m_b.load(ROW_S)
            m01_use = gl.where(m01 == float("-inf"), 0.0, m01)
            beta = gl.exp2(m0 - m01_use)                 # m0 = -inf: 0 (p and acc are 0)
            s0_smem.store((p * gl.expand_dims(beta, 1)).to(gl.bfloat16))
            fence_async_shared()
            _arrive(xbar.index(2))                       # P0 stored
            l_i = l_i * beta
            acc = acc * gl.expand_dims(gl.convert_layout(beta, ROW_O), 1)
            mbarrier.wait(xbar.index(3), ph)             # P1 stored
            acc = warpgroup_mma(s1, kv.index(1).slice(0, 256, dim=1), acc, is_async=True)
            # the next block a's scores (after the last pair: on stale buffers, discarded, so
            # that `s` stays an issued wgmma across iterations)
            nxt = j + 1 < n_pairs
            mbarrier.wait(ready.index(0), ph ^ 1, pred=nxt)
            s = _scores_l(qv, kv, zr, 0, zero_s, True)
            acc = warpgroup_mma_wait(1, deps=(acc,))
            _arrive(free.index(2))                       # 1.L
            mbarrier.wait(ready.index(1), ph ^ 1, pred=nxt)
            s = _scores_r(qv, qr, kv, kr, zr, 0, s, False)
            m_i = m01
        warpgroup_mma_wait(0, deps=(s,))
        out, l_i, has = row_sums(0, l_i, acc, l_a, l_b, fin)
        _store(out, 0, out_ptr, head0, n_heads)
        h_s = head0 + gl.arange(0, 64, ROW_S)
        lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, empty_lse)
        gl.store(lse_ptr + h_s, lse, mask=h_s < n_heads)

    @gluon.jit
    def _group1(qv, qr, kv, kr, s1, pos_s, m_a, m_b, l_a, l_b, ready, free, xbar, fin, n_keys,
                n_pairs, scale_log2, out_ptr, lse_ptr, head0, n_heads, empty_lse):
        P_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
        s0_smem = kr.index(0)._reinterpret(gl.bfloat16, [64, 64], P_SH)
        m_i = gl.full([64], float("-inf"), gl.float32, ROW_S)
        l_i = gl.zeros([64], gl.float32, ROW_S)
        acc = gl.zeros([64, 256], gl.float32, O_L)
        zero_s = gl.zeros([64, 64], gl.float32, S_L)
        for j in range(n_pairs):
            ph = j & 1
            zr = j // (n_pairs + 1)
            mbarrier.wait(ready.index(3), ph)            # 1.R first
            s = _scores_r(qv, qr, kv, kr, zr, 1, zero_s, True)
            mbarrier.wait(ready.index(2), ph)
            s = _scores_l(qv, kv, zr, 1, s, False)
            sv = _masked(warpgroup_mma_wait(0, deps=(s,)), pos_s, 1, (2 * j + 1) * 64, n_keys,
                         scale_log2)
            mbarrier.wait(xbar.index(0), ph)             # m0
            m0 = m_a.load(ROW_S)
            m01 = gl.maximum(m0, gl.max(sv, 1))
            m01_use = gl.where(m01 == float("-inf"), 0.0, m01)
            m_b.store(m01)
            _arrive(xbar.index(1))                       # the pair max to group 0
            p = gl.exp2(sv - gl.expand_dims(m01_use, 1))
            gamma = gl.exp2(m_i - m01_use)
            l_i = l_i * gamma + gl.sum(p, 1)
            acc = acc * gl.expand_dims(gl.convert_layout(gamma, ROW_O), 1)
            pb = p.to(gl.bfloat16)
            s1.store(pb)
            fence_async_shared()
            _arrive(xbar.index(3))                       # P1 stored
            mbarrier.wait(xbar.index(2), ph)             # P0 stored
            acc = warpgroup_mma(s0_smem, kv.index(0).slice(256, 256, dim=1), acc, is_async=True)
            acc = warpgroup_mma(gl.convert_layout(pb, P_OP), kv.index(1).slice(256, 256, dim=1),
                                acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))
            _arrive(free.index(1))                       # 0.R (and P0's place)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            _arrive(free.index(3))                       # 1.R
            m_i = m01
        out, l_i, has = row_sums(1, l_i, acc, l_a, l_b, fin)
        _store(out, 1, out_ptr, head0, n_heads)

    @gluon.jit
    def _store(out, ROLE: gl.constexpr, out_ptr, head0, n_heads):
        h_o = head0 + gl.arange(0, 64, ROW_O)
        c_o = ROLE * 256 + gl.arange(0, 256, gl.SliceLayout(0, O_L))
        o_mask = gl.expand_dims(h_o < n_heads, 1) & gl.expand_dims(c_o >= 0, 0)
        gl.store(out_ptr + gl.expand_dims(h_o * V_COLS, 1) + gl.expand_dims(c_o, 0),
                 out.to(out_ptr.dtype.element_ty), mask=o_mask)

    @gluon.jit
    def sparse_half_kernel(q_ptr, cache_ptr, table_ptr, req_ptr, idx_ptr, out_ptr, lse_ptr, n_rows,
                            n_heads, n_tiles, n_keys, n_splits, keys_per_split, stride_qn, stride_qh,
                            stride_in, stride_bt, scale_log2, empty_lse, BLOCK_SIZE: gl.constexpr,
                            num_warps: gl.constexpr):
        pid = gl.program_id(0)
        tile = pid % n_tiles
        split = (pid // n_tiles) % n_splits
        t = pid // (n_tiles * n_splits)
        head0 = tile * TILE_HEADS
        qv, qr, kv, kr, s1, pos_s, m_a, m_b, l_a, l_b, ready, free, xbar, fin = _buffers()
        Q_L: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [num_warps, 1], [1, 0])
        h = head0 + gl.arange(0, 64, gl.SliceLayout(1, Q_L))
        c = gl.arange(0, 64, gl.SliceLayout(0, Q_L))
        q_mask = gl.expand_dims(h < n_heads, 1) & gl.expand_dims(c >= 0, 0)
        q_at = q_ptr + t.to(gl.int64) * stride_qn + gl.expand_dims(h * stride_qh, 1) + gl.expand_dims(c, 0)
        store_q(qv, qr, q_at, q_mask, 1.0)
        idx_row = idx_ptr + t.to(gl.int64) * stride_in + split * keys_per_split
        n_here = gl.maximum(gl.minimum(keys_per_split, n_keys - split * keys_per_split), 0)
        table_row = table_ptr + gl.load(req_ptr + t).to(gl.int64) * stride_bt
        n_pairs = gl.cdiv(n_here, PAIR_KEYS)
        row_out = (split.to(gl.int64) * n_rows + t) * n_heads
        math = (qv, qr, kv, kr, s1, pos_s, m_a, m_b, l_a, l_b, ready, free, xbar, fin, n_here,
                n_pairs, scale_log2, out_ptr + row_out * V_COLS, lse_ptr + row_out, head0, n_heads,
                empty_lse)
        gl.warp_specialize([
            (_producer, (cache_ptr, table_row, idx_row, n_here, kv, kr, pos_s, ready, free,
                         n_pairs, BLOCK_SIZE)),
            (_group0, math),
            (_group1, math)],
            [4, 4], [MATH_REGS, MATH_REGS])
