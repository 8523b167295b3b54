"""Fixtures shared by the lowering tests."""
import pytest

# 32-key filter tiles and ~64 filter programs: rows of a few hundred keys split into several
# chunks of several tiles each (the filter's loop and its carried tile run)
SMALL_TOPK = dict(CAP=96, SAMPLES=64, SCORE_TILE=32, FILTER_PROGRAMS=64, PLAN_GROUP=4, PLAN_FEW=16)


@pytest.fixture
def small_topk_constants(monkeypatch):
    """Top-k's buffer and sample shrunk, on every device, so that a few hundred
    positions already run the sampled threshold, the refine and the exact fallback, and each
    test's rows take the same paths everywhere. Returns the real values."""
    from k31c.lowering.triton import topk_plan
    real = {name: getattr(topk_plan, name) for name in SMALL_TOPK}
    for name, value in SMALL_TOPK.items():
        monkeypatch.setattr(topk_plan, name, value)
    return real


@pytest.fixture
def real_topk_constants(small_topk_constants, monkeypatch):
    """The real constants back, for the tests at K3.1 Pro shapes (after small_topk_constants)."""
    from k31c.lowering.triton import topk_plan
    for name, value in small_topk_constants.items():
        monkeypatch.setattr(topk_plan, name, value)


@pytest.fixture
def topk_paths(monkeypatch):
    """After a top-k launch, `topk_paths()` is the path each row took (topk_plan.row_paths)."""
    from k31c.lowering.triton import topk
    monkeypatch.setattr(topk, "DEBUG_PATHS", True)
    monkeypatch.setattr(topk, "last_paths", [])
    return lambda: list(topk.last_paths)
