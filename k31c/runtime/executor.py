"""Run a Program (lowering/program.py): dense pieces, bound kernels, fork/join events.

Stream 0 is the stream current when the program is called (the capturing stream inside a device
graph capture); streams 1.. are long-lived side streams, shared by every program on the device and
created once. Each step runs wholly under its stream (Inductor launches a piece's kernels on the
stream current when the piece starts, Triton launchers on the current stream), events are created
once per program. With `streams=1` (AMD: dual-stream HIP-graph capture is unreliable there, and on
the CPU) every step runs on stream 0 and the events are dropped; per-stream order already is a
valid order of the whole program. A `weights_only` piece runs once and again only when a weight
it reads changes (its data pointer or version counter); its outputs stay at one address, so a
device graph captured after it keeps reading them (`refresh_weight_pieces` brings them up to date
before a replay). With `kernel_store` (a directory: the compile cache's, kernel_store.py) the
Triton kernels the program's launches compile are kept there.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch

from ..errors import RuntimeFailure
from ..lowering.program import Dense, Kernel, Program, Record, Ref, Refs, Wait
from ..lowering.targets import Target
from ..lowering.triton.device import using_target
from .jit_ahead import DRY_RUN
from .kernel_store import keeping

_SIDE_STREAMS: dict[tuple[str, int], list] = {}


def side_streams(device: torch.device, n: int) -> list:
    """`n` long-lived side streams of `device` (created on first use, then reused)."""
    key = (device.type, device.index if device.index is not None else torch.cuda.current_device())
    pool = _SIDE_STREAMS.setdefault(key, [])
    while len(pool) < n:
        pool.append(torch.cuda.Stream(device=key[1]))
    return pool[:n]


def _weights_key(tensors) -> Optional[tuple]:
    """What identifies the weights' current values (None: not trackable, e.g. inference tensors)."""
    try:
        return tuple((t.data_ptr(), t._version) for t in tensors)
    except RuntimeError:
        return None


class WeightsPiece:
    """A dense piece that reads weights alone: computed on the first call and when a weight it
    reads changed since, then written into the same output tensors (a captured graph reads them)."""

    def __init__(self, fn, args: tuple[int, ...]):
        self.fn = fn
        self.args = args                      # input slots of the weights it reads
        self.key: Optional[tuple] = None
        self.out: Optional[tuple] = None
        self.runs = 0

    def __call__(self, *weights):
        key = _weights_key(weights)
        if key is None or key != self.key:
            out = tuple(self.fn(*weights))
            self.runs += 1
            if self.out is None or key is None:
                self.out = out
            else:
                for kept, new in zip(self.out, out):
                    kept.copy_(new)
            self.key = key
        return self.out

    def refresh(self, weights) -> None:
        """Bring the kept outputs up to date; an untrackable piece was captured with the graph,
        which recomputes it itself."""
        key = _weights_key(weights)
        if key is not None and key != self.key:
            self(*weights)


