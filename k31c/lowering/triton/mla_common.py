"""What the MLA kernels share (mla.py: the one-pass kernel, dense decode; mla_two_pass.py: the
two-pass sparse kernel; spec/model.md §5.4): the argument checks, the head tiling (96 heads =
one 64-head tile + one 32-head tile, no padding to 128), and the kernel that resolves sparse
index lists to physical cache slots once, so the attention loops have one level of indirection."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
CACHE_DTYPES = FLOATS + (torch.float8_e4m3fn,)   # FP8 latent rows are upcast on load (no scale)
LOG2E = 1.4426950408889634


@triton.jit
def slots_kernel(idx_ptr, bt_ptr, row_req_ptr, slots_ptr, n_keys, stride_in, stride_btb,
                 stride_sn, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """Physical slot of every selected position (-1 stays -1): the sparse index lists resolved
    once, so the attention loop has a single level of indirection to pipeline."""
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
        slots.stride(0), BLOCK_SIZE=block_size, BLOCK=SLOTS_BLOCK, num_warps=4)
    return slots


def slots_spec(shapes, op: str):
    """The AOT build of resolve_slots' launch at `shapes` (aot_spec.AotShapes)."""
    from k31c.lowering.aot_spec import kernel_spec
    i32 = torch.int32
    return kernel_spec(slots_kernel, op, "slots", dict(BLOCK_SIZE=shapes.block_size, BLOCK=SLOTS_BLOCK),
                       dict(idx_ptr=i32, bt_ptr=i32, row_req_ptr=i32, slots_ptr=i32))


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
    if latent_cache.shape[2] != q.shape[2]:
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
