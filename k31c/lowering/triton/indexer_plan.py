"""The launch plan of the lightning indexer's Triton kernels (`indexer.launch_indexer` runs it,
and `indexer.aot_specs` builds what it plans): which kernel (gather, TMA or warp-specialized),
the dot's operand type, rows a tile, keys a step, key splits and warps."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from k31c.lowering.targets import Target
from k31c.lowering.triton import indexer_ws

OP = "k31c::lightning_indexer"
MX_VARIANT = "tma"          # the MXFP8 cache's kernel: the TMA kernel's MX form (measured faster)
_MAX_TILE_M = 256           # rows x heads per tl.dot (accumulator [keys, M] in registers)
_GPU_KEYS_PER_STEP = 128
_CPU_KEYS_PER_STEP = 32
_MIN_STEPS_PER_PROGRAM = 8  # fewer steps and the per-program q load/quantisation stops paying
_PROGRAMS_PER_SM = 4        # grid ≈ 2 rounds of the 2 resident programs per SM (the fastest
                            # measured on the H200; a lone request gets them all)
_TMA_PROGRAMS_PER_SM = 3    # tma grid target (with q_rcp=False sm_90a gives 255 registers at
                            # R=4, so 2 are resident: 1.5 rounds)
VARIANTS = ("gather", "tma", "warp_specialized")


def check_variant(variant) -> None:
    """A ValueError naming the known kernels for an unknown `variant`."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {', '.join(map(repr, VARIANTS))}, got {variant!r}")


