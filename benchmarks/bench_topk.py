"""Benchmark of the Triton top-k and of the lowering of `k31c::lightning_indexer_topk` (the scan,
then the select) at K3.1 Pro shapes (spec/performance.md §8 goals G2 and G3).

topk_select: 64 rows (B = 16 requests x R = 4 rows) of fp32 scores, k = 2048, contexts 16K..1M.
Peers in the same run: torch.topk (sorted=False) on the same scores, the eager reference op, and
torch.compile of the reference function. Floor: the scores read once (N·L·4 bytes) over the copy
bandwidth measured now. A ReLU-zero-heavy 1M row set (the exact fallback path) is timed too.

lightning_indexer_topk: 16 x 4 rows, 32 heads x 128, FP8 index cache (132 B/token), block 64,
k = 2048. Peers: the eager reference op and the Triton scan alone (goal G3: scan + select
<= 1.15x the scan). Floor: the keys read once per request (B·L·132 bytes), as in spec §6.

k31c and the Triton peers are timed as CUDA-graph replays (how the model runs them: no launch
overhead); "k31c eager" is the same call launched from Python. Every row also checks that the
selected sets equal the reference op's.

    PYTHONPATH=. python benchmarks/bench_topk.py [--quick | --pair]

--quick: the select alone at 128K and 1M (and the decode rows), without the torch.compile peer,
then each kernel's device time from the profiler, then the time per call from one graph of
RING calls over RING different score buffers (`ring_times`: the graph's own launch shared, as
in a decode step's graph, and no call finding its scores in L2; torch.topk timed alike).
--pair: the registered op (`lightning_indexer_topk`: the scan + select pair, or from
`indexer_topk.FUSED_FROM` keys a row the fused select) alone at 128K and 1M, beside the scan alone,
the pair and the fused select (`indexer_topk.fused_indexer_topk`) each called directly, then the
fused select's launches each alone (`fused_parts`). `--pair --rows 32`: the same with rows of
32K keys in the 128K and 1M tables (the op chooses by the table's width: a long pool's short
rows). Besides randn scores ("random"), each run
times scores spread as the layer's indexer scores are ("indexer-like", 128K and up).
"""
from __future__ import annotations

import itertools

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


def score_rows(kind: str, n_rows: int, ctx: int, gen: torch.Generator) -> torch.Tensor:
    """[n_rows, ctx] fp32 scores on the GPU: randn ("random"), or spread as the layer's indexer
    scores ("indexer-like"), or ReLU-zero-heavy ("relu-zeros")."""
    scores = torch.randn(n_rows, ctx, device="cuda", generator=gen)
    if kind == "relu-zeros":      # ~1,000 positives per row, the rest exact 0: ties at the k-th
        scores = scores.relu() * (torch.rand(n_rows, ctx, device="cuda", generator=gen) < 1e-3)
    elif kind == "indexer-like":  # the spread of the layer's indexer scores (mean ~0.05, sd
        # ~0.1): the top few thousand share their sign and high exponent bits, where randn's
        # cross the 2.0 and 4.0 exponent boundaries (the select's cost depends on the bits)
        scores = 0.05 + 0.1 * scores
    return scores


def topk_rows(machine: Machine, contexts=CONTEXTS, compile_peer: bool = True) -> list[Row]:
    import k31c.graph.ops.indexer as ref_ops
    from k31c.lowering.triton import topk
    compiled = torch.compile(ref_ops.select_topk, dynamic=True) if compile_peer else None
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    # 64 rows (B = 16 x R = 4) at every context; decode steps' 1 and 16 rows at 32K
    cases = ([(ctx, "random", N) for ctx in contexts] + [(contexts[-1], "relu-zeros", N)]
             + [(ctx, "indexer-like", N) for ctx in contexts if ctx >= 128 << 10]
             + [(32 << 10, "random", n) for n in (1, 16)])
    for ctx, kind, n_rows in cases:
        scores = score_rows(kind, n_rows, ctx, gen)
        row_len = torch.full((n_rows,), ctx, dtype=torch.int32, device="cuda")
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
        rows.append(Row("topk_select", f"{n_rows}x{ctx >> 10}K k={K} {kind}", ms,
                        bytes_floor_ms(n_rows * ctx * 4, machine), "bytes", peers, note))
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


