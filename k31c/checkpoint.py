"""Checkpoints: a directory with `config.json` and safetensors weights under HF K3 tensor names.

Layout (spec/model.md §9.6): `config.json` + `model.safetensors`, or shards listed by
`model.safetensors.index.json` (`weight_map`: tensor name -> shard file). Names may carry the
`language_model.` prefix of the multimodal K3 checkpoints on every language-model tensor; the
vision tower and projector beside them are then skipped.

Loading validates every tensor header against the model built on the meta device before reading
any data, and raises one CheckpointError listing every problem; tensors are read from the
memory-mapped files only after that; every file the index names must lie inside the directory.
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
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from . import fsutil
from .checkpoint_files import (CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, CheckpointError,
                               is_checkpoint_file, replace_problem)
from .config import K31Config, config_from_name_or_path
from .errors import UsageError
from .paths import default_model_dir, home_origin, remake_hint
LM_PREFIX = "language_model."
# Tensors of the multimodal wrapper that sit beside `language_model.*` and are not ours to load.
MULTIMODAL_PREFIXES = ("vision_tower.", "multi_modal_projector.", "mm_projector.")
MAX_LISTED = 12  # per kind of problem; the rest are counted

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shape(s) -> str:
    return "[" + ", ".join(str(int(n)) for n in s) + "]"


def _listed(kind: str, items: list[str]) -> list[str]:
    """At most MAX_LISTED problems of one kind, then a count of the rest."""
    if len(items) <= MAX_LISTED:
        return items
    return items[:MAX_LISTED] + [f"... and {len(items) - MAX_LISTED} more {kind}"]


# ---- reading headers -----------------------------------------------------------------------------

class _TensorRef:
    """Where one stored tensor lives and what its header says (no data read)."""

    def __init__(self, file: Path, stored_name: str, shape: list[int], dtype: str):
        self.file, self.stored_name, self.shape, self.dtype = file, stored_name, shape, dtype

    @property
    def torch_dtype(self):
        return _ST_DTYPES.get(self.dtype)

    @property
    def dtype_str(self) -> str:
        return _dtype_name(self.torch_dtype) if self.torch_dtype is not None else self.dtype


def _weight_files(ckpt: Path) -> tuple[list[Path], Optional[dict[str, str]]]:
    """The safetensors files of a checkpoint, and the index's weight_map when sharded."""
    single, index = ckpt / WEIGHTS_FILE, ckpt / INDEX_FILE
    for f in (single, index):
        if f.exists() and not f.is_file():
            raise CheckpointError([f"{f.name} is a directory or special file, not a file"], ckpt)
    if single.exists() and index.exists():
        raise CheckpointError([f"both {WEIGHTS_FILE} and {INDEX_FILE} present: which one holds the "
                               "weights is ambiguous"], ckpt)
    if single.exists():
        return [single], None
    if not index.exists():
        raise CheckpointError([f"no {WEIGHTS_FILE} or {INDEX_FILE}"], ckpt)
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise CheckpointError([f"{INDEX_FILE} is not a JSON object: {e}"], index) from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError([f"{INDEX_FILE} has no 'weight_map' of tensor name -> file name"], index)
    root = ckpt.resolve()
    outside = [f"{INDEX_FILE} maps '{name}' to '{f}', which is outside the checkpoint directory"
               for name, f in sorted(weight_map.items())
               if os.path.isabs(f) or not (ckpt / f).resolve().is_relative_to(root)]
    if outside:
        raise CheckpointError(_listed("files outside the directory", outside), ckpt)
    files = sorted(set(weight_map.values()))
    missing = [f"{INDEX_FILE} names shard '{f}', which does not exist" if not (ckpt / f).exists()
               else f"{INDEX_FILE} names shard '{f}', which is not a file"
               for f in files if not (ckpt / f).is_file()]
    if missing:
        raise CheckpointError(_listed("missing shards", missing), ckpt)
    return [ckpt / f for f in files], weight_map


def _check_readable(path: Path) -> None:
    """safetensors reports a file it may not open as missing: open it first for the real reason."""
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise CheckpointError([f"cannot read {path.name}: {e.strerror}"], path) from None


