"""`k31c bench`: the device benchmarks of the repository's benchmarks/ folder."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import UsageError

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
SUITES = {"kernels": "every Triton kernel family",
          "e2e": "the bench config's decode step end to end"}


def add(sub) -> None:
    p = sub.add_parser("bench", help="run device benchmarks (needs a GPU)",
                       description="Benchmarks live in the repository's benchmarks/ folder; each "
                                   "prints measured times beside floors measured in the same run.")
    # optional for argparse, so that a missing suite gets our message (argparse's names `rest` too)
    p.add_argument("suite", nargs="?", choices=SUITES, help="; ".join(f"{k}: {v}" for k, v in SUITES.items()))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the suite (--only, --out)")
    p.set_defaults(run=run)


def run(args) -> int:
    if args.suite is None:
        raise UsageError("bench needs a suite: " + "; ".join(f"{k} ({v})" for k, v in SUITES.items()))
    script = BENCH_DIR / f"{args.suite}.py"
    if not script.is_file():
        raise UsageError(f"{script} not found: benchmarks run from a source checkout of k31c")
    import runpy
    sys.argv = [str(script), *args.rest]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        return int(e.code or 0)
    return 0
