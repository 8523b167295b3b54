"""Warp-specialized kernel for `k31c::dense_mla` on sm_90a (Gluon), the h200 choice; the kernel
is in `mla_dense_ws_kernel.py`.

The work is cut as in mla_dense.py: a *group* of G consecutive query rows (`rows_per_group`: the
R rows of a request in the decode layout) shares its request's latent rows, so its G x H (row,
head) pairs are one M dimension, cut into 64-pair *slabs* (one wgmma M). A program takes one
slab of one group and one split of the cache blocks; the slabs of a (group, split) are adjacent
in the grid, so they read the same blocks together. Inside a program, three partitions:

- a producer (1 warp) loads the split's 64-row cache blocks two a step, block a into buffer 0
  and block b into buffer 1, each as 9 TMA boxes of [64 keys, 64 columns] (*chunks*: 8 of
  values, the rope part) of the contiguous cache viewed as [blocks x 64, 576], each chunk with
  its own ready barrier. A buffer's chunks are released in three groups (values 0-3, 4-7, the
  rope part), so the next step's first chunks load while the last P @ V of this one still
  reads the others;
- two math warp groups in a seesaw: group 0 scores block a, group 1 block b, at the same time,
  each a chain of 9 m64 n64 wgmmas (the 64 pairs' q, in shared memory, against the block's
  keys), each issued as soon as its chunk has landed. Group 0 takes its row max, stores its P
  over block a's rope part (dead once scored) with the max, and signals; group 1 takes the
  running max from it, does the same for block b and signals back. Each group accumulates both
  blocks' values into its half of the output columns ([64, 256] fp32), rescaling when the max
  moves; each sums its own blocks' P, and the sums are added at the end.

Any row_req: the slab's rows may belong to several requests. The program runs one *pass* per
request among them (the request of the first row not yet done, then all of its rows), each over
that request's blocks below the longest of its rows' lengths; a pair whose row is not of the
pass's request sees no key in it, so its running max, sums and output do not move. The
producer alone plans the passes (from row_req / row_len; planned in the math groups too, the
passes' code made ptxas spill in their loop): it hands the math groups the step count once, and
each step's requests (of block a and of block b), first position and limit with the blocks,
through shared memory; the barrier phases run on across passes. In the decode layout a slab's
rows are one request's: one pass.

Masks: a key at or past its row's length, and a -1 block (read as zeros: negative TMA
coordinates; a pass's odd last step loads one), is no key; rows past the pass's longest length
in its last step are set to zero before they meet P (unwritten slots may hold NaN). A row with
no key gives out = 0, lse = +inf. Each program also takes a split of the blocks (`plan_splits`:
the count that fills whole waves of one program an SM, as its ~220 KB of shared memory allows;
an even number of blocks a split, so only a pass's last step can hold one block) and writes
fp32 partials (an empty split's lse is -inf) that `mla_common.merge_splits` combines.

FP8 latent rows (656 bytes: 512 e4m3, 4 fp32 scales, 64 bf16 rope): the producer waits until
all three chunk groups of a buffer are released, then loads the block's e4m3 bytes into value
chunks 4-7 (four [64, 128]-byte boxes, one a scale group, each on its own ready barrier;
shared memory has no room for a staging area), its scales into a buffer of their own (with
the first box) and its rope as before. The math group that scores the block dequantises each
group in place as its box lands (e4m3 x the row's scale, in f16: FP8 rows run the latent
products in f16, `mla_seesaw.FP8_Q_MUL`) and issues that group's two score wgmmas before the
next group's dequant, which thus runs under them.

CUDA-graph safe: the grid, splits and workspace come from static shapes only. Calls this
kernel does not take go to mla_dense.py's split kernel (FP8 rows: to mla.py's one-pass kernel;
`why_split` names the reason): another dtype, width or block size, a strided cache, more passes
than MAX_PASSES, a GPU other than sm_90, no Gluon.
"""
from __future__ import annotations

