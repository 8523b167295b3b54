"""The device timeline of consecutive calls, from the profiler's trace: every kernel, memcpy and
memset with its stream, and the idle time between them (e2e.py's busy share, step_timeline.py)."""
from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def device_nodes(fn, calls: int) -> list[dict]:
    """The device events (kernels, memcpys, memsets) of `calls` consecutive calls of `fn`, issued
    without synchronising between them, by start time (us), each with its stream."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        trace = json.loads(Path(path).read_text())
    finally:
        os.unlink(path)
    nodes = [dict(ts=float(e["ts"]), dur=float(e.get("dur", 0)), name=e["name"],
                  stream=e.get("args", {}).get("stream", "?"), cat=e.get("cat", ""))
             for e in trace.get("traceEvents", []) if e.get("cat") in DEVICE_CATS]
    return sorted(nodes, key=lambda n: n["ts"])


def idle_gaps(nodes: list[dict]) -> tuple[float, float, list[float]]:
    """(span us, union busy us, the idle gap before each node: 0 where it starts inside busy time)."""
    start = nodes[0]["ts"]
    cur_end, busy, cur_start, before = start + nodes[0]["dur"], 0.0, start, [0.0]
    for n in nodes[1:]:
        gap = n["ts"] - cur_end
        before.append(max(gap, 0.0))
        if gap > 0:
            busy += cur_end - cur_start
            cur_start = n["ts"]
        cur_end = max(cur_end, n["ts"] + n["dur"])
    busy += cur_end - cur_start
    return cur_end - start, busy, before


def steady_steps(nodes: list[dict], last: str = "Memcpy DtoD") -> tuple[list[dict], int]:
    """(the nodes of the whole steps after the first, how many): the window from the node after the
    first step's last node to the last step's last node. A decode step ends with the copy of its
    logits out of the graph's buffer (`last`, a device-to-device memcpy). The first step is left
    out: the profiler's start takes longer than the steps queued before it, so the device waits
    for the host there, which a serving loop's device does not."""
    ends = [i for i, n in enumerate(nodes) if n["name"].startswith(last)]
    if len(ends) < 2:
        raise ValueError(f"steady_steps: fewer than two steps end with a '{last}' node")
    return nodes[ends[0] + 1:ends[-1] + 1], len(ends) - 1


def steady_profile(fn, calls: int) -> tuple[list[dict], int]:
    """`steady_steps` of `calls` consecutive calls of `fn`, after one untimed profile of as many
    (the profiler's own first-use costs)."""
    device_nodes(fn, calls)
    return steady_steps(device_nodes(fn, calls))


def per_step(nodes: list[dict], steps: int) -> list[tuple[str, float, float]]:
    """[(node name, us a step, count a step)] of `steps` steps' nodes, the most time first."""
    acc: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for n in nodes:
        acc[n["name"]][0] += n["dur"]
        acc[n["name"]][1] += 1
    return sorted(((name, us / steps, c / steps) for name, (us, c) in acc.items()), key=lambda r: -r[1])
