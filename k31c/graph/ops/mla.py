"""MLA attention over cached latent rows, absorbed form (spec/model.md §5.4, §6.3).

Ops (namespace k31c), both returning (out [N, Hq, dv] in q's dtype, lse [N, Hq] fp32):
- `sparse_mla(q, latent_cache, block_table, row_req, indices, sm_scale, dv)`: row t attends to the
  latent rows at logical positions indices[t] (int32, -1 = empty slot) of request row_req[t];
  keys are the whole Dl-wide rows, values their first dv columns.
- `dense_mla(q, latent_cache, block_table, row_req, row_len, sm_scale, dv)`: the same over every
  position < row_len[t] (the control, and Kimi K3's own attention).

q is the absorbed query [W_UKᵀ q_nope ‖ q_rope] per head (576 wide in K3). latent_cache is float
[num_blocks, block_size, Dl] or the FP8 latent layout (uint8 [num_blocks, block_size, row_bytes],
graph/ops/fp8_layouts.py), whose rows are dequantised to fp32 before the math. Softmax in fp32;
lse is the natural log of Σ exp(q·k·sm_scale). FlashMLA's convention for a row with no valid key:
out = 0, lse = +inf (so a context-parallel merge gives it zero weight).
"""
from __future__ import annotations

import torch

from k31c.graph.ops.fp8_layouts import dequantize_latent_fp8, latent_fp8_nope

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check_attention(q, latent_cache, block_table, row_req, dv) -> None:
    if q.dim() != 3 or q.dtype not in _FLOATS:
        raise ValueError(f"q: expected a float [N, Hq, Dl] tensor, got {q.dtype} {tuple(q.shape)}")
    if latent_cache.dim() != 3 or latent_cache.dtype not in _FLOATS + (torch.uint8,):
        raise ValueError(f"latent_cache: expected float [num_blocks, block_size, Dl] or the uint8 FP8 "
                         f"latent layout, got {latent_cache.dtype} {tuple(latent_cache.shape)}")
    if latent_cache.dtype == torch.uint8:
        latent_fp8_nope(latent_cache.shape[2], q.shape[2])
    elif latent_cache.shape[2] != q.shape[2]:
        raise ValueError(f"q is {q.shape[2]} wide but latent_cache rows are {latent_cache.shape[2]} wide")
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(f"block_table: expected int32 [B, max_blocks], got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    n = q.shape[0]
    if row_req.dtype != torch.int32 or tuple(row_req.shape) != (n,):
        raise ValueError(f"row_req: expected int32 [{n}], got {row_req.dtype} {tuple(row_req.shape)}")
    if not isinstance(dv, int) or not 0 < dv <= q.shape[2]:
        raise ValueError(f"dv must be an integer in 1..{q.shape[2]} (the row width), got {dv!r}")


def _check_indices(q, indices) -> None:
    if indices.dtype != torch.int32 or indices.dim() != 2 or indices.shape[0] != q.shape[0]:
        raise ValueError(f"indices: expected int32 [{q.shape[0]}, k], got {indices.dtype} "
                         f"{tuple(indices.shape)}")


def _check_row_len(q, row_len) -> None:
    if row_len.dtype != torch.int32 or tuple(row_len.shape) != (q.shape[0],):
        raise ValueError(f"row_len: expected int32 [{q.shape[0]}], got {row_len.dtype} "
                         f"{tuple(row_len.shape)}")


def _slots_of(indices, block_table, row_req, block_size) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical slots [N, k] of the logical positions in indices, and which entries are valid."""
    if row_req.numel() and (bool((row_req < 0).any()) or bool((row_req >= block_table.shape[0]).any())):
        raise ValueError(f"row_req: a request index is outside 0..{block_table.shape[0] - 1}")
    capacity = block_table.shape[1] * block_size
    if bool((indices >= capacity).any()) or bool((indices < -1).any()):
        raise ValueError(f"indices: a position is outside -1..{capacity - 1} (max_blocks * block_size)")
    valid = indices >= 0
    pos = indices.long().clamp_min(0)
    blocks = block_table[row_req.long()].long().gather(1, pos // block_size)
    if bool((valid & (blocks < 0)).any()):
        raise ValueError("block_table: a selected position maps to an unused block (-1)")
    return blocks.clamp_min(0) * block_size + pos % block_size, valid


def _attend(q, latent_cache, slots, valid, sm_scale, dv) -> tuple[torch.Tensor, torch.Tensor]:
    rows = latent_cache.flatten(0, 1)[slots]
    rows = dequantize_latent_fp8(rows, q.shape[2]) if rows.dtype == torch.uint8 else rows.float()  # [N, k, Dl]
    scores = torch.einsum("nhd,nkd->nhk", q.float(), rows) * sm_scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                     # -inf when empty
    empty = ~valid.any(dim=1, keepdim=True)
    lse = torch.where(empty, float("inf"), lse)
    probs = torch.exp(scores - lse.unsqueeze(-1))                             # 0 on masked / empty
    out = torch.einsum("nhk,nkv->nhv", probs, rows[..., :dv])
    return out.to(q.dtype), lse


@torch.library.custom_op("k31c::sparse_mla", mutates_args=())
def sparse_mla(q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor,
               row_req: torch.Tensor, indices: torch.Tensor, sm_scale: float,
               dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_attention(q, latent_cache, block_table, row_req, dv)
    _check_indices(q, indices)
    slots, valid = _slots_of(indices, block_table, row_req, latent_cache.shape[1])
    return _attend(q, latent_cache, slots, valid, sm_scale, dv)


@sparse_mla.register_fake
def _(q, latent_cache, block_table, row_req, indices, sm_scale, dv):
    _check_attention(q, latent_cache, block_table, row_req, dv)
    _check_indices(q, indices)
    return _fake_outputs(q, dv)


@torch.library.custom_op("k31c::dense_mla", mutates_args=())
def dense_mla(q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor,
              row_req: torch.Tensor, row_len: torch.Tensor, sm_scale: float,
              dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_attention(q, latent_cache, block_table, row_req, dv)
    _check_row_len(q, row_len)
    capacity = block_table.shape[1] * latent_cache.shape[1]
    if row_len.numel() and (bool((row_len < 0).any()) or bool((row_len > capacity).any())):
        raise ValueError(f"row_len: a length is outside 0..{capacity} (max_blocks * block_size)")
    width = int(row_len.max()) if row_len.numel() else 0
    positions = torch.arange(width, device=q.device, dtype=torch.int32).expand(q.shape[0], width)
    indices = torch.where(positions < row_len.unsqueeze(1), positions, -1)
    slots, valid = _slots_of(indices, block_table, row_req, latent_cache.shape[1])
    return _attend(q, latent_cache, slots, valid, sm_scale, dv)


@dense_mla.register_fake
def _(q, latent_cache, block_table, row_req, row_len, sm_scale, dv):
    _check_attention(q, latent_cache, block_table, row_req, dv)
    _check_row_len(q, row_len)
    return _fake_outputs(q, dv)


def _fake_outputs(q: torch.Tensor, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, heads, _ = q.shape
    return q.new_empty((n, heads, dv)), q.new_empty((n, heads), dtype=torch.float32)
