"""Checkpoints: a directory with `config.json` and safetensors weights under HF K3 tensor names.

Layout (spec/model.md §9.6): `config.json` + `model.safetensors`, or shards listed by
`model.safetensors.index.json` (`weight_map`: tensor name -> shard file). Names may carry the
`language_model.` prefix of the multimodal K3 checkpoints on every language-model tensor; the
vision tower and projector beside them are then skipped.

Loading validates every tensor header against the model built on the meta device before reading
any data, and raises one CheckpointError listing every problem; tensors are read from the
memory-mapped files only after that; every file the index names must lie inside the directory.
Writing checkpoints (save, random init, the tiny model's cache) is `checkpoint_save.py`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import SafetensorError, safe_open

from . import fsutil
from .checkpoint_files import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, CheckpointError
from .config import K31Config

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

def build_model(cfg: K31Config, device) -> torch.nn.Module:
    """The model of `cfg`, its parameters made on `device` ("meta": shapes only)."""
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

    model = build_model(cfg, "meta")
    _check_tensors(model.state_dict(), named, stray, ckpt)

    if dtype is not None and _dtype_name(dtype) != cfg.dtype:
        model = build_model(cfg.replace(dtype=_dtype_name(dtype)), "meta")
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
