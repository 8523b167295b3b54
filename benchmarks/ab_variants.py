"""A/B of source variants: one benchmark command run on the tree and on edited copies of it, in
fresh processes, interleaved over rounds (base, variant 1, ..., base, variant 1, ...), so a
machine's drift falls on every variant alike.

A variant is a list of edits to files under k31c/ or benchmarks/, each an exact text and its
replacement, given in a JSON file:

    {"evict_first": [{"file": "k31c/lowering/triton/topk.py",
                      "old": "other=0.0)", "new": "other=0.0, eviction_policy=\"evict_first\")",
                      "count": 2}]}

`count` (default 1) is how many times `old` must occur in the file; another count is an error,
so an edit never lands somewhere unintended or nowhere. Each variant runs from its own copy of
k31c/ and benchmarks/ (the command's working directory; PYTHONPATH points there), the base from
the tree itself. Output: each run's stdout under a `== round R: VARIANT` line, also to --out.

    python benchmarks/ab_variants.py SPEC.json [--rounds 2] [--timeout 120] [--out FILE] -- CMD...
    e.g. -- python3 -c "from benchmarks.bench_topk import ring_times; print(ring_times())"
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("k31c", "benchmarks")


def load_spec(path: Path) -> dict[str, list[dict]]:
    """The variants of a spec file, checked: names, and each edit's file, old, new and count."""
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        sys.exit(f"ab_variants: cannot read {path}: {e}")
    if not isinstance(spec, dict) or not spec:
        sys.exit(f"ab_variants: {path}: expected an object of variant name -> list of edits")
    for name, edits in spec.items():
        if name == "base" or not isinstance(edits, list) or not edits:
            sys.exit(f"ab_variants: variant {name!r}: expected a non-empty list of edits (and not the name 'base')")
        for e in edits:
            if not isinstance(e, dict) or not {"file", "old", "new"} <= set(e) or set(e) - {"file", "old", "new", "count"}:
                sys.exit(f"ab_variants: variant {name!r}: an edit needs file, old, new (and count): {e!r}")
            if Path(e["file"]).parts[0] not in COPIED or ".." in Path(e["file"]).parts:
                sys.exit(f"ab_variants: variant {name!r}: {e['file']} is not under {' or '.join(COPIED)}/")
    return spec


def make_copy(name: str, edits: list[dict], into: Path) -> Path:
    """A copy of the tree's k31c/ and benchmarks/ with `edits` applied (`into`/`name`)."""
    root = into / name
    for d in COPIED:
        shutil.copytree(ROOT / d, root / d, ignore=shutil.ignore_patterns("__pycache__", "results"))
    for e in edits:
        f = root / e["file"]
        if not f.is_file():
            sys.exit(f"ab_variants: variant {name!r}: no file {e['file']}")
        text = f.read_text()
        found, want = text.count(e["old"]), e.get("count", 1)
        if found != want:
            sys.exit(f"ab_variants: variant {name!r}: {e['file']} holds {e['old']!r} {found} times, "
                     f"the edit expects {want}")
        f.write_text(text.replace(e["old"], e["new"]))
    return root


def run(cmd: list[str], cwd: Path, timeout: float) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(cwd), os.environ.get("PYTHONPATH")]))}
    try:
        out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"(timed out after {timeout:.0f} s)"
    if out.returncode != 0:
        return f"(exit {out.returncode})\n{out.stderr[-2000:]}"
    return out.stdout.rstrip()


def main() -> None:
    argv = sys.argv[1:]
    if "--" not in argv:
        sys.exit("ab_variants: give the benchmark command after --")
    cut = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec", type=Path)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a run may take")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv[:cut])
    cmd = argv[cut + 1:]
    if not cmd or args.rounds < 1:
        sys.exit("ab_variants: expected a command after -- and --rounds >= 1")
    spec = load_spec(args.spec)
    lines = []
    with tempfile.TemporaryDirectory(prefix="k31c-ab-") as tmp:
        roots = {"base": ROOT, **{n: make_copy(n, e, Path(tmp)) for n, e in spec.items()}}
        for r in range(1, args.rounds + 1):
            for name, root in roots.items():
                print(f"... round {r}: {name}", file=sys.stderr, flush=True)
                lines += [f"== round {r}: {name}", run(cmd, root, args.timeout)]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
