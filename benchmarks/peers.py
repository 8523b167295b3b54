"""The plain-PyTorch peers in spec/performance.md Appendix B's formulation: what a user writes
without k31c when each request's cache is one contiguous tensor.

Two formulations of the same work are timed beside k31c, each eager and under torch.compile,
and claims are made against the faster of them:
- *paged* (bench_mla.plain_sparse_mla / plain_dense_mla, bench_layer.plain_layer): reads the
  paged pools k31c reads, through the block table, per query row;
- *contiguous* (here): per-request contiguous bf16 tensors (index keys [B, L, 128], latent rows
  [B, L, 576]), queries as [B, R, H, D]: the indexer as one einsum + ReLU + head-weighted sum,
  torch.topk, torch.gather of the picked latent rows, softmax attention; the dense control as
  full softmax attention over [B, R, H, L] scores. No block table, no FP8: bf16 index keys,
  which is what spec Appendix B measured. Neither returns the LSE (k31c's kernels also write it).

`contiguous_inputs` builds these tensors from the paged pools (the same values, gathered in
position order, FP8 index keys dequantised), so the peers see the data k31c sees.
"""
from __future__ import annotations

import torch

TOPK = 2048


def contiguous_indexer_topk(qi, ki, w, lens, k: int = TOPK):
    """qi [B, R, HI, DI] bf16, ki [B, L, DI] bf16, w [B, R, HI] fp32, lens [B, R] visible keys:
    the top-k positions [B, R, k] of Σ_h w_h · ReLU(q_h · k_l) (positions >= lens excluded)."""
    s = torch.einsum("brhd,bld->brhl", qi, ki).float().relu()
    s = (s * w[..., None]).sum(2)                                          # [B, R, L]
    pos = torch.arange(ki.shape[1], device=ki.device)
    s = s.masked_fill(pos >= lens[..., None], float("-inf"))
    return s.topk(k, dim=-1).indices


def contiguous_sparse_mla(qh, cache, idx, sm_scale: float, dv: int):
    """qh [B, R, H, Dl], cache [B, L, Dl], idx [B, R, k]: softmax attention over the picked rows."""
    r, width = qh.shape[1], cache.shape[-1]
    rows = torch.gather(cache[:, None].expand(-1, r, -1, -1), 2,
                        idx[..., None].expand(-1, -1, -1, width))           # [B, R, k, Dl]
    p = torch.einsum("brhd,brkd->brhk", qh, rows).float().mul(sm_scale).softmax(-1)
    return torch.einsum("brhk,brkd->brhd", p.to(qh.dtype), rows[..., :dv])


def contiguous_sparse_layer(qi, ki, w, lens, qh, cache, sm_scale: float, dv: int, k: int = TOPK):
    """Appendix B's sparse layer: indexer, top-k (k picks), sparse MLA over the picks."""
    return contiguous_sparse_mla(qh, cache, contiguous_indexer_topk(qi, ki, w, lens, k), sm_scale, dv)


def contiguous_dense_mla(qh, cache, lens, sm_scale: float, dv: int):
    """Appendix B's dense control: softmax attention of every query row over its first lens keys."""
    scores = torch.einsum("brhd,bld->brhl", qh, cache).float().mul(sm_scale)
    pos = torch.arange(cache.shape[1], device=cache.device)
    scores = scores.masked_fill(pos >= lens[..., None, None], float("-inf"))
    return torch.einsum("brhl,bld->brhd", scores.softmax(-1).to(qh.dtype), cache[..., :dv])


def contiguous_latent(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[B, L, Dl]: each request's latent rows in position order (L = table width x block size)."""
    b, blocks = table.shape
    return cache[table.long()].reshape(b, blocks * cache.shape[1], cache.shape[2])


def contiguous_index_keys(index_cache: torch.Tensor, table: torch.Tensor, block_size: int,
                          dim: int) -> torch.Tensor:
    """[B, L, dim] bf16 from the FP8 index pool ([blocks, block_size · (dim + 4)] bytes: e4m3
    values, then one fp32 scale per key): value x scale, in position order."""
    blocks = index_cache[table.long()]                                     # [B, nb, bytes]
    values = blocks[..., : block_size * dim].view(torch.float8_e4m3fn)
    values = values.unflatten(-1, (block_size, dim)).to(torch.float32)
    scales = blocks[..., block_size * dim:].contiguous().view(torch.float32)[..., None]
    keys = (values * scales).to(torch.bfloat16)                            # [B, nb, bs, dim]
    return keys.flatten(1, 2)


def by_request(x: torch.Tensor, requests: int) -> torch.Tensor:
    """[N, ...] rows in the decode layout (row b·R + r) as [B, R, ...]."""
    return x.view(requests, x.shape[0] // requests, *x.shape[1:])
