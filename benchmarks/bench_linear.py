"""The decode projections of the bench config (hidden 7168, K3.1 widths) on the H200:
`k31c::linear_group` (the grouped GEMV, lowering/triton/linear_group.py) against cuBLAS.

One row per group merge_projections makes (a KDA layer's six inputs, an MLA layer's three, a MoE
layer's three, the dense MLP's two) and per lone projection (o_proj, down projections, LM head),
at M = 1 and 16 rows. Peers, same process:
- "cuBLAS separate": one `F.linear` per weight (what the graph ran before merge_projections);
- "cuBLAS merged": one `F.linear` over the weights concatenated (what a model with fused
  projections, vLLM's merged/QKV linears, runs; it costs a copy of the weights).
Every call is timed as a CUDA-graph replay over several copies of the weights (> 300 MB in all,
so L2 holds none of them). Floor: the weight bytes over the copy bandwidth measured now (a GEMV
only reads, so it may pass 1.0x). The kernel is checked against the fp64 product every row.
With --sweep, the kernel's tiles (BN, BK, warps, stages) are swept per row and the best printed.

    PYTHONPATH=. python benchmarks/bench_linear.py [--sweep]     # ~1 minute (--sweep: ~3)
"""
from __future__ import annotations

import argparse
import itertools

import torch

try:
    from benchmarks.harness import Row, bytes_floor_ms, graph_ms, markdown, measure_machine
except ImportError:  # run as a script from benchmarks/
    from harness import Row, bytes_floor_ms, graph_ms, markdown, measure_machine

HIDDEN = 7168
GROUPS = {
    "KDA inputs (q, k, v, f_a, b, g)": ([12288, 12288, 12288, 128, 96, 12288], HIDDEN),
    "MLA inputs (q_a, kv_a, g)": ([1536, 576, 12288], HIDDEN),
    "MoE inputs (latent down, shared gate, up)": ([3584, 512, 512], HIDDEN),
    "MLP inputs (gate, up)": ([4096, 4096], HIDDEN),
    "o_proj": ([7168], 12288),
    "MLP down": ([7168], 4096),
    "latent up": ([7168], 3584),
    "shared down": ([7168], 512),
    "LM head": ([4096], HIDDEN),
    "q_b": ([18432], 1536),
}


def _copies(widths: list[int], k: int) -> list[list[torch.Tensor]]:
    per = sum(widths) * k * 2
    n = min(8, max(2, int(3e8 // per) + 1))
    return [[torch.randn(w, k, device="cuda", dtype=torch.bfloat16) * 0.02 for w in widths]
            for _ in range(n)]


def _error(x: torch.Tensor, weights: list[torch.Tensor], ys: list[torch.Tensor]) -> float:
    worst = 0.0
    for w, y in zip(weights, ys):
        want = x.double() @ w.double().t()
        worst = max(worst, ((y.double() - want).abs().max() / want.abs().max()).item())
    return worst


def rows(m: int, sweep: bool, machine) -> list[Row]:
    from k31c.lowering.triton import linear_group as lg
    out = []
    for name, (widths, k) in GROUPS.items():
        sets = _copies(widths, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        merged = [torch.cat(ws) for ws in sets]
        n = len(sets)
        kernel = graph_ms(lambda: [lg.launch(x, ws) for ws in sets]) / n
        peers = {"cuBLAS separate": graph_ms(lambda: [[torch.nn.functional.linear(x, w) for w in ws]
                                                      for ws in sets]) / n,
                 "cuBLAS merged": graph_ms(lambda: [torch.nn.functional.linear(x, w) for w in merged]) / n}
        note = f"max err {_error(x, sets[0], lg.launch(x, sets[0])):.1e}; tiles {lg.tiles(x, sum(widths))}"
        if sweep:
            best = None
            for bn, bk, warps, stages in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4)):
                cfg = dict(BN=bn, BK=bk, num_warps=warps, num_stages=stages)
                try:
                    ms = graph_ms(lambda: [lg.launch(x, ws, cfg) for ws in sets]) / n
                except Exception:  # noqa: BLE001  (a tile that does not fit shared memory)
                    continue
                if best is None or ms < best[0]:
                    best = (ms, cfg)
            note += f"; best swept {best[0]:.4f} ms at {best[1]}" if best else "; no swept tile ran"
        floor = bytes_floor_ms(sum(widths) * k * 2, machine)
        out.append(Row(f"linear_group: {name}", f"M={m}, K={k}, N={sum(widths)}", kernel, floor, "bytes",
                       peers, note))
        del sets, merged
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="sweep the kernel's tiles per row")
    args = ap.parse_args()
    machine = measure_machine()
    print(markdown([r for m in (1, 16) for r in rows(m, args.sweep, machine)], machine))


if __name__ == "__main__":
    main()
