"""What several subcommands share: messages, argument types, output and checkpoint checks made
before anything heavy is imported, and loading the model."""
from __future__ import annotations

import argparse
import math
import os
import sys
import unicodedata
from pathlib import Path
from typing import Optional

from ..errors import UsageError

PROG = "k31c"
SEED_MAX = 2**64 - 1   # torch.Generator.manual_seed takes 64 bits


def log(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def progress(msg: str) -> None:
    """What a long step is doing, for a person watching: on stderr when it is a terminal."""
    if sys.stderr.isatty():
        log(msg)


# ---- argument types (argparse reports a ValueError / ArgumentTypeError as `argument --x: ...`) --

def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def seed(text: str) -> int:
    value = _integer(text)
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"{text} is outside 0..{SEED_MAX} (64 bits)")
    return value


def positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def utf8_text(text: str) -> str:
    """Command-line text that is valid UTF-8 (Python keeps undecodable bytes as surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = text[e.start].encode("utf-8", "surrogateescape")
        raise argparse.ArgumentTypeError(f"not valid UTF-8 (byte {raw[0]:#04x} at character "
                                         f"{e.start})") from None
    return text


def printable(text: str) -> str:
    """Control characters a random model emits would drive the terminal; show them escaped."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else f"\\x{ord(c):02x}"
                   for c in text)


# ---- paths ------------------------------------------------------------------------------------

def output_file(arg: str, flag: str) -> Path:
    """An output file path whose directory exists and is writable, and that is not a directory.
    A symbolic link is checked as its target (the file that gets written); a device or FIFO
    (/dev/null) is written into, so only it must be writable."""
    from ..fsutil import is_special, output_target
    if not arg:
        raise UsageError(f"{flag} is empty: give a file name")
    if arg.endswith(os.sep) or os.path.basename(arg) == ".":   # Path() would drop the tail
        raise UsageError(f"{flag} {arg} ends in {os.path.basename(arg) or os.sep!r}: give a file "
                         "name, not a directory")
    path = Path(arg)
    try:
        target = output_target(path)
    except OSError as e:
        raise UsageError(f"{flag} {arg}: {e.strerror}") from None
    if target.is_dir():
        raise UsageError(f"{flag} {arg} is a directory")
    if is_special(target):
        if not os.access(target, os.W_OK):
            raise UsageError(f"{flag} {arg} is not writable")
        return path
    parent = target.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise UsageError(f"{flag} {arg}: directory {parent} {what}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {arg}: directory {parent} is not writable")
    return path


def checkpoint_dir(arg: Optional[str]) -> Optional[Path]:
    """--checkpoint checked (None: the default tiny model). A checkpoint that a killed
    `init --force` left aside is first put back, as the next write would."""
    from ..fsutil import clean_stale_for_reader, left_aside
    if arg is None:
        return None
    if not arg:
        raise UsageError("--checkpoint is empty: give a checkpoint directory")
    path = Path(arg)
    clean_stale_for_reader(path)
    if not path.exists():
        aside = left_aside(path)
        where = f" (a replacement left the previous one in {aside[0]})" if aside else ""
        raise UsageError(f"--checkpoint {arg}: checkpoint directory {path} does not exist{where}")
    if not path.is_dir():
        raise UsageError(f"--checkpoint {arg} is not a directory")
    return path


def checkpoint_config(path: Optional[Path]):
    """The config of a checkpoint, read from its config.json alone (no torch, no weights), so that
    arguments are checked against it first; for the default model, the preset it is made from."""
    from ..checkpoint_files import CONFIG_FILE, CheckpointError
    from ..config import ConfigError, K31Config, preset
    from ..paths import default_model_dir, remake_hint
    if path is None:
        made = default_model_dir() / CONFIG_FILE
        if not made.is_file():
            return preset("tiny")
        try:
            return K31Config.from_json(made)
        except ConfigError as e:
            raise ConfigError(e.problems + [remake_hint(made.parent)], str(made)) from None
    config = path / CONFIG_FILE
    if not config.is_file():
        there = config.exists()   # a FIFO or a directory: there, but not a file
        problem = f"{CONFIG_FILE} is not a file" if there else f"no {CONFIG_FILE} in the directory"
        raise CheckpointError([problem], path)
    return K31Config.from_json(config)