def read_tensor_headers(ckpt: Union[str, Path]) -> dict[str, _TensorRef]:
    """Stored name -> header of every tensor in the checkpoint's safetensors files.

    Reads only headers. A corrupt or truncated file, a tensor stored twice, or an index that
    disagrees with its shards raises CheckpointError.
    """
    ckpt = Path(ckpt)
    files, weight_map = _weight_files(ckpt)
    refs: dict[str, _TensorRef] = {}
    problems: list[str] = []
    for path in files:
        _check_readable(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    if name in refs:
                        problems.append(f"tensor '{name}' stored twice ({refs[name].file.name}, {path.name})")
                    refs[name] = _TensorRef(path, name, list(sl.get_shape()), sl.get_dtype())
        except (SafetensorError, OSError) as e:
            raise CheckpointError([f"cannot read {path.name}: {e}"], path) from None
    if weight_map is not None:
        for name, file in sorted(weight_map.items()):
            if name not in refs or refs[name].file.name != Path(file).name:
                problems.append(f"{INDEX_FILE} maps '{name}' to {file}, which has no such tensor")
        problems += [f"tensor '{n}' in {r.file.name} is not listed in {INDEX_FILE}"
                     for n, r in sorted(refs.items()) if n not in weight_map]
    if problems:
        raise CheckpointError(_listed("index problems", problems), ckpt)
    return refs


def _model_names(refs: dict[str, _TensorRef]) -> tuple[dict[str, _TensorRef], list[str]]:
    """Model tensor name -> header, after removing the optional `language_model.` prefix;
    plus the stored names that belong to no language model (reported as unexpected)."""
    if not any(n.startswith(LM_PREFIX) for n in refs):
        return dict(refs), []
    named: dict[str, _TensorRef] = {}
    stray: list[str] = []
    for n, r in refs.items():
        if n.startswith(LM_PREFIX):
            named[n[len(LM_PREFIX):]] = r
        elif not n.startswith(MULTIMODAL_PREFIXES):
            stray.append(n)
    return named, stray


# ---- loading ---------------------------------------------------------------------------------------

def _build_model(cfg: K31Config, device) -> torch.nn.Module:
    from .graph.model import K31ForCausalLM  # the model imports the op set; only load it when needed
    with torch.device(device):
        return K31ForCausalLM(cfg)


def _check_tensors(expected: dict[str, torch.Tensor], named: dict[str, _TensorRef], stray: list[str],
                   ckpt: Path) -> None:
    missing = [f"missing tensor '{n}' (expected {_shape(t.shape)} {_dtype_name(t.dtype)})"
               for n, t in expected.items() if n not in named]
    unexpected = [f"unexpected tensor '{named[n].stored_name}' in {named[n].file.name}"
                  for n in sorted(named) if n not in expected]
    unexpected += [f"unexpected tensor '{n}' in a checkpoint whose other tensors carry the "
                   f"'{LM_PREFIX}' prefix" for n in sorted(stray)]
    shapes, dtypes = [], []
    for n, t in expected.items():
        r = named.get(n)
        if r is None:
            continue
        if list(r.shape) != list(t.shape):
            shapes.append(f"tensor '{r.stored_name}' in {r.file.name}: shape {_shape(r.shape)}, "
                          f"expected {_shape(t.shape)}")
        if r.torch_dtype != t.dtype:
            dtypes.append(f"tensor '{r.stored_name}' in {r.file.name}: dtype {r.dtype_str}, "
                          f"expected {_dtype_name(t.dtype)}")
    problems = (_listed("missing tensors", missing) + _listed("unexpected tensors", unexpected)
                + _listed("shape mismatches", shapes) + _listed("dtype mismatches", dtypes))
    if problems:
        raise CheckpointError(problems, ckpt)


def load_checkpoint(path: Union[str, Path], device="cpu", dtype=None) -> torch.nn.Module:
    """Load a checkpoint directory into a K31ForCausalLM in eval mode, without gradients.

    Every tensor must match the model built from the checkpoint's config.json in name, shape and
    dtype (the model's own parameter dtype: cfg.dtype, float32 for the few kept in fp32);
    CheckpointError lists all mismatches and nothing is loaded. `dtype` (a torch dtype or its
    name) converts the model after validation, e.g. a bfloat16 checkpoint run in float32.
    ConfigError (from config.json) propagates unchanged.
    """
    ckpt = Path(path)
    fsutil.clean_stale_for_reader(ckpt)   # a killed `overwrite=True` left the old one aside
    if not ckpt.exists():
        aside = fsutil.left_aside(ckpt)
        where = f" (a replacement left the previous one in {aside[0]})" if aside else ""
        raise CheckpointError([f"no such directory{where}"], ckpt)
    if not ckpt.is_dir():
        raise CheckpointError([f"not a directory (a checkpoint is a directory with {CONFIG_FILE})"], ckpt)
    if not (ckpt / CONFIG_FILE).is_file():
        raise CheckpointError([f"{CONFIG_FILE} is not a file" if (ckpt / CONFIG_FILE).exists()
                               else f"no {CONFIG_FILE} in the directory"], ckpt)
    cfg = K31Config.from_json(ckpt / CONFIG_FILE)
    named, stray = _model_names(read_tensor_headers(ckpt))

    model = _build_model(cfg, "meta")
    _check_tensors(model.state_dict(), named, stray, ckpt)

    if dtype is not None and _dtype_name(dtype) != cfg.dtype:
        model = _build_model(cfg.replace(dtype=_dtype_name(dtype)), "meta")
    targets = model.state_dict()
    handles = {}
    try:
        state = {}
        for n, r in named.items():
            if r.file not in handles:
                handles[r.file] = safe_open(str(r.file), framework="pt")
            t = handles[r.file].get_tensor(r.stored_name)
            state[n] = t.to(device=device, dtype=targets[n].dtype)
    except (SafetensorError, OSError) as e:
        raise CheckpointError([f"cannot read tensor data: {e}"], ckpt) from None
    finally:
        handles.clear()
    model.load_state_dict(state, strict=True, assign=True)
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:  # a tensor the checkpoint does not carry (non-persistent buffer): a model bug
        raise RuntimeError(f"model tensors not materialised by the checkpoint: {still_meta[:5]}")
    model.eval()
    model.requires_grad_(False)
    return model


# ---- saving ----------------------------------------------------------------------------------------

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
        model = _build_model(cfg, "cpu")
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
