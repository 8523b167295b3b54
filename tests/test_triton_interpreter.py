"""tests/triton_interpreter.py takes effect on the Triton versions k31c supports (a Triton whose
interpreter changed shape would silently lose the speed-up: this test names it)."""
import os

import pytest
import torch
import triton
import triton.language as tl

import triton_interpreter

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs without a GPU")


@triton.jit
def _twice(x):
    return x + x


@triton.jit
def _kernel(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.program_id(0) * N + tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(y_ptr + i, _twice(_twice(x)) + tl.sqrt(x))


def test_the_interpreter_is_patched_and_runs_jit_helpers():
    from triton.runtime import interpreter as ti
    assert os.environ.get("TRITON_INTERPRET") == "1" and triton_interpreter.install()
    if os.environ.get("K31C_INTERPRETER_OVERFLOW_CHECKS") != "1":
        assert not ti.interpreter_builder.options.sanitize_overflow
    x = torch.rand(32, generator=torch.Generator().manual_seed(0))
    y = torch.empty_like(x)
    _kernel[(2,)](x, y, N=16)
    torch.testing.assert_close(y, 4 * x + x.sqrt())
    assert tl.core.is_builtin(tl.sqrt)          # the launch's patch of triton.language is undone
