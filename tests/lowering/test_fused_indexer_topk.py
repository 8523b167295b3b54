"""The fused indexer + top-k select (`indexer_topk.fused_indexer_topk`) against the reference op.

On any device its Triton launches (the plan on sampled blocks, the refine that defers whole-row
selects, the select of the marked rows) run on scans done in torch by `TorchScan`, which keeps
indexer_ws's contract: the sampled and gated scans write the reference scores, the filter appends
each key above its row's threshold in a shuffled order (as the warps' atomics would) and counts
past the buffer. On sm_90 the real scans (indexer_ws's Gluon kernels) run too, at real shapes.
"""
import pytest
import torch

import k31c.graph.ops.indexer  # noqa: F401  (registers torch.ops.k31c.*)
from k31c.lowering.triton import indexer_topk, indexer_ws, indexer_ws_filter, topk_plan
from k31c.lowering.triton.gluon_sm90 import why_not_sm90
from test_triton_topk import _indexer_inputs, _same_sets   # the exact-grid input builder

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
SM90 = CUDA and why_not_sm90(torch.device("cuda")) is None


def order_key(x: torch.Tensor) -> torch.Tensor:
    """radix_select.order_key in int64: the float order, -0.0 as +0.0, NaN above +inf."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    key = torch.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    key = torch.where(x == 0, torch.full_like(key, 0x80000000), key)
    return torch.where(x.isnan(), torch.full_like(key, 0xFFFFFFFF), key)


class TorchScan:
    """indexer_ws.launch / launch_filter in torch, on the reference op's scores; records the
    rows each gated launch scored."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.gated_rows: list[list[int]] = []

    def launch(self, q, weights, index_cache, block_table, row_req, row_len, scores, gate=None, pdl=False):
        full = torch.ops.k31c.lightning_indexer(q, weights, index_cache, block_table, row_req, row_len)
        rows = torch.arange(q.shape[0], device=q.device)
        if gate is None:    # past a row's length the scores are no one's to read: poison them
            past = torch.arange(full.shape[1], device=q.device)[None, :] >= row_len[:, None]
            full = full.masked_fill(past, float("nan"))
        else:         # tiles of ROWS rows with a row whose word is the value
            words, stride, offset, value = gate
            marked = words[offset::stride][:q.shape[0]] == value
            tiles = torch.zeros(-(-q.shape[0] // indexer_ws.ROWS), dtype=torch.bool, device=q.device)
            tiles.index_put_((rows // indexer_ws.ROWS,), marked, accumulate=True)
            rows = rows[tiles[rows // indexer_ws.ROWS]]
            self.gated_rows.append(rows.tolist())
        scores[rows] = full[rows]
        return scores

    def launch_filter(self, q, weights, index_cache, block_table, row_req, row_len, capacity, state,
                      ckey, cpos, cap, pdl=False):
        full = torch.ops.k31c.lightning_indexer(q, weights, index_cache, block_table, row_req, row_len)
        assert full.shape[1] == capacity
        st = state.view(-1, topk_plan.ROW_STATE)
        for row in range(q.shape[0]):
            n = int(row_len[row])
            thresh = int(st[row, topk_plan.ST_THRESH.value]) & 0xFFFFFFFF
            pos = torch.nonzero(order_key(full[row, :n]) > thresh).flatten().cpu()
            pos = pos[torch.randperm(len(pos), generator=self.gen)]
            base = int(st[row, topk_plan.ST_CNT.value])
            kept = pos[:max(0, cap - base)].to(q.device)
            slots = row * cap + base + torch.arange(len(kept), device=q.device)
            ckey[slots] = full[row, kept].view(torch.int32)
            cpos[slots] = kept.to(torch.int32)
            st[row, topk_plan.ST_CNT.value] = base + len(pos)


def _run_fused(args, row_len, k, scan):
    args = [a.to(DEVICE) for a in args]
    row_len = row_len.to(DEVICE)
    ref = torch.ops.k31c.lightning_indexer_topk(*args, row_len, k)
    got = indexer_topk.fused_indexer_topk(*args, row_len, k, scan=scan)
    _same_sets(got, ref)
    return got


@pytest.mark.usefixtures("small_topk_constants")
@pytest.mark.parametrize("cache_kind", ["fp8", torch.float32])
def test_fused_select_matches_reference(cache_kind, topk_paths):
    gen = torch.Generator().manual_seed(31)
    B, R, H, d, block_size, max_blocks, k = 3, 4, 4, 32, 16, 10, 16
    args = _indexer_inputs(gen, B, R, H, d, block_size, max_blocks, torch.float32, cache_kind)
    row_len = torch.tensor([160, 159, 120, 7, 16, 17, 60, 97, 150, 151, 152, 153], dtype=torch.int32)
    scan = TorchScan(0)
    got = _run_fused(args, row_len, k, scan)
    assert (got[3, 7:] == -1).all() and (got[3, :7] >= 0).all()     # row_len < k: -1 fill
    assert topk_paths() == ["sampled"] * 3 + ["direct"] * 2 + ["all"] * 2 + ["sampled"] * 5
    assert scan.gated_rows == [[]]          # no row marked: the gated scan scores nothing


@pytest.mark.usefixtures("small_topk_constants")
def test_fused_select_on_short_rows_in_a_long_table(topk_paths):
    """The op chooses by the table's width (a pool's length), not the rows': rows of 60-200 keys
    in a table of 1,024 take the sample stride of 1,024-key rows, so a row's sample is its few
    sampled blocks. The sets are still the reference's, whatever path each row takes."""
    gen = torch.Generator().manual_seed(35)
    B, R, H, d, block_size, max_blocks, k = 3, 4, 4, 32, 16, 64, 16
    args = _indexer_inputs(gen, B, R, H, d, block_size, max_blocks, torch.float32, "fp8")
    assert topk_plan.sample_stride(max_blocks * block_size, block_size) > 1
    row_len = torch.tensor([200, 199, 60, 61, 150, 151, 152, 153, 97, 120, 180, 190], dtype=torch.int32)
    _run_fused(args, row_len, k, TorchScan(3))
    # one sampled block a row (block 0 of 16): the threshold still holds k candidates here
    assert topk_paths() == ["sampled"] * 2 + ["all"] * 2 + ["sampled"] * 8


@pytest.mark.usefixtures("small_topk_constants")
def test_fused_select_marks_rows_for_the_whole_row_select(monkeypatch, topk_paths):
    """Rows with fewer candidates than k (a threshold above every key; an all-zero row, whose
    keys all tie) and rows with more than the buffer holds (a threshold below nearly every key)
    are selected from their whole rows, scored by the gated scan for their tiles only."""
    gen = torch.Generator().manual_seed(32)
    B, R, H, d, block_size, max_blocks, k = 4, 4, 4, 16, 16, 12, 16
    q, weights, cache, bt, row_req = _indexer_inputs(gen, B, R, H, d, block_size, max_blocks,
                                                     torch.float32, "fp8")
    weights[4:8] = 0.0                       # request 1: every score 0
    row_len = torch.full((B * R,), 190, dtype=torch.int32)
    row_len[8:12] = 40                       # request 2: short rows, every key a candidate
    monkeypatch.setattr(topk_plan, "TARGET_NUM", 0)    # request 0 and 3: T above every key
    scan = TorchScan(1)
    _run_fused((q, weights, cache, bt, row_req), row_len, k, scan)
    assert topk_paths() == ["fallback"] * 8 + ["all"] * 4 + ["fallback"] * 4
    assert scan.gated_rows == [[0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15]]
    monkeypatch.setattr(topk_plan, "TARGET_NUM", 1000)  # T below nearly every key: overflow
    scan = TorchScan(2)
    _run_fused((q, weights, cache, bt, row_req), row_len, k, scan)
    assert topk_paths() == ["fallback"] * 8 + ["all"] * 4 + ["fallback"] * 4


@pytest.mark.parametrize("stride", [1, 3, 64])
def test_sample_layout(stride):
    gen = torch.Generator().manual_seed(34)
    table = torch.randint(-1, 5000, (5, 130), generator=gen, dtype=torch.int32).to(DEVICE)
    row_len = torch.randint(0, 130 * 64, (20,), generator=gen, dtype=torch.int32).to(DEVICE)
    got_table, got_len = indexer_topk.sample_layout(table, row_len, 64, stride)
    assert torch.equal(got_table, table[:, ::stride])
    whole = row_len.long() // 64
    assert torch.equal(got_len.long(), (whole + stride - 1) // stride * 64)


def test_sample_stride_samples_about_the_plans_count(real_topk_constants):
    for width in (16 << 10, 128 << 10, 1 << 20):
        stride = topk_plan.sample_stride(width, 64)
        sampled = -(-(width // 64) // stride) * 64
        assert topk_plan.sample_count(width) <= sampled < 2 * topk_plan.sample_count(width)
    assert topk_plan.sample_stride(128 << 10, 64) == 64
    assert topk_plan.sample_stride(1000, 64) == 1           # short rows: every block


@pytest.mark.skipif(not SM90, reason="indexer_ws's scans are sm_90a Gluon kernels")
@pytest.mark.parametrize("context, one_split", [(128 << 10, False), (128 << 10, True), (1 << 20, False)])
def test_fused_select_real_shapes(context, one_split, real_topk_constants, topk_paths, monkeypatch):
    """The fused select with the Gluon scans at K3.1 Pro decode shapes (B = 16, R = 4, 32 heads
    x 128, FP8 keys, k = 2048): the sets of the registered pair; one request's rows all zero
    (every key tied at T) take the whole-row select. one_split: the filter scan on one program
    a request, whose warps' regions fill (~850 candidates a warp and row against REGION = 256),
    so the rest go to the rows' buffers by the atomic path."""
    if one_split:
        monkeypatch.setattr(indexer_ws_filter, "plan_splits", lambda *a: 1)
    from benchmarks.bench_topk import N, IndexPool, pair_inputs
    args = pair_inputs(IndexPool(context), context, torch.Generator(device="cuda").manual_seed(33))
    w, row_len = args[1], args[5]
    w[4:8] = 0.0
    row_len[8:12] = 5000                                       # shorter than the buffer
    assert indexer_topk.fused_why_not(*args, 2048) is None
    got = indexer_topk.fused_indexer_topk(*args, 2048)
    paths = topk_paths()
    from k31c.lowering.triton import indexer, topk
    pair = topk.topk_select(indexer.lightning_indexer(*args), row_len, 2048)
    _same_sets(got, pair)
    assert paths[4:8] == ["fallback"] * 4 and paths[8:12] == ["all"] * 4
    assert paths[:4] + paths[12:] == ["sampled"] * (N - 8)


def check_filter_scan_thresholds() -> None:
    """The filter scan alone (`launch_filter`) against thresholds set by hand, at 16K keys, B16xR4:
    a row's count is its keys whose order key is above T, and where they fit the buffer, its
    buffer holds exactly those (score bits, position). The oracle is torch's order key over the
    plain scan's scores (the same fp32 values: the scans share the block scores). T ranges over
    ordinary keys (a row's 2048th score), the key of +0.0, the key of -0.0's bits (which no score
    has), 0 (every key), the key of +inf and a NaN key (NaNs only) and the all-ones key (none);
    rows of -0.0 (weights -0.0), of NaN (weights NaN) and of +inf and NaN (one head's weight
    +inf) meet them."""
    from benchmarks.bench_topk import N, IndexPool, pair_inputs
    from k31c.lowering.triton import indexer
    ctx, k = 16 << 10, 2048
    q, w, cache, table, row_req, row_len = pair_inputs(IndexPool(ctx), ctx, torch.Generator(
        device="cuda").manual_seed(37))
    w[8:16] = -0.0
    w[16:28] = float("nan")
    w[36:40, 5] = float("inf")
    row_len[4:40] = 6000                                       # every key fits the buffer
    scores = indexer.lightning_indexer(q, w, cache, table, row_req, row_len)
    keys = order_key(scores)
    visible = torch.arange(ctx, device="cuda") < row_len[:, None].long()
    keys = torch.where(visible, keys, -1)
    t = keys.sort(1, descending=True).values[:, k - 1].clone()   # ordinary: 2047 above
    INF, NEG0, ONES = 0xFF800000, 0x7FFFFFFF, 0xFFFFFFFF
    for rows, key in [((4, 12), NEG0), ((12, 16), 0x80000000), ((16, 20), INF),
                      ((20, 24), INF + 1), ((24, 32), ONES), ((32, 36), 0), ((36, 40), INF)]:
        t[rows[0]:rows[1]] = key
    p = topk_plan.plan(N, ctx, k, torch.cuda.get_device_properties(0).multi_processor_count)
    ws = p.workspace(q.device, filter_slots=False)
    state = ws["state"].view(N, topk_plan.ROW_STATE)
    state[:, topk_plan.ST_THRESH.value] = ((t + (1 << 31)) % (1 << 32) - (1 << 31)).int()  # the bits
    state[:, topk_plan.ST_CNT.value] = 0
    indexer_ws_filter.launch_filter(q, w, cache, table, row_req, row_len, ctx, ws["state"],
                                    ws["ckey"], ws["cpos"], p.cap)
    above = visible & (keys > t[:, None])
    count = state[:, topk_plan.ST_CNT.value].long()
    assert torch.equal(count, above.sum(1)), (count.tolist(), above.sum(1).tolist())
    assert (count[8:12] == 6000).all() and (count[12:16] == 0).all() and (count[16:24] == 6000).all()
    assert (count[24:32] == 0).all() and (count[36:40] > 0).all()
    bits = scores.contiguous().view(torch.int32)
    for row in range(N):
        n = int(count[row])
        if n > p.cap:
            continue
        pos = ws["cpos"].view(N, p.cap)[row, :n].long()
        got = torch.stack([pos, ws["ckey"].view(N, p.cap)[row, :n].long()], 1)
        want_pos = above[row].nonzero().flatten()
        want = torch.stack([want_pos, bits[row, want_pos].long()], 1)
        assert torch.equal(got[got[:, 0].argsort()], want), f"row {row}, T = {int(t[row]):#x}"


@pytest.mark.skipif(not SM90, reason="indexer_ws's scans are sm_90a Gluon kernels")
@pytest.mark.parametrize("one_split", [False, True])
def test_filter_scan_keeps_the_keys_above_each_rows_threshold(one_split, monkeypatch):
    """one_split: one program a request, whose warps' regions overflow into the rows' buffers."""
    if one_split:
        monkeypatch.setattr(indexer_ws_filter, "plan_splits", lambda *a: 1)
    check_filter_scan_thresholds()


@pytest.mark.skipif(not SM90, reason="indexer_ws's scans are sm_90a Gluon kernels")
def test_fused_select_equals_the_reference_op_at_real_shapes(real_topk_constants, topk_paths):
    """The fused select with the Gluon scans against the reference op (not the registered pair,
    whose scan and select kernels the fused select shares) at 128K, B = 16, R = 4, 32 heads x
    128, FP8 keys, k = 2048: exact-grid inputs, so every score is exact in fp32 and the sets
    must be the reference's under its tie rule (ties abound). 1M is compared with the pair
    above: its exact-grid cache does not fit."""
    gen = torch.Generator(device="cuda").manual_seed(35)
    B, R, H, d, block_size, k, context = 16, 4, 32, 128, 64, 2048, 128 << 10
    args = _indexer_inputs(gen, B, R, H, d, block_size, context // block_size, torch.bfloat16, "fp8")
    row_len = (context - 3 + torch.arange(R, device="cuda").repeat(B)).int()
    row_len[4:8] = torch.tensor([100, 2048, 5000, 70000], dtype=torch.int32)
    assert indexer_topk.fused_why_not(*args, row_len, k) is None
    _same_sets(indexer_topk.fused_indexer_topk(*args, row_len, k),
               torch.ops.k31c.lightning_indexer_topk(*args, row_len, k))
    paths = topk_paths()
    assert paths[4:6] == ["direct"] * 2 and paths[6] == "all", paths[4:8]


def test_the_op_takes_the_fused_select_only_where_switched_on_and_able(monkeypatch):
    """`lightning_indexer_topk` runs the pair while FUSED_FROM is None or above the rows' keys,
    or `fused_why_not` names a reason (on the CPU: not sm_90a); the fused select otherwise."""
    gen = torch.Generator().manual_seed(35)
    args = [a.to(DEVICE) for a in _indexer_inputs(gen, 2, 4, 4, 16, 16, 6, torch.float32, "fp8")]
    row_len = torch.tensor([90, 91, 92, 93, 40, 41, 42, 43], dtype=torch.int32, device=DEVICE)
    fused = []
    monkeypatch.setattr(indexer_topk, "fused_indexer_topk", lambda *a: fused.append(a) or "fused")
    pair = indexer_topk.lightning_indexer_topk(*args, row_len, 8)
    assert not fused and pair.shape == (8, 8)
    monkeypatch.setattr(indexer_topk, "FUSED_FROM", 0)
    reason = indexer_topk.fused_why_not(*args, row_len, 8)
    if reason is not None:                      # e.g. the CPU: the pair still runs, not refused
        assert isinstance(reason, str) and reason
        _same_sets(indexer_topk.lightning_indexer_topk(*args, row_len, 8), pair)
        assert not fused
    monkeypatch.setattr(indexer_topk, "fused_why_not", lambda *a: None)
    monkeypatch.setattr(indexer_topk, "FUSED_FROM", 6 * 16 + 1)       # above the table's 96 keys
    _same_sets(indexer_topk.lightning_indexer_topk(*args, row_len, 8), pair)
    assert not fused
    monkeypatch.setattr(indexer_topk, "FUSED_FROM", 6 * 16)
    assert indexer_topk.lightning_indexer_topk(*args, row_len, 8) == "fused" and len(fused) == 1


_AOT_CHECK = """
from k31c.lowering.aot import build_spec, default_shapes, spec_name
from k31c.lowering.triton import indexer_topk
from k31c.lowering.triton.gluon_sm90 import GLUON_ERROR
shapes = default_shapes("h200")
indexer_topk.FUSED_FROM = None
off = {spec_name(s) for s in indexer_topk.aot_specs(shapes)}
indexer_topk.FUSED_FROM = shapes.context + 1            # above the build's context: none listed
assert {spec_name(s) for s in indexer_topk.aot_specs(shapes)} == off
indexer_topk.FUSED_FROM = 0
fused = [s for s in indexer_topk.aot_specs(shapes) if spec_name(s) not in off]
assert indexer_topk.fused_aot_specs(default_shapes("mi350x")) == []
if GLUON_ERROR is None:
    assert sorted(s.kernel.__name__ for s in fused) == [
        "_indexer_ws_filter_kernel", "_indexer_ws_kernel", "_indexer_ws_kernel", "_plan_kernel",
        "_refine_kernel", "_refine_kernel", "_sample_layout_kernel"], fused
    assert all(s.ops == ("k31c::lightning_indexer_topk",) for s in fused)
    for s in fused:
        if s.kernel.__name__ in ("_sample_layout_kernel", "_plan_kernel", "_refine_kernel"):
            assert build_spec(s, "h200").scratch_bytes == 0, spec_name(s)
else:
    assert fused == []
print("ok", len(fused))
"""


def test_the_ahead_of_time_build_lists_the_fused_select_only_where_switched_on():
    """With FUSED_FROM at or below the context, `indexer_topk.aot_specs` adds the fused select's
    seven launches at h200's shapes (none at mi350x's, whose scan is not the warp-specialized
    one); its Triton launches build for sm_90a without spill. In a subprocess: the builds need
    the interpreter off."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", _AOT_CHECK], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("ok ")
