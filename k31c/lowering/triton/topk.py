"""Triton radix top-k (`k31c::topk_select`): the select pipeline's kernels and its launcher.

Selection (spec/model.md §6.7.4): row t keeps the k largest composites `key << 32 | position`
over its positions < row_len[t], where key is the score's order-preserving uint32 image (-0.0 ties
with +0.0, every NaN sits above +inf, as torch.sort orders them). Composites are distinct, so the
set is unique and equals the reference's: among equal scores the higher position wins.

Three launches (no host sync; grids from static shapes; CUDA-graph safe). On CUDA sm_90+ the
filter and the refine are each the PDL dependent of the launch before (`device.pair_launch`):
their programs launch while it runs and wait for it at their start, hiding the launch latency
(the filter's first tile of scores is read before its wait: the scores come from before the plan).
1. plan, one program per row: rows with row_len <= k are written out (0..n-1, then -1). Rows
   with n <= cap take threshold T = 0 (every position is a candidate). Longer rows gather a
   strided sample (runs of 8; more keys for longer rows, so about 80 sampled keys lie above T)
   into registers and take as T a key with about rank = TARGET*samples/n sampled scores above
   it, so about TARGET = 2.5k keys of the row lie above T: a value within rank / 8 of it found
   by a value histogram, else (ties, NaN or inf in the sample) the sample key ranked `rank`
   exactly (25 bits of it).
2. filter, several programs per row: one pass appends each (key, position) with key > T to the
   row's candidate buffer and counts the keys == T of its chunk. Offsets within a tile are a scan
   within runs of 4 positions and one over the runs; a program appends to slots of its own
   first (one atomic on the row's counter when it ends, to copy them over), and a tile that
   would overflow them appends straight to the row's buffer (an atomic per tile).
3. refine, one program per row, with G keys > T buffered and E keys == T in the row:
   - k <= G <= cap: exact top-k of the buffer, held in registers (radix select on the key, then
     on the position among the keys tied at the k-th);
   - G < k <= G + E (e.g. ReLU zeros at T): the whole buffer plus the k - G highest positions at
     T, read from the chunks with ties, top down;
   - otherwise (the sample misjudged T; rare): the program selects exactly from the whole row
     itself (4 histogram passes of 8-bit digits, then the output pass), so no launch waits for
     a case that almost never happens.

The selection helpers are in `radix_select.py`, the plan's threshold in `topk_threshold.py`.
`topk_plan.plan` picks the chunking, buffer and sample sizes once; the launcher and `aot_specs`
read it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k31c.graph.ops.indexer import check_topk
from k31c.lowering.aot_spec import kernel_spec
from k31c.lowering.registry import register
from k31c.lowering.targets import GPU_TARGETS
from k31c.lowering.triton.radix_select import (key_float, order_key, sample_position, select_from_row, select_kth,
                                               select_kth_bracketed, store_where, take_top_ties, write_selected)
from k31c.lowering.triton.unit_stride import require_unit_stride
from k31c.lowering.triton.device import (PDL_ON, inline_ptx, let_dependent_start, pair_launch,
                                         pdl_launch, sm_count, wait_for_producers)
from k31c.lowering.triton import topk_plan
from k31c.lowering.triton.topk_plan import (MODE_WHOLE_ROW, ST_CNT, ST_MODE, ST_SLOTS, ST_THRESH, ST_WORDS, TopkPlan,
                                           pow2)
from k31c.lowering.triton.topk_threshold import sample_threshold

DEBUG_PATHS = False             # tests: record in `last_paths` the path each row took (syncs)
last_paths: list[str] = []
RUN_KEYS = tl.constexpr(4)    # filter positions per run: one 16-byte vector of fp32 scores
INF_KEY = tl.constexpr(0xFF800000)             # order_key(+inf)
NEG_ZERO_BITS_KEY = tl.constexpr(0x7FFFFFFF)   # ~0x80000000: no score has it (order_key maps -0.0 to +0.0)
# the refine's whole-row selects (`_refine_kernel`'s ROW_SELECT): in place, deferred (the row
# marked ST_MODE = MODE_WHOLE_ROW), or only those of the marked rows
ROW_SELECT_NOW, ROW_SELECT_DEFER, ROW_SELECT_MARKED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


# ---- kernels ----------------------------------------------------------------------------------

@triton.jit
def _plan_kernel(src_ptr, src_stride, row_len_ptr, out_ptr, out_stride, state_ptr, few_ptr, k, cap, target,
                 SAMPLES: tl.constexpr, RUN: tl.constexpr, TILE: tl.constexpr, GROUP: tl.constexpr,
                 FEW: tl.constexpr, PDL: tl.constexpr = False, PTX: tl.constexpr = False,
                 DEPENDENT: tl.constexpr = False, src_len_ptr=None):
    """Per row: reset its state; write it out if row_len <= k; else choose the filter threshold.
    src_len_ptr (the fused select's): src holds scores of sampled blocks only, src_len_ptr[row]
    of them, sampled from as from a row of that length; else src holds the whole rows."""
    wait_for_producers(PDL)
    let_dependent_start(PDL, DEPENDENT)     # the filter's programs launch now and wait for this one
    row = tl.program_id(0)
    n = tl.load(row_len_ptr + row)
    st = state_ptr + row * ST_WORDS
    tl.store(st + ST_CNT, 0)
    thresh = tl.zeros((), tl.uint32)
    if n <= k:       # every visible position, then -1
        tl.store(st + ST_MODE, 1)
        for start in range(0, k, TILE):
            j = start + tl.arange(0, TILE)
            tl.store(out_ptr + row.to(tl.int64) * out_stride + j, tl.where(j < n, j, -1), mask=j < k)
    else:
        tl.store(st + ST_MODE, 0)
        if n > cap:  # threshold from a sample; shorter rows keep 0 (all positions are candidates)
            i = tl.arange(0, SAMPLES)
            n_src = n if src_len_ptr is None else tl.load(src_len_ptr + row)
            x = tl.load(src_ptr + row.to(tl.int64) * src_stride + sample_position(i, n_src, SAMPLES, RUN))
            rank = tl.minimum((target.to(tl.int64) * SAMPLES + n - 1) // n, SAMPLES).to(tl.int32)
            thresh = sample_threshold(x, rank, few_ptr + row.to(tl.int64) * FEW, st + ST_SLOTS, SAMPLES, GROUP, FEW,
                                       PTX)
    tl.store(st + ST_THRESH, thresh.to(tl.int32, bitcast=True))


@triton.jit
def _append_tile(st, ckey_row, cpos_row, hkey, hpos, held, key, pos, sel, cap, SLOTS: tl.constexpr,
                 PTX: tl.constexpr):
    """Append the selected (key, position) of a [runs, RUN_KEYS] tile: to the program's own SLOTS
    slots while they hold it (no round trip to the row's counter on the tile's critical path),
    else straight to the row's candidate buffer at slots taken from its counter. Offsets are a
    scan inside each run (a thread's registers) plus a scan over the run totals, not one scan
    over the tile (which Triton spreads over every lane, one strand of shuffles per register).
    Returns how many slots the program now holds."""
    seli = sel.to(tl.int32)
    run_total = tl.sum(seli, 1)
    total = tl.sum(run_total, 0)
    if total > 0:
        offs = (tl.cumsum(run_total, 0) - run_total)[:, None] + tl.cumsum(seli, 1) - seli
        if held + total <= SLOTS:
            store_where(hkey + held + offs, key.to(tl.int32, bitcast=True), sel, PTX)
            store_where(hpos + held + offs, pos, sel, PTX)
            held += total
        else:
            # relaxed: the default acq_rel would make each tile's atomic wait for the stores before it
            idx = tl.atomic_add(st + ST_CNT, total, sem="relaxed") + offs
            ok = sel & (idx < cap)
            store_where(ckey_row + idx, key.to(tl.int32, bitcast=True), ok, PTX)
            store_where(cpos_row + idx, pos, ok, PTX)
    return held


@triton.jit
def _flush_held(st, ckey_row, cpos_row, hkey, hpos, held, cap, SLOTS: tl.constexpr, PTX: tl.constexpr):
    """Move the program's `held` candidates to the row's buffer: one counter atomic per program."""
    if held > 0:
        tl.debug_barrier()       # every thread's held stores are visible to the block
        base = tl.atomic_add(st + ST_CNT, held, sem="relaxed")
        i = tl.arange(0, SLOTS)
        ok = (i < held) & (base + i < cap)
        key = tl.load(hkey + i, mask=ok, other=0, cache_modifier=".cg")
        pos = tl.load(hpos + i, mask=ok, other=0, cache_modifier=".cg")
        store_where(ckey_row + base + i, key, ok, PTX)
        store_where(cpos_row + base + i, pos, ok, PTX)


@triton.jit
def _filter_span(src_row, lo, hi, first, st, ckey_row, cpos_row, hkey, hpos, thresh, cap, TILE: tl.constexpr,
                 SLOTS: tl.constexpr, FLOAT: tl.constexpr, PTX: tl.constexpr):
    """Filter positions [lo, hi) of a row against `thresh`, starting from `first`, the tile at lo
    (`_first_tile`); returns (slots held, keys == T).
    FLOAT: `thresh` is the fp32 t with order_key(t) == T (T <= the key of +inf, not the key of
    -0.0's bits), and the scores are compared as floats: order_key(x) > T exactly when x > t or x
    is NaN (an unordered >), and order_key(x) == T when x == t (-0.0 == +0.0), one instruction
    each instead of the order key's seven. Else `thresh` is T and the order keys are compared.
    The candidates' keys are appended as the scores' bits (the refine takes their order keys)."""
    run = tl.arange(0, TILE // RUN_KEYS)[:, None] * RUN_KEYS
    offs = run + tl.arange(0, RUN_KEYS)[None, :]
    held = tl.zeros((), tl.int32)
    ties = tl.zeros([TILE // RUN_KEYS], tl.int32)     # per run: a thread's adds, no carried tile
    nxt = first
    for start in range(lo, hi, TILE):
        pos = start + offs
        x = nxt          # the next tile's load is in flight while this one is filtered
        # the scores are read once, so evict-first (a 4% faster select, BENCHMARKS.md): L2 is left
        # to what is read again (the candidate buffers the refine reads back, likely the gain)
        nxt = tl.load(src_row + pos + TILE, mask=start + TILE + run + RUN_KEYS <= hi, other=0.0,
                      eviction_policy="evict_first")
        live = start + run + RUN_KEYS <= hi
        above, tie = _compare(x, thresh, FLOAT)
        ties += tl.sum((live & tie).to(tl.int32), 1)
        held = _append_tile(st, ckey_row, cpos_row, hkey, hpos, held, x.to(tl.int32, bitcast=True), pos,
                            live & above, cap, SLOTS, PTX)
    n_ties = tl.sum(ties, 0)
    tail = lo + (hi - lo) // RUN_KEYS * RUN_KEYS      # the partial run [tail, hi)
    if tail < hi:
        pos = tail + tl.arange(0, RUN_KEYS)[None, :]
        live = pos < hi
        x = tl.load(src_row + pos, mask=live, other=0.0)
        above, tie = _compare(x, thresh, FLOAT)
        n_ties += tl.sum(tl.sum((live & tie).to(tl.int32), 1), 0)
        held = _append_tile(st, ckey_row, cpos_row, hkey, hpos, held, x.to(tl.int32, bitcast=True), pos,
                            live & above, cap, SLOTS, PTX)
    return held, n_ties


@triton.jit
def _first_tile(src_row, lo, hi, TILE: tl.constexpr):
    """The [runs, RUN_KEYS] tile of scores at lo (whole runs below hi; the rest 0), evict-first
    as `_filter_span`'s other loads."""
    run = tl.arange(0, TILE // RUN_KEYS)[:, None] * RUN_KEYS
    return tl.load(src_row + lo + run + tl.arange(0, RUN_KEYS)[None, :], mask=lo + run + RUN_KEYS <= hi, other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def _compare(x, thresh, FLOAT: tl.constexpr):
    """(order_key(x) > T, order_key(x) == T) for scores x (see `_filter_span`)."""
    if FLOAT:
        return ~(x <= thresh), x == thresh
    else:
        key = order_key(x)
        return key > thresh, key == thresh


@triton.jit
def _filter_kernel(src_ptr, src_stride, row_len_ptr, state_ptr, ckey_ptr, cpos_ptr, hkey_ptr, hpos_ptr,
                   ties_ptr, cap, chunk, TILE: tl.constexpr, SLOTS: tl.constexpr, PDL: tl.constexpr = False,
                   PTX: tl.constexpr = False):
    """One pass over a chunk of a row: append keys > threshold, count keys == threshold. The
    tiles are whole runs of RUN_KEYS positions ([TILE / RUN_KEYS, RUN_KEYS], a run masked as one,
    so a run is one vector load and its scan stays in a thread); the chunk's last partial run,
    if any, comes after the loop. Thresholds up to the key of +inf (all but NaN-heavy rows)
    compare the scores as floats."""
    # The scores and row_len come from kernels before the plan, which waited for them before it
    # let this launch start: the first tile's load goes out before the wait for the plan, and the
    # plan's two state words after it in one round trip.
    row = tl.program_id(0)
    n = tl.load(row_len_ptr + row)
    lo = tl.program_id(1) * chunk
    hi = tl.maximum(tl.minimum(lo + chunk, n), lo)
    src_row = src_ptr + row.to(tl.int64) * src_stride
    first = _first_tile(src_row, lo, hi, TILE)
    wait_for_producers(PDL)
    st = state_ptr + row * ST_WORDS
    mode = tl.load(st + ST_MODE)
    thresh = tl.load(st + ST_THRESH).to(tl.uint32, bitcast=True)
    if mode == 0:
        ckey_row = ckey_ptr + row.to(tl.int64) * cap
        cpos_row = cpos_ptr + row.to(tl.int64) * cap
        prog = row * tl.num_programs(1) + tl.program_id(1)
        hkey = hkey_ptr + prog.to(tl.int64) * SLOTS      # the program's own candidate slots
        hpos = hpos_ptr + prog.to(tl.int64) * SLOTS
        if (thresh <= INF_KEY) & (thresh != NEG_ZERO_BITS_KEY):
            held, n_ties = _filter_span(src_row, lo, hi, first, st, ckey_row, cpos_row, hkey, hpos, key_float(thresh),
                                        cap, TILE, SLOTS, True, PTX)
        else:
            held, n_ties = _filter_span(src_row, lo, hi, first, st, ckey_row, cpos_row, hkey, hpos, thresh,
                                        cap, TILE, SLOTS, False, PTX)
        _flush_held(st, ckey_row, cpos_row, hkey, hpos, held, cap, SLOTS, PTX)
        tl.store(ties_ptr + prog, n_ties)


@triton.jit
def _refine_kernel(src_ptr, src_stride, row_len_ptr, out_ptr, out_stride, state_ptr, ckey_ptr,
                   cpos_ptr, ties_ptr, few_ptr, k, cap, chunk, n_chunks, CP: tl.constexpr, BUF: tl.constexpr,
                   TILE: tl.constexpr, FEW: tl.constexpr, PDL: tl.constexpr = False, PTX: tl.constexpr = False,
                   ROW_SELECT: tl.constexpr = ROW_SELECT_NOW):
    """Per row, with G keys > threshold T in the buffer and E keys == T in the row:
    k <= G <= cap: exact top-k of the buffer (key digits, then positions among ties);
    G < k <= G + E: the whole buffer plus the k - G highest positions at T, found by reading
    chunks of the scores from the top; anything else: exact selection from the whole row
    (ROW_SELECT: now, or later (the row marked for a launch of its own, ROW_SELECT_MARKED, that
    selects only the marked rows: the fused select writes their scores in between)).
    The key select narrows the buffer by counts at two pivots a pass, then selects among the at
    most FEW candidates left, gathered through few_ptr (`select_kth_bracketed`)."""
    wait_for_producers(PDL)
    row = tl.program_id(0)
    st = state_ptr + row * ST_WORDS
    if ROW_SELECT == ROW_SELECT_MARKED:
        if tl.load(st + ST_MODE) == MODE_WHOLE_ROW:
            select_from_row(row, tl.load(row_len_ptr + row), k, out_ptr + row.to(tl.int64) * out_stride, src_ptr,
                            src_stride, TILE)
    elif tl.load(st + ST_MODE) == 0:
        count = tl.load(st + ST_CNT)
        thresh = tl.load(st + ST_THRESH).to(tl.uint32, bitcast=True)
        c = tl.arange(0, CP)
        ties = tl.load(ties_ptr + row * n_chunks + c, mask=c < n_chunks, other=0)
        need = k - count
        n = tl.load(row_len_ptr + row)
        out_row = out_ptr + row.to(tl.int64) * out_stride
        use_ties = (need > 0) & (need <= tl.sum(ties, 0)) & (count <= cap)
        if ((count >= k) & (count <= cap)) | use_ties:
            offs = tl.arange(0, BUF)
            live = offs < count
            x = tl.load(ckey_ptr + row.to(tl.int64) * cap + offs, mask=live, other=0).to(tl.float32, bitcast=True)
            key = order_key(x)
            cpos = cpos_ptr + row.to(tl.int64) * cap + offs
            key_t = tl.zeros((), tl.uint32)
            pos_t = tl.zeros((), tl.uint32)
            if need <= 0:
                # every candidate of a sampled row lies above the threshold (else thresh is 0)
                lo = tl.where(thresh > 0, thresh.to(tl.int64) + 1, 0)
                key_t, krem, exact = select_kth_bracketed(x, key, live, count, lo, k, few_ptr + row.to(tl.int64) * FEW,
                                                          FEW, PTX)
                if exact == 0:       # krem of the keys equal to the k-th: the highest positions
                    tied = live & (key == key_t)
                    pos_t, _, _ = select_kth(tl.load(cpos, mask=tied, other=0).to(tl.uint32), tied,
                                             krem, 7, SKIP_COMMON=True)
            pos = tl.load(cpos, mask=live, other=0)
            sel = live & ((key > key_t) | ((key == key_t) & (pos.to(tl.uint32) >= pos_t)))
            base = write_selected(out_row, 0, pos, sel, PTX)
            j = n_chunks - 1     # chunks from the top, each giving its highest positions at T
            while (need > 0) & (j >= 0):
                take = tl.minimum(tl.sum(tl.where(c == j, ties, 0), 0), need)
                if take > 0:
                    base = take_top_ties(row, j * chunk, tl.minimum(j * chunk + chunk, n), thresh, take,
                                          out_row, base, src_ptr, src_stride, TILE)
                need -= take
                j -= 1
        else:
            tl.store(st + ST_MODE, MODE_WHOLE_ROW)
            if ROW_SELECT == ROW_SELECT_NOW:
                select_from_row(row, n, k, out_row, src_ptr, src_stride, TILE)


# ---- launcher ---------------------------------------------------------------------------------

def launch_plan(scores, row_len, out, p: TopkPlan, ws: dict, **flags):
    """The plan launch of `p` on workspace `ws` (flags: PDL, PTX)."""
    _plan_kernel[(p.n_rows,)](scores, scores.stride(0), row_len, out, out.stride(0), ws["state"], ws["few"], p.k,
                              p.cap, p.target, SAMPLES=p.samples, RUN=p.run, TILE=topk_plan.REFINE_TILE,
                              GROUP=p.group, FEW=p.few, num_warps=topk_plan.warps(p.samples, topk_plan.PLAN_KEYS),
                              **flags)


def launch_refine(scores, row_len, out, p: TopkPlan, ws: dict, n_chunks: int | None = None, **flags):
    """The refine launch of `p` on workspace `ws` (flags: PDL, PTX, ROW_SELECT); n_chunks: the
    filter chunks whose tie counts it reads (default the plan's; 0: none, no tie path)."""
    n_chunks = p.n_chunks if n_chunks is None else n_chunks
    _refine_kernel[(p.n_rows,)](scores, scores.stride(0), row_len, out, out.stride(0), ws["state"], ws["ckey"],
                                ws["cpos"], ws["ties"], ws["few"], p.k, p.cap, p.chunk, n_chunks,
                                CP=pow2(n_chunks), BUF=pow2(p.cap), TILE=topk_plan.REFINE_TILE, FEW=p.few,
                                num_warps=topk_plan.warps(pow2(p.cap), topk_plan.REFINE_KEYS), **flags)


@register("k31c::topk_select", GPU_TARGETS)
def topk_select(scores: torch.Tensor, row_len: torch.Tensor, k: int) -> torch.Tensor:
    """The k best visible positions of each row (any order; -1 fills rows with row_len < k)."""
    check_topk(scores, row_len, k)
    require_unit_stride(row_len=row_len)
    n_rows, width = scores.shape
    out = torch.empty((n_rows, k), dtype=torch.int32, device=scores.device)
    if n_rows == 0:
        return out
    if width and scores.stride(1) != 1:
        scores = scores.contiguous()
    p = topk_plan.plan(n_rows, width, k, sm_count(scores.device))
    ws = p.workspace(scores.device)
    stride = scores.stride(0)
    pdl = pdl_launch(scores.device)
    ptx = {"PTX": True} if inline_ptx(scores.device) else {}
    chained = pair_launch(scores.device)
    launch_plan(scores, row_len, out, p, ws, **ptx, **pdl, **({"DEPENDENT": True} if chained else {}))
    if chained:     # filter and refine: each the PDL dependent of the launch before it
        pdl = PDL_ON
    if width == 0:
        return out
    _filter_kernel[(n_rows, p.n_chunks)](scores, stride, row_len, ws["state"], ws["ckey"], ws["cpos"],
                                         ws["hkey"], ws["hpos"], ws["ties"], p.cap, p.chunk, TILE=p.tile,
                                         SLOTS=p.slots, num_warps=topk_plan.FILTER_WARPS, **ptx, **pdl)
    launch_refine(scores, row_len, out, p, ws, **ptx, **pdl)
    if DEBUG_PATHS:
        last_paths[:] = topk_plan.row_paths(ws, row_len, k, p.cap)
    return out


def aot_specs(shapes, fused_sample_width: int | None = None, op: str = "k31c::topk_select") -> list:
    """The launches of `topk_select` on the GPU at `shapes` (aot_spec.AotShapes), for the
    ahead-of-time build: batch x R rows of `context` fp32 scores, constexprs from the plan.
    fused_sample_width: the fused select's top-k launches instead (indexer_topk): the plan on
    sampled scores rows that wide, the refine deferring whole-row selects and the select of the
    marked rows, neither with tie counts."""
    p = topk_plan.plan(shapes.batch * max(shapes.rows_per_request), shapes.context, shapes.cfg.index_topk,
                       shapes.target.sm_count)
    f32, i32 = torch.float32, torch.int32
    ws = dict(state_ptr=i32, few_ptr=i32, ckey_ptr=i32, cpos_ptr=i32, hkey_ptr=i32, hpos_ptr=i32, ties_ptr=i32,
              out_ptr=i32, row_len_ptr=i32, src_ptr=f32)

    # the launches' integers: scores [rows, context] (the indexer's output), out [rows, k]
    ints = dict(src_stride=shapes.context, out_stride=p.k, k=p.k, cap=p.cap, target=p.target,
                chunk=p.chunk, n_chunks=p.n_chunks)

    ptx = {"PTX": True} if shapes.target.triton_backend == "cuda" else {}   # as `inline_ptx` at launch
    # as `pair_launch` at launch: the plan lets the filter start, filter and refine wait
    chained = shapes.target.pdl_capable
    plan_dep, waits = ({"DEPENDENT": True}, {"PDL": True}) if chained else ({}, {})
    refine_tile, warps = topk_plan.REFINE_TILE, topk_plan.warps

    def spec(kernel, variant, consts, num_warps, **more_ints):
        names = set(kernel.arg_names)
        return kernel_spec(kernel, op, variant, consts, {n: t for n, t in ws.items() if n in names},
                           num_warps=num_warps, ints={n: v for n, v in {**ints, **more_ints}.items() if n in names})
    if fused_sample_width is not None:
        ws["src_len_ptr"] = i32
        refine = dict(CP=pow2(0), BUF=pow2(p.cap), TILE=refine_tile, FEW=p.few, **ptx, **waits)
        return [spec(_plan_kernel, f"sample,S={p.samples}",
                     dict(SAMPLES=p.samples, RUN=p.run, TILE=refine_tile, GROUP=p.group, FEW=p.few, **ptx, **waits),
                     warps(p.samples, topk_plan.PLAN_KEYS), src_stride=fused_sample_width),
                *(spec(_refine_kernel, f"fused,{name},BUF={pow2(p.cap)}", dict(refine, ROW_SELECT=mode.value),
                       warps(pow2(p.cap), topk_plan.REFINE_KEYS), n_chunks=0)
                  for name, mode in (("defer", ROW_SELECT_DEFER), ("marked", ROW_SELECT_MARKED)))]
    return [spec(_plan_kernel, f"scores,S={p.samples}",
                 dict(SAMPLES=p.samples, RUN=p.run, TILE=refine_tile, GROUP=p.group, FEW=p.few, **ptx,
                      **plan_dep, src_len_ptr=None),
                 warps(p.samples, topk_plan.PLAN_KEYS)),
            spec(_filter_kernel, f"scores,SLOTS={p.slots}", dict(TILE=p.tile, SLOTS=p.slots, **ptx, **waits),
                 topk_plan.FILTER_WARPS),
            spec(_refine_kernel, f"scores,CP={pow2(p.n_chunks)},BUF={pow2(p.cap)}",
                 dict(CP=pow2(p.n_chunks), BUF=pow2(p.cap), TILE=refine_tile,
                      FEW=p.few, **ptx, **waits),
                 warps(pow2(p.cap), topk_plan.REFINE_KEYS))]
