"""`k31c build-kernels`: the Triton kernels of a GPU target compiled ahead of time (no GPU needed);
the build itself is k31c.lowering.aot's."""
from __future__ import annotations

import sys

from ..errors import UsageError
from ..host import usable_cpus
from .common import positive_int


def add(sub) -> None:
    """`k31c build-kernels --target mi350x [--out DIR] [--only FAMILIES] [--jobs N]`."""
    p = sub.add_parser("build-kernels", help="compile the Triton kernels of a GPU target ahead of "
                                              "time (no GPU needed)")
    p.add_argument("--target", required=True, help="h200 or mi350x")
    p.add_argument("--out", default=None, help="directory for the binaries and manifest.json")
    p.add_argument("--only", default=None, metavar="FAMILIES",
                   help="comma-separated kernel families (cache_write, indexer, topk, mla, ...)")
    p.add_argument("--jobs", type=positive_int, default=None, metavar="N",
                   help="kernels compiled at once, each in a process of its own (default: the CPUs "
                        "this process may use)")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..lowering.aot import AotBuildError, build_kernels
    from ..lowering.targets import get_target
    try:
        get_target(args.target)
        families = None
        if args.only is not None:
            families = [f.strip() for f in args.only.split(",") if f.strip()]
            if not families:    # not "every family": that is leaving --only out
                raise UsageError(f"--only {args.only!r} names no kernel family: give comma-separated "
                                 "families, or leave --only out to build them all")
        built = build_kernels(args.target, args.out, progress=lambda s: print(s, flush=True),
                              families=families, jobs=args.jobs or usable_cpus())
    except ValueError as e:
        print(f"k31c: error: {e}", file=sys.stderr)
        return 2
    except AotBuildError as e:
        print(f"k31c: error: {e}", file=sys.stderr)
        return 1
    total = sum(b.size for b in built)
    where = f", written to {args.out}" if args.out else ""
    print(f"{len(built)} kernels for {args.target}, {total} bytes{where}", flush=True)
    return 0
