"""The 8-bit cache formats on the H200 in one run (issue 11): FP8 latent rows and MXFP8 index keys.

1. speed: sparse_mla / dense_mla on the FP8 latent layout vs the bf16 cache it was written from
   (`latent_rows`; its note gives the output error against the bf16 cache), the MXFP8 index
   scan vs the per-token FP8 one (bench_indexer.mxfp8_rows);
2. picks: the fraction of an fp32 indexer's top-2048 picks that FP8 / MXFP8 index keys change, at
   K3.1 Pro indexer shapes on synthetic inputs (benchmarks/index_formats.py), scored by the
   reference op (each format's exact numerics) and by the registered Triton kernels.

    PYTHONPATH=. python benchmarks/bench_fp8.py
    PYTHONPATH=. python benchmarks/bench_fp8.py --latent   # the FP8 latent rows only (latent_rows)

`k31c bench kernels` runs `run` (the latent rows; bench_indexer's run has the MXFP8 rows).
"""
from __future__ import annotations

import sys
import time

import torch

from k31c.graph.ops.fp8_layouts import latent_fp8_row_bytes

try:
    from benchmarks import bench_indexer
    from benchmarks.bench_mla import (B, BLOCK, DV, HEADS, N, R, SM_SCALE, TOPK, WIDTH, Pool,
                                      dense_inputs, mla_flops, out_error, rate_note)
    from benchmarks.harness import (Machine, Row, bytes_floor_ms, flops_floor_ms, graph_ms,
                                    markdown, measure_machine, try_ms)
    from benchmarks.index_formats import indexer_inputs, pick_change
except ImportError:  # run as a script from benchmarks/
    import bench_indexer
    from bench_mla import (B, BLOCK, DV, HEADS, N, R, SM_SCALE, TOPK, WIDTH, Pool,
                           dense_inputs, mla_flops, out_error, rate_note)
    from harness import (Machine, Row, bytes_floor_ms, flops_floor_ms, graph_ms, markdown,
                         measure_machine, try_ms)
    from index_formats import indexer_inputs, pick_change

QUICK_CONTEXTS = (128 << 10,)


FP8_ROW_BYTES = latent_fp8_row_bytes(DV, WIDTH - DV)   # 656: 512 e4m3, 4 fp32 scales, 64 bf16 (spec §5.6)


def _runs_module(kernel, args) -> str:
    """The module of the launcher a registered kernel runs for these arguments."""
    fn = kernel.runs(*args) if kernel.runs else kernel.fn
    return fn.__module__.rsplit(".", 1)[-1]


