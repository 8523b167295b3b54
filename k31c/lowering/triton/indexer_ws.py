"""Warp-specialized lightning indexer scan on sm_90a (Gluon): h200's kernel for an FP8 index cache
read by 4-row verification steps (`indexer.launch_indexer` runs it where `why_not` finds nothing).

A tile of 4 consecutive query rows (one request in the decode layout: 4 rows x 32 heads = 128
query columns, m = r * 32 + h) has `splits` programs, which take chunks of CHUNK of the request's
64-key cache blocks from a counter of the tile's (`claim_counters`), so a program on a slower SM
takes fewer and the tile's programs end together. Three partitions:

- three math warp groups first quantise q, group k the rows r with r % 3 == k (32 query columns
  each, group 0 also row 3): e4m3 per (row, head), scale
  max(amax, 1e-4) / 448, x / scale computed as x * (1 / scale) plus one FMA correction (the
  correctly rounded quotient, as the TMA kernel's true division gives), clamped to +-448; the
  scales are folded into the head weights. q stays in shared memory;
- a 1-warp producer claims chunks (the next claim in flight while a chunk is copied) and
  bulk-copies each block (its 64 e4m3 keys as a [64, 128] TMA box, its 64 fp32 scales as a
  [2, 32] box of the same 8448-byte block; a -1 block is read as zeros) into a ring of 9 stages,
  each stage's block step in a word beside it, its first copies running under the q prologue;
  the tile's last program to finish zeroes the tile's counters for the next launch;
- math group k takes ring stages g with g % 3 == k, so two groups' epilogues run under the third's
  wgmma (the epilogue, not the copies, set the pace with two groups): the
  keys-as-M FP8 wgmma [64 keys, 128 query columns], ReLU, times the head weights, the sum over
  each row's 32 heads, times the key scale, -inf at or past the row's length.

The producer also writes -inf past a request's last block (shared out over the splits). Any
row_req is taken: a tile whose rows belong to several requests runs one pass per run of rows of
one request, each pass with its own claim counter, scoring and writing only its own rows (in
the decode layout there is one pass). The grid depends on static shapes only (CUDA-graph safe);
lengths, requests and blocks are read on the device. The ring, its producer and the sizes are
`indexer_ws_ring`'s. Splits: one program an SM (the math groups hold 152-176 registers a thread).
"""
from __future__ import annotations

import torch

from k31c.graph.ops.fp8_layouts import is_mxfp8_index_cache
from k31c.lowering.aot_spec import descriptor_type, kernel_spec
from k31c.lowering.triton import claim_counters
from k31c.lowering.triton.device import target_of
from k31c.lowering.triton.gluon_sm90 import GLUON_ERROR, why_not_sm90
from k31c.lowering.triton.indexer_ws_ring import BLOCK, BLOCK_BYTES, D, HEADS, PASS_SHIFT, ROWS

if GLUON_ERROR is None:
    from k31c.lowering.triton.gluon_sm90 import (fence_async_shared, gl, gluon, mbarrier, sync,
                                                 warpgroup_mma, warpgroup_mma_wait)
    from k31c.lowering.triton.indexer_ws_ring import (BK_C, D_C, H_C, NB, NG, PASS_SHIFT_C, R_C,
                                                      STEP_MASK, gdc_launch_dependents, gdc_wait,
                                                      loader, next_block, shared_state)

MIN_STEPS = 4                                    # blocks a split takes at least
NUM_WARPS = 4                                    # the default partition (math group 0)

