"""Triton lightning indexer vs the reference op torch.ops.k31c.lightning_indexer.

Inputs are random paged caches (blocks scattered through the pool, unused table entries -1),
decode/verify layouts (B x R rows with increasing lengths) and prefill-like layouts (uneven runs
of rows per request, tiles spanning requests). The -inf pattern must match exactly. Both kernels
run: "gather" (indexer.py) and "tma" (indexer_tma.py, one cache block per step).
"""
import dataclasses

import pytest
import torch

import k31c.graph.ops.indexer  # noqa: F401  (registers torch.ops.k31c.*)
from k31c.graph.ops.cache_write import index_row_bytes, quantize_index_fp8, dequantize_index_fp8
from k31c.lowering.triton import indexer as tix
from k31c.lowering.triton import claim_counters, indexer_tma, indexer_ws
from k31c.lowering.triton.device import target_of, using_target

VARIANTS = ["gather", "tma"]

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu_only = pytest.mark.skipif(not CUDA, reason="real K3.1 Pro shapes run on CUDA only")
# FP8 tensor cores accumulate e4m3 products with fewer than fp32's bits (~14, truncated), and
# the GPU's head_dot path rounds ReLU(logits) and the weights to bf16
FP8_TOL = 2e-3 if CUDA else 1e-5
HEAD_DOT_TOL = 1e-2 if CUDA else 1e-5


def _cache(kind: str, num_blocks: int, block_size: int, d: int, gen, device) -> torch.Tensor:
    keys = torch.randn(num_blocks * block_size, d, generator=gen)
    slots = torch.arange(num_blocks * block_size)
    if kind == "fp8":
        cache = torch.zeros(num_blocks, block_size * index_row_bytes(d), dtype=torch.uint8)
    else:
        cache = torch.zeros(num_blocks, block_size, d, dtype=getattr(torch, kind))
    torch.ops.k31c.index_cache_write(cache, keys, slots)
    return cache.to(device)


def _block_table(n_req: int, max_blocks: int, used: list[int], num_blocks: int, gen) -> torch.Tensor:
    """Each request gets `used[b]` distinct random blocks of the pool; the rest of its row is -1."""
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((n_req, max_blocks), -1, dtype=torch.int32)
    at = 0
    for b, u in enumerate(used):
        table[b, :u] = perm[at: at + u].int()
        at += u
    return table


def _decode_rows(lengths: list[int], r: int):
    """B x R verify rows: row j of request b sees lengths[b] - r + 1 + j keys."""
    row_req = torch.arange(len(lengths)).repeat_interleave(r).int()
    row_len = torch.tensor([max(0, L - r + 1 + j) for L in lengths for j in range(r)]).int()
    return row_req, row_len


