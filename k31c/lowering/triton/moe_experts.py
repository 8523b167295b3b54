"""Triton routed experts (`k31c::moe_experts`, spec/model.md §7.2): tokens grouped by expert,
one grouped GEMM gate/up with the GLU fused, one grouped GEMM down with the routing weight
applied, then each row's k results summed. Only the selected experts' weights are read, each
once per tile of up to BM rows that chose it.

Fixed launch sequence (no host sync, grids from static shapes: CUDA-graph safe). A = N·k
assignments, assignment a = n·k + j is row n's j-th expert. Grouping gives counts[e] (the
assignments of expert e), offsets[e] (their exclusive prefix sum), tile_end[e] (the inclusive
prefix sum of cdiv(counts[e], BM): the tiles of BM rows of experts 0..e) and sorted (the
assignments, expert by expert):
1. decode sizes (A <= GROUP_ONE_MAX), one program in registers: counts by a histogram, the
   prefix sums, and sorted from a sort of the keys e·NA + a (no memset, no atomics; ascending a
   within an expert);
   larger A, three launches after zeroing two counter arrays: count (atomic adds); offsets (one
   program); scatter, sorted[offsets[e] + rank] = a with the rank from an atomic cursor per
   expert (any order within an expert: each row's result is computed alone, so outputs are
   exact whatever the order).
2. gate/up, grid (worst-case tiles = min(E, A) + A // BM, I / BN): program t finds its expert by
   counting tile_end <= t and exits when t >= the tiles in use (device-side count); it computes
   h = GLU(z·w13[e, :I]ᵀ, z·w13[e, I:]ᵀ) for its rows, the products rounded to the weights'
   dtype as nn.Linear's are, h stored in that dtype in sorted order.
3. down, grid (worst-case tiles, W / BN): y[a] = weights[a] · round(h·w2[e]ᵀ) in fp32.
4. combine, grid (N, W / BW): u[n] = Σ_j y[n·k + j] (j ascending), cast to z's dtype.
An assignment naming no expert (outside 0..E-1) is skipped (the reference op raises on it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k31c.graph.ops.moe import check_experts
from k31c.lowering.aot_spec import kernel_spec
from k31c.lowering.registry import register
from k31c.lowering.targets import GPU_TARGETS
from k31c.lowering.triton.cache_write import to_storage
from k31c.lowering.triton.device import interpreting, pdl_launch, target_of, upcast_dots, wait_for_producers

MAX_EXPERTS = 8192           # experts the one-program offsets pass holds in registers


# ---- grouping ---------------------------------------------------------------------------------

@triton.jit
def _store_offsets(counts, cols, ok, offsets_ptr, tile_end_ptr, BM: tl.constexpr):
    """offsets = the exclusive prefix sum of counts; tile_end = the inclusive one of their tiles."""
    tl.store(offsets_ptr + cols, tl.cumsum(counts, axis=0) - counts, mask=ok)
    tl.store(tile_end_ptr + cols, tl.cumsum((counts + BM - 1) // BM, axis=0), mask=ok)


@triton.jit
def _group_kernel(idx_ptr, counts_ptr, offsets_ptr, tile_end_ptr, sorted_ptr, n_assign, n_experts,
                  NA: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr, PDL: tl.constexpr = False):
    """The whole grouping in one program (A <= NA assignments in registers)."""
    wait_for_producers(PDL)
    a = tl.arange(0, NA)
    e = tl.load(idx_ptr + a, mask=a < n_assign, other=-1)
    ok = (a < n_assign) & (e >= 0) & (e < n_experts)
    counts = tl.histogram(tl.where(ok, e, 0), EP, mask=ok)
    cols = tl.arange(0, EP)
    cm = cols < n_experts
    tl.store(counts_ptr + cols, counts, mask=cm)
    _store_offsets(counts, cols, cm, offsets_ptr, tile_end_ptr, BM)
    grouped = tl.sort(tl.where(ok, e, n_experts) * NA + a)        # expert-major; skipped ones last
    tl.store(sorted_ptr + a, grouped % NA, mask=a < tl.sum(ok.to(tl.int32), axis=0))


@triton.jit
def _count_kernel(idx_ptr, counts_ptr, n_assign, n_experts, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    a = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(idx_ptr + a, mask=a < n_assign, other=-1)
    ok = (e >= 0) & (e < n_experts)
    tl.atomic_add(counts_ptr + tl.where(ok, e, 0), 1, mask=ok)


@triton.jit
def _offsets_kernel(counts_ptr, offsets_ptr, tile_end_ptr, n_experts, BM: tl.constexpr,
                    EP: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    cols = tl.arange(0, EP)
    ok = cols < n_experts
    _store_offsets(tl.load(counts_ptr + cols, mask=ok, other=0), cols, ok, offsets_ptr, tile_end_ptr, BM)


@triton.jit
def _scatter_kernel(idx_ptr, offsets_ptr, cursor_ptr, sorted_ptr, n_assign, n_experts,
                    BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    a = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(idx_ptr + a, mask=a < n_assign, other=-1)
    ok = (e >= 0) & (e < n_experts)
    e = tl.where(ok, e, 0)
    rank = tl.atomic_add(cursor_ptr + e, 1, mask=ok)
    pos = tl.load(offsets_ptr + e, mask=ok, other=0) + rank
    tl.store(sorted_ptr + pos, a, mask=ok)


@triton.jit
def _tile(t, counts_ptr, offsets_ptr, tile_end_ptr, n_experts, BM: tl.constexpr, EP: tl.constexpr):
    """Expert of tile t, its first sorted position and the end of the expert's rows (t must be
    below the tiles in use)."""
    cols = tl.arange(0, EP)
    ends = tl.load(tile_end_ptr + cols, mask=cols < n_experts, other=2147483647)
    e = tl.sum((ends <= t).to(tl.int32), axis=0)
    count = tl.load(counts_ptr + e)
    first_tile = tl.load(tile_end_ptr + e) - (count + BM - 1) // BM
    start = tl.load(offsets_ptr + e)
    return e, start + (t - first_tile) * BM, start + count


# ---- activation ---------------------------------------------------------------------------------

@triton.jit
def _tanh(x):
    """tanh in fp32 from exp (Triton has no portable tanh): a short series near 0, where
    1 - e^-2|x| would cancel."""
    ax = tl.abs(x)
    t = tl.exp(-2.0 * ax)
    big = (1.0 - t) / (1.0 + t)
    x2 = ax * ax
    series = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    r = tl.where(ax < 0.0625, series, big)
    return tl.where(x < 0, -r, r)


@triton.jit
def _glu(g, u, beta, linear_beta, SITU: tl.constexpr, LINEAR_BETA: tl.constexpr):
    """norms.glu_activation in fp32: SiTU-GLU (beta·tanh(g/beta)·σ(g), up optionally
    linear_beta·tanh(u/linear_beta)) or SiLU-GLU."""
    if SITU:
        a = beta * _tanh(g / beta) * tl.sigmoid(g)
        if LINEAR_BETA:
            u = linear_beta * _tanh(u / linear_beta)
    else:
        a = g * tl.sigmoid(g)
    return a * u


# ---- grouped GEMMs ------------------------------------------------------------------------------

@triton.jit
def _gate_up_kernel(z_ptr, w13_ptr, h_ptr, sorted_ptr, counts_ptr, offsets_ptr, tile_end_ptr,
                    n_experts, width, inter, k, stride_z, stride_we, stride_wr, beta, linear_beta,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EP: tl.constexpr,
                    SITU: tl.constexpr, LINEAR_BETA: tl.constexpr, UPCAST: tl.constexpr,
                    PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    t = tl.program_id(0)
    if t < tl.load(tile_end_ptr + n_experts - 1):
        e, row0, row_end = _tile(t, counts_ptr, offsets_ptr, tile_end_ptr, n_experts, BM, EP)
        pos = row0 + tl.arange(0, BM)
        pos_ok = pos < row_end
        tok = tl.load(sorted_ptr + pos, mask=pos_ok, other=0) // k
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        col_ok = cols < inter
        gate_rows = w13_ptr + e.to(tl.int64) * stride_we + cols.to(tl.int64) * stride_wr
        up_rows = gate_rows + inter * stride_wr
        z_rows = z_ptr + tok.to(tl.int64) * stride_z
        acc_g = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, width, BK):
            ks = k0 + tl.arange(0, BK)
            k_ok = ks < width
            zt = tl.load(z_rows[:, None] + ks[None, :], mask=pos_ok[:, None] & k_ok[None, :], other=0.0)
            wm = col_ok[:, None] & k_ok[None, :]
            wg = tl.load(gate_rows[:, None] + ks[None, :], mask=wm, other=0.0)
            wu = tl.load(up_rows[:, None] + ks[None, :], mask=wm, other=0.0)
            if UPCAST:
                zt = zt.to(tl.float32)
                wg = wg.to(tl.float32)
                wu = wu.to(tl.float32)
            acc_g = tl.dot(zt, tl.trans(wg), acc_g, input_precision=PRECISION)
            acc_u = tl.dot(zt, tl.trans(wu), acc_u, input_precision=PRECISION)
        dt = h_ptr.dtype.element_ty
        g = to_storage(acc_g, dt).to(tl.float32)
        u = to_storage(acc_u, dt).to(tl.float32)
        h = to_storage(_glu(g, u, beta, linear_beta, SITU, LINEAR_BETA), dt)
        tl.store(h_ptr + pos.to(tl.int64)[:, None] * inter + cols[None, :], h,
                 mask=pos_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w2_ptr, y_ptr, sorted_ptr, wts_ptr, counts_ptr, offsets_ptr, tile_end_ptr,
                 n_experts, width, inter, stride_we, stride_wr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EP: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    t = tl.program_id(0)
    if t < tl.load(tile_end_ptr + n_experts - 1):
        e, row0, row_end = _tile(t, counts_ptr, offsets_ptr, tile_end_ptr, n_experts, BM, EP)
        pos = row0 + tl.arange(0, BM)
        pos_ok = pos < row_end
        a = tl.load(sorted_ptr + pos, mask=pos_ok, other=0)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        col_ok = cols < width
        w_rows = w2_ptr + e.to(tl.int64) * stride_we + cols.to(tl.int64) * stride_wr
        h_rows = h_ptr + pos.to(tl.int64) * inter
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, inter, BK):
            ks = k0 + tl.arange(0, BK)
            k_ok = ks < inter
            ht = tl.load(h_rows[:, None] + ks[None, :], mask=pos_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_rows[:, None] + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:
                ht = ht.to(tl.float32)
                wt = wt.to(tl.float32)
            acc = tl.dot(ht, tl.trans(wt), acc, input_precision=PRECISION)
        y = to_storage(acc, h_ptr.dtype.element_ty).to(tl.float32)
        y = y * tl.load(wts_ptr + a, mask=pos_ok, other=0.0)[:, None]
        tl.store(y_ptr + a.to(tl.int64)[:, None] * width + cols[None, :], y,
                 mask=pos_ok[:, None] & col_ok[None, :])


@triton.jit
def _combine_kernel(y_ptr, idx_ptr, out_ptr, n_experts, width, stride_out,
                    K: tl.constexpr, BW: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BW + tl.arange(0, BW)
    col_ok = cols < width
    acc = tl.zeros([BW], tl.float32)
    for j in tl.static_range(K):
        a = row * K + j
        e = tl.load(idx_ptr + a)
        ok = (e >= 0) & (e < n_experts)
        acc += tl.load(y_ptr + a.to(tl.int64) * width + cols, mask=col_ok & ok, other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, to_storage(acc, out_ptr.dtype.element_ty),
             mask=col_ok)


# ---- launch plan ----------------------------------------------------------------------------------

_GROUP_BLOCK = 256           # assignments per count / scatter program
GROUP_ONE_MAX = 1024         # most assignments grouped by one program (its sort keys fit int32)
_COMBINE_BW = 256


def plan(n_assign: int, small: bool | None = None, config: dict | None = None) -> dict:
    """Tiles and warps of the two grouped GEMMs; `config` overrides any of them (tuning, tests).
    Decode (few rows per expert): BM = 16, the smallest tile tl.dot takes, so an expert's weights
    are read once; long prefills: BM = 64. small: the interpreter's tiles. group: "one" (one
    program, A <= GROUP_ONE_MAX) or "three" (count, offsets, scatter)."""
    small = interpreting() if small is None else small
    cfg = dict(config or {})
    if small:
        cfg.setdefault("BM", 16)
        cfg.setdefault("BN", 32)
        cfg.setdefault("BK", 32)
        cfg.setdefault("up_stages", 1)
        cfg.setdefault("down_stages", 1)
    cfg.setdefault("BM", 16 if n_assign <= 4096 else 64)
    cfg.setdefault("BN", 64)
    cfg.setdefault("BK", 128)
    cfg.setdefault("num_warps", 4)
    cfg.setdefault("up_stages", 3)
    cfg.setdefault("down_stages", 4)
    cfg.setdefault("group", "one" if n_assign <= GROUP_ONE_MAX else "three")
    if cfg["group"] not in ("one", "three") or (cfg["group"] == "one" and n_assign > GROUP_ONE_MAX):
        raise ValueError(f"group={cfg['group']!r} for {n_assign} assignments: 'one' takes at most "
                         f"{GROUP_ONE_MAX}, else 'three'")
    return cfg


def max_tiles(n_experts: int, n_assign: int, bm: int) -> int:
    """Tiles in use are at most Σ_e cdiv(c_e, BM) <= A // BM + (experts in use)."""
    return min(n_experts, n_assign) + n_assign // bm


