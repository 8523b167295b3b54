"""Lightning indexer scan, TMA variant: one cache block per step, loaded by a tensor descriptor.

Same op and work split as `indexer.py` (a program owns a tile of ROWS rows — one request in the
decode layout — and one of `splits` slices of each request's key range), but the inner step is
one paged-cache block (BLOCK_SIZE keys, 64 on K3.1 Pro) instead of a gather of KEYS keys:

- the block's keys are one TMA box: the cache is viewed as a [num_blocks · block_stride / D, D]
  matrix (an FP8 block of 64 · 132 B is 66 rows of 128 B: 64 key rows, then 2 rows of scales),
  so block b's keys are rows [b · ROWS_PER_BLOCK, + BLOCK_SIZE). The copy engine computes the
  addresses and zero-fills a -1 (unused) block, where the gather spent ~150 integer instructions
  per 128 keys on 64-bit addresses, block lookups and masks;
- one m64 wgmma per step (keys as M, ROWS·heads = 128 query rows as N): a [64, 128] fp32
  accumulator is 64 registers a thread with 4 warps (the 128-key gather step holds 128);
- q is quantised to e4m3 with the hardware conversion (HW_CVT, `e4m3_hw`) instead of the
  bit-exact fp32 emulation the interpreter needs: both round x / scale to nearest-even, so the
  values agree; the emulation and a division per element made the gather kernel's prologue
  ~6000 SASS instructions a thread (this one: ~2600), paid by every program.

MXFP8 cache (MX_CACHE; `indexer.mx_plan`, that cache's default, measured faster): the same
boxes of e4m3 values, then each key's 4 group-exponent bytes read by pointer, the keys scaled by
them into bf16 (exact: 3 mantissa bits times a power of two) and q quantised and dequantised the
same way in the prologue (indexer_mxfp8.mx_query_tile), so one 16-bit dot per block sums the
products that the MX kernel's four partial FP8 dots sum, in another order; no per-key scale in
the epilogue.

Epilogue as in the gather kernel: ReLU, × w (q's scale folded in), sum over heads (or a second
tl.dot, HEAD_DOT), × the key's fp32 scale (after the head sum: ReLU(s·x) = s·ReLU(x), s > 0),
-inf past each row's length.

Needs: D a power of two with D · elem_bytes a multiple of 16, BLOCK_SIZE a power of two <= 256,
block_stride a multiple of D (the launcher falls back to the gather kernel otherwise). Without
q_rcp the launcher sets no register cap (sm_90a then gives 255 registers at R=4: 2 programs per
SM). Compiles for sm_90a and gfx950 (gfx950 has no TMA unit: its descriptor loads become masked
pointer loads). The estimate behind the design and the measured sweeps are in BENCHMARKS.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k31c.lowering.aot_spec import descriptor_type, kernel_spec
from k31c.graph.ops.fp8_layouts import is_mxfp8_index_cache
from k31c.lowering.triton.indexer_mxfp8 import mx_dequant_keys, mx_query_tile
from k31c.lowering.triton.indexer_tile import (fill_tail, head_weights, query_tile, rows_of_tile,
                                               run_rows, run_start, score_keys)
from k31c.lowering.triton.device import pdl_launch, register_cap, wait_for_producers


@triton.jit
def _indexer_tma_kernel(q_ptr, q_row_stride, q_head_stride, q_col_stride, w_ptr, w_row_stride, w_head_stride,
                        k_desc, cache_f32_ptr, cache_u8_ptr, block_stride, table_ptr, table_stride,
                        row_req_ptr, row_len_ptr, out_ptr, n_rows, n_req, capacity, n_splits,
                        ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, H: tl.constexpr, H_PAD: tl.constexpr,
                        D: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROWS_PER_BLOCK: tl.constexpr,
                        TAIL: tl.constexpr, FP8_CACHE: tl.constexpr, MX_CACHE: tl.constexpr,
                        QUANT_Q: tl.constexpr,
                        HW_CVT: tl.constexpr, Q_RCP: tl.constexpr, DOT_DTYPE: tl.constexpr,
                        HEAD_DOT: tl.constexpr, HEAD_DTYPE: tl.constexpr, OUT: tl.constexpr,
                        NUM_STAGES: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    tile = tl.program_id(0)
    split = tl.program_id(1)
    first_row = tile * ROWS

    if MX_CACHE:
        q_t, w = mx_query_tile(q_ptr, q_row_stride, q_head_stride, q_col_stride, w_ptr, w_row_stride,
                               w_head_stride, first_row, n_rows, ROWS, ROWS_PAD, H, H_PAD, D,
                               DOT_DTYPE)
    else:
        all_cols = tl.full((D,), 1, tl.int1)             # D is a power of two: no padding
        q_t, w = query_tile(q_ptr, q_row_stride, q_head_stride, q_col_stride, w_ptr, w_row_stride,
                            w_head_stride, first_row, n_rows, all_cols, ROWS, ROWS_PAD, H, H_PAD,
                            D, QUANT_Q, HW_CVT, Q_RCP, DOT_DTYPE)
    w_mat = w
    if HEAD_DOT:
        w_mat = head_weights(w, ROWS_PAD, H_PAD, OUT, HEAD_DTYPE)

    row_ok, req_of_row, len_of_row, out_row = rows_of_tile(row_req_ptr, row_len_ptr, out_ptr,
                                                           first_row, n_rows, capacity, ROWS, OUT)
    minus_inf = tl.full((OUT, TAIL), float("-inf"), tl.float32)
    offs = tl.arange(0, BLOCK_SIZE)

    for j in range(ROWS):
        row = first_row + j
        if row < n_rows:
            req, starts_run = run_start(row_req_ptr, row, j)
            if starts_run:
                sel, lens, length, table_row = run_rows(req, row_ok, req_of_row, len_of_row, n_req,
                                                        table_ptr, table_stride)
                n_steps = tl.cdiv(length, BLOCK_SIZE)
                for step in tl.range(split * n_steps // n_splits, (split + 1) * n_steps // n_splits,
                                     num_stages=NUM_STAGES):
                    block = tl.load(table_row + step)
                    # a -1 block: negative rows, outside the descriptor, read as zeros
                    k = k_desc.load([block * ROWS_PER_BLOCK, 0])          # [BLOCK_SIZE, D]
                    pos = step * BLOCK_SIZE + offs
                    if k.dtype == tl.uint8:            # interpreter: the e4m3 values as bytes
                        k = k.to(tl.float8e4nv, bitcast=True)
                    if FP8_CACHE:
                        k_scale = tl.load(cache_f32_ptr + (block.to(tl.int64) * block_stride
                                                           + BLOCK_SIZE * D) // 4 + offs,
                                          mask=(block >= 0) & (offs >= 0), other=0.0)
                    elif MX_CACHE:                      # group scales folded into the keys
                        k = mx_dequant_keys(k, cache_u8_ptr, block, block_stride, offs, BLOCK_SIZE,
                                            D, DOT_DTYPE)
                        k_scale = offs                                   # unused
                    else:
                        k_scale = offs                                   # unused without FP8
                    score_keys(k, q_t, w, w_mat, k_scale, pos, lens, out_row, sel, capacity,
                               BLOCK_SIZE, ROWS_PAD, H_PAD, FP8_CACHE, DOT_DTYPE, HEAD_DOT,
                               HEAD_DTYPE)
                fill_tail(out_row, sel, capacity, n_steps * BLOCK_SIZE, split, n_splits, minus_inf,
                          TAIL)


def tma_supported(index_cache: torch.Tensor, d: int, block_size: int) -> bool:
    """Whether the cache can be read as [rows, D] boxes of one block (see the module docstring)."""
    if d & (d - 1) or d < 16 or block_size & (block_size - 1) or block_size > 256:
        return False
    if index_cache.dtype == torch.uint8 and d < 32 and index_cache.device.type == "cuda":
        return False            # an FP8 tl.dot needs an inner size >= 32 on the GPU
    return ((d * index_cache.element_size()) % 16 == 0 and index_cache.stride(0) % d == 0
            and index_cache.data_ptr() % 16 == 0)


def launch_indexer_tma(q, weights, index_cache, block_table, row_req, row_len, scores, *, block_size: int,
                       rows: int, rows_pad: int, splits: int, quant_q: bool, dot_dtype, head_dot: bool,
                       num_warps: int | None, num_stages: int, q_rcp: bool = False,
                       maxnreg: int | None = None) -> torch.Tensor:
    """Launch on checked arguments (`indexer.launch_indexer(..., variant="tma")` derives them).
    q_rcp: see `e4m3_hw`; maxnreg: register cap (default on the GPU: 168 for an MXFP8 cache or with
    q_rcp, at 4 warps and at most 128 query rows a tile, so 3 programs fit an SM; 0: none)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    n, heads, d = q.shape
    on_gpu = q.device.type == "cuda"
    fp8 = index_cache.dtype == torch.uint8
    mx = is_mxfp8_index_cache(index_cache)
    capacity = scores.shape[1]
    h_pad = triton.next_power_of_2(heads)
    rows_per_block = index_cache.stride(0) // d          # = block_size for [blocks, bs, d]
    if fp8 or mx:    # e4m3 boxes on the GPU; bytes in the interpreter (bitcast in the kernel)
        base = index_cache.view(torch.float8_e4m3fn) if on_gpu else index_cache.view(torch.uint8)
    else:
        base = index_cache
    total_rows = index_cache.shape[0] * rows_per_block
    k_desc = TensorDescriptor(base, [total_rows, d], [d, 1], [block_size, d])
    cache_f32 = index_cache.view(torch.float32) if fp8 else index_cache
    cache_u8 = index_cache.view(torch.uint8) if mx else cache_f32   # MXFP8: the group exponents
    num_warps = _num_warps(rows_pad, h_pad, num_warps)
    if maxnreg is None:
        maxnreg = default_maxnreg(mx, q_rcp and quant_q, num_warps, rows_pad, h_pad)
    extra = register_cap(q.device, maxnreg)
    _indexer_tma_kernel[(triton.cdiv(n, rows), splits)](
        q, q.stride(0), q.stride(1), q.stride(2), weights, weights.stride(0), weights.stride(1),
        k_desc, cache_f32, cache_u8, index_cache.stride(0), block_table, block_table.stride(0),
        row_req, row_len, scores, n, block_table.shape[0], capacity, splits,
        **_constexprs(rows, rows_pad, heads, h_pad, d, block_size, rows_per_block, on_gpu, fp8,
                      quant_q, q_rcp, dot_dtype, head_dot, num_stages, mx),
        num_warps=num_warps, **extra, **pdl_launch(q.device))
    return scores


