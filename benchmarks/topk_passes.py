"""How the top-k refine's key select narrows its candidate buffer (a host model, no GPU): the
candidates are a row's top ~2.5k = 5,120 scores (the keys above the plan's threshold), k = 2,048.

`radix_select.select_kth_bracketed` counts the candidates at or above two pivots a pass, placed
FEW/3 ranks either side of the k-th by an exponential-tail model (the mean excess over the
threshold, here the candidates' minimum, then log-linear in the count between the interval's
ends), until at most FEW = 1,024
lie in the interval; the radix select it replaced ran 5-bit digit levels below the bits every
candidate shares. Per score distribution: the passes run (4 at most; more left means levels
follow), the keys left for the gathered select, and the levels the digit select ran over the
whole buffer before at most 1,024 were left.

    python benchmarks/topk_passes.py
"""
from __future__ import annotations

import numpy as np

K, FEW, CANDIDATES, PASSES = 2048, 1024, 5120, 4


def order_key(x: np.ndarray) -> np.ndarray:
    """radix_select.order_key on float32 (int64 holding the uint32)."""
    b = x.astype(np.float32).view(np.uint32).astype(np.int64)
    b = np.where(b == 0x80000000, 0, b)
    return np.where(b >= 0x80000000, b ^ 0xFFFFFFFF, b | 0x80000000)


def key_float(key: int) -> float:
    """radix_select.key_float of one key."""
    bits = key ^ 0x80000000 if key >= 0x80000000 else key ^ 0xFFFFFFFF
    return float(np.array([bits], np.uint32).view(np.float32)[0])


def passes(x: np.ndarray, k: int) -> tuple[int, int]:
    """(passes run, keys left in the interval) of select_kth_bracketed's narrowing."""
    keys = order_key(x)
    a, b, ca, cb = int(keys.min()), 1 << 32, len(keys), 0
    beta = float(x.mean()) - key_float(a)

    def pivot(t: int) -> int:
        xa = key_float(a)
        step = ((key_float(min(b, 0xFFFFFFFF)) - xa) * np.log(ca / t) / np.log(ca / cb) if cb > 0
                else beta * np.log(ca / t))
        return int(order_key(np.array([xa + step]))[0])

    n = 0
    while ca - cb > FEW and n < PASSES:
        p1 = min(max(pivot(min(k + FEW // 3, ca)), a + 1), b - 1)
        p2 = min(max(pivot(max(k - FEW // 3, cb, 1)), p1), b - 1)
        c1, c2 = int((keys >= p1).sum()), int((keys >= p2).sum())
        if c2 >= k:
            a, ca = p2, c2
        elif c1 >= k:
            a, ca, b, cb = p1, c1, p2, c2
        else:
            b, cb = p1, c1
        n += 1
    return n, ca - cb


def digit_levels(x: np.ndarray, k: int) -> int:
    """Full-buffer 5-bit levels the digit select ran (below the common bits) before <= FEW left."""
    keys = order_key(x)
    top = (int(keys.min()) ^ int(keys.max())).bit_length()
    live, krem, level = np.ones(len(keys), bool), k, 0
    while live.sum() > FEW and level < min((top + 4) // 5, 7):
        shift = max(top - 5 * (level + 1), 0)
        digit = (keys >> shift) & ((1 << (top - 5 * level - shift)) - 1)
        hist = np.bincount(digit[live], minlength=32)
        best = max(d for d in range(32) if hist[d:].sum() >= krem)
        krem -= int(hist[best + 1:].sum())
        live &= digit == best
        level += 1
    return level


def main() -> None:
    rng = np.random.default_rng(1)
    dists = {"random": lambda n: rng.standard_normal(n),
             "indexer-like": lambda n: 0.05 + 0.1 * rng.standard_normal(n),
             "lognormal": lambda n: np.exp(rng.standard_normal(n)), "uniform": lambda n: rng.random(n),
             "fp8-rounded": lambda n: np.round(rng.standard_normal(n) * 16) / 16,
             "cauchy": lambda n: rng.standard_cauchy(n)}
    for name, gen in dists.items():
        for n in (128 << 10, 1 << 20):
            rows = []
            for _ in range(8):
                top = np.sort(gen(n).astype(np.float32))[-int(rng.normal(CANDIDATES, 300)):]
                rows.append((*passes(top, K), digit_levels(top, K)))
            print(f"{name:12s} {n >> 10:5d}K  passes {[r[0] for r in rows]}  left {[r[1] for r in rows]}  "
                  f"digit levels {[r[2] for r in rows]}")


if __name__ == "__main__":
    main()
