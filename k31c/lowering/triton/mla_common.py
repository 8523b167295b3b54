"""What the MLA kernels share (mla.py: the one-pass kernel, dense decode; mla_two_pass.py: the
two-pass sparse kernel; spec/model.md §5.4): the argument checks, the head tiling (96 heads =
one 64-head tile + one 32-head tile, no padding to 128), the kernel that resolves sparse
index lists to physical cache slots once, so the attention loops have one level of indirection,
the on-chip dequantisation of FP8 latent rows (`fp8_latent_cols`, `rope_latent_cols`), and the
merge of key-split partial outputs by their LSE (`merge_splits`, for mla.py and mla_dense.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k31c.graph.ops.fp8_layouts import latent_fp8_nope, latent_fp8_scales
from k31c.lowering.aot_spec import kernel_spec
from k31c.lowering.triton.device import pdl_launch, wait_for_producers

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# float8_e4m3fn: raw e4m3 rows upcast on load with no scale (a benchmark comparison, no op's
# format); uint8: the FP8 latent layout (graph/ops/fp8_layouts.py), dequantised on chip
CACHE_DTYPES = FLOATS + (torch.float8_e4m3fn, torch.uint8)
LOG2E = 1.4426950408889634


# ---- FP8 latent rows: dequantisation on chip ------------------------------------------------------
# A row of the uint8 FP8 latent cache starts at byte offset row_off: NOPE e4m3 values, N_SCALES
# fp32 scales (one per 128 values), then the rope part as bf16. The kernels receive three views of
# the same cache (uint8, float32, bfloat16) and index each in its own units.

@triton.jit
def fp8_latent_cols(cache_ptr, scale_ptr, row_off, row_ok, col0, C: tl.constexpr, NOPE: tl.constexpr):
    """Latent columns [col0, col0 + C) of rows at byte offsets row_off [R], dequantised to fp32
    [R, C]; columns at or past NOPE and rows not row_ok read 0. Chunks sit inside the scale groups:
    C <= 128 dividing 128 with col0 a multiple of C (one scale a row), or C and col0 multiples of 128."""
    cols = col0 + tl.arange(0, C)
    ok = row_ok[:, None] & (cols < NOPE)[None, :]
    x = tl.load(cache_ptr + row_off[:, None] + cols[None, :], mask=ok, other=0)
    x = x.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    scale_at = (row_off + NOPE) // 4 + col0 // 128                     # fp32 units
    if C <= 128:      # (if/else, not an early return: the compiler traces past a return)
        s = tl.load(scale_ptr + scale_at, mask=row_ok, other=0.0)
        x = x * s[:, None]
    else:
        G: tl.constexpr = C // 128
        g = tl.arange(0, G)
        s = tl.load(scale_ptr + scale_at[:, None] + g[None, :],
                    mask=row_ok[:, None] & (col0 + g * 128 < NOPE)[None, :], other=0.0)
        x = tl.reshape(tl.reshape(x, (x.shape[0], G, 128)) * s[:, :, None], (x.shape[0], C))
    return x


@triton.jit
def rope_latent_cols(rope_ptr, row_off, row_ok, col0, C: tl.constexpr, NOPE: tl.constexpr,
                     N_SCALES: tl.constexpr, WIDTH: tl.constexpr):
    """Latent columns [col0, col0 + C) (all >= NOPE) of FP8 latent rows: the bf16 rope part, as
    fp32 [R, C]; columns at or past WIDTH read 0."""
    cols = col0 + tl.arange(0, C)
    at = (row_off + NOPE + 4 * N_SCALES) // 2                          # bf16 units
    return tl.load(rope_ptr + at[:, None] + (cols - NOPE)[None, :],
                   mask=row_ok[:, None] & (cols < WIDTH)[None, :], other=0.0).to(tl.float32)


def fp8_latent_views(latent_cache: torch.Tensor) -> tuple:
    """(uint8, float32, bfloat16) views of a cache (the same tensor three times unless FP8)."""
    if latent_cache.dtype != torch.uint8:
        return latent_cache, latent_cache, latent_cache
    return latent_cache, latent_cache.view(torch.float32), latent_cache.view(torch.bfloat16)


def fp8_latent_consts(latent_cache: torch.Tensor, width: int) -> dict:
    """The FP8 layout's constexprs (FP8, NOPE, N_SCALES) of a cache of `width`-wide rows."""
    if latent_cache.dtype != torch.uint8:
        return dict(FP8=False, NOPE=width, N_SCALES=0)
    nope = latent_fp8_nope(latent_cache.shape[2], width)
    return dict(FP8=True, NOPE=nope, N_SCALES=latent_fp8_scales(nope))


