"""The ring of the warp-specialized indexer scans (indexer_ws, indexer_ws_filter; Gluon, sm_90a):
the sizes the scans are written for, their shared memory (q, the head weights, a ring of 9
stages of key and scale boxes with a word a stage and ready / empty barriers), the producer
that claims a tile's blocks in chunks (`claim_counters`) and fills the ring, and the math
groups' read of a stage's word. A stage's word is pass << PASS_SHIFT | block step, or -1: no
more blocks for the math group that takes that stage.
"""
from __future__ import annotations

from k31c.lowering.triton import claim_counters
from k31c.lowering.triton.gluon_sm90 import GLUON_ERROR

if GLUON_ERROR is None:
    from k31c.lowering.triton.gluon_sm90 import fence_async_shared, gl, gluon, mbarrier, sync, tma

ROWS, HEADS, D, BLOCK = 4, 32, 128, 64          # what the kernel is written for (K3.1 Pro)
BLOCK_BYTES = BLOCK * (D + 4)                    # an FP8 cache block: 64 keys, then 64 fp32 scales
CHUNK = 8                                        # blocks a claim (4: more atomics, slower; 16: level)
PASS_SHIFT = 24                                  # a stage's word: pass << 24 | block step

if GLUON_ERROR is None:
    # ring stages (9 x 8.4 KB): a multiple of NG, so each stage feeds one math group only (group
    # k takes stages g % NG == k). On a stage two groups fed, a group could wait for the fill after
    # the one in flight; that parity already reads as complete, and the wait would pass at once
    # (with 3 groups on 8 stages a CPU model of the ring finds such early passes, and deadlocks:
    # BENCHMARKS.md, the indexer with three math warp groups).
    NG = gl.constexpr(3)                         # math groups
    NB = gl.constexpr(3 * NG)
    R_C = gl.constexpr(ROWS)                     # the module's sizes as the kernels see them
    H_C = gl.constexpr(HEADS)
    D_C = gl.constexpr(D)
    BK_C = gl.constexpr(BLOCK)
    BOX_ROWS = gl.constexpr(BLOCK_BYTES // D)    # 66 rows of 128 B a block in the descriptors' view
    CHUNK_C = gl.constexpr(CHUNK)
    PASS_SHIFT_C = gl.constexpr(PASS_SHIFT)
    STEP_MASK = gl.constexpr((1 << PASS_SHIFT) - 1)
    CTR_WORDS = gl.constexpr(claim_counters.WORDS)
    CTR_DONE = gl.constexpr(R_C)               # after the passes' claim counters

    @gluon.jit
    def gdc_wait():
        """Programmatic dependent launch: wait until the kernel before this one in the stream has
        finished, its writes visible (a no-op in a launch without PDL)."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def gdc_launch_dependents():
        """Programmatic dependent launch: let the next kernel in the stream launch (it waits for
        this one before it reads what this one writes; a no-op without PDL)."""
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def pass_blocks(row_req_ptr, len_ptr, row0, n_rows, n_req, capacity, j):
        """Pass j of the tile for the producer: whether row j starts a pass (a run of one
        request's rows), its request, the request's blocks (the longest of its rows in the tile,
        at most `capacity`), from scalar loads (the producer's 32 registers hold no per-row
        pointers across its loop)."""
        row = row0 + j
        req = gl.load(row_req_ptr + gl.minimum(row, n_rows - 1))
        prev = gl.load(row_req_ptr + gl.minimum(gl.maximum(row - 1, 0), n_rows - 1))
        first = (row < n_rows) & ((j == 0) | (req != prev))
        longest = n_rows * 0
        for rr in gl.static_range(R_C):
            at = gl.minimum(row0 + rr, n_rows - 1)
            mine = (row0 + rr < n_rows) & (gl.load(row_req_ptr + at) == req)
            longest = gl.maximum(longest, gl.where(mine, gl.minimum(gl.load(len_ptr + at), capacity), 0))
        longest = gl.where((req >= 0) & (req < n_req), longest, 0)
        return first, req, gl.cdiv(longest, BK_C)

    @gluon.jit
    def _claim(ctr, lane):
        # lane 0 adds one to the counter; the old value comes back in lane 0 (0 elsewhere), read
        # with gl.max once it is needed, so the claim is in flight until then
        got = gl.atomic_add(ctr + lane * 0, lane * 0 + 1, mask=lane == 0, sem="relaxed")
        return gl.where(lane == 0, got, 0)

    @gluon.jit
    def _hand_over(g, word, steps, ready, empty, k_desc, s_desc, k_bufs, s_bufs, blk, COPY: gl.constexpr):
        # stage g % NB, once free: its word for the math group, then (COPY) block blk's boxes, or
        # (not COPY) the word alone, its ready barrier arrived at by hand
        S2: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
        b = g % NB
        mbarrier.wait(empty.index(b), ((g // NB) & 1) ^ 1)
        steps.index(b).store(gl.full([2], 0, gl.int32, S2) + word)
        sync()
        if COPY:
            mbarrier.expect(ready.index(b), k_desc.block_type.nbytes + s_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [blk * BOX_ROWS, 0], ready.index(b), k_bufs.index(b))
            tma.async_copy_global_to_shared(s_desc, [blk * BOX_ROWS + BK_C, 0], ready.index(b),
                                            s_bufs.index(b))
        else:
            mbarrier.arrive(ready.index(b), count=1)

    @gluon.jit
    def loader(k_desc, s_desc, table_ptr, table_stride, row_req_ptr, len_ptr, out_ptr, claim_ptr,
               row0, n_rows, n_req, capacity, split, n_splits, write_tail, k_bufs, s_bufs, steps,
               ready, empty, WAIT: gl.constexpr):
        """The producer: for each pass, chunks of CHUNK blocks claimed from the pass's counter
        (the next claim in flight while a chunk is copied) into the ring, each stage's word
        (pass << PASS_SHIFT | block step) beside it; then an end word (-1) for each math group,
        and the tile's last program to finish zeroes the tile's counters. WAIT (a PDL
        dependent whose partitions do not wait first): wait for the kernel before, so that the
        launch before this one has left the counters zeroed."""
        if WAIT:
            gdc_wait()
        lane = gl.arange(0, 32, gl.BlockedLayout([1], [32], [1], [0]))
        T_L: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])
        ctr = claim_ptr + gl.program_id(0) * CTR_WORDS
        g = n_rows * 0                             # stages this program has filled (ring phases)
        for j in range(R_C):           # a loop, not unrolled: one copy of the pass's code
            first, req, n_steps = pass_blocks(row_req_ptr, len_ptr, row0, n_rows, n_req, capacity, j)
            if first:
                table_row = table_ptr + req.to(gl.int64) * table_stride
                n_chunks = gl.cdiv(n_steps, CHUNK_C)
                c = gl.max(_claim(ctr + j, lane), 0)
                while c < n_chunks:
                    nxt = _claim(ctr + j, lane)
                    for s in range(c * CHUNK_C, gl.minimum(c * CHUNK_C + CHUNK_C, n_steps)):
                        blk = gl.load(table_row + s)     # -1: negative rows, read as zeros
                        _hand_over(g, (j << PASS_SHIFT_C) + s, steps, ready, empty, k_desc, s_desc, k_bufs,
                                   s_bufs, blk, True)
                        g += 1
                    c = gl.max(nxt, 0)
                # -inf past the request's last block for this pass's rows, shared over the splits
                n_tail = gl.cdiv(capacity - n_steps * BK_C, 128) * write_tail
                for rr in gl.static_range(R_C):
                    row = row0 + rr
                    mine = (row < n_rows) & (gl.load(row_req_ptr + gl.minimum(row, n_rows - 1)) == req)
                    for chunk in range(split * n_tail // n_splits, (split + 1) * n_tail // n_splits):
                        p = n_steps * BK_C + chunk * 128 + gl.arange(0, 128, T_L)
                        gl.store(out_ptr + rr * capacity + p,
                                 gl.full([128], float("-inf"), gl.float32, T_L),
                                 mask=(p < capacity) & mine)
        for k in gl.static_range(NG):              # an end word for each math group
            _hand_over(g + k, -1, steps, ready, empty, k_desc, s_desc, k_bufs, s_bufs, 0, False)
        # every claim of this program has come back: the tile's last program zeroes its counters
        done = gl.max(gl.where(lane == 0, gl.atomic_add(ctr + CTR_DONE + lane * 0, lane * 0 + 1,
                                                        mask=lane == 0), 0), 0)
        if done == n_splits - 1:
            gl.store(ctr + lane, lane * 0, mask=lane < CTR_WORDS)

    @gluon.jit
    def next_block(g, steps, ready):
        """The word of ring stage g % NB, once its fill (or end word) has landed: pass <<
        PASS_SHIFT | block step, or -1 (no more blocks for this math group)."""
        W_L: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])
        b = g % NB
        mbarrier.wait(ready.index(b), (g // NB) & 1)
        return gl.max(steps.index(b).load(W_L), 0)

    @gluon.jit
    def shared_state():
        """The scan's shared memory, its barriers initialised: q (e4m3) and the head weights, the
        ring of key and scale boxes with each stage's word and its ready / empty barriers, and
        q's barrier."""
        Q_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R_C * H_C, D_C], gl.float8e4nv)
        K_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK_C, D_C], gl.float8e4nv)
        S_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2, 32], gl.float32)
        q_smem = gl.allocate_shared_memory(gl.float8e4nv, [R_C * H_C, D_C], Q_SH)
        w_smem = gl.allocate_shared_memory(gl.float32, [R_C * H_C], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        k_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NB, BK_C, D_C], K_SH)
        s_bufs = gl.allocate_shared_memory(gl.float32, [NB, 2, 32], S_SH)
        # a stage's word, twice (a power-of-two row)
        steps = gl.allocate_shared_memory(gl.int32, [NB, 2], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        ready = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=NG)
        for b in gl.static_range(NB):
            mbarrier.init(ready.index(b), count=1)
            mbarrier.init(empty.index(b), count=1)
        fence_async_shared()          # the barriers' initialisation before any partition uses them
        sync()
        return q_smem, w_smem, k_bufs, s_bufs, steps, ready, empty, q_bar
