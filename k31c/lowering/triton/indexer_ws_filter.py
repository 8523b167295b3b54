"""The top-k filter in the warp-specialized indexer scan (Gluon, sm_90a): the fused select's
scan (`indexer_topk.fused_indexer_topk`). It is indexer_ws's scan (its loader, q prologue and
block scores) whose math groups keep the keys above each row's threshold instead of storing the
scores: each warp appends its keys of a row to a region of its own in `hkey` / `hpos` (REGION
slots; offsets from a ballot, no atomics on the blocks' path; past a full region straight to the
row's candidate buffer, one atomic a warp and row), and when the program ends copies its regions
into the rows' candidate buffers (`ckey` / `cpos`, the top-k workspace's), one atomic a warp and
row for their slots. Rows' thresholds and counters are the top-k state words (topk_plan).
"""
from __future__ import annotations

import torch

from k31c.lowering.aot_spec import descriptor_type, kernel_spec
from k31c.lowering.triton.device import target_of
from k31c.lowering.triton.gluon_sm90 import GLUON_ERROR
from k31c.lowering.triton import claim_counters
from k31c.lowering.triton.indexer_ws import (BLOCK, D, HEADS, NUM_WARPS, ROWS, check_capacity,
                                             descriptors, plan_splits, shared_layouts)
from k31c.lowering.triton.radix_select import warp_slots_ptx
from k31c.lowering.triton.topk_plan import ST_CNT, ST_THRESH, ST_WORDS

REGION = 256       # slots a warp and row (~107 candidates expected at k = 2048 over 48 warps a row)

