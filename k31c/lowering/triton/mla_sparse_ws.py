"""Warp-specialized one-pass kernel for `k31c::sparse_mla` on sm_90a (Gluon), the h200 choice:
the registered launcher. bf16 latent rows in cache blocks of a power of two go to the
half-release seesaw over 64-key blocks (mla_sparse_half.py, faster there); FP8 latent rows, and
bf16 rows in blocks of other sizes, run the 32-key seesaw below.

One program per (query row, 64-head tile); a row's tiles are adjacent programs, so the second
finds the row's gathered latent rows in L2. The row's selected keys go in pairs of 32-key blocks
(a, b). Inside a program, three warp groups:

- a producer (4 warps, 56 registers; `mla_sparse_gather.gather`) turns the row's selected
  positions into cache rows (block table; the lookups run ahead of the copies) and gathers each
  block with 16-byte cp.async into one of four [32, 576] shared buffers (a -1 position and the
  tail past k are zero-filled): the next pair is in flight while this one is computed, and each
  row is read once for both products. FP8 latent rows land as e4m3 in the upper half of the
  value buffer, and the math group that scores the block dequantises it in place first (to
  f16: FP8 rows run the latent products in f16, `mla_seesaw.FP8_Q_MUL`);
- two math warp groups in a seesaw: group 0 scores block a, group 1 block b (wgmmas of the 64
  heads against the block's 32 keys, q from shared memory), at the same time. Group 0 takes its
  row max, stores its P over block a's rope part (dead once scored) with the max, and signals;
  group 1 takes the running max from it, does the same for block b and signals back. Each
  group then accumulates both blocks' values into its half of the output columns
  ([64, 256] fp32, K = 32 wgmmas), rescaling when the max moves; each sums the P of its own
  blocks, and the two sums are added at the end. One group's softmax runs under the other's
  wgmmas.
  The seesaw step, the buffers and the row sums are `mla_seesaw.py`'s (the dense kernel,
  mla_dense_ws_kernel.py, shares the step and the row sums over its own chunked buffers).

q is loaded once with masked pointer loads (heads past the last are zero rows); out and lse go
out with masked stores. Masked keys get -inf; a row with no key yet keeps 0 weights; a row with
no key gives out = 0 and lse = +inf (the reference's rule).

Where the (row, tile) programs leave SMs idle (a decode step of few rows), each also takes a
split of the keys (`plan_splits`: one wave, at least 4 pairs a split) and writes fp32 partials
that `mla_common.merge_splits` combines by LSE.

Triton's own pipeliner cannot do this: it warp-specializes on Hopper only around TMA-descriptor
loads, and the rows here are gathered (BENCHMARKS.md, "Sparse MLA, warp-specialized in Gluon":
the measurements and the forms that lost). Cases this kernel does not take go to the two-pass
kernel (`why_two_pass` names the reason): another dtype or width, a strided layout, a GPU
other than sm_90, no Gluon.
"""
from __future__ import annotations

import torch

from k31c.lowering.aot_spec import kernel_spec
from k31c.lowering.registry import register
from k31c.lowering.targets import targets_running
from k31c.lowering.triton import mla_sparse_half as half
from k31c.lowering.triton import mla_two_pass as two_pass
from k31c.lowering.triton.device import target_of
from k31c.lowering.triton.gluon_sm90 import GLUON_ERROR, why_not_sm90
from k31c.lowering.triton.mla_common import (fp8_latent_views, key_splits, merge_spec,
                                             merge_splits, sparse_outputs, split_outputs,
                                             split_width, table_width)
from k31c.lowering.triton.mla_seesaw import DV, WIDTH, latent_reason, scores_scale_log2

if GLUON_ERROR is None:
    from k31c.lowering.triton.gluon_sm90 import gl, gluon, mbarrier, warpgroup_mma
    from k31c.lowering.triton.mla_sparse_gather import dequant_block, fp8_scales, gather
    from k31c.lowering.triton.mla_seesaw import (BK, NB, O_L, ROW_O, ROW_S, S_L, pair_views,
                                                 Q_MUL_FP8, row_sums, seesaw_buffers, seesaw_pair,
                                                 store_q)

HEADS_TILE = 64                     # one wgmma M: the heads a program takes
KEYS_STEP = 64                      # selected rows a pair of blocks holds (a split's unit)
MIN_SPLIT_STEPS = 4                 # pairs a split takes at least (its q load and first
                                    # gather amortised)
NUM_WARPS = 4                       # the default partition (the producer); 12 warps in all


