"""Cache writes of the MLA layer: latent rows and index keys (spec/model.md §5.6, §6.5).

Ops (namespace k31c, each mutates its `cache` argument in place):
- `mla_cache_write(cache, rows, slot_mapping)`: latent rows [c_kv ‖ k_rope] into
  cache [num_blocks, block_size, Dl] (float), or into the FP8 latent layout of fp8_layouts.py
  (uint8 [num_blocks, block_size, row_bytes]: c_kv e4m3 with fp32 scales, k_rope bf16).
- `index_cache_write(cache, keys, slot_mapping)`: indexer keys, either plain
  ([num_blocks, block_size, d] in the cache's float dtype), the FP8 layout below (uint8 cache) or
  the MXFP8 layout of fp8_layouts.py (float8_e4m3fn cache: e4m3 values + E8M0 group-32 scales).
- `index_key_norm_write(cache, k_pre, ln_weight, ln_bias, slot_mapping, eps)`: LayerNorm in fp32
  + the same write; the op the `fuse_index_write` pass puts in place of LayerNorm → write.

FP8 index layout (spec §6.5; vLLM `indexer_k_quant_and_cache`, SGLang `NSATokenToKVPool`):
cache uint8 [num_blocks, block_size * (d + 4 * n_scales)], n_scales = ceil(d / 128). Per block,
bytes [0, B·d) hold the e4m3 values token-major, bytes [B·d, B·(d + 4·n_scales)) the fp32 scales
token-major (one per 128-value group). scale = max(amax_group, 1e-4) / 448, value = e4m3(key / scale).

Also public helpers used by the other reference ops and by tests: `index_row_bytes`,
`quantize_index_fp8`, `gather_index_keys`, `gather_latent_rows`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k31c.graph.ops.fp8_layouts import (dequantize_mxfp8, is_mxfp8_index_cache, latent_fp8_nope,
                                        mx_dim_from_row_bytes, mx_row_bytes, quantize_latent_fp8,
                                        quantize_mxfp8, split_mx_blocks)

FP8_MAX = 448.0            # largest finite float8_e4m3fn
FP8_MIN_AMAX = 1e-4        # floor on a group's amax, so an all-small group gets a usable scale
SCALE_GROUP = 128          # values per fp32 scale
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


# ---- layout helpers ------------------------------------------------------------------------

def index_scales_per_row(d: int) -> int:
    return -(-d // SCALE_GROUP)


def index_row_bytes(d: int) -> int:
    """Bytes one token's key takes in the FP8 layout: d e4m3 values + one fp32 per 128 values."""
    return d + 4 * index_scales_per_row(d)


