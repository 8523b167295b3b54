"""The --shard option of tests/conftest.py (scripts/gpu_check.sh splits its runs with it)."""
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_shard import parse_shard

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
