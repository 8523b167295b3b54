"""Triton attn_res_norm (Block AttnRes' mix + the RMSNorm after it) against a float64 oracle written
here from spec/model.md §3 (interpreter on CPU, compiled on CUDA): bank sizes 1 to 19, with no,
one and two pending addends, widths that are and are not powers of two, fp32 and bf16, strided
rows, no rows, a bank longer than the kernel's pointer arguments (its tail stacked); on CUDA the K3.1 Pro width and batch sizes of a decode step.

Tolerances: fp32 near its accumulation error; bf16: the oracle rounds where the reference rounds
(s, the mix, the normalised row, the product), so what is left is the sums' order moving a value
next to a rounding boundary: an ulp or two of the largest values (2^-8 relative each) on the GPU;
the interpreter's fp32 -> bf16 cast truncates, so each of the four roundings may be an ulp off
there (2^-5)."""
import pytest
import torch

import k31c.graph.ops  # noqa: F401  (registers torch.ops.k31c.*)
from k31c.lowering.registry import lookup
from k31c.lowering.triton import attn_res as ar

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu_only = pytest.mark.skipif(not CUDA, reason="K3.1 widths run on CUDA only")


def _problem(t, d, n_bank, dtype, gen, n_add=1):
    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)
    bank = [rnd(t, d, scale=float(i + 1)) for i in range(n_bank)]   # unlike scales: uneven weights
    return dict(partial=rnd(t, d), addends=[rnd(t, d) for _ in range(n_add)], bank=bank,
                res_norm_weight=(torch.rand(d, generator=gen) + 0.5).to(DEVICE, dtype),
                res_proj_weight=rnd(1, d), norm_weight=(torch.rand(d, generator=gen) + 0.5).to(DEVICE, dtype),
                res_eps=1e-5, norm_eps=1e-6)


def _oracle(p):
    """float64, rounded to the model dtype where spec §3, the model's adds and Kimi's RMSNorm round
    (`r`): s = r(partial + r(a0 + a1)), softmax over <v / rms(v), w_n * w_p> of bank + [s],
    h = r(mix), then r(w * r(h / rms(h)))."""
    dt = p["partial"].dtype

    def r(t):
        return t.to(dt).double()
    adds = [a.double() for a in p["addends"]]
    total = r(adds[0] + adds[1]) if len(adds) == 2 else adds[0] if adds else 0
    s = r(p["partial"].double() + total)
    cands = torch.stack([b.double() for b in p["bank"]] + [s], 1)                      # [T, n+1, D]
    q = p["res_norm_weight"].double() * p["res_proj_weight"].double().reshape(-1)
    logits = (cands / (cands.pow(2).mean(-1, keepdim=True) + p["res_eps"]).sqrt() * q).sum(-1)
    h = r((torch.softmax(logits, 1).unsqueeze(-1) * cands).sum(1))
    x = r(p["norm_weight"].double() * r(h / (h.pow(2).mean(-1, keepdim=True) + p["norm_eps"]).sqrt()))
    return s, x


def _args(p):
    return (p["partial"], p["addends"], p["bank"], p["res_norm_weight"], p["res_proj_weight"],
            p["norm_weight"], p["res_eps"], p["norm_eps"])


def _check(got, p):
    s, x = got
    want_s, want_x = _oracle(p)
    assert s.dtype == x.dtype == p["partial"].dtype and s.shape == x.shape == p["partial"].shape
    tol = 1e-5 if s.dtype == torch.float32 else 2 ** -7 if CUDA else 2 ** -5
    for name, a, b in (("s", s, want_s), ("x", x, want_x)):
        if b.numel():
            err = ((a.double() - b).abs() / b.abs().max()).max().item()
            assert err <= tol, f"{name}: max error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_bank,n_add", [(1, 0), (2, 1), (3, 2), (5, 1), (16, 2), (19, 1)])
@pytest.mark.parametrize("d", [96, 128])
def test_matches_the_oracle(d, n_bank, n_add, dtype):
    gen = torch.Generator().manual_seed(d + n_bank)
    p = _problem(7, d, n_bank, dtype, gen, n_add)
    got = ar.attn_res_norm(*_args(p))
    _check(got, p)
    # the reference op (what a CPU program runs) agrees with the same oracle, and with the kernel
    ref = torch.ops.k31c.attn_res_norm(*_args(p))
    _check(ref, p)
    if dtype == torch.float32:
        torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)


def test_strided_rows_zero_rows_and_the_registry():
    gen = torch.Generator().manual_seed(11)
    p = _problem(6, 64, 3, torch.float32, gen)
    wide = torch.randn(6, 160, generator=gen).to(DEVICE)
    p["bank"][1] = wide[:, 16:80]                       # a row stride of 160 among strides of 64
    p["partial"] = torch.randn(12, 64, generator=gen).to(DEVICE)[::2]
    _check(ar.attn_res_norm(*_args(p)), p)
    empty = _problem(0, 64, 2, torch.float32, gen)
    s, x = ar.attn_res_norm(*_args(empty))
    assert s.shape == x.shape == (0, 64)
    assert lookup("k31c::attn_res_norm", "h200").fn is ar.attn_res_norm


def test_bad_arguments_name_the_input():
    gen = torch.Generator().manual_seed(12)
    p = _problem(3, 32, 2, torch.float32, gen)
    with pytest.raises(ValueError, match=r"bank\[1\]"):
        ar.attn_res_norm(p["partial"], p["addends"], [p["bank"][0], p["bank"][1][:, :16]], *_args(p)[3:])
    with pytest.raises(ValueError, match=r"addends\[0\]"):
        ar.attn_res_norm(p["partial"], [p["partial"][:, :8]], *_args(p)[2:])
    with pytest.raises(ValueError, match="at most 2 terms"):
        ar.attn_res_norm(p["partial"], [p["partial"]] * 3, *_args(p)[2:])
    with pytest.raises(ValueError, match="width 16400"):
        q = _problem(2, 16400, 1, torch.float32, gen)
        ar.attn_res_norm(*_args(q))
    with pytest.raises(ValueError, match="norm_weight"):
        ar.attn_res_norm(*_args(p)[:5], p["norm_weight"].double(), 1e-5, 1e-6)


@gpu_only
@pytest.mark.parametrize("batch", [1, 16, 64])
@pytest.mark.parametrize("n_bank", [1, 9])
def test_k31_width_on_the_gpu(batch, n_bank):
    gen = torch.Generator().manual_seed(batch + n_bank)
    p = _problem(batch, 7168, n_bank, torch.bfloat16, gen)
    _check(ar.attn_res_norm(*_args(p)), p)
    p = _problem(batch, 7168, n_bank, torch.bfloat16, gen, n_add=2)
    _check(ar.attn_res_norm(*_args(p)), p)
