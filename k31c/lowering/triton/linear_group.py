"""Triton kernel for `k31c::linear_group`: the projections that read one x, as one GEMV launch.

One program computes a [BM, BN] tile of one weight's output: the grid's first axis runs over
every weight's column blocks back to back (segment s owns blocks [S_s, S_{s+1})), so the weights
stream through the SMs in one launch with no split-K reduction and no launch between them. A
program loops over the whole K, `tl.dot` on x [BM, BK] and the weight tile [BN, BK] (BM >= 16:
the MMA's minimum; rows past M are masked). Up to 8 weights a launch; longer lists take several.

Rows past `MAX_GEMV_ROWS` (prefill chunks) are a GEMM, not a GEMV: each weight is then one
cuBLAS matmul (`torch.mm`), as the dense code generator would have run it; the kernel would
re-read every weight once per 64 rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k31c.graph.ops.linear import check_linear_group
from k31c.lowering.aot_spec import kernel_spec
from k31c.lowering.registry import register
from k31c.lowering.targets import GPU_TARGETS
from k31c.lowering.triton.device import interpreting, pdl_launch, target_of, upcast_dots, wait_for_producers

MAX_SEGMENTS = 8
MAX_GEMV_ROWS = 64
# of the target's shared memory a program may use, what the pipeline's stages may not take:
# Triton's own scratch beside them (on sm_90 the stages get 192 KB of 227: the bf16 tiles' 4)
SCRATCH_BYTES = 35 << 10


@triton.jit
def _linear_group_kernel(x_ptr, w0_ptr, w1_ptr, w2_ptr, w3_ptr, w4_ptr, w5_ptr, w6_ptr, w7_ptr,
                         y0_ptr, y1_ptr, y2_ptr, y3_ptr, y4_ptr, y5_ptr, y6_ptr, y7_ptr,
                         n0, n1, n2, n3, n4, n5, n6, n7, M, K, stride_xm,
                         S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr, S4: tl.constexpr,
                         S5: tl.constexpr, S6: tl.constexpr, S7: tl.constexpr,
                         NSEG: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    pid = tl.program_id(0)
    # the segment of this block: the last one whose first block is <= pid
    w_ptr, y_ptr, n, local = w0_ptr, y0_ptr, n0, pid
    if NSEG > 1:
        if pid >= S1:
            w_ptr, y_ptr, n, local = w1_ptr, y1_ptr, n1, pid - S1
    if NSEG > 2:
        if pid >= S2:
            w_ptr, y_ptr, n, local = w2_ptr, y2_ptr, n2, pid - S2
    if NSEG > 3:
        if pid >= S3:
            w_ptr, y_ptr, n, local = w3_ptr, y3_ptr, n3, pid - S3
    if NSEG > 4:
        if pid >= S4:
            w_ptr, y_ptr, n, local = w4_ptr, y4_ptr, n4, pid - S4
    if NSEG > 5:
        if pid >= S5:
            w_ptr, y_ptr, n, local = w5_ptr, y5_ptr, n5, pid - S5
    if NSEG > 6:
        if pid >= S6:
            w_ptr, y_ptr, n, local = w6_ptr, y6_ptr, n6, pid - S6
    if NSEG > 7:
        if pid >= S7:
            w_ptr, y_ptr, n, local = w7_ptr, y7_ptr, n7, pid - S7
    rn = local * BN + tl.arange(0, BN)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    rk = tl.arange(0, BK)
    n_mask, m_mask = rn < n, rm < M
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        k_mask = (k + rk) < K
        w = tl.load(w_rows + (k + rk)[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_rows + (k + rk)[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:     # device.upcast_dots
            w, x = w.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * n + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def plan(m: int, total_n: int, k: int, small: bool | None = None, elem: int = 2,
         shared: int = 0) -> dict:
    """Tile sizes: BM the rows (16, 32 or 64), BN/BK by the width of the group and K (wide groups:
    64-column tiles, 32 when K is short; narrower ones: 32 or 16 columns, so the grid still
    covers the SMs); BK at most K rounded up to a power of two, and with `elem`-byte operands
    as many pipeline stages as fit `shared` (the target's `shared_memory`; 0: not stated, no
    cap) less `SCRATCH_BYTES`. bench_linear.py --sweep measures the alternatives."""
    small = interpreting() if small is None else small
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    if small:   # the interpreter pays per operation, not per element: few, large tiles
        return dict(BM=bm, BN=64, BK=128, num_warps=4, num_stages=1)
    bn, bk, stages = _tiles(bm, total_n, k)
    bk = min(bk, max(16, triton.next_power_of_2(k)))
    if shared:
        stages = max(1, min(stages, (shared - SCRATCH_BYTES) // ((bm + bn) * bk * elem)))
    return dict(BM=bm, BN=bn, BK=bk, num_warps=4, num_stages=stages)


def _tiles(bm: int, total_n: int, k: int) -> tuple[int, int, int]:
    """(BN, BK, stages) for 2-byte operands, as measured on the H200."""
    stages = 4 if bm == 16 else 3
    if total_n > 4096 and 1024 < k <= 2048:   # short K: 32-column tiles, more programs stream it
        bn, bk, stages = 32, 128, 3
    elif total_n > 4096:
        bn, bk = 64, 128 if bm > 16 else 256
    elif total_n >= 2048:
        bn, bk = 32, 512 if bm <= 16 else 128
    else:
        bn, bk = 16, 512 if bm == 16 else 128
    return bn, bk, stages


def _segment_starts(widths: list[int], bn: int) -> list[int]:
    """First block of each segment after the first, padded to 7 (unused: past the grid)."""
    starts, total = [], 0
    for n in widths[:-1]:
        total += triton.cdiv(n, bn)
        starts.append(total)
    return starts + [1 << 30] * (MAX_SEGMENTS - 1 - len(starts))


def _launch(x: torch.Tensor, weights: list[torch.Tensor], outs: list[torch.Tensor], p: dict) -> None:
    m, k = x.shape
    widths = [w.shape[0] for w in weights]
    blocks = sum(triton.cdiv(n, p["BN"]) for n in widths)
    pad = MAX_SEGMENTS - len(weights)
    starts = _segment_starts(widths, p["BN"])
    # an absent segment's weight and output pointers: x (never dereferenced)
    _linear_group_kernel[(blocks, triton.cdiv(m, p["BM"]))](
        x, *weights, *[x] * pad, *outs, *[x] * pad, *widths, *[0] * pad, m, k, x.stride(0),
        **{f"S{i + 1}": s for i, s in enumerate(starts)}, NSEG=len(weights),
        BM=p["BM"], BN=p["BN"], BK=p["BK"],
        PRECISION=target_of(x.device).dot_precision(fast=x.dtype != torch.float32),
        UPCAST=upcast_dots(x.dtype), num_warps=p["num_warps"], num_stages=p["num_stages"],
        **pdl_launch(x.device))


@register("k31c::linear_group", GPU_TARGETS)
def linear_group(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    return launch(x, weights)


def launch(x: torch.Tensor, weights: list[torch.Tensor], config: dict | None = None) -> list[torch.Tensor]:
    """`k31c::linear_group`; `config` overrides the tiles of `plan` (tuning, benchmarks)."""
    check_linear_group(x, weights)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m = x2.shape[0]
    weights = [w if w.stride(1) == 1 and w.stride(0) == k else w.contiguous() for w in weights]
    outs = [x2.new_empty((m, w.shape[0])) for w in weights]
    if m > MAX_GEMV_ROWS:
        for w, y in zip(weights, outs):
            torch.mm(x2, w.t(), out=y)
    elif k == 0:
        for y in outs:
            y.zero_()
    elif m > 0:
        p = {**tiles(x2, sum(w.shape[0] for w in weights)), **(config or {})}
        for i in range(0, len(weights), MAX_SEGMENTS):
            live = [j for j in range(i, min(i + MAX_SEGMENTS, len(weights))) if weights[j].shape[0]]
            if live:
                _launch(x2, [weights[j] for j in live], [outs[j] for j in live], p)
    return [y.view(*lead, y.shape[-1]) for y in outs]


def tiles(x2: torch.Tensor, total_n: int) -> dict:
    """The tiles `launch` takes for rows `x2` [m, k] against `total_n` weight rows: `plan` at the
    operands' element size and the shared memory of `x2`'s device's target."""
    return plan(x2.shape[0], total_n, x2.shape[-1], elem=x2.element_size(),
                shared=target_of(x2.device).shared_memory)


