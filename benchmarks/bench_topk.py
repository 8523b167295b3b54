"""Benchmark of the Triton top-k and the fused indexer + top-k comparison kernel
(benchmarks/alternatives/indexer_topk_fused.py) at K3.1 Pro shapes (spec/performance.md §8
goals G2 and G3).

topk_select: 64 rows (B = 16 requests x R = 4 rows) of fp32 scores, k = 2048, contexts 16K..1M.
Peers in the same run: torch.topk (sorted=False) on the same scores, the eager reference op, and
torch.compile of the reference function. Floor: the scores read once (N·L·4 bytes) over the copy
bandwidth measured now. A ReLU-zero-heavy 1M row set (the exact fallback path) is timed too.

lightning_indexer_topk: 16 x 4 rows, 32 heads x 128, FP8 index cache (132 B/token), block 64,
k = 2048. Peers: the eager reference op, the unfused pair (Triton lightning_indexer + Triton
topk_select) and the Triton scan alone (goal G3: fused <= 1.15x the scan). Floor: the keys read
once per request (B·L·132 bytes), as in spec §6.

k31c and the Triton peers are timed as CUDA-graph replays (how the model runs them: no launch
overhead); "k31c eager" is the same call launched from Python. Every row also checks that the
selected sets equal the reference op's.

    PYTHONPATH=. python benchmarks/bench_topk.py
"""
from __future__ import annotations

import torch

try:
    from benchmarks.harness import Machine, Row, bytes_floor_ms, graph_ms, markdown, measure_machine, time_ms
except ImportError:  # run as a script from benchmarks/
    from harness import Machine, Row, bytes_floor_ms, graph_ms, markdown, measure_machine, time_ms

B, R, HEADS, DIM, BLOCK, K = 16, 4, 32, 128, 64, 2048
N = B * R
CONTEXTS = (16 << 10, 32 << 10, 128 << 10, 256 << 10, 1 << 20)


def same_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.sort(1).values, b.sort(1).values))


def topk_rows(machine: Machine, contexts=CONTEXTS, compile_peer: bool = True) -> list[Row]:
    import k31c.graph.ops.indexer as ref_ops
    from k31c.lowering.triton import topk
    compiled = torch.compile(ref_ops.select_topk, dynamic=True) if compile_peer else None
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = [(ctx, "random") for ctx in contexts] + [(contexts[-1], "relu-zeros")]
    for ctx, kind in cases:
        scores = torch.randn(N, ctx, device="cuda", generator=gen)
        if kind == "relu-zeros":      # ~1,000 positives per row, the rest exact 0: ties at the k-th
            scores = scores.relu() * (torch.rand(N, ctx, device="cuda", generator=gen) < 1e-3)
        row_len = torch.full((N,), ctx, dtype=torch.int32, device="cuda")
        ref = torch.ops.k31c.topk_select(scores, row_len, K)
        got = topk.topk_select(scores, row_len, K)
        exact = same_sets(got, ref)
        peers = {"k31c eager": time_ms(lambda: topk.topk_select(scores, row_len, K)),
                 "torch.topk": graph_ms(lambda: torch.topk(scores, K, dim=1, sorted=False)),
                 "reference eager": time_ms(lambda: torch.ops.k31c.topk_select(scores, row_len, K),
                                            warmup=1, reps=5)}
        try:
            if compiled is not None:
                peers["reference compiled"] = time_ms(lambda: compiled(scores, row_len, K), warmup=2,
                                                      reps=5)
        except Exception as e:  # noqa: BLE001  (a peer that does not compile is reported, not fatal)
            print(f"torch.compile of the reference failed at {ctx}: {type(e).__name__}: {e}")
        ms = graph_ms(lambda: topk.topk_select(scores, row_len, K))
        vs_topk = peers["torch.topk"] / ms
        note = f"{vs_topk:.1f}x torch.topk; sets {'==' if exact else '!='} reference"
        if kind == "random":
            tk = torch.topk(scores, K, dim=1, sorted=False).indices.int()
            note += f", {'==' if same_sets(got, tk) else '!='} torch.topk"
        rows.append(Row("topk_select", f"{N}x{ctx >> 10}K k={K} {kind}", ms,
                        bytes_floor_ms(N * ctx * 4, machine), "bytes", peers, note))
        del scores
    return rows


