"""Split-key Triton kernel for `k31c::dense_mla` (flash-decoding; absorbed-form MLA decode,
spec/model.md §5.4, §6.3).

The query rows of one request share its latent rows, so the M dimension of every tl.dot is
(query row, head) pairs, not the heads of one row: a *group* of G consecutive query rows (G = N /
requests, the R verification rows of a request in the decode layout) is flattened to G·Hq M-rows
and cut into tiles of BM (4 rows x 96 heads = 6 tiles of 64; one row = 64 + a half-empty 64).
A program owns (tile, key split, group). It streams its split of the request's positions once,
BN keys at a time; with BN dividing the cache block size those BN keys are one contiguous
[BN, Dl] slice of one paged block (one block-table load per step). Each slice serves all BM
M-rows, as keys (every Dl column) and as values (the first dv). The tiles of one (group, split)
are adjacent in the grid, so they read the same slice together and HBM sees it once. On the GPU,
with a contiguous cache, the steps below every row's length load that slice as two TMA boxes
(values, rope) of the cache viewed as [blocks x block size, width]; the masked last steps use
pointer loads.

Online softmax in fp32 (log2 domain). Each split writes its normalised partial output and LSE
to a workspace [splits, N, Hq, dv] (fp32); `mla_common.merge_splits` combines them by LSE (with
one split the kernel writes the result directly). A row with no visible key gives out = 0,
lse = +inf.

Any row_req is accepted: a tile whose rows belong to several requests (rows of a group that are
not one request's) runs one pass per request, each pass updating only that request's rows; in
the decode layout the second pass is empty.

CUDA-graph safe: the grid, the split count and the workspace are functions of static shapes
(N, Hq, requests, block-table width) only; lengths, requests and block numbers are read on the
device. `mla_dense_plan.plan` picks the launch configuration; the launcher and `aot_specs` both
read it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k31c.lowering.aot_spec import descriptor_type, kernel_spec
from k31c.lowering.registry import register
from k31c.lowering.targets import targets_running
from k31c.lowering.triton.device import pdl_launch, target_of, wait_for_producers
from k31c.lowering.triton.mla_dense_plan import block_cols, plan, tma_fits
from k31c.lowering.triton.mla_common import LOG2E, check_mla_args, merge_spec, merge_splits, table_width

OP = "k31c::dense_mla"
VARIANT = "split"          # the `Target.variant` name of this kernel (mla.py's: "one_pass")


@triton.jit
def _attend_keys(q_v, q_r, m_i, l_i, acc, cache_ptr, kv_desc, kr_desc, bt_row, start, stop, limit,
                 sel, len_m, scale_log2, stride_cb, stride_cs, BM: tl.constexpr,
                 BN: tl.constexpr, BLOCK_SIZE: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr,
                 BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, MASKED: tl.constexpr,
                 STAGES: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr):
    """Online softmax over key steps start, start + BN, .. < stop of one request. MASKED: keys at
    or past each M-row's length (and past `limit`, the longest) are excluded; unmasked steps lie
    below every selected row's length (only the row selection applies). TMA: the unmasked steps
    load their keys as two boxes (values and rope parts) through the descriptors instead of
    pointer tensors, which the R = 4 build spilled registers for (BENCHMARKS.md).

    Two things here are for Triton's layout choice, not for the math. A dot whose result reaches
    another dot is laid out with all warps along M; with 64 M-rows on 8 warps that makes both
    warp groups compute the same scores (the MMA work 1.53x the useful FLOPs). So the softmax sits
    in a branch that is always taken (`stop > start` inside the loop): a branch's results are
    not in the score dot's forward slice, and the score dots get [4, 2] warps (each warp group
    half of the keys). And the nope and rope score dots are scaled apart before they are added,
    so Triton does not fold them into one dot accumulating into the other (a chained pair)."""
    offs_n = tl.arange(0, BN)
    offs_v = tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, BLOCK_R)
    v_mask = offs_v < DV
    r_mask = offs_r < DR
    dt = q_v.dtype
    for j in tl.range(start, stop, BN, num_stages=STAGES):
        pos = j + offs_n
        if MASKED:
            in_range = pos < limit
        else:
            in_range = offs_n >= 0
        # a key in a -1 (unused) block is no key: its block reads as block 0, masked to zeros
        if TMA and not MASKED:   # one box a part; a -1 block's rows are negative: read as zeros
            blk = tl.load(bt_row + j // BLOCK_SIZE)
            ok = in_range & (blk >= 0)
            first = blk * BLOCK_SIZE + j % BLOCK_SIZE
            k_v = kv_desc.load([first, 0]).to(dt)
            if DR > 0:
                k_r = kr_desc.load([first, 0]).to(dt)
        elif BLOCK_SIZE % BN == 0:       # j is a multiple of BN: the BN keys are one block's rows
            blk = tl.load(bt_row + j // BLOCK_SIZE)
            ok = in_range & (blk >= 0)
            rows = (cache_ptr + tl.maximum(blk, 0).to(tl.int64) * stride_cb
                    + (j % BLOCK_SIZE + offs_n) * stride_cs)
        else:
            blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=in_range, other=-1)
            ok = in_range & (blk >= 0)
            rows = (cache_ptr + tl.maximum(blk, 0).to(tl.int64) * stride_cb
                    + (pos % BLOCK_SIZE) * stride_cs)
        if not (TMA and not MASKED):
            # keys past the longest row or in no block read as zeros (unwritten slots may hold
            # NaN, and p = 0 there must not meet one)
            k_v = tl.load(rows[:, None] + offs_v[None, :], mask=ok[:, None] & v_mask[None, :],
                          other=0.0).to(dt)
            if DR > 0:
                k_r = tl.load(rows[:, None] + DV + offs_r[None, :],
                              mask=ok[:, None] & r_mask[None, :], other=0.0).to(dt)
        if DR > 0:
            # both dots issued before either result is used: one wait for the pair
            s_r = tl.dot(q_r, tl.trans(k_r), input_precision=PRECISION)
            s_v = tl.dot(q_v, tl.trans(k_v), input_precision=PRECISION)
            s = s_v * scale_log2 + s_r * scale_log2
        else:
            s = tl.dot(q_v, tl.trans(k_v), input_precision=PRECISION) * scale_log2
        if stop > start:     # always true inside the loop (the docstring says why it is here)
            if MASKED:
                keep = sel[:, None] & ok[None, :] & (pos[None, :] < len_m[:, None])
            else:
                keep = sel[:, None] & ok[None, :]
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # no key yet: avoid inf - inf
            alpha = tl.exp2(m_i - m_use)
            p_f = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p_f, 1)
            p = p_f.to(dt)
        else:
            m_new = m_i
            alpha = tl.full([BM], 1.0, tl.float32)
            p = tl.zeros([BM, BN], dt)
        acc = acc * alpha[:, None]
        acc = tl.dot(p, k_v, acc, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _dense_split_kernel(q_ptr, cache_ptr, kv_desc, kr_desc, bt_ptr, row_req_ptr, row_len_ptr,
                        out_ptr, lse_ptr, n_rows, n_heads, n_req, keys_per_split, scale_log2,
                        stride_qn, stride_qh, stride_cb, stride_cs, stride_btb,
                        stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                        G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr,
                        BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, PASSES: tl.constexpr,
                        STAGES: tl.constexpr, TAIL_STAGES: tl.constexpr, FINAL: tl.constexpr,
                        PRECISION: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    tile = tl.program_id(0)
    split = tl.program_id(1)
    group = tl.program_id(2)

    # the tile's M-rows: (query row t, head h) pairs of the group
    m_idx = tl.arange(0, BM)
    mm = tile * BM + m_idx
    t = group * G + mm // n_heads
    h = mm % n_heads
    m_real = (mm < G * n_heads) & (t < n_rows)
    b_m = tl.load(row_req_ptr + t, mask=m_real, other=-1)
    len_m = tl.load(row_len_ptr + t, mask=m_real, other=0)
    todo = m_real & (b_m >= 0) & (b_m < n_req)        # a request outside the table reads nothing

    offs_v = tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, BLOCK_R)
    q_rows = q_ptr + t.to(tl.int64) * stride_qn + h * stride_qh
    q_v = tl.load(q_rows[:, None] + offs_v[None, :],
                  mask=m_real[:, None] & (offs_v < DV)[None, :], other=0.0)
    if DR > 0:
        q_r = tl.load(q_rows[:, None] + DV + offs_r[None, :],
                      mask=m_real[:, None] & (offs_r < DR)[None, :], other=0.0)
    else:
        q_r = q_v                                        # unused

    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BLOCK_V], tl.float32)
    lo = split * keys_per_split
    for _ in range(PASSES):
        # the request of the first M-row not yet done, and every M-row of that request
        first = tl.min(tl.where(todo, m_idx, BM), 0)
        b = tl.max(tl.where(m_idx == first, b_m, -1), 0)
        sel = todo & (b_m == b)
        hi = tl.minimum(lo + keys_per_split, tl.max(tl.where(sel, len_m, 0), 0))
        # full steps below the shortest selected row need no length masks
        shortest = tl.min(tl.where(sel, len_m, 2147483647), 0)
        full_end = tl.maximum(lo + (tl.minimum(hi, shortest) - lo) // BN * BN, lo)
        bt_row = bt_ptr + tl.maximum(b, 0).to(tl.int64) * stride_btb
        m_i, l_i, acc = _attend_keys(q_v, q_r, m_i, l_i, acc, cache_ptr, kv_desc, kr_desc, bt_row,
                                     lo, full_end, hi, sel, len_m, scale_log2, stride_cb, stride_cs,
                                     BM, BN, BLOCK_SIZE, DV, DR, BLOCK_V, BLOCK_R, False, STAGES,
                                     PRECISION, TMA)
        m_i, l_i, acc = _attend_keys(q_v, q_r, m_i, l_i, acc, cache_ptr, kv_desc, kr_desc, bt_row,
                                     full_end, hi, hi, sel, len_m, scale_log2, stride_cb, stride_cs,
                                     BM, BN, BLOCK_SIZE, DV, DR, BLOCK_V, BLOCK_R, True, TAIL_STAGES,
                                     PRECISION, False)
        todo = todo & (sel == 0)

    has_key = l_i > 0.0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = (m_i + tl.log2(tl.where(has_key, l_i, 1.0))) / 1.4426950408889634
    if FINAL:
        lse = tl.where(has_key, lse, float("inf"))
    else:
        lse = tl.where(has_key, lse, float("-inf"))        # empty split: zero weight in the merge
    row_off = split.to(tl.int64) * stride_os + t.to(tl.int64) * stride_on + h * stride_oh
    tl.store(out_ptr + row_off[:, None] + offs_v[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_real[:, None] & (offs_v < DV)[None, :])
    tl.store(lse_ptr + split.to(tl.int64) * stride_ls + t.to(tl.int64) * stride_ln + h, lse,
             mask=m_real)


# ---- launch ------------------------------------------------------------------------------------

_SMALLER_STEP: dict = {}  # (device, row columns, element bytes) -> key step that fit, where the
                          # planned one did not


def _constexprs(cfg: dict, dv: int, width: int, block_size: int, final: bool,
                precision: str, tma: bool) -> dict:
    return dict(G=cfg["group"], BM=cfg["bm"], BN=cfg["bn"], BLOCK_SIZE=block_size, DV=dv,
                DR=width - dv, BLOCK_V=max(16, triton.next_power_of_2(dv)),      # tl.dot: K >= 16
                BLOCK_R=max(16, triton.next_power_of_2(max(width - dv, 1))),
                PASSES=cfg["passes"], STAGES=cfg["num_stages"], TAIL_STAGES=cfg["tail_stages"],
                FINAL=final, PRECISION=precision, TMA=tma)


def key_descriptors(latent_cache: torch.Tensor, dv: int, bn: int):
    """TMA descriptors of the values part [rows, dv] and the rope part [rows, width - dv] of the
    cache, one [BN, part] box per key step."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    blocks, block_size, width = latent_cache.shape
    rows = blocks * block_size
    flat = latent_cache.view(rows, width)
    return (TensorDescriptor(flat, [rows, dv], [width, 1], [bn, dv]),
            TensorDescriptor(flat[:, dv:], [rows, width - dv], [width, 1], [bn, width - dv]))


