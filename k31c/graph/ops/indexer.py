"""Lightning indexer scores and top-k selection (spec/model.md §6.1, §6.2, §6.7.4).

Ops (namespace k31c):
- `lightning_indexer(q, weights, index_cache, block_table, row_req, row_len)` → scores
  [N, max_blocks * block_size] fp32: scores[t, s] = Σ_h weights[t, h] · ReLU(q[t, h] · k[s]) over the
  keys of request row_req[t] (dequantised when the cache is FP8) for s < row_len[t]; -inf beyond.
  `weights` already carry the (H_I · d_I)^-1/2 factor (the model applies it). With an MXFP8 index
  cache (graph/ops/fp8_layouts.py) q is quantised the same way (e4m3, E8M0 scale per 32 values)
  before the dot: the fully quantised scoring path its kernel computes.
- `topk_select(scores, row_len, k)` → int32 [N, k]: the k best visible positions. Tie rule
  (spec §6.7.4): among equal scores the more recent (higher) position wins. With row_len ≤ k every
  visible position is selected and the rest of the row is -1. Reference order: score descending,
  then position descending, -1 last (kernels may return any order).
- `lightning_indexer_topk(...)` = topk_select(lightning_indexer(...)): the fused superkernel's reference.
"""
from __future__ import annotations

import torch

