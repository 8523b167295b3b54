"""Two-pass Triton kernel for `k31c::sparse_mla` (absorbed-form sparse MLA decode, spec §5.4).

The one-pass kernel in mla.py keeps a [heads, 512] fp32 accumulator per program, one program
per SM, and Triton runs its QK -> softmax -> PV chain serially. Here the work is two GEMM-shaped
passes instead, each with a small accumulator and many programs in flight:

1. scores: one program per (row, block of BK selected keys, head tile) computes
   S^T = K_blk @ Q^T over the full 576-wide rows (keys as the MMA's M, so the 32-head tile
   still gets 64-row wgmma), then writes p = exp2(S - m_blk) in the activation dtype and the
   block's per-head max m_blk and sum l_blk.
2. values: one program per (row, chunk of DVC value columns, head tile) merges the block
   statistics into the row's max m and sum l, and accumulates O^T = V^T @ (p * 2^(m_blk - m))
   over the row's keys, then writes O / l and the LSE.

Only the selected rows are read (twice: as keys, then as values); p is BF16 like the P of a
flash-attention kernel, so the result matches the one-pass kernel to bf16 rounding. Empty slots
(-1) get probability 0; a row without any key gives out = 0 and lse = +inf (the reference's rule).

An FP8 latent cache (uint8, graph/ops/fp8_layouts.py) is dequantised on chip in both passes
(mla_common.fp8_latent_cols / rope_latent_cols): e4m3 columns times their row's fp32 scale, the
bf16 rope columns as they are; the values are the e4m3 part (dv = its width).

Both passes gather the selected rows from HBM, which is what keeps it above the compute floor
(BENCHMARKS.md, MLA). `plan` picks the launch configuration; the launcher and `aot_specs` both
read it. `scores_pass` and `values_pass` are the two launches (the benchmarks time the first
alone).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k31c.lowering.aot_spec import kernel_spec
from k31c.lowering.registry import register
from k31c.lowering.targets import targets_running
from k31c.lowering.triton.device import interpreting, pdl_launch, target_of, wait_for_producers
from k31c.lowering.triton.mla_common import (LOG2E, check_mla_args, fp8_latent_cols, fp8_latent_consts,
                                             fp8_latent_views, head_tiles, in_row_slices, resolve_slots,
                                             rope_latent_cols, slots_spec)


@triton.jit
def _score_tile(q_ptr, cache_ptr, cache_f32_ptr, cache_bf16_ptr, slots_ptr, p_ptr, m_ptr, l_ptr, t,
                kb, head0, n_heads, n_keys,
                scale_log2, stride_qn, stride_qh, stride_cb, stride_cs, stride_sn,
                stride_pn, stride_pk, stride_mn, stride_mk,
                WIDTH: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, HT: tl.constexpr, PRECISION: tl.constexpr,
                FP8: tl.constexpr, NOPE: tl.constexpr, N_SCALES: tl.constexpr):
    offs_k = kb * BK + tl.arange(0, BK)
    k_mask = offs_k < n_keys
    slot = tl.load(slots_ptr + t.to(tl.int64) * stride_sn + offs_k, mask=k_mask, other=-1)
    valid = slot >= 0
    row_off = ((tl.maximum(slot, 0) // BLOCK_SIZE).to(tl.int64) * stride_cb
               + (tl.maximum(slot, 0) % BLOCK_SIZE) * stride_cs)
    offs_h = head0 + tl.arange(0, HT)
    h_mask = offs_h < n_heads
    q_cols = q_ptr + t.to(tl.int64) * stride_qn + offs_h[None, :] * stride_qh
    dt = q_ptr.dtype.element_ty
    acc = tl.zeros([BK, HT], tl.float32)
    if FP8:   # e4m3 columns dequantised on chip, then the bf16 rope columns
        for d0 in range(0, NOPE, BD):
            offs_d = d0 + tl.arange(0, BD)
            k = fp8_latent_cols(cache_ptr, cache_f32_ptr, row_off, valid, d0, BD, NOPE).to(dt)
            q_t = tl.load(q_cols + offs_d[:, None], mask=(offs_d < NOPE)[:, None] & h_mask[None, :],
                          other=0.0)
            acc = tl.dot(k, q_t, acc, input_precision=PRECISION)
        for d0 in range(NOPE, WIDTH, BD):
            offs_d = d0 + tl.arange(0, BD)
            k = rope_latent_cols(cache_bf16_ptr, row_off, valid, d0, BD, NOPE, N_SCALES, WIDTH).to(dt)
            q_t = tl.load(q_cols + offs_d[:, None], mask=(offs_d < WIDTH)[:, None] & h_mask[None, :],
                          other=0.0)
            acc = tl.dot(k, q_t, acc, input_precision=PRECISION)
    else:
        rows = cache_ptr + row_off
        for d0 in range(0, WIDTH, BD):
            offs_d = d0 + tl.arange(0, BD)
            d_mask = offs_d < WIDTH
            k = tl.load(rows[:, None] + offs_d[None, :], mask=valid[:, None] & d_mask[None, :],
                        other=0.0).to(dt)
            q_t = tl.load(q_cols + offs_d[:, None], mask=d_mask[:, None] & h_mask[None, :], other=0.0)
            acc = tl.dot(k, q_t, acc, input_precision=PRECISION)
    s = tl.where(valid[:, None], acc * scale_log2, float("-inf"))
    m = tl.max(s, 0)
    p = tl.exp2(s - tl.where(m == float("-inf"), 0.0, m)[None, :])   # empty slots -> 0
    tl.store(p_ptr + t.to(tl.int64) * stride_pn + offs_k[:, None] * stride_pk + offs_h[None, :],
             p.to(p_ptr.dtype.element_ty), mask=k_mask[:, None] & h_mask[None, :])
    stat = t.to(tl.int64) * stride_mn + kb * stride_mk + offs_h
    tl.store(m_ptr + stat, m, mask=h_mask)
    tl.store(l_ptr + stat, tl.sum(p, 0), mask=h_mask)


@triton.jit
def _scores_kernel(q_ptr, cache_ptr, cache_f32_ptr, cache_bf16_ptr, slots_ptr, p_ptr, m_ptr, l_ptr,
                   n_heads, n_keys, scale_log2,
                   stride_qn, stride_qh, stride_cb, stride_cs, stride_sn,
                   stride_pn, stride_pk, stride_mn, stride_mk,
                   WIDTH: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BIG_HT: tl.constexpr, N_BIG: tl.constexpr,
                   SMALL_HT: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
                   NOPE: tl.constexpr, N_SCALES: tl.constexpr, PDL: tl.constexpr = False):
    # grid (head tiles, key blocks, rows): the tiles that gather the same rows run side by side
    wait_for_producers(PDL)
    tile = tl.program_id(0)
    kb = tl.program_id(1)
    t = tl.program_id(2)
    if tile < N_BIG:
        _score_tile(q_ptr, cache_ptr, cache_f32_ptr, cache_bf16_ptr, slots_ptr, p_ptr, m_ptr, l_ptr,
                    t, kb, tile * BIG_HT,
                    n_heads, n_keys, scale_log2, stride_qn, stride_qh, stride_cb, stride_cs,
                    stride_sn, stride_pn, stride_pk, stride_mn, stride_mk,
                    WIDTH, BD, BK, BLOCK_SIZE, BIG_HT, PRECISION, FP8, NOPE, N_SCALES)
    else:
        _score_tile(q_ptr, cache_ptr, cache_f32_ptr, cache_bf16_ptr, slots_ptr, p_ptr, m_ptr, l_ptr,
                    t, kb, N_BIG * BIG_HT + (tile - N_BIG) * SMALL_HT,
                    n_heads, n_keys, scale_log2, stride_qn, stride_qh, stride_cb, stride_cs,
                    stride_sn, stride_pn, stride_pk, stride_mn, stride_mk,
                    WIDTH, BD, BK, BLOCK_SIZE, SMALL_HT, PRECISION, FP8, NOPE, N_SCALES)


@triton.jit
def _value_tile(cache_ptr, cache_f32_ptr, slots_ptr, p_ptr, m_ptr, l_ptr, out_ptr, lse_ptr, t, c,
                head0, n_heads, n_keys, n_blocks, stride_cb, stride_cs, stride_sn, stride_pn,
                stride_pk, stride_mn, stride_mk, stride_on, stride_oh,
                DV: tl.constexpr, DVC: tl.constexpr, BK: tl.constexpr, BK2: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, HT: tl.constexpr, PRECISION: tl.constexpr,
                FP8: tl.constexpr):
    offs_h = head0 + tl.arange(0, HT)
    h_mask = offs_h < n_heads
    stat_row = t.to(tl.int64) * stride_mn + offs_h
    # the row's softmax max and sum from the per-block statistics
    m = tl.full([HT], float("-inf"), tl.float32)
    for kb in range(0, n_blocks):
        m = tl.maximum(m, tl.load(m_ptr + stat_row + kb * stride_mk, mask=h_mask,
                                  other=float("-inf")))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros([HT], tl.float32)
    for kb in range(0, n_blocks):
        m_blk = tl.load(m_ptr + stat_row + kb * stride_mk, mask=h_mask, other=float("-inf"))
        den += tl.load(l_ptr + stat_row + kb * stride_mk, mask=h_mask, other=0.0) \
            * tl.exp2(m_blk - m_use)

    offs_c = c * DVC + tl.arange(0, DVC)
    c_mask = offs_c < DV
    dt = p_ptr.dtype.element_ty
    acc = tl.zeros([DVC, HT], tl.float32)
    for j in range(0, n_keys, BK2):
        offs_k = j + tl.arange(0, BK2)
        k_mask = offs_k < n_keys
        slot = tl.load(slots_ptr + t.to(tl.int64) * stride_sn + offs_k, mask=k_mask, other=-1)
        valid = slot >= 0
        row_off = ((tl.maximum(slot, 0) // BLOCK_SIZE).to(tl.int64) * stride_cb
                   + (tl.maximum(slot, 0) % BLOCK_SIZE) * stride_cs)
        if FP8:   # the values are the e4m3 part (DV = its width), dequantised on chip
            v = fp8_latent_cols(cache_ptr, cache_f32_ptr, row_off, valid, c * DVC, DVC, DV).to(dt)
        else:
            v = tl.load(cache_ptr + row_off[:, None] + offs_c[None, :],
                        mask=valid[:, None] & c_mask[None, :], other=0.0).to(dt)
        p = tl.load(p_ptr + t.to(tl.int64) * stride_pn + offs_k[:, None] * stride_pk
                    + offs_h[None, :], mask=k_mask[:, None] & h_mask[None, :], other=0.0)
        m_blk = tl.load(m_ptr + stat_row + (j // BK) * stride_mk, mask=h_mask,
                        other=float("-inf"))
        p = (p.to(tl.float32) * tl.exp2(m_blk - m_use)[None, :]).to(dt)
        acc = tl.dot(tl.trans(v), p, acc, input_precision=PRECISION)
    has_key = den > 0.0
    out = acc / tl.where(has_key, den, 1.0)[None, :]
    tl.store(out_ptr + t.to(tl.int64) * stride_on + offs_h[None, :] * stride_oh + offs_c[:, None],
             out.to(out_ptr.dtype.element_ty), mask=c_mask[:, None] & h_mask[None, :])
    lse = tl.where(has_key, (m_use + tl.log2(tl.where(has_key, den, 1.0))) / 1.4426950408889634,
                   float("inf"))
    tl.store(lse_ptr + t.to(tl.int64) * n_heads + offs_h, lse, mask=h_mask & (c == 0))


@triton.jit
def _values_kernel(cache_ptr, cache_f32_ptr, slots_ptr, p_ptr, m_ptr, l_ptr, out_ptr, lse_ptr,
                   n_heads, n_keys, n_blocks, stride_cb, stride_cs, stride_sn, stride_pn, stride_pk,
                   stride_mn, stride_mk, stride_on, stride_oh,
                   DV: tl.constexpr, DVC: tl.constexpr, BK: tl.constexpr, BK2: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BIG_HT: tl.constexpr, N_BIG: tl.constexpr,
                   SMALL_HT: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
                   PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    tile = tl.program_id(0)
    c = tl.program_id(1)
    t = tl.program_id(2)
    if tile < N_BIG:
        _value_tile(cache_ptr, cache_f32_ptr, slots_ptr, p_ptr, m_ptr, l_ptr, out_ptr, lse_ptr, t, c,
                    tile * BIG_HT, n_heads, n_keys, n_blocks, stride_cb, stride_cs, stride_sn,
                    stride_pn, stride_pk, stride_mn, stride_mk, stride_on, stride_oh,
                    DV, DVC, BK, BK2, BLOCK_SIZE, BIG_HT, PRECISION, FP8)
    else:
        _value_tile(cache_ptr, cache_f32_ptr, slots_ptr, p_ptr, m_ptr, l_ptr, out_ptr, lse_ptr, t, c,
                    N_BIG * BIG_HT + (tile - N_BIG) * SMALL_HT, n_heads, n_keys, n_blocks,
                    stride_cb, stride_cs, stride_sn, stride_pn, stride_pk, stride_mn, stride_mk,
                    stride_on, stride_oh, DV, DVC, BK, BK2, BLOCK_SIZE, SMALL_HT, PRECISION, FP8)


def plan(n_heads: int, config: dict | None = None, small: bool | None = None,
         rows: int | None = None, dv: int = 512, sm_count: int | None = None, fp8: bool = False) -> dict:
    """Launch plan: GPU tiles, or small ones under the interpreter (`small` None: by the env);
    `config` overrides any of them (tuning, tests). Given `rows` (and the target's `sm_count`),
    a values program takes 64 value columns instead of 256 where 256 would leave SMs idle (a
    decode step of a few rows: 4 programs at one row of K3.1's 96 heads). On FP8 latent rows
    (`fp8`) it takes 128, one scale group a row (measured faster than 256 on the H200)."""
    cfg = dict(config or {})
    small = interpreting() if small is None else small
    cfg.setdefault("big_ht", 16 if small else 64)
    cfg.setdefault("min_tile", 1 if small else 16)      # tl.dot needs >= 16 on the GPU
    big, n_big, small_ht = head_tiles(n_heads, cfg["big_ht"], cfg["min_tile"])
    cfg.update(big=big, n_big=n_big, small=small_ht,
               n_tiles=n_big + (1 if n_heads > n_big * big else 0))
    few_rows = rows is not None and rows * cfg["n_tiles"] * triton.cdiv(dv, 256) < sm_count
    cfg.setdefault("bk", 16 if small else 128)           # keys per scores program
    cfg.setdefault("bd", 16 if small else 64)            # row columns per scores step
    cfg.setdefault("bk2", 8 if small else 64)            # keys per values step (divides bk)
    cfg.setdefault("dvc", 32 if small else 64 if few_rows else 128 if fp8 else 256)   # value columns a program
    cfg.setdefault("warps_scores", 4)
    cfg.setdefault("warps_values", 4 if small else 8)
    cfg.setdefault("stages_scores", 1 if small else 4)
    cfg.setdefault("stages_values", 1 if small else 3)
    if cfg["bk"] % cfg["bk2"]:
        raise ValueError(f"config: bk2={cfg['bk2']} must divide bk={cfg['bk']}")
    return cfg


def _tiles(cfg: dict, block_size: int, precision: str) -> dict:
    return dict(BLOCK_SIZE=block_size, BIG_HT=cfg["big"], N_BIG=cfg["n_big"],
                SMALL_HT=cfg["small"], PRECISION=precision)


@register("k31c::sparse_mla", targets_running("k31c::sparse_mla", "two_pass"))
def sparse_mla(q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor,
               row_req: torch.Tensor, indices: torch.Tensor, sm_scale: float,
               dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    return in_row_slices(lambda q_, req_, idx_: launch(q_, latent_cache, block_table, req_, idx_,
                                                       sm_scale, dv), q.shape[0], q, row_req, indices)


def check_sparse(q, latent_cache, block_table, row_req, indices, dv) -> None:
    check_mla_args(q, latent_cache, block_table, row_req, dv, indices, "indices")
    if indices.dim() != 2:
        raise ValueError(f"indices: expected int32 [N, k], got {tuple(indices.shape)}")


def launch(q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor,
           row_req: torch.Tensor, indices: torch.Tensor, sm_scale: float, dv: int,
           config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`k31c::sparse_mla`; `config` overrides the launch plan (tuning, tests)."""
    check_sparse(q, latent_cache, block_table, row_req, indices, dv)
    n, n_heads, _ = q.shape
    out = q.new_empty((n, n_heads, dv))
    lse = q.new_empty((n, n_heads), dtype=torch.float32)
    if n == 0 or n_heads == 0:
        return out, lse
    if indices.shape[1] == 0:
        return out.zero_(), lse.fill_(float("inf"))
    cfg = plan(n_heads, config, rows=n, dv=dv, sm_count=target_of(q.device).sm_count,
               fp8=latent_cache.dtype == torch.uint8)
    scores = scores_pass(cfg, q, latent_cache, block_table, row_req, indices, sm_scale)
    values_pass(cfg, scores, latent_cache, out, lse, dv)
    return out, lse


def scores_pass(cfg: dict, q, latent_cache, block_table, row_req, indices, sm_scale) -> tuple:
    """The first launch (after the slots): p = exp2(S - m_blk) [row, key, head] and the per-block
    max and sum; returns (slots, p, m_blk, l_blk, precision) for `values_pass`."""
    n, n_heads, width = q.shape
    n_keys = indices.shape[1]
    bs = latent_cache.shape[1]
    slots = resolve_slots(indices, block_table, row_req, bs)
    n_blocks = triton.cdiv(n_keys, cfg["bk"])
    p = q.new_empty((n, n_keys, n_heads))                       # exp2(s - m_blk), [row, key, head]
    m_blk = q.new_empty((n, n_blocks, n_heads), dtype=torch.float32)
    l_blk = torch.empty_like(m_blk)
    precision = target_of(q.device).dot_precision(fast=q.dtype != torch.float32)
    _scores_kernel[(cfg["n_tiles"], n_blocks, n)](
        q, *fp8_latent_views(latent_cache), slots, p, m_blk, l_blk, n_heads, n_keys,
        float(sm_scale) * LOG2E,
        q.stride(0), q.stride(1), latent_cache.stride(0), latent_cache.stride(1), slots.stride(0),
        p.stride(0), p.stride(1), m_blk.stride(0), m_blk.stride(1),
        WIDTH=width, BD=cfg["bd"], BK=cfg["bk"], **_tiles(cfg, bs, precision),
        **fp8_latent_consts(latent_cache, width),
        num_warps=cfg["warps_scores"], num_stages=cfg["stages_scores"], **pdl_launch(q.device))
    return slots, p, m_blk, l_blk, precision


def values_pass(cfg: dict, scores: tuple, latent_cache, out, lse, dv: int) -> None:
    """The second launch: O = V^T p merged over the key blocks, O / l and the LSE into out, lse."""
    slots, p, m_blk, l_blk, precision = scores
    n, n_keys, n_heads = p.shape
    views = fp8_latent_views(latent_cache)
    _values_kernel[(cfg["n_tiles"], triton.cdiv(dv, cfg["dvc"]), n)](
        views[0], views[1], slots, p, m_blk, l_blk, out, lse, n_heads, n_keys, m_blk.shape[1],
        latent_cache.stride(0), latent_cache.stride(1), slots.stride(0), p.stride(0), p.stride(1),
        m_blk.stride(0), m_blk.stride(1), out.stride(0), out.stride(1),
        DV=dv, DVC=cfg["dvc"], BK=cfg["bk"], BK2=cfg["bk2"],
        **_tiles(cfg, latent_cache.shape[1], precision), FP8=latent_cache.dtype == torch.uint8,
        num_warps=cfg["warps_values"], num_stages=cfg["stages_values"], **pdl_launch(views[0].device))


def aot_specs(shapes) -> list:
    """The three launches (slots, scores, values) at `shapes` (aot_spec.AotShapes) with `plan`'s
    GPU defaults, for the ahead-of-time build: a cache in the model dtype and the FP8 latent
    layout (uint8, dequantised on chip)."""
    from k31c.graph.ops.fp8_layouts import latent_fp8_row_bytes, latent_fp8_scales
    cfg = shapes.cfg
    dt, heads, width, dv = cfg.torch_dtype, cfg.num_attention_heads, cfg.latent_dim, cfg.kv_lora_rank
    i32, f32 = torch.int32, torch.float32
    p = plan(heads, None, small=False)
    few = plan(heads, None, small=False, rows=shapes.batch, dv=dv, sm_count=shapes.target.sm_count)
    op = "k31c::sparse_mla"
    tiles = _tiles(p, shapes.block_size, shapes.target.dot_precision(dt != torch.float32))
    specs = [slots_spec(shapes, op)]
    k, bs = cfg.index_topk, shapes.block_size
    n_blocks = triton.cdiv(k, p["bk"])
    for fp8 in (False, True):
        cache = dict(cache_ptr=torch.uint8, cache_f32_ptr=f32, cache_bf16_ptr=torch.bfloat16) if fp8 \
            else dict(cache_ptr=dt, cache_f32_ptr=dt, cache_bf16_ptr=dt)
        layout = dict(FP8=fp8, NOPE=dv if fp8 else width, N_SCALES=latent_fp8_scales(dv) if fp8 else 0)
        tag = "fp8," if fp8 else ""
        row = latent_fp8_row_bytes(dv, width - dv) if fp8 else width      # a cache row's elements
        # the launches' integers at these shapes: q [n, heads, width], p [n, k, heads], m/l
        # [n, blocks, heads], out [n, heads, dv], slots [n, k], cache [blocks, bs, row]
        ints = dict(n_heads=heads, n_keys=k, n_blocks=n_blocks, stride_qn=heads * width, stride_qh=width,
                    stride_cb=bs * row, stride_cs=row, stride_sn=k, stride_pn=k * heads, stride_pk=heads,
                    stride_mn=n_blocks * heads, stride_mk=heads, stride_on=heads * dv, stride_oh=dv)
        scores_ints = {n: v for n, v in ints.items() if n in _scores_kernel.arg_names}
        values_ints = {n: v for n, v in ints.items() if n in _values_kernel.arg_names}
        specs += [
            kernel_spec(_scores_kernel, op, f"{tag}scores",
                        dict(WIDTH=width, BD=p["bd"], BK=p["bk"], **tiles, **layout),
                        dict(q_ptr=dt, **cache, slots_ptr=i32, p_ptr=dt, m_ptr=f32, l_ptr=f32,
                             scale_log2="fp32"),
                        num_warps=p["warps_scores"], num_stages=p["stages_scores"], ints=scores_ints),
        ]
        specs += [kernel_spec(_values_kernel, op, f"{tag}values,dvc={dvc}",
                              dict(DV=dv, DVC=dvc, BK=p["bk"], BK2=p["bk2"], **tiles, FP8=fp8),
                              dict(cache_ptr=cache["cache_ptr"], cache_f32_ptr=cache["cache_f32_ptr"],
                                   slots_ptr=i32, p_ptr=dt, m_ptr=f32, l_ptr=f32, out_ptr=dt,
                                   lse_ptr=f32),
                              num_warps=p["warps_values"], num_stages=p["stages_values"], ints=values_ints)
                  for dvc in sorted({plan(heads, None, small=False, fp8=fp8)["dvc"], few["dvc"]})]
    return specs
