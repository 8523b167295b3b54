"""Does programmatic dependent launch take effect in a replayed decode graph? Profiles one replayed
step of the bench config (context 2304, B = 1) with and without options={"pdl": True} and prints,
from the device timeline: kernels, their summed time, the step's span, the union of busy time, how
many kernels start before the one before them ends (PDL's sign), and the median start-to-start and
end-to-start gaps."""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from e2e import fill_random, step_ms  # noqa: E402
from harness import bench_model  # noqa: E402

import k31c.api as k31c_api  # noqa: E402
from k31c.runtime.engine import Engine  # noqa: E402


def timeline(eng: Engine, rids: list[int]) -> list[tuple[float, float, str]]:
    toks = [7] * len(rids)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.decode(rids, toks)
        torch.cuda.synchronize()
    ev = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
          if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(ev)


def main() -> None:
    model = bench_model()
    for name, opts in (("graphs", {}), ("graphs, PDL", {"pdl": True})):
        eng = Engine(model, max_requests=16, max_seq_len=2400, device="cuda",
                     step_fn=k31c_api.compile(model, target="h200", options=opts))
        rids = fill_random(eng, 1, 2304)
        ms, _ = step_ms(eng, rids, 20)
        ev = timeline(eng, rids)
        span = ev[-1][1] - min(e[0] for e in ev)
        busy, cur_s, cur_e = 0.0, ev[0][0], ev[0][1]
        for s, e, _ in ev[1:]:
            if s > cur_e:
                busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        busy += cur_e - cur_s
        early = sum(1 for a, b in zip(ev, ev[1:]) if b[0] < a[1])
        gaps = [b[0] - a[1] for a, b in zip(ev, ev[1:])]
        starts = [b[0] - a[0] for a, b in zip(ev, ev[1:])]
        print(f"{name}: step {ms:.3f} ms; {len(ev)} kernels, sum {sum(e[1] - e[0] for e in ev) / 1e3:.3f} ms, "
              f"span {span / 1e3:.3f} ms, union busy {busy / 1e3:.3f} ms; {early} start before the previous "
              f"ends; median end->start gap {statistics.median(gaps):.2f} us, start->start "
              f"{statistics.median(starts):.2f} us", flush=True)
        for s, e, n in ev[:12]:
            print(f"   {s - ev[0][0]:9.2f} {e - ev[0][0]:9.2f}  {n[:70]}")


if __name__ == "__main__":
    main()
