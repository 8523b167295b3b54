"""Triton lowering of `k31c::lightning_indexer_topk`: scan then select (registered), and the
single fused kernel (kept as `lightning_indexer_topk_fused`).

Registered for h200/mi350x: `lightning_indexer_topk` = indexer.py's scan writes the [N, L] fp32
scores to a workspace, topk.py's select reads them. Measured on the H200 (16 x 4 rows, FP8 keys,
k = 2048, 128K, CUDA-graph replay): 0.241 ms for this pair vs 0.638 ms for the fused kernel
(BENCHMARKS.md; 0.279 vs 0.626 with the earlier gather indexer), so the pair is the
lowering; the fused kernel stays built (AOT) and benchmarked (bench_topk.py) as the alternative.

The fused kernel: topk_select(lightning_indexer(...), row_len, k) without writing the [N, L] score
matrix: the select pipeline of topk.py runs on scores computed in-kernel from the index cache (FP8
e4m3 through the block table, or BF16/F32; scoring in topk_keys.py). The sample pass here scores
only the sampled positions, the filter pass here scores each tile in registers (all rows of a
request from one key load) and keeps only candidates; refine and the fallback passes are
topk.py's, and fallback rows (rare) are rescored on each of their passes.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from k31c.graph.ops.cache_write import is_fp8_index_cache
from k31c.graph.ops.indexer import check_indexer
from k31c.lowering.registry import register
from k31c.lowering.triton import indexer
from k31c.lowering.triton import topk   # tunables read as topk.X: one copy (the tests shrink it)
from k31c.lowering.triton.topk import (_MODE, _REFINE_TILE, _RS, _THRESH, _aot_spec, _append, _chunking,
                                       _fb_digit_kernel, _fb_emit_kernel, _finish, _plan_kernel, _pow2,
                                       _refine_kernel, _sample_pos, _workspace)
from k31c.lowering.triton.topk_keys import _load_q, _order_key, _row_keys, _score_tile

# ---- kernels ----------------------------------------------------------------------------------

@triton.jit
def _fused_sample_kernel(q_ptr, sq_t, sq_h, w_ptr, sw_t, cache_ptr, scale_ptr, bt_ptr, sbt, row_req_ptr,
                         H, D, row_len_ptr, sample_ptr, cap, SAMPLES: tl.constexpr, RUN: tl.constexpr,
                         BS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HP: tl.constexpr,
                         DP: tl.constexpr, FP8: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Order keys of the sampled positions of each long row (the plan pass reads them)."""
    row = tl.program_id(0)
    n = tl.load(row_len_ptr + row)
    if n > cap:
        i = tl.program_id(1) * BS + tl.arange(0, BS)
        pos = _sample_pos(i, n, SAMPLES, RUN)
        key = _row_keys(row, pos, pos < n, q_ptr, 0, q_ptr, sq_t, sq_h, w_ptr, sw_t, cache_ptr,
                        scale_ptr, bt_ptr, sbt, row_req_ptr, H, D, True, BLOCK_SIZE, HP, DP, FP8, DOT_DTYPE)
        tl.store(sample_ptr + row.to(tl.int64) * SAMPLES + i, key.to(tl.int32, bitcast=True))


@triton.jit
def _fused_filter_kernel(q_ptr, sq_t, sq_h, w_ptr, sw_t, cache_ptr, scale_ptr, bt_ptr, sbt, row_req_ptr,
                         H, D, row_len_ptr, state_ptr, ckey_ptr, cpos_ptr, ties_ptr, n_rows, cap, chunk,
                         G: tl.constexpr, BS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HP: tl.constexpr,
                         DP: tl.constexpr, FP8: tl.constexpr, DOT_DTYPE: tl.constexpr,
                         NUM_STAGES: tl.constexpr):
    """Score G consecutive rows over one chunk of positions, keeping the candidates. Rows of one
    request share each key load (one MMA with G*HP query columns); a group spanning several
    requests makes one pass per request."""
    r = tl.arange(0, G)
    rows = tl.program_id(0) * G + r
    valid = rows < n_rows
    reqs = tl.load(row_req_ptr + rows, mask=valid, other=-1)
    lens = tl.load(row_len_ptr + rows, mask=valid, other=0)
    st_rows = state_ptr + rows * _RS
    active = valid & (tl.load(st_rows + _MODE, mask=valid, other=1) == 0)
    thresh = tl.load(st_rows + _THRESH, mask=valid, other=0).to(tl.uint32, bitcast=True)
    lo = tl.program_id(1) * chunk
    ties = tl.zeros([G], tl.int32)
    for j in range(G):
        lead = tl.sum(tl.where(r == j, reqs, 0), 0)
        first = tl.sum(tl.where((r < j) & active & (reqs == lead), 1, 0), 0) == 0
        if first & (tl.sum(tl.where(r == j, active.to(tl.int32), 0), 0) > 0):
            mine = active & (reqs == lead)
            hi = tl.minimum(lo + chunk, tl.max(tl.where(mine, lens, 0), 0))
            q_t, w = _load_q(q_ptr, sq_t, sq_h, w_ptr, sw_t, rows, mine, H, D, G, HP, DP, DOT_DTYPE)
            for start in tl.range(lo, hi, BS, num_stages=NUM_STAGES):
                pos = start + tl.arange(0, BS)
                key = _order_key(_score_tile(q_t, w, cache_ptr, scale_ptr, bt_ptr, sbt, lead, pos, pos < hi,
                                             D, BLOCK_SIZE, G, HP, DP, FP8, DOT_DTYPE))
                live = mine[:, None] & (pos[None, :] < lens[:, None])
                ties += tl.sum((live & (key == thresh[:, None])).to(tl.int32), 1)
                _append(st_rows, ckey_ptr + rows.to(tl.int64) * cap, cpos_ptr + rows.to(tl.int64) * cap,
                        key, pos[None, :], live & (key > thresh[:, None]), cap)
    tl.store(ties_ptr + rows * tl.num_programs(1) + tl.program_id(1), ties, mask=active)


