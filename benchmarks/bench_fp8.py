"""The 8-bit cache formats on the H200 in one run (issue 11): FP8 latent rows and MXFP8 index keys.

1. speed: sparse_mla / dense_mla on the FP8 latent layout vs the bf16 cache it was written from
   (bench_mla.fp8_rows; its note gives the output error against the bf16 cache), the MXFP8 index
   scan vs the per-token FP8 one (bench_indexer.mxfp8_rows);
2. picks: the fraction of an fp32 indexer's top-2048 picks that FP8 / MXFP8 index keys change, at
   K3.1 Pro indexer shapes on synthetic inputs (benchmarks/index_formats.py), scored by the
   reference op (each format's exact numerics) and by the registered Triton kernels.

    PYTHONPATH=. python benchmarks/bench_fp8.py
"""
from __future__ import annotations

import time

import torch

try:
    from benchmarks import bench_indexer, bench_mla
    from benchmarks.harness import markdown, measure_machine
    from benchmarks.index_formats import indexer_inputs, pick_change
except ImportError:  # run as a script from benchmarks/
    import bench_indexer
    import bench_mla
    from harness import markdown, measure_machine
    from index_formats import indexer_inputs, pick_change


def picks(ctx: int = 128 << 10, requests: int = 4, rows: int = 4, k: int = 2048) -> list[str]:
    from k31c.lowering.triton import indexer as tix
    inputs = indexer_inputs(requests, rows, 32, 128, ctx, 64, device="cuda", seed=1)
    ref = pick_change(inputs, k, 64)
    kern = pick_change(inputs, k, 64, variants=("fp8", "mxfp8"), scorer=tix.lightning_indexer)
    shape = f"{requests}x{rows} rows, 32 heads x 128, L={ctx >> 10}K, k={k}"
    return [f"picks changed vs fp32 ({shape}), reference op: "
            + ", ".join(f"{n} {v:.2%}" for n, v in ref.items()),
            f"picks changed vs fp32 ({shape}), Triton kernels (fp8: q per (row, head) e4m3): "
            + ", ".join(f"{n} {v:.2%}" for n, v in kern.items())]


if __name__ == "__main__":
    start = time.time()
    m = measure_machine()
    table = bench_mla.fp8_rows(m) + bench_indexer.mxfp8_rows(m)
    print(markdown(table, m), flush=True)
    for ctx in (16 << 10, 128 << 10):
        for line in picks(ctx):
            print(line, flush=True)
    print(f"# {time.time() - start:.0f} s", flush=True)