def default_maxnreg(mx: bool, q_rcp: bool, num_warps: int, rows_pad: int, h_pad: int) -> int:
    """The launcher's register cap (0: none): 168 for an MXFP8 cache or q_rcp at 4 warps and at
    most 128 query rows a tile, so 3 programs fit an SM."""
    return 168 if (mx or q_rcp) and num_warps == 4 and rows_pad * h_pad <= 128 else 0


def _num_warps(rows_pad: int, h_pad: int, num_warps: int | None) -> int:
    if num_warps is None:      # [BLOCK_SIZE, rows_pad * h_pad] fp32 accumulator in registers
        return 8 if rows_pad * h_pad > 128 else 4
    return num_warps


def _constexprs(rows, rows_pad, heads, h_pad, d, block_size, rows_per_block, on_gpu, fp8, quant_q,
                q_rcp, dot_dtype, head_dot, num_stages, mx=False) -> dict:
    out = max(16, rows_pad) if head_dot else rows_pad
    return dict(ROWS=rows, ROWS_PAD=rows_pad, H=heads, H_PAD=h_pad, D=d, BLOCK_SIZE=block_size,
                ROWS_PER_BLOCK=rows_per_block, TAIL=(4096 if on_gpu else 256) // out, FP8_CACHE=fp8,
                MX_CACHE=mx,
                QUANT_Q=quant_q, HW_CVT=on_gpu, Q_RCP=q_rcp, DOT_DTYPE=dot_dtype, HEAD_DOT=head_dot,
                HEAD_DTYPE=tl.float32 if dot_dtype == tl.float32 else tl.bfloat16, OUT=out,
                NUM_STAGES=num_stages)


