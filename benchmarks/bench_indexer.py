"""Benchmark of the Triton lightning indexer scan and the cache writes at K3.1 Pro shapes (issue 4,
spec/performance.md §6 (b), goal G1 of §8).

Shapes: B = 16 requests x R = 4 verify rows, 32 indexer heads x 128, FP8 index cache (132 B/token:
128 e4m3 + one fp32 scale), block size 64, blocks scattered through the pool, contexts 16K..1M.
The kernel timed is the registered launcher's default (on the H200 indexer_ws's kernel). Peers
in the same run: "tma kernel" and "gather kernel" (indexer_tma.py's and indexer.py's,
`launch_indexer(variant=...)`, timed as CUDA-graph replay like the note's replay of the default), the eager reference op and
torch.compile of a plain-torch formulation (gather → dequantise → einsum → ReLU → head-weighted
sum → mask).

Floor of the scan (bytes over the copy bandwidth measured now), counting exactly:
  index keys read once per request  B·L·132      (e4m3 values + fp32 scales)
+ block table                       B·(L/64)·4
+ q (bf16) and weights (fp32)       N·32·128·2 + N·32·4
+ scores written                    N·L·4         (the op's [N, L] fp32 output, -inf tail included)
The note also gives the ratio against the keys-only floor of spec §6 (B·L·132), and a call's
time from a graph of RING calls (`ring_ms`) for the default and the TMA kernel: a graph of one
call carries its own launch (4.5-8 us on the H200), which a decode step's graph shares.
time_ms does not flush L2 (50 MB): at 16K the 35 MB of keys can stay in L2, so the ratio there
may fall below 1.

    PYTHONPATH=. python benchmarks/bench_indexer.py           # table (+ the MXFP8 rows)
    PYTHONPATH=. python benchmarks/bench_indexer.py --sweep   # launch-config sweep at 128K and 1M
"""
from __future__ import annotations

import sys

import torch

try:
    from benchmarks.harness import Machine, Row, bytes_floor_ms, graph_ms, markdown, measure_machine, time_ms, try_ms
except ImportError:  # run as a script from benchmarks/
    from harness import Machine, Row, bytes_floor_ms, graph_ms, markdown, measure_machine, time_ms, try_ms

HEADS, DIM, BLOCK = 32, 128, 64
ROW_BYTES = DIM + 4                 # 132 B per token
B, R = 16, 4
N = B * R
CONTEXTS = (16 << 10, 32 << 10, 128 << 10, 256 << 10, 1 << 20)
COMPILE_MAX = 256 << 10             # the plain formulation materialises [B, R, H, L] fp32 logits
RING = 8                            # calls a graph in ring_ms