if GLUON_ERROR is None:
    @gluon.jit
    def pass_rows(row_req_ptr, len_ptr, row0, n_rows, n_req, capacity, j, r):
        """Pass j of the tile (the run of rows from row j, one request's): the rows of that
        request in the tile (over `r` = arange(R_C)) and their lengths (0 outside it)."""
        req = gl.load(row_req_ptr + gl.minimum(row0 + j, n_rows - 1))
        in_tile = row0 + r < n_rows
        sel = in_tile & (gl.load(row_req_ptr + row0 + r, mask=in_tile, other=-1) == req)
        req_ok = (req >= 0) & (req < n_req)
        lens = gl.minimum(gl.load(len_ptr + row0 + r, mask=in_tile, other=0), capacity)
        return sel, gl.where(sel & req_ok, lens, 0)

    @gluon.jit
    def word_pass(word, j, sel, lens, row_req_ptr, len_ptr, row0, n_rows, n_req, capacity, r):
        """The pass j of a stage's word, the rows of its request in the tile and their lengths,
        read again (`pass_rows`) where the word starts another pass than j."""
        if (word >> PASS_SHIFT_C) != j:
            j = word >> PASS_SHIFT_C
            sel, lens = pass_rows(row_req_ptr, len_ptr, row0, n_rows, n_req, capacity, j, r)
        return j, sel, lens

    @gluon.jit
    def quantise_q(ROLE: gl.constexpr, q_ptr, w_ptr, row0, n_rows, q_smem, w_smem, q_bar):
        # this group's rows of the tile (r % NG == ROLE) -> e4m3 in shared memory, their scales
        # folded into the head weights; then wait for the other groups'
        Q_L: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        cols = gl.arange(0, D_C, gl.SliceLayout(0, Q_L))
        for c in gl.static_range(ROLE, R_C, NG):
            m = c * H_C + gl.arange(0, H_C, gl.SliceLayout(1, Q_L))
            ok = row0 + c < n_rows
            at = (row0 * H_C + m).to(gl.int64)
            qx = gl.load(q_ptr + gl.expand_dims(at, 1) * D_C + gl.expand_dims(cols, 0),
                         mask=gl.expand_dims(m >= 0, 1) & ok, other=0.0).to(gl.float32)
            scale = gl.div_rn(gl.maximum(gl.max(gl.abs(qx), 1), 1e-4), 448.0)
            inv = gl.expand_dims(gl.div_rn(1.0, scale), 1)
            y0 = qx * inv
            qy = gl.fma(gl.fma(-y0, gl.expand_dims(scale, 1), qx), inv, y0)
            qy = gl.minimum(gl.maximum(qy, -448.0), 448.0).to(gl.float8e4nv)
            q_smem.slice(c * H_C, H_C, dim=0).store(qy)
            w = gl.load(w_ptr + at, mask=(m >= 0) & ok, other=0.0)
            w_smem.slice(c * H_C, H_C, dim=0).store(w * scale)
        fence_async_shared()
        sync()
        mbarrier.arrive(q_bar, count=1)
        mbarrier.wait(q_bar, 0)

    @gluon.jit
    def block_scores(g, step, lens, w, zero, key, q_smem, k_bufs, s_bufs, empty):
        """The block in ring stage g % NB (landed), the request's step-th: its scores [64 keys,
        4 rows] (-inf at or past each row's length) and positions; its stage freed."""
        ST_L: gl.constexpr = gl.BlockedLayout([1, 2], [32, 1], [2, 2], [0, 1])   # [64 keys, 4 rows]
        SC_L: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        b = g % NB
        acc = warpgroup_mma(k_bufs.index(b), q_smem.permute((1, 0)), zero, use_acc=False,
                            is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        x = gl.maximum(acc, 0.0) * gl.expand_dims(w, 0)
        sc = gl.convert_layout(gl.sum(gl.reshape(x, [BK_C, R_C, H_C]), 2), ST_L)
        ks = s_bufs.index(b)._reinterpret(gl.float32, [BK_C], SC_L).load(gl.SliceLayout(1, ST_L))
        sync()
        mbarrier.arrive(empty.index(b), count=1)        # the stage is free again
        pos = step * BK_C + key
        sc = gl.where(gl.expand_dims(pos, 1) < gl.expand_dims(lens, 0),
                      sc * gl.expand_dims(ks, 1), float("-inf"))
        return sc, pos

    @gluon.jit
    def _score(ROLE: gl.constexpr, q_ptr, w_ptr, row_req_ptr, len_ptr, out_ptr, row0, n_rows,
               n_req, capacity, q_bar, q_smem, w_smem, k_bufs, s_bufs, steps, ready, empty):
        ACC_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, 128, 32])
        ST_L: gl.constexpr = gl.BlockedLayout([1, 2], [32, 1], [2, 2], [0, 1])   # [64 keys, 4 rows]
        quantise_q(ROLE, q_ptr, w_ptr, row0, n_rows, q_smem, w_smem, q_bar)
        w = w_smem.load(gl.SliceLayout(0, ACC_L))                 # [128] head weights x q scales
        r = gl.arange(0, R_C, gl.SliceLayout(0, ST_L))
        key = gl.arange(0, BK_C, gl.SliceLayout(1, ST_L))
        out_rows = out_ptr + r.to(gl.int64) * capacity
        zero = gl.zeros([BK_C, R_C * H_C], gl.float32, ACC_L)
        # this group's stages: g % NG == ROLE
        g = n_rows * 0 + ROLE
        word = next_block(g, steps, ready)
        j, sel, lens = word * 0 - 1, r < 0, r * 0            # no pass read yet
        while word >= 0:
            j, sel, lens = word_pass(word, j, sel, lens, row_req_ptr, len_ptr, row0, n_rows, n_req,
                                     capacity, r)
            sc, pos = block_scores(g, word & STEP_MASK, lens, w, zero, key, q_smem, k_bufs, s_bufs,
                                   empty)
            gl.store(gl.expand_dims(out_rows, 0) + gl.expand_dims(pos, 1), sc,
                     mask=gl.expand_dims(pos < capacity, 1) & gl.expand_dims(sel, 0))
            g += NG
            word = next_block(g, steps, ready)

    @gluon.jit
    def _score0(q_ptr, w_ptr, row_req_ptr, len_ptr, out_ptr, row0, n_rows, n_req, capacity, q_bar,
                q_smem, w_smem, k_bufs, s_bufs, steps, ready, empty):
        _score(0, q_ptr, w_ptr, row_req_ptr, len_ptr, out_ptr, row0, n_rows, n_req, capacity,
               q_bar, q_smem, w_smem, k_bufs, s_bufs, steps, ready, empty)

    @gluon.jit
    def _score1(q_ptr, w_ptr, row_req_ptr, len_ptr, out_ptr, row0, n_rows, n_req, capacity, q_bar,
                q_smem, w_smem, k_bufs, s_bufs, steps, ready, empty):
        _score(1, q_ptr, w_ptr, row_req_ptr, len_ptr, out_ptr, row0, n_rows, n_req, capacity,
               q_bar, q_smem, w_smem, k_bufs, s_bufs, steps, ready, empty)

    @gluon.jit
    def _score2(q_ptr, w_ptr, row_req_ptr, len_ptr, out_ptr, row0, n_rows, n_req, capacity, q_bar,
                q_smem, w_smem, k_bufs, s_bufs, steps, ready, empty):
        _score(2, q_ptr, w_ptr, row_req_ptr, len_ptr, out_ptr, row0, n_rows, n_req, capacity,
               q_bar, q_smem, w_smem, k_bufs, s_bufs, steps, ready, empty)

    @gluon.jit
    def _indexer_ws_kernel(q_ptr, w_ptr, k_desc, s_desc, table_ptr, table_stride, row_req_ptr,
                           len_ptr, out_ptr, claim_ptr, gate_ptr, n_rows, n_req, capacity, n_splits,
                           gate_stride, gate_offset, gate_value, num_warps: gl.constexpr,
                           GATED: gl.constexpr = False, PDL: gl.constexpr = False):
        """GATED: only tiles with a row whose gate word (gate_ptr[row * gate_stride +
        gate_offset]) equals gate_value run; the others return at once (they claim nothing).
        PDL: launched as the dependent of the kernel before, waiting for it before any access."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        row0 = gl.program_id(0) * R_C
        split = gl.program_id(1)
        if GATED:
            G_L: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
            rr = row0 + gl.arange(0, R_C, G_L)
            word = gl.load(gate_ptr + rr * gate_stride + gate_offset, mask=rr < n_rows,
                           other=gate_value + 1)
            if gl.max((word == gate_value).to(gl.int32), 0) == 0:
                return
        q_smem, w_smem, k_bufs, s_bufs, steps, ready, empty, q_bar = shared_state()
        out_row0 = out_ptr + row0.to(gl.int64) * capacity
        scans = (q_ptr, w_ptr, row_req_ptr, len_ptr, out_row0, row0, n_rows, n_req, capacity,
                 q_bar, q_smem, w_smem, k_bufs, s_bufs, steps, ready, empty)
        gl.warp_specialize([
            (_score0, scans),
            (_score1, scans),
            (_score2, scans),
            (loader, (k_desc, s_desc, table_ptr, table_stride, row_req_ptr, len_ptr, out_row0,
                      claim_ptr, row0, n_rows, n_req, capacity, split, n_splits, 1, k_bufs, s_bufs,
                      steps, ready, empty, False))],
            [4, 4, 1], [152, 152, 32])   # the default math group gets 176


def why_not(q, weights, index_cache, block_table, block_size: int) -> str | None:
    """Why `indexer.launch_indexer` runs another kernel for this call, or None when this one
    takes it (arguments already checked by `check_indexer`)."""
    reason = why_not_sm90(q.device)
    if reason is not None:
        return reason
    if index_cache.dtype != torch.uint8 or is_mxfp8_index_cache(index_cache):
        return "not the FP8 (e4m3 + fp32 scale) index cache"
    n, heads, d = q.shape
    if (heads, d, block_size) != (HEADS, D, BLOCK):
        return f"{heads} heads x {d} / {block_size}-key blocks: written for {HEADS} x {D} / {BLOCK}"
    if n != ROWS * block_table.shape[0]:
        return f"{n} rows for {block_table.shape[0]} requests: written for {ROWS} rows a request"
    if (not q.is_contiguous() or not weights.is_contiguous() or not index_cache.is_contiguous()
            or index_cache.stride(0) != BLOCK_BYTES or index_cache.data_ptr() % 16):
        return "a q, weights or cache layout that is not contiguous and aligned"
    return None


def check_capacity(capacity: int) -> None:
    """A stage's word holds a block step below 1 << PASS_SHIFT."""
    if capacity > BLOCK << PASS_SHIFT:
        raise ValueError(f"indexer scan: {capacity} keys a row; the warp-specialized scan takes at most "
                         f"{BLOCK << PASS_SHIFT}")