def group(idx: torch.Tensor, n_experts: int, bm: int, mode: str, pdl: dict) -> tuple:
    """(counts, offsets, tile_end, sorted) of the assignments in `idx` (contiguous int32):
    mode "one" (one program) or "three" (count, offsets, scatter after zeroing counters)."""
    n_assign, dev = idx.numel(), idx.device
    ep = triton.next_power_of_2(n_experts)
    offsets = torch.empty(n_experts, dtype=torch.int32, device=dev)
    tile_end = torch.empty(n_experts, dtype=torch.int32, device=dev)
    sorted_a = torch.empty(n_assign, dtype=torch.int32, device=dev)
    if mode == "one":
        counts = torch.empty(n_experts, dtype=torch.int32, device=dev)
        _group_kernel[(1,)](idx, counts, offsets, tile_end, sorted_a, n_assign, n_experts,
                            NA=triton.next_power_of_2(n_assign), EP=ep, BM=bm, **pdl)
    else:
        ints = torch.zeros(2 * n_experts, dtype=torch.int32, device=dev)     # counts, cursors
        counts, cursor = ints[:n_experts], ints[n_experts:]
        groups = (triton.cdiv(n_assign, _GROUP_BLOCK),)
        _count_kernel[groups](idx, counts, n_assign, n_experts, BLOCK=_GROUP_BLOCK, **pdl)
        _offsets_kernel[(1,)](counts, offsets, tile_end, n_experts, BM=bm, EP=ep, **pdl)
        _scatter_kernel[groups](idx, offsets, cursor, sorted_a, n_assign, n_experts, BLOCK=_GROUP_BLOCK,
                                **pdl)
    return counts, offsets, tile_end, sorted_a


