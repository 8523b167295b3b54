"""Two 8-bit cache layouts beside the FP8 index keys of cache_write.py: FP8 latent rows and MXFP8
index keys (the quantise/dequantise math every reference op and kernel test shares).

FP8 latent row (`fp8_ds_mla`, spec/model.md §5.6; vLLM `concat_and_cache_mla`, FlashMLA "FP8 with
scale"): a uint8 cache [num_blocks, block_size, row_bytes]. Per token, for a row of
`nope` values c_kv and `rope` values k_rope (K3: 512 + 64 = 656 bytes):
  bytes [0, nope)                       c_kv as e4m3, scale = max(amax, 1e-4) / 448 per 128 values
  bytes [nope, nope + 4·ceil(nope/128)) those fp32 scales
  bytes [.., row_bytes)                 k_rope as bf16 (not quantised)
`nope` is a multiple of 16 (then row_bytes and the row width determine it) and `rope` is even
(so the fp32 and bf16 parts are aligned in every row).

MXFP8 index keys (the `mxfp8_indexer` format; OCP microscaling): a float8_e4m3fn cache
[num_blocks, block_size * (d + d/32)] (the dtype is what tells it from the per-token FP8 layout's
uint8). Per block: the e4m3 values token-major (B·d bytes), then one E8M0 byte per 32 values
token-major (B·d/32 bytes). A group's scale is 2^e with e = ceil(log2(amax / 448)) clamped to
[-126, 127] (rounded up, so no value saturates); its byte is e + 127. 132 bytes a token at d = 128.
"""
from __future__ import annotations

import torch

E4M3_MAX = 448.0
LATENT_SCALE_GROUP = 128     # c_kv values per fp32 scale
LATENT_NOPE_MULTIPLE = 16
MX_GROUP = 32                # values per E8M0 scale
MX_MIN_EXP, MX_MAX_EXP = -126, 127
E8M0_BIAS = 127


# ---- FP8 latent rows ----------------------------------------------------------------------------

