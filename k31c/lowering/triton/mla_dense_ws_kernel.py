"""The Gluon kernel of `mla_dense_ws.py` (warp-specialized dense MLA on sm_90a); that module's
docstring describes it, and its launcher and `aot_specs` are the only callers.

Terms: a *group* is G consecutive query rows (the R rows of a request in the decode layout), its
(row, head) pairs numbered m = r·H + h; a *slab* is 64 consecutive pairs of a group (one wgmma
M); a *pass* is the work of one request on a slab's rows; a *step* is a pair of 64-row cache
blocks, a (buffer 0, scored by math group 0) and b (buffer 1, group 1); a *chunk* is 64 columns
of a buffer (8 value chunks, then the rope chunk), one TMA box with its own ready barrier (FP8
rows: the block's four e4m3 groups staged in value chunks 4-7 on ready[0-3], the scales with
group 0, the rope on ready[8]; `_fill_fp8`, `_score_fp8`).
"""
from __future__ import annotations

from k31c.lowering.triton.gluon_sm90 import GLUON_ERROR

if GLUON_ERROR is None:
    from k31c.lowering.triton.gluon_sm90 import (fence_async_shared, gl, gluon, mbarrier, sync, tma,
                                                 warpgroup_mma)
    from k31c.lowering.triton.mla_seesaw import (DEQUANT_L, O_L, Q_MUL_FP8, ROW_O, dequant_e4m3,
                                                 pair_views, row_sums, seesaw_pair, store_q)

NUM_WARPS = 4                       # the default partition (math group 0); 12 warps in all
                                    # (the 1-warp producer's warp group padded)
BLOCK = 64                          # keys a buffer holds: one cache block
CHUNK = 64                          # columns a TMA box (a chunk) holds