def launch(z, idx, weights, w13, w2, act, beta, linear_beta, config: dict | None = None):
    """The launch sequence on checked arguments (`config`: plan overrides)."""
    n, width = z.shape
    n_experts, inter = w13.shape[0], w13.shape[1] // 2
    k = idx.shape[1]
    out = torch.empty_like(z)
    if n == 0:
        return out
    if n_experts > MAX_EXPERTS:
        raise ValueError(f"w13: {n_experts} experts; the Triton kernels hold at most {MAX_EXPERTS}")
    z = z if z.stride(1) == 1 else z.contiguous()
    w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    idx, weights = idx.contiguous(), weights.contiguous()
    n_assign = n * k
    p = plan(n_assign, config=config)
    bm, ep = p["BM"], triton.next_power_of_2(n_experts)
    dev = z.device
    pdl = pdl_launch(dev)
    counts, offsets, tile_end, sorted_a = group(idx, n_experts, bm, p["group"], pdl)
    h = torch.empty((n_assign, inter), dtype=w13.dtype, device=dev)
    y = torch.empty((n_assign, width), dtype=torch.float32, device=dev)
    tiles = max_tiles(n_experts, n_assign, bm)
    precision = target_of(dev).dot_precision(fast=False)
    upcast = upcast_dots(w13.dtype)
    _gate_up_kernel[(tiles, triton.cdiv(inter, p["BN"]))](
        z, w13, h, sorted_a, counts, offsets, tile_end, n_experts, width, inter, k, z.stride(0),
        w13.stride(0), w13.stride(1), float(beta), float(linear_beta or 1.0),
        BM=bm, BN=p["BN"], BK=p["BK"], EP=ep, SITU=act == "situ", LINEAR_BETA=linear_beta is not None,
        UPCAST=upcast, PRECISION=precision, num_warps=p["num_warps"], num_stages=p["up_stages"], **pdl)
    _down_kernel[(tiles, triton.cdiv(width, p["BN"]))](
        h, w2, y, sorted_a, weights, counts, offsets, tile_end, n_experts, width, inter,
        w2.stride(0), w2.stride(1), BM=bm, BN=p["BN"], BK=p["BK"], EP=ep, UPCAST=upcast,
        PRECISION=precision, num_warps=p["num_warps"], num_stages=p["down_stages"], **pdl)
    _combine_kernel[(n, triton.cdiv(width, _COMBINE_BW))](y, idx, out, n_experts, width, out.stride(0),
                                                          K=k, BW=_COMBINE_BW, **pdl)
    return out


