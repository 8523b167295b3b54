"""Triton top-k vs the k31c reference op (interpreter on CPU, compiled on CUDA); the scan + select
pair (`lightning_indexer_topk`) is tested in test_triton_indexer_topk.py on this file's inputs.

Sets are compared exactly (the tie rule makes the selected set unique). On every device the
kernel's constants are shrunk (candidate buffer 96, 64 samples) so a few thousand positions
already exercise every path, and each test asserts the path every row took
(topk_plan.row_paths): direct (row_len <= k), all (row_len <= buffer), the sampled threshold, the
tie scan, and the exact selection from the whole row (sample misjudged, or masses of ties at the
threshold).
On CUDA the real constants also run at the real shapes (64 rows, k = 2048, L up to 1M).
"""
import pytest
import torch
import triton
import triton.language as tl

import k31c.graph.ops.indexer  # noqa: F401  (registers torch.ops.k31c.*)
from k31c.graph.ops.cache_write import index_row_bytes
from k31c.lowering.triton import topk, topk_plan
from k31c.lowering.triton.radix_select import (exclusive_scan, order_key, select_kth, select_kth_bracketed,
                                               threshold_by_value)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu_only = pytest.mark.skipif(not CUDA, reason="real K3.1 Pro shapes run on CUDA only")


pytestmark = pytest.mark.usefixtures("small_topk_constants")   # tests/lowering/conftest.py


def _same_sets(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.shape == ref.shape and got.dtype == torch.int32
    bad = (got.sort(1).values != ref.sort(1).values).any(1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:8]} select a different set"


def _check_topk(scores, row_len, k):
    ref = torch.ops.k31c.topk_select(scores, row_len, k)
    _same_sets(topk.topk_select(scores, row_len, k), ref)


def _direct(n):
    return ["direct"] * n


# ---- topk_select --------------------------------------------------------------------------------

def test_topk_random_rows_and_lengths(topk_paths):
    """Rows around k and the buffer."""
    gen = torch.Generator().manual_seed(0)
    k, width = 16, 1500
    lengths = [0, 1, k - 1, k, k + 1, 95, 97, 700, width, width]   # around k and the buffer (96)
    scores = torch.randn(len(lengths), width, generator=gen) * 3
    _check_topk(scores.to(DEVICE), torch.tensor(lengths, dtype=torch.int32, device=DEVICE), k)
    assert topk_paths() == _direct(4) + ["all"] * 2 + ["sampled"] * 4


def test_topk_many_rows_fresh_inputs(topk_paths):
    """Random widths, lengths and values drawn from a few levels (ties near the k-th) or not."""
    gen = torch.Generator().manual_seed(7)
    k, width = 16, 777
    scores = torch.randn(24, width, generator=gen)
    scores[::3] = torch.randint(-4, 5, (8, width), generator=gen).float() / 2
    row_len = torch.randint(0, width + 1, (24,), generator=gen).int()
    row_len[:4] = width
    _check_topk(scores.to(DEVICE), row_len.to(DEVICE), k)
    paths = topk_paths()
    # the levels rows: the value histogram puts T between two levels in most, the rest tie at T
    ties = {i for i, p in enumerate(paths) if p == "ties"}
    assert ties and ties <= set(range(0, 24, 3)), ties
    assert set(paths) == {"ties", "sampled", "all"}


def test_topk_of_one(topk_paths):
    """k = 1: the JIT passes an integer 1 as a constant, which the selects' loops must take."""
    gen = torch.Generator().manual_seed(11)
    scores = torch.randn(3, 700, generator=gen)
    _check_topk(scores.to(DEVICE), torch.tensor([1, 90, 700], dtype=torch.int32, device=DEVICE), 1)
    assert topk_paths() == ["direct", "all", "sampled"]


