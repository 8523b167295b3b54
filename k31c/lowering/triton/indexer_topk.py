"""Triton lowering of `k31c::lightning_indexer_topk`: the indexer's scan, then the top-k select.

indexer.py's scan writes the [N, L] fp32 scores to a workspace, topk.py's select reads them (a
select inside the scoring kernel is slower: BENCHMARKS.md, top-k).

The fused select (`fused_indexer_topk`, taken for rows of `FUSED_FROM` keys or more where
`fused_why_not` finds nothing) keeps the scores out of memory instead: on an H100 the
warp-specialized scan takes 105 / 726 us at 128K / 1M without its score stores against 119 / 837
with them. Seven launches:
  1. the scan over a sample of whole blocks (one in `topk_plan.sample_stride`), into [N, S],
     after a small launch that lays out the sample's block table and row lengths;
  2. the plan: each row's threshold from that sample (`topk._plan_kernel` with src_len_ptr);
  3. the scan with the filter (`indexer_ws_filter.launch_filter`): keys above the threshold go
     straight to the rows' candidate buffers, no scores written;
  4. the refine over the buffers (no tie counts); a row with fewer than k candidates or more
     than the buffer holds is marked for the whole-row select, not selected;
  5. the scan again, for the tiles with a marked row only (`indexer_ws.launch`'s gate): their
     full scores; in the common case every program finds no marked row and returns;
  6. the whole-row select of the marked rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k31c.graph.ops.indexer import check_indexer
from k31c.lowering.aot_spec import kernel_spec
from k31c.lowering.registry import register
from k31c.lowering.targets import GPU_TARGETS
from k31c.lowering.triton import indexer, indexer_ws, indexer_ws_filter, topk, topk_plan
from k31c.lowering.triton.device import (PDL_ON, inline_ptx, let_dependent_start, pair_launch, pdl_launch,
                                         sm_count, target_of, wait_for_producers)

_OP = "k31c::lightning_indexer_topk"
# the fused select for block tables of this many keys a row or more (a static shape: one choice
# per captured graph; None: never). From 256K it is as fast as the pair or faster on the H100 and
# the H200 (at 1M 7% faster on the H200); at 128K the pair is faster on the H200 (BENCHMARKS.md,
# the fused select)
FUSED_FROM: int | None = 256 << 10
BLOCK = indexer_ws.BLOCK      # keys a cache block (the scans' block)
LAYOUT_TILE = 1024            # table entries (and rows) a sample-layout program


@register(_OP, GPU_TARGETS)
def lightning_indexer_topk(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                           block_table: torch.Tensor, row_req: torch.Tensor, row_len: torch.Tensor,
                           k: int) -> torch.Tensor:
    """topk_select(lightning_indexer(...), row_len, k) as the two Triton launchers: the scores
    live in a workspace [N, L] fp32 between them (allocated per call from the caching allocator,
    so a CUDA graph capture keeps it in the graph's pool). From `FUSED_FROM` keys a row, the
    fused select where `fused_why_not` allows it."""
    if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    args = (q, weights, index_cache, block_table, row_req, row_len)
    if fused_taken(*args, k):
        return fused_indexer_topk(*args, k)
    scores = indexer.lightning_indexer(*args)
    return topk.topk_select(scores, row_len, k)


def fused_taken(q, weights, index_cache, block_table, row_req, row_len, k) -> bool:
    """Whether `lightning_indexer_topk` runs the fused select for these arguments: block tables
    of `FUSED_FROM` keys a row or more, where `fused_why_not` finds nothing."""
    if FUSED_FROM is None:
        return False
    block_size = check_indexer(q, weights, index_cache, block_table, row_req, row_len)
    return (block_table.shape[1] * block_size >= FUSED_FROM
            and fused_why_not(q, weights, index_cache, block_table, row_req, row_len, k, block_size) is None)


def fused_why_not(q, weights, index_cache, block_table, row_req, row_len, k,
                  block_size: int | None = None) -> str | None:
    """Why the fused select cannot take this call (None: it can): it runs on the warp-specialized
    scan alone, where the target picks that scan. block_size: what `check_indexer` already gave
    for these arguments (None: check them here)."""
    if block_size is None:
        block_size = check_indexer(q, weights, index_cache, block_table, row_req, row_len)
    if target_of(q.device).variant(indexer.OP, "gather") != "warp_specialized":
        return "the target's indexer is not the warp-specialized scan"
    reason = indexer_ws.why_not(q, weights, index_cache, block_table, block_size)
    if reason is not None:
        return reason
    for name, t in (("block_table", block_table), ("row_req", row_req), ("row_len", row_len)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            return f"{name}: not a contiguous int32 tensor"
    if block_table.shape[1] == 0 or q.shape[0] == 0:
        return "no keys or no rows"
    return None


@triton.jit
def _sample_layout_kernel(table_ptr, table_stride, row_len_ptr, sample_table_ptr, sample_len_ptr, n_rows,
                          n_entries, width, stride, BLOCK: tl.constexpr, TILE: tl.constexpr,
                          PDL: tl.constexpr = False, DEPENDENT: tl.constexpr = False):
    """The sample scan's block table, [requests, width] (each request's blocks 0, stride,
    2 stride, ...), and its row lengths: a row's sampled blocks are the whole ones of those."""
    wait_for_producers(PDL)
    let_dependent_start(PDL, DEPENDENT)
    i = tl.program_id(0) * TILE + tl.arange(0, TILE)
    m = i < n_entries
    blk = tl.load(table_ptr + (i // width).to(tl.int64) * table_stride + (i % width) * stride, mask=m)
    tl.store(sample_table_ptr + i, blk, mask=m)
    n = tl.load(row_len_ptr + i, mask=i < n_rows, other=0)
    tl.store(sample_len_ptr + i, (n // BLOCK + stride - 1) // stride * BLOCK, mask=i < n_rows)


def sample_layout(block_table: torch.Tensor, row_len: torch.Tensor, block: int, stride: int,
                  dependent: bool = False):
    """(the sample scan's block table, its row lengths) in one launch (a PDL dependent where the
    target's `pdl` says; dependent: it lets the next launch, a PDL dependent, start at once)."""
    width = -(-block_table.shape[1] // stride)
    table = torch.empty((block_table.shape[0], width), dtype=block_table.dtype, device=block_table.device)
    lens = torch.empty_like(row_len)
    n_entries = table.numel()
    _sample_layout_kernel[(triton.cdiv(max(n_entries, row_len.shape[0]), LAYOUT_TILE),)](
        block_table, block_table.stride(0), row_len, table, lens, row_len.shape[0], n_entries, width,
        stride, BLOCK=block, TILE=LAYOUT_TILE, **pdl_launch(block_table.device),
        **({"DEPENDENT": True} if dependent else {}))
    return table, lens


class GluonScans:
    """The fused select's scans on sm_90a: indexer_ws's (sampled and gated) and the filter's."""
    launch = staticmethod(indexer_ws.launch)
    launch_filter = staticmethod(indexer_ws_filter.launch_filter)


# the gated scan's gate words: the top-k state's mode word of each row, for the whole-row select
WHOLE_ROW_GATE = (topk_plan.ROW_STATE, topk_plan.ST_MODE.value, topk_plan.MODE_WHOLE_ROW.value)


def whole_row_gate(ws: dict) -> tuple:
    """The gated scan's gate (`indexer_ws.launch`): the rows whose top-k state marks them for the
    whole-row select (the state words themselves, 16-byte aligned as the ahead-of-time build
    assumes)."""
    return (ws["state"], *WHOLE_ROW_GATE)


def fused_indexer_topk(q, weights, index_cache, block_table, row_req, row_len, k: int,
                       scan=GluonScans) -> torch.Tensor:
    """The fused select (module docstring); callers check `fused_why_not` first. Graph-safe: no
    host sync, shapes from the arguments only. `scan`: what runs the three scans (`launch`,
    `launch_filter`): `GluonScans` on the GPU; tests pass the same contract in torch."""
    n, block = q.shape[0], check_indexer(q, weights, index_cache, block_table, row_req, row_len)
    capacity = block_table.shape[1] * block
    dev = q.device
    out = torch.empty((n, k), dtype=torch.int32, device=dev)
    p = topk_plan.plan(n, capacity, k, sm_count(dev))
    ws = p.workspace(dev, filter_slots=False)      # the filter scan has its own slots
    stride = topk_plan.sample_stride(capacity, block)
    # its own launches chained by PDL whatever the target's `pdl` (as topk_select's): each after
    # the first waits for the one before, so each reads only what those before it wrote
    pdl = pair_launch(dev)
    sample_table, sample_len = sample_layout(block_table, row_len, block, stride, dependent=pdl)
    sample = torch.empty((n, sample_table.shape[1] * block), dtype=torch.float32, device=dev)
    flags = {**({"PTX": True} if inline_ptx(dev) else {}), **(PDL_ON if pdl else {})}
    scan.launch(q, weights, index_cache, sample_table, row_req, sample_len, sample, pdl=pdl)
    topk.launch_plan(sample, row_len, out, p, ws, src_len_ptr=sample_len, **flags)
    scan.launch_filter(q, weights, index_cache, block_table, row_req, row_len, capacity, ws["state"],
                       ws["ckey"], ws["cpos"], p.cap, pdl=pdl)
    scores = torch.empty((n, capacity), dtype=torch.float32, device=dev)   # marked rows' only
    topk.launch_refine(scores, row_len, out, p, ws, n_chunks=0, ROW_SELECT=topk.ROW_SELECT_DEFER, **flags)
    scan.launch(q, weights, index_cache, block_table, row_req, row_len, scores, gate=whole_row_gate(ws),
                pdl=pdl)
    topk.launch_refine(scores, row_len, out, p, ws, n_chunks=0, ROW_SELECT=topk.ROW_SELECT_MARKED, **flags)
    if topk.DEBUG_PATHS:
        topk.last_paths[:] = topk_plan.row_paths(ws, row_len, k, p.cap)
    return out


def aot_specs(shapes) -> list:
    """The launches for `k31c::lightning_indexer_topk` at `shapes` (aot_spec.AotShapes): the
    indexer's and the top-k's own, tagged with this op too; from `FUSED_FROM` keys a row, the
    fused select's too where it can run (`fused_aot_specs`)."""
    return [s._replace(ops=tuple(dict.fromkeys((*s.ops, _OP))))
            for s in (*indexer.aot_specs(shapes), *topk.aot_specs(shapes))] + (
        fused_aot_specs(shapes) if FUSED_FROM is not None and shapes.context >= FUSED_FROM else [])


def fused_aot_specs(shapes) -> list:
    """The fused select's launches at `shapes` where its scans take them (h200's decode at 4 rows
    a request), else none: the sample layout, the sample scan, the plan, the filter scan, the
    refine, the gated scan and the marked rows' select."""
    if shapes.target.variant(indexer.OP, "gather") != "warp_specialized":
        return []                     # as fused_why_not: the target's scan is another
    stride = topk_plan.sample_stride(shapes.context, BLOCK)
    pdl = shapes.target.pdl_capable       # as pair_launch at launch: each launch the next's dependent
    sample_scan = indexer_ws.aot_spec(shapes, _OP, sample_stride=stride, pdl=pdl)
    if sample_scan is None:
        return []
    from k31c.lowering.triton.mla_common import table_width
    n, width = shapes.batch * indexer_ws.ROWS, table_width(shapes)
    sample_width = -(-width // stride)
    p = topk_plan.plan(n, shapes.context, shapes.cfg.index_topk, shapes.target.sm_count)
    i32 = torch.int32
    layout = kernel_spec(_sample_layout_kernel, _OP, f"sample/{stride}",
                         dict(BLOCK=BLOCK, TILE=LAYOUT_TILE, PDL=False, DEPENDENT=pdl),
                         dict(table_ptr=i32, row_len_ptr=i32, sample_table_ptr=i32, sample_len_ptr=i32),
                         ints=dict(table_stride=width, n_rows=n, n_entries=shapes.batch * sample_width,
                                   width=sample_width, stride=stride))
    return [layout, sample_scan, *topk.aot_specs(shapes, sample_width * BLOCK, op=_OP),
            indexer_ws_filter.aot_spec(shapes, _OP, p.cap, pdl=pdl),
            indexer_ws.aot_spec(shapes, _OP, gate=WHOLE_ROW_GATE, pdl=pdl)]
