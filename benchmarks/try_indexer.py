"""Old (gather) vs new (TMA) lightning indexer scan at K3.1 Pro shapes, goal G1 (spec §8).

Inputs and floor are bench_indexer's (its Pool, scan_bytes and CUDA-graph timer, imported):
B = 16 requests x R = 4 rows, 32 heads x 128, FP8 cache (132 B/token), block 64, contexts 16K,
128K, 1M. Per context:
  1. every variant's scores against the gather kernel's: -inf pattern
     equal, max |diff| / max |score| printed, asserted < 1e-2 (both quantise q the same way; the
     FP8 tensor cores' accumulation order differs); at 16K also the TMA kernel against the
     reference op on the dequantised q (an independent oracle);
  2. each variant timed as CUDA-graph replay: us, floor us, ratio.
The tma rows run with q_rcp=False (the launcher's default) unless named "q_rcp". The last row,
"tma prequantised q", runs the registered TMA launch on q quantised beforehand (its scale folded
into the weights), pricing the kernel's q-quantisation prologue.
A variant that fails prints its exception and the run goes on; each new compile prints its
registers and spills.

    PYTHONPATH=. python benchmarks/try_indexer.py
"""
from __future__ import annotations

import time
import traceback

import torch

try:
    from benchmarks.bench_indexer import DIM, HEADS, Pool, graph_ms, scan_bytes
    from benchmarks.harness import bytes_floor_ms, measure_machine
except ImportError:  # run as a script from benchmarks/
    from bench_indexer import DIM, HEADS, Pool, graph_ms, scan_bytes
    from harness import bytes_floor_ms, measure_machine

CONTEXTS = (16 << 10, 128 << 10, 1 << 20)
TOL = 1e-2


