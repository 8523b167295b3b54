"""The lowering of k31c::lightning_indexer_topk, the registered scan-then-select pair, vs the
reference op (interpreter on CPU, compiled on CUDA).

Inputs are test_triton_topk's exact-grid index caches (every score exact in fp32, ties abound), so
the selected sets must equal the reference's exactly; top-k's constants are shrunk on every device
so the sampled threshold, the tie scan and the exact fallback run at a few hundred positions, and
each test asserts the path every row took.
"""
import pytest
import torch

import k31c.graph.ops.indexer  # noqa: F401  (registers torch.ops.k31c.*)
from k31c.lowering.registry import lookup
from k31c.lowering.triton import indexer, indexer_topk, topk, topk_plan
from test_triton_topk import _indexer_inputs, _same_sets   # the exact-grid input builder

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


pytestmark = pytest.mark.usefixtures("small_topk_constants")   # tests/lowering/conftest.py


def _run(args, row_len, k):
    args = [a.to(DEVICE) for a in args]
    row_len = row_len.to(DEVICE)
    ref = torch.ops.k31c.lightning_indexer_topk(*args, row_len, k)
    got = indexer_topk.lightning_indexer_topk(*args, row_len, k)
    _same_sets(got, ref)
    return got, args, row_len


@pytest.mark.parametrize("target", ["h200", "mi350x"])
def test_op_lowers_to_the_pair(target):
    kernel = lookup("k31c::lightning_indexer_topk", target)
    assert kernel is not None and kernel.fn is indexer_topk.lightning_indexer_topk
    assert kernel.source == "k31c.lowering.triton.indexer_topk"       # AOT family, golden kernel names
    assert lookup("k31c::lightning_indexer_topk", "cpu") is None     # the CPU runs the reference


@pytest.mark.parametrize("cache_kind, path", [("fp8", "sampled"), (torch.float32, "sampled"),
                                              ("fp8", "fallback")])
def test_matches_reference(cache_kind, path, monkeypatch, topk_paths):
    if path == "fallback":   # a zero sample target puts T above every key: long rows fall back
        monkeypatch.setattr(topk_plan, "TARGET_NUM", 0)
    gen = torch.Generator().manual_seed(14)
    B, R, H, d, block_size, max_blocks, k = 3, 4, 4, 32, 16, 10, 16
    args = _indexer_inputs(gen, B, R, H, d, block_size, max_blocks, torch.float32, cache_kind)
    row_len = torch.tensor([160, 159, 120, 7, 16, 17, 60, 97, 150, 151, 152, 153], dtype=torch.int32)
    got, args, row_len = _run(args, row_len, k)
    assert (got[3, 7:] == -1).all() and (got[3, :7] >= 0).all()     # row_len < k: -1 fill
    long = "sampled" if path == "sampled" else "fallback"
    assert topk_paths() == [long] * 3 + ["direct"] * 2 + ["all"] * 2 + [long] * 5


def test_rows_of_mixed_requests(topk_paths):
    """Rows of several requests in any order, zero-heavy rows and one all-zero row (tie rule)."""
    gen = torch.Generator().manual_seed(15)
    B, H, d, block_size, max_blocks, k = 4, 4, 16, 8, 20, 16
    row_req = torch.tensor([2, 0, 2, 3, 1, 1, 0, 3])
    q, weights, cache, bt, row_req = _indexer_inputs(gen, B, 2, H, d, block_size, max_blocks,
                                                     torch.float16, "fp8", row_req)
    weights[:4] = -weights[:4].abs()
    weights[4] = 0.0
    row_len = torch.tensor([160, 3, 100, 16, 140, 33, 158, 159], dtype=torch.int32)
    _run((q, weights, cache, bt, row_req), row_len, k)
    # the all-zero row: the select scans the ties at T
    assert topk_paths() == ["sampled", "direct", "sampled", "direct", "ties", "all", "sampled", "sampled"]


