"""Writing checkpoints (the layout `checkpoint.py` reads): `save_checkpoint`, `init_checkpoint`
(random weights) and `default_checkpoint` (the tiny model in the user cache, made on first use).

Saving writes into a temporary directory and renames it into place, so a failed or killed save
leaves nothing behind (fsutil: a SIGKILLed one's temporary directory is removed by the next save).
Replacing an existing directory (`overwrite=True`) is allowed only for a checkpoint.
"""
from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import Callable, Optional, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from . import fsutil
from .checkpoint import build_model
from .checkpoint_files import (CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, CheckpointError,
                               is_checkpoint_file, replace_problem)
from .config import K31Config, config_from_name_or_path
from .errors import UsageError
from .paths import default_model_dir, home_origin, remake_hint


def _cpu_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as contiguous CPU tensors, each with storage of its own (safetensors needs it)."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Consecutive groups of names of at most max_bytes each (a larger tensor goes alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def _check_replaceable(out: Path, overwrite: bool) -> None:
    problem = replace_problem(out, overwrite, "overwrite=True")
    if problem:
        raise CheckpointError([problem], out)


def _publish(tmp: Path, out: Path, overwrite: bool) -> None:
    """Move the finished temporary directory to `out` with a rename."""
    _check_replaceable(out, overwrite)
    if out.is_dir() and any(out.iterdir()):
        if out.resolve() == Path.cwd().resolve():   # cannot be renamed (a mount point is refused)
            old = sorted(p.name for p in out.iterdir() if is_checkpoint_file(p))
            fsutil.replace_files(tmp, out, old)
        else:
            fsutil.replace_dir(tmp, out)
        return
    if out.exists():
        out.rmdir()
    try:
        os.rename(tmp, out)
    except OSError as e:  # another writer got there first
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        raise CheckpointError([f"cannot move the new checkpoint into place: {e.strerror}"], out) from None


def _apply_umask(directory: Path) -> None:
    """Give the temporary directory (0700 from mkdtemp) and its files the usual permissions."""
    os.chmod(directory, fsutil.dir_mode())
    for f in directory.iterdir():
        os.chmod(f, fsutil.file_mode())


def _save_file(tensors: dict[str, torch.Tensor], path: Path, meta: dict) -> None:
    """safetensors' save_file, its I/O failure raised as the OSError it is (ENOSPC: a full disk)."""
    try:
        save_file(tensors, str(path), metadata=meta)
    except SafetensorError as e:   # "... I/O error: No space left on device (os error 28)"
        m = re.search(r"\(os error (\d+)\)", str(e))
        code = int(m[1]) if m else errno.EIO
        raise OSError(code, os.strerror(code), str(path)) from None


def save_checkpoint(model: torch.nn.Module, out_dir: Union[str, Path], shard_max_bytes: Optional[int] = None,
                    overwrite: bool = False) -> Path:
    """Write `model.config` and its weights as a checkpoint directory; returns the directory.

    One `model.safetensors`, or with `shard_max_bytes` shards of at most that size (a tensor
    larger than the limit gets a shard of its own) plus `model.safetensors.index.json`.
    The output is a function of the weights alone: the same model gives the same bytes.
    An OS error while writing (a full disk: ENOSPC) names `out_dir`, not the temporary directory.
    """
    out = Path(os.path.abspath(out_dir))   # `.` has no name to put beside it
    if shard_max_bytes is not None and shard_max_bytes <= 0:
        raise ValueError(f"shard_max_bytes must be positive, got {shard_max_bytes}")
    _check_replaceable(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    fsutil.clean_stale(out.parent, out.name)
    try:
        _write(model, out, shard_max_bytes, overwrite)
    except OSError as e:
        raise fsutil.naming(e, Path(out_dir)) from None
    return Path(out_dir)


def _write(model: torch.nn.Module, out: Path, shard_max_bytes: Optional[int], overwrite: bool) -> None:
    """save_checkpoint's writing: into a temporary directory beside `out`, then renamed into place."""
    with fsutil.temporary_dir(out.parent, out.name) as tmp:
        fsutil.pause_point("checkpoint-tmp")
        model.config.to_json(tmp / CONFIG_FILE)
        tensors = _cpu_tensors(model)
        meta = {"format": "pt"}
        if shard_max_bytes is None:
            _save_file(tensors, tmp / WEIGHTS_FILE, meta)
        else:
            groups = _shards(tensors, shard_max_bytes)
            weight_map = {}
            for i, names in enumerate(groups):
                file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                _save_file({n: tensors[n] for n in names}, tmp / file, meta)
                weight_map.update({n: file for n in names})
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        _apply_umask(tmp)
        fsutil.pause_point("checkpoint-written")
        _publish(tmp, out, overwrite)


def init_checkpoint(config: Union[str, Path, K31Config], seed: int, out_dir: Union[str, Path],
                    overwrite: bool = False, shard_max_bytes: Optional[int] = None) -> Path:
    """Write a checkpoint of random weights (spec §9.5 init); the same seed gives the same bytes."""
    cfg = config if isinstance(config, K31Config) else config_from_name_or_path(config)
    with torch.random.fork_rng(devices=[]):  # whatever construction draws stays seeded too
        torch.manual_seed(seed)
        model = build_model(cfg, "cpu")
        model.reset_parameters(torch.Generator().manual_seed(seed))
    return save_checkpoint(model, out_dir, shard_max_bytes=shard_max_bytes, overwrite=overwrite)


def default_checkpoint(log: Optional[Callable[[str], None]] = None) -> Path:
    """The tiny model (preset `tiny`, seed 0) in the user cache directory, made on first use.

    `log` is told when the model is being made. Two processes making it at once is harmless:
    each writes its own temporary directory and the first rename wins.
    """
    out = default_model_dir()
    fsutil.clean_stale(out.parent, out.name)
    if (out / CONFIG_FILE).is_file():
        return out
    _check_cache(out)
    if log is not None:
        log(f"making the tiny model (preset 'tiny', seed 0) in {out}")
    try:
        init_checkpoint("tiny", 0, out)
    except CheckpointError:
        if not (out / CONFIG_FILE).is_file():  # not a lost race (the first rename wins)
            _check_cache(out)
            raise
    return out


def _check_cache(out: Path) -> None:
    """Before the tiny model is made in `out`: a place it can go, told in terms a user can act on
    (not `overwrite=True`; $K31C_HOME when that is what points at an unusable directory)."""
    if replace_problem(out, False, "overwrite=True"):   # a damaged cache: no config.json, or a file
        what = "not a directory" if not out.is_dir() else f"files but no {CONFIG_FILE}"
        raise CheckpointError([what, remake_hint(out)], out)
    problem = fsutil.parent_problem(out)
    if problem:
        raise UsageError(f"cannot make k31c's tiny model in {out}: {problem} (the directory comes "
                         f"from {home_origin()})")