if GLUON_ERROR is None:
    MATH_REGS = gl.constexpr(224)       # each math warp group's registers (no spill); the
                                        # producer runs on what is left (56)

    @gluon.jit
    def _half(ROLE: gl.constexpr, qv_smem, qr_smem, kv_bufs, kr_bufs, ready, empty, p_bar, fin,
              m_a, m_b, l_a, l_b, idx_row, n_keys, n_pairs, scale_log2, out_ptr, lse_ptr, head0,
              n_heads, empty_lse, scl_bufs, DEQUANT: gl.constexpr):
        # one math warp group: the scores of block 2j + ROLE of pair j, the values' columns
        # [256 ROLE, 256 ROLE + 256) of both blocks; the other group's P and running max come
        # through shared memory (p_bar: group 0's of block a, group 1's of block b)
        m_i = gl.full([64], float("-inf"), gl.float32, ROW_S)
        l_i = gl.zeros([64], gl.float32, ROW_S)
        acc = gl.zeros([64, 256], gl.float32, O_L)
        zero_s = gl.zeros([64, BK], gl.float32, S_L)
        key = gl.arange(0, BK, gl.SliceLayout(0, S_L))
        col0: gl.constexpr = ROLE * 256
        kidx = ROLE * BK + key
        keep = gl.load(idx_row + kidx, mask=kidx < n_keys, other=-1) >= 0
        for j in range(n_pairs):
            ph = j & 1                                  # the pair's exchange barriers
            ph_ready = (j // (NB // 2)) & 1             # its buffers' fills
            # q through an index the compiler cannot prove constant (always 0): its loop-invariant
            # wgmma descriptors would be hoisted out of the loop and spill
            zr = j // (n_pairs + 1)
            ba = (j % (NB // 2)) * 2                    # the pair's buffers: ba (a), ba + 1 (b)
            views = pair_views(ROLE, kv_bufs, kr_bufs, ba)
            kr = kr_bufs.index(ba + ROLE)
            kv = kv_bufs.index(ba + ROLE)
            mbarrier.wait(ready.index(ba + ROLE), ph_ready)
            if DEQUANT:             # FP8 rows: this group's block, staged as e4m3
                dequant_block(ba + ROLE, kv_bufs, scl_bufs)
            s = warpgroup_mma(qr_smem.index(zr), kr.permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)
            s = warpgroup_mma(qv_smem.index(zr), kv.permute((1, 0)), s, is_async=True)
            nxt = (2 * j + 2 + ROLE) * BK + key
            keep_next = gl.load(idx_row + nxt, mask=nxt < n_keys, other=-1) >= 0
            m_i, l_i, acc = seesaw_pair(ROLE, s, gl.expand_dims(keep, 0), m_i, l_i, acc, views,
                                        kv_bufs, ba, m_a, m_b, p_bar, empty, ph, scale_log2,
                                        False, False, 0, 0, False)
            keep = keep_next
        out, l_i, has = row_sums(ROLE, l_i, acc, l_a, l_b, fin)      # out 0 where no key
        h_o = head0 + gl.arange(0, 64, ROW_O)
        c_o = col0 + gl.arange(0, 256, gl.SliceLayout(0, O_L))
        o_mask = gl.expand_dims(h_o < n_heads, 1) & gl.expand_dims(c_o >= 0, 0)
        gl.store(out_ptr + gl.expand_dims(h_o * 512, 1) + gl.expand_dims(c_o, 0),
                 out.to(out_ptr.dtype.element_ty), mask=o_mask)
        if ROLE == 0:
            h_s = head0 + gl.arange(0, 64, ROW_S)
            lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453,
                           empty_lse)
            gl.store(lse_ptr + h_s, lse, mask=h_s < n_heads)

    @gluon.jit
    def _half0(qv_smem, qr_smem, kv_bufs, kr_bufs, ready, empty, p_bar, fin, m_a, m_b, l_a, l_b,
               idx_row, n_keys, n_pairs, scale_log2, out_ptr, lse_ptr, head0, n_heads, empty_lse,
               scl_bufs, DEQUANT: gl.constexpr):
        _half(0, qv_smem, qr_smem, kv_bufs, kr_bufs, ready, empty, p_bar, fin, m_a, m_b, l_a, l_b,
              idx_row, n_keys, n_pairs, scale_log2, out_ptr, lse_ptr, head0, n_heads, empty_lse,
              scl_bufs, DEQUANT)

    @gluon.jit
    def _half1(qv_smem, qr_smem, kv_bufs, kr_bufs, ready, empty, p_bar, fin, m_a, m_b, l_a, l_b,
               idx_row, n_keys, n_pairs, scale_log2, out_ptr, lse_ptr, head0, n_heads, empty_lse,
               scl_bufs, DEQUANT: gl.constexpr):
        _half(1, qv_smem, qr_smem, kv_bufs, kr_bufs, ready, empty, p_bar, fin, m_a, m_b, l_a, l_b,
              idx_row, n_keys, n_pairs, scale_log2, out_ptr, lse_ptr, head0, n_heads, empty_lse,
              scl_bufs, DEQUANT)

    @gluon.jit
    def _sparse_ws_kernel(q_ptr, cache_ptr, scale_ptr, rope_ptr, table_ptr, req_ptr, idx_ptr,
                          out_ptr, lse_ptr, n_rows, n_heads, n_tiles, n_keys, n_splits,
                          keys_per_split, block_size, stride_qn, stride_qh, stride_in, stride_bt,
                          scale_log2, empty_lse, FP8: gl.constexpr, num_warps: gl.constexpr):
        # FP8: cache_ptr, scale_ptr and rope_ptr are uint8, fp32 and bf16 views of FP8 latent
        # rows (else all three the bf16 cache)
        pid = gl.program_id(0)
        tile = pid % n_tiles
        split = (pid // n_tiles) % n_splits
        t = pid // (n_tiles * n_splits)
        head0 = tile * 64
        (qv_smem, qr_smem, kv_bufs, kr_bufs, m_a, m_b, l_a, l_b, ready, empty, p_bar,
         fin) = seesaw_buffers(128, gl.float16 if FP8 else gl.bfloat16)
        Q_L: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [num_warps, 1], [1, 0])
        h = head0 + gl.arange(0, 64, gl.SliceLayout(1, Q_L))
        c = gl.arange(0, 64, gl.SliceLayout(0, Q_L))
        q_mask = gl.expand_dims(h < n_heads, 1) & gl.expand_dims(c >= 0, 0)
        q_at = (q_ptr + t.to(gl.int64) * stride_qn + gl.expand_dims(h * stride_qh, 1)
                + gl.expand_dims(c, 0))
        store_q(qv_smem, qr_smem, q_at, q_mask, Q_MUL_FP8 if FP8 else 1.0)
        idx_row = idx_ptr + t.to(gl.int64) * stride_in + split * keys_per_split
        n_here = gl.maximum(gl.minimum(keys_per_split, n_keys - split * keys_per_split), 0)
        table_row = table_ptr + gl.load(req_ptr + t).to(gl.int64) * stride_bt
        n_pairs = gl.cdiv(n_here, 2 * BK)
        row_out = (split.to(gl.int64) * n_rows + t) * n_heads
        args = (qv_smem, qr_smem, kv_bufs, kr_bufs, ready, empty, p_bar, fin, m_a, m_b, l_a, l_b,
                idx_row, n_here, n_pairs, scale_log2, out_ptr + row_out * 512, lse_ptr + row_out,
                head0, n_heads, empty_lse)
        scl_bufs = fp8_scales() if FP8 else kr_bufs         # (bf16: a placeholder, unused)
        math_args = args + (scl_bufs, FP8)
        gl.warp_specialize([
            (gather, (cache_ptr, scale_ptr, rope_ptr, table_row, idx_row, n_here, block_size,
                      kv_bufs, kr_bufs, scl_bufs, ready, empty, 2 * n_pairs, FP8)),
            (_half0, math_args),
            (_half1, math_args)],
            [4, 4], [MATH_REGS, MATH_REGS])


def plan_splits(n_rows: int, n_heads: int, n_keys: int, sm_count: int) -> int:
    """Key splits a (row, head tile) takes: as many as keep every program on an SM of its own
    (one wave), each at least MIN_SPLIT_STEPS steps; 1 when the programs alone fill the SMs.
    Splits write fp32 partials that `merge_splits` combines by LSE."""
    return key_splits(n_rows * -(-n_heads // HEADS_TILE), n_keys, KEYS_STEP, MIN_SPLIT_STEPS, sm_count)


def split_keys(n_keys: int, splits: int) -> int:
    """Keys a split takes: a whole number of 64-key steps (the kernel's split boundaries)."""
    return split_width(n_keys, splits, KEYS_STEP)


def why_two_pass(q: torch.Tensor, latent_cache: torch.Tensor, indices: torch.Tensor,
                 dv: int) -> str | None:
    """Why this call goes to the two-pass kernel, or None when this kernel takes it."""
    return why_not_sm90(q.device) or _why_not_these_args(q, latent_cache, indices, dv)


def _why_not_these_args(q, latent_cache, indices, dv) -> str | None:
    """The reasons `why_two_pass` finds in the arguments' dtypes, widths and layouts alone (and
    in this Triton), which the compiler's report can tell before anything runs."""
    reason = latent_reason(q, latent_cache, dv, fp8=True)
    if reason is not None:
        return reason
    if not latent_cache.is_contiguous() or q.stride(2) != 1 or indices.stride(1) != 1:
        return "a cache, q or indices layout with strided rows"
    return None


def runs(q, latent_cache, block_table, row_req, indices, sm_scale, dv):
    """The launcher that runs a call with these arguments on an H200 (the registry's `runs`: the
    report names the two-pass kernel or the half-release seesaw where this one hands the call
    to it)."""
    if _why_not_these_args(q, latent_cache, indices, dv):
        return two_pass.sparse_mla
    return half.sparse_mla if half.why_not(latent_cache) is None else sparse_mla


@register("k31c::sparse_mla", targets_running("k31c::sparse_mla", "warp_specialized"),
          runs=runs)
def sparse_mla(q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor,
               row_req: torch.Tensor, indices: torch.Tensor, sm_scale: float,
               dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    two_pass.check_sparse(q, latent_cache, block_table, row_req, indices, dv)
    if why_two_pass(q, latent_cache, indices, dv) is not None:
        return two_pass.sparse_mla(q, latent_cache, block_table, row_req, indices, sm_scale, dv)
    if half.why_not(latent_cache) is None:
        return half.launch(q, latent_cache, block_table, row_req, indices, sm_scale)
    return launch(q, latent_cache, block_table, row_req, indices, sm_scale)


def launch(q, latent_cache, block_table, row_req, indices, sm_scale, splits: int | None = None):
    """This kernel's launch (callers check `why_two_pass` first); `splits` overrides
    `plan_splits` (tests, benchmarks)."""
    n, n_heads, _ = q.shape
    n_keys = indices.shape[1]
    out, lse, done = sparse_outputs(q, n_keys, DV)
    if done:
        return out, lse
    n_tiles = -(-n_heads // HEADS_TILE)
    if splits is None:
        splits = plan_splits(n, n_heads, n_keys, target_of(q.device).sm_count)
    per_split = split_keys(n_keys, splits)
    dst, dst_lse, empty_lse = split_outputs(out, lse, splits)
    fp8 = latent_cache.dtype == torch.uint8
    _sparse_ws_kernel[(n * n_tiles * splits,)](
        q, *fp8_latent_views(latent_cache), block_table, row_req, indices, dst, dst_lse, n,
        n_heads, n_tiles, n_keys, splits, per_split, latent_cache.shape[1], q.stride(0),
        q.stride(1), indices.stride(0), block_table.stride(0), scores_scale_log2(sm_scale, fp8),
        empty_lse, FP8=fp8, num_warps=NUM_WARPS)
    if splits > 1:
        merge_splits(dst, dst_lse, out, lse)
    return out, lse


def aot_specs(shapes) -> list:
    """The launches at `shapes` (aot_spec.AotShapes) for FP8 latent rows and a bf16 cache (the
    half-release seesaw's, where it takes the shapes' cache blocks): one split and the key
    splits of a one-row decode with their merge, for the ahead-of-time build."""
    cfg = shapes.cfg
    heads, k, dt = cfg.num_attention_heads, cfg.index_topk, cfg.torch_dtype
    n_tiles, sm = -(-heads // HEADS_TILE), shapes.target.sm_count
    bf16_half = half.block_size_reason(shapes.block_size) is None
    specs = half.aot_specs(shapes) if bf16_half else []
    caches = {True: dict(cache_ptr=torch.uint8, scale_ptr=torch.float32, rope_ptr=dt)}
    if not bf16_half:
        caches[False] = dict(cache_ptr=dt, scale_ptr=dt, rope_ptr=dt)
    for rows in sorted({shapes.batch * r for r in shapes.rows_per_request}):
        splits = plan_splits(rows, heads, k, sm)
        per_split = split_keys(k, splits)
        ints = dict(n_rows=rows, n_heads=heads, n_tiles=n_tiles, n_keys=k, n_splits=splits,
                    keys_per_split=per_split, block_size=shapes.block_size, stride_qn=heads * WIDTH,
                    stride_qh=WIDTH, stride_in=k, stride_bt=table_width(shapes))
        for fp8, cache in caches.items():
            specs.append(kernel_spec(
                _sparse_ws_kernel, "k31c::sparse_mla",
                f"{'fp8,' if fp8 else ''}rows={rows},splits={splits}",
                dict(FP8=fp8, num_warps=NUM_WARPS),
                dict(q_ptr=dt, **cache, table_ptr=torch.int32, req_ptr=torch.int32,
                     idx_ptr=torch.int32, out_ptr=dt if splits == 1 else torch.float32,
                     lse_ptr=torch.float32, scale_log2="fp32", empty_lse="fp32"),
                num_warps=NUM_WARPS, ints=ints))
        if splits > 1:
            specs.append(merge_spec("k31c::sparse_mla", DV, dt, rows, heads, splits))
    return specs
