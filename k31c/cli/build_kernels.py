"""`k31c build-kernels`: the Triton kernels of a GPU target compiled ahead of time (no GPU needed).

The arguments and the build belong to k31c.lowering.aot."""
from __future__ import annotations


def add(sub) -> None:
    from ..lowering.aot import add_build_parser
    add_build_parser(sub)
