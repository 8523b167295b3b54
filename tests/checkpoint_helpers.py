"""What the checkpoint tests share, fixtures included (tests/conftest.py's folder is on sys.path,
so a test imports this as `checkpoint_helpers`)."""
from __future__ import annotations

import pytest
import torch

from k31c.checkpoint_save import save_checkpoint
from k31c.config import preset
from k31c.graph.model import K31ForCausalLM


def random_model(seed: int, dtype: str = "float32") -> K31ForCausalLM:
    """The tiny config at the spec's random init (seeded)."""
    model = K31ForCausalLM(preset("tiny").replace(dtype=dtype))
    model.reset_parameters(torch.Generator().manual_seed(seed))
    return model.eval()


def assert_same_weights(a, b):
    """The two models hold the same tensors: names, order, dtypes and values."""
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for n in sa:
        assert sa[n].dtype == sb[n].dtype and torch.equal(sa[n], sb[n]), n


@pytest.fixture(scope="module")
def model():
    return random_model(seed=11)


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    return save_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "tiny")
