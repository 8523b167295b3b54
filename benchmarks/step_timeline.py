"""Where the idle time of a replayed decode step goes: the device timeline of consecutive steps.

For the bench config at (context, B) points, profiles `--steps` consecutive `Engine.decode` calls
(no synchronisation between them, as a serving loop issues them) of the k31c graph-replay program
and prints, from the profiler's trace (every kernel, memcpy and memset with its stream):
- per step: the span, the union of busy device time (overlapping streams counted once), the
  kernel sum and the idle time (the gaps between graphs included), over the steps after the
  first (`timeline.steady_steps`);
- the idle before each node summed by (previous node, node), largest first; the nodes by name;
- with --out FILE, every node (offset, duration, idle before, stream, name) in FILE's .raw.txt.
The busy column of `k31c bench e2e` is kernel time over wall time; this says which gaps make up
the rest.

    PYTHONPATH=. python benchmarks/step_timeline.py [--points 2304x1,32768x16] [--steps 5] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from e2e import fill_random, step_ms  # noqa: E402
from harness import bench_model, emit  # noqa: E402
from timeline import idle_gaps, per_step, steady_profile  # noqa: E402

import k31c.api as k31c_api  # noqa: E402
from k31c.runtime.engine import Engine  # noqa: E402


def report(label: str, nodes: list[dict], steps: int, wall_ms: float) -> tuple[list[str], list[str]]:
    """(summary lines, every node's line) of `steps` steady steps' device timeline
    (`timeline.steady_profile`)."""
    span, busy, before = idle_gaps(nodes)
    ksum = sum(n["dur"] for n in nodes)
    lines = [f"\n### {label}: {wall_ms:.3f} ms a step (e2e.step_ms, 20 steps)", "",
             f"{len(nodes)} device nodes over {steps} steps ({len(nodes) / steps:.1f} a step); per step: "
             f"span {span / steps:.1f} us, union busy {busy / steps:.1f} us ({busy / span:.1%} of the span), "
             f"kernel sum {ksum / steps:.1f} us, idle {(span - busy) / steps:.1f} us", ""]
    by_pair: Counter = Counter()
    for a, b, gap in zip(nodes, nodes[1:], before[1:]):
        by_pair[(a["name"][:50], b["name"][:50])] += gap
    lines += ["The idle before a node, summed by (previous node, node) over the steps (largest 25):", "",
              "| previous | node | idle us a step |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {g / steps:.2f} |" for (a, b), g in by_pair.most_common(25)]
    lines += ["", "| node | count a step | us a step |", "|---|---|---|"]
    lines += [f"| {name[:90]} | {c:g} | {us:.1f} |" for name, us, c in per_step(nodes, steps)]
    t0 = nodes[0]["ts"]
    raw = [f"# {label}: offset us, duration us, idle before us, stream, name"]
    raw += [f"{n['ts'] - t0:9.1f} {n['dur']:7.1f} {gap:6.1f} s{n['stream']!s:<3} {n['name'][:100]}"
            for n, gap in zip(nodes, before)]
    return lines, raw


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="2304x1,32768x16", help="context x batch, comma separated")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out")
    ap.add_argument("--options", default="{}", help="compile options as JSON (e.g. '{\"pdl\": true}')")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("step_timeline: needs a CUDA device", file=sys.stderr)
        return 2
    try:
        points = [tuple(int(v) for v in p.split("x")) for p in args.points.split(",")]
        options = json.loads(args.options)
    except ValueError as e:
        print(f"step_timeline: bad --points or --options: {e}", file=sys.stderr)
        return 2
    if args.steps < 3:
        print("step_timeline: --steps must be at least 3", file=sys.stderr)
        return 2
    model = bench_model()
    compiled = k31c_api.compile(model, target="h200", options=options)
    eng = Engine(model, max_requests=max(b for _, b in points), max_seq_len=max(c for c, _ in points) + 64,
                 device="cuda", step_fn=compiled)
    lines, raw = [f"k31c graph replay, bench config, options {options}"], []
    for ctx, batch in points:
        for rid in list(eng.pool.requests):
            eng.free(rid)
        rids = fill_random(eng, batch, ctx)
        wall, _ = step_ms(eng, rids, 20)
        toks = [7] * batch
        window, steps = steady_profile(lambda: eng.decode(rids, toks), args.steps)
        summary, nodes = report(f"context {ctx}, B {batch}", window, steps, wall)
        lines += summary
        raw += nodes
    emit(lines, args.out)
    if args.out:
        Path(args.out).with_suffix(".raw.txt").write_text("\n".join(raw) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