class IndexPool:
    """FP8 index cache (random keys, power-of-two scales) for every request at the largest context;
    each request's blocks are a shuffled slice of the pool."""

    def __init__(self, max_ctx: int):
        gen = torch.Generator(device="cuda").manual_seed(1)
        self.blocks = B * (max_ctx // BLOCK)
        self.cache = torch.empty(self.blocks, BLOCK * (DIM + 4), dtype=torch.uint8, device="cuda")
        keys = torch.randn(self.blocks, BLOCK, DIM, device="cuda", generator=gen)
        self.cache[:, : BLOCK * DIM] = keys.to(torch.float8_e4m3fn).view(torch.uint8).flatten(1)
        del keys
        scales = torch.rand(self.blocks, BLOCK, device="cuda", generator=gen) * 0.01 + 0.01
        self.cache[:, BLOCK * DIM:] = scales.view(torch.uint8).flatten(1)
        self.perm = torch.randperm(self.blocks, device="cuda", generator=gen).int()

    def table(self, ctx: int) -> torch.Tensor:
        per = ctx // BLOCK
        return self.perm[: B * per].view(B, per).contiguous()


def fused_rows(machine: Machine, contexts=CONTEXTS) -> list[Row]:
    import k31c.graph.ops.indexer  # noqa: F401
    from k31c.lowering.triton import indexer, topk
    try:
        from benchmarks.alternatives.indexer_topk_fused import lightning_indexer_topk_fused as fused
    except ImportError:  # run as a script from benchmarks/
        from alternatives.indexer_topk_fused import lightning_indexer_topk_fused as fused
    pool = IndexPool(max(contexts))
    gen = torch.Generator(device="cuda").manual_seed(2)
    rows = []
    for ctx in contexts:
        table = pool.table(ctx)
        q = torch.randn(N, HEADS, DIM, device="cuda", generator=gen).to(torch.bfloat16)
        w = torch.randn(N, HEADS, device="cuda", generator=gen) * HEADS ** -0.5
        row_req = torch.arange(B, device="cuda").repeat_interleave(R).int()
        row_len = (ctx - R + 1 + torch.arange(R, device="cuda").repeat(B)).int()
        args = (q, w, pool.cache, table, row_req, row_len)

        def pair():
            return topk.topk_select(indexer.lightning_indexer(*args), row_len, K)

        got = fused(*args, K)
        agree = same_sets(got, pair())           # same FP8 scoring as the Triton scan
        ref = torch.ops.k31c.lightning_indexer_topk(*args, K)   # fp32 q: FP8 q moves a few picks
        overlap = torch.isin(got + (torch.arange(N, device="cuda") * (ctx + 1))[:, None],
                             ref + (torch.arange(N, device="cuda") * (ctx + 1))[:, None]).float().mean()
        peers = {"k31c eager": time_ms(lambda: fused(*args, K)),
                 "unfused pair (triton)": graph_ms(pair),
                 "scan only (triton)": graph_ms(lambda: indexer.lightning_indexer(*args)),
                 "reference eager": time_ms(lambda: torch.ops.k31c.lightning_indexer_topk(*args, K),
                                            warmup=1, reps=3)}
        ms = graph_ms(lambda: fused(*args, K))
        note = (f"{ms / peers['scan only (triton)']:.2f}x scan only (G3 <= 1.15); "
                f"sets {'==' if agree else '!='} triton indexer + topk_select; "
                f"{100 * float(overlap):.2f}% of picks = fp32 reference's")
        rows.append(Row("lightning_indexer_topk (fp8)", f"B{B}xR{R} H{HEADS}x{DIM} L={ctx >> 10}K k={K}",
                        ms, bytes_floor_ms(B * ctx * (DIM + 4), machine), "bytes", peers, note))
    return rows


def run(machine: Machine, contexts=CONTEXTS, compile_peer: bool = True) -> list[Row]:
    return topk_rows(machine, contexts, compile_peer) + fused_rows(machine, contexts)


if __name__ == "__main__":
    m = measure_machine()
    print(markdown(run(m), m))