if GLUON_ERROR is None:
    MATH_REGS = gl.constexpr(240)       # math group 1's registers; group 0 (the default
    LOAD_REGS = gl.constexpr(40)        # partition) runs on what is left, the producer on 40
    BK = gl.constexpr(BLOCK)
    CK = gl.constexpr(CHUNK)
    # a math group's scores [64, 64] and their rows (its half of the output: the seesaw's O_L)
    S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, 64, 16]))
    ROW_S = gl.constexpr(gl.SliceLayout(1, S_L))

    @gluon.jit
    def _bar(count: gl.constexpr):
        # one barrier, its own allocation: Triton's shared-memory analysis (membar) takes two
        # mbarrier ops on one allocation as conflicting and puts a bar.sync between them, which
        # would serialise the score chain's chunk waits
        b = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(b, count=count)
        return b

    @gluon.jit
    def _buffer_bars():
        # a buffer's barriers: ready, one a chunk (TMA bytes); empty, one a chunk group (value
        # chunks 0-3, 4-7, the rope chunk: a group's chunks are released at the same moment, so
        # this is the per-chunk protocol with fewer arrivals), 2 arrivals each
        ready = (_bar(1), _bar(1), _bar(1), _bar(1), _bar(1), _bar(1), _bar(1), _bar(1), _bar(1))
        return ready, (_bar(2), _bar(2), _bar(2))

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
    def _pass_blocks(limit, kb0, blocks_per_split):
        # the cache blocks of this split below `limit`
        return gl.maximum(gl.minimum(blocks_per_split, gl.cdiv(limit, BK) - kb0), 0)

    @gluon.jit
    def _plan(rows, keys, ROWS: gl.constexpr, PASSES: gl.constexpr):
        # the slab's passes: pass p takes the request of the first row still to do and all its
        # rows, and this split's cache blocks below their longest length (`limit`, capped at the
        # table's width), in steps [start, end) of the program's (a pair of blocks a step).
        # Each pass's (request, limit, start, end) is lane p's of the [ROWS] vectors (the
        # producer warp's lanes).
        table_ptr, stride_bt, max_blocks, kb0, blocks_per_split = keys
        L: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
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
            limit = gl.minimum(gl.max(gl.where(sel, lens, 0), 0), max_blocks * BK)
            at = r == p
            b_v = gl.where(at, b, b_v)
            lim_v = gl.where(at, limit, lim_v)
            start_v = gl.where(at, total, start_v)
            total += (_pass_blocks(limit, kb0, blocks_per_split) + 1) // 2
            end_v = gl.where(at, total, end_v)
        return (r, b_v, lim_v, start_v, end_v), total

    @gluon.jit
    def _fill(desc, kv_buf, kr_buf, ready, empty, blk, ph):
        # one buffer's 9 chunks in order, each as soon as its chunk group is released (both
        # readers of its last use); a -1 block's rows are negative coordinates, read as zeros
        row = blk * BK
        for c in gl.static_range(8):
            if c % 4 == 0:
                mbarrier.wait(empty[c // 4], ph)
            mbarrier.expect(ready[c], desc.block_type.nbytes)
            tma.async_copy_global_to_shared(desc, [row, CK * c], ready[c],
                                            kv_buf.slice(CK * c, CK, dim=1))
        mbarrier.wait(empty[2], ph)
        mbarrier.expect(ready[8], desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [row, 8 * CK], ready[8], kr_buf)

    @gluon.jit
    def _fill_fp8(descs, kv_bufs, kr_buf, scl_buf, buf: gl.constexpr, ready, empty, blk, ph):
        # FP8 rows: once all three chunk groups of the buffer are released (the dequant writes
        # every value chunk), its e4m3 bytes to value chunks 4-7 (four [64, 128]-byte boxes,
        # box g on ready[g], the scales with box 0), its rope on ready[8]: the math group
        # dequantises and scores a box as soon as it lands
        d_nope, d_scale, d_rope = descs
        row = blk * BK
        for g in gl.static_range(3):
            mbarrier.wait(empty[g], ph)
        stage = kv_bufs._reinterpret(gl.uint8, [2 * 8, BK, 128], d_nope.layout)
        mbarrier.expect(ready[0], d_nope.block_type.nbytes + d_scale.block_type.nbytes)
        tma.async_copy_global_to_shared(d_scale, [row, 128], ready[0], scl_buf)
        tma.async_copy_global_to_shared(d_nope, [row, 0], ready[0], stage.index(buf * 8 + 4))
        for g in gl.static_range(1, 4):
            mbarrier.expect(ready[g], d_nope.block_type.nbytes)
            tma.async_copy_global_to_shared(d_nope, [row, 128 * g], ready[g],
                                            stage.index(buf * 8 + 4 + g))
        mbarrier.expect(ready[8], d_rope.block_type.nbytes)
        tma.async_copy_global_to_shared(d_rope, [row, 264], ready[8], kr_buf)

    @gluon.jit
    def _load(descs, kv_bufs, kr_bufs, scl_bufs, info, bars, rows, keys, PASSES: gl.constexpr,
              ROWS: gl.constexpr, FP8: gl.constexpr):
        # the producer (1 warp), a pass at a time: each step's blocks a and b into buffers 0
        # and 1, and the step's facts for the math groups in `info`
        plan, total = _plan(rows, keys, ROWS, PASSES)
        r, b_v, lim_v, start_v, end_v = plan
        table_ptr, stride_bt, max_blocks, kb0, blocks_per_split = keys
        ready0, empty0, ready1, empty1, plan_bar = bars
        I_L: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])
        field = gl.arange(0, 4, I_L)
        # the program's step count, for the math groups (the passes planned in their code too
        # made ptxas spill in their loop): every lane stores it, one arrives
        info.index(2).store(gl.where(field == 0, total, 0))
        mbarrier.arrive(plan_bar, count=1)
        for p in range(PASSES):
            at = r == p
            b = gl.max(gl.where(at, b_v, -1), 0)
            limit = gl.max(gl.where(at, lim_v, 0), 0)
            start = gl.max(gl.where(at, start_v, 0), 0)
            n_blk = _pass_blocks(limit, kb0, blocks_per_split)
            table_row = table_ptr + gl.maximum(b, 0).to(gl.int64) * stride_bt + kb0
            for j in range(start, gl.max(gl.where(at, end_v, 0), 0)):
                i = 2 * (j - start)                         # block a's index in the split
                blk_a = gl.load(table_row + i)
                blk_b = gl.load(table_row + i + 1, mask=i + 1 < n_blk, other=-1)
                ph = (j & 1) ^ 1                            # the buffers' previous use released
                # the step's facts: block a's and b's request (-2 for a -1 block: no row's),
                # block a's first position, the pass's limit. Written once step j - 1's block a
                # is released (both groups have read that step's facts by then), before this
                # step's first fill: every lane stores the same values, so the lane that
                # arrives (the fills' expect) has published them with the block.
                mbarrier.wait(empty0[0], ph)
                facts = gl.where(field == 0, gl.where(blk_a >= 0, b, -2),
                                 gl.where(field == 1, gl.where(blk_b >= 0, b, -2),
                                          gl.where(field == 2, (kb0 + i) * BK, limit)))
                info.index(j % 2).store(facts)
                if FP8:
                    _fill_fp8(descs, kv_bufs, kr_bufs.index(0), scl_bufs.index(0), 0, ready0, empty0,
                              blk_a, ph)
                    _fill_fp8(descs, kv_bufs, kr_bufs.index(1), scl_bufs.index(1), 1, ready1, empty1,
                              blk_b, ph)
                else:
                    _fill(descs[0], kv_bufs.index(0), kr_bufs.index(0), ready0, empty0, blk_a, ph)
                    _fill(descs[0], kv_bufs.index(1), kr_bufs.index(1), ready1, empty1, blk_b, ph)

    @gluon.jit
    def _chunk_score(qv, kv, s, c: gl.constexpr):
        # value chunk c's wgmma of a block's score chain (the first one starts it)
        return warpgroup_mma(qv.slice(CK * c, CK, dim=1),
                             kv.slice(CK * c, CK, dim=1).permute((1, 0)), s, use_acc=c > 0,
                             is_async=True)

    @gluon.jit
    def _rope_score(qr, kr, s, ready, ph):
        # the chain's last wgmma, once the rope chunk has landed
        mbarrier.wait(ready[8], ph)
        return warpgroup_mma(qr, kr.permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _score(qv, qr, kv, kr, ready, ph, zero_s):
        # a block's scores [64 pairs, 64 keys]: 9 chained wgmmas, each after its chunk's fill
        s = zero_s
        for c in gl.static_range(8):
            mbarrier.wait(ready[c], ph)
            s = _chunk_score(qv, kv, s, c)
        return _rope_score(qr, kr, s, ready, ph)

    @gluon.jit
    def _staged(stage, buf, g: gl.constexpr, h: gl.constexpr, D_L: gl.constexpr):
        # rows [32 h, 32 h + 32) of buffer buf's e4m3 column group g (uint8 [32, 128])
        return stage.index((buf * 8 + 4 + g) * 2 + h).load(D_L)

    @gluon.jit
    def _store_half(x, kv, scl, g: gl.constexpr, h: gl.constexpr, D_L: gl.constexpr):
        v = dequant_e4m3(x, scl.slice(32 * h, 32, dim=0), g, D_L, kv.dtype)
        kv.slice(128 * g, 128, dim=1).slice(32 * h, 32, dim=0).store(v)

    @gluon.jit
    def _score_fp8(qv, qr, kv_bufs, kr, scl, buf, ready, ph, zero_s):
        # FP8 rows: buffer buf's scores, each e4m3 group dequantised in place as its box lands
        # and its two value chunks' wgmmas issued before the next group is dequantised. Group
        # g (staged in value chunk 4 + g) goes to chunks 2g, 2g + 1: groups 0 and 1 to chunks
        # 0-3 (free), group 2 to the staging of groups 0 and 1 (read, then synced, before),
        # group 3 to its own staging and group 2's, once every thread has read it
        D_L: gl.constexpr = DEQUANT_L
        SH8: gl.constexpr = gl.NVMMASharedLayout.get_default_for([32, 128], gl.uint8)
        stage = kv_bufs._reinterpret(gl.uint8, [2 * 8 * 2, 32, 128], SH8)
        kv = kv_bufs.index(buf)
        s = zero_s
        for g in gl.static_range(4):
            mbarrier.wait(ready[g], ph)
            x0 = _staged(stage, buf, g, 0, D_L)
            x1 = _staged(stage, buf, g, 1, D_L)
            if g == 3:
                sync()
            _store_half(x0, kv, scl, g, 0, D_L)
            _store_half(x1, kv, scl, g, 1, D_L)
            fence_async_shared()            # the stores, before the wgmmas read them
            sync()
            for c in gl.static_range(2 * g, 2 * g + 2):
                s = _chunk_score(qv, kv, s, c)
        return _rope_score(qr, kr, s, ready, ph)

    @gluon.jit
    def _half(ROLE: gl.constexpr, smem, bars, ex, rows, outs, FP8: gl.constexpr):
        # one math warp group: the scores of block ROLE of each step, the values' columns
        # [256 ROLE, 256 ROLE + 256) of both blocks
        qv_smem, qr_smem, kv_bufs, kr_bufs, info, scl_bufs = smem
        m_a, m_b, l_a, l_b, p_bar, fin = ex
        ready_own = bars[2 * ROLE]
        empty0 = bars[1]
        empty1 = bars[3]
        plan_bar = bars[4]
        req_ptr, len_ptr, t_first, r_lo, r_hi, n_rows, n_req = rows
        out_ptr, lse_ptr, m0, n_m, n_heads, scale_log2, empty_lse = outs
        col0: gl.constexpr = ROLE * 256
        # each (row, head) pair's row: its request and length
        mg = m0 + gl.arange(0, 64, ROW_S)
        t = t_first + mg // n_heads
        real = (mg < n_m) & (t < n_rows)
        req_m = gl.load(req_ptr + t, mask=real, other=-1)
        len_m = gl.load(len_ptr + t, mask=real, other=0)
        I_L: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
        field = gl.arange(0, 4, I_L)
        mbarrier.wait(plan_bar, 0)                             # the producer's step count
        total = gl.sum(gl.where(field == 0, info.index(2).load(I_L), 0), 0)
        key = gl.arange(0, BK, gl.SliceLayout(0, S_L))
        m_i = gl.full([64], float("-inf"), gl.float32, ROW_S)
        l_i = gl.zeros([64], gl.float32, ROW_S)
        acc = gl.zeros([64, 256], gl.float32, O_L)
        zero_s = gl.zeros([64, BK], gl.float32, S_L)
        for j in range(total):
            ph = j & 1                          # each buffer and exchange is used once a step
            # shared memory through an index the compiler cannot prove constant (always 0):
            # the loop-invariant wgmma descriptors of q and of the buffers would be hoisted
            # out of the loop and spill
            zr = gl.inline_asm_elementwise("mov.u32 $0, 0; // $1", "=r,r", [j], dtype=gl.int32,
                                           is_pure=True, pack=1)
            if FP8:
                s = _score_fp8(qv_smem.index(zr), qr_smem.index(zr), kv_bufs,
                               kr_bufs.index(zr + ROLE), scl_bufs.index(zr + ROLE), zr + ROLE,
                               ready_own, ph, zero_s)
            else:
                s = _score(qv_smem.index(zr), qr_smem.index(zr), kv_bufs.index(zr + ROLE),
                           kr_bufs.index(zr + ROLE), ready_own, ph, zero_s)
            # the step's facts (from the producer, published with the blocks), under the
            # scores: each pair sees this group's block's keys below its length if its row is
            # of that block's request
            facts = info.index(j % 2).load(I_L)
            b = gl.sum(gl.where(field == ROLE, facts, 0), 0)
            first = gl.sum(gl.where(field == 2, facts, 0), 0)
            limit = gl.sum(gl.where(field == 3, facts, 0), 0)
            rem = gl.where(req_m == b, len_m - (first + ROLE * BK), 0)
            tail = first + 2 * BK > limit               # rows past every length
            seen = gl.expand_dims(key, 0) < gl.expand_dims(rem, 1)
            # the P @ V operands through their own opaque 0: derived from the scores' one,
            # their descriptors were kept live across the score chain and spilled
            zv = gl.inline_asm_elementwise("mov.u32 $0, 0; // $1", "=r,r", [ph], dtype=gl.int32,
                                           is_pure=True, pack=1)
            views = pair_views(ROLE, kv_bufs, kr_bufs, zv)
            m_i, l_i, acc = seesaw_pair(ROLE, s, seen, m_i, l_i, acc, views, kv_bufs, zv, m_a, m_b,
                                        p_bar, (empty0, empty1), ph, scale_log2, True, tail,
                                        first, limit, True)
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
    def _half0(smem, bars, ex, rows, outs, FP8: gl.constexpr):
        _half(0, smem, bars, ex, rows, outs, FP8)

    @gluon.jit
    def _half1(smem, bars, ex, rows, outs, FP8: gl.constexpr):
        _half(1, smem, bars, ex, rows, outs, FP8)

    @gluon.jit
    def dense_ws_kernel(q_ptr, desc, desc_scale, desc_rope, table_ptr, req_ptr, len_ptr, out_ptr, lse_ptr,
                        n_rows, n_heads, n_req, group_rows, n_slabs, n_splits, blocks_per_split,
                        max_blocks, stride_qn, stride_qh, stride_bt, scale_log2, empty_lse,
                        PASSES: gl.constexpr, ROWS: gl.constexpr, FP8: gl.constexpr,
                        num_warps: gl.constexpr):
        pid = gl.program_id(0)
        slab = pid % n_slabs                # a (group, split)'s slabs are adjacent: they read
        split = (pid // n_slabs) % n_splits  # the same blocks together (L2)
        group = pid // (n_slabs * n_splits)
        n_m = group_rows * n_heads
        m0 = slab * 64
        t_first = group * group_rows
        # q's latent part, the value buffers and P: f16 for FP8 rows (mla_seesaw.FP8_Q_MUL)
        VDT: gl.constexpr = gl.float16 if FP8 else gl.bfloat16
        SH_W: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 512], VDT)
        SH_R: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
        VEC: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        # q [64, 512] + [64, 64] with a leading dimension of 1 (indexed with an opaque 0), the
        # two block buffers, the exchanged maxima and row sums, two steps' facts and the step
        # count (`_load`)
        qv_smem = gl.allocate_shared_memory(VDT, [1, 64, 512], SH_W)
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 64], SH_R)
        kv_bufs = gl.allocate_shared_memory(VDT, [2, BK, 512], SH_W)
        kr_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BK, 64], SH_R)
        m_a = gl.allocate_shared_memory(gl.float32, [64], VEC)
        m_b = gl.allocate_shared_memory(gl.float32, [64], VEC)
        l_a = gl.allocate_shared_memory(gl.float32, [64], VEC)
        l_b = gl.allocate_shared_memory(gl.float32, [64], VEC)
        info = gl.allocate_shared_memory(gl.int32, [3, 4], VEC)
        if FP8:                 # each buffer's 64 rows of 4 scales (a TMA box)
            scl_bufs = gl.allocate_shared_memory(gl.float32, [2, BK, 4], desc_scale.layout)
        else:
            scl_bufs = info
        ready0, empty0 = _buffer_bars()
        ready1, empty1 = _buffer_bars()
        p_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(2):
            mbarrier.init(p_bar.index(b), count=1)
        fin = _bar(2)
        # q of the slab's pairs (pairs past the group or the rows read zeros)
        Q_L: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [num_warps, 1], [1, 0])
        mq = m0 + gl.arange(0, 64, gl.SliceLayout(1, Q_L))
        tq = t_first + mq // n_heads
        c = gl.arange(0, 64, gl.SliceLayout(0, Q_L))
        q_mask = gl.expand_dims((mq < n_m) & (tq < n_rows), 1) & gl.expand_dims(c >= 0, 0)
        q_at = (q_ptr + gl.expand_dims(tq.to(gl.int64) * stride_qn + (mq % n_heads) * stride_qh, 1)
                + gl.expand_dims(c, 0))
        store_q(qv_smem, qr_smem, q_at, q_mask, Q_MUL_FP8 if FP8 else 1.0)
        rows = (req_ptr, len_ptr, t_first, m0 // n_heads, gl.minimum(m0 + 63, n_m - 1) // n_heads,
                n_rows, n_req)
        keys = (table_ptr, stride_bt, max_blocks, split * blocks_per_split, blocks_per_split)
        # out / lse rows of the group in this split's [N, H] plane (pair m: row t_first·H + m)
        out_row = (split.to(gl.int64) * n_rows + t_first) * n_heads
        outs = (out_ptr + out_row * 512, lse_ptr + out_row, m0, n_m, n_heads, scale_log2,
                empty_lse)
        smem = (qv_smem, qr_smem, kv_bufs, kr_bufs, info, scl_bufs)
        bars = (ready0, empty0, ready1, empty1, _bar(1))
        ex = (m_a, m_b, l_a, l_b, p_bar, fin)
        gl.warp_specialize([
            (_half0, (smem, bars, ex, rows, outs, FP8)),
            (_half1, (smem, bars, ex, rows, outs, FP8)),
            (_load, ((desc, desc_scale, desc_rope), kv_bufs, kr_bufs, scl_bufs, info, bars, rows,
                     keys, PASSES, ROWS, FP8))],
            [4, 1], [MATH_REGS, LOAD_REGS])
