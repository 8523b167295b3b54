"""Kimi Delta Attention ops (spec/model.md §4): `kda_prefill` (chunked WY form) and `kda_decode`
(per-row recurrence with optional per-row snapshots), plus the pure math they are built from.

Layouts (graph/step.py): q|k|v pre-conv projections are concatenated as [.., 3P] (P = H*K) in the
conv window and the conv weight; the recurrent state is [H, K, V] fp32 (vLLM's layout, K = V).
All math runs in fp32; outputs are cast to q's dtype, conv windows to the conv state's dtype.

A negative slot (-1) marks a padding request (padded decode batches): its rows read and write
no state and their output rows are zero.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

L2_NORM_EPS = 1e-6  # q/k L2 norm eps (in-kernel in fla), independent of rms_norm_eps


# ---- pure math -------------------------------------------------------------------------------

def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
             lower_bound: Optional[float]) -> torch.Tensor:
    """Per-channel log-decay g [T, H, K] fp32 from the forget-gate input f [T, P] (no dt_bias)."""
    H = A_log.numel()
    x = (f.float() + dt_bias.float()).unflatten(-1, (H, -1))
    a = A_log.float().exp()[:, None]
    if lower_bound is None:
        return -a * F.softplus(x)                     # Kimi Linear 48B: softplus gate
    return lower_bound * torch.sigmoid(a * x)         # K3: decay in (e^lower_bound, 1)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(||x||^2 + 1e-6) over the last dim, fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_NORM_EPS)


def causal_conv_silu(u: torch.Tensor, weight: torch.Tensor,
                     history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over time, continuing from a cached window.

    u [..., T, C], weight [C, W], history [..., W-1, C] (the W-1 inputs before u, oldest first).
    Returns y [..., T, C] and the new window [..., W-1, C], both fp32.
    """
    T, W = u.shape[-2], weight.shape[-1]
    ext = torch.cat([history.float(), u.float()], dim=-2)   # [..., W-1+T, C]
    w = weight.float()
    y = sum(w[:, j] * ext[..., j:j + T, :] for j in range(W))
    return F.silu(y), ext[..., ext.shape[-2] - (W - 1):, :]


def kda_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             g: torch.Tensor, beta: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of §4.3 for any leading dims: state [..., H, K, V], q/k/g [..., H, K], v [..., H, V],
    beta [..., H]. Returns o [..., H, V] and the new state (fp32)."""
    S = state.float() * g.float().exp()[..., None]                       # decay rows (key channels)
    k = k.float()
    pred = torch.einsum("...kv,...k->...v", S, k)                        # S^T k
    S = S + (beta.float()[..., None, None] * k[..., :, None]) * (v.float() - pred)[..., None, :]
    o = torch.einsum("...kv,...k->...v", S, q.float() * scale)
    return o, S


def kda_recurrence(q, k, v, g, beta, scale: float,
                   initial_state: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact per-token recurrence (§4.3) for one sequence: q, k (L2-normed), g [T, H, K],
    v [T, H, V], beta [T, H] probabilities, state [H, K, V]. Returns o [T, H, V], final state."""
    T, H, K = q.shape
    V = v.shape[-1]
    S = _initial(initial_state, H, K, V, q.device)
    outs = []
    for t in range(T):
        o, S = kda_step(S, q[t], k[t], v[t], g[t], beta[t], scale)
        outs.append(o)
    o = torch.stack(outs) if outs else torch.zeros(0, H, V, device=q.device)
    return o, S


