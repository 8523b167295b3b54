"""The program: what a compiled step executes, as plain steps over numbered value slots, no FX.

A program holds its compiled dense pieces and a list of steps:
- `Dense(piece, stream, args, outs)`: run compiled piece `piece` on the slots `args`, store its
  outputs in `outs`;
- `Kernel(op, kernel, fn, stream, args, outs)`: call a k31c op's bound kernel (`fn`, with the op's
  signature); `args` mixes slot references (`Ref`), lists of them (`Refs`, a Tensor[] argument)
  and constants; `kernel` names what is bound,
  `"reference"` when no kernel exists for the target and the op's reference implementation runs;
- `Record(event, stream)` / `Wait(event, stream)`: the stream markers' fork/join events.
A Dense step is `weights_only` when it reads weights alone (e.g. the KDA conv weights
concatenated): its outputs change only when a weight does, and the executor keeps them.
Slots 0..n_inputs-1 are the program's inputs (weights, then the flattened step inputs); `free`
on a step lists slots whose last use it was (their tensors are dropped after the step). A value
read on another stream than the one that made it is never freed early: the caching allocator
could hand its memory to new work on the producing stream while the reader still runs.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union


@dataclass(frozen=True)
class Ref:
    slot: int


@dataclass(frozen=True)
class Refs:
    """A Tensor[] argument: the slots of its tensors, in order."""
    slots: tuple[int, ...]


def arg_slots(arg) -> tuple[int, ...]:
    """The slots a kernel argument reads (none for a constant)."""
    return (arg.slot,) if isinstance(arg, Ref) else arg.slots if isinstance(arg, Refs) else ()


@dataclass
class Dense:
    piece: int
    stream: int
    args: tuple[int, ...]
    outs: tuple[int, ...]
    free: tuple[int, ...] = ()
    weights_only: bool = False


@dataclass
class Kernel:
    op: str                      # "k31c::sparse_mla"
    kernel: str                  # "triton:k31c.lowering.triton.mla_two_pass.sparse_mla" or "reference"
    fn: Callable
    stream: int
    args: tuple[Any, ...]        # Ref(slot), Refs(slots) or a constant, positional as in the op's schema
    outs: tuple[Optional[int], ...]   # one slot per output (None: output unused)
    free: tuple[int, ...] = ()

    @property
    def reference(self) -> bool:
        return self.kernel == "reference"


@dataclass
class Record:
    event: int
    stream: int
    free: tuple[int, ...] = ()


@dataclass
class Wait:
    event: int
    stream: int
    free: tuple[int, ...] = ()


Step = Union[Dense, Kernel, Record, Wait]


@dataclass
class Program:
    name: str                          # the step kind: "decode", "prefill", "verify4"
    target: str
    steps: list[Step]
    pieces: list[Callable]             # compiled dense pieces (callable(*tensors) -> tuple)
    piece_names: list[str]             # what each compiled piece was built from (a key per piece)
    n_inputs: int
    n_slots: int
    outputs: tuple[int, ...]
    dense_codegen: str                 # "inductor" or "fx"
    stats: dict[str, Any] = field(default_factory=dict)   # build facts: pieces, compile seconds
    input_names: list[str] = field(default_factory=list)  # "@layers.0.q_proj.weight", "%meta.row_len"

    @property
    def streams(self) -> set[int]:
        return {s.stream for s in self.steps}

    @property
    def events(self) -> int:
        return 1 + max((s.event for s in self.steps if isinstance(s, (Record, Wait))), default=-1)

    def kernels(self) -> dict[tuple[str, str], int]:
        """(op, bound kernel) -> how many steps call it."""
        return dict(Counter((s.op, s.kernel) for s in self.steps if isinstance(s, Kernel)))

    def fallbacks(self) -> dict[str, int]:
        """op -> steps that run the op's reference implementation (no kernel for the target)."""
        return dict(Counter(s.op for s in self.steps if isinstance(s, Kernel) and s.reference))

    def describe(self) -> str:
        """One line per step: the program as the executor sees it (tests and `k31c inspect`)."""
        lines = [f"program {self.name} target={self.target}: {len(self.steps)} steps, "
                 f"{len(self.pieces)} compiled pieces ({self.dense_codegen}), streams {sorted(self.streams)}"]
        names = self.input_names

        def slot(i):
            return "_" if i is None else names[i] if i < len(names) else f"%{i}"
        for s in self.steps:
            if isinstance(s, Dense):
                kept = " (weights only: kept)" if s.weights_only else ""
                lines.append(f"  s{s.stream} dense piece{s.piece}({', '.join(map(slot, s.args))}) -> "
                             f"{', '.join(map(slot, s.outs))}{kept}")
            elif isinstance(s, Kernel):
                args = ", ".join(slot(a.slot) if isinstance(a, Ref)
                                 else "[" + ", ".join(map(slot, a.slots)) + "]" if isinstance(a, Refs)
                                 else repr(a) for a in s.args)
                lines.append(f"  s{s.stream} {s.op}[{s.kernel}]({args}) -> {', '.join(map(slot, s.outs))}")
            else:
                lines.append(f"  s{s.stream} {type(s).__name__.lower()} e{s.event}")
        return "\n".join(lines)

