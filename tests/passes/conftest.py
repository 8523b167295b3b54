import os
from pathlib import Path

import pytest

# Inductor's on-disk cache inside the repo (git-ignored): recompiling the same graphs is quick.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[2] / ".inductor-cache"))


@pytest.fixture(scope="session")
def lit():
    """The lit tests' two-layer model (tests/passes/lit_helpers.py), captured once per session."""
    from lit_helpers import LitModel
    return LitModel()
