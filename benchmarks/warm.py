"""Fill the Triton and Inductor caches of `k31c bench kernels --quick` in parallel processes before
anything is timed, so the timed run spends its minutes measuring, not compiling one kernel after
another.

Each job is one process that makes the launches and torch.compile calls the quick run makes, once,
at shapes that give the same compiled variants (the dense kernels at 8K with the split counts the
quick contexts plan; the layer and the compiled peers at the quick contexts themselves, as their
plans and static shapes depend on the context). Triton's cache (~/.triton) and Inductor's (FX graph
cache) are on disk and shared, so the timed process loads what the jobs built. A job that fails
only costs its compile time later; nothing is timed here and nothing here is reported as a result.

    PYTHONPATH=. python benchmarks/warm.py            # every job, in parallel
    PYTHONPATH=. python benchmarks/warm.py split-r4   # one job, in this process
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import torch

try:
    from benchmarks import bench_indexer as bi, bench_layer as bl, bench_mla as bm, peers as pp
except ImportError:  # run as a script from benchmarks/
    import bench_indexer as bi
    import bench_layer as bl
    import bench_mla as bm
    import peers as pp

SMALL_CTX = 8 << 10
BN32 = {"bn": 32, "num_stages": 3}         # bench_mla's other candidate tile of the split kernel
JOBS = ("seesaw", "split-r1", "split-r4", "split-bn32-r1", "split-bn32-r4", "one-pass",
        "dense-peers", "layer-kernels", "layer-peers")


def _dense_kernel(r: int, config: dict | None) -> None:
    """The split kernel at R = r with the variant (partials or not) the quick contexts plan."""
    from k31c.lowering.targets import get_target
    from k31c.lowering.triton import mla_dense, mla_dense_plan

    pool = bm.Pool(SMALL_CTX)
    q, table, rr, row_len = bm.dense_inputs(pool, SMALL_CTX, r)
    for ctx in bm.QUICK_CONTEXTS:
        planned = mla_dense_plan.plan(get_target("h200"), bm.B * r, bm.HEADS, bm.B, ctx, config,
                                      small=False)["splits"]
        mla_dense.launch(q, pool.cache, table, rr, row_len, bm.SM_SCALE, bm.DV,
                         config={**(config or {}), "splits": planned})


def _seesaw() -> None:
    """The registered dense kernel on the H200 (mla_dense_ws's Gluon seesaw) at each R with the
    splits the quick contexts plan."""
    from k31c.lowering.targets import get_target
    from k31c.lowering.triton import mla_dense_ws
    sms = get_target("h200").sm_count
    pool = bm.Pool(SMALL_CTX)
    for r in bm.DENSE_ROWS:
        q, table, rr, row_len = bm.dense_inputs(pool, SMALL_CTX, r)
        _, groups, slabs, _ = mla_dense_ws.layout(bm.B * r, bm.HEADS, bm.B)
        for ctx in bm.QUICK_CONTEXTS:
            splits = mla_dense_ws.plan_splits(groups * slabs, ctx // bm.BLOCK, sms)
            mla_dense_ws.launch(q, pool.cache, table, rr, row_len, bm.SM_SCALE, splits=splits)


def _one_pass() -> None:
    from k31c.lowering.triton import mla
    pool = bm.Pool(SMALL_CTX)
    for r in bm.DENSE_ROWS:
        q, table, rr, row_len = bm.dense_inputs(pool, SMALL_CTX, r)
        mla.launch(q, pool.cache, table, rr, row_len, bm.SM_SCALE, bm.DV)


def _dense_peers() -> None:
    """bench_mla.run's compiled peers at the quick shapes (the same pool size: the same strides)."""
    pool = bm.Pool(max(bm.QUICK_CONTEXTS))
    paged = torch.compile(bm.plain_dense_mla, dynamic=True)
    contiguous = torch.compile(pp.contiguous_dense_mla, dynamic=False)
    for ctx in bm.QUICK_CONTEXTS:
        for r in bm.DENSE_ROWS:
            q, table, rr, row_len = bm.dense_inputs(pool, ctx, r)
            paged(q, pool.cache, table, rr, row_len, bm.SM_SCALE, bm.DV, ctx)
            latent = pp.contiguous_latent(pool.cache, table)
            contiguous(pp.by_request(q, bm.B), latent, row_len.view(bm.B, r), bm.SM_SCALE, bm.DV)
            del latent
            torch.cuda.empty_cache()


def _layer_inputs(ctx: int):
    lat, idx_pool = bm.Pool(ctx), bi.Pool(ctx)
    table = lat.block_table[:, : ctx // bm.BLOCK]
    row_len = (ctx - bm.R + 1 + torch.arange(bm.R, device="cuda", dtype=torch.int32)).repeat(bm.B)
    return lat, idx_pool, table, row_len


def _layer_kernels() -> None:
    from k31c.lowering.triton import indexer as tix, topk as tk
    fns, _ = bl._kernels()
    for ctx in bl.QUICK_CONTEXTS:
        lat, idx_pool, table, row_len = _layer_inputs(ctx)
        iargs = (idx_pool.q, idx_pool.weights, idx_pool.cache, table, lat.row_req, row_len)
        idx = fns["lightning_indexer_topk"](*iargs, bl.K)
        fns["sparse_mla"](lat.q, lat.cache, table, lat.row_req, idx, bm.SM_SCALE, bm.DV)
        tk.topk_select(tix.lightning_indexer(*iargs), row_len, bl.K)
        del lat, idx_pool, idx
        torch.cuda.empty_cache()


def _layer_peers() -> None:
    paged = torch.compile(bl.plain_layer, dynamic=True)
    contiguous = torch.compile(pp.contiguous_sparse_layer, dynamic=False)
    for ctx in bl.QUICK_CONTEXTS:
        lat, idx_pool, table, row_len = _layer_inputs(ctx)
        paged(idx_pool.q, idx_pool.weights, idx_pool.cache, table, lat.row_req, row_len, lat.q,
              lat.cache)
        torch.cuda.empty_cache()
        keys = pp.contiguous_index_keys(idx_pool.cache, table, bm.BLOCK, bi.DIM)
        latent = pp.contiguous_latent(lat.cache, table)
        contiguous(pp.by_request(idx_pool.q, bm.B), keys, pp.by_request(idx_pool.weights, bm.B),
                   row_len.view(bm.B, bm.R), pp.by_request(lat.q, bm.B), latent, bm.SM_SCALE, bm.DV,
                   bl.K)
        del lat, idx_pool, keys, latent
        torch.cuda.empty_cache()


def run_job(name: str) -> None:
    from k31c.graph import ops  # noqa: F401  (torch.ops.k31c.*)
    {"seesaw": _seesaw,
     "split-r1": lambda: _dense_kernel(1, None), "split-r4": lambda: _dense_kernel(4, None),
     "split-bn32-r1": lambda: _dense_kernel(1, BN32), "split-bn32-r4": lambda: _dense_kernel(4, BN32),
     "one-pass": _one_pass, "dense-peers": _dense_peers, "layer-kernels": _layer_kernels,
     "layer-peers": _layer_peers}[name]()
    torch.cuda.synchronize()


def warm_all(jobs=JOBS) -> list[str]:
    """Run every job in its own process, all at once; returns the jobs that failed."""
    start = time.time()
    script = os.path.abspath(__file__)
    root = os.path.dirname(os.path.dirname(script))           # the checkout: k31c and benchmarks
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
    logs = {job: tempfile.TemporaryFile(mode="w+") for job in jobs}   # a pipe could fill and stall
    procs = {job: subprocess.Popen([sys.executable, script, job], stdout=subprocess.DEVNULL,
                                   stderr=logs[job], text=True, env=env) for job in jobs}
    failed = []
    for job, proc in procs.items():
        proc.wait()
        logs[job].seek(0)
        tail = logs[job].read().strip().splitlines()[-1:]
        logs[job].close()
        if proc.returncode != 0:
            failed.append(job)
            print(f"# warm {job} failed ({proc.returncode}): {' '.join(tail)[:200]}", file=sys.stderr,
                  flush=True)
    print(f"# warm-up: {len(jobs) - len(failed)}/{len(jobs)} jobs in {time.time() - start:.0f} s",
          flush=True)
    return failed


if __name__ == "__main__":
    if len(sys.argv) > 1:
        if sys.argv[1] not in JOBS:
            print(f"warm.py: error: unknown job {sys.argv[1]!r}; jobs: {', '.join(JOBS)}",
                  file=sys.stderr)
            sys.exit(2)
        run_job(sys.argv[1])
    else:
        sys.exit(1 if warm_all() else 0)