def test_pair_is_the_two_launchers_and_not_the_reference(monkeypatch):
    """The registered launcher runs indexer.py's scan then topk.py's select on its scores (their
    own launchers, so their tests and tuning apply) and never the reference ops."""
    gen = torch.Generator().manual_seed(16)
    args = [a.to(DEVICE) for a in _indexer_inputs(gen, 2, 2, 4, 16, 8, 12, torch.float32, "fp8")]
    row_len = torch.tensor([96, 95, 40, 90], dtype=torch.int32, device=DEVICE)
    ref = torch.ops.k31c.lightning_indexer_topk(*args, row_len, 8)
    calls = []
    scan, select = indexer.lightning_indexer, topk.topk_select
    monkeypatch.setattr(indexer, "lightning_indexer", lambda *a: calls.append("scan") or scan(*a))
    monkeypatch.setattr(topk, "topk_select", lambda s, n, k: calls.append(("select", s.shape)) or select(s, n, k))

    def refuse(*a, **kw):
        raise AssertionError("the kernel called the reference op")
    for name in ("indexer_scores", "select_topk"):
        monkeypatch.setattr(k31c.graph.ops.indexer, name, refuse)
    got = indexer_topk.lightning_indexer_topk(*args, row_len, 8)
    assert calls == ["scan", ("select", (4, 96))]
    _same_sets(got, ref)


def test_rejects_bad_arguments():
    gen = torch.Generator().manual_seed(17)
    args = [a.to(DEVICE) for a in _indexer_inputs(gen, 2, 2, 4, 16, 8, 4, torch.float32, "fp8")]
    row_len = torch.tensor([30, 31, 20, 32], dtype=torch.int32, device=DEVICE)
    fn = indexer_topk.lightning_indexer_topk
    for k in (0, -3, 2.0):
        with pytest.raises(ValueError, match="k must be"):
            fn(*args, row_len, k)
    with pytest.raises(ValueError, match="row_len"):
        fn(*args, row_len.long(), 4)
    with pytest.raises(ValueError, match="q:"):
        fn(args[0][:, 0], *args[1:], row_len, 4)
    with pytest.raises(ValueError, match="weights"):
        fn(args[0], args[1].double(), *args[2:], row_len, 4)


@pytest.mark.skipif(not CUDA, reason="real K3.1 Pro shapes run on CUDA only")
@pytest.mark.usefixtures("real_topk_constants")
@pytest.mark.parametrize("cache_kind", ["fp8", torch.bfloat16])
def test_real_shapes(cache_kind):
    """16 requests x 4 rows, 32 heads x 128, FP8 (or bf16) keys, block 64, 128K context, k = 2048,
    bf16 q."""
    gen = torch.Generator(device="cuda").manual_seed(18)
    B, R, H, d, block_size, k = 16, 4, 32, 128, 64, 2048
    args = _indexer_inputs(gen, B, R, H, d, block_size, 131072 // block_size, torch.bfloat16, cache_kind)
    row_len = (131072 - 3 + torch.arange(R).repeat(B)).int()
    row_len[4:8] = torch.tensor([100, 2048, 5000, 70000], dtype=torch.int32)
    _run(args, row_len, k)


def test_strided_index_arguments_are_rejected():
    """Lengths, request ids and block tables are read with unit stride: a strided view is refused
    by name instead of being misread."""
    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(4, 300, generator=gen).to(DEVICE)
    lens = torch.tensor([300, 9, 120, 300, 0, 0, 0, 0], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="row_len"):
        topk.topk_select(scores, lens[::2], 16)
    q, w, cache, table, row_req = (a.to(DEVICE) for a in _indexer_inputs(
        torch.Generator().manual_seed(5), 2, 2, 4, 16, 8, 12, torch.float32, "fp8"))
    row_len = torch.tensor([30, 31, 90, 91], dtype=torch.int32, device=DEVICE)
    indexer.launch_indexer(q, w, cache, table, row_req, row_len)          # the packed ones pass
    with pytest.raises(ValueError, match="block_table"):
        indexer.launch_indexer(q, w, cache, table.t().contiguous().t(), row_req, row_len)
    with pytest.raises(ValueError, match="row_len"):
        indexer.launch_indexer(q, w, cache, table, row_req, torch.stack([row_len, row_len], 1)[:, 0])
    with pytest.raises(ValueError, match="row_req"):
        indexer.launch_indexer(q, w, cache, table, torch.stack([row_req, row_req], 1)[:, 0], row_len)
    with pytest.raises(ValueError, match="splits"):
        indexer.launch_indexer(q, w, cache, table, row_req, row_len, splits=0)
