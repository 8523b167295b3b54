"""The half-release seesaw's launch: the sparse MLA for bf16 latent rows on sm_90a over 64-key
blocks (the kernel, and its schedule, in mla_sparse_half_kernel.py). `mla_sparse_ws.sparse_mla`
hands it bf16 calls; FP8 latent rows stay on the 32-key seesaw there. Here: which calls it takes
(`why_not`), the key splits a row takes (`plan_splits`), the launch and its ahead-of-time builds.
"""
from __future__ import annotations

import torch

from k31c.lowering.aot_spec import kernel_spec
from k31c.lowering.triton.device import target_of
from k31c.lowering.triton.gluon_sm90 import GLUON_ERROR
from k31c.lowering.triton.mla_common import (key_splits, merge_spec, merge_splits, sparse_outputs,
                                             split_outputs, split_width, table_width)
from k31c.lowering.triton.mla_seesaw import DV, WIDTH, scores_scale_log2
from k31c.lowering.triton.mla_sparse_half_kernel import HEADS_TILE, KEYS_STEP

MIN_SPLIT_STEPS = 2                 # pairs a split takes at least
NUM_WARPS = 4                       # the producer; 12 warps in all

if GLUON_ERROR is None:
    from k31c.lowering.triton.mla_sparse_half_kernel import sparse_half_kernel


def why_not(latent_cache: torch.Tensor) -> str | None:
    """Why this kernel does not take a call the 32-key seesaw takes (None: it does): FP8 rows,
    or cache blocks not a power of two (the block-table lookups are shifts)."""
    if latent_cache.dtype != torch.bfloat16:
        return "not bf16 latent rows"
    return block_size_reason(latent_cache.shape[1])


def block_size_reason(block_size: int) -> str | None:
    """Why cache blocks of `block_size` rows are not this kernel's (None: they are)."""
    if block_size <= 0 or block_size & (block_size - 1):
        return f"cache blocks of {block_size} rows, not a power of two"
    return None


def plan_splits(n_rows: int, n_heads: int, n_keys: int, sm_count: int) -> int:
    """Key splits a (row, head tile) takes: as many as keep every program on an SM of its own
    (one wave), each at least MIN_SPLIT_STEPS pairs; 1 when the programs alone fill the SMs."""
    return key_splits(n_rows * -(-n_heads // HEADS_TILE), n_keys, KEYS_STEP, MIN_SPLIT_STEPS, sm_count)


def split_keys(n_keys: int, splits: int) -> int:
    """Keys a split takes: a whole number of 128-key pairs."""
    return split_width(n_keys, splits, KEYS_STEP)


def sparse_mla(q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor,
               row_req: torch.Tensor, indices: torch.Tensor, sm_scale: float,
               dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`k31c::sparse_mla` on the calls `mla_sparse_ws.sparse_mla` (the registered launcher)
    checks and hands here: the name the compiler's report gives them."""
    return launch(q, latent_cache, block_table, row_req, indices, sm_scale)


def launch(q, latent_cache, block_table, row_req, indices, sm_scale, splits: int | None = None):
    """The kernel's launch on checked arguments `mla_sparse_ws` takes and `why_not` passes;
    `splits` overrides `plan_splits` (tests, benchmarks)."""
    n, n_heads, _ = q.shape
    n_keys = indices.shape[1]
    out, lse, done = sparse_outputs(q, n_keys, DV)
    if done:
        return out, lse
    n_tiles = -(-n_heads // HEADS_TILE)
    if splits is None:
        splits = plan_splits(n, n_heads, n_keys, target_of(q.device).sm_count)
    dst, dst_lse, empty_lse = split_outputs(out, lse, splits)
    sparse_half_kernel[(n * n_tiles * splits,)](
        q, latent_cache, block_table, row_req, indices, dst, dst_lse, n, n_heads, n_tiles, n_keys,
        splits, split_keys(n_keys, splits), q.stride(0), q.stride(1), indices.stride(0),
        block_table.stride(0), scores_scale_log2(sm_scale, False), empty_lse,
        BLOCK_SIZE=latent_cache.shape[1], num_warps=NUM_WARPS)
    if splits > 1:
        merge_splits(dst, dst_lse, out, lse)
    return out, lse


def aot_specs(shapes) -> list:
    """The kernel's launches at `shapes` (aot_spec.AotShapes), bf16 rows: one split and the key
    splits of a one-row decode with their merge, for the ahead-of-time build."""
    cfg = shapes.cfg
    heads, k, dt = cfg.num_attention_heads, cfg.index_topk, cfg.torch_dtype
    n_tiles, sm = -(-heads // HEADS_TILE), shapes.target.sm_count
    specs = []
    for rows in sorted({shapes.batch * r for r in shapes.rows_per_request}):
        splits = plan_splits(rows, heads, k, sm)
        ints = dict(n_rows=rows, n_heads=heads, n_tiles=n_tiles, n_keys=k, n_splits=splits,
                    keys_per_split=split_keys(k, splits), stride_qn=heads * WIDTH, stride_qh=WIDTH,
                    stride_in=k, stride_bt=table_width(shapes))
        specs.append(kernel_spec(
            sparse_half_kernel, "k31c::sparse_mla", f"half,rows={rows},splits={splits}",
            dict(BLOCK_SIZE=shapes.block_size, num_warps=NUM_WARPS),
            dict(q_ptr=dt, cache_ptr=dt, table_ptr=torch.int32, req_ptr=torch.int32,
                 idx_ptr=torch.int32, out_ptr=dt if splits == 1 else torch.float32,
                 lse_ptr=torch.float32, scale_log2="fp32", empty_lse="fp32"),
            num_warps=NUM_WARPS, ints=ints))
        if splits > 1:
            specs.append(merge_spec("k31c::sparse_mla", DV, dt, rows, heads, splits))
    return specs
