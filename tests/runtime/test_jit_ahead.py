"""prebuild's compile ahead (runtime/jit_ahead.py) without a GPU: the dry run's hook (launches
skipped, one compile per specialisation on the pool, in the launch's context, other modules'
kernels and the pool's own warm-ups let through), its report, and the JIT caches swapped for the
dry run and merged back (in a subprocess: Triton's JIT, not the interpreter). The whole path on
a GPU is tests/runtime/test_gpu_compile_cache.py::test_prebuild_compiles_ahead_on_threads."""
import contextvars
import os
import subprocess
import sys
import threading
from collections import defaultdict
from types import SimpleNamespace

import pytest

from k31c.errors import UsageError
from k31c.runtime.jit_ahead import _SplitCaches, compile_ahead

MARK = contextvars.ContextVar("mark", default=None)


class FakeJit:
    """Records what `preload` was given, on which thread, and the context it ran in; its device
    caches are a JIT function's (a defaultdict of binder tuples)."""
    __name__ = "fake_kernel"

    def __init__(self, fail=()):
        self.calls, self.fail = [], set(fail)
        self.device_caches = defaultdict(self.create_binder)

    @staticmethod
    def create_binder():
        return {}, {}, None, None, None

    def preload(self, data):
        self.calls.append((data, threading.current_thread().name, MARK.get()))
        if data in self.fail:
            raise RuntimeError(f"cannot compile {data}")


def launch(jit, key, module="k31c.lowering.triton.topk", warmup=False):
    """What Triton's JIT does at a launch that misses its cache: ask the hook (True: skip)."""
    from triton import knobs
    return knobs.runtime.jit_cache_hook(key=key, repr="k", fn=SimpleNamespace(module=module, name="k", jit_function=jit),
                                        compile={"key": key, "specialization_data": f"data-{key}"},
                                        is_manual_warmup=warmup, already_compiled=False)


def test_the_dry_run_skips_launches_and_compiles_each_specialisation_once_on_the_pool():
    jit, other = FakeJit(), FakeJit()
    answers = []

    own = jit.device_caches

    def run():
        MARK.set("store-a")                 # as the executor's kernel store is set around a launch
        answers.extend([launch(jit, "s1"), launch(jit, "s1"), launch(jit, "s2"),
                        launch(other, "s1", module="fla.ops.kda"), launch(jit, "s3", warmup=True)])
        answers.append(isinstance(jit.device_caches, _SplitCaches))   # split at its first launch
    said = []
    report = compile_ahead(run, 2, said.append)
    assert answers.pop() is True and jit.device_caches is own
    assert answers == [True, True, True, None, None]
    assert sorted(d for d, _, _ in jit.calls) == ["data-s1", "data-s2"] and other.calls == []
    assert all(t.startswith("k31c-jit") and mark == "store-a" for _, t, mark in jit.calls)
    assert (report.kernels, report.failed, report.stopped) == (2, 0, None)
    assert said == ["compiling 2 Triton kernels on 2 threads"]
    from triton import knobs
    assert knobs.runtime.jit_cache_hook is None          # the process's hook is back


def test_a_failed_compile_and_a_failed_dry_run_are_reported():
    jit = FakeJit(fail={"data-bad"})

    def run():
        launch(jit, "good")
        launch(jit, "bad")
        raise ValueError("a launcher rejected its input\nsecond line")
    report = compile_ahead(run, 3)
    assert (report.kernels, report.failed) == (2, 1)
    assert report.stopped == "ValueError: a launcher rejected its input"


def test_a_hook_the_process_had_is_asked_first_and_restored():
    from triton import knobs
    seen = []

    def theirs(*, key, **_):
        seen.append(key)
        return key == "theirs"
    jit = FakeJit()
    knobs.runtime.jit_cache_hook = theirs
    try:
        report = compile_ahead(lambda: (launch(jit, "theirs"), launch(jit, "mine")), 1)
        assert knobs.runtime.jit_cache_hook is theirs
    finally:
        knobs.runtime.jit_cache_hook = None
    assert seen[:2] == ["theirs", "mine"] and report.kernels == 1
    assert [d for d, _, _ in jit.calls] == ["data-mine"]


