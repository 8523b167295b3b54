"""How many radix levels the top-k refine's key select runs (a host model, no GPU): the candidates
are a row's top 2.5k = 5,120 order keys, the select's levels are `radix_select.select_kth`'s
with SKIP_COMMON (5-bit digits below the bits every candidate shares, stopping when the k-th's
digit bin holds exactly what is still to take). Per row: the levels run, the bits below the
common prefix, and the candidates left after the first level (`select_kth_gathered`, the
refine's form, gathers them once at most 1,024 remain and runs the later levels over those).

    python benchmarks/topk_levels.py
"""
from __future__ import annotations

import numpy as np

K, CANDIDATES = 2048, 5120


def order_key(x: np.ndarray) -> np.ndarray:
    """radix_select.order_key on float32 (as uint64 holding the uint32)."""
    b = x.view(np.uint32).astype(np.uint64)
    b = np.where(b == 0x80000000, 0, b)
    return np.where(b >= 0x80000000, b ^ 0xFFFFFFFF, b | 0x80000000).astype(np.uint64)


def levels(keys: np.ndarray, k: int) -> tuple[int, int, list[int]]:
    """(levels run, bits below the common prefix, live keys after each level)."""
    lo, hi = int(keys.min()), int(keys.max())
    top = (lo ^ hi).bit_length()
    live, krem, left = np.ones(len(keys), bool), k, []
    for level in range(min((top + 4) // 5, 7)):
        shift = max(top - 5 * (level + 1), 0)
        digit = ((keys >> np.uint64(shift)) & np.uint64((1 << (top - 5 * level - shift)) - 1)).astype(np.int64)
        hist = np.bincount(digit[live], minlength=32)
        suffix = hist[::-1].cumsum()[::-1]
        best = max(b for b in range(32) if suffix[b] >= krem)
        krem -= int(hist[best + 1:].sum())
        live &= digit == best
        left.append(int(hist[best]))
        if hist[best] == krem:
            break
    return len(left), top, left


def main() -> None:
    rng = np.random.default_rng(0)
    for name, spread in (("random", lambda x: x), ("indexer-like", lambda x: 0.05 + 0.1 * x)):
        for n in (128 << 10, 1 << 20):
            rows = []
            for _ in range(8):
                keys = order_key(spread(rng.standard_normal(n).astype(np.float32)).astype(np.float32))
                rows.append(levels(np.sort(keys)[-CANDIDATES:], K))
            print(f"{name:12s} {n >> 10:5d}K  levels {[r[0] for r in rows]}  bits {sorted({r[1] for r in rows})}  "
                  f"left after level 1 {[r[2][0] for r in rows]}")


if __name__ == "__main__":
    main()
