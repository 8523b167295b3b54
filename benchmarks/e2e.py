"""`k31c bench e2e`: one decode step of the bench config, end to end, on the GPU.

Rows: context 2.3K and 32K tokens per request, B = 1 and 16 requests. Columns, all measured in
this run: the eager reference, `torch.compile(mode="reduce-overhead")` of the reference, the k31c
program without device graphs, k31c graph replay (3 streams) and k31c graph replay on one stream;
the bytes floor (every weight read once + each request's caches read once, at the copy rate
measured now), and the GPU busy share of the replayed step (kernel time / step time, from the
profiler). The caches are filled with random latent rows, index keys and KDA states instead of a
prefill (the reference prefill cannot reach 32K); the step time is the wall time of
`Engine.decode` (host metadata + the step), averaged over consecutive steps.

    python benchmarks/e2e.py [--out FILE] [--steps N] [--skip-peer] [--quick]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import bytes_floor_ms, measure_machine  # noqa: E402

import k31c.api as k31c_api  # noqa: E402
from k31c.config import preset  # noqa: E402
from k31c.graph.model import K31ForCausalLM  # noqa: E402
from k31c.runtime.engine import Engine  # noqa: E402

CONTEXTS = (2304, 32768)
BATCHES = (1, 16)


def make_model():
    torch.manual_seed(0)
    m = K31ForCausalLM(preset("bench"))
    m.reset_parameters(torch.Generator().manual_seed(0))
    return m.eval().cuda()


def fill_random(eng: Engine, batch: int, ctx: int) -> list[int]:
    """`batch` requests whose caches hold `ctx` random tokens (latent rows, index keys, states)."""
    pool, gen = eng.pool, torch.Generator(device="cuda").manual_seed(1)
    for c in pool.mla:
        c.latent.normal_(0, 0.5, generator=gen)
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


def step_ms(eng: Engine, rids: list[int], steps: int) -> float:
    toks = [7] * len(rids)
    for _ in range(3):
        eng.decode(rids, toks)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        eng.decode(rids, toks)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def busy_share(eng: Engine, rids: list[int], ms: float) -> float:
    from torch.profiler import ProfilerActivity, profile
    toks = [7] * len(rids)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.decode(rids, toks)
        torch.cuda.synchronize()
    kernel_us = sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return kernel_us / 1e3 / ms


def floor_bytes(model, eng: Engine, batch: int, ctx: int) -> int:
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    pool = eng.pool
    per_token = sum(c.latent[0, 0].numel() * c.latent.element_size()
                    + (c.index.numel() // (c.index.shape[0] * pool.block_size)) * c.index.element_size()
                    for c in pool.mla)
    state = sum(s.recurrent[0].numel() * s.recurrent.element_size() + s.conv[0].numel() * s.conv.element_size()
                for s in pool.kda)
    return weights + batch * (ctx * per_token + 2 * state)      # states read and written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the table to this file")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip-peer", action="store_true", help="leave out the torch.compile peer")
    ap.add_argument("--quick", action="store_true",
                    help="context 2.3K only; eager, k31c without and with device graphs")
    args = ap.parse_args()
    contexts = CONTEXTS[:1] if args.quick else CONTEXTS
    if not torch.cuda.is_available():
        print("k31c: error: bench e2e needs a CUDA device", file=sys.stderr)
        return 2
    machine = measure_machine()
    model = make_model()
    max_len = max(contexts) + 64
    runners = {"eager": model}
    if not (args.skip_peer or args.quick):
        runners["torch.compile(reduce-overhead)"] = torch.compile(model, mode="reduce-overhead")
    runners["k31c no graphs"] = k31c_api.compile(model, target="h200", options={"device_graphs": False})
    runners["k31c graphs"] = k31c_api.compile(model, target="h200")
    if not args.quick:
        runners["k31c graphs, 1 stream"] = k31c_api.compile(model, target="h200", options={"streams": 1})
    # one engine (one cache pool) per runner: a compiled program serves the pool it was built for
    engines = {name: Engine(model, max_requests=max(BATCHES), max_seq_len=max_len, device="cuda", step_fn=fn)
               for name, fn in runners.items()}
    rows = []
    for ctx in contexts:
        for batch in BATCHES:
            times, busy, floor = {}, None, None
            for name, eng in engines.items():
                for rid in list(eng.pool.requests):
                    eng.free(rid)
                rids = fill_random(eng, batch, ctx)
                try:
                    times[name] = step_ms(eng, rids, args.steps)
                except Exception as e:      # noqa: BLE001  (a peer that fails is reported, not fatal)
                    times[name] = float("nan")
                    print(f"{name} at ctx {ctx}, B {batch}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                if name == "k31c graphs":
                    busy = busy_share(eng, rids, times[name])
                    floor = bytes_floor_ms(floor_bytes(model, eng, batch, ctx), machine)
            rows.append((ctx, batch, times, floor, busy))
            print(ctx, batch, {k: round(v, 3) for k, v in times.items()}, floor, busy, flush=True)
    names = list(runners)
    head = ["context", "B", *[f"{n} ms" for n in names], "floor ms", "graphs / floor", "eager / graphs",
            "peer / graphs", "busy"]
    lines = [f"Device: {machine.name}; measured copy {machine.copy_gbps:.0f} GB/s; bench config "
             f"(bf16, {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for ctx, batch, times, floor, busy in rows:
        g = times["k31c graphs"]
        peer = times.get("torch.compile(reduce-overhead)", float("nan"))
        lines.append("| " + " | ".join([str(ctx), str(batch), *[f"{times[n]:.3f}" for n in names], f"{floor:.3f}",
                                        f"{g / floor:.2f}", f"{times['eager'] / g:.1f}", f"{peer / g:.1f}",
                                        f"{busy:.0%}"]) + " |")
    for name in names:
        fn = runners[name]
        if hasattr(fn, "graph_stats"):
            lines.append(f"\n{name}: device graphs {fn.graph_stats()}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