def launch(q, latent_cache, block_table, row_req, row_len, sm_scale, dv, config=None,
           stats: dict | None = None):
    """Dense MLA over every position below row_len, on checked arguments. `config` overrides the
    launch plan (tuning, tests); `stats`, when given, receives the plan and the compiled kernel's
    registers / spills / shared memory (GPU only)."""
    n, n_heads, width = q.shape
    n_req, max_blocks = block_table.shape
    block_size = latent_cache.shape[1]
    capacity = max_blocks * block_size
    cols = block_cols(width, dv)
    fit_key = (q.device, cols, q.element_size())
    if fit_key in _SMALLER_STEP and not (config and "bn" in config):
        config = {**(config or {}), "bn": _SMALLER_STEP[fit_key]}
    cfg = plan(target_of(q.device), n, n_heads, n_req, capacity, config, cols=cols,
               elem=q.element_size())
    splits, bn = cfg["splits"], cfg["bn"]
    keys_per_split = triton.cdiv(triton.cdiv(capacity, splits), bn) * bn   # a multiple of BN
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
    tma = cfg["tma"] and latent_cache.data_ptr() % 16 == 0 and tma_fits(
        width, dv, block_size, bn, q.element_size(), latent_cache.stride(1), latent_cache.stride(0))
    kv_desc, kr_desc = key_descriptors(latent_cache, dv, bn) if tma else (latent_cache, latent_cache)
    try:
        compiled = _dense_split_kernel[(cfg["tiles"], splits, cfg["groups"])](
            q, latent_cache, kv_desc, kr_desc, block_table, row_req, row_len, part, part_lse,
            n, n_heads, n_req, keys_per_split, float(sm_scale) * LOG2E,
            q.stride(0), q.stride(1), latent_cache.stride(0), latent_cache.stride(1),
            block_table.stride(0),
            part.stride(0), part.stride(1), part.stride(2), part_lse.stride(0), part_lse.stride(1),
            **_constexprs(cfg, dv, width, block_size, final, precision, tma),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(q.device))
    except triton.runtime.errors.OutOfResources:
        # shared_bytes under-estimated this Triton's layout: half the key step, and remember it
        # for these tiles (the launch raises before anything is enqueued)
        if (config and "bn" in config) or bn <= 16:
            raise
        _SMALLER_STEP[fit_key] = bn // 2
        return launch(q, latent_cache, block_table, row_req, row_len, sm_scale, dv, config, stats)
    if stats is not None:
        stats.update(cfg, tma_used=tma)
        if compiled is not None:
            stats.update(regs=getattr(compiled, "n_regs", None),
                         spills=getattr(compiled, "n_spills", None),
                         shared=getattr(compiled.metadata, "shared", None))
    if not final:
        merge_splits(part, part_lse, out, lse)
    return out, lse