def latent_rows(machine: Machine, ctx: int = 128 << 10,
                dense_shapes=((32 << 10, 4), (128 << 10, 1))) -> list[Row]:
    """The FP8 latent layout (uint8 [blocks, 64, 656], `CachePool(latent_cache="fp8")`) against
    the bf16 cache it was written from, in the registered kernels, by graph replay: sparse_mla at
    `ctx` (h200: the warp-specialized kernel, each math group dequantising its block) and
    dense_mla at each (context, rows a request) of `dense_shapes` (R = 1: bound by the bytes);
    each row names the kernel the FP8 rows run. Peers: the same launcher on the bf16 cache; for
    sparse_mla the two-pass kernel on the FP8 rows (the other targets' path) and raw e4m3 rows
    without scales (upcast on load: what dequantisation adds); for dense_mla the one-pass kernel
    on the FP8 rows. The note gives the output error against the bf16 cache (what FP8 latent
    rows cost in accuracy at this shape)."""
    from k31c.graph.ops.fp8_layouts import quantize_latent_fp8
    from k31c.lowering.registry import lookup
    from k31c.lowering.triton import mla, mla_two_pass as two_pass

    sparse = lookup("k31c::sparse_mla", "h200")
    pool = Pool(ctx)
    q, cache, rr = pool.q, pool.cache, pool.row_req
    nb = cache.shape[0]
    fp8 = torch.empty(nb, BLOCK, FP8_ROW_BYTES, dtype=torch.uint8, device="cuda")
    for b0 in range(0, nb, 1024):                # quantise in chunks (fp32 temporaries)
        part = cache[b0:b0 + 1024]
        fp8[b0:b0 + 1024] = quantize_latent_fp8(part.reshape(-1, WIDTH), DV).view(part.shape[0], BLOCK, -1)
    raw8 = cache.to(torch.float8_e4m3fn)
    rows = []
    table, row_len, idx = pool.context(ctx)
    args = lambda c: (q, c, table, rr, idx, SM_SCALE, DV)  # noqa: E731
    ms = graph_ms(lambda: sparse.fn(*args(fp8)))
    peers = {"bf16 cache": graph_ms(lambda: sparse.fn(*args(cache))),
             "two-pass kernel": graph_ms(lambda: two_pass.sparse_mla(*args(fp8)))}
    t = try_ms(lambda: two_pass.sparse_mla(*args(raw8)), timer=graph_ms)
    if t is not None:
        peers["raw e4m3 (no scale), two-pass"] = t
    flops, nbytes = mla_flops(TOPK), N * TOPK * FP8_ROW_BYTES
    rows.append(Row(f"sparse_mla fp8_ds_mla ({_runs_module(sparse, args(fp8))})",
                    f"B{B}xR{R} H{HEADS} L={ctx >> 10}K k={TOPK}",
                    ms, flops_floor_ms(flops, machine.bf16_tflops), "flops", peers,
                    rate_note(ms, flops, nbytes, machine) + "; "
                    + out_error(sparse.fn(*args(fp8)), sparse.fn(*args(cache)))))
    dense = lookup("k31c::dense_mla", "h200")
    for dctx, r in dense_shapes:
        if dctx > ctx:                           # the pool holds ctx keys a request
            continue
        dq, table, rr_d, row_len = dense_inputs(pool, dctx, r)
        dargs = lambda c: (dq, c, table, rr_d, row_len, SM_SCALE, DV)  # noqa: E731
        ms = graph_ms(lambda: dense.fn(*dargs(fp8)), warmup=2, reps=10)
        peers = {"bf16 cache": graph_ms(lambda: dense.fn(*dargs(cache)), warmup=2, reps=10)}
        t = try_ms(lambda: mla.dense_mla(*dargs(fp8)), timer=graph_ms, warmup=2, reps=10)
        if t is not None:
            peers["one-pass kernel"] = t
        flops, nbytes = mla_flops(dctx) * r / R, B * dctx * FP8_ROW_BYTES
        floor, kind = flops_floor_ms(flops, machine.bf16_tflops), "flops"
        if r == 1:                               # one row a request: bound by the cache's bytes
            floor, kind = bytes_floor_ms(nbytes, machine), "bytes"
        rows.append(Row(f"dense_mla fp8_ds_mla ({_runs_module(dense, dargs(fp8))})",
                        f"B{B}xR{r} H{HEADS} L={dctx >> 10}K", ms, floor, kind, peers,
                        rate_note(ms, flops, nbytes, machine) + "; "
                        + out_error(dense.fn(*dargs(fp8)), dense.fn(*dargs(cache)))))
    return rows




def run(machine: Machine, contexts=QUICK_CONTEXTS) -> list[Row]:
    """`k31c bench kernels`' fp8 family: the FP8 latent rows at the largest context."""
    return latent_rows(machine, max(contexts))


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
    if "--latent" in sys.argv:
        print(markdown(latent_rows(m), m), flush=True)
        sys.exit(0)
    table = latent_rows(m) + bench_indexer.mxfp8_rows(m)
    print(markdown(table, m), flush=True)
    for ctx in (16 << 10, 128 << 10):
        for line in picks(ctx):
            print(line, flush=True)
    print(f"# {time.time() - start:.0f} s", flush=True)
