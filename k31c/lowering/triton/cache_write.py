"""Triton cache writes of the MLA layer: latent rows and index keys (spec/model.md §5.6, §6.5).

One launch writes all new tokens; rows whose slot is negative are padding and are skipped.
Registered launchers (the k31c ops' exact signatures):
- `mla_cache_write(cache, rows, slot_mapping)`: latent rows cast to the cache dtype, or into the
  FP8 latent layout (uint8 cache, graph/ops/fp8_layouts.py): c_kv e4m3 with one fp32 scale per 128
  values, then k_rope as bf16.
- `index_cache_write(cache, keys, slot_mapping)`: plain keys, the FP8 layout (uint8 cache): per
  block the e4m3 values token-major, then one fp32 scale per 128 values token-major; or the MXFP8
  layout (float8_e4m3fn cache): the same with one E8M0 byte per 32 values.
- `index_key_norm_write(cache, k_pre, ln_weight, ln_bias, slot_mapping, eps)`: LayerNorm in fp32
  fused in front of the same write.

Slots are device tensors (no host sync), so a slot outside the cache cannot raise here: the kernels
skip it instead of writing out of bounds (the reference op raises on it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k31c.graph.ops.cache_write import (FP8_MAX, FP8_MIN_AMAX, SCALE_GROUP, check_index_write,
                                        check_mla_write, check_norm_write, index_cache_block_size,
                                        index_scales_per_row)
from k31c.graph.ops.fp8_layouts import (MX_GROUP, is_mxfp8_index_cache, latent_fp8_nope,
                                        latent_fp8_scales)
from k31c.lowering.aot_spec import kernel_spec
from k31c.lowering.registry import register
from k31c.lowering.targets import GPU_TARGETS
from k31c.lowering.triton.device import pdl_launch, wait_for_producers

_TOKENS_PER_PROGRAM = 16
_LATENT_CHUNK = 128          # latent columns per program (576 = 4.5 chunks)



# ---- shared FP8 helpers (also used by the indexer kernels) ------------------------------------

@triton.jit
def round_to_e4m3(y, SIGNED_ZERO: tl.constexpr = False):
    """Round fp32 y (|y| <= 448) to the nearest e4m3 value, ties to even, returned as fp32.

    Done in fp32 arithmetic because the Triton interpreter's fp32→fp8 cast rounds wrongly; a value
    already on the e4m3 grid then casts exactly everywhere. Spacing is 2^(e-3) for exponent e,
    and 2^-9 in the subnormal range (e < -6). A negative y that rounds to zero gives +0 (Triton's
    -r is 0 - r), equal as a value; SIGNED_ZERO gives -0 (byte 0x80, as torch's cast), for bytes
    that are stored: the sign then comes with the step, a product. The indexer's query tiles,
    which only multiply the values, keep the other form: it costs the MXFP8 scan fewer registers
    (BENCHMARKS.md, "The GPU check passes; G11 on the GPU").
    """
    bits = y.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    ulp = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - (exponent - 3)) << 23).to(tl.float32, bitcast=True)
    a = tl.abs(y) * inv_ulp                        # exact: scaling by a power of two
    whole = tl.floor(a)
    frac = a - whole
    odd = (whole.to(tl.int32) & 1) == 1
    steps = whole + ((frac > 0.5) | ((frac == 0.5) & odd)).to(tl.float32)
    if SIGNED_ZERO:
        r = steps * tl.where(y < 0, -ulp, ulp)
    else:
        r = steps * ulp
        r = tl.where(y < 0, -r, r)
    return r


@triton.jit
def round_to_bf16(x):
    """fp32 → nearest bf16 value (ties to even) as fp32, by bit arithmetic: the interpreter's own
    fp32→bf16 cast truncates wrongly, a value already on the bf16 grid casts exactly."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def to_storage(x, dtype: tl.constexpr):
    """Cast fp32 x to the storage dtype, rounding to nearest even on every backend."""
    if dtype == tl.bfloat16:
        x = round_to_bf16(x)
    return x.to(dtype)


@triton.jit
def e4m3_scale(amax):
    """The fp32 scale of a group: max(amax, 1e-4) / 448 (correctly rounded, as in torch)."""
    return tl.div_rn(tl.maximum(amax, 1e-4), 448.0)


@triton.jit
def quantize_e4m3(x, scale, SIGNED_ZERO: tl.constexpr = False):
    """x / scale clamped to ±448 and rounded to e4m3, as fp32 values on the e4m3 grid (-0 kept
    with SIGNED_ZERO, as round_to_e4m3)."""
    y = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0)
    return round_to_e4m3(y, SIGNED_ZERO)