def latent_fp8_scales(nope: int) -> int:
    return -(-nope // LATENT_SCALE_GROUP)


def latent_fp8_row_bytes(nope: int, rope: int) -> int:
    """Bytes of one token's FP8 latent row: nope e4m3 + 4 per 128 of them + 2 per rope value."""
    return nope + 4 * latent_fp8_scales(nope) + 2 * rope


def latent_fp8_nope(row_bytes: int, width: int, arg: str = "latent_cache") -> int:
    """The e4m3 part of a `width`-wide latent row stored in `row_bytes` bytes (unique among
    multiples of 16); ValueError naming `arg` when no layout fits."""
    for nope in range(LATENT_NOPE_MULTIPLE, width + 1, LATENT_NOPE_MULTIPLE):
        if latent_fp8_row_bytes(nope, width - nope) == row_bytes and (width - nope) % 2 == 0:
            return nope
    raise ValueError(f"{arg}: {row_bytes} bytes per token is not an FP8 latent row of {width} values "
                     f"(nope e4m3 + 4*ceil(nope/128) scale bytes + 2*rope bf16 bytes, nope a multiple "
                     f"of {LATENT_NOPE_MULTIPLE}, rope even)")


def check_latent_fp8_dims(nope: int, rope: int) -> None:
    if nope <= 0 or nope % LATENT_NOPE_MULTIPLE or rope < 0 or rope % 2:
        raise ValueError(f"the FP8 latent layout needs kv_lora_rank a positive multiple of "
                         f"{LATENT_NOPE_MULTIPLE} and an even rope width; got {nope} and {rope}")


def quantize_latent_fp8(rows: torch.Tensor, nope: int) -> torch.Tensor:
    """rows [N, width] -> uint8 [N, row_bytes] in the FP8 latent layout."""
    n, width = rows.shape
    ns = latent_fp8_scales(nope)
    x = rows.float()
    padded = torch.nn.functional.pad(x[:, :nope], (0, ns * LATENT_SCALE_GROUP - nope))
    groups = padded.view(n, ns, LATENT_SCALE_GROUP)
    scales = groups.abs().amax(-1).clamp_min(1e-4) / E4M3_MAX
    values = (groups / scales.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).flatten(1)[:, :nope]
    rope = x[:, nope:].to(torch.bfloat16)
    return torch.cat([values.to(torch.float8_e4m3fn).view(torch.uint8), scales.view(torch.uint8),
                      rope.view(torch.uint8)], dim=1)


def dequantize_latent_fp8(raw: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 [..., row_bytes] FP8 latent rows -> float32 [..., width]."""
    nope = latent_fp8_nope(raw.shape[-1], width)
    ns = latent_fp8_scales(nope)
    values = raw[..., :nope].contiguous().view(torch.float8_e4m3fn).float()
    scales = raw[..., nope:nope + 4 * ns].contiguous().view(torch.float32)
    rope = raw[..., nope + 4 * ns:].contiguous().view(torch.bfloat16).float()
    per_value = scales.repeat_interleave(LATENT_SCALE_GROUP, dim=-1)[..., :nope]
    return torch.cat([values * per_value, rope], dim=-1)


# ---- MXFP8 index keys ---------------------------------------------------------------------------

def mx_row_bytes(d: int) -> int:
    return d + d // MX_GROUP


def mx_dim_from_row_bytes(row_bytes: int) -> int:
    if row_bytes % (MX_GROUP + 1):
        raise ValueError(f"{row_bytes} bytes per token is not an MXFP8 index row (d + d/32)")
    return row_bytes // (MX_GROUP + 1) * MX_GROUP


def is_mxfp8_index_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float8_e4m3fn


def mx_exponents(amax: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents (int32) of groups with these amax: ceil(log2(amax / 448)) clamped, computed
    exactly (frexp, not a rounded log2)."""
    y = (amax.float() / E4M3_MAX).clamp_min(2.0 ** MX_MIN_EXP)
    mantissa, exp = torch.frexp(y)                    # y = mantissa * 2^exp, mantissa in [0.5, 1)
    exp = exp.to(torch.int32) - (mantissa == 0.5).to(torch.int32)
    return exp.clamp(MX_MIN_EXP, MX_MAX_EXP)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] (d a multiple of 32) -> (e4m3 values [..., d], int32 exponents [..., d/32])."""
    d = x.shape[-1]
    if d % MX_GROUP:
        raise ValueError(f"MXFP8 needs a width that is a multiple of {MX_GROUP}, got {d}")
    g = x.float().unflatten(-1, (d // MX_GROUP, MX_GROUP))
    exp = mx_exponents(g.abs().amax(-1))
    scaled = torch.ldexp(g, -exp.unsqueeze(-1).float()).clamp(-E4M3_MAX, E4M3_MAX)
    return scaled.to(torch.float8_e4m3fn).flatten(-2), exp


def dequantize_mxfp8(values: torch.Tensor, exp: torch.Tensor) -> torch.Tensor:
    g = values.float().unflatten(-1, (-1, MX_GROUP))
    return torch.ldexp(g, exp.unsqueeze(-1).float()).flatten(-2)


def mxfp8_quant_dequant(x: torch.Tensor) -> torch.Tensor:
    """x quantised to MXFP8 along its last dim and back, in x's dtype (exact in bf16 and fp32)."""
    return dequantize_mxfp8(*quantize_mxfp8(x)).to(x.dtype)


def split_mx_blocks(cache: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 views of an MXFP8 index cache: values [num_blocks, B, d], E8M0 bytes [num_blocks, B, d/32]."""
    raw = cache.view(torch.uint8)
    block_size = raw.shape[1] // mx_row_bytes(d)
    values = raw[:, : block_size * d].unflatten(1, (block_size, d))
    scales = raw[:, block_size * d:].unflatten(1, (block_size, d // MX_GROUP))
    return values, scales
