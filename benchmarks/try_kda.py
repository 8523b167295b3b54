"""KDA decode: the one-kernel comparison (benchmarks/alternatives/kda_decode_fused.py) vs the
registered three-launch kernels (k31c/lowering/triton/kda_decode.py) vs fla, at G8's shape.

B = 16 requests, H = 96, K = V = 128, bf16 activations, fp32 state, R = 1 and 4 rows per request.
First checks at the real shape that the registered kernels agree with the fused one and with the
reference op (out, conv window, state; R = 4 also the snapshots), then times under CUDA-graph
replay (harness.graph_ms): fused at its tiles, the registered kernels at several (BV, warps),
their three launches alone (prep / state / norm), and fla's fused_recurrent_kda. One line per
case. `k31c bench kernels` (bench_kda.py) times the default against the fused kernel and fla;
this script keeps the real-shape cross-check and the per-launch breakdown.

Run: PYTHONPATH=.:<fla-core> python benchmarks/try_kda.py   (fla optional)
"""
from __future__ import annotations

import time
from functools import partial

import torch

try:
    from benchmarks.bench_kda import (ACT, B_DECODE, EPS, LB, H, K, P, W, args, decode_bytes,
                                      fla_decode_peers, graph_ms, layer, tokens)
    from benchmarks.alternatives.kda_decode_fused import kda_decode_fused
except ImportError:  # run from benchmarks/
    from bench_kda import (ACT, B_DECODE, EPS, LB, H, K, P, W, args, decode_bytes,
                           fla_decode_peers, graph_ms, layer, tokens)
    from alternatives.kda_decode_fused import kda_decode_fused

import k31c.graph.ops.kda  # noqa: F401  (registers torch.ops.k31c.kda_decode)
from k31c.lowering.triton.kda_decode import launch_kda_decode

B = B_DECODE
FUSED = ((32, 4), (64, 4))                     # (BV, warps): the old kernel's measured best two
SPLIT = ((32, 4), (16, 2), (64, 4), (32, 2), (128, 8), (128, 16), (8, 1))
BW = 4.0e12                                    # nominal copy bandwidth for the floor column


def clone(lay):
    return {n: t.clone() for n, t in lay.items()}


def snaps(R):
    return (torch.full((B, R, W - 1, 3 * P), 7.0, device="cuda", dtype=ACT),
            torch.full((B, R, H, K, K), 7.0, device="cuda"))


def run_once(fn, tok, lay, slots, R, snap):
    lay = clone(lay)
    sn = snaps(R) if snap else (None, None)
    out = fn(*args(tok, lay), slots, R, LB, EPS, *sn)
    torch.cuda.synchronize()
    return [out, lay["conv_state"], lay["recurrent"], *(sn if snap else ())]


def check(tok, lay, slots, R):
    names = ("out", "conv_state", "recurrent", "snap_conv", "snap_state")
    snap = R > 1
    ref = run_once(torch.ops.k31c.kda_decode, tok, lay, slots, R, snap)
    fused = run_once(kda_decode_fused, tok, lay, slots, R, snap)
    for bv, nw in ((None, None), (32, 4), (128, 8)):       # None: the launcher's per-R default
        fn = partial(launch_kda_decode, block_v=bv, num_warps=nw)
        got = run_once(fn, tok, lay, slots, R, snap)
        for name, g, f, r in zip(names, got, fused, ref):
            d_f = (g.float() - f.float()).abs().max().item()
            d_r = (g.float() - r.float()).abs().max().item()
            d_fr = (f.float() - r.float()).abs().max().item()
            print(f"check R={R} split BV={bv} w={nw} {name}: max|split-fused| {d_f:.2e} "
                  f"max|split-ref| {d_r:.2e} (fused-ref {d_fr:.2e})")
            torch.testing.assert_close(g.float(), r.float(), atol=3e-2, rtol=3e-2,
                                       msg=lambda m: f"R={R} {name}: {m}")


def timed(label, fn, fla_us, floor_us):
    try:
        us = graph_ms(fn) * 1e3
    except Exception as e:  # noqa: BLE001  (one failing case must not hide the others)
        print(f"{label:<34} FAILED {type(e).__name__}: {str(e)[:160]}")
        return None
    ratio = f"fla/this {fla_us / us:.2f}x" if fla_us else "fla n/a"
    print(f"{label:<34} {us:8.1f} us  {ratio}  floor/this {floor_us / us:.2f}", flush=True)
    return us


def main():
    t0 = time.time()
    gen = torch.Generator().manual_seed(0)
    base = layer(B + 4, gen)
    # mixed slots, one padding request
    slots = torch.randperm(B + 4, generator=gen)[:B]
    slots[3] = -1
    slots = slots.cuda()
    lin = torch.arange(B, device="cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for R in (1, 4):
        tok = tokens(B * R, gen)
        check(tok, base, slots, R)
        floor = decode_bytes(B, R, False) / BW * 1e6
        print(f"R={R}: floor {floor:.1f} us at {BW / 1e12:.1f} TB/s")
        fla = None
        try:
            lay = clone(base)
            peers = fla_decode_peers(tok, lay, B, R)
            with torch.inference_mode():
                fla = timed(f"R={R} fla fused_recurrent_kda", peers["fla recurrent"], None, floor)
        except Exception as e:  # noqa: BLE001
            print(f"R={R} fla unavailable: {type(e).__name__}: {str(e)[:160]}")

        def case(label, snap=False, fused=False, **kw):
            lay = clone(base)
            sn = snaps(R) if snap else (None, None)
            fn = kda_decode_fused if fused else launch_kda_decode
            return timed(f"R={R} {label}", lambda: fn(*args(tok, lay), lin, R, LB, EPS, *sn, **kw),
                         fla, floor)

        for bv, nw in FUSED:
            case(f"fused BV={bv} w={nw}", fused=True, block_v=bv, num_warps=nw)
        res = {}
        for bv, nw in SPLIT:
            res[bv, nw] = case(f"split BV={bv} w={nw}", block_v=bv, num_warps=nw)
        ok = {c: t for c, t in res.items() if t}
        if ok:
            bv, nw = min(ok, key=ok.get)
            for st in ("p", "s", "n") if bv < K else ("p", "s"):   # BV = K: norm in "s"
                case(f"  split BV={bv} w={nw} only {st}", block_v=bv,
                     num_warps=nw, stages=st)
            if R > 1:
                case(f"split BV={bv} w={nw} rolled", block_v=bv,
                     num_warps=nw, unroll_rows=False)
                case(f"split BV={bv} w={nw} +snapshots", snap=True, block_v=bv,
                     num_warps=nw)
                case("fused BV=64 w=4 +snapshots", snap=True, fused=True, block_v=64,
                     num_warps=4)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
