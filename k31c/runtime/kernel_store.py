"""The k31c kernels' Triton binaries kept in the compile cache (`<cache>/.triton/`).

A program's Triton kernels are compiled by Triton's JIT at their first launch, keyed by Triton
itself (source, signature, value specialisations, options, Triton version, GPU architecture).
While a compiled program runs with the compile cache on (`keeping(store)`, around the executor's
calls), Triton's compiles and lookups go to the cache's `.triton/` directory instead of Triton's
own cache, so a warm start, or another machine the cache directory was copied to, loads them
and compiles nothing. The layout is Triton's own (`<key>/<files>` with a group file listing
them), written by Triton's file cache manager (each file renamed into place: no partial file
is read). Two differences:
- a group's files are looked up beside it, not at the absolute paths Triton records, so the
  directory can move;
- a kernel missing from the store but in Triton's own cache is copied over instead of compiled.

Outside `keeping` (and in other threads) Triton's cache works as before. A process that sets its
own `knobs.cache.manager_class` (or $TRITON_CACHE_MANAGER) keeps it: `install` then says why the
store is not used.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from contextvars import ContextVar
from typing import Iterator, Optional

STORE_DIR = ".triton"           # inside the compile cache's root; not an entry (entries skip dot names)

_STORE: ContextVar[Optional[str]] = ContextVar("k31c_kernel_store", default=None)
_manager = None                  # the CacheManager class, made on first install


def _manager_class():
    global _manager
    if _manager is not None:
        return _manager
    from triton import knobs
    from triton.runtime.cache import FileCacheManager

    class StoreCacheManager(FileCacheManager):
        """Triton's FileCacheManager, rooted at the store while `keeping` is in force."""

        def __init__(self, key, override=False, dump=False):
            store = _STORE.get()
            self.in_store = store is not None and not override and not dump
            if not self.in_store:
                super().__init__(key, override=override, dump=dump)
                return
            self.key = key
            self.cache_dir = os.path.join(store, key)
            self.lock_path = os.path.join(self.cache_dir, "lock")
            os.makedirs(self.cache_dir, exist_ok=True)

        def get_group(self, filename: str):
            if not self.in_store:
                return super().get_group(filename)
            return _read_group(self.cache_dir, filename) or self._copy_from_triton(filename)

        def _copy_from_triton(self, filename: str) -> Optional[dict]:
            """The group from Triton's own cache, copied into the store (None: not there)."""
            theirs = os.path.join(knobs.cache.dir, self.key)
            group = _read_group(theirs, filename)
            if group is None:
                return None
            mine = {}
            for child, path in group.items():
                with open(path, "rb") as f:
                    mine[child] = self.put(f.read(), child, binary=True)
            self.put_group(filename, mine)
            return mine

    _manager = StoreCacheManager
    return _manager


def _read_group(directory: str, filename: str) -> Optional[dict]:
    """The group's files as they lie beside its group file (all of them, else None)."""
    try:
        with open(os.path.join(directory, f"__grp__{filename}")) as f:
            children = json.load(f)["child_paths"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    group = {c: os.path.join(directory, os.path.basename(p)) for c, p in children.items()}
    return group if all(os.path.isfile(p) for p in group.values()) else None


def install() -> Optional[str]:
    """Make Triton's cache manager the store-aware one (once a process); None, or why the store
    cannot be used (the process has its own manager)."""
    from triton import knobs
    cls = _manager_class()
    current = knobs.cache.manager_class
    if current is None:
        knobs.cache.manager_class = cls
    elif current is not cls:
        return f"Triton's cache manager is {current.__module__}.{current.__name__} ($TRITON_CACHE_MANAGER)"
    return None


@contextlib.contextmanager
def keeping(store: str) -> Iterator[None]:
    """Triton kernels compiled or looked up inside go to `store` (made if needed)."""
    token = _STORE.set(store)
    try:
        yield
    finally:
        _STORE.reset(token)


def summary(store) -> tuple[int, int]:
    """(kernels, bytes) in a store directory (a kernel: one compiled specialisation)."""
    kernels = size = 0
    if not os.path.isdir(store):
        return 0, 0
    for root, _, files in os.walk(store):
        for name in files:
            size += os.path.getsize(os.path.join(root, name))
            kernels += name.startswith("__grp__")
    return kernels, size


def clear(store) -> None:
    """Remove a store directory (renamed aside first, so no reader sees it half deleted)."""
    if not os.path.isdir(store):
        return
    aside = f"{store}.removing-{os.getpid()}"
    os.rename(store, aside)
    shutil.rmtree(aside, ignore_errors=True)
