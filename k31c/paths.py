"""Where k31c keeps per-user files: the tiny model made on first use, and (later) the compile cache.

The root is `$K31C_HOME` when set, else `$XDG_CACHE_HOME/k31c`, else `~/.cache/k31c`.
Nothing here creates a directory: callers create what they write, atomically.
"""
from __future__ import annotations

import os
from pathlib import Path


def k31c_home() -> Path:
    """The root of k31c's per-user files."""
    if os.environ.get("K31C_HOME"):
        return Path(os.environ["K31C_HOME"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "k31c"


def home_origin() -> str:
    """Where k31c_home() comes from, for a message about a directory there that cannot be used."""
    if os.environ.get("K31C_HOME"):
        return f"$K31C_HOME={os.environ['K31C_HOME']}"
    if os.environ.get("XDG_CACHE_HOME"):
        return f"$XDG_CACHE_HOME={os.environ['XDG_CACHE_HOME']}; set $K31C_HOME to choose another"
    return f"{k31c_home()}, the default; set $K31C_HOME to choose another"


def remake_hint(path: Path) -> str:
    """What to do about a damaged model that k31c made itself."""
    return f"this is k31c's cached tiny model: delete {path} and the next run makes it again"


def models_dir() -> Path:
    """Checkpoints that k31c made itself (random-weight models for trying the tools)."""
    return k31c_home() / "models"


def default_model_dir() -> Path:
    """The tiny model (preset `tiny`, seed 0) that `k31c logits|generate` use without --checkpoint."""
    return models_dir() / "tiny-seed0"


def compile_cache_dir() -> Path:
    """The persistent compile cache (DESIGN §6)."""
    return k31c_home() / "compile-cache"
