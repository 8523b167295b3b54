"""Per-target kernel registry: which implementation runs each k31c op on each target.

A kernel is a Python callable with exactly the op's signature (the op's schema is the ABI). The
`lower` pass asks `lookup`; an op without a kernel for the target runs its reference
implementation, and that fallback is counted and reported, never silent.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .targets import get_target


@dataclass(frozen=True)
class Kernel:
    op: str            # "k31c::sparse_mla"
    target: str        # "h200"
    fn: Callable
    backend: str       # "triton", "iree", ...
    source: str        # module that defines it (goes into cache keys)
    runs: Optional[Callable] = None   # (op's args) -> the launcher that runs a call of these
                                      # shapes, dtypes and layouts, where fn hands some calls to
                                      # another kernel (fake tensors work: only metadata is read)

    @property
    def name(self) -> str:
        """`<backend>:<module>.<function>`, as reports and graph dumps print it."""
        return _name(self.backend, self.fn)

    def name_for(self, args) -> str:
        """The name of the launcher that runs a call with these arguments (`name` unless `fn`
        hands such calls to another kernel)."""
        return _name(self.backend, self.runs(*args)) if self.runs is not None else self.name


def _name(backend: str, fn: Callable) -> str:
    return f"{backend}:{fn.__module__}.{fn.__name__}"


_KERNELS: dict[tuple[str, str], Kernel] = {}


def register(op: str, targets: tuple[str, ...], backend: str = "triton",
             runs: Optional[Callable] = None):
    """Decorator: `@register("k31c::sparse_mla", targets.GPU_TARGETS)` on the launcher; `runs`
    (see Kernel) where the launcher hands some calls to another kernel."""
    if not op.startswith("k31c::"):
        raise ValueError(f"kernels implement k31c ops; got '{op}'")

    def deco(fn):
        for t in targets:
            get_target(t)
            key = (op, t)
            if key in _KERNELS and _KERNELS[key].fn is not fn:
                raise ValueError(f"two kernels registered for {op} on {t}: "
                                 f"{_KERNELS[key].source} and {fn.__module__}")
            _KERNELS[key] = Kernel(op, t, fn, backend, fn.__module__, runs)
        return fn
    return deco


def lookup(op: str, target: str) -> Kernel | None:
    _load_kernels(target)
    return _KERNELS.get((op, target))


def kernels_for(target: str) -> dict[str, Kernel]:
    _load_kernels(target)
    return {op: k for (op, t), k in _KERNELS.items() if t == target}


def _load_kernels(target: str) -> None:
    """Import the kernel modules of a target lazily (Triton/IREE are imported only when asked)."""
    if get_target(target).triton_backend is not None:
        from .triton import register_all
        register_all()
