"""What `k31c.compile` reports (`compiled.report`): per step kind, the capture, each pass's
result, the program built, the kernels it calls and what the compile cache did."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .passes.manager import PassRecord


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