class Executor:
    def __init__(self, program: Program, device: torch.device, target: Target,
                 streams: Optional[int] = None, kernel_store: Optional[str] = None):
        self.program = program
        self.kernel_store = kernel_store
        self.target = target          # the record the kernels' launchers take their facts from
        self.device = torch.device(device)
        used = program.streams
        gpu = self.device.type == "cuda"
        self.multi = gpu and len(used) > 1 and (streams is None or streams > 1)
        if self.multi:
            n_side = max(used)
            if streams is not None and n_side + 1 > streams:
                raise RuntimeFailure(f"program {program.name} uses {n_side + 1} streams; the target allows "
                                     f"{streams}")
            self._side = side_streams(self.device, n_side)
            self.events = [torch.cuda.Event() for _ in range(program.events)]
        self.weight_pieces: list[WeightsPiece] = []
        self.steps = self._plan()
        self.runs = 0
        self.reference_calls = 0
        self._reference_steps = sum(1 for s in program.steps if isinstance(s, Kernel) and s.reference)

    def _plan(self) -> list[tuple]:
        """Each step as a flat tuple the loop below unpacks quickly."""
        plan = []
        for s in self.program.steps:
            if isinstance(s, (Record, Wait)):
                if self.multi:
                    plan.append((2 if isinstance(s, Record) else 3, s.stream, s.event, s.free))
                continue
            stream = s.stream if self.multi else 0
            if isinstance(s, Dense):
                fn = self.program.pieces[s.piece]
                if s.weights_only:
                    fn = WeightsPiece(fn, s.args)
                    self.weight_pieces.append(fn)
                plan.append((0, stream, fn, s.args, s.outs, s.free))
            else:
                consts = list(s.args)
                refs = tuple((i, a.slot) for i, a in enumerate(s.args) if isinstance(a, Ref))
                lists = tuple((i, a.slots) for i, a in enumerate(s.args) if isinstance(a, Refs))
                plan.append((1, stream, s.fn, (consts, refs, lists), s.outs, s.free))
        return plan

    def keeping_kernels(self):
        """A context in which the Triton kernels compiled are kept in the program's kernel store
        (the executor's calls run in it; so does the device graphs' staging kernel)."""
        return keeping(self.kernel_store) if self.kernel_store is not None else nullcontext()

    def __call__(self, inputs: list) -> tuple:
        with using_target(self.target), self.keeping_kernels():
            return self._run(inputs)

    def refresh_weight_pieces(self, inputs: list) -> None:
        """Recompute, in place, the weights-only pieces whose weights changed (before a replay of
        a graph that reads their outputs; on the current stream)."""
        for piece in self.weight_pieces:
            piece.refresh([inputs[a] for a in piece.args])

    def _run(self, inputs: list) -> tuple:
        prog = self.program
        if len(inputs) != prog.n_inputs:
            raise RuntimeFailure(f"program {prog.name} takes {prog.n_inputs} inputs, got {len(inputs)}")
        env: list = list(inputs) + [None] * (prog.n_slots - prog.n_inputs)
        streams = None
        if self.multi:
            main = torch.cuda.current_stream(self.device)
            streams = [main] + self._side
        dry = DRY_RUN.get()         # prebuild's dry run: the kernels' launches were skipped
        for index, step in enumerate(self.steps):
            kind, stream = step[0], step[1]
            if kind >= 2:
                _, s, event, free = step
                if kind == 2:
                    self.events[event].record(streams[s])
                else:
                    streams[s].wait_event(self.events[event])
                continue
            _, _, fn, args, outs, free = step
            ctx = torch.cuda.stream(streams[stream]) if stream else nullcontext()
            with ctx:
                if kind == 0:
                    call = [env[a] for a in args]
                else:
                    consts, refs, lists = args
                    call = list(consts)
                    for i, slot in refs:
                        call[i] = env[slot]
                    for i, list_slots in lists:
                        call[i] = [env[slot] for slot in list_slots]
                try:
                    result = fn(*call)
                except Exception as e:          # say which step, and what it was given
                    e.add_note(_describe_call(prog.name, index, fn, call))
                    raise
                if dry and kind == 1:           # unwritten: zeros, never stray indices
                    _zero(result)
            if len(outs) == 1:     # a piece returns a tuple; a kernel a tensor, or a list (Tensor[])
                env[outs[0]] = result[0] if kind == 0 or isinstance(result, (list, tuple)) else result
            elif outs:
                for slot, value in zip(outs, result):
                    if slot is not None:
                        env[slot] = value
            for slot in free:
                env[slot] = None
        self.runs += 1
        self.reference_calls += self._reference_steps
        return tuple(env[s] for s in prog.outputs)


def _zero(result) -> None:
    """Zero every tensor of a kernel's result (a tensor, or tuples and Tensor[] lists of them)."""
    if isinstance(result, torch.Tensor):
        result.zero_()
    elif isinstance(result, (list, tuple)):
        for t in result:
            _zero(t)


def _describe_call(program: str, index: int, fn, call: list) -> str:
    def arg(a):
        if isinstance(a, torch.Tensor):
            return f"{a.dtype} {tuple(a.shape)} stride {a.stride()}"
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(arg(x) for x in a[:4]) + (", ..." if len(a) > 4 else "") + "]"
        return repr(a)
    name = getattr(fn, "__name__", type(fn).__name__)
    return f"k31c: in program {program}, step {index} ({name}), called with: " + "; ".join(map(arg, call))