@triton.jit
def slots_kernel(idx_ptr, bt_ptr, row_req_ptr, slots_ptr, n_keys, stride_in, stride_btb,
                 stride_sn, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Physical slot of every selected position (-1 stays -1): the sparse index lists resolved
    once, so the attention loop has a single level of indirection to pipeline."""
    wait_for_producers(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < n_keys
    pos = tl.load(idx_ptr + t.to(tl.int64) * stride_in + offs, mask=in_range, other=-1)
    b = tl.load(row_req_ptr + t)
    blk = tl.load(bt_ptr + b.to(tl.int64) * stride_btb + tl.maximum(pos, 0) // BLOCK_SIZE,
                  mask=pos >= 0, other=0)
    slot = tl.where(pos >= 0, blk * BLOCK_SIZE + tl.maximum(pos, 0) % BLOCK_SIZE, -1)
    tl.store(slots_ptr + t.to(tl.int64) * stride_sn + offs, slot, mask=in_range)


SLOTS_BLOCK = 256           # positions per slots_kernel program


def resolve_slots(indices: torch.Tensor, block_table: torch.Tensor, row_req: torch.Tensor,
                  block_size: int) -> torch.Tensor:
    """Physical slots of `indices` [N, k] (-1 stays -1), one launch of slots_kernel."""
    n, n_keys = indices.shape
    slots = torch.empty_like(indices)
    slots_kernel[(n, triton.cdiv(n_keys, SLOTS_BLOCK))](
        indices, block_table, row_req, slots, n_keys, indices.stride(0), block_table.stride(0),
        slots.stride(0), BLOCK_SIZE=block_size, BLOCK=SLOTS_BLOCK, num_warps=4, **pdl_launch(indices.device))
    return slots


def slots_spec(shapes, op: str):
    """The AOT build of resolve_slots' launch at `shapes` (aot_spec.AotShapes)."""
    i32, k = torch.int32, shapes.cfg.index_topk
    return kernel_spec(slots_kernel, op, "slots", dict(BLOCK_SIZE=shapes.block_size, BLOCK=SLOTS_BLOCK),
                       dict(idx_ptr=i32, bt_ptr=i32, row_req_ptr=i32, slots_ptr=i32),
                       ints=dict(n_keys=k, stride_in=k, stride_btb=table_width(shapes), stride_sn=k))


def table_width(shapes) -> int:
    """Blocks per request in the block table at `shapes` (its row stride in the AOT builds)."""
    return -(-shapes.context // shapes.block_size)


MAX_GRID_ROWS = 65535      # CUDA's limit on grid dims y and z, where the MLA launches put the rows


def in_row_slices(launch, n: int, *row_args):
    """launch(*row_args) on at most MAX_GRID_ROWS rows at a time (a long prefill step can have
    more rows than a grid dimension allows); each row_arg is sliced along dim 0 and the
    (out, lse) pairs are concatenated."""
    if n <= MAX_GRID_ROWS:
        return launch(*row_args)
    parts = [launch(*(a[s:s + MAX_GRID_ROWS] for a in row_args)) for s in range(0, n, MAX_GRID_ROWS)]
    return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])


def head_tiles(n_heads: int, big: int, min_tile: int) -> tuple[int, int, int]:
    """(BIG_HT, N_BIG, SMALL_HT): full tiles of `big` heads, then one power-of-two tile for the rest
    (96 = 64 + 32: no head is padded unless the rest is not a power of two)."""
    n_big = n_heads // big
    rest = n_heads - n_big * big
    small = max(min_tile, triton.next_power_of_2(rest)) if rest else big
    if n_big == 0:   # fewer heads than one big tile: a single small tile
        return small, 1, small
    return big, n_big, small