# ---- launcher ---------------------------------------------------------------------------------

def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _dot_dtype(q: torch.Tensor, cache: torch.Tensor, fp8: bool):
    """MMA input type, as the Triton indexer picks it: FP8 (q quantised like the keys) for an FP8
    cache on the GPU; a 16-bit dot where q and the keys are exact in it; fp32 otherwise and under
    the interpreter (its 16-bit and fp8 dots are not trusted)."""
    if _interpreting() or q.device.type != "cuda":
        return tl.float32
    if fp8:
        return tl.float8e4nv
    for torch_t, tl_t in ((torch.bfloat16, tl.bfloat16), (torch.float16, tl.float16)):
        if q.dtype == torch_t and cache.dtype == torch_t:
            return tl_t
    return tl.float32


_FUSED_TILE = 128      # positions per scoring tile


_OP = "k31c::lightning_indexer_topk"


@register(_OP, ("h200", "mi350x"))
def lightning_indexer_topk(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                           block_table: torch.Tensor, row_req: torch.Tensor, row_len: torch.Tensor,
                           k: int) -> torch.Tensor:
    """topk_select(lightning_indexer(...), row_len, k) as the two Triton launchers: the scores
    live in a workspace [N, L] fp32 between them (allocated per call from the caching allocator,
    so a CUDA graph capture keeps it in the graph's pool)."""
    if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    scores = indexer.lightning_indexer(q, weights, index_cache, block_table, row_req, row_len)
    return topk.topk_select(scores, row_len, k)