def plan_splits(n_rows: int, capacity: int, sm_count: int) -> int:
    """Key splits of each 4-row tile: one program an SM, at least MIN_STEPS blocks a split."""
    tiles = -(-n_rows // ROWS)
    return max(1, min(sm_count // max(tiles, 1), capacity // BLOCK // MIN_STEPS))


def shared_layouts():
    return (gl.NVMMASharedLayout.get_default_for([BLOCK, D], gl.float8e4nv),
            gl.NVMMASharedLayout.get_default_for([2, 32], gl.float32))


def descriptors(index_cache):
    """The FP8 cache [blocks, 8448] bytes as [blocks * 66, 128] e4m3 (key boxes [64, 128]) and
    [blocks * 66, 32] fp32 (scale boxes [2, 32])."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    rows = index_cache.shape[0] * (BLOCK_BYTES // D)
    k_lay, s_lay = shared_layouts()
    return (TensorDescriptor(index_cache.view(torch.float8_e4m3fn).view(rows, D), [rows, D], [D, 1],
                             [BLOCK, D], k_lay),
            TensorDescriptor(index_cache.view(torch.float32).view(rows, 32), [rows, 32], [32, 1],
                             [2, 32], s_lay))


def launch(q, weights, index_cache, block_table, row_req, row_len, scores, splits: int | None = None,
           gate: tuple | None = None, pdl: bool = False):
    """Scores [N, capacity] fp32 into `scores` (callers check `why_not` first); `splits`
    overrides `plan_splits` (tests, benchmarks). gate = (words, stride, offset, value): only the
    tiles with a row whose words[row * stride + offset] == value are scored (the rest of `scores`
    untouched). pdl: launched as the PDL dependent of the kernel before (sm_90)."""
    n, capacity = q.shape[0], scores.shape[1]
    check_capacity(capacity)
    if splits is None:
        splits = plan_splits(n, capacity, target_of(q.device).sm_count)
    words, stride, offset, value = gate if gate is not None else (row_len, 1, 0, 0)
    k_desc, s_desc = descriptors(index_cache)
    tiles = -(-n // ROWS)
    _indexer_ws_kernel[(tiles, splits)](
        q, weights, k_desc, s_desc, block_table, block_table.stride(0), row_req, row_len, scores,
        claim_counters.counters(q.device, tiles), words, n, block_table.shape[0], capacity, splits,
        stride, offset, value, num_warps=NUM_WARPS, GATED=gate is not None,
        **({"PDL": True, "launch_pdl": True} if pdl else {}))
    return scores


def aot_spec(shapes, op: str, sample_stride: int = 1, gate: tuple | None = None, pdl: bool = False):
    """This kernel's launch at `shapes` (aot_spec.AotShapes) for R = 4 rows a request, or None
    where it does not take those shapes. sample_stride: over one block in that many (the fused
    select's sample scan, its table `sample_stride` times narrower); gate = (stride, offset,
    value): the gated launch (`launch`'s gate, its words' layout); pdl: `launch`'s."""
    from k31c.lowering.triton.mla_common import table_width
    cfg = shapes.cfg
    if GLUON_ERROR is not None or (cfg.index_n_heads, cfg.index_head_dim, shapes.block_size) != (
            HEADS, D, BLOCK) or ROWS not in shapes.rows_per_request:
        return None
    n = shapes.batch * ROWS
    width = -(-table_width(shapes) // sample_stride)
    capacity = shapes.context if sample_stride == 1 else width * BLOCK
    gate_stride, gate_offset, gate_value = gate if gate is not None else (1, 0, 0)
    tag = f"fp8,R={ROWS},ws" + (f",sample/{sample_stride}" if sample_stride > 1 else "") + (
        ",gated" if gate is not None else "")
    k_lay, s_lay = shared_layouts()
    return kernel_spec(
        _indexer_ws_kernel, op, tag + (",pdl" if pdl else ""),
        dict(num_warps=NUM_WARPS, GATED=gate is not None, PDL=pdl),
        dict(q_ptr=cfg.torch_dtype, w_ptr=torch.float32, table_ptr=torch.int32,
             row_req_ptr=torch.int32, len_ptr=torch.int32, out_ptr=torch.float32,
             claim_ptr=torch.int32, gate_ptr=torch.int32,
             k_desc=descriptor_type(torch.float8_e4m3fn, (BLOCK, D), k_lay),
             s_desc=descriptor_type(torch.float32, (2, 32), s_lay)),
        num_warps=NUM_WARPS,
        ints=dict(table_stride=width, n_rows=n, n_req=shapes.batch, capacity=capacity,
                  gate_stride=gate_stride, gate_offset=gate_offset, gate_value=gate_value,
                  n_splits=plan_splits(n, capacity, shapes.target.sm_count)))
