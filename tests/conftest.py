import os
import sys

import pytest

from pytest_shard import parse_shard, shards_of  # tests/ is on sys.path (this file's folder)
from triton_interpreter import install as fast_interpreter

# Triton kernels run on the CPU through the interpreter when no GPU is present; the variable
# must be set before any @triton.jit function is created.
try:
    import torch
    _cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    fast_interpreter()
# Compiled programs stay out of the user's compile cache; tests/test_compile_cache.py gives its own.
os.environ.setdefault("K31C_COMPILE_CACHE", "off")
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".triton-cache"))


def pytest_addoption(parser):
    parser.addoption("--update-goldens", action="store_true", default=False,
                     help="rewrite tests/golden/ from the current graphs (a reviewed change)")
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run every N-th collected test starting at the I-th (1-based), so that "
                          "N commands with I = 1..N run the selection once (scripts/gpu_check.sh)")


@pytest.hookimpl(trylast=True)      # after -k / -m have deselected theirs
def pytest_collection_modifyitems(config, items):
    # The slowest tests first, each to the least loaded shard, the rest round robin over the
    # collected order (pytest_shard.shards_of): neighbours (a module's tests sharing a fixture)
    # land in different shards, which costs a fixture rebuild per shard but balances their time.
    text = config.getoption("--shard")
    if text is None:
        return
    i, n = parse_shard(text)
    shard = shards_of([item.nodeid for item in items], n)
    keep = [item for item, s in zip(items, shard) if s == i - 1]
    config.hook.pytest_deselected(items=[item for item, s in zip(items, shard) if s != i - 1])
    items[:] = keep


def pytest_runtest_logreport(report):
    """With $K31C_FAILURES_AT_ONCE set (scripts/gpu_check.sh), a failure's traceback goes to
    stderr as it happens: a run cut off by a time limit never reaches pytest's summary."""
    if report.failed and os.environ.get("K31C_FAILURES_AT_ONCE"):
        sys.stderr.write(f"\n=== FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n")
        sys.stderr.flush()


@pytest.fixture
def update_goldens(request):
    return request.config.getoption("--update-goldens")