import torch
import triton

from k31c.lowering.aot_spec import descriptor_type, kernel_spec
from k31c.lowering.registry import register
from k31c.lowering.targets import targets_running
from k31c.lowering.triton import mla
from k31c.lowering.triton import mla_dense as split_dense
from k31c.lowering.triton.device import target_of
from k31c.lowering.triton.gluon_sm90 import GLUON_ERROR, why_not_sm90
from k31c.lowering.triton.mla_common import merge_spec, merge_splits, split_outputs, table_width
from k31c.lowering.triton.mla_dense_plan import MAX_SPLITS, choose_splits, rows_per_group
from k31c.lowering.triton.mla_dense_ws_kernel import BLOCK, CHUNK, NUM_WARPS
from k31c.lowering.triton.mla_seesaw import DV, FP8_ROW, WIDTH, latent_reason, scores_scale_log2

if GLUON_ERROR is None:
    from triton.experimental.gluon import language as gl
    from k31c.lowering.triton.mla_dense_ws_kernel import dense_ws_kernel

OP = "k31c::dense_mla"
VARIANT = "warp_specialized"        # the `Target.variant` name of this kernel
SLAB = 64                           # (row, head) pairs a program takes: one wgmma M
MIN_SPLIT_BLOCKS = 4                # cache blocks a split takes at least
MAX_PASSES = 8                      # requests a slab may need (more: the pass plan's unrolled
                                    # code and registers grow; such calls run the split kernel)


