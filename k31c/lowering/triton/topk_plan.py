"""The top-k select's launch plan (`topk.py` runs it): how a call's rows split into filter
chunks, the candidate buffer and sample sizes, the launches' warps, the workspace, and the
per-row state words the kernels share. The constants are read when a call is planned or
launched, so tests may shrink them (tests/lowering/conftest.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

CAP = 8192             # candidate buffer per row (at least 4k; ~2.5k expected, +5 sd at 80 samples above T)
TARGET_NUM, TARGET_DEN = 5, 2   # expected candidates = 2.5 k
SAMPLES, RUN = 16384, 8         # most sampled keys per long row, in runs of 8 adjacent positions
MIN_SAMPLES = 2048              # fewest (rows up to 128K keys)
PLAN_GROUP, PLAN_FEW = 32, 1024  # the plan's bound: maxima of groups of 32 sampled keys; keys it selects from after
#                                  (the refine's key select, too, finishes over at most PLAN_FEW gathered keys)
MAX_SLOTS = 256                 # most candidate slots a filter program holds (2x its expected count)
ROW_STATE = 4                   # int32 words of per-row state

# per-row state words
ST_CNT = tl.constexpr(0)      # candidates appended
ST_THRESH = tl.constexpr(1)   # filter threshold key (uint32 bits)
ST_MODE = tl.constexpr(2)     # 0: select; 1: written by plan (row_len <= k); 2: refine selected from the row
ST_SLOTS = tl.constexpr(3)    # the plan's gather counter (`radix_select.live_slots`)
ST_WORDS = tl.constexpr(ROW_STATE)
MODE_WHOLE_ROW = tl.constexpr(2)   # ST_MODE of a row selected (or marked to be) from its whole row

SCORE_TILE, REFINE_TILE = 256, 2048       # positions per filter tile; per refine / row-select tile
# a filter program is one warp (its sums and scans stay in shuffles, no block barrier) on 256-key
# tiles, 8 keys a thread (bigger tiles cost registers faster than they save; BENCHMARKS.md)
FILTER_WARPS = 1
FILTER_PER_SM = 32     # one-warp filter programs an SM runs at once: sm_90's 32-block limit, which
#                        the filter's 64 registers a thread also meet; SMs x 32 programs are one wave
#                        (1.94 waves on 132 SMs, 8192 programs, were 10% slower at 128K; BENCHMARKS.md)
FILTER_PROGRAMS = None  # filter programs in all; None: one wave on the target's SMs (tests set a count)
PLAN_KEYS, REFINE_KEYS = 8, 16           # keys a thread holds: the sample's, the candidate buffer's


def pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def chunking(width: int, groups: int, tile: int, programs: int) -> tuple[int, int]:
    """Positions per filter program (whole tiles) and programs per row group, ~`programs` in all."""
    per_group = max(1, programs // max(groups, 1))
    chunk = max(tile, triton.cdiv(triton.cdiv(width, per_group), tile) * tile)
    return chunk, triton.cdiv(width, chunk)


@dataclass(frozen=True)
class TopkPlan:
    """How one call splits its rows: filter chunks, the candidate buffer and the sample (the
    constants are read when planned, so tests may shrink them)."""
    n_rows: int
    width: int
    k: int
    tile: int            # positions per filter tile
    chunk: int           # positions per filter program (whole tiles)
    n_chunks: int        # filter programs per row
    cap: int             # candidate buffer per row
    slots: int           # candidate slots of a filter program's own
    samples: int         # sampled keys per long row
    run: int
    target: int          # expected candidates above the threshold
    group: int           # the plan's sample narrowed by maxima of groups of `group` keys
    few: int             # to at most `few` keys (gathered in the workspace); the refine's select likewise

    def workspace(self, device, filter_slots: bool = True) -> dict:
        """Scratch for one call (one int32 allocation): per-row state, the plan's gathered sample
        keys, candidate buffers, the filter programs' own slots and per-chunk tie counts.
        filter_slots=False: no slots (empty hkey / hpos), for callers whose filter is not
        `topk._filter_kernel` (the fused select's filter scan keeps its own)."""
        n = self.n_rows
        held = n * self.n_chunks * self.slots if filter_slots else 0
        sizes = {"state": n * ROW_STATE, "few": n * self.few, "ckey": n * self.cap, "cpos": n * self.cap,
                 "hkey": held, "hpos": held, "ties": n * self.n_chunks}
        flat = torch.empty(sum(sizes.values()), dtype=torch.int32, device=device)
        return dict(zip(sizes, flat.split(list(sizes.values()))))


def row_paths(ws, row_len, k: int, cap: int) -> list[str]:
    """The path each row of a finished call took, read back from its workspace: "direct"
    (row_len <= k), "all" (row_len <= cap: every position a candidate), "sampled" (a sampled
    threshold, settled from the buffer), "ties" (the buffer plus keys at the threshold),
    "fallback" (selected from the whole row)."""
    state = ws["state"].view(-1, ROW_STATE).cpu()
    paths = []
    for row, n in enumerate(row_len.tolist()):
        mode = int(state[row, ST_MODE.value])
        if mode == 1:
            paths.append("direct")
        elif mode == MODE_WHOLE_ROW.value:
            paths.append("fallback")
        elif int(state[row, ST_CNT.value]) < k:           # fewer candidates than k
            paths.append("ties")
        else:
            paths.append("all" if n <= cap else "sampled")
    return paths


def sample_count(width: int) -> int:
    """Sampled keys for rows of `width`: ~width/64 (about 80 of them above the threshold), within
    [MIN_SAMPLES, SAMPLES]."""
    return min(SAMPLES, max(min(MIN_SAMPLES, SAMPLES), pow2(triton.cdiv(width, 64))))


def sample_stride(width: int, block: int) -> int:
    """The fused select's sample scan: one block of `block` keys scored in every `sample_stride`
    of a row's blocks, so about `sample_count(width)` keys are sampled, in whole blocks."""
    return max(1, triton.cdiv(width, block) // max(1, sample_count(width) // block))


def filter_programs(sms: int) -> int:
    """Filter programs in all for a GPU of `sms` SMs (CUs): FILTER_PROGRAMS where set, else one wave."""
    return FILTER_PROGRAMS if FILTER_PROGRAMS is not None else sms * FILTER_PER_SM


def plan(n_rows: int, width: int, k: int, sms: int, groups: int | None = None, tile: int | None = None,
         programs: int | None = None) -> TopkPlan:
    """The plan of `n_rows` rows of `width` keys on a GPU of `sms` SMs (filter programs shared by
    `groups` row groups, default one per row; `programs` in all, default `filter_programs(sms)`)."""
    width = max(width, 1)
    tile = SCORE_TILE if tile is None else tile
    programs = filter_programs(sms) if programs is None else programs
    chunk, n_chunks = chunking(width, n_rows if groups is None else groups, tile, programs)
    cap = min(max(CAP, 4 * k), width)
    target = TARGET_NUM * k // TARGET_DEN
    # twice a chunk's expected candidates in a full-width row; denser chunks (short rows, a
    # cluster of high scores) go on to append to the row's buffer directly
    slots = min(MAX_SLOTS, max(16, pow2(triton.cdiv(2 * target * chunk, width))))
    return TopkPlan(n_rows, width, k, tile, chunk, n_chunks, cap, slots, sample_count(width), RUN, target, PLAN_GROUP,
                    PLAN_FEW)


def warps(elements: int, per_thread: int) -> int:
    """Warps for a program holding `elements` keys in registers, about `per_thread` a thread. The
    refine holds 16 (16 warps for its 8,192 keys): at 32 a thread its straight-line code stalled
    on instruction fetch; the plan's sample, 8 (fewer warps were slower; BENCHMARKS.md)."""
    return max(4, min(16, elements // (32 * per_thread)))
