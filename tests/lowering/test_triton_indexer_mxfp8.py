"""MXFP8 index keys (float8_e4m3fn cache: e4m3 + E8M0 scale per 32 values): the Triton scan
(indexer_mxfp8.py, reached through the registered lightning_indexer launcher) against the
reference op, which dequantises the keys and quantises q the same way. Random paged caches (blocks
scattered through the pool, -1 table entries), decode/verify and prefill-like row layouts, keys
and queries over many magnitudes so the groups' exponents differ. The -inf pattern must match
exactly; values to fp32 accumulation order (CPU: exact fp32 dots) or the FP8 tensor cores' (GPU)."""
import pytest
import torch

import k31c.graph.ops  # noqa: F401  (registers torch.ops.k31c.*)
from k31c.graph.ops.cache_write import gather_index_keys
from k31c.graph.ops.fp8_layouts import mx_row_bytes
from k31c.lowering.registry import lookup
from k31c.lowering.triton import indexer as tix
from k31c.lowering.targets import get_target
from k31c.lowering.triton import indexer_topk, indexer_tma
from test_triton_indexer import _block_table

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu_only = pytest.mark.skipif(not CUDA, reason="real K3.1 Pro shapes run on CUDA only")
TOL = 2e-3 if CUDA else 1e-5      # FP8 tensor cores accumulate with fewer than fp32's bits