def aot_spec(p, block_size: int, ptrs: dict, variant: str, op: str, ints: dict | None = None,
             mx: bool = False):
    """The AOT build of the launch `indexer.plan` describes (p, an IndexerPlan for the GPU) with
    q_rcp off: the [blocks, block_stride] cache viewed as [rows, D], one box = one block's keys
    (mx: an MXFP8 cache, 4 B of group exponents a key after the values); `ints`: the launch's
    integers (aot_spec.kernel_spec)."""
    stride = block_size * (p.d + 4 if p.fp8 else p.d + p.d // 32 if mx else p.d)
    num_warps = _num_warps(p.rows_pad, p.h_pad, p.num_warps)
    desc = descriptor_type(torch.float8_e4m3fn if p.fp8 or mx else torch.bfloat16, (block_size, p.d))
    return kernel_spec(
        _indexer_tma_kernel, op, variant,
        _constexprs(p.rows, p.rows_pad, p.heads, p.h_pad, p.d, block_size, stride // p.d, True,
                    p.fp8, p.quant_q, False, p.dot_dtype, p.head_dot, p.num_stages, mx),
        dict(ptrs, k_desc=desc, cache_u8_ptr=torch.uint8 if mx else ptrs["cache_f32_ptr"]),
        num_warps=num_warps, ints=ints,
        maxnreg=default_maxnreg(mx, False, num_warps, p.rows_pad, p.h_pad))