def pair_inputs(pool: IndexPool, ctx: int, gen: torch.Generator, keys: int | None = None) -> tuple:
    """The scan's arguments at `ctx`: q [N, 32, 128] bf16, head weights, the pool's cache and
    a table of ctx keys a request, rows' requests (4 consecutive rows a request) and lengths
    (keys - 3 .. keys; keys = ctx unless given: short rows in a long table)."""
    q = torch.randn(N, HEADS, DIM, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(N, HEADS, device="cuda", generator=gen) * HEADS ** -0.5
    row_req = torch.arange(B, device="cuda").repeat_interleave(R).int()
    row_len = ((keys or ctx) - R + 1 + torch.arange(R, device="cuda").repeat(B)).int()
    return q, w, pool.cache, pool.table(ctx), row_req, row_len


def indexer_topk_rows(machine: Machine, contexts=CONTEXTS, keys: int | None = None) -> list[Row]:
    """The op, the pair and the fused select on tables of each context (rows of `keys` keys
    where given: the op's choice goes by the table's width, not the rows' lengths)."""
    import k31c.graph.ops.indexer  # noqa: F401
    from k31c.lowering.triton import indexer, indexer_topk, topk
    pool = IndexPool(max(contexts))
    gen = torch.Generator(device="cuda").manual_seed(2)
    rows = []
    for ctx in contexts:
        args = pair_inputs(pool, ctx, gen, keys)
        used = min(keys or ctx, ctx)

        def op():
            return indexer_topk.lightning_indexer_topk(*args, K)

        def pair():
            return topk.topk_select(indexer.lightning_indexer(*args), args[5], K)

        got = op()
        ref = torch.ops.k31c.lightning_indexer_topk(*args, K)   # fp32 q: FP8 q moves a few picks
        offset = (torch.arange(N, device="cuda") * (ctx + 1))[:, None]
        overlap = torch.isin(got + offset, ref + offset).float().mean()
        fused_ok = indexer_topk.fused_why_not(*args, K) is None
        peers = {"k31c eager": time_ms(op),
                 "scan only (triton)": graph_ms(lambda: indexer.lightning_indexer(*args)),
                 "pair (scan, then select)": graph_ms(pair),
                 **({"fused select": graph_ms(lambda: indexer_topk.fused_indexer_topk(*args, K))}
                    if fused_ok else {}),
                 "reference eager": time_ms(lambda: torch.ops.k31c.lightning_indexer_topk(*args, K),
                                            warmup=1, reps=3)}
        ms = graph_ms(op)
        scan = peers["scan only (triton)"]
        note = (f"{ms / scan:.2f}x scan only (G3 <= 1.15); the pair "
                f"{peers['pair (scan, then select)'] / scan:.2f}x; "
                f"{100 * float(overlap):.2f}% of picks = fp32 reference's")
        if fused_ok:
            same = same_sets(indexer_topk.fused_indexer_topk(*args, K), pair())
            note += (f"; fused select {peers['fused select'] / scan:.2f}x scan only, sets "
                     f"{'==' if same else '!='} the pair's")
        shape = f"B{B}xR{R} H{HEADS}x{DIM} L={ctx >> 10}K" + (f" rows {used >> 10}K" if used < ctx else "")
        rows.append(Row("lightning_indexer_topk (fp8)", f"{shape} k={K}", ms,
                        bytes_floor_ms(B * used * (DIM + 4), machine), "bytes", peers, note))
    return rows


def fused_parts(contexts=(128 << 10, 1 << 20)) -> str:
    """Each launch of the fused select alone (us, graph replay, one call a graph) beside the
    registered scan: the sample scan, the plan, the filter scan (its rows' counters zeroed before
    each call, a ~1-2 us launch of its own), the refine, the gated scan with no row marked and the
    select of the marked rows; then the whole select."""
    from k31c.lowering.triton import indexer, indexer_topk, indexer_ws, indexer_ws_filter, topk, topk_plan
    from k31c.lowering.triton.device import PDL_ON, sm_count
    pool = IndexPool(max(contexts))
    gen = torch.Generator(device="cuda").manual_seed(3)
    lines = ["| context | scan (registered) | sample scan | plan | filter scan | refine | gated scan | "
             "marked select | fused select |", "|---|---|---|---|---|---|---|---|---|"]
    for ctx in contexts:
        args = pair_inputs(pool, ctx, gen)
        q, w, cache, table, row_req, row_len = args
        if indexer_topk.fused_why_not(*args, K) is not None:
            return f"fused select: {indexer_topk.fused_why_not(*args, K)}"
        p = topk_plan.plan(N, ctx, K, sm_count(q.device))
        ws = p.workspace(q.device)
        stride = topk_plan.sample_stride(ctx, BLOCK)
        s_table, s_len = indexer_topk.sample_layout(table, row_len, BLOCK, stride, dependent=True)
        sample = torch.empty((N, s_table.shape[1] * BLOCK), device="cuda")
        out = torch.empty((N, K), dtype=torch.int32, device="cuda")
        scores = torch.empty((N, ctx), device="cuda")
        flags = {"PTX": True, **PDL_ON}      # as the fused select launches them (sm_90)
        cnt = ws["state"].view(N, topk_plan.ROW_STATE)[:, topk_plan.ST_CNT.value]
        indexer_ws.launch(q, w, cache, s_table, row_req, s_len, sample)
        topk.launch_plan(sample, row_len, out, p, ws, src_len_ptr=s_len, **flags)

        def filt():
            cnt.zero_()
            indexer_ws_filter.launch_filter(*args, ctx, ws["state"], ws["ckey"], ws["cpos"], p.cap)
        filt()
        # the refine defers whole-row selects: the state it leaves marks no row for the gated launches
        topk.launch_refine(scores, row_len, out, p, ws, n_chunks=0, ROW_SELECT=topk.ROW_SELECT_DEFER, **flags)
        parts = [graph_ms(lambda: indexer.lightning_indexer(*args)),
                 graph_ms(lambda: indexer_ws.launch(q, w, cache, s_table, row_req, s_len, sample)),
                 graph_ms(lambda: topk.launch_plan(sample, row_len, out, p, ws, src_len_ptr=s_len, **flags)),
                 graph_ms(filt),
                 graph_ms(lambda: topk.launch_refine(scores, row_len, out, p, ws, n_chunks=0,
                                                     ROW_SELECT=topk.ROW_SELECT_DEFER, **flags)),
                 graph_ms(lambda: indexer_ws.launch(*args, scores, gate=indexer_topk.whole_row_gate(ws))),
                 graph_ms(lambda: topk.launch_refine(scores, row_len, out, p, ws, n_chunks=0,
                                                     ROW_SELECT=topk.ROW_SELECT_MARKED, **flags)),
                 graph_ms(lambda: indexer_topk.fused_indexer_topk(*args, K))]
        lines.append(f"| {ctx >> 10}K | " + " | ".join(f"{t * 1e3:.1f}" for t in parts) + " |")
    return "\n".join(lines)


def run(machine: Machine, contexts=CONTEXTS, compile_peer: bool = True) -> list[Row]:
    return topk_rows(machine, contexts, compile_peer) + indexer_topk_rows(machine, contexts)


RING = 10          # calls (and score buffers) per graph in ring_times


def ring_times(contexts=(128 << 10, 1 << 20)) -> str:
    """Per-call time (us) of topk_select and torch.topk on 64 random rows from one CUDA graph of
    RING calls, each on its own score buffer (sets checked against the reference op's: randn
    rows do tie at the k-th now and then, where torch.topk may keep either position)."""
    import k31c.graph.ops.indexer  # noqa: F401  (registers torch.ops.k31c.topk_select)
    from k31c.lowering.triton import topk
    lines = [f"| rows x context | k31c us (graph of {RING}) | torch.topk us (graph of {RING}) | ratio "
             "| sets |", "|---|---|---|---|---|"]
    for ctx in contexts:
        ring = [torch.randn(N, ctx, device="cuda") for _ in range(RING)]
        row_len = torch.full((N,), ctx, dtype=torch.int32, device="cuda")
        exact = all(same_sets(topk.topk_select(s, row_len, K),
                              torch.ops.k31c.topk_select(s, row_len, K)) for s in ring)

        def rotating(fn):                  # each captured call on the next buffer
            turn = itertools.count()
            return lambda: fn(ring[next(turn) % RING])
        ms = graph_ms(rotating(lambda s: topk.topk_select(s, row_len, K)), calls=RING)
        peer = graph_ms(rotating(lambda s: torch.topk(s, K, dim=1, sorted=False)), calls=RING)
        lines.append(f"| {N}x{ctx >> 10}K | {ms * 1e3:.1f} | {peer * 1e3:.1f} | {peer / ms:.2f}x | "
                     f"{'==' if exact else '!='} reference |")
        del ring
    return "\n".join(lines)


def kernel_times(contexts=(32 << 10, 128 << 10, 1 << 20), row_counts=(1, 16, N)) -> str:
    """Per-kernel device time (us) of one topk_select call on random rows, from the profiler; at
    64 x 1M also on indexer-like and relu-zeros rows (the plan's cost depends on the scores)."""
    from torch.profiler import ProfilerActivity, profile
    from k31c.lowering.triton import topk
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = ["| rows x context | " + " | ".join(("plan", "filter", "refine")) + " |", "|---|---|---|---|"]
    cases = ([(ctx, n_rows, "random") for ctx in contexts for n_rows in row_counts]
             + [(contexts[-1], N, kind) for kind in ("indexer-like", "relu-zeros")])
    for ctx, n_rows, kind in cases:
        scores = score_rows(kind, n_rows, ctx, gen)
        row_len = torch.full((n_rows,), ctx, dtype=torch.int32, device="cuda")
        for _ in range(3):
            topk.topk_select(scores, row_len, K)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                topk.topk_select(scores, row_len, K)
            torch.cuda.synchronize()
        us = {e.key: e.device_time_total / e.count for e in prof.key_averages() if e.count}
        cells = [f"{us.get(name, 0.0):.1f}" for name in ("_plan_kernel", "_filter_kernel", "_refine_kernel")]
        lines.append(f"| {n_rows}x{ctx >> 10}K{'' if kind == 'random' else ' ' + kind} | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys
    m = measure_machine()
    if "--quick" in sys.argv:    # the select alone at 128K and 1M, no torch.compile peer; per-kernel times
        print(markdown(topk_rows(m, (128 << 10, 1 << 20), compile_peer=False), m))
        print()
        print(kernel_times())
        print()
        print(ring_times())
    elif "--pair" in sys.argv and "--rows" in sys.argv:   # rows of --rows K keys in 128K and 1M tables
        short = int(sys.argv[sys.argv.index("--rows") + 1]) << 10
        print(markdown(indexer_topk_rows(m, (128 << 10, 1 << 20), keys=short), m))
    elif "--pair" in sys.argv:   # the scan + select pair alone at 128K and 1M, the fused select's parts
        print(markdown(indexer_topk_rows(m, (128 << 10, 1 << 20)), m))
        print()
        print(fused_parts())
    else:
        print(markdown(run(m), m))
