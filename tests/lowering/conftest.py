"""Fixtures shared by the lowering tests."""
import pytest
import torch


@pytest.fixture
def small_topk_constants(monkeypatch):
    """On the CPU, top-k's buffer, sample and fallback grid shrink so that a few hundred positions
    already run the sampled threshold, the refine and the exact fallback (CUDA keeps the real
    constants at the real shapes)."""
    if not torch.cuda.is_available():
        from k31c.lowering.triton import topk
        monkeypatch.setattr(topk, "CAP", 64)
        monkeypatch.setattr(topk, "SAMPLES", 64)
        monkeypatch.setattr(topk, "FB_PROGRAMS", 4)
