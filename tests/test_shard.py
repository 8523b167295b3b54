"""The --shard option of tests/conftest.py (scripts/gpu_check.sh splits its runs with it)."""
import subprocess
import sys
from pathlib import Path

import pytest

import pytest_shard
from pytest_shard import parse_shard, shards_of

ROOT = Path(__file__).resolve().parent.parent


def _collected(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests/test_config.py", *args], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_shards_partition_the_selection_after_k():
    whole = _collected("-k", "not bad_config")
    shards = [_collected("-k", "not bad_config", "--shard", f"{i}/2") for i in (1, 2)]
    assert len(whole) >= 6
    assert shards == [whole[0::2], whole[1::2]]       # each test once, balanced after -k


@pytest.mark.parametrize("text", ["0/3", "4/3", "1", "a/b", "1/0"])
def test_a_bad_shard_is_a_usage_error(text):
    with pytest.raises(pytest.UsageError, match="--shard"):
        parse_shard(text)


def test_the_slowest_tests_spread_over_the_shards(monkeypatch):
    """Listed slow tests go longest first to the least loaded shard, then the rest: 3 shards of 100
    seconds each (a; b and the five 2-second tests; c and d), where round robin gives a, c, x3
    (162), x1, x2, x4 (6) and b, d, x5 (132)."""
    monkeypatch.setattr(pytest_shard, "SLOW_TESTS", {"a": 100, "b": 90, "c": 60, "d": 40})
    ids = ["a", "x1", "b", "c", "x2", "d", "x3", "x4", "x5"]
    shard = shards_of(ids, 3)
    assert dict(zip(ids, shard)) == {"a": 0, "b": 1, "c": 2, "d": 2, "x1": 1, "x2": 1, "x3": 1, "x4": 1, "x5": 1}
    assert shards_of(["p", "q", "r", "s", "t"], 2) == [0, 1, 0, 1, 0]       # none listed: round robin