@pytest.mark.parametrize("path", ["sampled", "fallback"])
def test_topk_tie_heavy_rows(path, monkeypatch, topk_paths):
    if path == "fallback":   # a zero sample target puts T above every key: all long rows fall back
        monkeypatch.setattr(topk_plan, "TARGET_NUM", 0)
    gen = torch.Generator().manual_seed(1)
    k, width = 16, 2000
    rows = [
        torch.relu(torch.randn(width, generator=gen)) * (torch.rand(width, generator=gen) < 0.004),
        torch.randint(0, 3, (width,), generator=gen).float(),           # ties at the k-th place
        torch.full((width,), 1.5),                                      # all equal
        torch.randint(0, 2, (width,), generator=gen).float() * -0.0,    # +0.0 and -0.0 tie
        torch.relu(torch.randn(width, generator=gen)),                  # ~half exact zeros
        torch.tensor([-torch.inf, 1.0, torch.inf])[torch.randint(0, 3, (width,), generator=gen)],
    ]
    scores = torch.stack(rows)
    row_len = torch.tensor([width, width, 1234, width, 600, width], dtype=torch.int32)
    _check_topk(scores.to(DEVICE), row_len.to(DEVICE), k)
    # sampled: every row but the half-zero one has fewer than k keys above T (the tie scan)
    assert topk_paths() == (["ties"] * 4 + ["sampled", "ties"] if path == "sampled" else ["fallback"] * 6)


