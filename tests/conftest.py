import os

import pytest

# Triton kernels run on the CPU through the interpreter when no GPU is present; the variable
# must be set before any @triton.jit function is created.
try:
    import torch
    _cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".triton-cache"))


def pytest_addoption(parser):
    parser.addoption("--update-goldens", action="store_true", default=False,
                     help="rewrite tests/golden/ from the current graphs (a reviewed change)")


@pytest.fixture
def update_goldens(request):
    return request.config.getoption("--update-goldens")
