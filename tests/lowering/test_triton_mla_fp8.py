"""FP8 latent rows (graph/ops/fp8_layouts.py, uint8 cache) in the Triton MLA kernels against the
reference ops on the same cache: the two-pass sparse kernel and the one-pass dense kernel
dequantise on chip. The reference dequantises to fp32 first; in fp32 both see
the same values, so the tolerances are those of the float cache. Also the FP8 layout's own error
(FP8 cache vs the float rows it was written from) at op level.
CPU: the Triton interpreter at small shapes (and the GPU tile plan at K3.1 widths); CUDA: bf16 at
K3.1 Pro shapes."""
import pytest
import torch

import k31c.graph.ops  # noqa: F401  (registers torch.ops.k31c.*)
from k31c.graph.ops.fp8_layouts import (LATENT_SCALE_GROUP, dequantize_latent_fp8,
                                        latent_fp8_nope, latent_fp8_scales, quantize_latent_fp8)
from k31c.lowering.triton import mla as one_pass_kernels
from k31c.lowering.triton import mla_two_pass as two_pass
from test_triton_mla import DEV, K31, SMALL, assert_close, dense_args, make_case, sparse_args

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="K3.1 Pro shapes run on CUDA")


def fp8_case(c):
    """The case with its latent cache written in the FP8 layout (nope = dv)."""
    cache = c["latent_cache"]
    nb, bs, width = cache.shape
    raw = quantize_latent_fp8(cache.reshape(-1, width).float(), c["dv"])
    return {**c, "latent_cache": raw.view(nb, bs, -1).contiguous()}


def f16_values(raw: torch.Tensor, width: int) -> torch.Tensor:
    """FP8 latent rows -> float32 [..., width], the values the warp-specialized kernels multiply
    (mla_seesaw.dequant_e4m3): e4m3 to f16 (exact), times the scale rounded to f16, the product
    rounded to f16; the rope part as stored."""
    nope = latent_fp8_nope(raw.shape[-1], width)
    ns = latent_fp8_scales(nope)
    values = raw[..., :nope].contiguous().view(torch.float8_e4m3fn).to(torch.float16)
    scales = raw[..., nope:nope + 4 * ns].contiguous().view(torch.float32).to(torch.float16)
    rope = raw[..., nope + 4 * ns:].contiguous().view(torch.bfloat16).float()
    per_value = scales.repeat_interleave(LATENT_SCALE_GROUP, dim=-1)[..., :nope]
    return torch.cat([(values * per_value).float(), rope], dim=-1)


@pytest.mark.parametrize("heads", [8, 5])
@pytest.mark.parametrize("cfg", [None, {"bk": 32, "bk2": 16, "dvc": 64, "bd": 32}])
def test_two_pass_fp8_matches_reference(heads, cfg):
    c = fp8_case(make_case(**{**SMALL, "heads": heads}, device=DEV, dtype=torch.float32, seed=heads + 40))
    want = torch.ops.k31c.sparse_mla(*sparse_args(c))
    assert torch.isinf(want[1][1]).all()
    assert_close(two_pass.launch(*sparse_args(c), config=cfg), want, torch.float32)


@pytest.mark.parametrize("dvc", [None, 256])
def test_two_pass_fp8_gpu_tile_plan_on_k31_widths(dvc):
    """The H200 plan for FP8 rows (64-wide row steps, 128 value columns = one scale group a row;
    or 256, two groups a program) on the 656-byte rows, in fp32 everywhere."""
    c = fp8_case(make_case(**{**K31, "k": 200, "requests": 1, "rows": 2, "max_blocks": 6},
                           device=DEV, dtype=torch.float32, seed=41))
    assert c["latent_cache"].shape[2] == 656
    cfg = two_pass.plan(96, None if dvc is None else {"dvc": dvc}, small=False, fp8=True)
    assert cfg["dvc"] == (dvc or 128) and two_pass.plan(96, None, small=False)["dvc"] == 256
    assert_close(two_pass.launch(*sparse_args(c), config=cfg),
                 torch.ops.k31c.sparse_mla(*sparse_args(c)), torch.float32)