def layout(n_rows: int, n_heads: int, n_req: int) -> tuple[int, int, int, int]:
    """(G, groups, slabs, passes): rows a group (static shapes only), groups, 64-pair slabs a
    group, and the passes a slab can need: the rows 64 consecutive pairs can touch, at most G."""
    g = rows_per_group(n_rows, n_req)
    return (g, -(-n_rows // g), -(-(g * n_heads) // SLAB),
            min(g, -(-(SLAB - 1) // max(n_heads, 1)) + 1))


def plan_splits(programs: int, n_blocks: int, sm_count: int) -> int:
    """Splits of the `n_blocks` table columns, one program an SM: the count with the shortest
    estimated makespan in whole waves (`mla_dense_plan.choose_splits`), each split at least
    MIN_SPLIT_BLOCKS blocks, at most MAX_SPLITS (the fp32 workspace). B = 16 x R = 4 (96
    programs): 4 splits, 384 programs in 3 waves, where 1 split leaves 36 SMs idle."""
    most = min(MAX_SPLITS, n_blocks // MIN_SPLIT_BLOCKS)
    return choose_splits(max(programs, 1), n_blocks, sm_count, most)


def _layout_of(shape):
    return gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)


def why_split(q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor,
              dv: int) -> str | None:
    """Why a call with a float cache goes to the split kernel, or None when this kernel takes
    it (the device, then `_why_not_these_args`)."""
    reason = why_not_sm90(q.device)
    if reason is None and latent_cache.data_ptr() % 16:
        reason = "a cache not 16-byte aligned (TMA)"
    return reason or _why_not_these_args(q, latent_cache, block_table, dv)


def _why_not_these_args(q, latent_cache, block_table, dv) -> str | None:
    """The reasons `why_split` finds in the arguments' shapes, dtypes and layouts alone (and in
    this Triton), which the compiler's report can tell before anything runs."""
    reason = latent_reason(q, latent_cache, dv, fp8=True)
    if reason is not None:
        return reason
    if latent_cache.shape[1] != BLOCK:
        return (f"cache blocks of {latent_cache.shape[1]} rows: the kernel is written for "
                f"{BLOCK}")
    if not latent_cache.is_contiguous():
        return "a strided cache (the kernel reads it as TMA boxes of [blocks x 64, 576])"
    n, heads = q.shape[0], q.shape[1]
    _, groups, slabs, passes = layout(n, heads, block_table.shape[0])
    if passes > MAX_PASSES:
        return f"{heads} heads in groups of {n // groups} rows: a slab may need {passes} passes"
    return None


def runs(q, latent_cache, block_table, row_req, row_len, sm_scale, dv):
    """The launcher that runs a call with these arguments on an H200 (the registry's `runs`: the
    report names the kernel that runs). With a symbolic row count the choice is made at each
    call: this module's launcher, which makes it."""
    if not isinstance(q.shape[0], int) or not isinstance(block_table.shape[0], int):
        return dense_mla
    if _why_not_these_args(q, latent_cache, block_table, dv) is None:
        return dense_mla
    return mla.dense_mla if latent_cache.dtype == torch.uint8 else split_dense.dense_mla


@register(OP, targets_running(OP, VARIANT), runs=runs)
def dense_mla(q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor,
              row_req: torch.Tensor, row_len: torch.Tensor, sm_scale: float,
              dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`k31c::dense_mla`: this kernel (a bf16 cache or FP8 latent rows), or where `why_split`
    names a reason, the split kernel (a float cache) or mla.py's one-pass kernel (FP8 rows)."""
    split_dense.check_dense(q, latent_cache, block_table, row_req, row_len, dv)
    if why_split(q, latent_cache, block_table, dv) is not None:
        if latent_cache.dtype == torch.uint8:
            return mla.dense_mla(q, latent_cache, block_table, row_req, row_len, sm_scale, dv)
        return split_dense.launch(q, latent_cache, block_table, row_req, row_len, sm_scale, dv)
    return launch(q, latent_cache, block_table, row_req, row_len, sm_scale)


def key_descriptors(latent_cache: torch.Tensor) -> tuple:
    """The kernel's three Gluon TMA descriptors. A bf16 cache: itself viewed as
    [blocks x 64, 576], one [64, 64] box (a chunk) a load (576 = 9 x 64, so the values and the
    rope part are boxes of one descriptor), three times. FP8 latent rows (656 bytes): the e4m3
    bytes as [64, 128]-byte boxes, the 4 fp32 scales of 64 rows, and the bf16 rope as a [64, 64]
    box, each over its view of the rows."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if latent_cache.dtype != torch.uint8:
        flat = latent_cache.view(-1, WIDTH)
        one = TensorDescriptor(flat, [flat.shape[0], WIDTH], [WIDTH, 1], [BLOCK, CHUNK],
                               _layout_of([BLOCK, CHUNK]))
        return one, one, one
    views = [latent_cache.view(dt).view(-1, FP8_ROW // size)
             for dt, size in ((torch.uint8, 1), (torch.float32, 4), (torch.bfloat16, 2))]
    boxes = ([BLOCK, 128], [BLOCK, 4], [BLOCK, CHUNK])
    return tuple(TensorDescriptor(v, list(v.shape), [v.shape[1], 1], box, layout)
                 for v, box, layout in zip(views, boxes, _fp8_layouts()))


def _fp8_layouts() -> tuple:
    # the shared layouts of the FP8 descriptors' boxes: e4m3 bytes, scales, rope
    return (gl.NVMMASharedLayout.get_default_for([BLOCK, 128], gl.uint8),
            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2),
            _layout_of([BLOCK, CHUNK]))


def blocks_per_split(max_blocks: int, splits: int) -> int:
    """The table columns a split takes: an even number (two blocks a step)."""
    per = -(-max_blocks // splits)
    return per + (per & 1)


def launch(q, latent_cache, block_table, row_req, row_len, sm_scale, splits: int | None = None):
    """This kernel's launch on checked arguments (callers check `why_split` first); `splits`
    overrides `plan_splits` (tests, benchmarks)."""
    n, heads, _ = q.shape
    n_req, max_blocks = block_table.shape
    out = q.new_empty((n, heads, DV))
    lse = q.new_empty((n, heads), dtype=torch.float32)
    if n == 0 or heads == 0:
        return out, lse
    if max_blocks == 0 or latent_cache.shape[0] == 0:           # no position has a key
        return out.zero_(), lse.fill_(float("inf"))
    g, groups, slabs, passes = layout(n, heads, n_req)
    if splits is None:
        splits = plan_splits(groups * slabs, max_blocks, target_of(q.device).sm_count)
    dst, dst_lse, empty_lse = split_outputs(out, lse, splits)
    fp8 = latent_cache.dtype == torch.uint8
    dense_ws_kernel[(groups * slabs * splits,)](
        q, *key_descriptors(latent_cache), block_table, row_req, row_len, dst, dst_lse, n, heads,
        n_req, g, slabs, splits, blocks_per_split(max_blocks, splits), max_blocks, q.stride(0),
        q.stride(1), block_table.stride(0), scores_scale_log2(sm_scale, fp8), empty_lse,
        PASSES=passes, ROWS=triton.next_power_of_2(passes), FP8=fp8, num_warps=NUM_WARPS)
    if splits > 1:
        merge_splits(dst, dst_lse, out, lse)
    return out, lse


def aot_specs(shapes) -> list:
    """The launches at `shapes` (aot_spec.AotShapes): for each row count a request where this
    kernel runs, its launch with the planned splits and their merge; where the split kernel
    runs (a model this kernel is not written for, too many passes), mla_dense.py's launches."""
    cfg = shapes.cfg
    heads, dt, sm = cfg.num_attention_heads, cfg.torch_dtype, shapes.target.sm_count
    table = table_width(shapes)
    fits = (GLUON_ERROR is None and dt == torch.bfloat16 and shapes.block_size == BLOCK
            and (cfg.latent_dim, cfg.kv_lora_rank) == (WIDTH, DV))
    specs, split_rows = [], set()
    for r in shapes.rows_per_request:
        n = shapes.batch * r
        g, groups, slabs, passes = layout(n, heads, shapes.batch)
        if not fits or passes > MAX_PASSES:
            split_rows.add(f"R={r}")
            continue
        splits = plan_splits(groups * slabs, table, sm)
        ints = dict(n_rows=n, n_heads=heads, n_req=shapes.batch, group_rows=g, n_slabs=slabs,
                    n_splits=splits, blocks_per_split=blocks_per_split(table, splits),
                    max_blocks=table,
                    stride_qn=heads * WIDTH, stride_qh=WIDTH, stride_bt=table)
        one = descriptor_type(dt, (BLOCK, CHUNK), _layout_of([BLOCK, CHUNK]))
        fp8 = [descriptor_type(t, box, layout) for t, box, layout in
               zip((torch.uint8, torch.float32, dt), ((BLOCK, 128), (BLOCK, 4), (BLOCK, CHUNK)),
                   _fp8_layouts())]
        for rows_fp8, descs in ((False, [one] * 3), (True, fp8)):
            specs.append(kernel_spec(
                dense_ws_kernel, OP, f"{'fp8,' if rows_fp8 else ''}R={r},splits={splits}",
                dict(PASSES=passes, ROWS=triton.next_power_of_2(passes), FP8=rows_fp8,
                     num_warps=NUM_WARPS),
                dict(q_ptr=dt, table_ptr=torch.int32, req_ptr=torch.int32, len_ptr=torch.int32,
                     out_ptr=dt if splits == 1 else torch.float32, lse_ptr=torch.float32,
                     scale_log2="fp32", empty_lse="fp32",
                     **dict(zip(("desc", "desc_scale", "desc_rope"), descs))),
                num_warps=NUM_WARPS, ints=ints))
        if splits > 1:
            specs.append(merge_spec(OP, DV, dt, n, heads, splits))
    # the split kernel's launches (its variants "R=<r>,final|split" and its merge)
    split_specs = split_dense.aot_specs(shapes) if split_rows else []
    return specs + [s for s in split_specs if s.variant.split(",")[0] in split_rows
                    or s.variant == "merge"]
