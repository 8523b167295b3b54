"""The launch plan of the split-key dense MLA kernel (`mla_dense.py` runs it, and its
`aot_specs` builds what it plans): tile sizes, warps, stages, rows per group, key splits, and
whether the full key steps can load TMA boxes."""
from __future__ import annotations

import functools

import triton

from k31c.lowering.targets import Target
from k31c.lowering.triton.device import interpreting


MAX_SPLITS = 64           # bounds the workspace: splits x N x Hq x dv fp32


def rows_per_group(n_rows: int, n_req: int) -> int:
    """G: the query rows that share a request in the decode layout (rows b·R .. b·R + R - 1),
    from static shapes only; 1 when N is not a multiple of the request count."""
    return n_rows // n_req if n_req > 0 and n_rows >= n_req and n_rows % n_req == 0 else 1


@functools.lru_cache(maxsize=256)   # every direct launch asks (12-25 us of Python a call)
def choose_splits(programs: int, n_blocks: int, slots: int, most: int) -> int:
    """The split count with the shortest estimated makespan: waves of `slots` concurrent programs
    x key blocks per split (programs = tiles; one split = one program per tile). The smallest
    such count within 3% of the best, so partials are written only where they pay."""
    costs = [(-(-(programs * s) // slots) * -(-n_blocks // s), s) for s in range(1, max(1, most) + 1)]
    lowest = min(costs)[0]
    return next(s for c, s in costs if c <= lowest * 1.03)


def block_cols(width: int, dv: int) -> int:
    """Columns of the kernel's row tiles: dv and the rest, each padded to a power of two."""
    rest = width - dv
    return max(16, triton.next_power_of_2(dv)) + (max(16, triton.next_power_of_2(rest)) if rest else 0)


def shared_bytes(bm: int, bn: int, cols: int, elem: int) -> int:
    """Shared memory of one program as Triton 3.6/3.7 lay it out for sm_90a: q [bm, cols], two
    [bn, cols] key buffers, the [bm, bn] probabilities exchanged between the warp groups."""
    return (bm + 2 * bn) * cols * elem + bm * bn * elem


def plan(target: Target, n_rows: int, n_heads: int, n_req: int, capacity: int,
         config: dict | None = None, small: bool | None = None, cols: int = 576,
         elem: int = 2) -> dict:
    """Tile sizes, warps, stages, rows per group and key splits for N rows of Hq heads, `n_req`
    requests in the block table and `capacity` = block-table width x block size keys, row tiles
    of `cols` (block_cols) elements of `elem` bytes. `config` overrides any of them (tuning,
    tests); small: the interpreter's small tiles (None: when interpreting or off the GPU)."""
    cfg = dict(config or {})
    if small is None:
        small = interpreting() or target.device != "cuda"
    if small:
        cfg.setdefault("bm", 16)
        cfg.setdefault("bn", 32)
        cfg.setdefault("num_warps", 4)
        cfg.setdefault("num_stages", 1)
    # 64 M-rows (one m64 wgmma row block; a [64, 512] fp32 accumulator over 8 warps), 64 keys a
    # step ([64, 576] bf16 = 72 KB a buffer; 2 buffers + q + the P exchange = 224 KB of shared
    # memory on sm_90a, of 227): each warp group's score wgmma is n32 (n16 with 32-key steps,
    # which re-read q from shared memory twice as often). bench_mla times 32 keys x 3 stages too.
    cfg.setdefault("bm", 64)
    cfg.setdefault("num_warps", 8)
    cfg.setdefault("num_stages", 2)
    if "bn" not in cfg:          # 64 keys, fewer where q and two key buffers would not fit
        cfg["bn"] = next((bn for bn in (64, 32) if shared_bytes(cfg["bm"], bn, cols, elem)
                          <= (target.shared_memory or float("inf"))), 16)
    # the masked last steps too: an unpipelined loop loads each tile through registers (spills)
    cfg.setdefault("tail_stages", cfg["num_stages"])
    cfg.setdefault("programs_per_sm", 1)
    cfg.setdefault("tma", not small)           # full key steps as TMA boxes where the layout allows
    g = cfg.setdefault("group", rows_per_group(n_rows, n_req))
    if g < 1:
        raise ValueError(f"config group: expected >= 1 rows per group, got {g}")
    bm = cfg["bm"]
    tiles = -(-(g * n_heads) // bm)
    groups = -(-n_rows // g) if n_rows else 0
    # rows one tile of bm consecutive M-rows can touch (each may be another request's)
    cfg.setdefault("passes", min(g, (bm - 1) // max(n_heads, 1) + 2))
    cfg.update(tiles=tiles, groups=groups)
    if "splits" not in cfg:
        n_blocks = -(-capacity // cfg["bn"])
        most = min(MAX_SPLITS, max(1, n_blocks // 4))           # >= 4 key steps a split
        cfg["splits"] = choose_splits(max(1, tiles * groups), n_blocks,
                                      target.sm_count * cfg["programs_per_sm"], most)
    return cfg


def tma_fits(width: int, dv: int, block_size: int, bn: int, elem: int, row_stride: int,
             block_stride: int) -> bool:
    """Whether the full key steps can load their [BN, dv] and [BN, width - dv] parts as boxes of
    the cache viewed as [blocks x block_size, width]: both parts powers of two of 16-byte
    multiples, the cache contiguous, BN keys within one block."""
    parts = all(x > 0 and x & (x - 1) == 0 and x * elem % 16 == 0 for x in (dv, width - dv))
    return parts and row_stride == width and block_stride == block_size * width and block_size % bn == 0
