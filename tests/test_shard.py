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


@pytest.mark.parametrize("gib, shards", [(79, 4), (139, 8), (10, 1)])
def test_gpu_check_caps_parallel_shards_at_the_gpu_memory(tmp_path, gib, shards):
    """`gpu_check.sh --parallel 8` runs at most the GPU's GiB / 16 shards, and says so when it
    caps (8 shards ran out of memory on an 80 GB H100). A stand-in python answers the script's
    device probes and runs no tests."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\ncase "$*" in\n'
                    f'  *total_memory*) echo {gib} ;;\n'
                    '  *is_available*) echo "torch stand-in" ;;\n'
                    '  *) echo "1 passed in 0.01s" ;;\nesac\n')
    fake.chmod(0o755)
    out = subprocess.run(["bash", "scripts/gpu_check.sh", "--parallel", "8"], cwd=ROOT, text=True,
                         capture_output=True, env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake),
                                                   "LOGS": str(tmp_path / "logs")})
    assert out.returncode == 0, out.stdout + out.stderr
    ran = [line for line in out.stdout.splitlines() if line.startswith("shard ")]
    assert [line.split(":")[0] for line in ran] == [f"shard {i}/{shards}" for i in range(1, shards + 1)]
    assert ("capped to" in out.stdout) == (shards < 8)
    assert len(list((tmp_path / "logs").iterdir())) == shards
