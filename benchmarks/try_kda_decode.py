"""Probe of the KDA decode state pass's register cap (goal G8): at bench_kda's decode inputs
(B = 16, R = 1 and 4), the default launch against `state_maxnreg` caps, interleaved over rounds,
each output compared with the default's (a cap changes the spill, not the math: bit for bit).

    PYTHONPATH=. python benchmarks/try_kda_decode.py [ROUNDS]
"""
from __future__ import annotations

import statistics
import sys

import torch

try:
    from benchmarks import bench_kda as bk
except ImportError:  # run as a script from benchmarks/
    import bench_kda as bk

# (rows per request, cap): sm_90a builds at R = 1 (BV = K, 4 warps) take 238 registers uncapped
# (2 programs an SM), 200 with 16 B of stack (2), 168 with 296 B (3)
CAPS = ((1, None), (1, 200), (1, 168), (4, None), (4, 96))


def main(rounds: int) -> None:
    from k31c.lowering.triton.kda_decode import launch_kda_decode
    gen = torch.Generator().manual_seed(0)
    B = bk.B_DECODE
    lay = bk.layer(B, gen)
    slots = torch.arange(B, device="cuda")
    toks = {R: bk.tokens(B * R, gen) for R in (1, 4)}

    def run(R, cap):
        return launch_kda_decode(*bk.args(toks[R], lay), slots, R, bk.LB, bk.EPS, None, None,
                                 state_first=False, state_maxnreg=cap)
    start = {n: lay[n].clone() for n in ("conv_state", "recurrent")}

    def fresh(R, cap):
        for n, t in start.items():
            lay[n].copy_(t)
        return run(R, cap).float()
    for R, cap in CAPS:
        if cap is not None:
            same = torch.equal(fresh(R, cap), fresh(R, None))
            print(f"R={R} cap {cap}: output equal to the uncapped launch's: {same}", flush=True)
    times = {c: [] for c in CAPS}
    for r in range(rounds):
        for c in (CAPS if r % 2 == 0 else CAPS[::-1]):
            times[c].append(bk.graph_ms(lambda c=c: run(*c)) * 1e3)
    for (R, cap), ts in times.items():
        print(f"R={R} cap {cap}: median {statistics.median(ts):.1f} us over {rounds} rounds: "
              + " ".join(f"{t:.1f}" for t in ts), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