# ---- argument checks (shapes and dtypes only: nothing here reads device memory) -----------------

def check_mla_args(q, latent_cache, block_table, row_req, dv, keys, keys_name) -> None:
    if q.dim() != 3 or q.dtype not in FLOATS or q.stride(2) != 1:
        raise ValueError(f"q: expected a float [N, Hq, Dl] tensor with unit last stride, got "
                         f"{q.dtype} {tuple(q.shape)} strides {q.stride()}")
    if (latent_cache.dim() != 3 or latent_cache.dtype not in CACHE_DTYPES
            or latent_cache.stride(2) != 1):
        raise ValueError(f"latent_cache: expected [num_blocks, block_size, Dl] (float or fp8 e4m3) "
                         f"with unit last stride, got {latent_cache.dtype} {tuple(latent_cache.shape)}")
    if latent_cache.dtype == torch.uint8:
        nope = latent_fp8_nope(latent_cache.shape[2], q.shape[2])
        if dv != nope:
            raise ValueError(f"dv={dv}: the Triton MLA kernels read the values of an FP8 latent cache "
                             f"as its e4m3 part, which is {nope} wide")
        if not latent_cache.is_contiguous():
            raise ValueError("latent_cache: an FP8 latent cache must be contiguous")
    elif latent_cache.shape[2] != q.shape[2]:
        raise ValueError(f"q is {q.shape[2]} wide but latent_cache rows are "
                         f"{latent_cache.shape[2]} wide")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.stride(1) != 1:
        raise ValueError(f"block_table: expected contiguous-row int32 [B, max_blocks], got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    n = q.shape[0]
    if row_req.dtype != torch.int32 or tuple(row_req.shape) != (n,) or not row_req.is_contiguous():
        raise ValueError(f"row_req: expected contiguous int32 [{n}], got {row_req.dtype} "
                         f"{tuple(row_req.shape)}")
    if not isinstance(dv, int) or not 0 < dv <= q.shape[2]:
        raise ValueError(f"dv must be an integer in 1..{q.shape[2]} (the row width), got {dv!r}")
    if keys.dtype != torch.int32 or keys.shape[0] != n or keys.stride(-1) != 1:
        raise ValueError(f"{keys_name}: expected int32 with {n} rows and unit last stride, got "
                         f"{keys.dtype} {tuple(keys.shape)}")
    devices = {t.device for t in (q, latent_cache, block_table, row_req, keys)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


MERGE_HEADS = 8          # heads per merge program


@triton.jit
def merge_splits_kernel(part_ptr, part_lse_ptr, out_ptr, lse_ptr, n_splits, n_heads,
                        stride_ps, stride_pn, stride_ph, stride_pls, stride_pln,
                        stride_on, stride_oh, stride_ln,
                        DV: tl.constexpr, BLOCK_V: tl.constexpr, HB: tl.constexpr,
                        PDL: tl.constexpr = False):
    """out[t, h] = Σ_s exp(lse_s - lse) · part_s[t, h], lse = log Σ_s exp(lse_s) (+inf if none)."""
    wait_for_producers(PDL)
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * HB + tl.arange(0, HB)
    offs_v = tl.arange(0, BLOCK_V)
    h_mask = offs_h < n_heads
    hv_mask = h_mask[:, None] & (offs_v < DV)[None, :]
    lse_row = part_lse_ptr + t.to(tl.int64) * stride_pln + offs_h
    m = tl.full([HB], float("-inf"), tl.float32)
    for s in range(n_splits):
        m = tl.maximum(m, tl.load(lse_row + s * stride_pls, mask=h_mask, other=float("-inf")))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, BLOCK_V], tl.float32)
    for s in range(n_splits):
        lse_s = tl.load(lse_row + s * stride_pls, mask=h_mask, other=float("-inf"))
        w = tl.exp(lse_s - m_use)                                # 0 for an empty split
        part = tl.load(part_ptr + s * stride_ps + t.to(tl.int64) * stride_pn
                       + offs_h[:, None] * stride_ph + offs_v[None, :],
                       mask=hv_mask & (lse_s > float("-inf"))[:, None], other=0.0)
        acc += w[:, None] * part
        den += w
    has_key = den > 0.0
    out = acc / tl.where(has_key, den, 1.0)[:, None]
    lse = tl.where(has_key, m_use + tl.log(tl.where(has_key, den, 1.0)), float("inf"))
    tl.store(out_ptr + t.to(tl.int64) * stride_on + offs_h[:, None] * stride_oh + offs_v[None, :],
             out.to(out_ptr.dtype.element_ty), mask=hv_mask)
    tl.store(lse_ptr + t.to(tl.int64) * stride_ln + offs_h, lse, mask=h_mask)


