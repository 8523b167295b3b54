"""Try-out of topk_fast.py (the streaming top-k) against topk.py's pipeline and torch.topk (goal G2:
>= 4x torch.topk at 128K, >= 8x at 1M; 64 rows, k = 2048, fp32 scores).

Per case: every variant's set is checked against the reference op (sort based, the tie rule's
definition), then timed as a CUDA-graph replay (harness.time_ms). One line per (case, variant)
with us, speed-up over torch.topk and over the pipeline path; a failing variant prints its
exception and the rest go on. Then a per-kernel breakdown of the default fast config (profiler).

    PYTHONPATH=. python benchmarks/try_topk.py
"""
from __future__ import annotations

import time
import traceback

import torch

try:
    from benchmarks.harness import time_ms
except ImportError:  # run as a script from benchmarks/
    from harness import time_ms

N, K = 64, 2048
WIDTHS = (16 << 10, 128 << 10, 1 << 20)

# launch configs of the fast path (keys of topk_fast.DEFAULT_CONFIG); {} is the default
FAST_VARIANTS = {
    "fast": {},
    "fast bits11": dict(bits=11),
    "fast fused": dict(fuse_refine=True),
    "fast fused rt16": dict(fuse_refine=True, rt=16),       # fused, refine reads the buffer (few registers)
    "fast tile2048 w4": dict(tile=2048, warps=4),
    "fast tile4096x4": dict(iters=4),
    "fast tile8192 w16": dict(tile=8192, warps=16),
    "fast refine w16": dict(refine_warps=16),
}


def graphed(fn):
    """fn captured once in a CUDA graph; returns the replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def same_sets(a: torch.Tensor, b: torch.Tensor) -> str:
    bad = (a.sort(1).values != b.sort(1).values).any(1).nonzero().flatten().tolist()
    return "==" if not bad else f"!= (rows {bad[:6]})"


def make_scores(width: int, kind: str, gen) -> torch.Tensor:
    scores = torch.randn(N, width, device="cuda", generator=gen)
    if kind == "relu-zeros":    # ~500 positives per 1M row, the rest exact 0: the k-th is a tie at 0
        scores = scores.relu() * (torch.rand(N, width, device="cuda", generator=gen) < 1e-3)
    elif kind == "ints":        # 50 levels, ~20K copies each: ties at the k-th
        scores = torch.randint(0, 50, (N, width), device="cuda", generator=gen).float()
    return scores


def profile_kernels(fn, label: str) -> None:
    """Average device time per kernel name over 20 graph replays."""
    from torch.profiler import ProfilerActivity, profile
    replay = graphed(fn)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            replay()
        torch.cuda.synchronize()
    parts = []
    for ev in prof.key_averages():
        dev = getattr(ev, "device_time", None) or getattr(ev, "cuda_time", 0)
        if ev.count and dev:
            parts.append(f"{ev.key[:28]} {dev:.1f}us")
    print(f"  kernels [{label}]: " + "; ".join(parts))


def main() -> None:
    import k31c.graph.ops.indexer  # noqa: F401  (registers torch.ops.k31c.*)
    from k31c.lowering.triton import topk, topk_fast
    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = [(w, "random") for w in WIDTHS] + [(WIDTHS[-1], "relu-zeros"), (WIDTHS[-1], "ints")]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  64 rows, k {K}; us per call "
          "(CUDA-graph replay); 'xtopk' = torch.topk / variant, 'xpipe' = pipeline / variant")
    for width, kind in cases:
        scores = make_scores(width, kind, gen)
        row_len = torch.full((N,), width, dtype=torch.int32, device="cuda")
        if kind == "random":     # a few partial rows too (full rows are the timed shape's common case)
            row_len[1] = width // 3
            row_len[2] = K
            row_len[3] = K - 5
        ref = torch.ops.k31c.topk_select(scores, row_len, K)
        name = f"{width >> 10}K {kind}"
        t_topk = time_ms(graphed(lambda: torch.topk(scores, K, dim=1, sorted=False))) * 1e3
        print(f"{name:16s} torch.topk          {t_topk:8.1f} us")
        variants = {"pipeline": lambda: topk.topk_select(scores, row_len, K, path="pipeline")}
        for label, cfg in FAST_VARIANTS.items():
            variants[label] = (lambda cfg=cfg: topk_fast.topk_select_fast(scores, row_len, K, **cfg))
        t_pipe = None
        for label, fn in variants.items():
            try:
                check = same_sets(fn(), ref)
                us = time_ms(graphed(fn)) * 1e3
                if label == "pipeline":
                    t_pipe = us
                pipe = f"{t_pipe / us:5.2f}x pipe" if t_pipe else ""
                print(f"{name:16s} {label:19s} {us:8.1f} us  {t_topk / us:5.2f}x topk  {pipe}  sets {check} ref")
            except Exception as e:  # noqa: BLE001  (report and go on with the other variants)
                print(f"{name:16s} {label:19s} FAILED {type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc(limit=2)
        if kind == "random" or width == WIDTHS[-1]:
            try:
                profile_kernels(lambda: topk_fast.topk_select_fast(scores, row_len, K), f"fast {name}")
                profile_kernels(lambda: topk.topk_select(scores, row_len, K, path="pipeline"), f"pipeline {name}")
            except Exception as e:  # noqa: BLE001
                print(f"  profile failed: {type(e).__name__}: {e}")
        del scores, ref
        torch.cuda.empty_cache()
        print(f"  ({time.time() - t0:.0f} s so far)")
    print(f"total {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
