"""Registering the Dynamo backend name "k31c" without clashing with its entry point."""
from __future__ import annotations

import sys


def register(compiler_fn) -> None:
    """Register `compiler_fn` as "k31c" if Dynamo is loaded and does not know the name yet. An
    installed k31c is also found through its `torch_dynamo_backends` entry point (pyproject.toml);
    once Dynamo has listed that entry point, it loads it itself on first lookup."""
    registry = sys.modules.get("torch._dynamo.backends.registry")
    if registry is None or "k31c" in registry._COMPILER_FNS or registry._BACKENDS.get("k31c") is not None:
        return
    registry.register_backend(compiler_fn=compiler_fn, name="k31c")