from k31c.graph.ops.cache_write import gather_index_keys, index_cache_block_size
from k31c.graph.ops.fp8_layouts import is_mxfp8_index_cache, mxfp8_quant_dequant

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check_rows(row_req: torch.Tensor, row_len: torch.Tensor, n: int) -> None:
    for arg, t in (("row_req", row_req), ("row_len", row_len)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != n:
            raise ValueError(f"{arg}: expected int32 [{n}], got {t.dtype} {tuple(t.shape)}")


def _check_block_table(block_table: torch.Tensor) -> None:
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(f"block_table: expected int32 [B, max_blocks], got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")


def check_indexer(q, weights, index_cache, block_table, row_req, row_len) -> int:
    """Checks shapes and dtypes; returns the cache's block size."""
    if q.dim() != 3 or q.dtype not in _FLOATS:
        raise ValueError(f"q: expected a float [N, H_I, d_I] tensor, got {q.dtype} {tuple(q.shape)}")
    n, heads, _ = q.shape
    if weights.dtype != torch.float32 or tuple(weights.shape) != (n, heads):
        raise ValueError(f"weights: expected float32 [{n}, {heads}], got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    block_size = index_cache_block_size(index_cache, q.shape[2], "index_cache")
    _check_block_table(block_table)
    _check_rows(row_req, row_len, n)
    return block_size


def _check_row_values(block_table: torch.Tensor, row_req: torch.Tensor, row_len: torch.Tensor,
                      capacity: int) -> None:
    """Value checks the reference can afford (they synchronise)."""
    if row_req.numel() and (bool((row_req < 0).any()) or bool((row_req >= block_table.shape[0]).any())):
        raise ValueError(f"row_req: a request index is outside 0..{block_table.shape[0] - 1}")
    if row_len.numel() and (bool((row_len < 0).any()) or bool((row_len > capacity).any())):
        raise ValueError(f"row_len: a length is outside 0..{capacity} (max_blocks * block_size)")


def indexer_scores(q, weights, index_cache, block_table, row_req, row_len) -> torch.Tensor:
    block_size = check_indexer(q, weights, index_cache, block_table, row_req, row_len)
    capacity = block_table.shape[1] * block_size
    _check_row_values(block_table, row_req, row_len, capacity)
    scores = torch.full((q.shape[0], capacity), float("-inf"), dtype=torch.float32, device=q.device)
    positions = torch.arange(capacity, device=q.device)
    # One pass per request: its rows score against the keys the longest of them can see.
    for b in torch.unique(row_req).tolist():
        rows = (row_req == b).nonzero().squeeze(1)
        length = int(row_len[rows].max())
        keys = gather_index_keys(index_cache, block_table[b], length, block_size)    # [L, d] fp32
        q_rows = q[rows].float()
        if is_mxfp8_index_cache(index_cache):
            q_rows = mxfp8_quant_dequant(q_rows)
        logits = torch.einsum("thd,sd->ths", q_rows, keys).relu()
        req_scores = torch.einsum("ths,th->ts", logits, weights[rows])
        visible = positions[:length].unsqueeze(0) < row_len[rows].unsqueeze(1)
        scores[rows, :length] = req_scores.masked_fill(~visible, float("-inf"))
    return scores


def check_topk(scores: torch.Tensor, row_len: torch.Tensor, k: int) -> None:
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores: expected float32 [N, S], got {scores.dtype} {tuple(scores.shape)}")
    if row_len.dtype != torch.int32 or tuple(row_len.shape) != (scores.shape[0],):
        raise ValueError(f"row_len: expected int32 [{scores.shape[0]}], got {row_len.dtype} "
                         f"{tuple(row_len.shape)}")
    if not isinstance(k, int) or k <= 0:
        raise ValueError(f"k must be a positive integer, got {k!r}")


def select_topk(scores: torch.Tensor, row_len: torch.Tensor, k: int) -> torch.Tensor:
    check_topk(scores, row_len, k)
    n, width = scores.shape
    if row_len.numel() and (bool((row_len < 0).any()) or bool((row_len > width).any())):
        raise ValueError(f"row_len: a length is outside 0..{width} (the scores' width)")
    # Reverse the positions, then stable-sort by score: among equal scores the reversed order
    # keeps the higher position first. A second stable sort moves hidden positions behind every
    # visible one (a visible -inf still beats a hidden position).
    reversed_scores = scores.flip(1)
    reversed_pos = torch.arange(width - 1, -1, -1, device=scores.device)
    order = torch.sort(reversed_scores, dim=1, descending=True, stable=True).indices
    pos = reversed_pos[order]
    hidden = pos >= row_len.unsqueeze(1).long()
    by_visibility = torch.sort(hidden.to(torch.uint8), dim=1, stable=True).indices
    pos = torch.gather(pos, 1, by_visibility)
    hidden = torch.gather(hidden, 1, by_visibility)
    idx = torch.where(hidden, -1, pos)[:, :k]
    if idx.shape[1] < k:
        idx = torch.cat([idx, idx.new_full((n, k - idx.shape[1]), -1)], 1)
    return idx.to(torch.int32)


@torch.library.custom_op("k31c::lightning_indexer", mutates_args=())
def lightning_indexer(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                      block_table: torch.Tensor, row_req: torch.Tensor,
                      row_len: torch.Tensor) -> torch.Tensor:
    return indexer_scores(q, weights, index_cache, block_table, row_req, row_len)


@lightning_indexer.register_fake
def _(q, weights, index_cache, block_table, row_req, row_len):
    block_size = check_indexer(q, weights, index_cache, block_table, row_req, row_len)
    return q.new_empty((q.shape[0], block_table.shape[1] * block_size), dtype=torch.float32)


@torch.library.custom_op("k31c::topk_select", mutates_args=())
def topk_select(scores: torch.Tensor, row_len: torch.Tensor, k: int) -> torch.Tensor:
    return select_topk(scores, row_len, k)


@topk_select.register_fake
def _(scores, row_len, k):
    check_topk(scores, row_len, k)
    return scores.new_empty((scores.shape[0], k), dtype=torch.int32)


@torch.library.custom_op("k31c::lightning_indexer_topk", mutates_args=())
def lightning_indexer_topk(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                           block_table: torch.Tensor, row_req: torch.Tensor, row_len: torch.Tensor,
                           k: int) -> torch.Tensor:
    scores = indexer_scores(q, weights, index_cache, block_table, row_req, row_len)
    return select_topk(scores, row_len, k)


@lightning_indexer_topk.register_fake
def _(q, weights, index_cache, block_table, row_req, row_len, k):
    check_indexer(q, weights, index_cache, block_table, row_req, row_len)
    if not isinstance(k, int) or k <= 0:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    return q.new_empty((q.shape[0], k), dtype=torch.int32)