def check_dense(q, latent_cache, block_table, row_req, row_len, dv) -> None:
    check_mla_args(q, latent_cache, block_table, row_req, dv, row_len, "row_len")
    if row_len.dim() != 1:
        raise ValueError(f"row_len: expected int32 [N], got {tuple(row_len.shape)}")


@register(OP, targets_running(OP, VARIANT))
def dense_mla(q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor,
              row_req: torch.Tensor, row_len: torch.Tensor, sm_scale: float,
              dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`k31c::dense_mla`. A cache of FP8 latent rows (uint8, the 656-byte layout) is read by
    mla.py's one-pass kernel, which dequantises them on chip; this kernel reads float rows."""
    if latent_cache.dtype == torch.uint8:
        from k31c.lowering.triton import mla
        return mla.dense_mla(q, latent_cache, block_table, row_req, row_len, sm_scale, dv)
    check_dense(q, latent_cache, block_table, row_req, row_len, dv)
    return launch(q, latent_cache, block_table, row_req, row_len, sm_scale, dv)


def aot_specs(shapes) -> list:
    """The launches of the launcher on the GPU at `shapes` (aot_spec.AotShapes): for each row
    count per request, the attention kernel with one split (output written directly) and with
    several (partials), and the merge; tiles from `plan`'s GPU defaults."""
    cfg = shapes.cfg
    dt, heads, width, dv = cfg.torch_dtype, cfg.num_attention_heads, cfg.latent_dim, cfg.kv_lora_rank
    i32, f32 = torch.int32, torch.float32
    precision = shapes.target.dot_precision(dt != torch.float32)
    specs = []
    for r in shapes.rows_per_request:
        n = shapes.batch * r
        for splits in (1, 2):
            p = plan(shapes.target, n, heads, shapes.batch, shapes.context, {"splits": splits},
                     small=False, cols=block_cols(width, dv), elem=dt.itemsize)
            final = splits == 1
            bs, table = shapes.block_size, table_width(shapes)
            tma = p["tma"] and tma_fits(width, dv, bs, p["bn"], dt.itemsize, width, bs * width)
            descs = ((descriptor_type(dt, (p["bn"], dv)), descriptor_type(dt, (p["bn"], width - dv)))
                     if tma else (dt, dt))
            # the launch's integers: q [n, heads, width], cache [blocks, bs, width], the
            # partials [splits, n, heads, dv] (the output, unsqueezed, when final)
            ints = dict(n_rows=n, n_heads=heads, n_req=shapes.batch,
                        keys_per_split=triton.cdiv(triton.cdiv(table * bs, splits), p["bn"]) * p["bn"],
                        stride_qn=heads * width, stride_qh=width, stride_cb=bs * width, stride_cs=width,
                        stride_btb=table, stride_os=n * heads * dv, stride_on=heads * dv, stride_oh=dv,
                        stride_ls=n * heads, stride_ln=heads)
            specs.append(kernel_spec(
                _dense_split_kernel, OP, f"R={r},{'final' if final else 'split'}",
                _constexprs(p, dv, width, shapes.block_size, final, precision, tma),
                dict(q_ptr=dt, cache_ptr=dt, kv_desc=descs[0], kr_desc=descs[1], bt_ptr=i32,
                     row_req_ptr=i32, row_len_ptr=i32,
                     out_ptr=dt if final else f32, lse_ptr=f32, scale_log2="fp32"),
                num_warps=p["num_warps"], num_stages=p["num_stages"], ints=ints))
    specs.append(merge_spec(OP, dv, dt, shapes.batch, heads, 2))
    return specs
