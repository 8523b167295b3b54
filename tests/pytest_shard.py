"""The --shard I/N option's argument (tests/conftest.py)."""
import pytest


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N) with 1 <= I <= N; a clear error otherwise."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard: expected I/N such as 2/3, got {text!r}") from None
    if not 1 <= i <= n:
        raise pytest.UsageError(f"--shard: expected 1 <= I <= N, got {text!r}")
    return i, n
