"""Forms of staging a decode step's ints from pinned host memory into a CUDA graph's buffers, timed
on a graph of 30 small kernels (the reason runtime/staging.py stages the way it does):
A: a Triton kernel reading the pinned buffer zero-copy as the graph's first node
B: a memcpy node (dev.copy_(host, non_blocking=True)) captured in the graph
C: a host-to-device copy before the replay
N: no staging (the graph alone)
A and B record an external event after staging, and the host waits on it before rewriting the
buffer (both are checked to stage the values of their own step). Prints us a step (CUDA events
over 200 replays) at 300, 2,600 and 33,000 words.

    python3 benchmarks/stage_forms.py        (needs a CUDA device)
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from k31c.runtime.graphs import capture_guard

FORMS = "ABCN"


@triton.jit
def copy_words(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


def capture(form: str, host, dev, body):
    """(graph, event) of the body with form's staging in front (none for C and N)."""
    grid = (triton.cdiv(dev.numel(), 1024),)
    ev = torch.cuda.Event(external=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):                         # compile and warm up outside the capture
        body()
        copy_words[grid](host, dev, dev.numel(), BLOCK=1024)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with capture_guard(), torch.cuda.graph(g, stream=s):
        if form == "A":
            copy_words[grid](host, dev, dev.numel(), BLOCK=1024)
            ev.record()
        elif form == "B":
            dev.copy_(host, non_blocking=True)
            ev.record()
        body()
    return g, ev


def check(g, ev, host, dev) -> None:
    """Each replay stages the values the host wrote for it."""
    for _ in range(5):
        ev.synchronize()
        host.copy_(torch.randint(0, 1 << 30, host.shape, dtype=torch.int32))
        want = host.clone()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu(), want), "staged the wrong values"


def time_form(form: str, g, ev, host, dev, n: int = 200) -> float:
    """us a step over n replays, each after the host wrote the step's values (the form's way)."""
    values = torch.randint(0, 1 << 30, host.shape, dtype=torch.int32)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(n + 1):
        if i == 1:
            e0.record()
        if form in "AB":
            ev.synchronize()
            host.copy_(values)
        elif form == "C":
            dev.copy_(values.pin_memory(), non_blocking=True)
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n * 1e3


def main() -> int:
    if not torch.cuda.is_available():
        print("stage_forms: needs a CUDA device", file=sys.stderr)
        return 1
    print(torch.__version__, triton.__version__)
    x = torch.randn(4096, device="cuda")

    def body():
        y = x
        for _ in range(30):
            y = y * 1.0001 + 0.5
        return y

    for words in (300, 2600, 33000):
        host = torch.randint(0, 1 << 30, (words,), dtype=torch.int32).pin_memory()
        dev = torch.empty(words, dtype=torch.int32, device="cuda")
        graphs = {form: capture(form, host, dev, body) for form in FORMS}
        for form in "AB":
            check(*graphs[form], host, dev)
        res = {form: time_form(form, *graphs[form], host, dev) for form in FORMS * 2}   # the second pass kept
        print(f"words {words}: us a step " + " ".join(f"{k}={v:.2f}" for k, v in res.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