def _mx_problem(*, heads, d, block_size, row_req, row_len, gen, q_dtype=torch.float32, device=DEVICE):
    n_req = int(row_req.max()) + 1
    used = [0] * n_req
    for b, L in zip(row_req.tolist(), row_len.tolist()):
        used[b] = max(used[b], -(-L // block_size))
    max_blocks = max(used) + 1
    num_blocks = sum(used) + 3
    keys = torch.randn(num_blocks * block_size, d, generator=gen)
    keys = keys * torch.exp2(torch.randint(-6, 6, (num_blocks * block_size, d // 32), generator=gen)
                             .float()).repeat_interleave(32, 1)
    cache = torch.zeros(num_blocks, block_size * mx_row_bytes(d), dtype=torch.float8_e4m3fn)
    torch.ops.k31c.index_cache_write(cache, keys, torch.arange(num_blocks * block_size))
    table = _block_table(n_req, max_blocks, used, num_blocks, gen)
    n = row_req.shape[0]
    q = torch.randn(n, heads, d, generator=gen) * torch.exp2(
        torch.randint(-4, 4, (n, heads, d // 32), generator=gen).float()).repeat_interleave(32, 2)
    weights = torch.randn(n, heads, generator=gen) * (heads * d) ** -0.5
    return (q.to(device, q_dtype), weights.to(device), cache.to(device), table.to(device),
            row_req.to(device), row_len.to(device))


def _check(got, want, tol=TOL):
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)), "the -inf pattern differs"
    scale = want[finite].abs().max().clamp_min(1e-6)
    err = ((got[finite] - want[finite]).abs().max() / scale).item()
    assert err <= tol, f"max rel error {err:.3g}"


def _decode_rows(lengths, r):
    row_req = torch.arange(len(lengths)).repeat_interleave(r).int()
    row_len = torch.tensor([max(0, L - r + 1 + j) for L in lengths for j in range(r)]).int()
    return row_req, row_len


@pytest.mark.parametrize("d,heads", [(32, 4), (64, 3), (128, 4)])
@pytest.mark.parametrize("r", [1, 3])
def test_mxfp8_decode_matches_reference(d, heads, r):
    gen = torch.Generator().manual_seed(d + heads + r)
    row_req, row_len = _decode_rows([37, 5, 64, 1], r)
    args = _mx_problem(heads=heads, d=d, block_size=16, row_req=row_req, row_len=row_len, gen=gen)
    want = torch.ops.k31c.lightning_indexer(*args)
    _check(tix.lightning_indexer(*args), want)
    _check(tix.launch_indexer(*args, splits=3), want)


@pytest.mark.parametrize("d,heads", [(32, 4), (64, 3), (128, 4)])
@pytest.mark.parametrize("r", [1, 3])
def test_mxfp8_tma_matches_reference(d, heads, r):
    """The TMA kernel's MX form: blocks of 32 keys (whole 128-byte rows per block: a TMA box),
    q and keys dequantised to exact 16-bit values on chip, one dot per block."""
    gen = torch.Generator().manual_seed(50 + d + heads + r)
    row_req, row_len = _decode_rows([70, 5, 128, 1], r)
    args = _mx_problem(heads=heads, d=d, block_size=32, row_req=row_req, row_len=row_len, gen=gen)
    assert indexer_tma.tma_supported(args[2], d, 32)
    assert tix.mx_plan(get_target("h200"), row_req.shape[0], heads, d, 4, 256, 32,
                       variant="tma").variant == "tma"
    want = torch.ops.k31c.lightning_indexer(*args)
    _check(tix.launch_indexer(*args, variant="tma"), want)
    _check(tix.launch_indexer(*args, variant="tma", splits=3), want)


def test_mxfp8_variants_and_default():
    """MX_VARIANT is what the registered launcher runs (the TMA form, measured faster); a layout
    the TMA kernel cannot box (16-key blocks of 132-byte rows) plans the gather kernel."""
    t = get_target("h200")
    assert tix.mx_plan(t, 4, 4, 128, 4, 256, 64).variant == tix.MX_VARIANT == "tma"
    assert tix.mx_plan(t, 4, 4, 128, 4, 256, 64, variant="gather").variant == "gather"
    assert tix.mx_plan(t, 4, 4, 128, 4, 256, 16, tma_ok=False, variant="tma").variant == "gather"


def test_mxfp8_prefill_rows_and_registry():
    """Uneven runs of rows per request (tiles spanning requests), a row that sees nothing; the
    registered launchers (lightning_indexer and the indexer + top-k pair) route MXFP8 here."""
    gen = torch.Generator().manual_seed(5)
    row_req = torch.tensor([0] * 5 + [1] * 2 + [2] * 6).int()
    row_len = torch.tensor([1, 2, 3, 4, 5, 30, 31, 0, 10, 11, 12, 13, 14]).int()
    args = _mx_problem(heads=4, d=64, block_size=8, row_req=row_req, row_len=row_len, gen=gen)
    want = torch.ops.k31c.lightning_indexer(*args)
    assert lookup("k31c::lightning_indexer", "h200").fn is tix.lightning_indexer
    _check(tix.lightning_indexer(*args), want)
    picks = indexer_topk.lightning_indexer_topk(*args, 4)
    ref = torch.ops.k31c.lightning_indexer_topk(*args, 4)
    assert torch.equal(picks.sort(1).values, ref.sort(1).values)


def test_mxfp8_reference_quantises_q():
    """The reference's MXFP8 path is not the float one: the same (dequantised) keys in an fp32
    cache, scored with q kept exact, differ by q's e4m3 rounding (~1e-2), far above the kernel
    tolerance."""
    gen = torch.Generator().manual_seed(6)
    row_req, row_len = _decode_rows([40, 20], 2)
    q, w, cache, table, rr, rl = _mx_problem(heads=4, d=64, block_size=16, row_req=row_req,
                                             row_len=row_len, gen=gen, device="cpu")
    keys = gather_index_keys(cache, torch.arange(cache.shape[0], dtype=torch.int32),
                             cache.shape[0] * 16, 16)
    plain = keys.view(cache.shape[0], 16, 64)
    exact = torch.ops.k31c.lightning_indexer(q, w, plain, table, rr, rl)
    got = torch.ops.k31c.lightning_indexer(q, w, cache, table, rr, rl)
    finite = torch.isfinite(got)
    assert torch.equal(finite, torch.isfinite(exact))
    rel = ((got[finite] - exact[finite]).abs().max() / exact[finite].abs().max()).item()
    assert 1e-3 < rel < 0.1, rel


@gpu_only
@pytest.mark.parametrize("r", [1, 4])
def test_mxfp8_k31_shapes(r):
    """K3.1 Pro: 32 heads x 128, block size 64, 16 requests, bf16 q, contexts up to 8K."""
    gen = torch.Generator().manual_seed(40 + r)
    lengths = torch.randint(1, 8192, (16,), generator=gen).tolist()
    row_req, row_len = _decode_rows(lengths, r)
    args = _mx_problem(heads=32, d=128, block_size=64, row_req=row_req, row_len=row_len, gen=gen,
                       q_dtype=torch.bfloat16)
    want = torch.ops.k31c.lightning_indexer(*args)
    _check(tix.lightning_indexer(*args), want)                  # the TMA form, 168-register cap
    _check(tix.launch_indexer(*args, variant="tma", maxnreg=0), want)
    _check(tix.launch_indexer(*args, variant="gather"), want)   # 4 partial FP8 dots a key


def test_pick_change_against_fp32_near_measured():
    """Top-k picks of the 8-bit formats against an fp32 indexer on synthetic indexer-like inputs
    (benchmarks/index_formats.py; 2 requests x 2 rows, 32 heads x 128, 8K keys, k = 2048; the
    reference op). Measured: per-token FP8 keys change 1.5% of the picks, with q quantised per
    (row, head) as the GPU FP8 kernel does 2.0%, MXFP8 keys alone 1.6%, MXFP8 keys and q 2.2%
    (at 16K keys: 1.9, 2.5, 2.1, 2.9%: more candidates near the k-th score).
    (The seed's "about 6%" is on real K3.1 Pro activations at long context.) Power-of-two group
    scales keep e4m3's relative precision, so MXFP8 keys are no closer than per-token FP8 ones
    here; quantising q costs about as much again."""
    from benchmarks.index_formats import indexer_inputs, pick_change
    change = pick_change(indexer_inputs(2, 2, 32, 128, 8192, 64, seed=1), 2048, 64,
                         variants=("fp8", "fp8+q", "mxfp8"))
    assert 0.010 < change["fp8"] < 0.020, change
    assert 0.014 < change["fp8+q"] < 0.026, change
    assert 0.016 < change["mxfp8"] < 0.029, change
    assert change["mxfp8"] > change["fp8"], change