def test_prebuild_rejects_a_bad_jit_workers():
    from k31c import api
    from k31c.runtime.engine import Engine
    from tiny_model import make_model
    model = make_model()
    compiled = api.compile(model, target="cpu", options={"executor": "fx"})
    engine = Engine(compiled, max_requests=1, max_seq_len=32)
    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(UsageError, match="jit_workers"):
            compiled.prebuild(engine, ["decode"], jit_workers=bad)


_SWAP = r"""
import k31c.lowering.triton.topk as topk
from k31c.runtime.jit_ahead import _SplitCaches, _jit_functions, _looking_uncompiled
fns = _jit_functions()
assert len(fns) >= 3, fns
fn = next(f for f in fns if f.__name__ == "_filter_kernel")
mine = fn.device_caches
mine[0] = ({"before": "k0"}, {}, None, None, None)
with _looking_uncompiled():
    split = fn.device_caches
    assert isinstance(split, _SplitCaches) and split.dry == {} and split.compiled == {}
    split.compiled[0] = ({"ahead": "k1"}, {}, None, None, None)     # what the pool compiled
assert fn.device_caches is mine and mine[0][0] == {"before": "k0", "ahead": "k1"}, mine[0][0]
try:
    with _looking_uncompiled():
        raise KeyError("dry run failed")
except KeyError:
    pass
assert fn.device_caches is mine and all(f.device_caches.__class__.__name__ == "defaultdict" for f in fns)
print("ok")
"""


def test_split_caches_keep_the_dry_runs_thread_apart_from_the_pools():
    """The dry run's thread never sees a kernel the pool compiled: its binder tuples are its own
    (so its launches keep missing and are skipped); the pool's threads share theirs."""
    made = []

    def create():
        made.append(({}, {}, None, None, None))
        return made[-1]
    caches = _SplitCaches(create, threading.get_ident())
    seen = {}

    def pool_thread(name):
        seen[name] = caches[0]
        seen[name][0]["k"] = "compiled"
    threads = [threading.Thread(target=pool_thread, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["a"] is seen["b"] and caches.compiled[0][0] == {"k": "compiled"}
    assert caches[0] is caches[0] and caches[0][0] == {} and len(made) == 2


def test_the_jit_caches_are_swapped_for_the_dry_run_and_merged_back():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _SWAP], env={**env, "PYTHONPATH": root},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_an_interrupted_dry_run_drops_the_compiles_not_started():
    import time
    started = []

    class Slow(FakeJit):
        def preload(self, data):
            started.append(data)
            time.sleep(0.2)
    jit = Slow()

    def run():
        for i in range(6):
            launch(jit, f"s{i}")
        raise KeyboardInterrupt
    from triton import knobs
    with pytest.raises(KeyboardInterrupt):
        compile_ahead(run, 1)
    assert len(started) < 6 and knobs.runtime.jit_cache_hook is None


def test_a_dry_run_zeroes_what_the_kernels_return():
    """The executor in a dry run: each kernel step's outputs are zeroed (its launch was skipped:
    an unwritten buffer read as indices by a dense piece would be out of bounds), the dense
    pieces' are what they compute; outside a dry run nothing is touched."""
    import torch
    from k31c.lowering.program import Dense, Kernel, Program, Ref
    from k31c.lowering.targets import get_target
    from k31c.runtime.executor import Executor
    from k31c.runtime.jit_ahead import DRY_RUN

    def topk_like(x):           # what a skipped launch leaves: an allocation nobody wrote
        return torch.full((4,), 12345, dtype=torch.int64), [x + 1.0, x * 0 + 7.0]
    steps = [Kernel("k31c::x", "triton:test", topk_like, 0, (Ref(0),), (1, 2)),
             Dense(0, 0, (0,), (3,))]
    program = Program("decode", "h200", steps, [lambda x: (x * 2.0,)], ["p0"], n_inputs=1, n_slots=4,
                      outputs=(1, 2, 3), dense_codegen="fx")
    run = Executor(program, torch.device("cpu"), get_target("h200"))
    x = torch.randn(4)
    idx, pair, dense = run([x])
    assert idx.tolist() == [12345] * 4 and torch.equal(pair[0], x + 1.0) and torch.equal(dense, x * 2.0)
    token = DRY_RUN.set(True)
    try:
        idx, pair, dense = run([x])
    finally:
        DRY_RUN.reset(token)
    assert idx.tolist() == [0] * 4 and all(torch.count_nonzero(t) == 0 for t in pair)
    assert torch.equal(dense, x * 2.0)
