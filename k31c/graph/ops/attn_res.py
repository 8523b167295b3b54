"""Block Attention Residuals' mix and the RMSNorm after it (spec/model.md §3), as one op.

Op (namespace k31c):
- `attn_res_norm(partial, addends, bank, res_norm_weight, res_proj_weight, norm_weight, res_eps,
  norm_eps)` → (s, x):
  s = partial + (addends[0] + addends[1]) (at most two; a copy of partial when there are none), in
  the model dtype, each add rounded as the model's own adds are: the layer's partial sum with
  the output that was still to be added (a MoE layer's is two terms, the routed and the shared
  experts');
  h = softmax_i(<rmsnorm(V_i), res_norm_weight ⊙ res_proj_weight>) · V_i over V = bank + [s], in
  fp32, cast to the model dtype (HF `_apply_attn_res`: the softmax weights use the normalised
  candidates, the mix the raw ones);
  x = norm_weight · (h / rms(h)) (Kimi's RMSNorm: normalised in fp32, cast, then scaled).
  partial, each addend, each bank entry and x: [T, D]; the weights [D] (res_proj_weight [1, D]).

Every layer of a Block-AttnRes model mixes its candidates twice (before the mixer and before the
FFN) and the model once more before the final norm. As plain PyTorch that is a residual add, a
stack, norms, a softmax and a weighted sum: five or six small kernels, each a graph node of a
decode step (and a MoE layer's add of its two terms one more); the op is one. The reference is
that plain PyTorch.
"""
from __future__ import annotations

import torch

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


MAX_ADDENDS = 2


def check_attn_res_norm(partial: torch.Tensor, addends: list[torch.Tensor], bank: list[torch.Tensor],
                        res_norm_weight: torch.Tensor, res_proj_weight: torch.Tensor,
                        norm_weight: torch.Tensor) -> None:
    if partial.dtype not in _FLOATS or partial.dim() != 2:
        raise ValueError(f"partial: expected a float [T, D] tensor, got {partial.dtype} {tuple(partial.shape)}")
    if not bank:
        raise ValueError("bank: expected at least one block snapshot, got none")
    if len(addends) > MAX_ADDENDS:
        raise ValueError(f"addends: expected at most {MAX_ADDENDS} terms, got {len(addends)}")
    shape, dt = tuple(partial.shape), partial.dtype
    for name, t in [(f"addends[{i}]", a) for i, a in enumerate(addends)] + \
            [(f"bank[{i}]", b) for i, b in enumerate(bank)]:
        if tuple(t.shape) != shape or t.dtype != dt or t.device != partial.device:
            raise ValueError(f"{name}: expected {dt} {list(shape)} on {partial.device} (partial's), "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    d = shape[1]
    for name, w in (("res_norm_weight", res_norm_weight), ("res_proj_weight", res_proj_weight),
                    ("norm_weight", norm_weight)):
        if w.numel() != d or w.dtype not in _FLOATS:
            raise ValueError(f"{name}: expected {d} float values, got {w.dtype} {tuple(w.shape)}")
    if norm_weight.dtype != dt:
        raise ValueError(f"norm_weight: expected {dt} (the activations' dtype: x keeps it), got {norm_weight.dtype}")


def attn_res_mix(values: list[torch.Tensor], res_norm_weight: torch.Tensor, res_proj_weight: torch.Tensor,
                 res_eps: float) -> torch.Tensor:
    """The mix h over the candidates `values` (the bank, then the partial sum), in fp32."""
    v = torch.stack(values, dim=1).float()                                  # [T, n+1, D]
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + res_eps)
    query = res_norm_weight.float() * res_proj_weight.float().reshape(-1)   # [D]
    # a broadcast product, not `keys @ query`: torch 2.11's fake matmul of a 3-D tensor with a
    # symbolic size by a vector calls numel() and fails in the graph's fake re-propagation
    alpha = torch.softmax((keys * query).sum(-1), dim=1)                    # [T, n+1]
    return (alpha.unsqueeze(-1) * v).sum(1)


@torch.library.custom_op("k31c::attn_res_norm", mutates_args=())
def attn_res_norm(partial: torch.Tensor, addends: list[torch.Tensor], bank: list[torch.Tensor],
                  res_norm_weight: torch.Tensor, res_proj_weight: torch.Tensor, norm_weight: torch.Tensor,
                  res_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_attn_res_norm(partial, addends, bank, res_norm_weight, res_proj_weight, norm_weight)
    s = partial.clone() if not addends else partial + (addends[0] if len(addends) == 1
                                                       else addends[0] + addends[1])
    h = attn_res_mix([*bank, s], res_norm_weight, res_proj_weight, res_eps).to(partial.dtype)
    hf = h.float()
    x = norm_weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + norm_eps)).to(h.dtype)
    return s, x


@attn_res_norm.register_fake
def _(partial, addends, bank, res_norm_weight, res_proj_weight, norm_weight, res_eps, norm_eps):
    check_attn_res_norm(partial, addends, bank, res_norm_weight, res_proj_weight, norm_weight)
    return torch.empty_like(partial), torch.empty_like(partial)