def test_topk_ties_in_a_chunks_last_partial_run(topk_paths):
    """The filter reads whole runs of 4 positions and the partial run at a chunk's end apart: a
    row whose ties at the threshold are just enough, two of them in that partial run, must take
    the tie scan (a lost tail tie would send it to the whole-row select)."""
    gen = torch.Generator().manual_seed(3)
    k, width, n = 16, 1300, 1234          # chunks of 32: the one to n ends in the partial run [1232, 1234)
    row = -1.0 - torch.rand(width, generator=gen)
    runs = topk_plan.SAMPLES // topk_plan.RUN
    sampled = [r * n // runs for r in range(runs)]               # first positions of the sampled runs
    # the sample's 3rd key (its rank for 40 expected candidates) among 5 equal ones: T = key(1.0)
    row[sampled[:5]] = 1.0
    row[[1232, 1233]] = 1.0       # 7 ties in all
    above = torch.tensor([30, 60, 90, 120, 200, 250, 350, 400, 500, 550])
    row[above] = 5.0 + torch.arange(10.0)                        # 10 keys above T: need 6 ties
    assert all(not (s <= p < s + topk_plan.RUN) for p in above.tolist() + [1232, 1233] for s in sampled)
    scores = row[None].to(DEVICE)
    row_len = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    _check_topk(scores, row_len, k)
    assert topk_paths() == ["ties"]


def test_topk_nan_and_inf_rows(topk_paths):
    """NaN sits above +inf. The filter compares scores as floats while T is at most the key of
    +inf and as order keys above it (a sample whose T lands among the NaNs): a float compare
    there would take every key (t is a NaN) and send the row to the whole-row select."""
    gen = torch.Generator().manual_seed(4)
    k, width = 16, 2000
    runs = topk_plan.SAMPLES // topk_plan.RUN
    sampled = torch.tensor([r * width // runs for r in range(runs)])
    rows = torch.randn(4, width, generator=gen)
    rows[0, torch.randperm(width, generator=gen)[:5]] = torch.nan      # a few NaNs: candidates above T
    nan_heavy = torch.randperm(width, generator=gen)[:36]
    rows[1, nan_heavy] = torch.nan                                      # 40 NaNs, 4 of them sampled:
    rows[1, sampled[:4]] = torch.nan                                    # T among the NaN keys
    rows[2, torch.rand(width, generator=gen) < 0.3] = torch.inf         # T = key(+inf): ties at inf
    rows[3, torch.rand(width, generator=gen) < 0.3] = -torch.inf
    rows[3, 7] = torch.nan
    row_len = torch.full((4,), width, dtype=torch.int32)
    _check_topk(rows.to(DEVICE), row_len.to(DEVICE), k)
    assert topk_paths() == ["sampled", "sampled", "ties", "sampled"]


def test_topk_sample_misjudged(topk_paths):
    """Large scores only where the sample never looks (too many candidates) or only where it does
    (too few): both rows must still come out exact."""
    gen = torch.Generator().manual_seed(2)
    k, width = 16, 3000
    scores = torch.rand(2, width, generator=gen)
    sampled = torch.zeros(width, dtype=torch.bool)
    n, runs, run = width, topk_plan.SAMPLES // topk_plan.RUN, topk_plan.RUN
    for i in range(runs):
        sampled[i * n // runs: i * n // runs + run] = True
    scores[0, ~sampled] += 10.0
    scores[1, sampled] += 10.0
    row_len = torch.full((2,), width, dtype=torch.int32)
    _check_topk(scores.to(DEVICE), row_len.to(DEVICE), k)
    assert topk_paths() == ["fallback", "fallback"]     # both thresholds were wrong: the whole-row select


def test_topk_rejects_bad_arguments():
    scores = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="row_len"):
        topk.topk_select(scores, torch.tensor([3, 4], device=DEVICE), 8)
    with pytest.raises(ValueError, match="scores"):
        topk.topk_select(scores.half(), torch.tensor([3, 4], dtype=torch.int32, device=DEVICE), 8)



@pytest.mark.usefixtures("real_topk_constants")
@pytest.mark.parametrize("target", ["h200", "mi350x"])
def test_filter_grid_is_one_wave_of_the_targets_sms(target):
    """64 rows of 128K keys: the filter's programs fill each SM of the target once (32 one-warp
    programs an SM) at most once, short of it only by the rounding to whole 256-key tiles."""
    from k31c.lowering.targets import get_target
    sms = get_target(target).sm_count
    p = topk_plan.plan(64, 131072, 2048, sms)
    assert 0.9 * sms * 32 <= 64 * p.n_chunks <= sms * 32 and p.chunk % 256 == 0
    assert p.n_chunks * p.chunk >= 131072 > (p.n_chunks - 1) * p.chunk

@gpu_only
@pytest.mark.usefixtures("real_topk_constants")
@pytest.mark.parametrize("width", [131072, 1048576])
def test_topk_real_shapes(width):
    """64 rows (16 requests x 4 verification rows), k = 2048: random, ReLU-zero-heavy and
    integer-tied rows, full and partial lengths."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    k = 2048
    scores = torch.randn(64, width, device="cuda", generator=gen)
    scores[8:16] = torch.relu(scores[8:16]) * (torch.rand(8, width, device="cuda", generator=gen) < 1e-3)
    scores[16:24] = torch.randint(0, 50, (8, width), device="cuda", generator=gen).float()
    scores[24:32] = torch.relu(scores[24:32])
    row_len = torch.full((64,), width, dtype=torch.int32, device="cuda")
    row_len[1::4] = torch.randint(1, width, (16,), device="cuda", generator=gen).int()
    row_len[2] = k
    row_len[3] = k - 7
    _check_topk(scores, row_len, k)


# ---- index caches for the scan + select pair (test_triton_indexer_topk.py) --------------------

def _exact_fp8_cache(num_blocks, block_size, d, gen):
    """FP8 cache whose keys are small e4m3 values times power-of-two scales, so every score is
    exact in fp32 whatever the summation order (and ties abound)."""
    dev = gen.device
    values = torch.tensor([0, .5, -.5, 1, -1, 1.5, -1.5, 2, -2, 3, -3, 4, -4], device=dev)
    v = values[torch.randint(0, len(values), (num_blocks, block_size, d), generator=gen, device=dev)]
    scales = 2.0 ** torch.randint(-2, 3, (num_blocks, block_size), generator=gen, device=dev).float()
    cache = torch.empty(num_blocks, block_size * index_row_bytes(d), dtype=torch.uint8, device=dev)
    cache[:, : block_size * d] = v.to(torch.float8_e4m3fn).view(torch.uint8).flatten(1)
    cache[:, block_size * d:] = scales.view(torch.uint8).flatten(1)
    return cache, v * scales[..., None]


def _indexer_inputs(gen, B, R, H, d, block_size, max_blocks, q_dtype, cache_kind, row_req=None):
    num_blocks = B * max_blocks + 3
    fp8, keys = _exact_fp8_cache(num_blocks, block_size, d, gen)
    cache = fp8 if cache_kind == "fp8" else keys.to(cache_kind)
    dev = gen.device
    block_table = torch.randperm(num_blocks, generator=gen, device=dev)[: B * max_blocks].view(B, max_blocks)
    n = B * R
    # q on a grid that the GPU kernel's per-(row, head) FP8 quantisation keeps exact: amax 0.875
    # gives the scale 2^-9 and every value lands on e4m3 (0, 128, 256, 384, 448 times it)
    q = torch.randint(-3, 4, (n, H, d), generator=gen, device=dev).float() / 4
    q[:, :, 0] = 0.875
    q = q.to(q_dtype)
    weights = torch.tensor([.5, -1., 2., 1., -.25], device=dev)[torch.randint(0, 5, (n, H), generator=gen,
                                                                              device=dev)]
    if row_req is None:
        row_req = torch.arange(B).repeat_interleave(R)
    return q, weights, cache, block_table.int(), row_req.int().to(dev)


# ---- radix_select.select_kth --------------------------------------------------------------------

@triton.jit
def _select_probe(val_ptr, n, k, lo, out_ptr, few_ptr, N: tl.constexpr, FORM: tl.constexpr):
    offs = tl.arange(0, N)
    live = offs < n
    v = tl.load(val_ptr + offs, mask=live, other=0).to(tl.uint32)
    if FORM == 2:      # the values are the order keys of the floats they hold as bits
        x = v.to(tl.float32, bitcast=True)
        t, krem, exact = select_kth_bracketed(x, order_key(x), live, n, lo, k, few_ptr, 8, False)
    else:
        t, krem, exact = select_kth(v, live, k, 7, FORM == 1)
    tl.store(out_ptr, t.to(tl.int64))
    tl.store(out_ptr + 1, krem.to(tl.int64))
    tl.store(out_ptr + 2, exact.to(tl.int64))


def _float_bits(keys: list[int]) -> list[int]:
    """The fp32 bits whose order key is each key (radix_select.key_float on the host)."""
    return [k ^ 0x80000000 if k >= 0x80000000 else k ^ 0xFFFFFFFF for k in keys]


def _order_keys(bits: list[int]) -> list[int]:
    """radix_select.order_key of fp32 bits, on the host."""
    bits = [b & 0xFFFFFFFF for b in bits]
    x = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    return [0xFFFFFFFF if f != f else 0x80000000 if f == 0 else (b ^ 0xFFFFFFFF if b >= 0x80000000 else b | 0x80000000)
            for f, b in zip(x.tolist(), bits)]


def _select(vals, k, form, lo=0):
    N = triton.next_power_of_2(max(len(vals), 16))
    v = torch.zeros(N, dtype=torch.int64)
    v[:len(vals)] = torch.tensor(vals, dtype=torch.int64)
    out = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    few = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    _select_probe[(1,)](v.to(DEVICE), len(vals), k, lo, out, few, N=N, FORM=form)
    return out.tolist()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")     # the interpreter's inf and NaN scores
@pytest.mark.parametrize("form", [0, 1, 2], ids=["all-bits", "skip-common", "bracketed"])
def test_select_kth_with_and_without_the_common_prefix(form):
    """Exact semantics of select_kth at 32-bit depth: exact → exactly k of the values are >= t;
    else t is the k-th largest value and krem of the values equal to it complete the k. Values
    that share their high bits (the case SKIP_COMMON starts below), all equal, differing only in
    the last bit, and spanning all 32 bits. `select_kth_bracketed` (on the floats whose order keys
    the values are: counting passes, then levels until at most 8 are left, gathered) has the same
    semantics on the keys of its floats, randn scores and their tails too, with a lower bound on
    the keys given or its own minimum."""
    gen = torch.Generator().manual_seed(5)
    rand = lambda n, lo, hi: torch.randint(lo, hi, (n,), generator=gen).tolist()  # noqa: E731
    cases = [rand(50, 0, 2 ** 32), [0xBF800000 + x for x in rand(60, 0, 4096)],
             [0xBF800000 + x for x in rand(40, 0, 3)], [0xC0000000] * 20,
             [0x80000000, 0x80000001] * 9, [0, 0xFFFFFFFF, 5, 5, 7], [0xBF812345],
             [0xBF800000 + x for x in rand(200, 0, 1 << 20)]]
    randn = torch.randn(300, generator=gen)
    cases += [_order_keys(x.view(torch.int32).tolist()) for x in (randn, randn.sort().values[-120:], randn.abs() + 3)]
    # every k of the 40-value cases, 40 randn scores among them: intervals whose exact digit
    # boundary falls below them
    cases.append(_order_keys(torch.randn(40, generator=torch.Generator().manual_seed(35)).view(torch.int32).tolist()))
    every_k = {2, len(cases) - 1}
    for i, vals in enumerate(cases):
        if form == 2:
            bits = _float_bits(vals)
            vals = _order_keys(bits)
        n = len(vals)
        for k in range(1, n + 1) if i in every_k else sorted({1, min(2, n), n // 3 or 1, n // 2 or 1, n}):
            # the bracketed select with a lower bound given (the minimum, or one below), or found
            lo = 0 if k % 2 or form != 2 else min(vals) - (k % 4 == 0)
            t, krem, exact = _select(bits if form == 2 else vals, k, form, lo)
            above = sum(x > t for x in vals)
            if exact:
                assert sum(x >= t for x in vals) == k, (vals[:4], k)
            else:
                assert t == sorted(vals, reverse=True)[k - 1] and above == k - krem, (vals[:4], k)


# ---- radix_select.exclusive_scan -----------------------------------------------------------------

@triton.jit
def _scan_probe(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, exclusive_scan(tl.load(x_ptr + offs)))


@pytest.mark.parametrize("n", [1, 2, 16, 32, 64, 2048, 8192])
def test_exclusive_scan_matches_torch(n):
    """The selects' slot offsets (rows of 32, then the row totals): torch's exclusive cumsum, for
    tensors shorter than a row, one row, and the refine's 8,192 slots; random counts, not 0/1
    masks only."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randint(0, 5, (n,), generator=gen, dtype=torch.int32)
    out = torch.full((n,), -1, dtype=torch.int32, device=DEVICE)
    _scan_probe[(1,)](x.to(DEVICE), out, N=n, num_warps=4 if n < 8192 else 16)
    want = torch.cumsum(x, 0, dtype=torch.int32) - x
    assert torch.equal(out.cpu(), want)


# ---- radix_select.threshold_by_value --------------------------------------------------------------

@triton.jit
def _threshold_probe(x_ptr, rank, out_ptr, N: tl.constexpr):
    p, found = threshold_by_value(tl.load(x_ptr + tl.arange(0, N)), rank, N)
    tl.store(out_ptr, p)
    tl.store(out_ptr + 1, found.to(tl.float32))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")     # the interpreter's inf and NaN samples
def test_threshold_by_value():
    """The plan's threshold: where found, between rank - rank / 8 and rank + rank / 8 of the
    sample lie above it (counted here by torch); found for the score shapes a decode step makes
    at the plan's real samples and rank (2,048 sampled keys at 128K, 16,384 at 1M, whose bins
    are over group maxima; rank 80, and short rows' larger ranks); not found where no value can
    do (a NaN or an inf in the sample, the rank-th among a mass of equal values), which leaves
    the exact select to the plan."""
    gen = torch.Generator().manual_seed(9)
    q, w = torch.randn(32, 16, generator=gen), torch.randn(32, generator=gen)

    def shapes(n):
        return {"randn": torch.randn(n, generator=gen), "uniform": torch.rand(n, generator=gen),
                "exponential": torch.empty(n).exponential_(generator=gen),
                "indexer-like": (torch.relu(torch.randn(n, 16, generator=gen) @ q.T) * w).sum(1),
                "relu": torch.relu(torch.randn(n, generator=gen)),
                "bimodal": torch.cat([torch.randn(n // 2, generator=gen), torch.randn(n // 2, generator=gen) + 4])}
    out = torch.zeros(2, device=DEVICE)

    def threshold(x, rank):
        _threshold_probe[(1,)](x.to(DEVICE), rank, out, N=len(x))
        p, found = out.tolist()
        return p, bool(found)
    for n, ranks in ((2048, (80, 300, 1165)), (16384, (80, 200))):
        for name, x in shapes(n).items():
            for rank in ranks:
                if (name, rank) == ("relu", 1165):
                    continue          # among ~1024 zeros: below
                p, found = threshold(x, rank)
                assert found, (n, name, rank)
                above = int((x.to(DEVICE) > p).sum())
                assert rank - rank // 8 <= above <= rank + rank // 8, (n, name, rank, above)
    n = 2048
    randn, relu = torch.randn(n, generator=gen), torch.relu(torch.randn(n, generator=gen))
    levels = torch.randint(-4, 5, (n,), generator=gen).float()       # ~228 values a level
    for bad in (torch.where(torch.arange(n) == 7, torch.nan, randn), torch.where(torch.arange(n) == 7, torch.inf, randn),
                levels):
        assert not threshold(bad, 80)[1]
    assert not threshold(relu, 1165)[1]      # the 1165th of 2048 is among ~1024 zeros
    assert not threshold(randn, 0)[1]        # no value has about 0 above it in the sense asked