@register("k31c::moe_experts", GPU_TARGETS)
def moe_experts(z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, act: str, beta: float, linear_beta: float | None) -> torch.Tensor:
    check_experts(z, idx, weights, w13, w2, act, beta, linear_beta)
    return launch(z, idx, weights, w13, w2, act, beta, linear_beta)


def aot_specs(shapes) -> list:
    """The expert launches at `shapes` (aot_spec.AotShapes): `batch` decode rows of K3.1 Pro's
    experts (latent width, bf16), constexprs from `plan`."""
    cfg = shapes.cfg
    op, dt = "k31c::moe_experts", cfg.torch_dtype
    n_experts, k = cfg.num_experts, cfg.num_experts_per_token
    p = plan(shapes.batch * k, small=False)
    ep, i32, f32 = triton.next_power_of_2(n_experts), torch.int32, torch.float32
    up = (dt == torch.float32, shapes.target.dot_precision(fast=False))
    grouping = dict(counts_ptr=i32, offsets_ptr=i32, tile_end_ptr=i32, sorted_ptr=i32)
    # the launches' integers: z, out [n, width]; w13 [E, 2 inter, width]; w2 [E, width, inter]
    width, inter, n_assign = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, shapes.batch * k
    sizes = dict(n_assign=n_assign, n_experts=n_experts)      # the grouping launches'
    if p["group"] == "one":
        group = [kernel_spec(_group_kernel, op, f"A={n_assign},E={n_experts}",
                             dict(NA=triton.next_power_of_2(n_assign), EP=ep, BM=p["BM"]),
                             dict(idx_ptr=i32, **grouping), ints=sizes)]
    else:
        group = [kernel_spec(_count_kernel, op, "count", dict(BLOCK=_GROUP_BLOCK),
                             dict(idx_ptr=i32, counts_ptr=i32), ints=sizes),
                 kernel_spec(_offsets_kernel, op, f"E={n_experts}", dict(BM=p["BM"], EP=ep),
                             dict(counts_ptr=i32, offsets_ptr=i32, tile_end_ptr=i32),
                             ints=dict(n_experts=n_experts)),
                 kernel_spec(_scatter_kernel, op, "scatter", dict(BLOCK=_GROUP_BLOCK),
                             dict(idx_ptr=i32, offsets_ptr=i32, cursor_ptr=i32, sorted_ptr=i32), ints=sizes)]
    return [
        *group,
        kernel_spec(_gate_up_kernel, op, f"{cfg.hidden_act}",
                    dict(BM=p["BM"], BN=p["BN"], BK=p["BK"], EP=ep, SITU=cfg.hidden_act == "situ",
                         LINEAR_BETA=cfg.activation_situ_linear_beta is not None, UPCAST=up[0],
                         PRECISION=up[1]),
                    dict(z_ptr=dt, w13_ptr=dt, h_ptr=dt, **grouping, beta="fp32", linear_beta="fp32"),
                    num_warps=p["num_warps"], num_stages=p["up_stages"],
                    ints=dict(n_experts=n_experts, width=width, inter=inter, k=k, stride_z=width,
                              stride_we=2 * inter * width, stride_wr=width)),
        kernel_spec(_down_kernel, op, "down",
                    dict(BM=p["BM"], BN=p["BN"], BK=p["BK"], EP=ep, UPCAST=up[0], PRECISION=up[1]),
                    dict(h_ptr=dt, w2_ptr=dt, y_ptr=f32, wts_ptr=f32, **grouping),
                    num_warps=p["num_warps"], num_stages=p["down_stages"],
                    ints=dict(n_experts=n_experts, width=width, inter=inter, stride_we=width * inter,
                              stride_wr=inter)),
        kernel_spec(_combine_kernel, op, f"k={k}", dict(K=k, BW=_COMBINE_BW),
                    dict(y_ptr=f32, idx_ptr=i32, out_ptr=dt),
                    ints=dict(n_experts=n_experts, width=width, stride_out=width)),
    ]
