"""The Triton kernels a step launches, compiled in parallel before the step first runs.

Triton compiles each specialisation of a k31c kernel at its first launch, one after another:
about 0.6 s each, 84 of them for the tiny model's steps on an H100. `compile_ahead(run, workers)`
calls `run` "dry": each Triton launch of a k31c kernel is skipped (through Triton's
`jit_cache_hook`), and the first launch of each specialisation hands its compile to a pool of
threads (Triton's compiler leaves the GIL in its MLIR passes, and ptxas is a subprocess). When
it returns, every compile has finished and sits in the kernel's in-memory cache (and in the
compile cache's kernel store where `run` keeps kernels there: each compile runs in a copy of its
launch's context), so the real run that follows launches without compiling; the decode graph's
staging kernel is the exception, as only the graph's capture launches it and a dry run captures
nothing. A compile that failed is left to that run, which compiles it again and raises its error
where it always did.

During the dry run no k31c kernel launches, not even one compiled before or by the pool in
the meantime: a launch on the unwritten outputs of a skipped one could read out of bounds.
Each k31c kernel's JIT caches are split for the dry run (`_SplitCaches`): the dry run's thread
sees caches of its own that stay empty, so every launch misses and the hook skips
it; the pool's threads see others, which their compiles fill, and which are merged into the
kernel's own afterwards. The dense pieces (Inductor's kernels, launched outside the JIT) do
run, on zeros: the executor zeroes what each kernel step returns while `DRY_RUN` is set
(runtime/executor.py), so a dense piece that indexes by a kernel's output reads position 0,
not whatever the allocator's memory held.
"""
from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from ..errors import RuntimeFailure
from ..host import usable_cpus

KERNEL_MODULES = "k31c.lowering.triton."
DRY_RUN: contextvars.ContextVar[bool] = contextvars.ContextVar("k31c_dry_run", default=False)


@dataclass
class AheadReport:
    kernels: int = 0             # distinct specialisations the dry run met
    failed: int = 0              # compiles that raised (left to the real run)
    seconds: float = 0.0         # the dry run and the compiles
    stopped: Optional[str] = None    # why the dry run stopped early (its error), if it did


def default_workers() -> int:
    """Threads for the compiles: one per CPU this process may use."""
    return usable_cpus()


def _ours(module) -> bool:
    return str(getattr(module, "__name__", module)).startswith(KERNEL_MODULES)


def _jit_functions() -> list:
    """Every @triton.jit function of the k31c kernel modules imported so far."""
    from triton.runtime.jit import JITFunction
    found = {}
    for name, module in list(sys.modules.items()):
        if _ours(name) and module is not None:
            for value in vars(module).values():
                if isinstance(value, JITFunction):
                    found[id(value)] = value
    return list(found.values())


class _SplitCaches:
    """A JIT function's device caches during a dry run (Triton reads them only by
    `device_caches[device]`): the dry run's thread gets binder tuples of its own, whose kernel
    caches stay empty; the pool's threads share others, which their compiles fill."""

    def __init__(self, create_binder: Callable, dry_thread: int):
        self.create, self.dry_thread = create_binder, dry_thread
        self.dry: dict = {}
        self.compiled: dict = {}
        self.lock = threading.Lock()

    def __getitem__(self, device):
        side = self.dry if threading.get_ident() == self.dry_thread else self.compiled
        with self.lock:
            if device not in side:
                side[device] = self.create()
            return side[device]


class _Split:
    """The k31c kernels whose caches are split, with their own to restore."""

    def __init__(self):
        self.saved: dict = {}               # id -> (JIT function, its own device caches)
        self.thread = threading.get_ident()

    def split(self, fn) -> None:
        if id(fn) in self.saved:
            return
        if not (isinstance(getattr(fn, "device_caches", None), defaultdict) and hasattr(fn, "create_binder")):
            raise RuntimeFailure(f"jit_workers: this Triton's JIT function {fn.__name__} keeps no "
                                 "device_caches to compile ahead into (use jit_workers=0)")
        self.saved[id(fn)] = (fn, fn.device_caches)
        fn.device_caches = _SplitCaches(fn.create_binder, self.thread)

    def restore(self) -> None:
        """Each kernel's own caches back, with what the pool compiled added."""
        for fn, caches in self.saved.values():
            for device, entry in fn.device_caches.compiled.items():
                if entry[0]:
                    caches[device][0].update(entry[0])
            fn.device_caches = caches
        self.saved.clear()


@contextlib.contextmanager
def _looking_uncompiled() -> Iterator[_Split]:
    """Every k31c kernel imported so far split (`_SplitCaches`); one imported later is split by
    the hook at its first launch. On exit each has its own caches back, with what the pool
    compiled."""
    fns = _jit_functions()
    split = _Split()
    try:
        for fn in fns:
            split.split(fn)
        yield split
    finally:
        split.restore()


class _Ahead:
    """The jit_cache_hook of a dry run: a k31c launch is skipped, the first of each
    specialisation submitting its compile to the pool; the compile the pool runs (`preload`, a
    warm-up) goes on, as does anything not k31c's."""

    def __init__(self, pool: ThreadPoolExecutor, before, split: _Split):
        self.pool = pool
        self.before = before        # a hook the process had set: asked first
        self.split = split
        self.futures = {}

    def __call__(self, *, key, fn, compile, is_manual_warmup, **kwargs):
        if self.before is not None and self.before(key=key, fn=fn, compile=compile,
                                                   is_manual_warmup=is_manual_warmup, **kwargs):
            return True
        if is_manual_warmup or not _ours(fn.module):
            return None
        jit = fn.jit_function
        self.split.split(jit)       # a kernel imported during the dry run: before its compile lands
        slot = (id(jit), key)
        if slot not in self.futures:
            context = contextvars.copy_context()      # the kernel store the launch keeps to
            self.futures[slot] = self.pool.submit(context.run, _preload, jit, compile["specialization_data"],
                                                  compile.get("device"))
        return True


def _preload(jit, data: str, device) -> None:
    """`preload` compiles for the thread's current device: the launch's."""
    if isinstance(device, int):
        import torch
        with torch.cuda.device(device):
            jit.preload(data)
    else:
        jit.preload(data)


def compile_ahead(run: Callable[[], None], workers: int,
                  say: Callable[[str], None] = lambda _: None) -> AheadReport:
    """Call `run` dry with the k31c kernels' compiles on `workers` threads; return when they
    have finished. `run` must not capture a device graph (its launches are skipped)."""
    from triton import knobs
    start = time.perf_counter()
    report = AheadReport()
    pool = ThreadPoolExecutor(workers, thread_name_prefix="k31c-jit")
    with _looking_uncompiled() as split:
        try:
            hook = _Ahead(pool, knobs.runtime.jit_cache_hook, split)
            knobs.runtime.jit_cache_hook = hook
            dry = DRY_RUN.set(True)
            try:
                run()
            except Exception as e:      # the real run that follows meets it again, where it is
                report.stopped = f"{type(e).__name__}: {e}".splitlines()[0]
            finally:
                DRY_RUN.reset(dry)
                knobs.runtime.jit_cache_hook = hook.before
            report.kernels = len(hook.futures)
            say(f"compiling {report.kernels} Triton kernels on {workers} threads")
            wait(list(hook.futures.values()))
        finally:            # interrupted: the compiles not started are dropped, not waited for
            pool.shutdown(wait=True, cancel_futures=True)
    report.failed = sum(1 for f in hook.futures.values() if f.exception() is not None)
    report.seconds = time.perf_counter() - start
    return report