def check_length(n: int, cfg, what: str) -> None:
    if n > cfg.max_seq_len:
        raise UsageError(f"{what} ({n} tokens) exceeds the model's maximum length {cfg.max_seq_len}")


def load_model(path: Optional[Path]):
    """The model of a checked --checkpoint, or the default tiny model (made on first use)."""
    progress("loading torch")
    import torch

    from ..checkpoint import load_checkpoint
    from ..checkpoint_save import default_checkpoint
    from ..checkpoint_files import CheckpointError
    from ..config import ConfigError
    from ..paths import remake_hint
    torch.manual_seed(0)            # same checkpoint and tokens -> same bytes out, run after run
    torch.use_deterministic_algorithms(True, warn_only=True)
    if path is not None:
        progress(f"loading {path}")
        return load_checkpoint(path)
    path = default_checkpoint(log=log)
    try:
        return load_checkpoint(path)
    except (CheckpointError, ConfigError) as e:
        raise type(e)(e.problems + [remake_hint(path)], path) from None


def bad_weights(ckpt: Optional[Path], problem: str):
    """The CheckpointError of logits that are NaN or inf: the same weights fail the same way on
    any machine, so it is the checkpoint that is bad (for k31c's own tiny model: how to remake it)."""
    from ..checkpoint_files import CheckpointError
    from ..paths import default_model_dir, remake_hint
    hint = [] if ckpt else [remake_hint(default_model_dir())]
    return CheckpointError([f"{problem} (its weights hold NaN or inf, or overflow)"] + hint,
                           ckpt or default_model_dir())


# ---- compiled models (generate --target, prebuild) ----------------------------------------------

TARGET_NAMES = ("cpu", "h200", "mi350x")     # lowering/targets.py (not imported here: no torch yet)
DENSE_CODEGEN_NAMES = ("inductor", "fx", "iree")   # lowering/build.py: DENSE_CODEGENS
DEFAULT_POOL_LEN = 4096                      # the Engine's default pool length (runtime/engine.py)


def add_compile_args(p, default_target: Optional[str]) -> None:
    choices = (("eager",) if default_target == "eager" else ()) + TARGET_NAMES
    p.add_argument("--target", default=default_target or "cpu", choices=choices,
                   help=f"{'eager: the PyTorch model itself; ' if default_target == 'eager' else ''}"
                        f"a k31c target to compile for (default: {default_target or 'cpu'})")
    p.add_argument("--dense-codegen", choices=DENSE_CODEGEN_NAMES,
                   help="who compiles the dense ops between the k31c kernels (executor 'program'; "
                        "default: the target's: Inductor, IREE on mi350x; 'iree' on cpu runs IREE's "
                        "CPU modules)")
    add_cache_dir(p)


def add_cache_dir(p) -> None:
    p.add_argument("--cache-dir", help="the compile cache (default: $K31C_COMPILE_CACHE, else "
                                       "compile-cache in the k31c home, ~/.cache/k31c)")


def pool_len(cfg, needed: int = 0) -> int:
    """The cache pool's length for a compiled model: one length for every prompt, so the
    compile cache's programs (which are specialised to the pool) serve them all."""
    return max(min(cfg.max_seq_len, DEFAULT_POOL_LEN), needed)


def compile_model(model, target: str, cache_dir: Optional[str], dense_codegen: Optional[str] = None):
    """`k31c.compile(model, target)` with the CLI's cache and dense code generator choices, the
    model on the target's device."""
    from ..api import compile as k31c_compile
    from ..lowering.targets import get_target
    t = get_target(target)
    if not t.runnable_here:
        raise UsageError(f"--target {target} is compile-only here: its kernels and programs are built "
                         f"and inspected (k31c build-kernels --target {target}, k31c inspect --target "
                         f"{target}, k31c.compile(...).build(...)), not run")
    if t.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise UsageError(f"--target {target} runs on a CUDA device and this machine has none")
        model = model.to("cuda")
    options = {"cache": cache_dir} if cache_dir else {}
    if dense_codegen is not None:            # the option of executor "program" (the cpu's default is "inductor")
        options.update(executor="program", dense_codegen=dense_codegen)
    return k31c_compile(model, target=target, options=options or None)

