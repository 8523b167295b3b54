"""`k31c bench e2e`: one decode step of the bench config, end to end, on the GPU.

Rows: context 2.3K and 32K tokens per request, B = 1 and 16 requests. Columns, all measured in
this run: the eager reference, `torch.compile(mode="reduce-overhead")` of the reference, the k31c
program without device graphs, k31c graph replay (3 streams), k31c graph replay on one stream and
k31c graph replay with programmatic dependent launch (`options={"pdl": True}`) on 3 streams and
on one, and k31c graph replay over FP8 latent rows (`options={"quantize": {"latent_cache":
"fp8"}}`: the pool's latent cache in the 656-byte layout, half the bf16 one); the bytes floor
(`floor_bytes`: the weights a step reads once, each request's caches once, at the copy rate
measured now), the GPU busy share of the replayed step (from the profiler's trace of 5
consecutive steps, the first left out: the union of the device's busy time, overlapping streams
counted once, over the device span; the idle between steps and the graph launches counts; "idle
us" is the rest, a step; "kernels / step": the same union of busy time a step over the step time
measured without the profiler, the issue's "kernel time / step time", which leaves out the
profiler's own gaps), the host time of one `Engine.decode` call (the wait for
the previous step's staging event included: the host runs one step ahead), and the replayed step's
time when every step's logits are read back before the next (a sampling loop without overlap).
The caches are filled with random latent rows, index keys and KDA states instead of a prefill
(the reference prefill cannot reach 32K); the step time is taken by CUDA events over `--steps`
consecutive `Engine.decode` calls (host metadata + the step) after a warm one, so the loop's
start is not in it (`step_ms`). Below the table, the largest kernels of each replayed step.

    python benchmarks/e2e.py [--out FILE] [--steps N] [--skip-peer] [--quick] [--host-profile]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import bench_model, bytes_floor_ms, emit, measure_machine  # noqa: E402
from timeline import idle_gaps, per_step, steady_profile  # noqa: E402

import k31c.api as k31c_api  # noqa: E402
from k31c.graph.ops.fp8_layouts import quantize_latent_fp8  # noqa: E402
from k31c.runtime.engine import Engine  # noqa: E402

CONTEXTS = (2304, 32768)
BATCHES = (1, 16)



def random_latent(latent: torch.Tensor, cfg, gen: torch.Generator, chunk: int = 1 << 16) -> None:
    """Fill a latent cache with random rows (std 0.5): in its dtype, or (uint8) as FP8 latent
    rows quantised from random fp32 rows, `chunk` rows at a time."""
    if latent.dtype != torch.uint8:
        latent.normal_(0, 0.5, generator=gen)
        return
    flat = latent.view(-1, latent.shape[-1])
    for r0 in range(0, flat.shape[0], chunk):
        rows = torch.randn(min(chunk, flat.shape[0] - r0), cfg.latent_dim, generator=gen,
                           device=latent.device) * 0.5
        flat[r0:r0 + rows.shape[0]] = quantize_latent_fp8(rows, cfg.kv_lora_rank)


def fill_random(eng: Engine, batch: int, ctx: int) -> list[int]:
    """`batch` requests whose caches hold `ctx` random tokens (latent rows, index keys, states)."""
    pool, gen = eng.pool, torch.Generator(device="cuda").manual_seed(1)
    for c in pool.mla:
        random_latent(c.latent, eng.cfg, gen)
        if c.index.is_floating_point():
            c.index.normal_(0, 1.0, generator=gen)
    for s in pool.kda:
        s.conv.normal_(0, 0.5, generator=gen)
        s.recurrent.normal_(0, 0.05, generator=gen)
    rids = []
    for _ in range(batch):
        rid = eng.add_request()
        pool.reserve(rid, ctx)
        pool.requests[rid].length = ctx
        rids.append(rid)
    return rids


def step_ms(eng: Engine, rids: list[int], steps: int, read_back: bool = False) -> tuple[float, float]:
    """(ms per step, host ms per `Engine.decode` call) over `steps` consecutive decode steps.
    The step time is taken on the device, from the end of one warm step to the end of the last
    (CUDA events in the stream): a loop's start (the first call's host time, before the device
    has work) is not a per-step cost; where the host is slower than the device (eager), the
    device waits and the events measure the host. The host time is the call's own time: where it
    is below the step time, the host prepares the next step while the device runs this one."""
    toks = [7] * len(rids)
    for _ in range(3):
        eng.decode(rids, toks)
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    eng.decode(rids, toks)
    begin.record()
    host = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = eng.decode(rids, toks)
        host += time.perf_counter() - t0
        if read_back:
            logits[-1, :8].cpu()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / steps, host / steps * 1e3


def step_profile(eng: Engine, rids: list[int], steps: int = 5) -> tuple[float, float, list]:
    """(busy share, busy us a step, [(node, us, count)] a step) from the profiler's trace of
    `steps` consecutive decode steps, the first left out (`timeline.steady_profile`): busy is the
    union of busy device time over the device span (overlapping streams count once; the idle
    between steps and the graph launch counts as idle)."""
    toks = [7] * len(rids)
    window, k = steady_profile(lambda: eng.decode(rids, toks), steps)
    span, busy, _ = idle_gaps(window)
    return busy / span, busy / k, per_step(window, k)


def host_profile(eng: Engine, batch: int, ctx: int, steps: int = 50) -> list[str]:
    """The host functions taking the most time over `steps` read-back decode steps (cProfile)."""
    import cProfile
    import io
    import pstats
    for rid in list(eng.pool.requests):
        eng.free(rid)
    rids = fill_random(eng, batch, ctx)
    step_ms(eng, rids, 3, read_back=True)
    prof = cProfile.Profile()
    prof.enable()
    step_ms(eng, rids, steps, read_back=True)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    return [f"\nhost profile, k31c graphs, context {ctx}, B {batch}, {steps} read-back steps:", "```",
            *out.getvalue().strip().splitlines(), "```"]


def floor_bytes(model, eng: Engine, batch: int, ctx: int) -> int:
    """Bytes a decode step must move: every weight once, except that the embedding table gives
    one row per request and the routed experts count only the share that B x k picks can select
    (min(1, B k / E)); each request's latent rows and index keys once; KDA states read and written."""
    cfg = model.config
    share = min(1.0, batch * cfg.num_experts_per_token / cfg.num_experts)
    weights = 0.0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if name.endswith("embed_tokens.weight"):
            size = batch * p.shape[1] * p.element_size()
        elif ".experts." in name:
            size *= share
        weights += size
    pool = eng.pool
    per_token = sum(c.latent[0, 0].numel() * c.latent.element_size()
                    + (c.index.numel() // (c.index.shape[0] * pool.block_size)) * c.index.element_size()
                    for c in pool.mla)
    state = sum(s.recurrent[0].numel() * s.recurrent.element_size() + s.conv[0].numel() * s.conv.element_size()
                for s in pool.kda)
    return int(weights + batch * (ctx * per_token + 2 * state))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the table to this file")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip-peer", action="store_true", help="leave out the torch.compile peer")
    ap.add_argument("--host-profile", action="store_true",
                    help="also print where the host time of a read-back replayed step goes (cProfile)")
    ap.add_argument("--quick", action="store_true",
                    help="context 2.3K only; eager, k31c without and with device graphs")
    args = ap.parse_args()
    contexts = CONTEXTS[:1] if args.quick else CONTEXTS
    if not torch.cuda.is_available():
        print("k31c: error: bench e2e needs a CUDA device", file=sys.stderr)
        return 2
    machine = measure_machine()
    model = bench_model()
    max_len = max(contexts) + 64
    runners = {"eager": model}
    if not (args.skip_peer or args.quick):
        runners["torch.compile(reduce-overhead)"] = torch.compile(model, mode="reduce-overhead")
    runners["k31c no graphs"] = k31c_api.compile(model, target="h200", options={"device_graphs": False})
    runners["k31c graphs"] = k31c_api.compile(model, target="h200")
    if not args.quick:
        runners["k31c graphs, 1 stream"] = k31c_api.compile(model, target="h200", options={"streams": 1})
        runners["k31c graphs, PDL"] = k31c_api.compile(model, target="h200", options={"pdl": True})
        runners["k31c graphs, PDL, 1 stream"] = k31c_api.compile(model, target="h200",
                                                                 options={"pdl": True, "streams": 1})
        # FP8 latent rows (about half the latent cache's bytes): the engine below allocates
        # its pool in the format this program was compiled for
        runners["k31c graphs, FP8 latent rows"] = k31c_api.compile(
            model, target="h200", options={"quantize": {"latent_cache": "fp8"}})
    # one engine (one cache pool) per runner: a compiled program serves the pool it was built for
    engines = {name: Engine(model, max_requests=max(BATCHES), max_seq_len=max_len, device="cuda", step_fn=fn)
               for name, fn in runners.items()}
    rows, kernels = [], []
    for ctx in contexts:
        for batch in BATCHES:
            times, busy, floor, host, idle_us, kernels_share = {}, *[float("nan")] * 5
            for name, eng in engines.items():
                for rid in list(eng.pool.requests):
                    eng.free(rid)
                rids = fill_random(eng, batch, ctx)
                try:
                    times[name], host_ms = step_ms(eng, rids, args.steps)
                except Exception as e:      # noqa: BLE001  (a peer that fails is reported, not fatal)
                    times[name] = float("nan")
                    print(f"{name} at ctx {ctx}, B {batch}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                    continue
                if name == "k31c graphs":
                    host = host_ms
                    times["k31c graphs, read back"] = step_ms(eng, rids, args.steps, read_back=True)[0]
                    busy, busy_us, table = step_profile(eng, rids)
                    idle_us = (1 - busy) * times[name] * 1e3
                    kernels_share = busy_us / (times[name] * 1e3)
                    floor = bytes_floor_ms(floor_bytes(model, eng, batch, ctx), machine)
                    kernels.append((ctx, batch, table))
            rows.append((ctx, batch, times, floor, busy, idle_us, kernels_share, host))
            print(ctx, batch, {k: round(v, 3) for k, v in times.items()}, floor, busy, idle_us, kernels_share,
                  host, flush=True)
    if args.host_profile:
        lines_host = host_profile(engines["k31c graphs"], min(BATCHES), contexts[0])
    names = [*runners, "k31c graphs, read back"]
    head = ["context", "B", *[f"{n} ms" for n in names], "floor ms", "graphs / floor", "eager / graphs",
            "peer / graphs", "busy", "idle us", "kernels / step", "host ms"]
    lines = [f"Device: {machine.name}; measured copy {machine.copy_gbps:.0f} GB/s; bench config "
             f"(bf16, {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for ctx, batch, times, floor, busy, idle_us, kernels_share, host in rows:
        g = times.get("k31c graphs", float("nan"))
        peer = times.get("torch.compile(reduce-overhead)", float("nan"))
        cells = [f"{times.get(n, float('nan')):.3f}" for n in names]
        lines.append("| " + " | ".join([str(ctx), str(batch), *cells, f"{floor:.3f}", f"{g / floor:.2f}",
                                        f"{times['eager'] / g:.1f}", f"{peer / g:.1f}", f"{busy:.1%}",
                                        f"{idle_us:.0f}", f"{kernels_share:.1%}", f"{host:.3f}"]) + " |")
    for name in runners:
        fn = runners[name]
        if hasattr(fn, "graph_stats"):
            lines.append(f"\n{name}: device graphs {fn.graph_stats()}")
    for ctx, batch, table in kernels:
        count, kernel_ms = round(sum(r[2] for r in table)), sum(r[1] for r in table) / 1e3
        lines += [f"\nk31c graphs, context {ctx}, B {batch}: {count} device nodes, {kernel_ms:.3f} ms a "
                  "step; the largest:", "",
                  "| node | ms a step | count a step |", "|---|---|---|"]
        lines += [f"| {name[:90]} | {us / 1e3:.3f} | {n:g} |" for name, us, n in table[:12]]
    if args.host_profile:
        lines += lines_host
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
