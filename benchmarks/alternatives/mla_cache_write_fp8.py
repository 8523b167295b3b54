"""FP8 latent cache write into vLLM's `fp8_ds_mla` row layout: no k31c op uses this layout yet
(the latent cache is BF16, `k31c::mla_cache_write`), so it stays out of k31c until one does.

Per token a 656-byte row: 512 e4m3 values of c_kv (scale = max(amax, 1e-4)/448 per 128 values,
as the index keys), the 4 fp32 scales, then the 64 rope values as bf16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k31c.graph.ops.cache_write import SCALE_GROUP
from k31c.lowering.triton.cache_write import (e4m3_scale, quantize_e4m3, require_contiguous,
                                              to_storage)

FP8_LATENT_NOPE = 512        # fp8_ds_mla: quantised c_kv values per token
FP8_LATENT_ROPE = 64         # fp8_ds_mla: bf16 rope values per token
FP8_LATENT_ROW_BYTES = FP8_LATENT_NOPE + 4 * (FP8_LATENT_NOPE // SCALE_GROUP) + 2 * FP8_LATENT_ROPE  # 656
_TOKENS_PER_PROGRAM = 16


@triton.jit
def _latent_write_fp8_kernel(cache_ptr, cache_f32_ptr, cache_bf16_ptr, rows_ptr, row_stride, col_stride,
                             slot_ptr, n_rows, n_slots,
                             TOKENS: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr,
                             ROW_BYTES: tl.constexpr):
    """fp8_ds_mla row: bytes [0, NOPE) e4m3, then NOPE/128 fp32 scales, then ROPE bf16 values."""
    GROUPS: tl.constexpr = NOPE // 128
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    slot = tl.load(slot_ptr + t, mask=t < n_rows, other=-1)
    live = (slot >= 0) & (slot < n_slots)
    row_at = t.to(tl.int64)[:, None] * row_stride
    base = slot * ROW_BYTES
    cols = tl.arange(0, NOPE)
    x = tl.load(rows_ptr + row_at + cols[None, :] * col_stride, mask=live[:, None], other=0.0).to(tl.float32)
    groups = tl.reshape(x, (TOKENS, GROUPS, 128))
    scale = e4m3_scale(tl.max(tl.abs(groups), axis=2))
    values = tl.reshape(quantize_e4m3(groups, scale[:, :, None]), (TOKENS, NOPE))
    tl.store(cache_ptr + base[:, None] + cols[None, :],
             values.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=live[:, None])
    g = tl.arange(0, GROUPS)
    tl.store(cache_f32_ptr + (base + NOPE)[:, None] // 4 + g[None, :], scale, mask=live[:, None])
    r = tl.arange(0, ROPE)
    rope = tl.load(rows_ptr + row_at + (NOPE + r)[None, :] * col_stride, mask=live[:, None], other=0.0)
    tl.store(cache_bf16_ptr + (base + NOPE + 4 * GROUPS)[:, None] // 2 + r[None, :],
             to_storage(rope.to(tl.float32), tl.bfloat16), mask=live[:, None])


def mla_cache_write_fp8(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Latent rows [N, 576] into an FP8 latent cache uint8 [num_blocks, block_size, 656].

    Per token: 512 e4m3 values of c_kv (scale = max(amax, 1e-4)/448 per 128 values, as the index
    keys), the 4 fp32 scales, then the 64 rope values as bf16. Slot < 0 skips the row.
    """
    if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[2] != FP8_LATENT_ROW_BYTES:
        raise ValueError(f"cache: expected uint8 [num_blocks, block_size, {FP8_LATENT_ROW_BYTES}], "
                         f"got {cache.dtype} {tuple(cache.shape)}")
    require_contiguous(cache)
    width = FP8_LATENT_NOPE + FP8_LATENT_ROPE
    if rows.dim() != 2 or rows.shape[1] != width or not rows.dtype.is_floating_point:
        raise ValueError(f"rows: expected a float [N, {width}] tensor, got {rows.dtype} {tuple(rows.shape)}")
    if slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (rows.shape[0],):
        raise ValueError(f"slot_mapping: expected int64 [{rows.shape[0]}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    n = rows.shape[0]
    if n == 0:
        return
    grid = (triton.cdiv(n, _TOKENS_PER_PROGRAM),)
    _latent_write_fp8_kernel[grid](cache, cache.view(torch.float32), cache.view(torch.bfloat16), rows,
                                   rows.stride(0), rows.stride(1), slot_mapping, n,
                                   cache.shape[0] * cache.shape[1], TOKENS=_TOKENS_PER_PROGRAM,
                                   NOPE=FP8_LATENT_NOPE, ROPE=FP8_LATENT_ROPE,
                                   ROW_BYTES=FP8_LATENT_ROW_BYTES)