def lightning_indexer_topk_fused(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                                 block_table: torch.Tensor, row_req: torch.Tensor, row_len: torch.Tensor,
                                 k: int) -> torch.Tensor:
    """The single fused kernel: topk_select(lightning_indexer(...), row_len, k) without writing
    the scores out (not registered: slower than the pair on the H200; benchmarks call it by name)."""
    block_size = check_indexer(q, weights, index_cache, block_table, row_req, row_len)
    if not isinstance(k, int) or k <= 0:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    n_rows, heads, d = q.shape
    if d > 128:
        raise ValueError(f"q: index_head_dim {d} > 128 (one FP8 scale group) is not supported by the "
                         "fused kernel")
    if not index_cache.is_contiguous():
        raise ValueError("index_cache: the fused kernel needs a contiguous cache tensor")
    fp8 = is_fp8_index_cache(index_cache)
    if fp8 and (block_size * d) % 4:
        raise ValueError(f"index_cache: block_size*d = {block_size * d} is not a multiple of 4 "
                         "(unaligned fp32 scales)")
    width = block_table.shape[1] * block_size
    out = torch.empty((n_rows, k), dtype=torch.int32, device=q.device)
    if n_rows == 0:
        return out
    groups = min(4, 1 << (max(1, n_rows // block_table.shape[0]).bit_length() - 1))  # rows per request
    n_groups = triton.cdiv(n_rows, groups)
    chunk, n_chunks = _chunking(max(width, 1), n_groups, _FUSED_TILE, programs=2 * _sm_count(q.device))
    cap, ws = _workspace(n_rows, max(width, 1), k, n_chunks, q.device)
    if q.stride(2) != 1:
        q = q.contiguous()
    dot = _dot_dtype(q, index_cache, fp8)
    scale_view = index_cache.view(torch.float32) if fp8 else index_cache
    if dot == tl.float8e4nv:   # e4m3 loads feed the tensor cores directly (no byte bitcast)
        index_cache = index_cache.view(torch.float8_e4m3fn)
    hp1 = max(_pow2(heads), 16)
    dp = max(32 if dot == tl.float8e4nv else 16, _pow2(d))     # an fp8 MMA needs K >= 32 (zero-padded)
    shape = dict(BLOCK_SIZE=block_size, DP=dp, FP8=fp8, DOT_DTYPE=dot)
    src = (q, q.stride(0), q.stride(1), weights, weights.stride(0), index_cache, scale_view, block_table,
           block_table.stride(0), row_req, heads, d)
    if width > cap:
        _fused_sample_kernel[(n_rows, topk.SAMPLES // 64)](*src, row_len, ws["samples"], cap,
                                                           SAMPLES=topk.SAMPLES, RUN=topk.RUN, BS=64, HP=hp1,
                                                           **shape, num_warps=4)
    _plan_kernel[(n_rows,)](q, 0, row_len, out, out.stride(0), ws["state"], ws["fb"], ws["samples"],
                            ws["hist"], k, cap, topk.TARGET_NUM * k // topk.TARGET_DEN, PRESAMPLED=True,
                            SAMPLES=topk.SAMPLES, RUN=topk.RUN, TILE=_REFINE_TILE, num_warps=8)
    if width == 0:
        return out
    _fused_filter_kernel[(n_groups, n_chunks)](
        *src, row_len, ws["state"], ws["ckey"], ws["cpos"], ws["ties"], n_rows, cap, chunk, G=groups,
        BS=_FUSED_TILE, HP=max(_pow2(heads), 16 // groups), **shape, NUM_STAGES=3, num_warps=8)
    _finish((weights, 0, *src), row_len, out, ws, k, cap, chunk, n_chunks, False,
            dict(TILE=64, FUSED=True, HP=hp1, **shape, num_warps=4))
    return out


def aot_specs(shapes) -> list:
    """The launches for `k31c::lightning_indexer_topk` at `shapes` (lowering.aot.AotShapes), for
    the ahead-of-time build: the registered pair's (indexer.py's and topk.py's own specs, tagged
    with this op too) and the fused kernel's, so the alternative lowering keeps building."""
    pair = [s._replace(ops=tuple(dict.fromkeys((*s.ops, _OP))))
            for s in (*indexer.aot_specs(shapes), *topk.aot_specs(shapes))]
    return pair + _fused_aot_specs(shapes)


def _fused_aot_specs(shapes) -> list:
    """The fused kernel's launches: over FP8 (e4m3 view) and BF16 index caches; constexprs as
    lightning_indexer_topk_fused derives them."""
    cfg, width = shapes.cfg, shapes.context
    i32, f32 = torch.int32, torch.float32
    spec = _aot_spec
    specs = []
    op = _OP
    heads, d = cfg.index_n_heads, cfg.index_head_dim
    hp1 = max(_pow2(heads), 16)
    for fp8 in (True, False):
        cache_dt = torch.float8_e4m3fn if fp8 else torch.bfloat16
        dot = tl.float8e4nv if fp8 else tl.bfloat16
        dp = max(32 if dot == tl.float8e4nv else 16, _pow2(d))
        shape = dict(BLOCK_SIZE=shapes.block_size, DP=dp, FP8=fp8, DOT_DTYPE=dot)
        src = dict(q_ptr=cfg.torch_dtype, w_ptr=f32, cache_ptr=cache_dt,
                   scale_ptr=f32 if fp8 else cache_dt, bt_ptr=i32, row_req_ptr=i32)
        tag = "fp8" if fp8 else "bf16"
        specs.append(spec(_fused_sample_kernel, op, tag,
                          dict(SAMPLES=topk.SAMPLES, RUN=topk.RUN, BS=64, HP=hp1, **shape), src, num_warps=4))
        specs.append(spec(_plan_kernel, op, "presampled",
                          dict(PRESAMPLED=True, SAMPLES=topk.SAMPLES, RUN=topk.RUN, TILE=_REFINE_TILE),
                          dict(src_ptr=cfg.torch_dtype), num_warps=8))
        for r in shapes.rows_per_request:
            n_rows = shapes.batch * r
            groups = min(4, 1 << (max(1, n_rows // shapes.batch).bit_length() - 1))
            chunk, n_chunks = _chunking(width, triton.cdiv(n_rows, groups), _FUSED_TILE,
                                        programs=2 * shapes.sms)
            specs.append(spec(_fused_filter_kernel, op, f"{tag},G={groups}",
                              dict(G=groups, BS=_FUSED_TILE, HP=max(_pow2(heads), 16 // groups),
                                   **shape, NUM_STAGES=3), src, num_warps=8))
            specs.append(spec(_refine_kernel, op, f"fused,CP={_pow2(n_chunks)}",
                              dict(SCAN_TIES=False, CP=_pow2(n_chunks), TILE=_REFINE_TILE,
                                   STILE=_REFINE_TILE), dict(src_ptr=f32), num_warps=8))
        fb = dict(TILE=64, FUSED=True, HP=hp1, **shape)
        fb_src = dict(src_ptr=f32, **src)
        for level in range(4):
            specs.append(spec(_fb_digit_kernel, op, f"{tag},LEVEL={level}",
                              dict(LEVEL=level, NP=topk.FB_PROGRAMS, **fb), fb_src, num_warps=4))
        specs.append(spec(_fb_emit_kernel, op, tag, dict(NP=topk.FB_PROGRAMS, **fb), fb_src, num_warps=4))
    return specs
