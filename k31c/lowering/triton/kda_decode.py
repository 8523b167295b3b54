"""The launch plan and launcher of `k31c::kda_decode` (the kernels and the launches they make up
are in kda_decode_kernels.py): `plan` picks the launch configuration once (the state pass's
(BV, warps) tile, measured per rows per request); the registered launcher and `aot_specs` both
read it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton

from k31c.graph.ops.kda import check_decode
from k31c.lowering.aot_spec import kernel_spec
from k31c.lowering.registry import register
from k31c.lowering.targets import GPU_TARGETS
from k31c.lowering.triton.device import pair_launch, pdl_launch, sm_count
from k31c.lowering.triton.kda_common import check_kda_layout
from k31c.lowering.triton.kda_decode_kernels import (kda_decode_norm_kernel, kda_decode_prep_kernel,
                                                     kda_decode_state_kernel)
from k31c.lowering.triton.unit_stride import require_unit_stride

PREP_WARPS = 2            # prep at R > 1: the decode at B = 16 (H100) 97.1 us, 98.3 at 1, 98.0 at 4
PREP_WARPS_ONE_ROW = 2    # at R = 1: 78.2 us (H100), 78.1 at 4 warps, 80.4 at 8
NORM_WARPS = 4
NORM_ROWS = 16            # [N*H, K] rows per norm program


# ---- launch plan ----------------------------------------------------------------------------

# (BV, num_warps) of the state pass by rows per request: the fastest measured on the H200 at
# B=16, H=96 (BENCHMARKS.md, KDA). For one row BV = K (capped at K: one program per head, the gated
# norm fused, two launches instead of three) won at B = 1 and 16 in four runs.
_TILE_ONE_ROW, _TILE_ROWS = (128, 4), (32, 2)


@dataclass(frozen=True)
class DecodePlan:
    """The launch configuration of one `kda_decode` call shape."""
    rows: int            # rows per request
    K: int               # head dim (= V)
    W: int               # conv kernel width
    block_v: int         # value channels per state program (K: the norm fused)
    num_warps: int       # state pass
    prep_warps: int = PREP_WARPS        # (`plan`: PREP_WARPS_ONE_ROW at R = 1)
    norm_rows: int = NORM_ROWS
    unroll_rows: bool = True
    state_first: bool = False   # the state pass launched as the prep's PDL dependent (`pairs`)

    @property
    def fuse_norm(self) -> bool:
        """The state pass normalises o itself (one program holds the head's whole o rows)."""
        return self.block_v == self.K

    def state_programs(self, requests: int, H: int) -> int:
        return requests * H * (self.K // self.block_v)

    def pairs(self, requests: int, H: int, sms: int) -> bool:
        """Whether the state pass should be the prep's PDL dependent: only when every state
        program can be resident beside the prep (one per SM at most). Measured on the H200: B = 1,
        R = 1 (96 programs) 10.0-10.2 us paired vs 11.1-11.6 plain; B = 4 (384) and B = 16
        paired are 0-4% slower (early programs wait on SMs the prep needs)."""
        return self.state_programs(requests, H) <= sms

    def prep_constexprs(self, has_lower_bound: bool, has_snap: bool) -> dict:
        return dict(ROWS=self.rows, RB=triton.next_power_of_2(self.rows), K=self.K, W=self.W,
                    WB=triton.next_power_of_2(max(self.W - 1, 1)), HAS_LOWER_BOUND=has_lower_bound,
                    HAS_SNAP=has_snap, **({"DEPENDENT": True} if self.state_first else {}))

    def state_constexprs(self, has_snap: bool) -> dict:
        return dict(ROWS=self.rows, K=self.K, BV=self.block_v, HAS_SNAP=has_snap,
                    FUSE_NORM=self.fuse_norm, UNROLL=bool(self.unroll_rows),
                    **({"STATE_FIRST": True, "PDL": True} if self.state_first else {}))

    def norm_constexprs(self) -> dict:
        return dict(ROWS=self.rows, K=self.K, BR=self.norm_rows)


def decode_tile(rows: int, K: int, block_v: int | None = None,
                num_warps: int | None = None) -> tuple[int, int]:
    """(BV, num_warps) of the state pass: the explicit ones, else the default for one row or for
    more. BV is capped at K."""
    bv, nw = _TILE_ONE_ROW if rows == 1 else _TILE_ROWS
    BV = min(bv if block_v is None else block_v, K)
    if BV < 1 or K % BV or BV & (BV - 1):
        raise ValueError(f"block_v: expected a power of two dividing K={K}, got {block_v}")
    nw = nw if num_warps is None else num_warps
    if nw < 1 or nw & (nw - 1):
        raise ValueError(f"num_warps: expected a power of two, got {num_warps}")
    return BV, nw


def plan(rows: int, K: int, W: int, block_v: int | None = None, num_warps: int | None = None,
         prep_warps: int | None = None, norm_rows: int = NORM_ROWS,
         unroll_rows: bool = True) -> DecodePlan:
    """The plan for `rows` rows per request: the state pass's tile from `decode_tile`, the rest
    as given (the launcher decides `state_first`: `DecodePlan.pairs`)."""
    BV, nw = decode_tile(rows, K, block_v, num_warps)
    prep_warps = (PREP_WARPS_ONE_ROW if rows == 1 else PREP_WARPS) if prep_warps is None else prep_warps
    return DecodePlan(rows, K, W, BV, nw, prep_warps, norm_rows, unroll_rows)


# ---- launcher -------------------------------------------------------------------------------

@register("k31c::kda_decode", GPU_TARGETS)
def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
               beta: torch.Tensor, gate: torch.Tensor, conv_weight: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, o_norm_weight: torch.Tensor,
               conv_state: torch.Tensor, recurrent: torch.Tensor, slots: torch.Tensor, rows: int,
               lower_bound: float | None, eps: float, snap_conv: torch.Tensor | None,
               snap_state: torch.Tensor | None) -> torch.Tensor:
    """Launcher with the op's signature."""
    return launch_kda_decode(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                             conv_state, recurrent, slots, rows, lower_bound, eps, snap_conv,
                             snap_state)


def check_decode_layout(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                        conv_state, recurrent, slots, rows, snap_conv, snap_state):
    """The op's checks and the kernels' layout needs; returns (N, H, K, W)."""
    N, H, K, W = check_decode(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                              conv_state, recurrent, slots, rows, snap_conv, snap_state)
    check_kda_layout(q, K, conv_state, recurrent)
    require_unit_stride(slots=slots)
    if snap_conv is not None and not (snap_conv.is_contiguous() and snap_state.is_contiguous()):
        raise ValueError("snap_conv, snap_state: expected contiguous buffers (written in place)")
    return N, H, K, W


def launch_kda_decode(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
                      conv_state, recurrent, slots, rows, lower_bound, eps, snap_conv, snap_state,
                      block_v: int | None = None, num_warps: int | None = None,
                      prep_warps: int | None = None, norm_rows: int = NORM_ROWS,
                      unroll_rows: bool = True, stages: str = "psn",
                      state_first: bool | None = None) -> torch.Tensor:
    """The launches, with the tuning knobs exposed for benchmarks. block_v, num_warps: tile of
    the state pass (default: `decode_tile`; block_v = K: one program per head, gated norm fused,
    no norm launch). unroll_rows: unroll the row loop (all rows' vector loads early) or not
    (fewer registers). stages: which of prep / state / norm to launch (benchmarks time them
    alone; anything but "psn" leaves the output unfinished). state_first: launch the state pass
    as the prep's PDL dependent, loading its state while the prep runs (default: where the
    device has PDL and `DecodePlan.pairs` says so)."""
    N, H, K, W = check_decode_layout(q, k, v, f, beta, gate, conv_weight, A_log, dt_bias,
                                     o_norm_weight, conv_state, recurrent, slots, rows, snap_conv,
                                     snap_state)
    if not stages or set(stages) - set("psn"):
        raise ValueError(f"stages: expected letters of 'psn' (prep, state, norm), got {stages!r}")
    p = plan(rows, K, W, block_v, num_warps, prep_warps, norm_rows, unroll_rows)
    paired = pair_launch(q.device) and "p" in stages
    if state_first is None:
        state_first = p.pairs(slots.shape[0], H, sm_count(q.device))
    p = dataclasses.replace(p, state_first=state_first and paired)
    q, k, v, f, beta, gate = (t.contiguous() for t in (q, k, v, f, beta, gate))
    return _run(p, q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight, conv_state,
                recurrent, slots, lower_bound, eps, snap_conv, snap_state, N, H, stages)


def _run(p: DecodePlan, q, k, v, f, beta, gate, conv_weight, A_log, dt_bias, o_norm_weight,
         conv_state, recurrent, slots, lower_bound, eps, snap_conv, snap_state, N, H,
         stages) -> torch.Tensor:
    B = slots.shape[0]
    K = p.K
    P = H * K
    dev = q.device
    pdl = pdl_launch(dev)
    has_snap = snap_conv is not None
    lb = 0.0 if lower_bound is None else float(lower_bound)
    qs, ks, vs, ds = (torch.empty(N, P, device=dev, dtype=torch.float32) for _ in range(4))
    bs = torch.empty(N, H, device=dev, dtype=torch.float32)
    if "p" in stages:
        kda_decode_prep_kernel[(B, H)](
            q, k, v, f, beta, conv_weight.contiguous(), A_log.contiguous(), dt_bias.contiguous(),
            conv_state, slots, snap_conv if has_snap else conv_state, qs, ks, vs, ds, bs,
            H, lb, K ** -0.5,
            **p.prep_constexprs(lower_bound is not None, has_snap), num_warps=p.prep_warps, **pdl)
    out = torch.empty_like(q)
    o_raw = out if p.fuse_norm else torch.empty(N, P, device=dev, dtype=torch.float32)
    norm_w = o_norm_weight.contiguous()
    if "s" in stages:
        kda_decode_state_kernel[(B * H * (K // p.block_v),)](
            qs, ks, vs, ds, bs, o_raw, gate, norm_w, recurrent, slots,
            snap_state if has_snap else recurrent, H, float(eps),
            **{**pdl, **p.state_constexprs(has_snap),
               **({"launch_pdl": True} if p.state_first else {})}, num_warps=p.num_warps)
    if "n" in stages and not p.fuse_norm:
        kda_decode_norm_kernel[(triton.cdiv(N * H, p.norm_rows),)](
            o_raw, gate, norm_w, slots, out, N * H, H, float(eps), **p.norm_constexprs(),
            num_warps=NORM_WARPS, **pdl)
    return out


def aot_specs(shapes) -> list:
    """The launches of `kda_decode` at `shapes` (aot_spec.AotShapes), for the ahead-of-time build,
    from `plan`'s defaults; dtypes as the KDA block passes them: for every rows-per-request count,
    with and without per-row snapshots, prep and state (also as a PDL pair where
    `DecodePlan.pairs` allows it at one request), and the norm (one build per R: it maps rows to
    requests; none when BV = K fuses it into the state pass)."""
    cfg = shapes.cfg
    dt, f32, i64, op = cfg.torch_dtype, torch.float32, torch.int64, "k31c::kda_decode"
    K, W, H = cfg.kda_head_dim, cfg.short_conv_kernel_size, cfg.kda_num_heads
    lb = cfg.gate_lower_bound is not None
    inputs = dict(q_ptr=dt, k_ptr=dt, v_ptr=dt, f_ptr=dt, beta_ptr=dt, conv_w_ptr=f32,
                  a_log_ptr=f32, dt_bias_ptr=f32, conv_ptr=dt, slots_ptr=i64)
    prep_types = dict(inputs, snap_conv_ptr=dt, qs_ptr=f32, ks_ptr=f32, vs_ptr=f32, ds_ptr=f32,
                      bs_ptr=f32, lower_bound="fp32", scale="fp32")
    specs = []
    for rows in shapes.rows_per_request:
        base = plan(rows, K, W)
        # paired at one request where the grid allows it (DecodePlan.pairs), plain otherwise
        pairs = shapes.target.pdl_capable and base.pairs(1, H, shapes.target.sm_count)
        state_types = dict(qs_ptr=f32, ks_ptr=f32, vs_ptr=f32, ds_ptr=f32, bs_ptr=f32,
                           o_ptr=dt if base.fuse_norm else f32, gate_ptr=dt, norm_w_ptr=dt,
                           state_ptr=f32, slots_ptr=i64, snap_state_ptr=f32, eps="fp32")
        for p in (base, dataclasses.replace(base, state_first=True)) if pairs else (base,):
            pair = ",paired" if p.state_first else ""
            for snap in (False, True):
                tag = f"R={rows}{',snap' if snap else ''}"
                specs.append(kernel_spec(kda_decode_prep_kernel, op, tag + pair,
                                         p.prep_constexprs(lb, snap), prep_types,
                                         num_warps=p.prep_warps, ints=dict(H=H)))
                specs.append(kernel_spec(kda_decode_state_kernel, op, f"{tag},BV={p.block_v}{pair}",
                                         p.state_constexprs(snap), state_types, num_warps=p.num_warps,
                                         ints=dict(H=H)))
        if not base.fuse_norm:
            specs.append(kernel_spec(
                kda_decode_norm_kernel, op, f"R={rows},BR={base.norm_rows}", base.norm_constexprs(),
                dict(o_ptr=f32, gate_ptr=dt, norm_w_ptr=dt, slots_ptr=i64, out_ptr=dt,
                     eps="fp32"),
                num_warps=NORM_WARPS, ints=dict(n_rows=shapes.batch * rows * H, H=H)))
    return specs
