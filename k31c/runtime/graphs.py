"""Device graphs: one captured CUDA/HIP graph per (batch bucket, rows) of a decode step kind.

A decode step with B requests runs as the graph of the smallest bucket >= B: the step's token ids
and metadata are staged into the bucket's static buffers by the graph's first node (staging.py),
the rows past B hold padding requests (graph/step.py's `padding_step`: they read and write
nothing), the graph is replayed, verification snapshots are copied out and the first B x rows
logits are returned (a copy: the next replay reuses the buffer). The cache pools are graph inputs
by address: a call with other cache tensors than the captured ones is an error. A batch larger
than every bucket runs uncaptured, counted.

Capture: the bucket's buffers are filled with padding, the staging kernel and the program run once
on the capture stream (so autotuning, lazy allocation and kernel compilation happen outside the
capture), then `torch.cuda.graph` records it with Python's garbage collector held off
(`capture_guard`); side streams fork from and join into the capturing
stream (the executor's events). All buckets and step kinds of a compiled model share one memory
pool. The same code captures HIP graphs under a ROCm build of torch; there the target asks for
one stream, and the staging buffer is copied to the device by a memcpy node before the staging
kernel (staging.py).
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass

import sympy
import torch

from ..errors import RuntimeFailure
from ..graph.step import padding_step
from .executor import Executor
from .staging import StagedInputs, StepInputs

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@contextlib.contextmanager
def capture_guard():
    """Python's cyclic garbage collector held off for a capture. A collection that frees an
    earlier CUDAGraph (held in a dead cycle) destroys it mid-capture, an operation a capturing
    stream forbids: the capture is invalidated ("operation failed due to a previous error during
    capture"). So dead cycles are collected before, and none during."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def check_buckets(buckets) -> tuple[int, ...]:
    if isinstance(buckets, (str, bytes)) or not hasattr(buckets, "__iter__"):
        raise ValueError(f"buckets must be a list of positive batch sizes, got {buckets!r}")
    out = tuple(sorted(set(buckets)))
    if not out or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in out):
        raise ValueError(f"buckets must be positive integers, got {list(buckets)!r}")
    return out


@dataclass
class _Graph:
    graph: object
    statics: StagedInputs
    out: torch.Tensor


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    uncaptured: int = 0                 # calls with a batch larger than every bucket
    table_copies: int = 0               # replays whose block table was copied whole (staging.py)


class DecodeGraphs:
    def __init__(self, executor: Executor, inputs: StepInputs, buckets, pool, max_blocks: int):
        self.executor = executor
        self.inputs = inputs
        self.buckets = check_buckets(buckets)
        self.pool = pool
        self.max_blocks = max_blocks
        self.graphs: dict[int, _Graph] = {}
        self.stats = GraphStats()
        self._persistent: tuple = ()        # data pointers of the non-per-step inputs at capture

    def bucket(self, batch: int):
        return next((b for b in self.buckets if b >= batch), None)

    def _shape(self, i: int, batch: int) -> tuple[int, ...]:
        subs = {self.inputs.batch_symbol: batch}
        return tuple(int(sympy.sympify(d).subs(subs)) for d in self.inputs.shapes[i])

    def _templates(self, batch: int, flat: list) -> list[torch.Tensor]:
        """Padding values of every per-step input at `batch` requests."""
        device = self.executor.device
        ids, meta = padding_step(batch, self.inputs.rows, self.max_blocks, device)
        padding = {"input_ids": ids, **{f"meta.{k}": getattr(meta, k) for k in meta.__dataclass_fields__}}
        out = []
        for i, (index, name) in enumerate(zip(self.inputs.per_step, self.inputs.names)):
            like = flat[index]
            shape = self._shape(i, batch)
            t = padding.get(name)
            if t is None:                   # snapshots: written by the step, never read
                t = torch.empty(shape, dtype=like.dtype, device=device)
            if tuple(t.shape) != shape or t.dtype != like.dtype:
                raise RuntimeFailure(f"device graphs: padding for {name} is {t.dtype} {tuple(t.shape)}, "
                                     f"the program takes {like.dtype} {shape}")
            out.append(t)
        return out

    def _persistent_ptrs(self, flat: list) -> tuple:
        """Addresses of the cache pools (the step inputs after the first per-step one that are not
        per-step); weights are the model's own tensors, fixed for the compiled model's life."""
        per_step = set(self.inputs.per_step)
        first = self.inputs.per_step[0]
        return tuple(flat[i].data_ptr() for i in range(first, len(flat)) if i not in per_step)

    def static_inputs(self, batch: int, flat: list) -> StagedInputs:
        return StagedInputs(self.inputs, self._templates(batch, flat), self.executor.device)

    def _capture(self, batch: int, flat: list) -> _Graph:
        statics = self.static_inputs(batch, flat)
        run = statics.bind(flat)
        capture_stream = torch.cuda.Stream(device=self.executor.device)
        capture_stream.wait_stream(torch.cuda.current_stream(self.executor.device))
        with torch.cuda.stream(capture_stream), self.executor.keeping_kernels():
            statics.stage()                     # warm-up on padding: compiles, tunes, writes nothing
            self.executor(run)
        torch.cuda.current_stream(self.executor.device).wait_stream(capture_stream)
        graph = torch.cuda.CUDAGraph()
        with capture_guard(), torch.cuda.graph(graph, pool=self.pool, stream=capture_stream):
            statics.stage()
            statics.staged.record()             # the host may rewrite the staging buffer after this
            out = self.executor(run)[0]
        self.stats.captures += 1
        return _Graph(graph, statics, out)

    def __call__(self, flat: list, batch: int) -> torch.Tensor:
        bucket = self.bucket(batch)
        if bucket is None:
            self.stats.uncaptured += 1
            return self.executor(flat)[0]
        ptrs = self._persistent_ptrs(flat)
        if not self._persistent:
            self._persistent = ptrs
        elif ptrs != self._persistent:
            raise RuntimeFailure("device graphs: the weights or cache pools are not the tensors the graphs "
                                 "were captured with (a new pool or model needs a new compile)")
        entry = self.graphs.get(bucket)
        if entry is None:
            entry = self.graphs[bucket] = self._capture(bucket, flat)
        self.stats.table_copies += entry.statics.fill(flat)
        self.executor.refresh_weight_pieces(flat)
        entry.graph.replay()
        self.stats.replays += 1
        entry.statics.copy_back(flat, batch)
        return entry.out[:batch * self.inputs.rows].clone()
