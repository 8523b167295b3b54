"""Cache pools: the MLA pool of flat blocks (latent plane + index-key plane, shared block ids for
all MLA layers) and the KDA state pool (conv window + fp32 recurrent state per request slot).

Cache formats (spec/model.md §5.6, §6.5; graph/ops/fp8_layouts.py), chosen per pool:
- latent_cache "model": [num_blocks, block_size, kv_lora + rope] in the model dtype; "fp8": the
  FP8 latent layout, uint8 [num_blocks, block_size, row_bytes] (656 bytes a token at K3 sizes);
- index_cache "bf16": float keys (fp32 for an fp32 model); "fp8": e4m3 + one fp32 scale per 128
  values (uint8); "mxfp8": e4m3 + one E8M0 byte per 32 values (float8_e4m3fn).
The ops read the format from the tensors, so one model runs on any of them.

The pool owns memory and bookkeeping (free lists, per-request blocks and lengths); the model only
sees the tensors, through graph/step.py's dataclasses.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from ..config import K31Config
from ..errors import RuntimeFailure
from ..graph.ops.cache_write import index_row_bytes
from ..graph.ops.fp8_layouts import check_latent_fp8_dims, latent_fp8_row_bytes, mx_row_bytes
from ..graph.step import Caches, KDALayerState, KDASnapshots, MLALayerCache

INDEX_CACHE_KINDS = ("bf16", "fp8", "mxfp8")
LATENT_CACHE_KINDS = ("model", "fp8")


class PoolExhausted(RuntimeError):
    pass


def _planes(cfg: K31Config, num_blocks: int, block_size: int, max_requests: int, index_cache: str,
            latent_cache: str, dev) -> tuple[list[MLALayerCache], list[KDALayerState]]:
    """The pool's tensors, zeroed, on `dev` ("meta" sizes them without allocating)."""
    dt = cfg.torch_dtype
    mla: list[MLALayerCache] = []
    for _ in cfg.mla_layers:
        if latent_cache == "fp8":
            latent = torch.zeros(num_blocks, block_size,
                                 latent_fp8_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim),
                                 dtype=torch.uint8, device=dev)
        else:
            latent = torch.zeros(num_blocks, block_size, cfg.latent_dim, dtype=dt, device=dev)
        if not cfg.has_indexer:
            index = torch.zeros(0, dtype=dt, device=dev)
        elif index_cache == "fp8":
            index = torch.zeros(num_blocks, block_size * index_row_bytes(cfg.index_head_dim),
                                dtype=torch.uint8, device=dev)
        elif index_cache == "mxfp8":
            index = torch.zeros(num_blocks, block_size * mx_row_bytes(cfg.index_head_dim),
                                dtype=torch.float8_e4m3fn, device=dev)
        else:
            index_dt = torch.float32 if dt == torch.float32 else torch.bfloat16
            index = torch.zeros(num_blocks, block_size, cfg.index_head_dim, dtype=index_dt, device=dev)
        mla.append(MLALayerCache(latent, index))
    W, P = cfg.short_conv_kernel_size, cfg.kda_proj_dim
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    kda = [KDALayerState(torch.zeros(max_requests, W - 1, 3 * P, dtype=dt, device=dev),
                         torch.zeros(max_requests, H, K, K, dtype=torch.float32, device=dev))
           for _ in cfg.kda_layers]
    return mla, kda


def _memory_of(device: torch.device) -> int | None:
    """Total memory of `device` in bytes (an upper bound of what a pool may take), None if unknown."""
    try:
        if device.type == "cpu":
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
    except (ValueError, OSError, RuntimeError, AssertionError):   # no such sysconf name / device
        pass
    return None


@dataclass
class Request:
    slot: int                         # KDA state slot and block-table row
    blocks: list[int] = field(default_factory=list)
    length: int = 0                   # committed tokens in the caches