def _tile_rows(n_rows: int, n_req: int, h_pad: int) -> tuple[int, int]:
    """Rows per tile (and its power-of-two padding): a request's R rows when N = B·R fits one dot."""
    max_rows = max(1, _MAX_TILE_M // h_pad)
    per_req = n_rows // n_req if n_req and n_rows % n_req == 0 else 0
    rows = per_req if 1 <= per_req <= max_rows else max(1, min(max_rows, 128 // h_pad))
    rows_pad = max(triton.next_power_of_2(rows), triton.cdiv(16, h_pad))   # tl.dot needs M >= 16
    return rows, rows_pad


@dataclass(frozen=True)
class IndexerPlan:
    """The launch configuration of one lightning_indexer call shape, for either kernel."""
    variant: str          # "gather", "tma" or "warp_specialized"
    on_gpu: bool
    fp8: bool             # FP8 (uint8) cache
    quant_q: bool         # q quantised to e4m3 like the keys
    dot_dtype: object     # tl.dot operand type
    heads: int
    h_pad: int
    d: int
    rows: int             # rows per tile
    rows_pad: int
    keys: int             # keys per step (the block size for tma)
    splits: int           # programs per tile along the keys
    num_warps: int
    num_stages: int
    head_dot: bool        # the weighted head sum as a second tl.dot
    hw_quant: bool        # gather: hardware e4m3 conversion of q

    @property
    def out(self) -> int:
        return max(16, self.rows_pad) if self.head_dot else self.rows_pad

    def common_constexprs(self, block_size: int) -> dict:
        return dict(ROWS=self.rows, ROWS_PAD=self.rows_pad, H=self.heads, H_PAD=self.h_pad,
                    D=self.d, BLOCK_SIZE=block_size, TAIL=(4096 if self.on_gpu else 256) // self.out,
                    FP8_CACHE=self.fp8, QUANT_Q=self.quant_q, DOT_DTYPE=self.dot_dtype,
                    HEAD_DOT=self.head_dot,
                    HEAD_DTYPE=tl.float32 if self.dot_dtype == tl.float32 else tl.bfloat16,
                    OUT=self.out, NUM_STAGES=self.num_stages)

    def gather_constexprs(self, block_size: int) -> dict:
        return dict(self.common_constexprs(block_size), D_PAD=max(16, triton.next_power_of_2(self.d)),
                    KEYS=self.keys, HW_CVT=bool(self.hw_quant and self.quant_q and self.on_gpu))


def plan(target: Target, n: int, heads: int, d: int, n_req: int, capacity: int, block_size: int,
         cache_dtype: torch.dtype, q_width: int | None = None, *, tma_ok: bool = True,
         ws_ok: bool = False,
         keys_per_step=None, splits=None, quant_q=None, exact_dot=False, head_dot=False,
         num_warps=None, num_stages=5, variant=None, hw_quant=False,
         programs_per_sm=None) -> IndexerPlan:
    """cache_dtype: uint8 for the FP8 layout; tma_ok: whether the cache can be read by the TMA
    kernel (`indexer_tma.tma_supported`); ws_ok: whether indexer_ws takes the call
    (`indexer_ws.why_not` found nothing); the knobs as `launch_indexer`'s."""
    if variant is None:
        variant = target.variant(OP, "tma")
    check_variant(variant)
    on_gpu = target.device == "cuda"
    fp8 = cache_dtype == torch.uint8
    if quant_q is None:
        quant_q = fp8 and on_gpu
    if not on_gpu or exact_dot or cache_dtype == torch.float32:
        dot_dtype = tl.float32            # the interpreter's 16-bit and fp8 dots are not trusted
    elif fp8:
        # an FP8 tl.dot needs an inner size >= 32; below it, bf16 holds e4m3 values exactly
        dot_dtype = tl.float8e4nv if quant_q and d >= 32 else tl.bfloat16
    else:
        dot_dtype = tl.bfloat16 if cache_dtype == torch.bfloat16 else tl.float16
    if fp8 and not quant_q and dot_dtype == tl.bfloat16:
        dot_dtype = tl.float32            # unquantised q must keep its precision against e4m3 keys
    h_pad = triton.next_power_of_2(heads)
    rows, rows_pad = _tile_rows(n, n_req, h_pad)
    if variant == "warp_specialized" and not ws_ok:
        variant = "tma"
    if variant == "tma" and not tma_ok:
        variant = "gather"
    keys = block_size if variant != "gather" else (
        keys_per_step or (_GPU_KEYS_PER_STEP if on_gpu else _CPU_KEYS_PER_STEP))
    tiles = triton.cdiv(n, rows)
    if splits is None and variant == "warp_specialized":
        splits = indexer_ws.plan_splits(n, capacity, target.sm_count)
    elif splits is None:   # fill the GPU with the tiles there are (one request: all programs are its)
        if variant == "tma":   # no rounding up: 3 x SMs programs (168 registers with q_rcp: one round)
            target_programs = (programs_per_sm or _TMA_PROGRAMS_PER_SM) * target.sm_count // tiles
        else:
            target_programs = triton.cdiv((programs_per_sm or _PROGRAMS_PER_SM) * target.sm_count, tiles)
        splits = max(1, min(target_programs, triton.cdiv(capacity, keys * _MIN_STEPS_PER_PROGRAM)))
    if num_warps is None and variant == "gather":
        num_warps = 8 if rows_pad * h_pad > 128 else 4
    elif variant == "warp_specialized":
        num_warps = indexer_ws.NUM_WARPS
    return IndexerPlan(variant, on_gpu, fp8, quant_q, dot_dtype, heads, h_pad, d, rows, rows_pad,
                       keys, splits, num_warps, num_stages, head_dot, hw_quant)


def mx_plan(target: Target, n: int, heads: int, d: int, n_req: int, capacity: int, block_size: int,
            *, tma_ok: bool = True, variant=None, **knobs) -> IndexerPlan:
    """The plan for an MXFP8 cache: variant None is `MX_VARIANT`. "tma" (where the layout allows
    it) plans the TMA kernel as for a bf16 cache (the keys become exact bf16 on chip: 16-bit
    dots on the GPU, fp32 in the interpreter); "gather" plans indexer_mxfp8's kernel on the gather
    tiling."""
    variant = MX_VARIANT if variant is None else variant
    if variant == "tma" and tma_ok:
        return plan(target, n, heads, d, n_req, capacity, block_size, torch.bfloat16,
                    variant="tma", **knobs)
    knobs.pop("head_dot", None)
    knobs.pop("exact_dot", None)
    return plan(target, n, heads, d, n_req, capacity, block_size, torch.uint8, variant="gather",
                **knobs)
