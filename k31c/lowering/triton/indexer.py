"""Triton lightning indexer: scores[t, s] = Σ_h w[t, h] · ReLU(q[t, h] · k[s]) (spec/model.md §6.1).

Keys come from the paged index cache through the block table: the FP8 layout of spec §6.5 (uint8
cache, e4m3 values + one fp32 scale per token) or plain float keys. Positions at or past a row's
`row_len` (and the rest of the [N, max_blocks * block_size] output) are -inf, written here.

Work split:
- a program owns a tile of ROWS consecutive rows (ROWS = rows per request when N = B·R, so a
  decode/verify tile is exactly one request) and one of `splits` slices of the key range;
- the tile's rows of one request score every key of that request from ONE load of the key: one
  tl.dot [keys, d] x [d, ROWS·heads], then ReLU, head weights and the sum over heads;
- a tile that spans two requests (prefill, uneven R) makes one pass per request;
- each pass divides [0, longest visible length of its rows) evenly over the `splits` programs of
  the tile, so the work follows each request's real length; splits ≈ 4·SMs / tiles (the TMA
  kernel: 3·SMs / tiles), so a batch of one request still fills the GPU. Lengths, requests and blocks are read
  on the device; the grid depends only on static shapes (CUDA-graph safe).

The registered launcher runs the target's default variant (`Target.variant`): on h200
"warp_specialized", indexer_ws.py (Gluon: a TMA producer warp and three math warp groups, each
taking every third block) for an FP8 cache read by 4 rows a request at K3.1 Pro's widths, "tma"
for the calls it declines (`indexer_ws.why_not` names the reason); "tma" on mi350x: indexer_tma.py,
one cache block a step through a TMA tensor descriptor, q quantised by the hardware conversion
with a true division (q_rcp=False). Where the cache layout does not fit
a descriptor (`indexer_tma.tma_supported`: a head dim that is not a power of two, blocks above 256
keys, an FP8 cache with d < 32 on the GPU, an unaligned cache) it runs this module's gather kernel,
which `variant="gather"` also selects. The TMA kernel was measured the faster (BENCHMARKS.md,
indexer). `indexer_plan.plan` derives the launch configuration of each kernel; the launcher and
`aot_specs` both read it.

An MXFP8 cache (float8_e4m3fn, e4m3 keys with E8M0 group-32 scales) runs the TMA kernel's MX
form by default (`MX_VARIANT`, MX_CACHE): q quantised and dequantised on chip, each block's keys
scaled by their group exponents into bf16 (exact) and one 16-bit dot per block, with a
168-register cap at 4 warps (3 programs an SM). Measured on the H200 (BENCHMARKS.md, FP8 latent
rows and the MXFP8 indexer) 5-6x faster than indexer_mxfp8.py's gather kernel (q quantised the
same way, four partial FP8 dots per 128-wide key), which stays for the layouts a descriptor
cannot read and for `variant="gather"`.

Precision: on the GPU an FP8 cache is scored with FP8 tensor cores: q is quantised per
(row, head) like the keys (e4m3, scale max(amax, 1e-4)/448) and its scale folded into w, as
DeepGEMM's fp8_mqa_logits does; the scores then differ from the reference (which keeps q in full
precision) by q's quantisation error (~1e-2 relative). A BF16/FP16 cache uses a 16-bit dot (q cast
to the cache dtype); fp32 keys and the Triton interpreter (CPU) use an exact fp32 dot.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k31c.graph.ops.indexer import check_indexer
from k31c.lowering.aot_spec import kernel_spec
from k31c.lowering.registry import register
from k31c.lowering.targets import GPU_TARGETS
from k31c.graph.ops.fp8_layouts import is_mxfp8_index_cache
from k31c.lowering.triton import indexer_mxfp8, indexer_tma, indexer_ws
from k31c.lowering.triton.device import pdl_launch, target_of, wait_for_producers
from k31c.lowering.triton.indexer_plan import MX_VARIANT, OP, check_variant, mx_plan, plan
from k31c.lowering.triton.indexer_tile import (fill_tail, head_weights, key_slots, query_tile,
                                               rows_of_tile, run_rows, run_start, score_keys)
from k31c.lowering.triton.unit_stride import require_unit_stride


@triton.jit
def _indexer_kernel(q_ptr, q_row_stride, q_head_stride, q_col_stride, w_ptr, w_row_stride, w_head_stride,
                    cache_ptr, cache_f32_ptr, block_stride, table_ptr, table_stride,
                    row_req_ptr, row_len_ptr, out_ptr, n_rows, n_req, capacity, n_splits,
                    ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, H: tl.constexpr, H_PAD: tl.constexpr,
                    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    KEYS: tl.constexpr, TAIL: tl.constexpr, FP8_CACHE: tl.constexpr,
                    QUANT_Q: tl.constexpr, DOT_DTYPE: tl.constexpr, HEAD_DOT: tl.constexpr,
                    HEAD_DTYPE: tl.constexpr, OUT: tl.constexpr, NUM_STAGES: tl.constexpr,
                    HW_CVT: tl.constexpr, PDL: tl.constexpr = False):
    """HW_CVT: quantise q with the hardware e4m3 conversion (GPU only) rather than the bit-exact
    fp32 emulation (same values: both round x / scale to nearest-even).
    HEAD_DOT: the weighted head sum as a second tl.dot, ReLU(logits) [KEYS, M] (HEAD_DTYPE) x
    W [M, OUT] with W[m, r] = w[m] where m is a head of tile row r (OUT >= 16 columns, rows past
    ROWS unused); else ReLU, x w and a sum over a [KEYS, ROWS_PAD, H_PAD] view (OUT = ROWS_PAD)."""
    wait_for_producers(PDL)
    tile = tl.program_id(0)
    split = tl.program_id(1)
    first_row = tile * ROWS

    # The tile's queries, one tl.dot operand row per (row, head), loaded (and quantised) once.
    cols = tl.arange(0, D_PAD)
    col_ok = cols < D
    q_t, w = query_tile(q_ptr, q_row_stride, q_head_stride, q_col_stride, w_ptr, w_row_stride,
                        w_head_stride, first_row, n_rows, col_ok, ROWS, ROWS_PAD, H, H_PAD, D_PAD,
                        QUANT_Q, HW_CVT, False, DOT_DTYPE)
    w_mat = w
    if HEAD_DOT:
        w_mat = head_weights(w, ROWS_PAD, H_PAD, OUT, HEAD_DTYPE)

    row_ok, req_of_row, len_of_row, out_row = rows_of_tile(row_req_ptr, row_len_ptr, out_ptr,
                                                           first_row, n_rows, capacity, ROWS, OUT)
    minus_inf = tl.full((OUT, TAIL), float("-inf"), tl.float32)

    for j in range(ROWS):
        row = first_row + j
        if row < n_rows:
            req, starts_run = run_start(row_req_ptr, row, j)
            if starts_run:
                sel, lens, length, table_row = run_rows(req, row_ok, req_of_row, len_of_row, n_req,
                                                        table_ptr, table_stride)
                n_steps = tl.cdiv(length, KEYS)
                for step in tl.range(split * n_steps // n_splits, (split + 1) * n_steps // n_splits,
                                     num_stages=NUM_STAGES):
                    pos, key_ok, block, offset, key_at = key_slots(table_row, step, length,
                                                                   block_stride, KEYS, BLOCK_SIZE, D)
                    k = tl.load(cache_ptr + key_at[:, None] + cols[None, :],
                                mask=key_ok[:, None] & (col_ok[None, :] | (D == D_PAD)), other=0.0)
                    if FP8_CACHE:
                        if cache_ptr.dtype.element_ty == tl.uint8:   # interpreter: bytes, reinterpreted
                            k = k.to(tl.float8e4nv, bitcast=True)
                        k_scale = tl.load(cache_f32_ptr + (block * block_stride + BLOCK_SIZE * D) // 4 + offset,
                                          mask=key_ok, other=0.0)
                    else:
                        k_scale = offset                                 # unused without FP8
                    score_keys(k, q_t, w, w_mat, k_scale, pos, lens, out_row, sel, capacity, KEYS,
                               ROWS_PAD, H_PAD, FP8_CACHE, DOT_DTYPE, HEAD_DOT, HEAD_DTYPE)
                fill_tail(out_row, sel, capacity, n_steps * KEYS, split, n_splits, minus_inf, TAIL)


def launch_indexer(q, weights, index_cache, block_table, row_req, row_len, *, keys_per_step=None,
                   splits=None, quant_q=None, exact_dot=False, head_dot=False, num_warps=None,
                   num_stages=5, variant=None, hw_quant=False,
                   programs_per_sm=None, q_rcp=False, maxnreg=None) -> torch.Tensor:
    """The lightning_indexer launcher with its tuning knobs exposed (benchmarks and tests).

    quant_q: quantise q to e4m3 (default: FP8 cache on the GPU); exact_dot: force the fp32 dot
    (separates the FP8 tensor cores' accumulation error from the quantisation in tests);
    head_dot: sum the heads with a second (bf16 on the GPU) tl.dot instead of on the ALUs.
    variant: "gather" (this module's kernel, KEYS keys a step through pointer loads), "tma"
    (indexer_tma: one cache block a step through a tensor descriptor; falls back to "gather" where
    the layout does not allow it; keys_per_step is then the block size) or "warp_specialized"
    (indexer_ws, which refuses a call it cannot run; as the target's default it hands such calls
    to "tma"). None: the target's default (`Target.variant`). hw_quant: the gather kernel
    quantises q with the hardware conversion (the tma kernel always does on the GPU). programs_per_sm: the grid target when
    splits is None. q_rcp, maxnreg: tma only (see indexer_tma.launch_indexer_tma)."""
    if variant is not None:
        check_variant(variant)
    block_size = check_indexer(q, weights, index_cache, block_table, row_req, row_len)
    require_unit_stride(block_table=block_table, row_req=row_req, row_len=row_len)
    if splits is not None and (not isinstance(splits, int) or splits < 1):
        raise ValueError(f"splits: expected a positive integer or None, got {splits!r}")
    if not index_cache.is_contiguous():
        raise ValueError("index_cache: the Triton indexer needs a contiguous cache tensor")
    n, heads, d = q.shape
    if d > 128:
        raise ValueError(f"q: index_head_dim {d} > 128 (one FP8 scale group) is not supported by the "
                         "Triton indexer")
    fp8 = index_cache.dtype == torch.uint8
    if fp8 and (block_size * d) % 4:
        raise ValueError(f"index_cache: block_size*d = {block_size * d} is not a multiple of 4 "
                         "(unaligned fp32 scales)")
    capacity = block_table.shape[1] * block_size
    scores = torch.empty((n, capacity), dtype=torch.float32, device=q.device)
    if n == 0 or capacity == 0:
        return scores
    # the warp-specialized kernel's checks only where it may run (the target's default or named)
    not_ws = (indexer_ws.why_not(q, weights, index_cache, block_table, block_size)
              if variant in (None, "warp_specialized") else f"variant {variant!r} named")
    if variant == "warp_specialized" and not_ws:       # asked for by name: no quiet substitute
        raise ValueError(f"variant 'warp_specialized' cannot run this call: {not_ws}")
    if is_mxfp8_index_cache(index_cache):
        indexer_mxfp8.check_mx_width(d)
        p = mx_plan(target_of(q.device), n, heads, d, block_table.shape[0], capacity, block_size,
                    tma_ok=indexer_tma.tma_supported(index_cache, d, block_size), variant=variant,
                    keys_per_step=keys_per_step, splits=splits, exact_dot=exact_dot,
                    head_dot=head_dot, num_warps=num_warps, num_stages=num_stages,
                    programs_per_sm=programs_per_sm)
        if p.variant == "tma":
            return indexer_tma.launch_indexer_tma(
                q, weights, index_cache, block_table, row_req, row_len, scores,
                block_size=block_size, rows=p.rows, rows_pad=p.rows_pad, splits=p.splits,
                quant_q=False, dot_dtype=p.dot_dtype, head_dot=p.head_dot, num_warps=p.num_warps,
                num_stages=p.num_stages, maxnreg=maxnreg)
        return indexer_mxfp8.launch_indexer_mx(
            q, weights, index_cache, block_table, row_req, row_len, scores, block_size=block_size,
            rows=p.rows, rows_pad=p.rows_pad, keys=p.keys, splits=p.splits, num_warps=p.num_warps,
            num_stages=p.num_stages, exact_dot=exact_dot)
    p = plan(target_of(q.device), n, heads, d, block_table.shape[0], capacity, block_size,
             index_cache.dtype, tma_ok=indexer_tma.tma_supported(index_cache, d, block_size),
             ws_ok=not_ws is None,
             keys_per_step=keys_per_step, splits=splits, quant_q=quant_q, exact_dot=exact_dot,
             head_dot=head_dot, num_warps=num_warps, num_stages=num_stages, variant=variant,
             hw_quant=hw_quant, programs_per_sm=programs_per_sm)
    if p.variant == "warp_specialized":
        return indexer_ws.launch(q, weights, index_cache, block_table, row_req, row_len, scores,
                                 p.splits)
    if p.variant == "tma":
        return indexer_tma.launch_indexer_tma(
            q, weights, index_cache, block_table, row_req, row_len, scores, block_size=block_size,
            rows=p.rows, rows_pad=p.rows_pad, splits=p.splits, quant_q=p.quant_q,
            dot_dtype=p.dot_dtype, head_dot=p.head_dot, num_warps=p.num_warps,
            num_stages=p.num_stages, q_rcp=q_rcp, maxnreg=maxnreg)
    cache_f32 = index_cache.view(torch.float32) if fp8 else index_cache
    if fp8 and p.on_gpu:   # e4m3 loads straight into shared memory feed the tensor cores (no bitcast)
        index_cache = index_cache.view(torch.float8_e4m3fn)
    _indexer_kernel[(triton.cdiv(n, p.rows), p.splits)](
        q, q.stride(0), q.stride(1), q.stride(2), weights, weights.stride(0), weights.stride(1),
        index_cache, cache_f32, index_cache.stride(0), block_table, block_table.stride(0),
        row_req, row_len, scores, n, block_table.shape[0], capacity, p.splits,
        **p.gather_constexprs(block_size), num_warps=p.num_warps, **pdl_launch(q.device))
    return scores


@register(OP, GPU_TARGETS)
def lightning_indexer(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                      block_table: torch.Tensor, row_req: torch.Tensor,
                      row_len: torch.Tensor) -> torch.Tensor:
    return launch_indexer(q, weights, index_cache, block_table, row_req, row_len)


def aot_specs(shapes) -> list:
    """The launches of `lightning_indexer` on the GPU at `shapes` (aot_spec.AotShapes), for the
    ahead-of-time build: FP8 (uint8, viewed as e4m3) and BF16 index caches, decode batches of
    R rows per request; constexprs from `plan` with the launcher's defaults: the tma kernel
    where the target's default variant is tma, else the gather kernel."""
    from k31c.lowering.triton.mla_common import table_width
    cfg = shapes.cfg
    heads, d, bs = cfg.index_n_heads, cfg.index_head_dim, shapes.block_size

    def ints(n: int, p, block_stride: int) -> dict:
        return _launch_ints(shapes, n, p, block_stride, heads, d, table_width(shapes))
    specs = []
    for fp8 in (True, False):
        cache_dt = torch.float8_e4m3fn if fp8 else torch.bfloat16   # FP8: the e4m3 view on the GPU
        ptrs = dict(q_ptr=cfg.torch_dtype, w_ptr=torch.float32,
                    cache_f32_ptr=torch.float32 if fp8 else cache_dt, table_ptr=torch.int32,
                    row_req_ptr=torch.int32, row_len_ptr=torch.int32, out_ptr=torch.float32)
        tag = "fp8" if fp8 else "bf16"
        for r in shapes.rows_per_request:
            n = shapes.batch * r
            ws = indexer_ws.aot_spec(shapes, OP) if fp8 and r == indexer_ws.ROWS else None
            p = plan(shapes.target, n, heads, d, shapes.batch, shapes.context, bs,
                     torch.uint8 if fp8 else torch.bfloat16, ws_ok=ws is not None)
            at = ints(n, p, bs * (d + 4 if fp8 else d))
            if p.variant == "warp_specialized":
                specs.append(ws)
            elif p.variant == "tma":   # as indexer_tma.launch_indexer_tma (q_rcp off: no register cap)
                specs.append(indexer_tma.aot_spec(p, bs, ptrs, f"{tag},R={r}", OP, at))
            else:
                specs.append(kernel_spec(_indexer_kernel, OP, f"{tag},R={r}", p.gather_constexprs(bs),
                                         dict(ptrs, cache_ptr=cache_dt), num_warps=p.num_warps, ints=at))
    specs += mx_aot_specs(shapes, MX_VARIANT)
    return specs


def mx_aot_specs(shapes, variant: str) -> list:
    """The MXFP8 cache's launches at `shapes` with `variant` ("gather": indexer_mxfp8's kernel,
    "tma": the TMA kernel's MX_CACHE form), one per rows-per-request count."""
    from k31c.graph.ops.fp8_layouts import mx_row_bytes
    from k31c.lowering.triton.mla_common import table_width
    cfg = shapes.cfg
    heads, d, bs = cfg.index_n_heads, cfg.index_head_dim, shapes.block_size
    ptrs = dict(q_ptr=cfg.torch_dtype, w_ptr=torch.float32, table_ptr=torch.int32,
                row_req_ptr=torch.int32, row_len_ptr=torch.int32, out_ptr=torch.float32)
    specs = []
    for r in shapes.rows_per_request:
        n = shapes.batch * r
        p = mx_plan(shapes.target, n, heads, d, shapes.batch, shapes.context, bs, variant=variant)
        at = _launch_ints(shapes, n, p, bs * mx_row_bytes(d), heads, d, table_width(shapes))
        if p.variant == "tma":
            specs.append(indexer_tma.aot_spec(p, bs, dict(ptrs, cache_f32_ptr=torch.float8_e4m3fn),
                                              f"mxfp8,R={r}", OP, at, mx=True))
        else:
            specs.append(indexer_mxfp8.aot_spec(p, bs, ptrs, f"mxfp8,R={r}", OP, at))
    return specs


def _launch_ints(shapes, n: int, p, block_stride: int, heads: int, d: int, table_stride: int) -> dict:
    """The launch's integers: q [n, heads, d] and weights [n, heads] contiguous, the cache
    [blocks, block_stride], the block table [batch, table width], scores [n, context]."""
    return dict(q_row_stride=heads * d, q_head_stride=d, q_col_stride=1, w_row_stride=heads,
                w_head_stride=1, block_stride=block_stride, table_stride=table_stride,
                n_rows=n, n_req=shapes.batch, capacity=shapes.context, n_splits=p.splits)
