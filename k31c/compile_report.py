"""What `k31c.compile` reports (`compiled.report`): per step kind, the capture, each pass's
result, the program built, the kernels it calls and what the compile cache did; and the
helpers that fill it in."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .graph.ops import is_k31c
from .graph.ops.streams import is_marker
from .lowering.build import op_name
from .passes.manager import PassRecord, Pipeline


@dataclass
class StepReport:
    step: str
    capture_seconds: float
    passes: list[PassRecord]
    kernels: dict = field(default_factory=dict)      # (op, kernel) -> calls per step, from what runs
    fallbacks: dict = field(default_factory=dict)    # op -> reference calls per step on a GPU target
    build_seconds: float = 0.0                       # passes + code generation
    executor: str = ""
    program: str = ""                                # pieces, streams: what the program executor built
    cache: str = ""                                  # what the compile cache did (cached_program.py)

    def lines(self) -> list[str]:
        if self.cache.startswith("hit"):
            out = [f"step {self.step}: loaded from the compile cache in {self.build_seconds:.2f}s "
                   "(the passes' report is the build's)"]
        else:
            out = [f"step {self.step}: capture {self.capture_seconds:.1f}s, passes + {self.executor or 'no'} "
                   f"build {self.build_seconds:.1f}s"]
        for rec in self.passes:
            r = rec.result
            out.append(f"  {rec.name:24s} matches={r.matches:<5d} changed={str(r.changed):5s} "
                       f"{rec.seconds:6.2f}s  {'; '.join(r.notes)}")
        if self.program:
            out.append(f"  program: {self.program}")
        if self.cache:
            out.append(f"  compile cache: {self.cache}")
        if self.kernels:
            out.append("  kernels: " + ", ".join(f"{op.split('::')[-1]}={k.split('.')[-1] if k != 'reference' else k} x{n}"
                                                 for (op, k), n in sorted(self.kernels.items())))
        out.append("  reference fallbacks: " + (", ".join(f"{op} x{n}" for op, n in sorted(self.fallbacks.items()))
                                                 if self.fallbacks else "none"))
        return out


@dataclass
class CompileReport:
    target: str
    pipeline: tuple[str, ...]
    options: dict[str, Any]
    steps: dict[str, StepReport] = field(default_factory=dict)

    def fallbacks(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for s in self.steps.values():
            for op, n in s.fallbacks.items():
                total[op] = total.get(op, 0) + n
        return total

    def __str__(self) -> str:
        lines = [f"k31c compile: target={self.target} passes={','.join(self.pipeline)}"]
        for s in self.steps.values():
            lines += s.lines()
        return "\n".join(lines)


def changed_options(pipeline: Pipeline) -> dict:
    """Pass options that differ from their defaults (every pass has at least `enabled`)."""
    from .passes.manager import registered
    passes = registered()
    out = {}
    for name, opts in pipeline.options.items():
        changed = {k: v for k, v in opts.items() if passes[name].options.get(k) != v}
        if changed:
            out[name] = changed
    return out


def reference_counts(gm: torch.fx.GraphModule) -> dict[tuple[str, str], int]:
    """(op, "reference") per k31c op of a graph a whole-graph executor runs (no kernel bound)."""
    counts: dict[tuple[str, str], int] = {}
    for n in gm.graph.nodes:
        if is_k31c(n) and not is_marker(n.target):
            key = (op_name(n.target), "reference")
            counts[key] = counts.get(key, 0) + 1
    return counts


def describe_program(kp, executor, device_graphs: bool) -> str:
    """The report's program line: pieces, steps, streams, device graphs (`executor` None: the
    program is built for a target that does not run here)."""
    pieces = f"{kp.stats['pieces']} dense pieces ({kp.stats['compiled_pieces']} compiled, {kp.dense_codegen})"
    if executor is None:
        return f"{pieces}, {len(kp.steps)} steps, streams {sorted(kp.streams)}; built for {kp.target}, not run here"
    return (f"{pieces}, {len(kp.steps)} steps, streams {sorted(kp.streams) if executor.multi else [0]}, "
            f"device graphs {'on' if device_graphs else 'off'}")