def key_splits(programs: int, n_keys: int, keys_step: int, min_steps: int, sm_count: int) -> int:
    """Key splits each of `programs` takes: as many as keep every program on an SM of its own
    (one wave), each at least `min_steps` steps of `keys_step` keys; 1 when the programs alone
    fill the SMs."""
    steps = -(-n_keys // keys_step)
    return max(1, min(sm_count // max(programs, 1), steps // min_steps))


def split_width(n_keys: int, splits: int, keys_step: int) -> int:
    """Keys a split takes: a whole number of `keys_step`-key steps (the kernels' split
    boundaries)."""
    return -(-n_keys // (splits * keys_step)) * keys_step


def sparse_outputs(q: torch.Tensor, n_keys: int, dv: int):
    """out [N, Hq, dv] and lse [N, Hq] of a sparse MLA call on q [N, Hq, ...] with `n_keys`
    selected keys a row, and whether they are already its result (no row, head or key: a row
    with no key has out 0 and lse +inf). Returns (out, lse, done)."""
    n, n_heads = q.shape[:2]
    out = q.new_empty((n, n_heads, dv))
    lse = q.new_empty((n, n_heads), dtype=torch.float32)
    if n == 0 or n_heads == 0:
        return out, lse, True
    if n_keys == 0:
        return out.zero_(), lse.fill_(float("inf")), True
    return out, lse, False


def split_outputs(out: torch.Tensor, lse: torch.Tensor, splits: int):
    """Where a kernel of `splits` key splits writes: out and lse themselves (an empty row's lse
    +inf) for one split, else fp32 partials [S, N, Hq, dv] / [S, N, Hq] (an empty split's lse
    -inf: no weight in `merge_splits`). Returns (dst, dst_lse, empty_lse)."""
    if splits == 1:
        return out, lse, float("inf")
    return (out.new_empty((splits, *out.shape), dtype=torch.float32),
            lse.new_empty((splits, *lse.shape), dtype=torch.float32), float("-inf"))


def merge_splits(part: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """out [N, Hq, dv], lse [N, Hq] from the splits' partial outputs [S, N, Hq, dv] and LSEs [S, N, Hq]."""
    splits, n, n_heads, dv = part.shape
    merge_splits_kernel[(n, triton.cdiv(n_heads, MERGE_HEADS))](
        part, part_lse, out, lse, splits, n_heads,
        part.stride(0), part.stride(1), part.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        DV=dv, BLOCK_V=max(16, triton.next_power_of_2(dv)), HB=MERGE_HEADS, num_warps=4,
        **pdl_launch(part.device))


def merge_spec(op: str, dv: int, dt: torch.dtype, n: int, n_heads: int, splits: int):
    """The AOT spec of `merge_splits` for `op`'s launcher (outputs in dt) merging `splits`
    partials [splits, n, heads, dv] into out [n, heads, dv]."""
    f32 = torch.float32
    ints = dict(n_splits=splits, n_heads=n_heads, stride_ps=n * n_heads * dv, stride_pn=n_heads * dv,
                stride_ph=dv, stride_pls=n * n_heads, stride_pln=n_heads, stride_on=n_heads * dv,
                stride_oh=dv, stride_ln=n_heads)
    return kernel_spec(merge_splits_kernel, op, "merge",
                       dict(DV=dv, BLOCK_V=max(16, triton.next_power_of_2(dv)), HB=MERGE_HEADS),
                       dict(part_ptr=f32, part_lse_ptr=f32, out_ptr=dt, lse_ptr=f32), ints=ints)
