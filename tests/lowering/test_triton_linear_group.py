"""Triton linear_group (the grouped decode GEMV) vs an fp64 oracle (interpreter on CPU, compiled
on CUDA): several weights of odd widths (a zero-width one, one row, widths not multiples of the
tile), more weights than one launch takes, M from 1 to past the GEMV limit (the cuBLAS path),
fp32 and bf16, x with leading dims and a strided x; on CUDA the bench config's decode groups.

Tolerances: fp32 near its accumulation error over K; bf16 one rounding of the output (the kernel
accumulates in fp32 like cuBLAS, so bf16 outputs differ from the oracle by the final rounding:
half an ulp on the GPU, up to one ulp under the interpreter, whose fp32 -> bf16 cast truncates)."""
import subprocess
import sys

import pytest
import torch

import k31c.graph.ops  # noqa: F401  (registers torch.ops.k31c.*)
from k31c.lowering.triton import linear_group as lg

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu_only = pytest.mark.skipif(not CUDA, reason="bench-config widths run on CUDA only")


def _check(x, weights, ys):
    assert len(ys) == len(weights)
    for i, (y, w) in enumerate(zip(ys, weights)):
        # fp64 in slices of 2048 weight rows: a whole [12288, 7168] weight in fp64 is 672 MiB, which
        # the parallel GPU check's shards, sharing one card, could not always find
        want = torch.cat([x.double() @ part.double().t() for part in w.split(2048)], -1)
        assert y.shape == want.shape and y.dtype == x.dtype and y.is_contiguous(), i
        if not want.numel():
            continue
        scale = want.abs().max().item() + 1e-30
        err = (y.double() - want).abs().max().item() / scale
        tol = 2e-6 if x.dtype == torch.float32 else 2 ** -8 if CUDA else 2 ** -7
        assert err <= tol, f"weight {i} [{tuple(w.shape)}]: max error {err:.2e} of the largest output"


# narrow tiles: segments of several column blocks and a K loop with a masked tail at these widths
NARROW = dict(BN=16, BK=32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 16, 40, 65])
def test_random_groups_match_the_oracle(m, dtype):
    gen = torch.Generator().manual_seed(m)
    k = 72
    widths = [40, 0, 1, 17, 33, 5, 9, 16, 3, 50]            # 10 weights: two launches
    weights = [torch.randn(n, k, generator=gen).to(DEVICE, dtype) for n in widths]
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    _check(x, weights, lg.linear_group(x, weights))
    _check(x, weights, lg.launch(x, weights, NARROW))
    # the reference op agrees (what a program on the CPU target runs)
    _check(x, weights, torch.ops.k31c.linear_group(x, weights))


def test_leading_dims_and_a_strided_x():
    gen = torch.Generator().manual_seed(3)
    weights = [torch.randn(n, 48, generator=gen).to(DEVICE) for n in (24, 7)]
    x = torch.randn(2, 3, 96, generator=gen).to(DEVICE)[..., ::2]      # stride 2 in the last dim
    ys = lg.linear_group(x, weights)
    assert [tuple(y.shape) for y in ys] == [(2, 3, 24), (2, 3, 7)]
    _check(x.reshape(6, 48), weights, [y.reshape(6, -1) for y in ys])


def test_bad_arguments_name_the_input():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"weights\[1\]: expected torch.float32 \[N, 8\]"):
        lg.linear_group(x, [torch.randn(3, 8), torch.randn(3, 9)])
    with pytest.raises(ValueError, match=r"weights\[0\]: expected torch.float32"):
        lg.linear_group(x, [torch.randn(3, 8, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="at least one"):
        torch.ops.k31c.linear_group(x, [])


@gpu_only
@pytest.mark.parametrize("m", [1, 16, 64])
def test_bench_config_decode_groups(m):
    """The groups merge_projections makes in the bench config (hidden 7168): a KDA layer's six
    inputs, an MLA layer's three, a MoE's three, the dense MLP's two, and an o_proj alone."""
    gen = torch.Generator().manual_seed(11)
    groups = [[12288, 12288, 12288, 128, 96, 12288], [1536, 576, 12288], [3584, 512, 512], [4096, 4096]]
    for widths, k in [(g, 7168) for g in groups] + [([7168], 12288)]:
        weights = [(torch.randn(n, k, generator=gen) * 0.02).to("cuda", torch.bfloat16) for n in widths]
        x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
        _check(x, weights, lg.linear_group(x, weights))


_FIT_PROBE = """
import torch
from k31c.lowering.aot import build_spec
from k31c.lowering.targets import get_target
from k31c.lowering.triton import linear_group as lg
for m, widths, k in [(5, [4096, 32], 64), (16, [4096, 4096, 128], 7168), (40, [2048, 16], 2048),
                     (1, [8192, 8192], 1536)]:
    for dt in (torch.float32, torch.bfloat16):
        spec = lg.group_spec(get_target("h200"), m, widths, k, dt, "probe")
        assert spec.constexprs["BK"] <= max(16, 1 << (k - 1).bit_length()), (m, widths, k, dt)
        shared = build_spec(spec, "h200").shared
        assert shared <= 227 << 10, (m, widths, k, dt, shared)
print("fits")
"""


def test_the_tiles_fit_an_sm90_program():
    """The launch `plan` picks, compiled for sm_90a (no GPU needed; a subprocess without the
    interpreter), fits a program's shared memory (227 KB) in fp32 as in bf16: fp32 tiles take
    fewer pipeline stages, and BK never passes K rounded up (the tiny model's fp32 group of 5
    rows on 4096 + 32 index-head rows of K = 64 once asked for 288 KB)."""
    from test_aot import _env, ROOT
    out = subprocess.run([sys.executable, "-c", _FIT_PROBE], cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "fits", out.stdout