if GLUON_ERROR is None:
    from k31c.lowering.triton.gluon_sm90 import gl, gluon
    from k31c.lowering.triton.indexer_ws import block_scores, quantise_q, word_pass
    from k31c.lowering.triton.indexer_ws_ring import (BK_C, H_C, NG, R_C, STEP_MASK,
                                                      gdc_launch_dependents, gdc_wait, loader,
                                                      next_block, shared_state)

    REGION_C = gl.constexpr(REGION)
    # lane 0 adds $2 (the same in every lane) to the counter at $1, if not 0 (a row past the
    # last or with no candidates touches no counter); every lane gets the old value
    WARP_TAKE_PTX = gl.constexpr("""{
        .reg .pred lead;
        .reg .b32 lane, d;
        mov.u32 lane, %laneid;
        setp.eq.u32 lead, lane, 0;
        setp.ne.and.u32 lead, $2, 0, lead;
        mov.u32 d, 0;
        @lead atom.global.add.u32 d, [$1], $2;
        shfl.sync.idx.b32 $0, d, 0, 0x1f, 0xffffffff;
    }""")

    # a key's append, from one ballot of the candidates $1 ($0: the warp's count): each lane's
    # candidate goes as score bits $6 / position $7 to its region slot (held $2 + its rank) at
    # region pointers $9 / $10. Where the region overflows (warp-uniform: held + count > REGION,
    # held being the same in every lane) the lanes past it take buffer slots from the row's
    # counter $3 (`warp_slots_ptx`: one atomic) and store at row pointers $4 / $5 while the slot
    # is below cap $8. Uniform branches skip it all where the warp has no candidate (nearly every
    # block: a ballot and a branch an element) and the overflow path where the region holds them
    FILTER_APPEND_PTX = gl.constexpr(("""{
        .reg .pred p, none, mine, full, q, in;
        .reg .b32 b, rank, n, slot, room, at;
        .reg .b64 off, ak, ap;
        setp.ne.b32 p, $1, 0;
        vote.sync.ballot.b32 b, p, 0xffffffff;
        mov.u32 n, 0;
        setp.eq.u32 none, b, 0;
        @none bra.uni DONE;
        mov.u32 rank, %lanemask_lt;
        and.b32 rank, rank, b;
        popc.b32 rank, rank;
        popc.b32 n, b;
        add.u32 slot, $2, rank;
        setp.lt.and.u32 mine, slot, REGION, p;
        mul.wide.u32 off, slot, 4;
        add.s64 ak, $9, off;
        add.s64 ap, $10, off;
        @mine st.global.b32 [ak], $6;
        @mine st.global.b32 [ap], $7;
        add.u32 room, $2, n;
        setp.gt.u32 full, room, REGION;
        @!full bra.uni DONE;
        setp.ge.and.u32 q, slot, REGION, p;
        """ + warp_slots_ptx("q", "$3", "at") + """
        setp.lt.and.u32 in, at, $8, q;
        mul.wide.u32 off, at, 4;
        add.s64 ak, $4, off;
        add.s64 ap, $5, off;
        @in st.global.b32 [ak], $6;
        @in st.global.b32 [ap], $7;
    DONE:
        mov.u32 $0, n;
    }""").replace("REGION", str(REGION)))

    @gluon.jit
    def _filter(ROLE: gl.constexpr, q_ptr, w_ptr, row_req_ptr, len_ptr, state_ptr, ckey_ptr,
                cpos_ptr, hkey_ptr, hpos_ptr, row0, n_rows, n_req, capacity, cap, split, n_splits,
                q_bar, q_smem, w_smem, k_bufs, s_bufs, steps, ready, empty):
        """`_score` with the top-k filter in place of the score stores: each key above its row's
        threshold (the top-k state's) is kept as (score bits, position). A warp appends its keys
        of a row to a region of its own (hkey / hpos, REGION slots, offsets from a ballot: no
        atomics on the blocks' path); past REGION it appends to the row's candidate buffer
        directly (one atomic a warp and row). When the program ends, each warp copies its
        regions into the rows' buffers, one atomic a row for the slots."""
        ACC_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, 128, 32])
        ST_L: gl.constexpr = gl.BlockedLayout([1, 2], [32, 1], [2, 2], [0, 1])   # [64 keys, 4 rows]
        quantise_q(ROLE, q_ptr, w_ptr, row0, n_rows, q_smem, w_smem, q_bar)
        w = w_smem.load(gl.SliceLayout(0, ACC_L))
        r = gl.arange(0, R_C, gl.SliceLayout(0, ST_L))
        key = gl.arange(0, BK_C, gl.SliceLayout(1, ST_L))
        zero = gl.zeros([BK_C, R_C * H_C], gl.float32, ACC_L)
        zero_i = gl.zeros([BK_C, R_C], gl.int32, ST_L)
        # launched as the plan's PDL dependent: q quantised (and the loader's copies begun, the
        # keys older than the plan) before the wait for the plan's thresholds and zeroed counters
        gdc_wait()
        st = state_ptr + (row0 + r) * ST_WORDS
        thresh = gl.load(st + ST_THRESH, mask=row0 + r < n_rows, other=-1).to(gl.uint32,
                                                                                bitcast=True)
        # the scores compared as floats, ~(x <= t) (order_key(x) > T exactly when x > t or x is
        # NaN: topk._compare's FLOAT) against t, the fp32 of each row's threshold key T: +inf
        # for a NaN key (only NaNs lie above it; the all-ones key, above every score, drops the
        # row), -(the least subnormal) for the key of -0.0's bits (every score >= -0.0 above it)
        tbits = gl.where(thresh >= 0x80000000, thresh ^ 0x80000000, thresh ^ 0xFFFFFFFF)
        tbits = gl.where(thresh > 0xFF800000, 0x7F800000, tbits)
        tbits = gl.where(thresh == 0x7FFFFFFF, 0x80000001, tbits)
        tf = gl.expand_dims(tbits.to(gl.float32, bitcast=True), 0)
        live = thresh != 0xFFFFFFFF
        cap_i = zero_i + cap
        ctr = gl.expand_dims(st + ST_CNT, 0) + zero_i             # each row's counter
        buf = gl.expand_dims((row0 + r).to(gl.int64) * cap, 0) + zero_i
        # this warp's region of each row: (program, group, key half of the block, row)
        program = gl.program_id(0) * n_splits + split
        half = gl.expand_dims(key // 32, 1) + zero_i
        region = (((program * NG + ROLE) * 2 + half) * R_C
                  + gl.expand_dims(r, 0)).to(gl.int64) * REGION_C
        ckey_buf = ckey_ptr + buf
        cpos_buf = cpos_ptr + buf
        hkey_region = hkey_ptr + region
        hpos_region = hpos_ptr + region
        held = zero_i                                             # keys in the warp's region
        # this group's stages, as `_score`'s
        g = n_rows * 0 + ROLE
        word = next_block(g, steps, ready)
        j, sel, lens = word * 0 - 1, r < 0, r * 0            # no pass read yet
        while word >= 0:
            j, sel, lens = word_pass(word, j, sel, lens, row_req_ptr, len_ptr, row0, n_rows, n_req,
                                     capacity, r)
            sc, pos = block_scores(g, word & STEP_MASK, lens, w, zero, key, q_smem, k_bufs, s_bufs,
                                   empty)
            cand = (~(sc <= tf) & (gl.expand_dims(pos, 1) < gl.expand_dims(lens, 0))
                    & gl.expand_dims(sel & live, 0))
            bits = sc.to(gl.int32, bitcast=True)
            posi = gl.expand_dims(pos, 1) + zero_i
            held += gl.inline_asm_elementwise(
                FILTER_APPEND_PTX, "=r,r,r,l,l,l,r,r,r,l,l",
                [cand.to(gl.int32), held, ctr, ckey_buf, cpos_buf, bits, posi, cap_i,
                 hkey_region, hpos_region], dtype=gl.int32, is_pure=False, pack=1)
            g += NG
            word = next_block(g, steps, ready)
        # the regions into the rows' buffers (past cap: counted, not stored; the refine sends
        # such a row to the whole-row select)
        kept = gl.where(gl.expand_dims(row0 + r < n_rows, 0), gl.minimum(held, REGION_C), 0)
        at0 = gl.inline_asm_elementwise(WARP_TAKE_PTX, "=r,l,r", [ctr, kept], dtype=gl.int32,
                                        is_pure=False, pack=1)
        lane = gl.expand_dims(key % 32, 1) + zero_i
        for i in gl.static_range(0, REGION_C, 32):
            idx = lane + i
            m = (idx < kept) & (at0 + idx < cap)
            gl.store(ckey_ptr + buf + at0 + idx, gl.load(hkey_ptr + region + idx, mask=m), mask=m)
            gl.store(cpos_ptr + buf + at0 + idx, gl.load(hpos_ptr + region + idx, mask=m), mask=m)

    @gluon.jit
    def _filter0(q_ptr, w_ptr, row_req_ptr, len_ptr, state_ptr, ckey_ptr, cpos_ptr, hkey_ptr,
                 hpos_ptr, row0, n_rows, n_req, capacity, cap, split, n_splits, q_bar, q_smem,
                 w_smem, k_bufs, s_bufs, steps, ready, empty):
        _filter(0, q_ptr, w_ptr, row_req_ptr, len_ptr, state_ptr, ckey_ptr, cpos_ptr, hkey_ptr,
                hpos_ptr, row0, n_rows, n_req, capacity, cap, split, n_splits, q_bar, q_smem,
                w_smem, k_bufs, s_bufs, steps, ready, empty)

    @gluon.jit
    def _filter1(q_ptr, w_ptr, row_req_ptr, len_ptr, state_ptr, ckey_ptr, cpos_ptr, hkey_ptr,
                 hpos_ptr, row0, n_rows, n_req, capacity, cap, split, n_splits, q_bar, q_smem,
                 w_smem, k_bufs, s_bufs, steps, ready, empty):
        _filter(1, q_ptr, w_ptr, row_req_ptr, len_ptr, state_ptr, ckey_ptr, cpos_ptr, hkey_ptr,
                hpos_ptr, row0, n_rows, n_req, capacity, cap, split, n_splits, q_bar, q_smem,
                w_smem, k_bufs, s_bufs, steps, ready, empty)

    @gluon.jit
    def _filter2(q_ptr, w_ptr, row_req_ptr, len_ptr, state_ptr, ckey_ptr, cpos_ptr, hkey_ptr,
                 hpos_ptr, row0, n_rows, n_req, capacity, cap, split, n_splits, q_bar, q_smem,
                 w_smem, k_bufs, s_bufs, steps, ready, empty):
        _filter(2, q_ptr, w_ptr, row_req_ptr, len_ptr, state_ptr, ckey_ptr, cpos_ptr, hkey_ptr,
                hpos_ptr, row0, n_rows, n_req, capacity, cap, split, n_splits, q_bar, q_smem,
                w_smem, k_bufs, s_bufs, steps, ready, empty)

    @gluon.jit
    def _indexer_ws_filter_kernel(q_ptr, w_ptr, k_desc, s_desc, table_ptr, table_stride, row_req_ptr,
                                  len_ptr, state_ptr, ckey_ptr, cpos_ptr, hkey_ptr, hpos_ptr, claim_ptr,
                                  n_rows, n_req, capacity, n_splits, cap, num_warps: gl.constexpr,
                                  PDL: gl.constexpr = False):
        """PDL: launched as the dependent of the kernel before (the math groups wait for it in
        `_filter`, the producer before its first claim; no-ops without PDL)."""
        if PDL:
            gdc_launch_dependents()   # the refine may launch; it waits for this kernel to finish
        row0 = gl.program_id(0) * R_C
        split = gl.program_id(1)
        q_smem, w_smem, k_bufs, s_bufs, steps, ready, empty, q_bar = shared_state()
        filters = (q_ptr, w_ptr, row_req_ptr, len_ptr, state_ptr, ckey_ptr, cpos_ptr, hkey_ptr,
                   hpos_ptr, row0, n_rows, n_req, capacity, cap, split, n_splits, q_bar, q_smem,
                   w_smem, k_bufs, s_bufs, steps, ready, empty)
        gl.warp_specialize([
            (_filter0, filters),
            (_filter1, filters),
            (_filter2, filters),
            # no score rows, so no -inf tails (write_tail 0: the loader's out_ptr is never written)
            (loader, (k_desc, s_desc, table_ptr, table_stride, row_req_ptr, len_ptr, w_ptr, claim_ptr,
                      row0, n_rows, n_req, capacity, split, n_splits, 0, k_bufs, s_bufs, steps, ready,
                      empty, PDL))],
            [4, 4, 1], [152, 152, 32])


def regions(n_rows: int, device, splits: int) -> torch.Tensor:
    """The filter's scratch: per program, math group, key half and row, REGION (score, position)
    slots (int32 [2, ...])."""
    tiles = -(-n_rows // ROWS)
    return torch.empty((2, tiles * splits * 3 * 2 * ROWS * REGION), dtype=torch.int32, device=device)


def launch_filter(q, weights, index_cache, block_table, row_req, row_len, capacity: int, state,
                  ckey, cpos, cap: int, splits: int | None = None, pdl: bool = False) -> None:
    """The scan with the top-k filter (callers check `indexer_ws.why_not` first): no scores
    written; each key of row t above its threshold (state[t, ST_THRESH], an order key) goes as
    (fp32 bits, position) to ckey / cpos[t, slot] for a slot counted at state[t, ST_CNT] (which
    the caller zeroes), stored while slot < cap. pdl: launched as the PDL dependent of the
    kernel that wrote the thresholds (its math groups wait for it after quantising q)."""
    n = q.shape[0]
    if splits is None:
        splits = plan_splits(n, capacity, target_of(q.device).sm_count)
    check_capacity(capacity)
    held = regions(n, q.device, splits)
    k_desc, s_desc = descriptors(index_cache)
    tiles = -(-n // ROWS)
    _indexer_ws_filter_kernel[(tiles, splits)](
        q, weights, k_desc, s_desc, block_table, block_table.stride(0), row_req, row_len, state,
        ckey, cpos, held[0], held[1], claim_counters.counters(q.device, tiles), n, block_table.shape[0],
        capacity, splits, cap, num_warps=NUM_WARPS, **({"PDL": True, "launch_pdl": True} if pdl else {}))


def aot_spec(shapes, op: str, cap: int, pdl: bool = False):
    """The filter scan's launch at `shapes` (aot_spec.AotShapes) for R = 4 rows a request and a
    candidate buffer of `cap` (pdl: `launch_filter`'s), or None where indexer_ws does not take
    those shapes."""
    from k31c.lowering.triton.mla_common import table_width
    cfg = shapes.cfg
    if GLUON_ERROR is not None or (cfg.index_n_heads, cfg.index_head_dim, shapes.block_size) != (
            HEADS, D, BLOCK) or ROWS not in shapes.rows_per_request:
        return None
    n = shapes.batch * ROWS
    k_lay, s_lay = shared_layouts()
    i32 = torch.int32
    return kernel_spec(
        _indexer_ws_filter_kernel, op, f"fp8,R={ROWS},ws,filter" + (",pdl" if pdl else ""),
        dict(num_warps=NUM_WARPS, PDL=pdl),
        dict(q_ptr=cfg.torch_dtype, w_ptr=torch.float32, table_ptr=i32, row_req_ptr=i32, len_ptr=i32,
             state_ptr=i32, ckey_ptr=i32, cpos_ptr=i32, hkey_ptr=i32, hpos_ptr=i32, claim_ptr=i32,
             k_desc=descriptor_type(torch.float8_e4m3fn, (BLOCK, D), k_lay),
             s_desc=descriptor_type(torch.float32, (2, 32), s_lay)),
        num_warps=NUM_WARPS,
        ints=dict(table_stride=table_width(shapes), n_rows=n, n_req=shapes.batch,
                  capacity=shapes.context, cap=cap,
                  n_splits=plan_splits(n, shapes.context, shapes.target.sm_count)))