@triton.jit
def mx_exponent(amax):
    """E8M0 exponent (int32) of a group: ceil(log2(amax / 448)) clamped to [-126, 127], exactly
    (from the bits of the correctly rounded quotient, as fp8_layouts.mx_exponents)."""
    y = tl.div_rn(amax, 448.0)
    bits = y.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    e = biased - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.where(biased == 0, -126, e)              # zero or subnormal quotient
    return tl.minimum(tl.maximum(e, -126), 127)


@triton.jit
def exp2_int(e):
    """2^e as fp32 for an int32 e in [-126, 127] (exact: built from the exponent bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


# ---- kernels ---------------------------------------------------------------------------------

@triton.jit
def _latent_write_kernel(cache_ptr, rows_ptr, row_stride, col_stride, slot_ptr, n_rows, n_slots, width,
                         TOKENS: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    slot = tl.load(slot_ptr + t, mask=t < n_rows, other=-1)
    live = (slot >= 0) & (slot < n_slots)
    mask = live[:, None] & (cols < width)[None, :]
    x = tl.load(rows_ptr + t.to(tl.int64)[:, None] * row_stride + cols[None, :] * col_stride, mask=mask)
    tl.store(cache_ptr + slot[:, None] * width + cols[None, :],
             to_storage(x.to(tl.float32), cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _latent_write_fp8_kernel(cache_ptr, cache_f32_ptr, cache_bf16_ptr, rows_ptr, row_stride, col_stride,
                             slot_ptr, n_rows, n_slots, row_bytes,
                             TOKENS: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr,
                             GROUP: tl.constexpr, GROUPS: tl.constexpr, ROPE_PAD: tl.constexpr,
                             PDL: tl.constexpr = False):
    """FP8 latent rows: bytes [0, NOPE) e4m3 (scale max(amax, 1e-4)/448 per 128 values), then
    ceil(NOPE/128) fp32 scales, then ROPE bf16 values; row_bytes apart."""
    wait_for_producers(PDL)
    WIDTH: tl.constexpr = GROUP * GROUPS
    N_SCALES: tl.constexpr = (NOPE + 127) // 128
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    slot = tl.load(slot_ptr + t, mask=t < n_rows, other=-1)
    live = (slot >= 0) & (slot < n_slots)
    row_at = t.to(tl.int64)[:, None] * row_stride
    base = slot.to(tl.int64) * row_bytes
    cols = tl.arange(0, WIDTH)
    col_ok = cols < NOPE
    x = tl.load(rows_ptr + row_at + cols[None, :] * col_stride, mask=live[:, None] & col_ok[None, :],
                other=0.0).to(tl.float32)
    groups = tl.reshape(x, (TOKENS, GROUPS, GROUP))
    scale = e4m3_scale(tl.max(tl.abs(groups), axis=2))               # [TOKENS, GROUPS]
    values = tl.reshape(quantize_e4m3(groups, scale[:, :, None], True), (TOKENS, WIDTH))
    tl.store(cache_ptr + base[:, None] + cols[None, :],
             values.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=live[:, None] & col_ok[None, :])
    g = tl.arange(0, GROUPS)
    tl.store(cache_f32_ptr + (base + NOPE)[:, None] // 4 + g[None, :], scale,
             mask=live[:, None] & (g < N_SCALES)[None, :])
    if ROPE > 0:
        r = tl.arange(0, ROPE_PAD)
        rope = tl.load(rows_ptr + row_at + (NOPE + r)[None, :] * col_stride,
                       mask=live[:, None] & (r < ROPE)[None, :], other=0.0)
        tl.store(cache_bf16_ptr + (base + NOPE + 4 * N_SCALES)[:, None] // 2 + r[None, :],
                 to_storage(rope.to(tl.float32), tl.bfloat16), mask=live[:, None] & (r < ROPE)[None, :])


@triton.jit
def _index_write_kernel(cache_ptr, cache_f32_ptr, keys_ptr, key_stride, key_col_stride,
                        ln_w_ptr, ln_b_ptr, slot_ptr, n_rows, n_slots, d, block_size, block_stride, eps,
                        TOKENS: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
                        FP8: tl.constexpr, NORM: tl.constexpr, MX: tl.constexpr, PDL: tl.constexpr = False):
    """TOKENS keys per program: [LayerNorm] → [FP8 quantise per GROUP values] → write.

    MX (with FP8): GROUP = 32, a power-of-two scale per group stored as one E8M0 byte at
    blk*block_stride + block_size*d + off*n_groups + g (cache_f32_ptr unused).

    FP8: block_stride = bytes per block; value byte of token (blk, off), column c at
    blk*block_stride + off*d + c; its group g's scale (fp32 units) at
    (blk*block_stride + block_size*d) / 4 + off*n_groups + g. Else: element slot*d + c.
    """
    wait_for_producers(PDL)
    WIDTH: tl.constexpr = GROUP * GROUPS
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    cols = tl.arange(0, WIDTH)
    col_ok = cols < d
    slot = tl.load(slot_ptr + t, mask=t < n_rows, other=-1)
    live = (slot >= 0) & (slot < n_slots)
    mask = live[:, None] & col_ok[None, :]
    x = tl.load(keys_ptr + t.to(tl.int64)[:, None] * key_stride + cols[None, :] * key_col_stride,
                mask=mask, other=0.0).to(tl.float32)
    if NORM:
        mean = tl.sum(x, axis=1) / d
        centred = tl.where(col_ok[None, :], x - mean[:, None], 0.0)
        var = tl.sum(centred * centred, axis=1) / d
        rstd = 1.0 / tl.sqrt_rn(var + eps)
        w = tl.load(ln_w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        b = tl.load(ln_b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        x = centred * rstd[:, None] * w[None, :] + b[None, :]      # padding columns stay 0
    if FP8:
        n_groups = (d + GROUP - 1) // GROUP
        groups = tl.reshape(x, (TOKENS, GROUPS, GROUP))
        amax = tl.max(tl.abs(groups), axis=2)                           # [TOKENS, GROUPS]
        if MX:
            exponent = mx_exponent(amax)
            scale = exp2_int(exponent)
            y = tl.minimum(tl.maximum(groups * exp2_int(-exponent)[:, :, None], -448.0), 448.0)
            values = tl.reshape(round_to_e4m3(y, True), (TOKENS, WIDTH))   # x * 2^-e: exact
        else:
            scale = e4m3_scale(amax)
            values = tl.reshape(quantize_e4m3(groups, scale[:, :, None], True), (TOKENS, WIDTH))
        block = slot // block_size
        offset = slot % block_size
        base = block * block_stride
        tl.store(cache_ptr + (base + offset * d)[:, None] + cols[None, :],
                 values.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=mask)
        g = tl.arange(0, GROUPS)
        if MX:
            scale_at = base + block_size * d + offset * n_groups
            tl.store(cache_ptr + scale_at[:, None] + g[None, :], (exponent + 127).to(tl.uint8),
                     mask=live[:, None] & (g < n_groups)[None, :])
        else:
            scale_at = (base + block_size * d) // 4 + offset * n_groups
            tl.store(cache_f32_ptr + scale_at[:, None] + g[None, :], scale,
                     mask=live[:, None] & (g < n_groups)[None, :])
    else:
        tl.store(cache_ptr + slot[:, None] * d + cols[None, :], to_storage(x, cache_ptr.dtype.element_ty),
                 mask=mask)


# ---- launchers -------------------------------------------------------------------------------

def require_contiguous(cache: torch.Tensor) -> None:
    if not cache.is_contiguous():
        raise ValueError("cache: the Triton cache writes need a contiguous cache tensor")


@register("k31c::mla_cache_write", GPU_TARGETS)
def mla_cache_write(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    check_mla_write(cache, rows, slot_mapping)
    require_contiguous(cache)
    n, width = rows.shape
    if n == 0:
        return
    if cache.dtype == torch.uint8:
        nope = latent_fp8_nope(cache.shape[2], width, "cache")
        _latent_write_fp8_kernel[(triton.cdiv(n, _TOKENS_PER_PROGRAM),)](
            cache, cache.view(torch.float32), cache.view(torch.bfloat16), rows, rows.stride(0),
            rows.stride(1), slot_mapping, n, cache.shape[0] * cache.shape[1], cache.shape[2],
            **latent_fp8_plan(nope, width - nope), **pdl_launch(cache.device))
        return
    grid = (triton.cdiv(n, _TOKENS_PER_PROGRAM), triton.cdiv(width, _LATENT_CHUNK))
    _latent_write_kernel[grid](cache, rows, rows.stride(0), rows.stride(1), slot_mapping, n,
                               cache.shape[0] * cache.shape[1], width,
                               TOKENS=_TOKENS_PER_PROGRAM, CHUNK=_LATENT_CHUNK, **pdl_launch(cache.device))


def latent_fp8_plan(nope: int, rope: int) -> dict:
    """The FP8 latent write's constexprs (the launcher's and aot_specs')."""
    group = min(SCALE_GROUP, triton.next_power_of_2(nope))
    return dict(TOKENS=_TOKENS_PER_PROGRAM, NOPE=nope, ROPE=rope, GROUP=group,
                GROUPS=triton.next_power_of_2(latent_fp8_scales(nope)),
                ROPE_PAD=max(1, triton.next_power_of_2(rope)))


