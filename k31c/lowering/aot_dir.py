"""The output directory of an ahead-of-time kernel build (`k31c build-kernels --out DIR`): one
binary a kernel and manifest.json, written whole or not at all.

DIR must not exist, be empty, or hold an earlier build of the same target, which a build
replaces whole (through a temporary directory beside it and fsutil's directory replacement), so
it never holds a binary its manifest does not list and an interrupted build leaves the earlier
one as it was.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict
from pathlib import Path
from typing import Iterable, Optional

import triton

from .. import fsutil
from ..errors import UsageError
from .targets import get_target

BINARY = {"hip": "hsaco", "cuda": "cubin"}     # backend -> the binary a kernel is built to
MANIFEST = "manifest.json"


def check_out_dir(out_dir, target_name: str) -> Path:
    """The directory a build writes (a link followed). It must not exist, be empty, or hold an
    earlier build of the same target (manifest.json and binaries only), which the build replaces
    whole; anything else is refused, so that no file of the user's is lost."""
    if str(out_dir) == "":
        raise UsageError("--out is empty: give a directory")
    out = fsutil.output_target(Path(os.path.abspath(out_dir)))
    if not out.exists():
        problem = fsutil.parent_problem(out)
        if problem:
            raise UsageError(f"--out {out_dir}: {problem}")
        return out
    if not out.is_dir():
        raise UsageError(f"--out {out_dir} exists and is not a directory: give a new directory or "
                         "that of an earlier build")
    mounted = fsutil.mount_point_problem(out, "a build")
    if mounted:
        raise UsageError(f"--out {out_dir} {mounted}")
    entries = sorted(os.listdir(out))
    problem = entries and _not_a_build(out, entries, target_name)
    if problem:
        raise UsageError(f"--out {out_dir} is not empty and not an earlier {target_name} build "
                         f"({problem}): give a new or empty directory")
    return out


def _not_a_build(out: Path, entries: list[str], target_name: str) -> Optional[str]:
    """Why the non-empty directory `out` is not the output of a build for `target_name`, or None."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST}"
    except (OSError, ValueError) as e:
        return f"{MANIFEST} unreadable: {e}"
    found = manifest.get("target") if isinstance(manifest, dict) else None
    if found != target_name:
        return f"its {MANIFEST} is for target {found!r}"
    others = [e for e in entries if e != MANIFEST and not e.endswith(tuple("." + k for k in BINARY.values()))]
    if others:
        return f"it also holds {', '.join(others[:3])}{', ...' if len(others) > 3 else ''}"
    return None


def write_outputs(built: list, out_dir: Path, target_name: str,
                  families: Optional[Iterable[str]] = None) -> Path:
    """Each binary and manifest.json, written to a temporary directory beside `out_dir` that then
    takes its place whole: an interrupted build leaves the earlier one as it was, and no binary
    is left that the manifest does not list (a build of fewer families drops the others)."""
    out = check_out_dir(out_dir, target_name)   # again: it may have changed while compiling
    out.parent.mkdir(parents=True, exist_ok=True)
    fsutil.clean_stale(out.parent, out.name)    # what a killed build left beside it
    try:
        with fsutil.temporary_dir(out.parent, out.name) as tmp:
            entries = []
            for b in built:
                fname = _file_name(b)
                (tmp / fname).write_bytes(b.binary)
                entry = {k: v for k, v in asdict(b).items() if k != "binary"}
                entry["file"] = fname
                entries.append(entry)
            manifest = {"target": target_name, "arch": get_target(target_name).arch,
                        "triton": _triton_version(),
                        "families": "all" if families is None else sorted(families), "kernels": entries}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
            os.chmod(tmp, fsutil.dir_mode())    # mkdtemp's 0700 -> what the umask gives
            _publish(tmp, out)
    except OSError as e:
        raise fsutil.naming(e, Path(out_dir)) from None
    return Path(out_dir) / MANIFEST


def _publish(tmp: Path, out: Path) -> None:
    """Put the finished directory `tmp` in the place of `out` (fsutil keeps an earlier build aside
    until the new one is in)."""
    if out.exists() and out.resolve() == Path.cwd().resolve():   # (a mount point is refused)
        fsutil.replace_files(tmp, out, sorted(os.listdir(out)))    # cannot be renamed away
    elif out.is_dir() and any(out.iterdir()):
        fsutil.replace_dir(tmp, out)
    else:
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)


def _file_name(b) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", b.name.replace("/", ".")).strip("_") + "." + b.binary_kind


def _triton_version() -> str:
    return triton.__version__