def _problem(kind, *, heads, d, block_size, max_blocks, row_req, row_len, gen, q_dtype=torch.float32,
             device=DEVICE):
    n_req = int(row_req.max()) + 1 if row_req.numel() else 1
    used = [0] * n_req
    for b, L in zip(row_req.tolist(), row_len.tolist()):
        used[b] = max(used[b], -(-L // block_size))
    num_blocks = sum(used) + 3
    cache = _cache(kind, num_blocks, block_size, d, gen, device)
    table = _block_table(n_req, max_blocks, used, num_blocks, gen).to(device)
    n = row_req.shape[0]
    q = torch.randn(n, heads, d, generator=gen).to(device, q_dtype)
    weights = torch.randn(n, heads, generator=gen).to(device) * (heads * d) ** -0.5
    return q, weights, cache, table, row_req.to(device), row_len.to(device)


def _dequantised_q(q: torch.Tensor) -> torch.Tensor:
    """q as the FP8 path sees it: e4m3 per (row, head) with one fp32 scale."""
    n, h, d = q.shape
    # on the CPU: torch on CUDA divides by the scalar 448 via its reciprocal (1 ulp off)
    values, scales = quantize_index_fp8(q.float().reshape(n * h, d).cpu())
    return dequantize_index_fp8(values, scales).view(n, h, d).to(q.device)


def _reference(kind: str, q, *rest):
    """The reference op on the q the kernel's dot sees (quantised on the GPU's FP8 path)."""
    if kind == "fp8" and CUDA:
        q = _dequantised_q(q)
    return torch.ops.k31c.lightning_indexer(q, *rest)


def _assert_scores(got: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> None:
    assert got.shape == ref.shape
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), "-inf pattern differs"
    finite = torch.isfinite(ref)
    err = torch.where(finite, (got - ref).abs(), 0.0)
    bad = err > atol + rtol * ref.abs().where(finite, 0.0)
    if bool(bad.any()):
        rows = bad.any(1).nonzero().squeeze(1).tolist()
        raise AssertionError(f"{int(bad.sum())} of {int(finite.sum())} scores off (max error "
                             f"{float(err.max()):.3g}, scores up to {float(ref[finite].abs().max()):.3g}); "
                             f"rows {rows[:20]}, first bad columns {bad.any(0).nonzero()[:5].flatten().tolist()}")


@pytest.fixture
def tma_launches(monkeypatch):
    """Counts the launches that really took the TMA kernel (the launcher may fall back)."""
    calls = []
    real = indexer_tma.launch_indexer_tma

    def counting(*args, **kw):
        calls.append(kw["block_size"])
        return real(*args, **kw)

    monkeypatch.setattr(indexer_tma, "launch_indexer_tma", counting)
    return calls


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", ["float32", "fp8", "bfloat16"])
@pytest.mark.parametrize("splits, head_dot", [(None, False), (3, False), (None, True)])
def test_decode_verify_rows(kind, splits, head_dot, variant, tma_launches):
    gen = torch.Generator().manual_seed(10)
    row_req, row_len = _decode_rows([70, 3, 128, 41], r=4)       # one request shorter than R
    args = _problem(kind, heads=4, d=32, block_size=16, max_blocks=9, row_req=row_req,
                    row_len=row_len, gen=gen)
    ref = _reference(kind, *args)
    got = tix.launch_indexer(*args, splits=splits, head_dot=head_dot, variant=variant)
    assert tma_launches == ([16] if variant == "tma" else [])
    tol = (HEAD_DOT_TOL if head_dot else FP8_TOL) if kind == "fp8" else 1e-5
    if kind == "bfloat16":    # keys rounded to bf16 in the cache (the reference reads the same),
        tol = 1e-5 if not CUDA else 1e-2      # q to bf16 for the GPU's 16-bit dot
    _assert_scores(got, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", ["float32", "fp8"])
@pytest.mark.parametrize("head_dot", [False, True])
def test_prefill_rows_spanning_tiles(kind, head_dot, variant, tma_launches):
    """Uneven runs (5, 1, 6, 2 rows): tiles hold rows of two requests; one request sees 0 keys."""
    gen = torch.Generator().manual_seed(11)
    counts, starts = [5, 1, 6, 2], [40, 0, 90, 7]
    row_req = torch.cat([torch.full((c,), b) for b, c in enumerate(counts)]).int()
    row_len = torch.cat([torch.arange(s + 1, s + c + 1) for s, c in zip(starts, counts)]).int()
    row_len[5] = 0
    args = _problem(kind, heads=4, d=32, block_size=8, max_blocks=13, row_req=row_req,
                    row_len=row_len, gen=gen)
    ref = _reference(kind, *args)
    tol = (HEAD_DOT_TOL if head_dot else FP8_TOL) if kind == "fp8" else 1e-5
    _assert_scores(tix.launch_indexer(*args, head_dot=head_dot, variant=variant), ref, rtol=tol, atol=tol)
    assert tma_launches == ([8] if variant == "tma" else [])


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp8_mixed_lengths_large_blocks(variant, tma_launches):
    """Block size 64 (the model's), d = 128, 8 heads x R = 2: a tile's M = 16 query rows; request
    lengths from 0 to the full capacity, 5 splits (some programs get no block), -inf tails."""
    gen = torch.Generator().manual_seed(16)
    row_req, row_len = _decode_rows([1, 200, 64, 0, 255, 129], r=2)
    args = _problem("fp8", heads=8, d=128, block_size=64, max_blocks=5, row_req=row_req,
                    row_len=row_len, gen=gen)
    ref = _reference("fp8", *args)
    got = tix.launch_indexer(*args, splits=5, variant=variant)
    assert tma_launches == ([64] if variant == "tma" else [])
    _assert_scores(got, ref, rtol=FP8_TOL, atol=FP8_TOL)


def test_tma_falls_back_where_the_layout_does_not_fit(tma_launches):
    """d = 24 (not a power of two): variant="tma" runs the gather kernel."""
    gen = torch.Generator().manual_seed(17)
    row_req, row_len = _decode_rows([9, 30], r=2)
    args = _problem("float32", heads=3, d=24, block_size=4, max_blocks=8, row_req=row_req,
                    row_len=row_len, gen=gen)
    ref = torch.ops.k31c.lightning_indexer(*args)
    _assert_scores(tix.launch_indexer(*args, variant="tma"), ref, rtol=1e-5, atol=1e-5)
    assert tma_launches == []
    with pytest.raises(ValueError, match="variant"):
        tix.launch_indexer(*args, variant="tmaa")


@pytest.mark.parametrize("kind", ["fp8", "bfloat16"])
def test_registered_launcher_runs_the_tma_kernel(kind, tma_launches, monkeypatch):
    """The registered launcher takes the target's default variant (tma on h200 and mi350x; the
    CPU's record names none, so the launcher's own, tma); variant="gather" still runs the gather
    kernel, as does a target record that names it; all agree with the reference."""
    gen = torch.Generator().manual_seed(18)
    row_req, row_len = _decode_rows([45, 100, 7], r=2)
    args = _problem(kind, heads=4, d=32, block_size=16, max_blocks=8, row_req=row_req,
                    row_len=row_len, gen=gen)
    ref = _reference(kind, *args)
    tol = FP8_TOL if kind == "fp8" else (1e-5 if not CUDA else 1e-2)
    _assert_scores(tix.lightning_indexer(*args), ref, rtol=tol, atol=tol)
    assert tma_launches == [16]
    _assert_scores(tix.launch_indexer(*args, variant="gather"), ref, rtol=tol, atol=tol)
    assert tma_launches == [16]
    here = target_of(args[0].device)      # the target record's default variant is the switch
    gather_target = dataclasses.replace(here, default_variants=(("k31c::lightning_indexer", "gather"),))
    with using_target(gather_target):
        _assert_scores(tix.lightning_indexer(*args), ref, rtol=tol, atol=tol)
    assert tma_launches == [16]


def test_fp16_queries_and_odd_sizes():
    """fp16 q, 3 heads, d = 24 (padded on chip), R = 3 rows per request, block size 4."""
    gen = torch.Generator().manual_seed(12)
    row_req, row_len = _decode_rows([9, 30, 17], r=3)
    args = _problem("float32", heads=3, d=24, block_size=4, max_blocks=8, row_req=row_req,
                    row_len=row_len, gen=gen, q_dtype=torch.float16)
    ref = torch.ops.k31c.lightning_indexer(*args)
    _assert_scores(tix.lightning_indexer(*args), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_quantised_q_path(variant):
    """The GPU's FP8-q path (run here with an fp32 dot) equals the reference on dequantised q."""
    gen = torch.Generator().manual_seed(13)
    row_req, row_len = _decode_rows([50, 77], r=2)
    q, w, cache, table, rr, rl = _problem("fp8", heads=8, d=32, block_size=16, max_blocks=5,
                                          row_req=row_req, row_len=row_len, gen=gen)
    ref = torch.ops.k31c.lightning_indexer(_dequantised_q(q), w, cache, table, rr, rl)
    got = tix.launch_indexer(q, w, cache, table, rr, rl, quant_q=True, variant=variant, hw_quant=True)
    _assert_scores(got, ref, rtol=FP8_TOL, atol=FP8_TOL)


def test_bad_arguments_raise():
    gen = torch.Generator().manual_seed(14)
    row_req, row_len = _decode_rows([8], r=1)
    q, w, cache, table, rr, rl = _problem("float32", heads=4, d=32, block_size=8, max_blocks=2,
                                          row_req=row_req, row_len=row_len, gen=gen)
    with pytest.raises(ValueError, match="row_len"):
        tix.lightning_indexer(q, w, cache, table, rr, rl.long())
    with pytest.raises(ValueError, match="weights"):
        tix.lightning_indexer(q, w.double(), cache, table, rr, rl)


@gpu_only
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", ["fp8", "bfloat16"])
@pytest.mark.parametrize("head_dot", [False, True])
def test_real_shape(kind, head_dot, variant):
    """K3.1 Pro indexer: 32 heads x 128, block 64, B = 16 x R = 4 verify rows at ~8K context."""
    gen = torch.Generator().manual_seed(15)
    lengths = torch.randint(1000, 8192, (16,), generator=gen).tolist()
    lengths[3] = 2
    row_req, row_len = _decode_rows(lengths, r=4)
    q, w, cache, table, rr, rl = _problem(kind, heads=32, d=128, block_size=64, max_blocks=130,
                                          row_req=row_req, row_len=row_len, gen=gen,
                                          q_dtype=torch.bfloat16, device="cuda")
    got = tix.launch_indexer(q, w, cache, table, rr, rl, head_dot=head_dot, variant=variant)
    # FP8 path: the reference on the q the tensor cores see; bf16 path: q is already bf16
    q_ref = _dequantised_q(q) if kind == "fp8" else q
    ref = torch.ops.k31c.lightning_indexer(q_ref, w, cache, table, rr, rl)
    if kind == "fp8":   # quantisation and paging alone, with an exact dot: tight
        exact = tix.launch_indexer(q, w, cache, table, rr, rl, exact_dot=True, quant_q=True,
                                   variant=variant, hw_quant=True)
        _assert_scores(exact, ref, rtol=1e-4, atol=1e-4)
    # FP8 accumulation (~14 bits, truncated) over 128 products of magnitude ~160^2 and bf16
    # rounding in head_dot: errors of ~1e-3 of the score scale; a wrong key/row/scale is O(1).
    # bf16 keys without head_dot: exact bf16 products summed in fp32, so only the order of the
    # sums differs from the reference (~1e-6 of the scale); 1e-4 leaves a margin
    scale = float(ref[torch.isfinite(ref)].abs().max())
    loose = kind == "fp8" or head_dot
    tol = (1e-2 if loose else 1e-4) * scale
    _assert_scores(got, ref, rtol=1e-2 if loose else 1e-4, atol=tol)


# ---- the warp-specialized scan (indexer_ws.py, Gluon, sm_90a) ---------------------------------

@pytest.fixture
def ws_launches(monkeypatch):
    """Counts the launches that really took the warp-specialized kernel."""
    calls = []
    real = indexer_ws.launch

    def counting(*args, **kw):
        calls.append(args[0].shape[0])
        return real(*args, **kw)

    monkeypatch.setattr(indexer_ws, "launch", counting)
    return calls


def _ws_problem(row_req, row_len, max_blocks, seed):
    return _problem("fp8", heads=32, d=128, block_size=64, max_blocks=max_blocks, row_req=row_req,
                    row_len=row_len, gen=torch.Generator().manual_seed(seed),
                    q_dtype=torch.bfloat16, device="cuda")


def _assert_fp8_scores(got, q, w, cache, table, rr, rl):
    """Against the reference on the q the tensor cores see; FP8 accumulation errors are ~1e-3
    of the score scale (see test_real_shape), a wrong key, row or scale is O(1)."""
    ref = torch.ops.k31c.lightning_indexer(_dequantised_q(q), w, cache, table, rr, rl)
    scale = float(ref[torch.isfinite(ref)].abs().max())
    _assert_scores(got, ref, rtol=1e-2, atol=1e-2 * scale)


@gpu_only
@pytest.mark.parametrize("splits", [None, 3, 40])
def test_warp_specialized_decode_rows(splits, ws_launches):
    """K3.1 Pro widths, B = 6 x R = 4: lengths from 0 to ~3000 (a request of 2 keys, one of 0),
    capacity past the longest (the -inf tail), splits up to more than a request's blocks (empty
    splits); the registered launcher takes this kernel for the call."""
    lengths = [2900, 2, 0, 700, 64, 1500]
    row_req, row_len = _decode_rows(lengths, r=4)
    args = _ws_problem(row_req, row_len, max_blocks=60, seed=60)
    assert indexer_ws.why_not(args[0], args[1], args[2], args[3], 64) is None
    got = (tix.lightning_indexer(*args) if splits is None
           else tix.launch_indexer(*args, splits=splits, variant="warp_specialized"))
    assert ws_launches == [24]
    _assert_fp8_scores(got, *args)


@gpu_only
def test_warp_specialized_rows_of_several_requests(ws_launches):
    """4 rows a request on average but not in the decode layout: tiles of 4 rows hold rows of up
    to 4 requests, one request's rows in two separate runs of a tile; each row scored against its
    own request's keys and length."""
    row_req = torch.tensor([0, 1, 0, 2, 3, 3, 3, 3, 1, 2, 0, 1, 2, 0, 3, 2]).int()
    row_len = torch.tensor([900, 130, 5, 1200, 64, 65, 3000, 1, 0, 777, 901, 40, 300, 2, 2999, 1199]).int()
    args = _ws_problem(row_req, row_len, max_blocks=50, seed=61)
    got = tix.launch_indexer(*args, variant="warp_specialized", splits=5)
    assert ws_launches == [16]
    _assert_fp8_scores(got, *args)


@gpu_only
@pytest.mark.parametrize("layout", ["several requests a tile", "long decode rows"])
def test_warp_specialized_claims_leave_the_counters_zeroed(layout, ws_launches):
    """A tile's programs claim chunks of its blocks from counters that each launch leaves zeroed
    (`claim_counters`: the tile's last program zeroes them): the same call three times eagerly,
    then captured and replayed three times, gives the first call's scores every time (the output
    NaN-filled before each call, so a block left unclaimed shows), and the counters read zero
    after. Tiles of several requests (a counter a pass), and long rows of many chunks a split."""
    if layout == "several requests a tile":
        row_req = torch.tensor([0, 1, 0, 2, 3, 3, 3, 3, 1, 2, 0, 1, 2, 0, 3, 2]).int()
        row_len = torch.tensor([900, 130, 5, 1200, 64, 65, 3000, 1, 0, 777, 901, 40, 300, 2, 2999,
                                1199]).int()
        args, splits = _ws_problem(row_req, row_len, max_blocks=50, seed=64), 5
    else:
        row_req, row_len = _decode_rows([20000, 3001, 9000], r=4)
        args, splits = _ws_problem(row_req, row_len, max_blocks=320, seed=65), 7
    first = tix.launch_indexer(*args, variant="warp_specialized", splits=splits)
    _assert_fp8_scores(first, *args)
    out = torch.empty_like(first)

    def call():
        out.fill_(float("nan"))
        indexer_ws.launch(*args, out, splits=splits)

    for _ in range(3):
        call()
        assert torch.equal(out, first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)
    tiles = -(-first.shape[0] // indexer_ws.ROWS)
    assert int(claim_counters.counters(first.device, tiles).count_nonzero()) == 0
    assert ws_launches == [first.shape[0]] * 5


def test_warp_specialized_refuses_what_it_cannot_run():
    """Asked for by name, the kernel refuses a call it cannot run with the reason (on the CPU:
    the device; on an H200: the widths and rows a request); the split plan fills the SMs."""
    row_req, row_len = _decode_rows([100, 50], r=4)
    args = _problem("fp8", heads=4, d=32, block_size=16, max_blocks=8, row_req=row_req,
                    row_len=row_len, gen=torch.Generator().manual_seed(62))
    with pytest.raises(ValueError, match="warp_specialized.*(NVIDIA|Gluon|heads)"):
        tix.launch_indexer(*args, variant="warp_specialized")
    assert indexer_ws.plan_splits(64, 131072, 132) == 8          # B = 16 x R = 4: 16 tiles
    assert indexer_ws.plan_splits(4, 131072, 132) == 132         # one request
    assert indexer_ws.plan_splits(64, 1024, 132) == 4            # 16 blocks: 4 a split
    assert indexer_ws.plan_splits(1024, 131072, 132) == 1        # more tiles than SMs
    if CUDA:
        row_req, row_len = _decode_rows([100, 50], r=2)
        q, w, cache, table, rr, rl = _ws_problem(row_req, row_len, max_blocks=4, seed=63)
        assert "4 rows a request" in indexer_ws.why_not(q, w, cache, table, 64)