@pytest.mark.parametrize("splits", [None, 3])
def test_one_pass_fp8_dense(splits):
    c = fp8_case(make_case(**SMALL, device=DEV, dtype=torch.float32, seed=42))
    c["row_len"][2] = 0
    cfg = {"splits": splits} if splits else None
    assert_close(one_pass_kernels.launch(*dense_args(c), config=cfg),
                 torch.ops.k31c.dense_mla(*dense_args(c)), torch.float32)


def test_fp8_layout_error_against_the_float_cache():
    """What FP8 latent rows cost at op level: sparse_mla over the FP8 cache vs over the float rows
    it was written from. e4m3 keeps 3 mantissa bits (relative step 2^-3), so single values move
    up to ~6%; attention averages that down (measured here: ~2% of max |out|). The band's lower
    end shows the cache really is quantised."""
    c = make_case(**SMALL, device=DEV, dtype=torch.float32, seed=43)
    c["sm_scale"] = c["q"].shape[2] ** -0.5
    out, lse = torch.ops.k31c.sparse_mla(*sparse_args(c))
    out8, lse8 = torch.ops.k31c.sparse_mla(*sparse_args(fp8_case(c)))
    live = ~torch.isinf(lse)
    rel = ((out8 - out).abs().amax() / out.abs().amax()).item()
    assert 2e-3 < rel < 5e-2, rel
    assert (lse8[live] - lse[live]).abs().max().item() < 0.1


def test_f16_values_error_bounds():
    """This file's oracle for the warp-specialized kernels, `f16_values` (their f16 dequant
    emulated in torch; the kernels' own `mla_seesaw.dequant_e4m3` is checked through the kernel
    tests that compare against it), against the fp32 dequant, on
    rows whose 128-column groups' maxima span 1e-4..1e3: within 2^-10 relative and 2^-25
    absolute (a product below f16's normals) where the scale (max / 448) is an f16 normal,
    plus 448 x 2^-25 (the scale's own rounding) where it is not, as
    mla_seesaw.dequant_e4m3 states."""
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(256, 576, generator=g)
    amax = 10.0 ** (torch.rand(256, 4, generator=g) * 7 - 4)
    rows[:, :512] *= (amax / rows[:, :512].view(256, 4, 128).abs().amax(-1)).repeat_interleave(128, 1)
    raw = quantize_latent_fp8(rows, 512)
    exact = dequantize_latent_fp8(raw, 576)
    got = f16_values(raw, 576)
    err = (got - exact).abs()
    assert torch.equal(got[:, 512:], exact[:, 512:])
    bound = exact.abs() * 2.0 ** -10 * 1.001 + (448 + 1) * 2.0 ** -25
    assert bool((err <= bound).all()), float((err - bound).max())
    normal = (amax / 448 >= 2.0 ** -14).repeat_interleave(128, 1)
    rel = exact[:, :512].abs()[normal] * 2.0 ** -10 * 1.001
    assert bool((err[:, :512][normal] <= rel + 2.0 ** -25).all())
    assert 0 < int(normal.sum()) < normal.numel()


def test_fp8_layout_is_rejected_where_it_does_not_fit():
    c = fp8_case(make_case(**SMALL, device=DEV, dtype=torch.float32, seed=44))
    with pytest.raises(ValueError, match="dv=32"):
        two_pass.launch(*sparse_args({**c, "dv": 32}))
    with pytest.raises(ValueError, match="FP8 latent row"):
        two_pass.launch(*sparse_args({**c, "latent_cache": c["latent_cache"][..., :90]}))


@cuda_only
def test_fp8_k31_shapes_bf16():
    c = fp8_case(make_case(**K31, device="cuda", dtype=torch.bfloat16, seed=45))
    want = torch.ops.k31c.sparse_mla(*sparse_args(c))
    assert_close(two_pass.sparse_mla(*sparse_args(c)), want, torch.bfloat16)
    c = fp8_case(make_case(**{**K31, "max_blocks": 40}, device="cuda", dtype=torch.bfloat16, seed=46))
    assert_close(one_pass_kernels.dense_mla(*dense_args(c)), torch.ops.k31c.dense_mla(*dense_args(c)),
                 torch.bfloat16)
