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
    """An output file path whose directory exists and is writable, and that is not a directory."""
    path = Path(arg)
    parent = path.parent
    if path.is_dir():
        raise UsageError(f"{flag} {arg} is a directory")
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise UsageError(f"{flag} {arg}: directory {parent} {what}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {arg}: directory {parent} is not writable")
    return path


def checkpoint_dir(arg: Optional[str]) -> Optional[Path]:
    """--checkpoint checked (None: the default tiny model)."""
    if arg is None:
        return None
    path = Path(arg)
    if not path.exists():
        raise UsageError(f"--checkpoint {arg}: checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise UsageError(f"--checkpoint {arg} is not a directory")
    return path


def checkpoint_config(path: Optional[Path]):
    """The config of a checkpoint, read from its config.json alone (no torch, no weights), so that
    arguments are checked against it first; for the default model, the preset it is made from."""
    from ..checkpoint_files import CONFIG_FILE, CheckpointError
    from ..config import K31Config, preset
    from ..paths import default_model_dir
    if path is None:
        made = default_model_dir() / CONFIG_FILE
        return K31Config.from_json(made) if made.is_file() else preset("tiny")
    if not (path / CONFIG_FILE).is_file():
        raise CheckpointError([f"no {CONFIG_FILE} in the directory"], path)
    return K31Config.from_json(path / CONFIG_FILE)


def check_length(n: int, cfg, what: str) -> None:
    if n > cfg.max_seq_len:
        raise UsageError(f"{what} ({n} tokens) exceeds the model's maximum length {cfg.max_seq_len}")


def load_model(path: Optional[Path]):
    """The model of a checked --checkpoint, or the default tiny model (made on first use)."""
    progress("loading torch")
    import torch

    from ..checkpoint import default_checkpoint, load_checkpoint
    from ..checkpoint_files import CheckpointError
    from ..config import ConfigError
    torch.manual_seed(0)            # same checkpoint and tokens -> same bytes out, run after run
    torch.use_deterministic_algorithms(True, warn_only=True)
    if path is not None:
        progress(f"loading {path}")
        return load_checkpoint(path)
    path = default_checkpoint(log=log)
    try:
        return load_checkpoint(path)
    except (CheckpointError, ConfigError) as e:
        hint = f"this is k31c's cached tiny model: delete {path} and the next run makes it again"
        raise type(e)(e.problems + [hint], path) from None