def variants(sms: int) -> dict[str, dict]:
    """name -> launch_indexer kwargs; splits given so the grid is a whole number of rounds."""
    tiles = 16
    per_round = lambda progs_per_sm: max(1, progs_per_sm * sms // tiles)  # noqa: E731
    return {
        "gather": dict(variant="gather"),
        "gather hw_quant": dict(variant="gather", hw_quant=True),
        "default (tma div_rn)": {},
        "tma q_rcp": dict(variant="tma", q_rcp=True),
        "tma splits=2 rounds": dict(variant="tma", splits=per_round(6)),
        "tma head_dot": dict(variant="tma", head_dot=True),
        "tma stages=4": dict(variant="tma", num_stages=4),
        "tma stages=7": dict(variant="tma", num_stages=7),
        "tma 8 warps": dict(variant="tma", num_warps=8, splits=per_round(2)),
    }


def prequantised(args):
    """The registered TMA launch with q quantised beforehand (per (row, head) e4m3 with its scale
    folded into the head weights, as the kernel's prologue does it), so the kernel runs with
    QUANT_Q off: what a prologue-free scan would cost (the prologue's per-element divisions are
    the suspected fixed per-program cost). Returns the launch as a function of nothing."""
    from k31c.lowering.triton import indexer as tix
    from k31c.lowering.triton import indexer_tma
    from k31c.lowering.triton.device import target_of

    q, w, cache, table, row_req, row_len = args
    n, heads, d = q.shape
    block_size = cache.shape[1] // (d + 4)              # the FP8 layout: d value bytes + a scale
    scale = q.float().abs().amax(-1).clamp_min(1e-4) / 448.0
    q8 = (q.float() / scale[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    w8 = (w.float() * scale).to(w.dtype)
    capacity = table.shape[1] * block_size
    p = tix.plan(target_of(q.device), n, heads, d, table.shape[0], capacity, block_size, cache.dtype,
                 tma_ok=True, variant="tma", quant_q=True)
    scores = torch.empty((n, capacity), dtype=torch.float32, device=q.device)

    def launch():
        return indexer_tma.launch_indexer_tma(
            q8, w8, cache, table, row_req, row_len, scores, block_size=block_size, rows=p.rows,
            rows_pad=p.rows_pad, splits=p.splits, quant_q=False, dot_dtype=p.dot_dtype,
            head_dot=p.head_dot, num_warps=p.num_warps, num_stages=p.num_stages)
    return launch


def _compiled() -> dict:
    """id -> (kernel label, compiled kernel) of every indexer kernel built so far."""
    from k31c.lowering.triton import indexer as tix
    from k31c.lowering.triton import indexer_tma

    out = {}
    for label, kern in (("gather", tix._indexer_kernel), ("tma", indexer_tma._indexer_tma_kernel)):
        for cache in kern.device_caches.values():   # Triton 3.6/3.7 layout: (kernels by key, ...)
            for k in cache[0].values():
                out[id(k)] = (label, k)
    return out


def _describe(k) -> str:
    return (f"n_regs={k.n_regs} n_spills={k.n_spills} shared={k.metadata.shared} "
            f"warps={k.metadata.num_warps}")


def _compare(name: str, got: torch.Tensor, ref: torch.Tensor) -> str:
    same_inf = torch.equal(torch.isneginf(got), torch.isneginf(ref))
    finite = torch.isfinite(ref)
    scale = float(ref[finite].abs().max())
    diff = float((got[finite] - ref[finite]).abs().max()) / scale
    ok = same_inf and bool(torch.isfinite(got[finite]).all()) and diff < TOL
    assert ok, f"{name}: -inf pattern equal {same_inf}, max rel diff {diff:.3g}"
    return f"max rel diff {diff:.2e}"


def _oracle_check(pool: Pool, args) -> None:
    """TMA kernel vs the reference op on the q the FP8 path sees (quantised on the CPU)."""
    from k31c.graph import ops  # noqa: F401  (torch.ops.k31c.*)
    from k31c.graph.ops.cache_write import dequantize_index_fp8, quantize_index_fp8
    from k31c.lowering.triton import indexer as tix

    q = pool.q
    n = q.shape[0]
    values, scales = quantize_index_fp8(q.float().reshape(n * HEADS, DIM).cpu())
    q_deq = dequantize_index_fp8(values, scales).view(n, HEADS, DIM).cuda()
    ref = torch.ops.k31c.lightning_indexer(q_deq, *args[1:])
    got = tix.launch_indexer(*args, variant="tma", quant_q=True)   # the GPU default for FP8
    print(f"  oracle: tma vs reference op on dequantised q: {_compare('tma vs reference', got, ref)}")


def main() -> None:
    from k31c.lowering.triton import indexer as tix
    from k31c.lowering.triton.device import sm_count

    start = time.time()
    machine = measure_machine()
    sms = sm_count(torch.device("cuda"))     # what the launchers size their grids for
    print(f"# {machine.name}: copy {machine.copy_gbps:.0f} GB/s, {sms} SMs")
    configs = variants(sms)
    pool = Pool(max(CONTEXTS))
    for ctx in CONTEXTS:
        table, row_len = pool.context(ctx)
        args = (pool.q, pool.weights, pool.cache, table, pool.row_req, row_len)
        floor_us = bytes_floor_ms(scan_bytes(ctx), machine) * 1e3
        print(f"\nL={ctx >> 10}K  floor {floor_us:.1f} us")
        base = tix.launch_indexer(*args, variant="gather")
        torch.cuda.synchronize()
        if ctx == CONTEXTS[0]:
            try:
                _oracle_check(pool, args)
            except Exception as e:  # noqa: BLE001
                print(f"  oracle check FAILED: {type(e).__name__}: {str(e)[:300]}")
        # name -> a function making the variant's launch (the prequantised one builds its q first)
        makers = {name: (lambda cfg=cfg: lambda: tix.launch_indexer(*args, **cfg))
                  for name, cfg in configs.items()}
        makers["tma prequantised q"] = lambda: prequantised(args)
        for name, make in makers.items():
            try:
                try:
                    before = _compiled()
                except Exception:  # noqa: BLE001  (another Triton cache layout: no register report)
                    before = None
                launch = make()
                got = launch()
                torch.cuda.synchronize()
                if before is not None:
                    for key, (label, k) in _compiled().items():
                        if key not in before:
                            print(f"  {name:22s} compiled {label}: {_describe(k)}")
                check = _compare(name, got, base) if name != "gather" else "baseline"
                del got
                us = graph_ms(launch) * 1e3
                print(f"  {name:22s} {us:8.1f} us  floor {floor_us:7.1f}  "
                      f"ratio {us / floor_us:5.2f}  ({check})")
            except Exception as e:  # noqa: BLE001
                print(f"  {name:22s} FAILED: {type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc(limit=2)
                torch.cuda.synchronize()
        del base
        torch.cuda.empty_cache()
    print(f"# total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
