"""One-pass Triton kernel for `k31c::dense_mla` (absorbed-form MLA decode, spec/model.md §5.4,
§6.3), registered for the GPU targets whose record picks the "one_pass" variant of dense_mla
(targets.py; the others run mla_dense.py's split-key kernel). `k31c::sparse_mla` runs the
two-pass kernel (mla_two_pass.py).

One program owns (query row t, a tile of heads, a split of the keys). Per step it gathers BN latent
rows of row t's request ONCE into shared memory and uses them for every head of its tile: as keys
(all Dl columns) and, the first dv columns, as values (MQA: heads share the row). Softmax is online
in fp32 (log2 domain). Keys are positions `0..row_len[t]-1`; a position p of request b lives in
slot `block_table[b, p // bs] * bs + p % bs`.

Heads are tiled without padding to a power of two above Hq (mla_common.head_tiles): 96 heads run
as one 64-head tile (MMA rows = heads, wgmma on Hopper) plus one 32-head tile, both in the same
launch (head tiles vary fastest in the grid) so the programs that share a row's gathers run side
by side and the second read hits L2. When rows x head tiles cannot fill the GPU the keys are split
(flash-decoding): each split writes its normalised partial output and LSE, and a small kernel
merges them by LSE.

One program per SM holds a [heads, 512] fp32 accumulator, and the QK -> softmax -> PV chain of
each step runs serially in it: that chain, not registers, is what bounds this kernel
(BENCHMARKS.md, MLA).

Everything the kernels read about lengths and slots is a device tensor and the grid is a
function of static shapes only, so the launcher is CUDA-graph safe (no host sync). `plan` picks
the launch configuration; the launcher and `aot_specs` both read it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k31c.lowering.aot_spec import kernel_spec
from k31c.lowering.registry import register
from k31c.lowering.targets import Target, targets_running
from k31c.lowering.triton.device import interpreting, pdl_launch, target_of, wait_for_producers
from k31c.graph.ops.fp8_layouts import latent_fp8_scales
from k31c.lowering.triton.mla_common import (LOG2E, check_mla_args, fp8_latent_cols, fp8_latent_views,
                                             head_tiles, in_row_slices, merge_spec, merge_splits,
                                             rope_latent_cols, table_width)


@triton.jit
def _slots(bt_row, start, hi, BLOCK_SIZE: tl.constexpr, BN: tl.constexpr):
    """Physical slots of keys start..start+BN-1 (-1 = none), from the block table row."""
    offs = start + tl.arange(0, BN)
    blk = tl.load(bt_row + offs // BLOCK_SIZE, mask=offs < hi, other=0)
    return tl.where(offs < hi, blk * BLOCK_SIZE + offs % BLOCK_SIZE, -1)


@triton.jit
def _attend_tile(q_ptr, cache_ptr, cache_f32_ptr, cache_bf16_ptr, bt_ptr, out_ptr, lse_ptr,
                 t, b, split, head0, n_heads, lo, hi, scale_log2,
                 stride_qn, stride_qh, stride_cb, stride_cs, stride_btb,
                 stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                 DV: tl.constexpr, DR: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, HT: tl.constexpr, BN: tl.constexpr,
                 FINAL: tl.constexpr, PRECISION: tl.constexpr,
                 FP8: tl.constexpr, N_SCALES: tl.constexpr):
    offs_h = head0 + tl.arange(0, HT)
    h_mask = offs_h < n_heads
    offs_v = tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, BLOCK_R)
    v_mask = offs_v < DV
    r_mask = offs_r < DR

    q_rows = q_ptr + t.to(tl.int64) * stride_qn + offs_h[:, None] * stride_qh
    q_v = tl.load(q_rows + offs_v[None, :], mask=h_mask[:, None] & v_mask[None, :], other=0.0)
    if DR > 0:
        q_r = tl.load(q_rows + DV + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :],
                      other=0.0)
    dt = q_v.dtype

    m_i = tl.full([HT], float("-inf"), tl.float32)
    l_i = tl.zeros([HT], tl.float32)
    acc = tl.zeros([HT, BLOCK_V], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    slot = _slots(bt_row, lo, hi, BLOCK_SIZE, BN)
    for j in range(lo, hi, BN):
        # next block's slots now, used next iteration; the row gathers below are pipelined by the
        # compiler (num_stages 3: issued two blocks ahead). Loop-carried values stay fresh: one
        # that is a plain copy of another stops Triton from pipelining the loop at all.
        slot_next = _slots(bt_row, j + BN, hi, BLOCK_SIZE, BN)
        valid = slot >= 0
        row_off = ((tl.maximum(slot, 0) // BLOCK_SIZE).to(tl.int64) * stride_cb
                   + (tl.maximum(slot, 0) % BLOCK_SIZE) * stride_cs)
        # the gathered latent rows, split into the value part and the rest (rope) part
        if FP8:   # FP8 latent rows (mla_common): e4m3 values dequantised on chip, bf16 rope
            k_v = fp8_latent_cols(cache_ptr, cache_f32_ptr, row_off, valid, 0, BLOCK_V, DV).to(dt)
        else:
            k_v = tl.load(cache_ptr + row_off[:, None] + offs_v[None, :],
                          mask=valid[:, None] & v_mask[None, :], other=0.0).to(dt)
        if DR > 0:
            if FP8:
                k_r = rope_latent_cols(cache_bf16_ptr, row_off, valid, DV, BLOCK_R, DV, N_SCALES,
                                       DV + DR).to(dt)
            else:
                k_r = tl.load(cache_ptr + row_off[:, None] + DV + offs_r[None, :],
                              mask=valid[:, None] & r_mask[None, :], other=0.0).to(dt)
            s = tl.dot(q_r, tl.trans(k_r), input_precision=PRECISION)
        else:
            s = tl.zeros([HT, BN], tl.float32)
        s = tl.dot(q_v, tl.trans(k_v), s, input_precision=PRECISION)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)    # no valid key yet: avoid inf - inf
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(dt), k_v, acc, input_precision=PRECISION)
        m_i = m_new
        slot = slot_next

    has_key = l_i > 0.0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = (m_i + tl.log2(tl.where(has_key, l_i, 1.0))) / 1.4426950408889634
    if FINAL:
        lse = tl.where(has_key, lse, float("inf"))
    else:
        lse = tl.where(has_key, lse, float("-inf"))        # empty split: zero weight in the merge
    o_ptrs = (out_ptr + split.to(tl.int64) * stride_os + t.to(tl.int64) * stride_on
              + offs_h[:, None] * stride_oh + offs_v[None, :])
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & v_mask[None, :])
    tl.store(lse_ptr + split.to(tl.int64) * stride_ls + t.to(tl.int64) * stride_ln + offs_h, lse,
             mask=h_mask)


@triton.jit
def _mla_kernel(q_ptr, cache_ptr, cache_f32_ptr, cache_bf16_ptr, bt_ptr, row_req_ptr,
                row_len_ptr, out_ptr, lse_ptr,
                n_heads, keys_per_split, scale_log2,
                stride_qn, stride_qh, stride_cb, stride_cs, stride_btb,
                stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                DV: tl.constexpr, DR: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, BIG_HT: tl.constexpr, N_BIG: tl.constexpr,
                SMALL_HT: tl.constexpr, BN: tl.constexpr,
                FINAL: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
                N_SCALES: tl.constexpr, PDL: tl.constexpr = False):
    # grid (head tiles, rows, splits): head tiles vary fastest, so the programs that gather the
    # same rows are scheduled together
    wait_for_producers(PDL)
    tile = tl.program_id(0)
    t = tl.program_id(1)
    split = tl.program_id(2)
    b = tl.load(row_req_ptr + t)
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, tl.load(row_len_ptr + t))
    if tile < N_BIG:
        _attend_tile(q_ptr, cache_ptr, cache_f32_ptr, cache_bf16_ptr, bt_ptr, out_ptr, lse_ptr,
                     t, b, split, tile * BIG_HT, n_heads, lo, hi, scale_log2,
                     stride_qn, stride_qh, stride_cb, stride_cs, stride_btb,
                     stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                     DV, DR, BLOCK_V, BLOCK_R, BLOCK_SIZE, BIG_HT, BN, FINAL, PRECISION,
                     FP8, N_SCALES)
    else:
        _attend_tile(q_ptr, cache_ptr, cache_f32_ptr, cache_bf16_ptr, bt_ptr, out_ptr, lse_ptr,
                     t, b, split, N_BIG * BIG_HT + (tile - N_BIG) * SMALL_HT, n_heads, lo, hi,
                     scale_log2,
                     stride_qn, stride_qh, stride_cb, stride_cs, stride_btb,
                     stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                     DV, DR, BLOCK_V, BLOCK_R, BLOCK_SIZE, SMALL_HT, BN, FINAL, PRECISION,
                     FP8, N_SCALES)


# ---- launch plan ------------------------------------------------------------------------------

def plan(target: Target, n_rows: int, n_heads: int, n_work_keys: int,
         config: dict | None = None, small: bool | None = None) -> dict:
    """Tiles, warps, stages and key splits; `config` overrides any of them (tuning, tests).
    small: the interpreter's small tiles (None: when interpreting or off the GPU)."""
    cfg = dict(config or {})
    if small is None:
        small = interpreting() or target.device != "cuda"
    if small:
        cfg.setdefault("big_ht", 16)
        cfg.setdefault("bn", 16)
        cfg.setdefault("num_warps", 4)
        cfg.setdefault("num_stages", 1)
        cfg.setdefault("min_tile", 1)
    cfg.setdefault("big_ht", 64)
    cfg.setdefault("min_tile", 16)          # tl.dot needs at least 16 rows on the GPU
    cfg.setdefault("bn", 32)
    cfg.setdefault("num_warps", 8)
    cfg.setdefault("num_stages", 3)     # row gathers issued two blocks ahead of their math
    big, n_big, small_ht = head_tiles(n_heads, cfg["big_ht"], cfg["min_tile"])
    n_tiles = n_big + (1 if n_heads > n_big * big else 0)
    cfg.update(big=big, n_big=n_big, small=small_ht, n_tiles=n_tiles)
    if "splits" not in cfg:
        # ~4 waves of programs (long rows); never a split shorter than a few key blocks
        sms = target.sm_count
        programs = max(1, n_rows * n_tiles)
        want = -(-(4 * sms) // programs)
        most = max(1, n_work_keys // (4 * cfg["bn"]))
        cfg["splits"] = max(1, min(want, most))
    return cfg


def _constexprs(cfg: dict, dv: int, width: int, block_size: int, final: bool, precision: str,
                fp8: bool = False) -> dict:
    return dict(FP8=fp8, N_SCALES=latent_fp8_scales(dv) if fp8 else 0,
                DV=dv, DR=width - dv, BLOCK_V=max(16, triton.next_power_of_2(dv)),  # tl.dot: K >= 16
                BLOCK_R=max(16, triton.next_power_of_2(width - dv)), BLOCK_SIZE=block_size,
                BIG_HT=cfg["big"], N_BIG=cfg["n_big"], SMALL_HT=cfg["small"], BN=cfg["bn"],
                FINAL=final, PRECISION=precision)


def launch(q, latent_cache, block_table, row_req, row_len, sm_scale, dv, config=None,
           stats: dict | None = None):
    """The one-pass kernel over all keys below row_len, on checked arguments. `config` overrides
    the launch plan (tuning, tests); `stats`, when given, receives the compiled kernel's
    registers / spills / shared memory (GPU only)."""
    n, n_heads, width = q.shape
    n_keys = block_table.shape[1] * latent_cache.shape[1]
    cfg = plan(target_of(q.device), n, n_heads, n_keys, config)
    splits = cfg["splits"]
    bn = cfg["bn"]
    keys_per_split = triton.cdiv(triton.cdiv(n_keys, splits), bn) * bn   # as aot_specs builds it
    out = q.new_empty((n, n_heads, dv))
    lse = q.new_empty((n, n_heads), dtype=torch.float32)
    if n == 0 or n_heads == 0:
        return out, lse
    final = splits == 1
    if final:
        part, part_lse = out.unsqueeze(0), lse.unsqueeze(0)
    else:
        part = q.new_empty((splits, n, n_heads, dv), dtype=torch.float32)
        part_lse = q.new_empty((splits, n, n_heads), dtype=torch.float32)
    precision = target_of(q.device).dot_precision(fast=q.dtype != torch.float32)
    compiled = _mla_kernel[(cfg["n_tiles"], n, splits)](
        q, *fp8_latent_views(latent_cache), block_table, row_req, row_len, part, part_lse,
        n_heads, keys_per_split, float(sm_scale) * LOG2E,
        q.stride(0), q.stride(1), latent_cache.stride(0), latent_cache.stride(1),
        block_table.stride(0),
        part.stride(0), part.stride(1), part.stride(2), part_lse.stride(0), part_lse.stride(1),
        **_constexprs(cfg, dv, width, latent_cache.shape[1], final, precision,
                      latent_cache.dtype == torch.uint8),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(q.device))
    if stats is not None and compiled is not None:
        stats.update(cfg, regs=getattr(compiled, "n_regs", None),
                     spills=getattr(compiled, "n_spills", None),
                     shared=getattr(compiled.metadata, "shared", None))
    if not final:
        merge_splits(part, part_lse, out, lse)
    return out, lse


@register("k31c::dense_mla", targets_running("k31c::dense_mla", "one_pass"))
def dense_mla(q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor,
              row_req: torch.Tensor, row_len: torch.Tensor, sm_scale: float,
              dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_mla_args(q, latent_cache, block_table, row_req, dv, row_len, "row_len")
    if row_len.dim() != 1:
        raise ValueError(f"row_len: expected int32 [N], got {tuple(row_len.shape)}")
    return in_row_slices(lambda q_, req_, len_: launch(q_, latent_cache, block_table, req_, len_,
                                                       sm_scale, dv), q.shape[0], q, row_req, row_len)


def aot_specs(shapes) -> list:
    """The launches of `launch` on the GPU at `shapes` (aot_spec.AotShapes), for the
    ahead-of-time build, with one split (FINAL: output written directly) and with several
    (partials + merge); tiles from `plan`'s GPU defaults."""
    cfg = shapes.cfg
    dt, heads, width, dv = cfg.torch_dtype, cfg.num_attention_heads, cfg.latent_dim, cfg.kv_lora_rank
    i32, f32 = torch.int32, torch.float32
    n = shapes.batch * max(shapes.rows_per_request)
    precision = shapes.target.dot_precision(dt != torch.float32)
    specs = []
    op = "k31c::dense_mla"
    bs, table = shapes.block_size, table_width(shapes)
    for splits in (1, 2):
        cfg_ = plan(shapes.target, n, heads, 0, {"splits": splits}, small=False)
        final = splits == 1
        # the launch's integers: keys = the table's positions; q [n, heads, width],
        # cache [blocks, bs, width], partials [splits, n, heads, dv]
        n_keys = table * bs
        ints = dict(n_heads=heads,
                    keys_per_split=triton.cdiv(triton.cdiv(n_keys, splits), cfg_["bn"]) * cfg_["bn"],
                    stride_qn=heads * width, stride_qh=width, stride_cb=bs * width, stride_cs=width,
                    stride_btb=table, stride_os=n * heads * dv, stride_on=heads * dv,
                    stride_oh=dv, stride_ls=n * heads, stride_ln=heads)
        specs.append(kernel_spec(
            _mla_kernel, op, f"dense,{'final' if final else 'split'}",
            _constexprs(cfg_, dv, width, shapes.block_size, final, precision),
            dict(q_ptr=dt, cache_ptr=dt, cache_f32_ptr=dt, cache_bf16_ptr=dt, bt_ptr=i32, row_req_ptr=i32, row_len_ptr=i32,
                 out_ptr=dt if final else f32, lse_ptr=f32, scale_log2="fp32"),
            num_warps=cfg_["num_warps"], num_stages=cfg_["num_stages"], ints=ints))
    specs.append(merge_spec(op, dv, dt, n, heads, 2))
    return specs
