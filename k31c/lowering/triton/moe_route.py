"""Triton MoE router (`k31c::moe_route`, spec/model.md §7.1): logits, then selection.

Two launches, no host sync, grids from static shapes (CUDA-graph safe):
1. logits: partial fp32 dot products of x and the router weight, a program per (expert tile,
   row tile, split of D); split s writes its own partial sum, so the result does not depend on
   the order programs run in (no atomics).
2. select, one program per row, over all E experts at once: the partials summed in split order,
   sigmoid (or softmax) scores, + bias, the group restriction (group score: the sum of its top
   2; the best `topk_group` groups kept), k rounds of one int64 max over (choice image, index)
   keys, the picks' scores recomputed from the partials, renormalised and scaled.
   Among equal choices the lower expert (group) index wins, as in the reference.

bf16 x bf16 products are exact in fp32, so the logits equal the reference's fp32 products up to
the order of the sums; fp32 operands use IEEE dots.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k31c.graph.ops.moe import check_route
from k31c.lowering.aot_spec import kernel_spec
from k31c.lowering.registry import register
from k31c.lowering.targets import GPU_TARGETS
from k31c.lowering.triton.device import interpreting, pdl_launch, target_of, upcast_dots, wait_for_producers


@triton.jit
def _logits_kernel(x_ptr, w_ptr, part_ptr, n_rows, n_experts, d, d_per_split, stride_x, stride_w,
                   BM: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr,
                   PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    """part[s, rows, experts] = Σ_{k in split s} x[rows, k] · w[experts, k] (fp32)."""
    wait_for_producers(PDL)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    experts = tl.program_id(0) * BE + tl.arange(0, BE)
    split = tl.program_id(2)
    row_ok = rows < n_rows
    e_ok = experts < n_experts
    k_lo = split * d_per_split
    acc = tl.zeros([BM, BE], tl.float32)
    for k0 in range(0, d_per_split, BK):       # loop bounds from arguments only
        ks = k_lo + k0 + tl.arange(0, BK)
        k_ok = (ks < d) & (k0 + tl.arange(0, BK) < d_per_split)
        xt = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :],
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_ptr + experts.to(tl.int64)[:, None] * stride_w + ks[None, :],
                     mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:                      # fp32 operands (the interpreter's bf16 dot is wrong)
            xt = xt.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PRECISION)
    out = part_ptr + (split * n_rows + rows).to(tl.int64)[:, None] * n_experts + experts[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & e_ok[None, :])


@triton.jit
def _select_kernel(part_ptr, bias_ptr, idx_ptr, wout_ptr, row_len_ptr, n_rows, n_experts, group_size,
                   scaling, HAS_ROW_LEN: tl.constexpr, SPLITS: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                   GROUPS: tl.constexpr, GP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                   SOFTMAX: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, EP)
    valid = cols < n_experts
    logits = tl.zeros([EP], tl.float32)
    for s in tl.static_range(SPLITS):
        logits += tl.load(part_ptr + (s * n_rows + row).to(tl.int64) * n_experts + cols, mask=valid,
                          other=0.0)
    if SOFTMAX:
        m = tl.max(tl.where(valid, logits, float("-inf")), axis=0)
        p = tl.where(valid, tl.exp(logits - m), 0.0)
        scores = p / tl.sum(p, axis=0)
    else:
        scores = tl.sigmoid(logits)
    choice = scores + tl.load(bias_ptr + cols, mask=valid, other=0.0)
    if GROUPS > TOPK_GROUP:
        group = cols // group_size
        g_ids = tl.arange(0, GP)
        g_score = tl.full([GP], float("-inf"), tl.float32)
        for g in tl.static_range(GROUPS):
            in_g = valid & (group == g)
            top1 = tl.max(tl.where(in_g, choice, float("-inf")), axis=0)
            first = tl.min(tl.where(in_g & (choice == top1), cols, EP), axis=0)
            top2 = tl.max(tl.where(in_g & (cols != first), choice, float("-inf")), axis=0)
            g_score = tl.where(g_ids == g, top1 + top2, g_score)
        g_taken = g_ids >= GROUPS
        keep = cols < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(tl.where(g_taken, float("-inf"), g_score), axis=0)
            pick = tl.min(tl.where(~g_taken & (g_score == best), g_ids, GP), axis=0)
            pick = tl.where(pick < GROUPS, pick, tl.min(tl.where(g_taken, GP, g_ids), axis=0))  # NaN
            g_taken = g_taken | (g_ids == pick)
            keep = keep | (group == pick)
        valid = valid & keep
    # one max per pick over keys (order-preserving image of the choice) << 32 | (EP-1-index):
    # the largest choice, the lower index among equal ones
    bits = choice.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    keys = tl.where(valid, (ordered << 32) | (EP - 1 - cols).to(tl.int64), -9223372036854775807 - 1)
    k_ids = tl.arange(0, KP)
    sel = tl.zeros([KP], tl.int32)
    for j in tl.static_range(K):
        best = tl.max(keys, axis=0)
        pick = EP - 1 - (best & 0x7FFFFFFF).to(tl.int32)
        keys = tl.where(cols == pick, -9223372036854775807 - 1, keys)
        sel = tl.where(k_ids == j, pick, sel)
    sel = tl.minimum(tl.maximum(sel, 0), n_experts - 1)
    # the picks' scores, recomputed from the partials exactly as above
    picked = tl.zeros([KP], tl.float32)
    for s in tl.static_range(SPLITS):
        picked += tl.load(part_ptr + (s * n_rows + row).to(tl.int64) * n_experts + sel)
    if SOFTMAX:
        w = tl.exp(picked - m) / tl.sum(p, axis=0)
    else:
        w = tl.sigmoid(picked)
    w = tl.where(k_ids < K, w, 0.0)
    if RENORM and K > 1:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    if HAS_ROW_LEN:                          # a padding row (no keys) selects no expert
        live = tl.load(row_len_ptr + row) > 0
        sel = tl.where(live, sel, -1)
        w = tl.where(live, w, 0.0)
    out = row.to(tl.int64) * K + k_ids
    tl.store(idx_ptr + out, sel, mask=k_ids < K)
    tl.store(wout_ptr + out, w * scaling, mask=k_ids < K)


# ---- launch plan ------------------------------------------------------------------------------

def plan(n_rows: int, n_experts: int, d: int, small: bool | None = None) -> dict:
    """Tiles of the logits launch: about 2 programs per SM at decode (D split when the row and
    expert tiles alone are too few); small: the interpreter's tiles."""
    small = interpreting() if small is None else small
    bm, be, bk = (16, 16, 32) if small else (16, 32, 128)
    tiles = triton.cdiv(n_experts, be) * triton.cdiv(max(n_rows, 1), bm)
    splits = 1 if small else max(1, min(8, 256 // tiles, d // (4 * bk)))
    d_per_split = triton.cdiv(triton.cdiv(d, splits), bk) * bk
    return dict(BM=bm, BE=be, BK=bk, splits=triton.cdiv(d, d_per_split), d_per_split=d_per_split,
                num_warps=4)


def select_constexprs(n_experts: int, k: int, n_group: int, topk_group: int, scoring: str,
                      renormalize: bool, splits: int) -> dict:
    return dict(SPLITS=splits, EP=triton.next_power_of_2(n_experts), K=k, KP=triton.next_power_of_2(k),
                GROUPS=n_group, GP=triton.next_power_of_2(n_group), TOPK_GROUP=topk_group,
                SOFTMAX=scoring == "softmax", RENORM=bool(renormalize))


@register("k31c::moe_route", GPU_TARGETS)
def moe_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, n_group: int,
              topk_group: int, scoring: str, renormalize: bool, scaling: float,
              row_len: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    check_route(x, weight, bias, k, n_group, topk_group, scoring, renormalize, scaling, row_len)
    n, d = x.shape
    n_experts = weight.shape[0]
    idx = torch.empty((n, k), dtype=torch.int32, device=x.device)
    w = torch.empty((n, k), dtype=torch.float32, device=x.device)
    if n == 0:
        return idx, w
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    bias = bias.contiguous()
    p = plan(n, n_experts, d)
    part = torch.empty((p["splits"], n, n_experts), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n_experts, p["BE"]), triton.cdiv(n, p["BM"]), p["splits"])
    pdl = pdl_launch(x.device)
    _logits_kernel[grid](x, weight, part, n, n_experts, d, p["d_per_split"], x.stride(0),
                         weight.stride(0), BM=p["BM"], BE=p["BE"], BK=p["BK"],
                         UPCAST=upcast_dots(x.dtype) or x.dtype != weight.dtype,
                         PRECISION=target_of(x.device).dot_precision(fast=False),
                         num_warps=p["num_warps"], **pdl)
    _select_kernel[(n,)](part, bias, idx, w, idx if row_len is None else row_len, n, n_experts,
                         n_experts // n_group, float(scaling), HAS_ROW_LEN=row_len is not None,
                         **select_constexprs(n_experts, k, n_group, topk_group, scoring, renormalize,
                                             p["splits"]), num_warps=4, **pdl)
    return idx, w


def aot_specs(shapes) -> list:
    """The router's launches at `shapes` (aot_spec.AotShapes): `batch` rows of K3.1 Pro's
    hidden width against its experts, constexprs from `plan` and `select_constexprs`."""
    cfg = shapes.cfg
    op, dt = "k31c::moe_route", cfg.torch_dtype
    p = plan(shapes.batch, cfg.num_experts, cfg.hidden_size, small=False)
    logits = kernel_spec(_logits_kernel, op, f"{dt}".split(".")[-1],
                         dict(BM=p["BM"], BE=p["BE"], BK=p["BK"], UPCAST=dt == torch.float32,
                              PRECISION=shapes.target.dot_precision(fast=False)),
                         dict(x_ptr=dt, w_ptr=dt, part_ptr=torch.float32), num_warps=p["num_warps"],
                         ints=dict(n_rows=shapes.batch, n_experts=cfg.num_experts, d=cfg.hidden_size,
                                   d_per_split=p["d_per_split"], stride_x=cfg.hidden_size,
                                   stride_w=cfg.hidden_size))
    consts = select_constexprs(cfg.num_experts, cfg.num_experts_per_token, cfg.num_expert_group,
                               cfg.topk_group, cfg.moe_router_activation_func, cfg.moe_renormalize,
                               p["splits"])
    select = kernel_spec(_select_kernel, op, f"E={cfg.num_experts},k={cfg.num_experts_per_token}",
                         dict(consts, HAS_ROW_LEN=True),
                         dict(part_ptr=torch.float32, bias_ptr=torch.float32, idx_ptr=torch.int32,
                              wout_ptr=torch.float32, row_len_ptr=torch.int32, scaling="fp32"),
                         ints=dict(n_rows=shapes.batch, n_experts=cfg.num_experts,
                                   group_size=cfg.num_experts // cfg.num_expert_group))
    return [logits, select]
