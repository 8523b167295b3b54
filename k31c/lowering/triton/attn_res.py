"""Triton kernel for `k31c::attn_res_norm`: Block AttnRes' mix and the RMSNorm after it, one launch.

One program per row: the row of every candidate (the bank's snapshots, then s = partial + the
addends, each add rounded to the model dtype as the reference's adds are) is read once, in
order, and folded into an online softmax: its logit is <v, q> / rms(v) with q = res_norm_weight
⊙ res_proj_weight, the running mix is rescaled when the maximum moves. The mix is rounded to the model dtype (the
reference casts it), normalised by its own rms in fp32, cast, and scaled by norm_weight. The whole
row (D <= 16K) stays in registers, so each byte is read once and x and s are written once.

Bank entries are separate tensors (the model's list of block snapshots), passed as `MAX_BANK`
pointer arguments; K3.1 Pro has at most 8 (93 layers in blocks of 12). A longer bank passes its
entries from the 16th on stacked into one tensor as the last pointer (a copy a launch, only for
such models).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k31c.graph.ops.attn_res import MAX_ADDENDS, check_attn_res_norm
from k31c.lowering.aot_spec import kernel_spec
from k31c.lowering.registry import register
from k31c.lowering.targets import GPU_TARGETS
from k31c.lowering.triton.device import pdl_launch, wait_for_producers

MAX_BANK = 16
MAX_WIDTH = 16384


@triton.jit
def _fold(v, q, eps, m, l, acc, D: tl.constexpr):
    """One candidate row v (fp32) into the online softmax (m: max logit, l: sum, acc: the mix)."""
    logit = tl.sum(v * q, axis=0) * tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)
    m_new = tl.maximum(m, logit)
    scale = tl.exp(m - m_new)
    p = tl.exp(logit - m_new)
    return m_new, l * scale + p, acc * scale + p * v


@triton.jit
def _attn_res_norm_kernel(partial_ptr, a0_ptr, a1_ptr, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12,
                          b13, b14, b15, rn_ptr, rp_ptr, nw_ptr, s_ptr, x_ptr, res_eps, norm_eps,
                          stride_p, stride_a, stride_a1, stride_b, stride_s, stride_x, stride_tail,
                          D: tl.constexpr, BLOCK: tl.constexpr, N_BANK: tl.constexpr,
                          N_ADD: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    q = tl.load(rn_ptr + cols, mask=ok, other=0.0).to(tl.float32) * \
        tl.load(rp_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    m = tl.full([], float("-inf"), tl.float32)
    l = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in tl.static_range(N_BANK):
        if N_BANK <= 16 or i < 15:
            b = (b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, b15)[i]
        else:                           # entries 15.. stacked in b15, stride_tail apart
            b = b15 + (i - 15) * stride_tail
        v = tl.load(b + row * stride_b + cols, mask=ok, other=0.0).to(tl.float32)
        m, l, acc = _fold(v, q, res_eps, m, l, acc, D)
    s = tl.load(partial_ptr + row * stride_p + cols, mask=ok, other=0.0)
    if N_ADD > 0:
        a = tl.load(a0_ptr + row * stride_a + cols, mask=ok, other=0.0)
        if N_ADD > 1:           # the two terms' sum first, rounded, as the model adds them
            a = (a.to(tl.float32) + tl.load(a1_ptr + row * stride_a1 + cols, mask=ok,
                                            other=0.0).to(tl.float32)).to(s_ptr.dtype.element_ty)
        s = (s.to(tl.float32) + a.to(tl.float32))
        s = s.to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + row * stride_s + cols, s, mask=ok)
    m, l, acc = _fold(s.to(tl.float32), q, res_eps, m, l, acc, D)
    h = (acc / l).to(x_ptr.dtype.element_ty).to(tl.float32)
    n = (h * tl.rsqrt(tl.sum(h * h, axis=0) / D + norm_eps)).to(x_ptr.dtype.element_ty)
    # the product of two bf16 values is exact in fp32: one rounding, as the model dtype's product
    x = tl.load(nw_ptr + cols, mask=ok, other=0.0).to(tl.float32) * n.to(tl.float32)
    tl.store(x_ptr + row * stride_x + cols, x.to(x_ptr.dtype.element_ty), mask=ok)


def plan(width: int) -> dict:
    """The row tile (the next power of two of D) and warps: 16 elements a thread at most."""
    block = triton.next_power_of_2(width)
    return dict(BLOCK=block, num_warps=max(1, min(16, block // 512)))


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@register("k31c::attn_res_norm", GPU_TARGETS)
def attn_res_norm(partial: torch.Tensor, addends: list[torch.Tensor], bank: list[torch.Tensor],
                  res_norm_weight: torch.Tensor, res_proj_weight: torch.Tensor, norm_weight: torch.Tensor,
                  res_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_attn_res_norm(partial, addends, bank, res_norm_weight, res_proj_weight, norm_weight)
    n, d = partial.shape
    if d > MAX_WIDTH:
        raise ValueError(f"attn_res_norm: the Triton kernel holds a row of at most {MAX_WIDTH} values "
                         f"in registers, got width {d}")
    s, x = torch.empty_like(partial), torch.empty_like(partial)
    if n == 0:
        return s, x
    partial = _row_major(partial)
    bank = [_row_major(b) for b in bank]
    stride_b = bank[0].stride(0)
    if len(bank) > MAX_BANK or any(b.stride(0) != stride_b for b in bank):   # one row stride for all
        bank = [b.contiguous() for b in bank]
        stride_b = d
    ptrs, stride_tail = bank[:MAX_BANK], 0
    if len(bank) > MAX_BANK:
        ptrs = bank[:MAX_BANK - 1] + [torch.stack(bank[MAX_BANK - 1:])]
        stride_tail = n * d
    ptrs += [bank[0]] * (MAX_BANK - len(ptrs))
    adds = [_row_major(a) for a in addends] + [partial] * (MAX_ADDENDS - len(addends))
    p = plan(d)
    _attn_res_norm_kernel[(n,)](
        partial, *adds, *ptrs, res_norm_weight.reshape(-1), res_proj_weight.reshape(-1),
        norm_weight.reshape(-1), s, x, float(res_eps), float(norm_eps), partial.stride(0), adds[0].stride(0),
        adds[1].stride(0), stride_b, s.stride(0), x.stride(0), stride_tail, D=d, BLOCK=p["BLOCK"],
        N_BANK=len(bank), N_ADD=len(addends), num_warps=p["num_warps"], **pdl_launch(partial.device))
    return s, x


def aot_specs(shapes) -> list:
    """The launches at `shapes` (aot_spec.AotShapes): a decode batch of K3.1 Pro's hidden width,
    one build per bank size a model of `num_hidden_layers` layers in blocks of
    `attn_res_block_size` reaches, with one pending addend (an attention or dense-MLP output) and
    with two (a MoE layer's routed and shared terms)."""
    cfg = shapes.cfg
    if cfg.attn_res_block_size is None:
        return []
    d, dt = cfg.hidden_size, cfg.torch_dtype
    p = plan(d)
    banks = range(1, triton.cdiv(cfg.num_hidden_layers, cfg.attn_res_block_size) + 1)
    ptrs = dict(partial_ptr=dt, a0_ptr=dt, a1_ptr=dt, **{f"b{i}": dt for i in range(MAX_BANK)}, rn_ptr=dt,
                rp_ptr=dt, nw_ptr=dt, s_ptr=dt, x_ptr=dt, res_eps="fp32", norm_eps="fp32")
    ints = dict(stride_p=d, stride_a=d, stride_a1=d, stride_b=d, stride_s=d, stride_x=d, stride_tail=0)
    return [kernel_spec(_attn_res_norm_kernel, "k31c::attn_res_norm", f"bank={nb},addends={na}",
                        dict(D=d, BLOCK=p["BLOCK"], N_BANK=nb, N_ADD=na), ptrs,
                        num_warps=p["num_warps"], ints=ints) for nb in banks for na in (1, 2)]