def aot_specs(shapes) -> list:
    """The launch of a KDA layer's input projections (q, k, v, f_a, b, g: the widest group a
    K3.1 decode step makes) at `shapes.batch` rows, tiles from `plan`."""
    cfg = shapes.cfg
    width = cfg.kda_num_heads * cfg.kda_head_dim
    widths = [width, width, width, cfg.kda_head_dim, cfg.kda_num_heads, width]
    return [group_spec(shapes.target, shapes.batch, widths, cfg.hidden_size, cfg.torch_dtype, "kda_in")]


def group_spec(target, m: int, widths: list[int], k: int, dt: torch.dtype, tag: str):
    """The ahead-of-time spec of one launch: x [m, k] against weights of `widths` rows, in `dt`,
    tiles from `plan` as `launch` picks them."""
    p = plan(m, sum(widths), k, small=False, elem=dt.itemsize, shared=target.shared_memory)
    starts = _segment_starts(widths, p["BN"])
    consts = {f"S{i + 1}": s for i, s in enumerate(starts)}
    consts.update(NSEG=len(widths), BM=p["BM"], BN=p["BN"], BK=p["BK"],
                  PRECISION=target.dot_precision(fast=dt != torch.float32),
                  UPCAST=dt == torch.float32)
    ptrs = {"x_ptr": dt, **{f"w{i}_ptr": dt for i in range(8)}, **{f"y{i}_ptr": dt for i in range(8)}}
    ints = dict(M=m, K=k, stride_xm=k,
                **{f"n{i}": w for i, w in enumerate(widths + [0] * (MAX_SEGMENTS - len(widths)))})
    return kernel_spec(_linear_group_kernel, "k31c::linear_group", f"{tag},{dt}".replace("torch.", ""),
                       consts, ptrs, num_warps=p["num_warps"], num_stages=p["num_stages"], ints=ints)