class CachePool:
    def __init__(self, cfg: K31Config, *, max_requests: int, max_seq_len: int, block_size: int = 16,
                 num_blocks: int | None = None, index_cache: str = "bf16", latent_cache: str = "model",
                 device="cpu"):
        if index_cache not in INDEX_CACHE_KINDS:
            raise ValueError(f"index_cache must be one of {INDEX_CACHE_KINDS}, got {index_cache!r}")
        if latent_cache not in LATENT_CACHE_KINDS:
            raise ValueError(f"latent_cache must be one of {LATENT_CACHE_KINDS}, got {latent_cache!r}")
        if latent_cache == "fp8":
            check_latent_fp8_dims(cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        if index_cache == "mxfp8" and cfg.has_indexer and cfg.index_head_dim % 32:
            raise ValueError(f"index_cache 'mxfp8' needs index_head_dim a multiple of 32, got "
                             f"{cfg.index_head_dim}")
        if block_size <= 0 or max_requests <= 0 or max_seq_len <= 0:
            raise ValueError("block_size, max_requests and max_seq_len must be positive")
        self.cfg, self.block_size, self.device = cfg, block_size, torch.device(device)
        self.max_seq_len = max_seq_len
        self.max_blocks_per_req = math.ceil(max_seq_len / block_size)
        self.num_blocks = num_blocks or max_requests * self.max_blocks_per_req
        # sized on the meta device first, so a pool that cannot fit is refused with its size
        # instead of failing inside the allocator (or, on CPU, swapping the machine to a halt)
        mla, kda = _planes(cfg, self.num_blocks, block_size, max_requests, index_cache, latent_cache,
                           "meta")
        need = sum(t.numel() * t.element_size() for t in [x for c in mla for x in (c.latent, c.index)]
                   + [x for st in kda for x in (st.conv, st.recurrent)])
        have = _memory_of(self.device)
        if have is not None and need > have:
            raise RuntimeFailure(
                f"out of memory: the cache pool for {max_requests} request(s) of up to {max_seq_len} "
                f"tokens needs {need} bytes ({need / 2**30:.1f} GiB) and {self.device} has {have} "
                f"bytes ({have / 2**30:.1f} GiB) in all; fewer or shorter requests fit")
        self.mla, self.kda = _planes(cfg, self.num_blocks, block_size, max_requests, index_cache,
                                     latent_cache, self.device)
        self.free_slots = list(range(max_requests - 1, -1, -1))
        self.free_blocks = list(range(self.num_blocks - 1, -1, -1))
        # host bookkeeping: a step ships its requests' rows with its other metadata
        self.block_table = torch.full((max_requests, self.max_blocks_per_req), -1, dtype=torch.int32)
        self.requests: dict[int, Request] = {}
        self._next_id = 0

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self) -> int:
        if not self.free_slots:
            raise PoolExhausted(f"all {len(self.block_table)} request slots are in use")
        slot = self.free_slots.pop()
        for st in self.kda:  # a new request starts from zero state
            st.conv[slot].zero_()
            st.recurrent[slot].zero_()
        rid, self._next_id = self._next_id, self._next_id + 1
        self.requests[rid] = Request(slot)
        return rid

    def free(self, rid: int) -> None:
        req = self.requests.pop(rid)
        self.free_blocks.extend(reversed(req.blocks))
        self.block_table[req.slot].fill_(-1)
        self.free_slots.append(req.slot)

    def reserve(self, rid: int, new_length: int) -> None:
        """Make sure request `rid` owns blocks for positions < new_length."""
        if new_length > self.max_seq_len:
            raise ValueError(f"request {rid} would reach {new_length} tokens; max_seq_len is {self.max_seq_len}")
        req = self.requests[rid]
        need = math.ceil(new_length / self.block_size) - len(req.blocks)
        if need > len(self.free_blocks):
            raise PoolExhausted(f"need {need} more blocks, {len(self.free_blocks)} free")
        for _ in range(max(need, 0)):
            b = self.free_blocks.pop()
            self.block_table[req.slot, len(req.blocks)] = b
            req.blocks.append(b)

    def slots_for(self, rid: int, start: int, stop: int) -> list[int]:
        """Physical cache slots of logical positions start..stop-1 of request rid."""
        req, bs = self.requests[rid], self.block_size
        return [req.blocks[p // bs] * bs + p % bs for p in range(start, stop)]

    # ---- views handed to the model ----------------------------------------------------------------
    def caches(self, snapshots: list[KDASnapshots] | None = None) -> Caches:
        return Caches(self.mla, self.kda, snapshots)

    def new_snapshots(self, batch: int, rows: int) -> list[KDASnapshots]:
        return [KDASnapshots(torch.empty(batch, rows, *st.conv.shape[1:], dtype=st.conv.dtype,
                                         device=self.device),
                             torch.empty(batch, rows, *st.recurrent.shape[1:], dtype=torch.float32,
                                         device=self.device))
                for st in self.kda]

    def rollback(self, slots: list[int], accepted: list[int], rows: int,
                 snapshots: list[KDASnapshots]) -> None:
        """After verifying `rows` rows, make the state after row accepted[b]-1 the committed one.

        kda_decode already committed the state after the last row; only requests that rejected
        some rows copy their snapshot back. MLA/indexer caches need nothing: the request length is
        truncated by the caller, so rejected rows are simply overwritten later.
        """
        for b, (slot, a) in enumerate(zip(slots, accepted)):
            if not 1 <= a <= rows:
                raise ValueError(f"accepted rows must be in 1..{rows}, got {a} for request {b}")
            if a == rows:
                continue
            for st, snap in zip(self.kda, snapshots):
                st.conv[slot].copy_(snap.conv[b, a - 1])
                st.recurrent[slot].copy_(snap.recurrent[b, a - 1])
