"""How much the index-key format changes the indexer's picks: top-k agreement of FP8 (per-token
scale, 132 B/token) and MXFP8 (E8M0 scale per 32 values, q quantised too) with an fp32 indexer on
the same inputs (seed: "FP8 keys change about 6% of the selected tokens" against FP32, measured on
real K3.1 Pro activations).

Inputs are synthetic, shaped like the indexer's: keys = LayerNorm(x) with an affine weight of
log-normal spread (a few channels far larger than the rest, as learned LayerNorm weights make
them), q with the same kind of channel spread, head weights ~ N(0, 1)·(H·d)^-1/2; decode layout
(B requests x R rows, row r of a request sees L - R + 1 + r keys). `scorer` is the
lightning_indexer callable (the reference op on the CPU, the registered Triton launcher on the GPU).
"""
from __future__ import annotations

import torch

from k31c.graph.ops.cache_write import index_row_bytes
from k31c.graph.ops.fp8_layouts import mx_row_bytes

FORMATS = ("f32", "fp8", "mxfp8")


def indexer_inputs(requests: int, rows: int, heads: int, d: int, ctx: int, block_size: int,
                   device="cpu", seed: int = 0, spread: float = 0.5):
    """(q, weights, keys [B·L, d] fp32, block_table, row_req, row_len) in the decode layout; block
    b*L/bs + i of the pool is block i of request b."""
    g = torch.Generator().manual_seed(seed)
    blocks = ctx // block_size
    x = torch.randn(requests * ctx, d, generator=g)
    gamma = torch.exp(spread * torch.randn(d, generator=g))
    keys = torch.nn.functional.layer_norm(x, (d,)) * gamma + 0.1 * torch.randn(d, generator=g)
    n = requests * rows
    q = torch.randn(n, heads, d, generator=g) * torch.exp(spread * torch.randn(d, generator=g))
    weights = torch.randn(n, heads, generator=g) * (heads * d) ** -0.5
    table = torch.arange(requests * blocks, dtype=torch.int32).view(requests, blocks)
    row_req = torch.arange(requests, dtype=torch.int32).repeat_interleave(rows)
    row_len = (ctx - rows + 1 + torch.arange(rows, dtype=torch.int32)).repeat(requests)
    to = dict(device=device)
    return (q.to(**to), weights.to(**to), keys.to(**to), table.to(**to), row_req.to(**to),
            row_len.to(**to))


def index_cache(fmt: str, keys: torch.Tensor, block_size: int) -> torch.Tensor:
    """The keys written through k31c::index_cache_write into a cache of format `fmt`."""
    import k31c.graph.ops  # noqa: F401  (torch.ops.k31c.*)
    n, d = keys.shape
    blocks = n // block_size
    if fmt == "f32":
        cache = keys.new_zeros(blocks, block_size, d)
    elif fmt == "fp8":
        cache = torch.zeros(blocks, block_size * index_row_bytes(d), dtype=torch.uint8, device=keys.device)
    elif fmt == "mxfp8":
        cache = torch.zeros(blocks, block_size * mx_row_bytes(d), dtype=torch.float8_e4m3fn,
                            device=keys.device)
    else:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    torch.ops.k31c.index_cache_write(cache, keys, torch.arange(n, device=keys.device))
    return cache


def _fp8_q(q: torch.Tensor) -> torch.Tensor:
    """q as the FP8 scoring kernel sees it on the GPU: e4m3 with one fp32 scale per (row, head)."""
    from k31c.graph.ops.cache_write import dequantize_index_fp8, quantize_index_fp8
    n, h, d = q.shape
    return dequantize_index_fp8(*quantize_index_fp8(q.reshape(n * h, d))).view(n, h, d).to(q.dtype)


def _mx(x: torch.Tensor) -> torch.Tensor:
    from k31c.graph.ops.fp8_layouts import mxfp8_quant_dequant
    return mxfp8_quant_dequant(x.float()).to(x.dtype)


# name -> (cache format, q as scored, keys as written); the reference op scores each
VARIANTS = {
    "fp8": ("fp8", None, None),                 # per-token FP8 keys, q exact (the reference op)
    "fp8+q": ("fp8", _fp8_q, None),             # and q per (row, head) e4m3: the GPU FP8 kernel
    "mxfp8 keys": ("f32", None, _mx),           # MXFP8 keys, q exact
    "mxfp8": ("mxfp8", None, None),             # MXFP8 keys and q (the op on an MXFP8 cache)
}


def pick_change(inputs, k: int, block_size: int, variants=tuple(VARIANTS), scorer=None) -> dict:
    """Fraction of the fp32 indexer's top-k picks each variant does not pick (mean over rows).
    scorer: lightning_indexer callable for the variants (default: the reference op)."""
    import k31c.graph.ops  # noqa: F401
    q, weights, keys, table, row_req, row_len = inputs
    scorer = scorer or torch.ops.k31c.lightning_indexer

    def picks(fmt, q_fn, key_fn, score_fn):
        cache = index_cache(fmt, key_fn(keys) if key_fn else keys, block_size)
        scores = score_fn(q_fn(q) if q_fn else q, weights, cache, table, row_req, row_len)
        return torch.ops.k31c.topk_select(scores, row_len, k)

    ref = picks("f32", None, None, torch.ops.k31c.lightning_indexer)
    width = table.shape[1] * block_size
    ref_set = torch.zeros(ref.shape[0], width + 1, dtype=torch.bool, device=ref.device)
    ref_set.scatter_(1, torch.where(ref >= 0, ref, width).long(), True)
    ref_set = ref_set[:, :width]
    out = {}
    for name in variants:
        got = picks(*VARIANTS[name], scorer)
        hit = ref_set.gather(1, got.clamp_min(0).long()) & (got >= 0)
        out[name] = 1.0 - (hit.sum(1).float() / ref_set.sum(1).float()).mean().item()
    return out
