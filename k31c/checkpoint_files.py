"""The files of a checkpoint directory, and which directories `--force` / `overwrite=True` may
replace. Torch-free, so that the CLI checks its arguments before it imports anything heavy."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Union

from .errors import InputError
from .fsutil import mount_point_problem

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(InputError):
    """A checkpoint that cannot be loaded (or written); the message lists every problem found."""

    def __init__(self, problems: list[str], source: Union[str, Path]):
        self.problems = problems
        self.source = str(source)
        super().__init__(f"invalid checkpoint {source}:\n" + "\n".join(f"  - {p}" for p in problems))


def is_checkpoint_file(entry: Path) -> bool:
    name = entry.name
    return (entry.is_file() and not entry.is_symlink()
            and (name in (CONFIG_FILE, INDEX_FILE) or name.endswith(".safetensors")))


def is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def replace_problem(out: Path, force: bool, flag: str) -> str | None:
    """Why a new checkpoint may not be written to `out`, or None: `out` is missing or an empty
    directory, or `force` is set and it is a checkpoint (config.json plus safetensors files and
    nothing else). `flag` names the switch that sets `force` (`--force`, `overwrite=True`)."""
    if not out.exists() and not out.is_symlink():
        return None
    if out.is_symlink():   # renaming over it would replace the link, not the directory
        return f"is a symbolic link (to {os.readlink(out)}): give the directory itself"
    if not out.is_dir():
        return "exists and is not a directory"
    mounted = mount_point_problem(out, "a checkpoint")
    if mounted:
        return mounted
    entries = sorted(out.iterdir())
    if not entries:
        return None
    if not force:
        return f"exists and is not empty ({flag} replaces a checkpoint there)"
    foreign = [e.name for e in entries if not is_checkpoint_file(e)]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        return (f"holds files that are not a checkpoint's ({shown}); only a directory of "
                f"{CONFIG_FILE} and safetensors files is replaced, even with {flag}")
    if not (out / CONFIG_FILE).is_file():
        return (f"has no {CONFIG_FILE}, so it is not a checkpoint; only a checkpoint directory is "
                f"replaced, even with {flag}")
    return None
