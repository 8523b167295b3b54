"""The Gluon kernel of `mla_dense_ws.py` (warp-specialized dense MLA on sm_90a); that module's
docstring describes it, and its launcher and `aot_specs` are the only callers.

Terms: a *group* is G consecutive query rows (the R rows of a request in the decode layout), its
(row, head) pairs numbered m = r·H + h; a *slab* is 64 consecutive pairs of a group (one wgmma
M); a *pass* is the work of one request on a slab's rows; a *pair* is one 64-row cache block,
loaded as two 32-key blocks a (rows 0-31) and b (rows 32-63).
"""
from __future__ import annotations

from k31c.lowering.triton.gluon_sm90 import GLUON_ERROR

if GLUON_ERROR is None:
    from k31c.lowering.triton.gluon_sm90 import gl, gluon, mbarrier, tma, warpgroup_mma
    from k31c.lowering.triton.mla_seesaw import (BK, NB, O_L, ROW_O, ROW_S, S_L, pair_views,
                                                 row_sums, seesaw_buffers, seesaw_pair, store_q)

NUM_WARPS = 4                       # the default partition (math group 0); 12 warps in all
                                    # (the 1-warp producer's warp group padded)


if GLUON_ERROR is None:
    MATH_REGS = gl.constexpr(240)       # math group 1's registers; group 0 (the default
    LOAD_REGS = gl.constexpr(32)        # partition) runs on what is left (232), the producer
                                        # on 32: none spills

    @gluon.jit
    def _slab_rows(rows, ROWS: gl.constexpr, L: gl.constexpr):
        # the query rows the slab touches (group rows r_lo..r_hi): request, length, and whether
        # the row is still to attend (a request outside the block table is never attended)
        req_ptr, len_ptr, t_first, r_lo, r_hi, n_rows, n_req = rows
        r = r_lo + gl.arange(0, ROWS, L)
        t = t_first + r
        real = (r <= r_hi) & (t < n_rows)
        req = gl.load(req_ptr + t, mask=real, other=-1)
        lens = gl.load(len_ptr + t, mask=real, other=0)
        return req, lens, real & (req >= 0) & (req < n_req)

    @gluon.jit
    def _plan(rows, keys, ROWS: gl.constexpr, PASSES: gl.constexpr, NUM: gl.constexpr):
        # the slab's passes: pass p takes the request of the first row still to do and all its
        # rows, and this split's cache blocks below their longest length (`limit`, capped at the
        # table's width), steps [start, end) of the program's. Each pass's (request, limit,
        # start, end) is lane p's of the [ROWS] vectors (a lane layout over NUM warps).
        table_ptr, stride_bt, max_blocks, kb0, blocks_per_split = keys
        L: gl.constexpr = gl.BlockedLayout([1], [32], [NUM], [0])
        req, lens, todo = _slab_rows(rows, ROWS, L)
        r = gl.arange(0, ROWS, L)
        b_v = gl.full([ROWS], -1, gl.int32, L)
        lim_v = gl.zeros([ROWS], gl.int32, L)
        start_v = gl.zeros([ROWS], gl.int32, L)
        end_v = gl.zeros([ROWS], gl.int32, L)
        total = 0
        for p in gl.static_range(PASSES):
            first = gl.min(gl.where(todo, r, ROWS), 0)
            b = gl.max(gl.where(r == first, req, -1), 0)               # -1: no row left
            sel = todo & (req == b)
            todo = todo & (sel == 0)
            limit = gl.minimum(gl.max(gl.where(sel, lens, 0), 0), max_blocks * 64)
            n_pairs = gl.maximum(gl.minimum(blocks_per_split, gl.cdiv(limit, 64) - kb0), 0)
            at = r == p
            b_v = gl.where(at, b, b_v)
            lim_v = gl.where(at, limit, lim_v)
            start_v = gl.where(at, total, start_v)
            total += n_pairs
            end_v = gl.where(at, total, end_v)
        return (r, b_v, lim_v, start_v, end_v), total

    @gluon.jit
    def _load(kv_desc, kr_desc, kv_bufs, kr_bufs, info, ready, empty, rows, keys,
              PASSES: gl.constexpr, ROWS: gl.constexpr):
        # the producer (1 warp), a pass at a time: each step's cache block as two 32-key blocks
        # of two TMA boxes each (values part, rope part; a -1 block's rows are negative
        # coordinates, read as zeros), and the step's facts for the math groups in `info`
        plan, total = _plan(rows, keys, ROWS, PASSES, 1)
        r, b_v, lim_v, start_v, end_v = plan
        table_ptr, stride_bt, max_blocks, kb0, blocks_per_split = keys
        I_L: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])
        field = gl.arange(0, 4, I_L)
        for p in range(PASSES):
            at = r == p
            b = gl.max(gl.where(at, b_v, -1), 0)
            limit = gl.max(gl.where(at, lim_v, 0), 0)
            start = gl.max(gl.where(at, start_v, 0), 0)
            table_row = table_ptr + gl.maximum(b, 0).to(gl.int64) * stride_bt + (kb0 - start)
            for j in range(start, gl.max(gl.where(at, end_v, 0), 0)):
                blk = gl.load(table_row + j)
                first = (kb0 + j - start) * 64              # the block's first position
                for half in gl.static_range(2):
                    i = 2 * j + half
                    buf = i % NB
                    mbarrier.wait(empty.index(buf), ((i // NB) & 1) ^ 1)    # both groups done
                    if half == 0:
                        # the step's request (-2 for a -1 block: no row's), first position
                        # and limit. The groups read the slot before they free block a; every
                        # lane stores the same values, so the lane that arrives below (a
                        # release) has published them with the block.
                        facts = gl.where(field == 0, gl.where(blk >= 0, b, -2),
                                         gl.where(field == 1, first, limit))
                        info.index(j % 2).store(facts)
                    mbarrier.expect(ready.index(buf),
                                    kv_desc.block_type.nbytes + kr_desc.block_type.nbytes)
                    at_row = blk * 64 + half * BK
                    tma.async_copy_global_to_shared(kv_desc, [at_row, 0], ready.index(buf),
                                                    kv_bufs.index(buf))
                    tma.async_copy_global_to_shared(kr_desc, [at_row, 0], ready.index(buf),
                                                    kr_bufs.index(buf))

    @gluon.jit
    def _half(ROLE: gl.constexpr, smem, bars, rows, keys, outs, PASSES: gl.constexpr,
              ROWS: gl.constexpr):
        # one math warp group: the scores of block 2j + ROLE of pair j, the values' columns
        # [256 ROLE, 256 ROLE + 256) of both blocks; the other group's P and running max come
        # through shared memory (p_bar: group 0's of block a, group 1's of block b)
        qv_smem, qr_smem, kv_bufs, kr_bufs, info = smem
        ready, empty, p_bar, fin, m_a, m_b, l_a, l_b = bars
        req_ptr, len_ptr, t_first, r_lo, r_hi, n_rows, n_req = rows
        out_ptr, lse_ptr, m0, n_m, n_heads, scale_log2, empty_lse = outs
        col0: gl.constexpr = ROLE * 256
        # each (row, head) pair's row: its request and length
        mg = m0 + gl.arange(0, 64, ROW_S)
        t = t_first + mg // n_heads
        real = (mg < n_m) & (t < n_rows)
        req_m = gl.load(req_ptr + t, mask=real, other=-1)
        len_m = gl.load(len_ptr + t, mask=real, other=0)
        _, total = _plan(rows, keys, ROWS, PASSES, 4)          # the steps (the producer's)
        I_L: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
        field = gl.arange(0, 4, I_L)
        key = gl.arange(0, BK, gl.SliceLayout(0, S_L))
        m_i = gl.full([64], float("-inf"), gl.float32, ROW_S)
        l_i = gl.zeros([64], gl.float32, ROW_S)
        acc = gl.zeros([64, 256], gl.float32, O_L)
        zero_s = gl.zeros([64, BK], gl.float32, S_L)
        for j in range(total):
            ph = j & 1                                  # the pair's exchange barriers
            ph_ready = (j // (NB // 2)) & 1             # its buffers' fills
            # q through an index the compiler cannot prove constant (always 0): its
            # loop-invariant wgmma descriptors would be hoisted out of the loop and spill
            zr = gl.inline_asm_elementwise("mov.u32 $0, 0; // $1", "=r,r", [j], dtype=gl.int32,
                                           is_pure=True, pack=1)
            ba = (j % (NB // 2)) * 2                    # the pair's buffers: ba (a), ba + 1 (b)
            views = pair_views(ROLE, kv_bufs, kr_bufs, ba)
            mbarrier.wait(ready.index(ba + ROLE), ph_ready)
            s = warpgroup_mma(qr_smem.index(zr), kr_bufs.index(ba + ROLE).permute((1, 0)),
                              zero_s, use_acc=False, is_async=True)
            s = warpgroup_mma(qv_smem.index(zr), kv_bufs.index(ba + ROLE).permute((1, 0)), s,
                              is_async=True)
            # the step's request, first position and limit (from the producer), under the
            # scores: each pair sees the block's keys below its length if its row is of that
            # request, else none (its running max, sums and output do not move)
            facts = info.index(j % 2).load(I_L)
            b = gl.sum(gl.where(field == 0, facts, 0), 0)
            first = gl.sum(gl.where(field == 1, facts, 0), 0)
            limit = gl.sum(gl.where(field == 2, facts, 0), 0)
            rem = gl.where(req_m == b, len_m - (first + ROLE * BK), 0)
            seen = gl.expand_dims(key, 0) < gl.expand_dims(rem, 1)
            tail = first + 64 > limit                   # rows past every length
            m_i, l_i, acc = seesaw_pair(ROLE, s, seen, m_i, l_i, acc, views, kv_bufs, ba, m_a,
                                        m_b, p_bar, empty, ph, scale_log2, True, tail, first,
                                        limit)
        out, l_i, has = row_sums(ROLE, l_i, acc, l_a, l_b, fin)      # out 0 where no key
        m_o = m0 + gl.arange(0, 64, ROW_O)
        c_o = col0 + gl.arange(0, 256, gl.SliceLayout(0, O_L))
        real_o = (m_o < n_m) & (t_first + m_o // n_heads < n_rows)
        gl.store(out_ptr + gl.expand_dims(m_o.to(gl.int64) * 512, 1) + gl.expand_dims(c_o, 0),
                 out.to(out_ptr.dtype.element_ty),
                 mask=gl.expand_dims(real_o, 1) & gl.expand_dims(c_o >= 0, 0))
        if ROLE == 0:
            lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453,
                           empty_lse)
            gl.store(lse_ptr + mg, lse, mask=real)

    @gluon.jit
    def _half0(smem, bars, rows, keys, outs, PASSES: gl.constexpr, ROWS: gl.constexpr):
        _half(0, smem, bars, rows, keys, outs, PASSES, ROWS)

    @gluon.jit
    def _half1(smem, bars, rows, keys, outs, PASSES: gl.constexpr, ROWS: gl.constexpr):
        _half(1, smem, bars, rows, keys, outs, PASSES, ROWS)

    @gluon.jit
    def dense_ws_kernel(q_ptr, kv_desc, kr_desc, table_ptr, req_ptr, len_ptr, out_ptr, lse_ptr,
                        n_rows, n_heads, n_req, group_rows, n_slabs, n_splits, blocks_per_split,
                        max_blocks, stride_qn, stride_qh, stride_bt, scale_log2, empty_lse,
                        PASSES: gl.constexpr, ROWS: gl.constexpr, num_warps: gl.constexpr):
        pid = gl.program_id(0)
        slab = pid % n_slabs                # a (group, split)'s slabs are adjacent: they read
        split = (pid // n_slabs) % n_splits  # the same blocks together (L2)
        group = pid // (n_slabs * n_splits)
        n_m = group_rows * n_heads
        m0 = slab * 64
        t_first = group * group_rows
        (qv_smem, qr_smem, kv_bufs, kr_bufs, m_a, m_b, l_a, l_b, ready, empty, p_bar,
         fin) = seesaw_buffers(1)
        # a step's facts (`_load`)
        info = gl.allocate_shared_memory(gl.int32, [2, 4], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        # q of the slab's pairs (pairs past the group or the rows read zeros)
        Q_L: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [num_warps, 1], [1, 0])
        mq = m0 + gl.arange(0, 64, gl.SliceLayout(1, Q_L))
        tq = t_first + mq // n_heads
        c = gl.arange(0, 64, gl.SliceLayout(0, Q_L))
        q_mask = gl.expand_dims((mq < n_m) & (tq < n_rows), 1) & gl.expand_dims(c >= 0, 0)
        q_at = (q_ptr + gl.expand_dims(tq.to(gl.int64) * stride_qn + (mq % n_heads) * stride_qh, 1)
                + gl.expand_dims(c, 0))
        store_q(qv_smem, qr_smem, q_at, q_mask)
        rows = (req_ptr, len_ptr, t_first, m0 // n_heads, gl.minimum(m0 + 63, n_m - 1) // n_heads,
                n_rows, n_req)
        keys = (table_ptr, stride_bt, max_blocks, split * blocks_per_split, blocks_per_split)
        # out / lse rows of the group in this split's [N, H] plane (pair m: row t_first·H + m)
        out_row = (split.to(gl.int64) * n_rows + t_first) * n_heads
        outs = (out_ptr + out_row * 512, lse_ptr + out_row, m0, n_m, n_heads, scale_log2,
                empty_lse)
        smem = (qv_smem, qr_smem, kv_bufs, kr_bufs, info)
        bars = (ready, empty, p_bar, fin, m_a, m_b, l_a, l_b)
        gl.warp_specialize([
            (_half0, (smem, bars, rows, keys, outs, PASSES, ROWS)),
            (_half1, (smem, bars, rows, keys, outs, PASSES, ROWS)),
            (_load, (kv_desc, kr_desc, kv_bufs, kr_bufs, info, ready, empty, rows, keys, PASSES,
                     ROWS))],
            [4, 1], [MATH_REGS, LOAD_REGS])