def plain_indexer(q, weights, cache, block_table, row_len, block_size: int):
    """The torch.compile peer (decode layout: rows b*R .. b*R+R-1 belong to request b)."""
    n_req, max_blocks = block_table.shape
    n, heads, d = q.shape
    r = n // n_req
    width = max_blocks * block_size
    pos = torch.arange(width, device=q.device)
    blocks = block_table[:, pos // block_size].long()                       # [B, L]
    offs = pos % block_size
    values = cache[:, : block_size * d].unflatten(1, (block_size, d))[blocks, offs]      # [B, L, d]
    scales = cache[:, block_size * d:].unflatten(1, (block_size, 4))[blocks, offs]       # [B, L, 4]
    scales = scales.view(torch.float32).squeeze(-1)
    keys = values.view(torch.float8_e4m3fn).to(torch.bfloat16)
    logits = torch.einsum("brhd,bld->brhl", q.view(n_req, r, heads, d).to(torch.bfloat16), keys)
    scores = (logits.float().relu() * weights.view(n_req, r, heads, 1)).sum(2) * scales[:, None, :]
    scores = scores.reshape(n, width)
    return scores.masked_fill(pos[None, :] >= row_len[:, None].long(), float("-inf"))


class Pool:
    """An FP8 index pool big enough for the largest context; tables are a shuffled permutation."""

    def __init__(self, max_ctx: int, seed: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        blocks_per_req = max_ctx // BLOCK
        num_blocks = B * blocks_per_req + 7
        cache = torch.empty(num_blocks, BLOCK * ROW_BYTES, dtype=torch.uint8, device="cuda")
        # finite e4m3 bytes (0x7F/0xFF are NaN) and positive scales
        magnitude = torch.randint(0, 0x7F, (num_blocks, BLOCK * DIM), device="cuda", generator=g,
                                  dtype=torch.uint8)
        sign = torch.randint(0, 2, magnitude.shape, device="cuda", generator=g, dtype=torch.uint8) << 7
        cache[:, : BLOCK * DIM] = magnitude | sign
        cache[:, BLOCK * DIM:].view(torch.float32).uniform_(1e-3, 2e-3, generator=g)
        self.cache = cache
        perm = torch.randperm(num_blocks, device="cuda", generator=g)[: B * blocks_per_req]
        self.block_table = perm.view(B, blocks_per_req).to(torch.int32)
        self.q = torch.randn(N, HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=g)
        self.weights = torch.randn(N, HEADS, device="cuda", generator=g) * (HEADS * DIM) ** -0.5
        self.row_req = torch.arange(B, device="cuda", dtype=torch.int32).repeat_interleave(R)

    def context(self, ctx: int):
        """(block_table, row_len) for requests of `ctx` tokens; row r sees ctx - R + 1 + r keys."""
        row_len = (ctx - R + 1 + torch.arange(R, device="cuda", dtype=torch.int32)).repeat(B)
        return self.block_table[:, : ctx // BLOCK], row_len


def ring_ms(fn, pool: Pool, ctx: int) -> float:
    """Per-call time of fn(block_table, row_len) replayed from one CUDA graph of RING calls, as
    a decode step's graph shares its launch; the calls cycle over disjoint slices of the pool's
    blocks, so no call finds the previous one's keys in L2 (at 1M one slice: 2.2 GB of keys), and
    each keeps its own scores."""
    width = ctx // BLOCK
    slices = max(1, min(RING, pool.block_table.shape[1] // width))
    tables = [pool.block_table[:, (i % slices) * width:(i % slices + 1) * width]
              for i in range(RING)]
    row_len = pool.context(ctx)[1]

    def calls():
        return [fn(table, row_len) for table in tables]     # outputs kept: one buffer each
    return graph_ms(calls) / RING


def scan_bytes(ctx: int) -> float:
    return (B * ctx * ROW_BYTES + B * (ctx // BLOCK) * 4 + N * HEADS * DIM * 2 + N * HEADS * 4
            + N * ctx * 4)


def _scan_rows(machine: Machine, pool: Pool, contexts) -> list[Row]:
    from k31c.lowering.triton import indexer as tix

    rows = []
    compiled = torch.compile(plain_indexer, dynamic=True)   # one compile for all L
    for ctx in contexts:
        table, row_len = pool.context(ctx)
        args = (pool.q, pool.weights, pool.cache, table, pool.row_req, row_len)
        ms = time_ms(lambda: tix.lightning_indexer(*args))
        peers = {}
        slow = ctx >= (256 << 10)
        t = try_ms(lambda: torch.ops.k31c.lightning_indexer(*args), warmup=1, reps=3 if slow else 10)
        if t is not None:
            peers["eager ref"] = t
        if ctx <= COMPILE_MAX:
            t = try_ms(lambda: compiled(pool.q, pool.weights, pool.cache, table, row_len, BLOCK),
                       warmup=2, reps=10)
            if t is not None:
                peers["torch.compile"] = t
        floor = bytes_floor_ms(scan_bytes(ctx), machine)
        keys_only = bytes_floor_ms(B * ctx * ROW_BYTES, machine)
        replay = graph_ms(lambda: tix.lightning_indexer(*args))
        t_tma = try_ms(lambda: tix.launch_indexer(*args, variant="tma"), timer=graph_ms)
        if t_tma is not None:
            peers["tma kernel"] = t_tma
        rest = (pool.q, pool.weights, pool.cache)
        ring = ring_ms(lambda t, n: tix.lightning_indexer(*rest, t, pool.row_req, n), pool, ctx)
        ring_tma = try_ms(lambda t, n: tix.launch_indexer(*rest, t, pool.row_req, n, variant="tma"),
                          ring_ms, pool=pool, ctx=ctx)
        t = try_ms(lambda: tix.launch_indexer(*args, variant="gather"), timer=graph_ms)
        if t is not None:
            peers["gather kernel"] = t
        note = (f"CUDA-graph replay {replay * 1e3:.1f} us = {replay / floor:.2f}x floor"
                + (f" (tma kernel {t_tma / floor:.2f}x)" if t_tma is not None else "")
                + (f" (gather kernel {t / floor:.2f}x)" if t is not None else "")
                + f"; {ring * 1e3:.1f} us = {ring / floor:.2f}x a call from a graph of {RING}"
                + (f" (tma kernel {ring_tma / floor:.2f}x)" if ring_tma is not None else "") + "; "
                f"{ms / keys_only:.2f}x the keys-only floor ({keys_only * 1e3:.1f} us)")
        if ctx > COMPILE_MAX:
            note += "; torch.compile peer skipped (its [B,R,H,L] fp32 logits do not fit)"
        rows.append(Row("lightning_indexer (fp8)", f"B{B}xR{R} H{HEADS}x{DIM} L={ctx >> 10}K",
                        ms, floor, "bytes", peers, note))
    return rows


def mxfp8_rows(machine: Machine, contexts=(32 << 10, 128 << 10)) -> list[Row]:
    """The MXFP8 index cache (e4m3 + one E8M0 byte per 32 values: also 132 B/token) scanned by
    the registered MX kernel (`indexer.MX_VARIANT`: the TMA kernel's MX form, keys and q
    dequantised to exact bf16 on chip, one dot per block, a 168-register cap for 3 programs an
    SM), the same without the cap and indexer_mxfp8's gather kernel (four partial FP8 dots per
    key), against the registered FP8 kernel (per-token scale) on the same bytes with fp32
    scales."""
    from k31c.lowering.triton import indexer as tix

    pool = Pool(max(contexts))
    g = torch.Generator(device="cuda").manual_seed(2)
    mx = pool.cache.clone()
    mx[:, BLOCK * DIM:] = torch.randint(116, 124, mx[:, BLOCK * DIM:].shape, device="cuda",
                                        generator=g, dtype=torch.uint8)     # scales 2^-11 .. 2^-4
    mx = mx.view(torch.float8_e4m3fn)
    rows = []
    for ctx in contexts:
        table, row_len = pool.context(ctx)
        args = (pool.q, pool.weights, mx, table, pool.row_req, row_len)
        fp8_args = (pool.q, pool.weights, pool.cache, table, pool.row_req, row_len)
        ms = graph_ms(lambda: tix.lightning_indexer(*args))
        peers = {"fp8 kernel": graph_ms(lambda: tix.lightning_indexer(*fp8_args))}
        t = try_ms(lambda: tix.launch_indexer(*fp8_args, variant="gather"), timer=graph_ms)
        if t is not None:
            peers["fp8 gather kernel"] = t
        floor = bytes_floor_ms(scan_bytes(ctx), machine)
        # (keys a step, warps): the default spills 1,424 B at R = 4 in its sm_90a build; 64 keys on
        # 8 warps 40 B, 32 keys on 8 warps none
        tiles = {kw: try_ms(lambda kw=kw: tix.launch_indexer(*args, keys_per_step=kw[0], num_warps=kw[1],
                                                             variant="gather"),
                            timer=graph_ms) for kw in ((64, 8), (32, 8), (64, 4))}
        for name, knobs in (("mxfp8 gather kernel", dict(variant="gather")),     # the registered: tma
                            ("mxfp8 tma kernel, no register cap", dict(variant="tma", maxnreg=0))):
            t = try_ms(lambda knobs=knobs: tix.launch_indexer(*args, **knobs), timer=graph_ms)
            if t is not None:
                peers[name] = t
        rows.append(Row("lightning_indexer (mxfp8)", f"B{B}xR{R} H{HEADS}x{DIM} L={ctx >> 10}K",
                        ms, floor, "bytes", peers, f"CUDA-graph replay times; registered: {tix.MX_VARIANT}; "
                        "gather: q quantised per 32 values on chip, 4 partial FP8 dots per 128-wide key, "
                        "(keys, warps) " + " ".join(
                            f"{k},{w}:{'failed' if t is None else f'{t:.4f}'}" for (k, w), t in tiles.items())))
    return rows


def _write_rows(machine: Machine) -> list[Row]:
    """The cache writes at one decode step (64 new tokens) and one 8K prefill chunk."""
    from k31c.lowering.triton import cache_write as tcw

    rows = []
    g = torch.Generator(device="cuda").manual_seed(1)
    num_blocks = 4096
    index = torch.zeros(num_blocks, BLOCK * ROW_BYTES, dtype=torch.uint8, device="cuda")
    latent = torch.zeros(num_blocks, BLOCK, 576, dtype=torch.bfloat16, device="cuda")
    latent8 = torch.zeros(num_blocks, BLOCK, 656, dtype=torch.uint8, device="cuda")
    index_mx = torch.zeros(num_blocks, BLOCK * ROW_BYTES, dtype=torch.float8_e4m3fn, device="cuda")
    w = torch.rand(DIM, device="cuda", generator=g) + 0.5
    b = torch.randn(DIM, device="cuda", generator=g)
    for n in (N, 8192):
        slots = torch.randperm(num_blocks * BLOCK, device="cuda", generator=g)[:n]
        k_pre = torch.randn(n, DIM, device="cuda", dtype=torch.bfloat16, generator=g)
        rows_in = torch.randn(n, 576, device="cuda", dtype=torch.bfloat16, generator=g)
        cases = (
            ("index_key_norm_write (fp8)", n * (DIM * 2 + ROW_BYTES + 8),
             lambda: tcw.index_key_norm_write(index, k_pre, w, b, slots, 1e-6),
             lambda: torch.ops.k31c.index_key_norm_write(index, k_pre, w, b, slots, 1e-6)),
            ("mla_cache_write (bf16)", n * (576 * 2 * 2 + 8),
             lambda: tcw.mla_cache_write(latent, rows_in, slots),
             lambda: torch.ops.k31c.mla_cache_write(latent, rows_in, slots)),
            ("index_key_norm_write (mxfp8)", n * (DIM * 2 + ROW_BYTES + 8),
             lambda: tcw.index_key_norm_write(index_mx, k_pre, w, b, slots, 1e-6),
             lambda: torch.ops.k31c.index_key_norm_write(index_mx, k_pre, w, b, slots, 1e-6)),
            ("mla_cache_write (fp8_ds_mla)", n * (576 * 2 + 656 + 8),
             lambda: tcw.mla_cache_write(latent8, rows_in, slots),
             lambda: torch.ops.k31c.mla_cache_write(latent8, rows_in, slots)),
        )
        for name, nbytes, kernel, eager in cases:
            ms = time_ms(kernel)
            peers = {}
            t = try_ms(eager, warmup=2, reps=10)
            if t is not None:
                peers["eager ref"] = t
            rows.append(Row(name, f"{n} tokens", ms, bytes_floor_ms(nbytes, machine), "bytes", peers,
                            "launch-bound" if n == N else ""))
    return rows


def run(machine: Machine, contexts=CONTEXTS) -> list[Row]:
    from k31c.graph import ops  # noqa: F401  (torch.ops.k31c.*)

    pool = Pool(max(contexts))
    rows = _scan_rows(machine, pool, contexts)
    del pool
    torch.cuda.empty_cache()
    return rows + mxfp8_rows(machine) + _write_rows(machine)


def sweep(contexts=(128 << 10, 1 << 20)) -> None:
    """Kernel-only (CUDA-graph) times of launch configurations of the default kernel: head sum x
    stages x splits."""
    from k31c.lowering.triton import indexer as tix
    from k31c.lowering.triton import indexer_tma
    from k31c.lowering.triton.device import sm_count

    pool = Pool(max(contexts))
    sms = sm_count(torch.device("cuda"))     # what the launchers size their grids for
    configs = [dict(head_dot=hd, splits=sp, num_stages=st) for hd in (False, True) for st in (4, 5)
               for sp in (4 * sms // 16 + 1, 8 * sms // 16 + 1)]
    for ctx in contexts:
        table, row_len = pool.context(ctx)
        args = (pool.q, pool.weights, pool.cache, table, pool.row_req, row_len)
        for cfg in configs:
            try:
                t = graph_ms(lambda: tix.launch_indexer(*args, **cfg))
                print(f"L={ctx >> 10}K {cfg}: {t * 1e3:.1f} us (graph replay)")
            except Exception as e:  # noqa: BLE001
                print(f"L={ctx >> 10}K {cfg}: failed {type(e).__name__}: {str(e)[:120]}")
    for kern in (tix._indexer_kernel, indexer_tma._indexer_tma_kernel):
        for cache in kern.device_caches.values():   # Triton 3.6/3.7 cache layout
            for k in cache[0].values():
                print(f"# {kern.__name__} n_regs={k.n_regs} n_spills={k.n_spills} "
                      f"shared={k.metadata.shared}")


if __name__ == "__main__":
    if "--sweep" in sys.argv:
        sweep()
    else:
        m = measure_machine()
        print(markdown(run(m), m))