def index_write_plan(d: int, fp8: bool, norm: bool, mx: bool = False) -> dict:
    """The index-key write's constexprs for keys of width d (the launcher's and aot_specs');
    mx: the MXFP8 layout (fp8 must be set too)."""
    if mx:
        return dict(TOKENS=_TOKENS_PER_PROGRAM, GROUP=MX_GROUP,
                    GROUPS=triton.next_power_of_2(d // MX_GROUP), FP8=True, NORM=norm, MX=True)
    groups = index_scales_per_row(d) if fp8 else 1
    group = min(SCALE_GROUP, triton.next_power_of_2(d)) if fp8 else triton.next_power_of_2(d)
    return dict(TOKENS=_TOKENS_PER_PROGRAM, GROUP=group, GROUPS=triton.next_power_of_2(groups),
                FP8=fp8, NORM=norm, MX=False)


def _launch_index_write(cache, keys, ln_weight, ln_bias, slot_mapping, eps, norm: bool) -> None:
    require_contiguous(cache)
    n, d = keys.shape
    block_size = index_cache_block_size(cache, d, "cache")
    if n == 0:
        return
    mx = is_mxfp8_index_cache(cache)
    if mx:
        cache = cache.view(torch.uint8)          # bytes: values and E8M0 scales
    fp8 = cache.dtype == torch.uint8
    if fp8 and not mx and (block_size * d) % 4:
        raise ValueError(f"cache: block_size*d = {block_size * d} is not a multiple of 4, so the "
                         "fp32 scales of the FP8 layout would be unaligned")
    cache_f32 = cache.view(torch.float32) if fp8 and not mx else cache   # MX: unused
    ln_w = ln_weight if norm else keys      # unused pointers when norm is off
    ln_b = ln_bias if norm else keys
    grid = (triton.cdiv(n, _TOKENS_PER_PROGRAM),)
    _index_write_kernel[grid](cache, cache_f32, keys, keys.stride(0), keys.stride(1), ln_w, ln_b,
                              slot_mapping, n, cache.shape[0] * block_size, d, block_size,
                              cache.stride(0), float(eps), **index_write_plan(d, fp8, norm, mx),
                              **pdl_launch(cache.device))


@register("k31c::index_cache_write", GPU_TARGETS)
def index_cache_write(cache: torch.Tensor, keys: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    check_index_write(cache, keys, slot_mapping)
    _launch_index_write(cache, keys, None, None, slot_mapping, 0.0, norm=False)


@register("k31c::index_key_norm_write", GPU_TARGETS)
def index_key_norm_write(cache: torch.Tensor, k_pre: torch.Tensor, ln_weight: torch.Tensor,
                         ln_bias: torch.Tensor, slot_mapping: torch.Tensor, eps: float) -> None:
    check_norm_write(cache, k_pre, ln_weight, ln_bias, slot_mapping)
    _launch_index_write(cache, k_pre, ln_weight, ln_bias, slot_mapping, eps, norm=True)


__all__ = ["mla_cache_write", "index_cache_write", "index_key_norm_write",
           "round_to_e4m3", "e4m3_scale", "quantize_e4m3", "mx_exponent", "exp2_int", "FP8_MAX",
           "FP8_MIN_AMAX"]


def aot_specs(shapes) -> list:
    """The launches of the registered launchers at `shapes` (aot_spec.AotShapes), for the
    ahead-of-time build: the latent write (float and FP8 caches), and the index-key write (FP8,
    MXFP8 and BF16 caches, with and without the LayerNorm) with `index_write_plan`'s constexprs."""
    from k31c.graph.ops.fp8_layouts import latent_fp8_row_bytes, mx_row_bytes
    from k31c.lowering.triton.mla_common import table_width
    cfg = shapes.cfg
    dt, n, bs = cfg.torch_dtype, shapes.batch, shapes.block_size
    nope, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    # the launches' integers: contiguous rows / keys of the batch's tokens, a pool of blocks of
    # bs slots (any count of them: a multiple of 16 slots)
    slots = shapes.batch * table_width(shapes) * bs
    latent = dict(row_stride=nope + rope, col_stride=1, n_rows=n, n_slots=slots)
    specs = [kernel_spec(_latent_write_kernel, "k31c::mla_cache_write", f"{dt}".split(".")[-1],
                         dict(TOKENS=_TOKENS_PER_PROGRAM, CHUNK=_LATENT_CHUNK),
                         dict(cache_ptr=dt, rows_ptr=dt, slot_ptr=torch.int64),
                         ints=dict(latent, width=nope + rope))]
    specs.append(kernel_spec(_latent_write_fp8_kernel, "k31c::mla_cache_write", "fp8",
                             latent_fp8_plan(nope, rope),
                             dict(cache_ptr=torch.uint8, cache_f32_ptr=torch.float32,
                                  cache_bf16_ptr=torch.bfloat16, rows_ptr=dt, slot_ptr=torch.int64),
                             ints=dict(latent, row_bytes=latent_fp8_row_bytes(nope, rope))))
    d = cfg.index_head_dim
    key_bytes = {"fp8": d + 4, "mxfp8": mx_row_bytes(d), "bf16": d}    # a key's cache elements
    ln_dt = torch.float32                     # the indexer's key LayerNorm is kept in fp32
    for fmt in ("fp8", "mxfp8", "bf16"):
        fp8, mx = fmt != "bf16", fmt == "mxfp8"
        cache_dt = torch.uint8 if fp8 else torch.bfloat16
        for norm, op in ((False, "k31c::index_cache_write"), (True, "k31c::index_key_norm_write")):
            specs.append(kernel_spec(
                _index_write_kernel, op, f"{fmt}{',norm' if norm else ''}",
                index_write_plan(d, fp8, norm, mx),
                dict(cache_ptr=cache_dt, cache_f32_ptr=torch.float32 if fp8 and not mx else cache_dt,
                     keys_ptr=dt,
                     ln_w_ptr=ln_dt if norm else dt, ln_b_ptr=ln_dt if norm else dt,   # else: keys
                     slot_ptr=torch.int64, eps="fp32"),
                ints=dict(key_stride=d, key_col_stride=1, n_rows=n, n_slots=slots, d=d, block_size=bs,
                          block_stride=bs * key_bytes[fmt])))
    return specs
