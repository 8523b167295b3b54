"""What one forward step receives besides token ids: cache tensors and device-side metadata.

The model never allocates or frees these (runtime/kv.py does); it only reads and writes them
through the k31c ops. Everything here is a tensor so one captured graph replays for every step.

Row layout. A step processes N rows. Decode/verify: B requests x R rows, request-major
(rows b*R .. b*R+R-1 belong to request b). Prefill: the new tokens of B requests concatenated,
request b owning rows cu_seqlens[b] .. cu_seqlens[b+1]-1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.utils._pytree as pytree


@dataclass
class StepMeta:
    slot_mapping: torch.Tensor   # [N] int64: physical cache slot (block * block_size + offset) of each row
    block_table: torch.Tensor    # [B, max_blocks] int32: physical block of each logical block; -1 unused
    row_req: torch.Tensor        # [N] int32: request (index into block_table / kda_slots) of each row
    row_len: torch.Tensor        # [N] int32: keys the row sees, itself included (= position + 1)
    kda_slots: torch.Tensor      # [B] int64: KDA state slot of each request
    cu_seqlens: torch.Tensor     # [B+1] int32: row offsets per request (prefill); arange(B+1)*R (decode)


META_DTYPES = {"slot_mapping": torch.int64, "block_table": torch.int32, "row_req": torch.int32,
               "row_len": torch.int32, "kda_slots": torch.int64, "cu_seqlens": torch.int32}


def step_meta(*, slot_mapping, block_table, row_req, row_len, kda_slots, cu_seqlens,
              device=None) -> StepMeta:
    """The one way to build a StepMeta: each field from a tensor or a (nested) list of ints, cast
    to its dtype (META_DTYPES) on `device` (default: where a tensor field already is, else cpu)."""
    fields = dict(slot_mapping=slot_mapping, block_table=block_table, row_req=row_req, row_len=row_len,
                  kda_slots=kda_slots, cu_seqlens=cu_seqlens)
    if device is None:
        device = next((v.device for v in fields.values() if isinstance(v, torch.Tensor)), "cpu")
    return StepMeta(**{name: (v.to(device=device, dtype=META_DTYPES[name]) if isinstance(v, torch.Tensor)
                              else torch.tensor(v, dtype=META_DTYPES[name], device=device))
                       for name, v in fields.items()})


def host_ints_to_device(groups: list[torch.Tensor], dtype: torch.dtype, device) -> list[torch.Tensor]:
    """Each host tensor of `groups` (any shape) as a tensor of that shape and `dtype` on `device`,
    all of them views of one buffer filled by one copy.

    On a CUDA device through a pinned host buffer with one non-blocking copy: a plain
    `torch.tensor(..., device="cuda")` waits for the stream to drain, which would serialize every
    step's host work with the previous step's kernels, and one copy per group is a device node
    each. The views start at offsets that depend on the batch; a `torch.compile(...,
    dynamic=True)` of the model does not retrace for them (tests/passes/test_dynamo_backend.py)."""
    device = torch.device(device)
    flat = [g.to(dtype).reshape(-1) for g in groups]
    host = torch.cat(flat) if flat else torch.empty(0, dtype=dtype)
    if device.type == "cuda":
        buf = torch.empty(host.shape, dtype=dtype, device=device)
        buf.copy_(host.pin_memory(), non_blocking=True)
    else:
        buf = host.to(device)
    out, start = [], 0
    for f, g in zip(flat, groups):
        out.append(buf[start:start + f.numel()].view(g.shape))
        start += f.numel()
    return out


def step_to_device(input_ids: torch.Tensor, meta: StepMeta, device) -> tuple[torch.Tensor, StepMeta]:
    """Host token ids and metadata on `device`: the int64 fields in one copy, the int32 ones in
    another (host_ints_to_device)."""
    ids, slot_mapping, kda_slots = host_ints_to_device([input_ids, meta.slot_mapping, meta.kda_slots],
                                                       torch.int64, device)
    row_req, row_len, cu, table = host_ints_to_device([meta.row_req, meta.row_len, meta.cu_seqlens,
                                                       meta.block_table], torch.int32, device)
    return ids, StepMeta(slot_mapping=slot_mapping, block_table=table, row_req=row_req,
                         row_len=row_len, kda_slots=kda_slots, cu_seqlens=cu)


@dataclass
class MLALayerCache:
    """One MLA layer's share of the flat block pool (blocks are shared by all layers).

    latent: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], model dtype, or the FP8
            latent layout (fp8_ds_mla) as uint8 [num_blocks, block_size, row_bytes]: c_kv e4m3,
            its fp32 scales (one per 128 values), k_rope bf16 (graph/ops/fp8_layouts.py).
    index:  BF16/F32 keys [num_blocks, block_size, index_head_dim], or the FP8 layout of
            spec §6.5 as uint8 [num_blocks, block_size * (index_head_dim + 4 * n_scales)]:
            per block all FP8 values token-major first, then the fp32 scales
            (n_scales = ceil(index_head_dim / 128)), or the MXFP8 layout as float8_e4m3fn
            [num_blocks, block_size * (index_head_dim + index_head_dim / 32)]: per block the
            e4m3 values, then one E8M0 scale byte per 32 values.
    """
    latent: torch.Tensor
    index: torch.Tensor


@dataclass
class KDALayerState:
    """One KDA layer's per-request state pool.

    conv:      [num_slots, W-1, 3P] model dtype: the last W-1 pre-conv inputs of q|k|v, oldest first.
    recurrent: [num_slots, H, K, V] float32 (layout [H, K, V], as vLLM's Kimi Linear).
    """
    conv: torch.Tensor
    recurrent: torch.Tensor


@dataclass
class KDASnapshots:
    """Per-row states written during verification, so rejected rows can be rolled back.

    conv:      [B, R, W-1, 3P] conv window after row r of request b.
    recurrent: [B, R, H, K, V] float32 state after row r of request b.
    """
    conv: torch.Tensor
    recurrent: torch.Tensor


@dataclass
class Caches:
    mla: list[MLALayerCache]                          # one per MLA layer, in layer order
    kda: list[KDALayerState]                          # one per KDA layer, in layer order
    kda_snapshots: Optional[list[KDASnapshots]] = None  # verification only, one per KDA layer


for _cls in (StepMeta, MLALayerCache, KDALayerState, KDASnapshots, Caches):
    pytree.register_dataclass(_cls)

META_FIELDS = ("slot_mapping", "block_table", "row_req", "row_len", "kda_slots", "cu_seqlens")


def step_leaves(input_ids: torch.Tensor, meta: StepMeta, caches: Caches) -> list[torch.Tensor]:
    """The tensors of `(input_ids, meta, caches)` in pytree's flatten order (the order of a
    captured graph's step inputs), without pytree's generic walk: this runs on every step."""
    out = [input_ids]
    out += [getattr(meta, f) for f in META_FIELDS]
    for c in caches.mla:
        out += (c.latent, c.index)
    for s in caches.kda:
        out += (s.conv, s.recurrent)
    for s in caches.kda_snapshots or ():
        out += (s.conv, s.recurrent)
    return out


def padding_step(batch: int, rows: int, max_blocks: int, device) -> tuple[torch.Tensor, StepMeta]:
    """Token ids and metadata of a decode step of `batch` padding requests x `rows` rows.

    A padding request reads and writes nothing: its rows have no cache slot (-1) and see no keys
    (row_len 0), its block table row is empty (-1) and its KDA slot is -1. Device graphs pad a
    batch up to its bucket with these; row_req and cu_seqlens keep the request-major pattern, so a
    real batch's values are a prefix of the padded ones."""
    n = batch * rows
    i32, i64 = torch.int32, torch.int64
    meta = step_meta(slot_mapping=torch.full((n,), -1, dtype=i64, device=device),
                     block_table=torch.full((batch, max_blocks), -1, dtype=i32, device=device),
                     row_req=torch.arange(n, dtype=i32, device=device) // rows,
                     row_len=torch.zeros(n, dtype=i32, device=device),
                     kda_slots=torch.full((batch,), -1, dtype=i64, device=device),
                     cu_seqlens=torch.arange(batch + 1, dtype=i32, device=device) * rows)
    return torch.zeros(n, dtype=i64, device=device), meta


def caches_device(caches: Caches) -> torch.device:
    """Where a step runs: the device of its cache pools."""
    first = (caches.kda or caches.mla or [None])[0]
    if first is None:
        raise ValueError("step inputs: the caches hold no KDA or MLA layer")
    return (first.conv if isinstance(first, KDALayerState) else first.latent).device