def kda_chunked(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor],
                chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked WY form (§4.4), same contract as `kda_recurrence`; the last chunk may be short."""
    T, H, K = q.shape
    V = v.shape[-1]
    S = _initial(initial_state, H, K, V, q.device)
    # head-major [H, T, .] so every chunk is a batch of H small matrix problems
    q, k, v, g = (x.float().transpose(0, 1) for x in (q, k, v, g))
    q = q * scale
    beta = beta.float().transpose(0, 1)
    outs = []
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        o, S = _wy_chunk(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], S)
        outs.append(o)
    o = torch.cat(outs, dim=1).transpose(0, 1) if outs else torch.zeros(0, H, V, device=q.device)
    return o, S


def _wy_chunk(q, k, v, g, beta, S0):
    """One chunk, head-major: q (scaled), k, g [H, n, K], v [H, n, V], beta [H, n], S0 [H, K, V]."""
    n = q.shape[1]
    G = g.cumsum(1)                                               # Γ_r, inclusive
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    # exp(Γ_r − Γ_i) for i ≤ r, formed from the difference (Γ reaches lower_bound·C); 0 above
    diff = (G[:, :, None, :] - G[:, None, :, :]).masked_fill(~causal[None, :, :, None], float("-inf"))
    decay = diff.exp()                                            # [H, r, i, K]
    M = beta[:, :, None] * torch.einsum("hrd,hid,hrid->hri", k, k, decay).tril(-1)
    eye = torch.eye(n, device=q.device).expand_as(M)
    # (I + M) [W | U] = Diag(β) [exp(Γ)⊙K | V]
    rhs = beta[:, :, None] * torch.cat([G.exp() * k, v], dim=-1)
    WU = torch.linalg.solve_triangular(eye + M, rhs, upper=False, unitriangular=True)
    W, U = WU[..., :k.shape[-1]], WU[..., k.shape[-1]:]
    v_new = U - W @ S0
    A_qk = torch.einsum("hrd,hcd,hrcd->hrc", q, k, decay)         # c ≤ r (decay is 0 above)
    o = (q * G.exp()) @ S0 + A_qk @ v_new
    G_last = G[:, -1]                                             # [H, K]
    S = G_last.exp()[:, :, None] * S0 + ((G_last[:, None, :] - G).exp() * k).transpose(1, 2) @ v_new
    return o, S


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head x·rsqrt(mean(x²)+eps)·w·σ(gate) over the last dim, fp32 (fla FusedRMSNormGated)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float() \
        * torch.sigmoid(gate.float())


def _initial(state, H, K, V, device):
    if state is None:
        return torch.zeros(H, K, V, device=device)
    return state.float().clone()


# ---- argument checks (shared by the ops and their fake kernels) -------------------------------

def _expect(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def _check_common(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                  conv_state, recurrent, slots) -> tuple[int, int, int, int]:
    """Shape and dtype checks common to both ops; returns (N, H, K, W)."""
    if A_log.dim() != 1:
        raise ValueError(f"A_log: expected shape [H], got {tuple(A_log.shape)}")
    if o_norm_weight.dim() != 1:
        raise ValueError(f"o_norm_weight: expected shape [K], got {tuple(o_norm_weight.shape)}")
    H, K = A_log.shape[0], o_norm_weight.shape[0]
    P = H * K
    if q.dim() != 2:
        raise ValueError(f"q: expected shape [N, {P}], got {tuple(q.shape)}")
    N = q.shape[0]
    for name, t in (("q", q), ("k", k), ("v", v), ("f", f), ("gate", gate)):
        _expect(name, t, (N, P))
    _expect("beta", beta, (N, H))
    if conv_weight.dim() != 2 or conv_weight.shape[0] != 3 * P or conv_weight.shape[1] < 1:
        raise ValueError(f"conv_weight: expected shape [{3 * P}, W], got {tuple(conv_weight.shape)}")
    W = conv_weight.shape[1]
    _expect("dt_bias", dt_bias, (P,))
    if conv_state.dim() != 3:
        raise ValueError(f"conv_state: expected shape [S, {W - 1}, {3 * P}], got {tuple(conv_state.shape)}")
    _expect("conv_state", conv_state, (conv_state.shape[0], W - 1, 3 * P))
    _expect("recurrent", recurrent, (conv_state.shape[0], H, K, K))
    if recurrent.dtype != torch.float32:
        raise ValueError(f"recurrent: expected dtype float32, got {recurrent.dtype}")
    if slots.dim() != 1 or slots.dtype != torch.int64:
        raise ValueError(f"slots: expected a 1-D int64 tensor, got {tuple(slots.shape)} {slots.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v), ("f", f), ("beta", beta), ("gate", gate),
                    ("conv_state", conv_state)):
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name}: expected a floating dtype, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k, v: expected q's dtype {q.dtype}, got {k.dtype}, {v.dtype}")
    return N, H, K, W


def _check_slot_values(slots: torch.Tensor, num_slots: int) -> list[int]:
    ids = slots.tolist()
    bad = [s for s in ids if s >= num_slots or s < -1]
    if bad:
        raise ValueError(f"slots: {bad} outside [-1, {num_slots}) (-1 = padding)")
    used = [s for s in ids if s >= 0]
    if len(set(used)) != len(used):
        raise ValueError(f"slots: a state slot is used by two requests: {ids}")
    return ids


# ---- kda_prefill ------------------------------------------------------------------------------

@torch.library.custom_op("k31c::kda_prefill", mutates_args=("conv_state", "recurrent"))
def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
                beta: torch.Tensor, gate: torch.Tensor, conv_weight: torch.Tensor,
                A_log: torch.Tensor, dt_bias: torch.Tensor, o_norm_weight: torch.Tensor,
                conv_state: torch.Tensor, recurrent: torch.Tensor, slots: torch.Tensor,
                cu_seqlens: torch.Tensor, lower_bound: Optional[float], eps: float,
                chunk_size: int) -> torch.Tensor:
    """Prefill B requests' new tokens (rows cu_seqlens[b]..cu_seqlens[b+1]-1) onto their slots'
    conv window and recurrent state; write both back; return the gated-normed output [T, P]."""
    T, H, K, W = check_prefill(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                                conv_state, recurrent, slots, cu_seqlens, chunk_size)
    ids = _check_slot_values(slots, conv_state.shape[0])
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to {T}, got {cu}")
    P = H * K
    u = torch.cat([q, k, v], dim=-1)                                 # pre-conv inputs [T, 3P]
    g = kda_gate(f, A_log, dt_bias, lower_bound)
    b = torch.sigmoid(beta.float())
    o = torch.zeros(T, H, K, device=q.device)
    for r, slot in enumerate(ids):
        s, e = cu[r], cu[r + 1]
        if slot < 0:
            continue
        y, window = causal_conv_silu(u[s:e], conv_weight, conv_state[slot])
        qc, kc, vc = (t.unflatten(-1, (H, K)) for t in y.split(P, dim=-1))
        o_req, state = kda_chunked(l2_normalize(qc), l2_normalize(kc), vc, g[s:e], b[s:e],
                                   K ** -0.5, recurrent[slot], chunk_size)
        o[s:e] = o_req
        conv_state[slot] = window.to(conv_state.dtype)
        recurrent[slot] = state
    out = gated_rms_norm(o, o_norm_weight, gate.unflatten(-1, (H, K)), eps)
    return out.flatten(-2).to(q.dtype)


def check_prefill(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                   conv_state, recurrent, slots, cu_seqlens, chunk_size):
    T, H, K, W = _check_common(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                               conv_state, recurrent, slots)
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens: expected dtype int32, got {cu_seqlens.dtype}")
    _expect("cu_seqlens", cu_seqlens, (slots.shape[0] + 1,))
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size}")
    return T, H, K, W


@kda_prefill.register_fake
def _(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight, conv_state, recurrent,
      slots, cu_seqlens, lower_bound, eps, chunk_size):
    check_prefill(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                   conv_state, recurrent, slots, cu_seqlens, chunk_size)
    return torch.empty_like(q)


# ---- kda_decode -------------------------------------------------------------------------------

@torch.library.custom_op("k31c::kda_decode",
                         mutates_args=("conv_state", "recurrent", "snap_conv", "snap_state"))
def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
               beta: torch.Tensor, gate: torch.Tensor, conv_weight: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, o_norm_weight: torch.Tensor,
               conv_state: torch.Tensor, recurrent: torch.Tensor, slots: torch.Tensor, rows: int,
               lower_bound: Optional[float], eps: float, snap_conv: Optional[torch.Tensor],
               snap_state: Optional[torch.Tensor]) -> torch.Tensor:
    """Decode / verify: N = B*rows rows, request-major. Each request's rows run one after another
    from its committed slot state (§4.3, §4.7); the state after the last row is written to the slot
    and, with snapshots, the state after row r to snap_conv[b, r] / snap_state[b, r]."""
    N, H, K, W = check_decode(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                               conv_state, recurrent, slots, rows, snap_conv, snap_state)
    ids = _check_slot_values(slots, conv_state.shape[0])
    live = [r for r, s in enumerate(ids) if s >= 0]
    P, B = H * K, len(ids)
    o = torch.zeros(B, rows, H, K, device=q.device)
    if live:
        live_t = torch.tensor(live, device=q.device)
        slot_t = slots[live_t]
        # every live request steps together; its rows are sequential
        u = torch.cat([q, k, v], dim=-1).unflatten(0, (B, rows))[live_t]     # [L, R, 3P]
        g = kda_gate(f, A_log, dt_bias, lower_bound).unflatten(0, (B, rows))[live_t]
        b = torch.sigmoid(beta.float()).unflatten(0, (B, rows))[live_t]
        window, state = conv_state[slot_t].float(), recurrent[slot_t].clone()
        for r in range(rows):
            y, window = causal_conv_silu(u[:, r:r + 1], conv_weight, window)
            qc, kc, vc = (t[:, 0].unflatten(-1, (H, K)) for t in y.split(P, dim=-1))
            o_r, state = kda_step(state, l2_normalize(qc), l2_normalize(kc), vc, g[:, r], b[:, r],
                                  K ** -0.5)
            o[live_t, r] = o_r
            if snap_conv is not None:
                snap_conv[live_t, r] = window.to(snap_conv.dtype)
                snap_state[live_t, r] = state
        conv_state[slot_t] = window.to(conv_state.dtype)
        recurrent[slot_t] = state
    out = gated_rms_norm(o.flatten(0, 1), o_norm_weight, gate.unflatten(-1, (H, K)), eps)
    if len(live) < B:  # padding requests' rows stay zero
        pad = torch.tensor([s < 0 for s in ids], device=q.device).repeat_interleave(rows)
        out[pad] = 0.0
    return out.flatten(-2).to(q.dtype)


def check_decode(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                  conv_state, recurrent, slots, rows, snap_conv, snap_state):
    N, H, K, W = _check_common(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                               conv_state, recurrent, slots)
    B = slots.shape[0]
    if rows < 1:
        raise ValueError(f"rows: expected a positive integer, got {rows}")
    if N != B * rows:
        raise ValueError(f"q: expected {B} requests x {rows} rows = {B * rows} rows, got {N}")
    if (snap_conv is None) != (snap_state is None):
        raise ValueError("snap_conv, snap_state: give both snapshot buffers or neither")
    if snap_conv is not None:
        _expect("snap_conv", snap_conv, (B, rows, W - 1, 3 * H * K))
        _expect("snap_state", snap_state, (B, rows, H, K, K))
        if snap_state.dtype != torch.float32:
            raise ValueError(f"snap_state: expected dtype float32, got {snap_state.dtype}")
    return N, H, K, W


@kda_decode.register_fake
def _(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight, conv_state, recurrent,
      slots, rows, lower_bound, eps, snap_conv, snap_state):
    check_decode(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                  conv_state, recurrent, slots, rows, snap_conv, snap_state)
    return torch.empty_like(q)
