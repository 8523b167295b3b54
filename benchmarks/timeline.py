"""The device timeline of consecutive calls, from the profiler's trace: every kernel, memcpy and
memset with its stream, and the idle time between them (e2e.py's busy share, step_timeline.py)."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def device_nodes(fn, calls: int, lead: int = 0) -> list[dict]:
    """The device events (kernels, memcpys, memsets) of `calls` consecutive calls of `fn`, issued
    without synchronising between them, by start time (us), each with its stream. `lead` calls
    are issued before the profiler starts, so the device already has work queued when the
    window opens (a steady state: the host's time for the first call is not device idle)."""
    torch.cuda.synchronize()
    for _ in range(lead):
        fn()
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