def index_dim_from_row_bytes(row_bytes: int) -> int:
    """Inverse of `index_row_bytes` (it is strictly increasing, so the answer is unique)."""
    for n_scales in range(1, row_bytes // 4 + 1):
        d = row_bytes - 4 * n_scales
        if d > 0 and index_scales_per_row(d) == n_scales:
            return d
    raise ValueError(f"{row_bytes} bytes per token is not an FP8 index row (d + 4*ceil(d/128))")


def is_fp8_index_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.uint8


def index_cache_block_size(cache: torch.Tensor, d: int, arg: str = "index_cache") -> int:
    """Tokens per block of an index cache holding d-wide keys (any layout); checks the shape."""
    if is_mxfp8_index_cache(cache):
        if cache.dim() != 2 or d % 32:
            raise ValueError(f"{arg}: the MXFP8 (float8_e4m3fn) index cache must be 2-D "
                             f"[num_blocks, block_size * (d + d/32)] with d a multiple of 32; got "
                             f"{tuple(cache.shape)} for d={d}")
        if cache.shape[1] % mx_row_bytes(d):
            raise ValueError(f"{arg}: {cache.shape[1]} bytes per block is not a multiple of "
                             f"{mx_row_bytes(d)} (MXFP8 bytes per token for d={d})")
        return cache.shape[1] // mx_row_bytes(d)
    if is_fp8_index_cache(cache):
        if cache.dim() != 2:
            raise ValueError(f"{arg}: the FP8 (uint8) index cache must be 2-D "
                             f"[num_blocks, block_size * {index_row_bytes(d)}], got {tuple(cache.shape)}")
        row = index_row_bytes(d)
        if cache.shape[1] % row:
            raise ValueError(f"{arg}: {cache.shape[1]} bytes per block is not a multiple of "
                             f"{row} (bytes per token for d={d})")
        return cache.shape[1] // row
    if cache.dtype not in _FLOATS:
        raise ValueError(f"{arg}: dtype {cache.dtype} is neither uint8 (FP8 layout) nor a float type")
    if cache.dim() != 3 or cache.shape[2] != d:
        raise ValueError(f"{arg}: expected [num_blocks, block_size, {d}], got {tuple(cache.shape)}")
    return cache.shape[1]


def _split_fp8_blocks(cache: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of an FP8 index cache: values [num_blocks, B, d] and scale bytes [num_blocks, B, 4·n]."""
    block_size = cache.shape[1] // index_row_bytes(d)
    values = cache[:, : block_size * d].unflatten(1, (block_size, d))
    scales = cache[:, block_size * d:].unflatten(1, (block_size, 4 * index_scales_per_row(d)))
    return values, scales


def quantize_index_fp8(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [N, d] → (e4m3 values [N, d], fp32 scales [N, ceil(d/128)]), one scale per 128 values."""
    n, d = keys.shape
    n_scales = index_scales_per_row(d)
    padded = F.pad(keys.float(), (0, n_scales * SCALE_GROUP - d))  # zero pad never raises an amax
    groups = padded.view(n, n_scales, SCALE_GROUP)
    scales = groups.abs().amax(-1).clamp_min(FP8_MIN_AMAX) / FP8_MAX
    scaled = (groups / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    values = scaled.flatten(1)[:, :d].to(torch.float8_e4m3fn)
    return values, scales


def dequantize_index_fp8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, d = values.shape
    per_value = scales.repeat_interleave(SCALE_GROUP, dim=1)[:, :d]
    return values.float() * per_value


def physical_slots(block_table_row: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Physical slot of each logical position of one request (int64)."""
    blocks = block_table_row.long()[positions // block_size]
    if bool((blocks < 0).any()):
        raise ValueError("block_table: a position in use maps to an unused block (-1)")
    return blocks * block_size + positions % block_size


def _check_length(block_table_row: torch.Tensor, length: int, block_size: int) -> None:
    if length < 0 or length > block_table_row.shape[0] * block_size:
        raise ValueError(f"length {length} outside 0..{block_table_row.shape[0] * block_size} "
                         "(the blocks of block_table_row)")


def gather_index_keys(cache: torch.Tensor, block_table_row: torch.Tensor, length: int,
                      block_size: int) -> torch.Tensor:
    """Keys of logical positions 0..length-1 of one request, as float32 [length, d] (dequantised)."""
    _check_length(block_table_row, length, block_size)
    positions = torch.arange(length, device=cache.device)
    slots = physical_slots(block_table_row, positions, block_size)
    if not (is_fp8_index_cache(cache) or is_mxfp8_index_cache(cache)):
        if cache.shape[1] != block_size:
            raise ValueError(f"block_size {block_size} differs from the cache's {cache.shape[1]}")
        return cache.flatten(0, 1)[slots].float()
    if cache.shape[1] % block_size:
        raise ValueError(f"block_size {block_size} does not divide the {cache.shape[1]} bytes per block")
    if is_mxfp8_index_cache(cache):
        d = mx_dim_from_row_bytes(cache.shape[1] // block_size)
        values, exps = (r.flatten(0, 1)[slots] for r in split_mx_blocks(cache, d))
        return dequantize_mxfp8(values.view(torch.float8_e4m3fn), exps.int() - 127)
    d = index_dim_from_row_bytes(cache.shape[1] // block_size)
    values, scale_bytes = _split_fp8_blocks(cache, d)
    values = values.flatten(0, 1)[slots].view(torch.float8_e4m3fn)
    scales = scale_bytes.flatten(0, 1)[slots].contiguous().view(torch.float32)
    return dequantize_index_fp8(values, scales)


def gather_latent_rows(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """Latent rows of logical positions 0..length-1 of one request: [length, Dl] in the cache
    dtype (the raw bytes [length, row_bytes] of an FP8 latent cache)."""
    block_size = cache.shape[1]
    _check_length(block_table_row, length, block_size)
    positions = torch.arange(length, device=cache.device)
    return cache.flatten(0, 1)[physical_slots(block_table_row, positions, block_size)]


# ---- argument checks (metadata only, shared by the real and the fake implementations) ------

def _check_slot_mapping(slot_mapping: torch.Tensor, n: int) -> None:
    if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping: expected a 1-D int64 tensor, got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    if slot_mapping.shape[0] != n:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {n} rows")


def _check_float_2d(t: torch.Tensor, arg: str) -> None:
    if t.dim() != 2 or t.dtype not in _FLOATS:
        raise ValueError(f"{arg}: expected a 2-D float tensor [N, width], got {t.dtype} {tuple(t.shape)}")


def check_mla_write(cache, rows, slot_mapping) -> None:
    if cache.dim() != 3 or cache.dtype not in _FLOATS + (torch.uint8,):
        raise ValueError(f"cache: expected float [num_blocks, block_size, Dl] or the uint8 FP8 latent "
                         f"layout, got {cache.dtype} {tuple(cache.shape)}")
    _check_float_2d(rows, "rows")
    if cache.dtype == torch.uint8:
        latent_fp8_nope(cache.shape[2], rows.shape[1], "cache")
    elif rows.shape[1] != cache.shape[2]:
        raise ValueError(f"rows are {rows.shape[1]} wide but cache rows are {cache.shape[2]} wide")
    _check_slot_mapping(slot_mapping, rows.shape[0])


def check_index_write(cache, keys, slot_mapping) -> None:
    _check_float_2d(keys, "keys")
    index_cache_block_size(cache, keys.shape[1], "cache")
    _check_slot_mapping(slot_mapping, keys.shape[0])


def _written(slot_mapping: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Indices of the rows to write. A negative slot marks a padding row (not written)."""
    if bool((slot_mapping >= num_slots).any()):
        raise ValueError(f"slot_mapping: a slot is >= the cache's {num_slots} slots")
    return (slot_mapping >= 0).nonzero().squeeze(1)


# ---- ops -------------------------------------------------------------------------------------

@torch.library.custom_op("k31c::mla_cache_write", mutates_args=("cache",))
def mla_cache_write(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache.flatten(0, 1)[slot_mapping[i]] = rows[i] (cast to the cache dtype, or quantised to the
    FP8 latent layout for a uint8 cache); slot < 0 skips."""
    check_mla_write(cache, rows, slot_mapping)
    flat = cache.view(-1, cache.shape[2])
    keep = _written(slot_mapping, flat.shape[0])
    if cache.dtype == torch.uint8:
        nope = latent_fp8_nope(cache.shape[2], rows.shape[1], "cache")
        flat.index_copy_(0, slot_mapping[keep], quantize_latent_fp8(rows[keep], nope))
        return
    flat.index_copy_(0, slot_mapping[keep], rows[keep].to(cache.dtype))


@mla_cache_write.register_fake
def _(cache, rows, slot_mapping):
    check_mla_write(cache, rows, slot_mapping)


def _write_index_keys(cache: torch.Tensor, keys: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    d = keys.shape[1]
    block_size = index_cache_block_size(cache, d, "cache")
    keep = _written(slot_mapping, cache.shape[0] * block_size)
    slots, keys = slot_mapping[keep], keys[keep]
    if is_mxfp8_index_cache(cache):
        values, exps = quantize_mxfp8(keys)
        value_region, scale_region = split_mx_blocks(cache, d)
        block, offset = slots // block_size, slots % block_size
        value_region[block, offset] = values.view(torch.uint8)
        scale_region[block, offset] = (exps + 127).to(torch.uint8)
        return
    if not is_fp8_index_cache(cache):
        cache.view(-1, d).index_copy_(0, slots, keys.to(cache.dtype))
        return
    values, scales = quantize_index_fp8(keys)
    value_region, scale_region = _split_fp8_blocks(cache, d)
    block, offset = slots // block_size, slots % block_size
    value_region[block, offset] = values.view(torch.uint8)
    scale_region[block, offset] = scales.view(torch.uint8)   # fp32 → its 4 native-order bytes


@torch.library.custom_op("k31c::index_cache_write", mutates_args=("cache",))
def index_cache_write(cache: torch.Tensor, keys: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write indexer keys [N, d] to their slots: FP8-quantised for a uint8 cache, else cast."""
    check_index_write(cache, keys, slot_mapping)
    _write_index_keys(cache, keys, slot_mapping)


@index_cache_write.register_fake
def _(cache, keys, slot_mapping):
    check_index_write(cache, keys, slot_mapping)


def check_norm_write(cache, k_pre, ln_weight, ln_bias, slot_mapping) -> None:
    check_index_write(cache, k_pre, slot_mapping)
    d = k_pre.shape[1]
    for arg, t in (("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        if t.dim() != 1 or t.shape[0] != d or t.dtype not in _FLOATS:
            raise ValueError(f"{arg}: expected a float [{d}] tensor, got {t.dtype} {tuple(t.shape)}")


@torch.library.custom_op("k31c::index_key_norm_write", mutates_args=("cache",))
def index_key_norm_write(cache: torch.Tensor, k_pre: torch.Tensor, ln_weight: torch.Tensor,
                         ln_bias: torch.Tensor, slot_mapping: torch.Tensor, eps: float) -> None:
    """index_cache_write(cache, LayerNorm_fp32(k_pre; ln_weight, ln_bias, eps), slot_mapping)."""
    check_norm_write(cache, k_pre, ln_weight, ln_bias, slot_mapping)
    keys = F.layer_norm(k_pre.float(), (k_pre.shape[1],), ln_weight.float(), ln_bias.float(), eps)
    _write_index_keys(cache, keys, slot_mapping)


@index_key_norm_write.register_fake
def _(cache, k_pre, ln_weight, ln_bias, slot_mapping, eps):
    check_norm_write(cache, k_pre, ln_weight, ln_bias, slot_mapping)
