"""Triton cache writes vs the k31c reference ops (interpreter on CPU, compiled on CUDA).

Every test writes the same random keys/rows into two copies of a random cache, one through the
reference op and one through the Triton launcher, and compares the whole cache, so a write to a
wrong slot or a missed padding row shows up as well as a wrong value.
"""
import pytest
import torch

import k31c.graph.ops.cache_write  # noqa: F401  (registers torch.ops.k31c.*)
from k31c.graph.ops.cache_write import (gather_index_keys, index_row_bytes, quantize_index_fp8)
from k31c.lowering.triton import cache_write as tcw
from k31c.graph.ops.fp8_layouts import latent_fp8_row_bytes, mx_row_bytes

CUDA = torch.cuda.is_available()
DEVICES = ["cuda"] if CUDA else ["cpu"]
gpu_only = pytest.mark.skipif(not CUDA, reason="real K3.1 Pro shapes run on CUDA only")


def _slots(n: int, num_slots: int, gen: torch.Generator, device) -> torch.Tensor:
    """Distinct random slots with a few padding rows (-1)."""
    slots = torch.randperm(num_slots, generator=gen)[:n]
    slots[torch.rand(n, generator=gen) < 0.2] = -1
    return slots.to(device)


def _random_fp8_cache(num_blocks, block_size, d, gen, device):
    """Random bytes, but with valid (finite, positive) scales so the cache can be dequantised."""
    cache = torch.randint(0, 256, (num_blocks, block_size * index_row_bytes(d)), generator=gen,
                          dtype=torch.uint8)
    scales = cache[:, block_size * d:].view(torch.float32)
    scales.copy_(torch.rand(scales.shape, generator=gen) + 0.5)
    values = cache[:, : block_size * d]
    values[(values & 0x7F) == 0x7F] = 0x38                  # e4m3 NaN bytes → 1.0
    return cache.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_cache_write(device, dtype):
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(6, 16, 80, generator=gen).to(device, dtype)
    rows = torch.randn(37, 80, generator=gen).to(device, torch.float32)
    slots = _slots(37, 96, gen, device)
    ref = cache.clone()
    torch.ops.k31c.mla_cache_write(ref, rows, slots)
    tcw.mla_cache_write(cache, rows, slots)
    torch.testing.assert_close(cache, ref, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d, block_size", [(32, 16), (200, 8)])
def test_index_cache_write_fp8_bit_exact(device, d, block_size):
    gen = torch.Generator().manual_seed(2)
    cache = _random_fp8_cache(5, block_size, d, gen, device)
    # keys spanning many binades, so rounding, carries into the exponent and subnormals all occur
    keys = (torch.randn(29, d, generator=gen) * torch.exp(torch.randn(29, 1, generator=gen) * 3)).to(device)
    keys[0, : min(d, 128)] *= 1e-7                          # a group whose amax hits the 1e-4 floor
    keys[1:, ::5] *= 1e-9                                   # values that round to -0 / +0 (0x80 / 0x00)
    slots = _slots(29, 5 * block_size, gen, device)
    cache_before = cache.clone()
    ref = cache.clone()
    torch.ops.k31c.index_cache_write(ref, keys, slots)
    tcw.index_cache_write(cache, keys, slots)
    if device == "cpu":
        assert torch.equal(cache, ref)
    else:
        # PyTorch on CUDA divides by the Python scalar 448 as a multiply by its fp32 reciprocal, so
        # the reference's scales may be 1 ulp off amax/448 (the kernel divides exactly, as on CPU).
        _assert_fp8_close(cache, ref, d, block_size)
        assert torch.equal(cache, _reference_on_cpu(cache_before, keys, slots))


def _reference_on_cpu(cache, keys, slots):
    out = cache.cpu().clone()
    torch.ops.k31c.index_cache_write(out, keys.cpu(), slots.cpu())
    return out.to(cache.device)


def test_e4m3_rounding_matches_torch_on_every_binade():
    """The fp32 → e4m3 rounding helper, checked through the write on a dense sweep of values."""
    d, block_size = 128, 4
    sweep = torch.linspace(-448.0, 448.0, 512 * d).view(512, d)   # amax 448 ⇒ scale exactly 1
    sweep[:, 0] = 448.0
    sweep[::2, 1:] *= 1e-2                                         # subnormal/small range too
    sweep[::2, 0] = 448.0
    device = DEVICES[0]
    cache = torch.zeros(128, block_size * index_row_bytes(d), dtype=torch.uint8, device=device)
    slots = torch.arange(512, device=device)
    tcw.index_cache_write(cache, sweep.to(device), slots)
    got = gather_index_keys(cache, torch.arange(128, dtype=torch.int32, device=device), 512, block_size)
    values, scales = quantize_index_fp8(sweep)
    expected = values.float() * scales
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_index_cache_write_plain(device, cache_dtype):
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(4, 16, 32, generator=gen).to(device, cache_dtype)
    keys = torch.randn(21, 32, generator=gen).to(device)
    slots = _slots(21, 64, gen, device)
    ref = cache.clone()
    torch.ops.k31c.index_cache_write(ref, keys, slots)
    tcw.index_cache_write(cache, keys, slots)
    assert torch.equal(cache, ref)


def _ordinal(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes → integers in value order (adjacent values differ by 1, ±0 both 0)."""
    magnitude = (codes & 0x7F).int()
    return torch.where(codes >= 0x80, -magnitude, magnitude)


def _assert_fp8_close(got: torch.Tensor, ref: torch.Tensor, d: int, block_size: int) -> None:
    """LayerNorm's order of operations differs by ulps, which may move a value across an e4m3
    rounding boundary: e4m3 codes may differ by one step on a few values, scales by fp32 rounding."""
    values = slice(0, block_size * d)
    code_got, code_ref = _ordinal(got[:, values]), _ordinal(ref[:, values])
    assert (code_got - code_ref).abs().max() <= 1
    assert (code_got != code_ref).float().mean() < 0.01
    scales = slice(block_size * d, None)
    torch.testing.assert_close(got[:, scales].view(torch.float32), ref[:, scales].view(torch.float32),
                               rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_index_key_norm_write_fp8(device, in_dtype):
    gen = torch.Generator().manual_seed(4)
    d, block_size = 32, 16
    cache = _random_fp8_cache(4, block_size, d, gen, device)
    k_pre = (torch.randn(40, d, generator=gen) * 3 + 1).to(device, in_dtype)
    w = (torch.rand(d, generator=gen) + 0.5).to(device)
    b = (torch.randn(d, generator=gen) * 0.1).to(device)
    slots = _slots(40, 64, gen, device)
    ref = cache.clone()
    torch.ops.k31c.index_key_norm_write(ref, k_pre, w, b, slots, 1e-6)
    tcw.index_key_norm_write(cache, k_pre, w, b, slots, 1e-6)
    _assert_fp8_close(cache, ref, d, block_size)


@pytest.mark.parametrize("device", DEVICES)
def test_index_key_norm_write_plain(device):
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(4, 16, 32, generator=gen).to(device)
    k_pre = torch.randn(40, 32, generator=gen).to(device)
    w, b = torch.randn(32, generator=gen).to(device), torch.randn(32, generator=gen).to(device)
    slots = _slots(40, 64, gen, device)
    ref = cache.clone()
    torch.ops.k31c.index_key_norm_write(ref, k_pre, w, b, slots, 1e-5)
    tcw.index_key_norm_write(cache, k_pre, w, b, slots, 1e-5)
    torch.testing.assert_close(cache, ref, rtol=1e-5, atol=1e-5)


def _fp8_latent_oracle(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, nope: int) -> None:
    """Naive per-token loop writing the fp8_ds_mla row: e4m3 c_kv, fp32 scales, bf16 rope."""
    flat = cache.view(-1, cache.shape[-1])
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        values, scales = quantize_index_fp8(rows[i, :nope].float().view(1, nope))
        rope = rows[i, nope:].to(torch.bfloat16)
        flat[slot] = torch.cat([values.view(torch.uint8).flatten(), scales.flatten().view(torch.uint8),
                                rope.view(torch.uint8)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nope,rope", [(512, 64), (64, 16), (144, 0)])
def test_mla_cache_write_fp8(device, nope, rope):
    """The FP8 latent layout (uint8 cache): the registered launcher and the reference op against
    a per-token oracle, byte for byte (K3's 656-byte row, the tiny model's, one of 2 scales)."""
    gen = torch.Generator().manual_seed(6)
    row_bytes = latent_fp8_row_bytes(nope, rope)
    cache = torch.randint(0, 256, (3, 4, row_bytes), generator=gen, dtype=torch.uint8).to(device)
    rows = torch.randn(9, nope + rope, generator=gen) * 2
    rows[:, :nope:7] *= 1e-7         # values that round to zero, of either sign: -0 is byte 0x80
    rows = rows.to(device)
    slots = _slots(9, 12, gen, device)
    want = cache.cpu().clone()
    _fp8_latent_oracle(want, rows.cpu(), slots.cpu(), nope)   # on CPU: torch divides by 448 exactly there
    ref = cache.clone()
    torch.ops.k31c.mla_cache_write(ref, rows, slots)
    tcw.mla_cache_write(cache, rows, slots)
    assert torch.equal(cache.cpu(), want)    # the kernel divides exactly (div_rn), as on CPU
    if device == "cpu":
        assert torch.equal(ref, want)
    else:
        _assert_latent_fp8_close(ref.cpu(), want, nope + rope)


def _assert_latent_fp8_close(got: torch.Tensor, want: torch.Tensor, width: int) -> None:
    """PyTorch on CUDA divides by 448 as a multiply by its fp32 reciprocal: a scale may be 1 ulp
    off, and a value one e4m3 step. Rows the write skipped keep their random bytes (NaN codes
    among them) in both, hence equal_nan; the kernel's bytes are checked exactly elsewhere."""
    from k31c.graph.ops.fp8_layouts import dequantize_latent_fp8
    torch.testing.assert_close(dequantize_latent_fp8(got, width), dequantize_latent_fp8(want, width),
                               rtol=2 ** -3, atol=1e-3, equal_nan=True)


def _random_mx_cache(num_blocks, block_size, d, gen, device):
    """Random e4m3 values (no NaN) and E8M0 scale bytes of moderate exponents."""
    raw = torch.randint(0, 256, (num_blocks, block_size * mx_row_bytes(d)), generator=gen,
                        dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x38
    raw[:, block_size * d:] = torch.randint(120, 135, raw[:, block_size * d:].shape, generator=gen,
                                            dtype=torch.uint8)
    return raw.view(torch.float8_e4m3fn).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm", [False, True])
def test_index_write_mxfp8(device, norm):
    """MXFP8 keys (float8_e4m3fn cache): values and E8M0 bytes equal the reference's exactly;
    keys span many magnitudes so groups get different exponents (incl. an all-zero group)."""
    gen = torch.Generator().manual_seed(9)
    d, block_size = 64, 16
    cache = _random_mx_cache(4, block_size, d, gen, device)
    keys = torch.randn(40, d, generator=gen) * torch.exp2(torch.randint(-12, 12, (40, 1), generator=gen).float())
    keys[3, :32] = 0.0
    keys[4:, ::5] *= 1e-9                                   # values that round to -0 / +0 (0x80 / 0x00)
    keys = keys.to(device)
    slots = _slots(40, 64, gen, device)
    ref = cache.clone()
    if norm:
        w = (torch.rand(d, generator=gen) + 0.5).to(device)
        b = (torch.randn(d, generator=gen) * 0.1).to(device)
        torch.ops.k31c.index_key_norm_write(ref, keys, w, b, slots, 1e-6)
        tcw.index_key_norm_write(cache, keys, w, b, slots, 1e-6)
        got, want = (gather_index_keys(c.cpu(), torch.arange(4, dtype=torch.int32), 64, block_size)
                     for c in (cache, ref))
        # the kernel's LayerNorm rounds differently from torch's: a value may land one e4m3 step away
        torch.testing.assert_close(got, want, rtol=2 ** -3, atol=1e-6)
    else:
        torch.ops.k31c.index_cache_write(ref, keys, slots)
        tcw.index_cache_write(cache, keys, slots)
        assert torch.equal(cache.view(torch.uint8).cpu(), ref.view(torch.uint8).cpu())


@gpu_only
@pytest.mark.parametrize("fp8", [True, False])
def test_index_key_norm_write_real_shape(fp8):
    """K3.1 Pro: d = 128, block size 64, bf16 pre-norm keys, a prefill-sized batch of tokens."""
    gen = torch.Generator().manual_seed(7)
    d, block_size, blocks, n = 128, 64, 512, 8192
    if fp8:
        cache = _random_fp8_cache(blocks, block_size, d, gen, "cuda")
    else:
        cache = torch.randn(blocks, block_size, d, generator=gen).to("cuda", torch.bfloat16)
    k_pre = torch.randn(n, d, generator=gen).to("cuda", torch.bfloat16)
    w, b = torch.rand(d, generator=gen).cuda() + 0.5, torch.randn(d, generator=gen).cuda()
    slots = _slots(n, blocks * block_size, gen, "cuda")
    ref = cache.clone()
    torch.ops.k31c.index_key_norm_write(ref, k_pre, w, b, slots, 1e-6)
    tcw.index_key_norm_write(cache, k_pre, w, b, slots, 1e-6)
    if fp8:
        _assert_fp8_close(cache, ref, d, block_size)
    else:
        torch.testing.assert_close(cache, ref, rtol=1e-2, atol=1e-2)


@gpu_only
@pytest.mark.parametrize("fp8", [False, True])
def test_mla_cache_write_real_shape(fp8):
    gen = torch.Generator().manual_seed(8)
    if fp8:
        cache = torch.randint(0, 256, (256, 64, 656), generator=gen, dtype=torch.uint8).cuda()
    else:
        cache = torch.randn(256, 64, 576, generator=gen).to("cuda", torch.bfloat16)
    rows = torch.randn(4096, 576, generator=gen).to("cuda", torch.bfloat16)
    slots = _slots(4096, 256 * 64, gen, "cuda")
    on_cpu = cache.cpu()                     # the reference on CPU divides by 448 exactly
    ref = cache.clone()
    torch.ops.k31c.mla_cache_write(ref, rows, slots)
    tcw.mla_cache_write(cache, rows, slots)
    if fp8:   # the kernel byte for byte (it divides exactly, as test_mla_cache_write_fp8 checks
        # on small rows); the reference on CUDA to the e4m3 step (torch divides by 448 through a
        # reciprocal there)
        torch.ops.k31c.mla_cache_write(on_cpu, rows.cpu(), slots.cpu())
        assert torch.equal(cache.cpu(), on_cpu)
        _assert_latent_fp8_close(ref.cpu(), on_cpu, 576)
    else:
        assert torch.equal(cache, ref)


def test_bad_arguments_raise():
    cache = torch.zeros(2, 16, 32)
    with pytest.raises(ValueError, match="slot_mapping"):
        tcw.index_cache_write(cache, torch.randn(3, 32), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="cache"):
        tcw.mla_cache_write(torch.zeros(2, 64, 16).transpose(1, 2), torch.randn(3, 64),
                            torch.zeros(3, dtype=torch.int64))
