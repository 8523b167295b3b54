"""The Gluon sm_90a MLA kernels against the reference ops: the warp-specialized sparse kernel
(mla_sparse_ws.py) and dense kernel (mla_dense_ws.py), their split plans, the calls they decline
and the kernel names the compiler's report gives. Their kernels run on an H200 only (Gluon has
no interpreter); the plans, reasons and names are checked everywhere."""
import pytest
import torch

import k31c.graph.ops  # noqa: F401  (registers torch.ops.k31c.*)
from k31c.lowering.registry import lookup
from k31c.lowering.triton import mla_dense_ws as dws
from k31c.lowering.triton import mla_sparse_half as half
from k31c.lowering.triton import mla_sparse_ws as ws
from test_triton_mla import (CUDA, DEV, K31, assert_close, cuda_only, dense_args, make_case,
                             sparse_args)
from test_triton_mla_fp8 import f16_values, fp8_case


# ---- the warp-specialized sparse kernel (mla_sparse_ws.py, Gluon, sm_90a) ---------------------

@cuda_only
@pytest.mark.parametrize("heads,k,rows,block_size", [
    (96, 2048, 4, 64),      # K3.1 Pro decode (R = 4): a 64-head tile and a 32-head one
    (64, 300, 5, 64),       # one full tile; a tail of 44 keys past the last 64-key step
    (128, 2048, 3, 64),     # two full tiles
    (40, 1000, 5, 64),      # one tile, 24 zero rows
    (96, 700, 4, 16),       # 16-row cache blocks: four blocks in a 64-key step
    (96, 1050, 3, 64),      # the last pair's second 32-key block past k (26 keys left)
])
def test_warp_specialized_sparse_matches_reference(heads, k, rows, block_size):
    """bf16 at K3.1 Pro widths against the reference op: -1 holes, a row with no key (out 0,
    lse +inf), shuffled blocks; every case must take the one-pass kernels, not the two-pass
    fallback: the registered launcher (bf16 rows: the half-release seesaw) and the 32-key
    seesaw's own launch (what bf16 rows in blocks of other sizes run)."""
    c = make_case(**{**K31, "heads": heads, "k": k, "rows": rows, "block_size": block_size,
                     "max_blocks": K31["max_blocks"] * 64 // block_size}, device="cuda",
                  dtype=torch.bfloat16, seed=30 + heads + block_size)
    assert ws.why_two_pass(c["q"], c["latent_cache"], c["indices"], c["dv"]) is None
    assert half.why_not(c["latent_cache"]) is None
    want = torch.ops.k31c.sparse_mla(*sparse_args(c))
    assert_close(ws.sparse_mla(*sparse_args(c)), want, torch.bfloat16)
    assert_close(ws.launch(*sparse_args(c)[:-1]), want, torch.bfloat16)


@cuda_only
@pytest.mark.parametrize("splits", [2, 3, 7])
def test_warp_specialized_sparse_key_splits(splits):
    """Key splits merged by LSE (a one-row decode's plan): 300 keys in splits of 64-key steps;
    at 7 splits the last two have no keys (their partials must carry no weight)."""
    c = make_case(**{**K31, "heads": 96, "k": 300, "requests": 3, "rows": 1}, device="cuda",
                  dtype=torch.bfloat16, seed=40 + splits)
    want = torch.ops.k31c.sparse_mla(*sparse_args(c))
    assert_close(ws.launch(*sparse_args(c)[:-1], splits=splits), want, torch.bfloat16)


@cuda_only
@pytest.mark.parametrize("splits", [2, 3, 7])
def test_half_seesaw_key_splits(splits):
    """The half-release seesaw's key splits, merged by LSE: 300 keys in splits of 128-key
    pairs (at 3 splits the last has 44 keys; at 7 the last four have none: no weight)."""
    c = make_case(**{**K31, "heads": 96, "k": 300, "requests": 3, "rows": 1}, device="cuda",
                  dtype=torch.bfloat16, seed=50 + splits)
    want = torch.ops.k31c.sparse_mla(*sparse_args(c))
    assert_close(half.launch(*sparse_args(c)[:-1], splits=splits), want, torch.bfloat16)


@cuda_only
def test_bf16_rows_in_blocks_of_other_sizes_take_the_32_key_seesaw():
    """48-row cache blocks (not a power of two): the registered launcher runs the 32-key
    seesaw on them, which matches the reference."""
    c = make_case(**{**K31, "heads": 96, "k": 700, "rows": 3, "block_size": 48,
                     "max_blocks": K31["max_blocks"] * 64 // 48 + 1}, device="cuda",
                  dtype=torch.bfloat16, seed=61)
    assert "power of two" in half.why_not(c["latent_cache"])
    assert lookup("k31c::sparse_mla", "h200").name_for(sparse_args(c)) == \
        "triton:k31c.lowering.triton.mla_sparse_ws.sparse_mla"
    assert_close(ws.sparse_mla(*sparse_args(c)), torch.ops.k31c.sparse_mla(*sparse_args(c)),
                 torch.bfloat16)


@cuda_only
@pytest.mark.parametrize("heads,k,rows,block_size,splits", [
    (96, 2048, 4, 64, None),   # K3.1 Pro decode (R = 4)
    (96, 1050, 3, 16, None),   # 16-row blocks; the last pair's second block past k
    (64, 300, 5, 64, None),    # a tail of 44 keys past the last 64-key step
    (96, 300, 1, 64, 3),       # a one-row decode's key splits
])
def test_warp_specialized_sparse_fp8_latent_rows(heads, k, rows, block_size, splits):
    """FP8 latent rows (656 bytes: e4m3, fp32 scales, bf16 rope), dequantised on chip (to f16)
    by the math group that scores each block, against the reference op on the values the kernel
    multiplies (`f16_values`), and on the FP8 cache itself (which it dequantises in fp32): over
    300-2048 keys a row the bf16 tolerance holds for both (a one-key row's lse would not for the
    second: test_warp_specialized_dense_fp8_latent_rows)."""
    c = fp8_case(make_case(**{**K31, "heads": heads, "k": k, "rows": rows, "block_size": block_size,
                              "requests": 3 if splits else K31["requests"],
                              "max_blocks": K31["max_blocks"] * 64 // block_size}, device="cuda",
                           dtype=torch.bfloat16, seed=50 + heads + block_size + rows))
    assert c["latent_cache"].dtype == torch.uint8 and c["latent_cache"].shape[2] == 656
    assert ws.why_two_pass(c["q"], c["latent_cache"], c["indices"], c["dv"]) is None
    seen = f16_values(c["latent_cache"], K31["width"])
    got = ws.launch(*sparse_args(c)[:-1], splits=splits)
    assert_close(got, torch.ops.k31c.sparse_mla(*sparse_args({**c, "latent_cache": seen})),
                 torch.bfloat16)
    assert_close(got, torch.ops.k31c.sparse_mla(*sparse_args(c)), torch.bfloat16)


def test_warp_specialized_sparse_split_plan():
    """One wave: splits fill the SMs the (row, tile) programs leave, at least 4 steps each."""
    assert ws.plan_splits(64, 96, 2048, 132) == 1          # B = 16 x R = 4: 128 programs
    assert ws.plan_splits(16, 96, 2048, 132) == 4          # B = 16 x R = 1: 32 x 4 = 128
    assert ws.plan_splits(1, 96, 2048, 132) == 8           # 32 steps, 4 a split
    assert ws.plan_splits(2, 96, 300, 132) == 1            # 5 steps: one split


def test_half_seesaw_split_plan_and_report_names():
    """The half-release seesaw's plan (one wave, pairs of 128 keys, at least 2 a split) and the
    kernel h200's report names for a call: it for bf16 rows in 64- and 16-row blocks, the 32-key
    seesaw for FP8 rows and 48-row blocks, the two-pass kernel for an fp32 cache."""
    assert half.plan_splits(64, 96, 2048, 132) == 1
    assert half.plan_splits(16, 96, 2048, 132) == 4
    assert half.plan_splits(1, 96, 2048, 132) == 8          # 16 pairs, 2 a split
    assert half.plan_splits(2, 96, 300, 132) == 1           # 3 pairs: one split
    assert half.split_keys(300, 3) == 128
    h200 = lookup("k31c::sparse_mla", "h200")
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, idx = torch.empty(16, 96, 576, **meta), torch.empty(16, 2048, device="meta", dtype=torch.int32)
    table, req = torch.empty(16, 64, device="meta", dtype=torch.int32), torch.empty(16, device="meta", dtype=torch.int32)

    def name(cache):
        return h200.name_for((q, cache, table, req, idx, 0.1, 512))

    assert name(torch.empty(100, 64, 576, **meta)) == "triton:k31c.lowering.triton.mla_sparse_half.sparse_mla"
    assert name(torch.empty(100, 16, 576, **meta)) == "triton:k31c.lowering.triton.mla_sparse_half.sparse_mla"
    seesaw = "triton:k31c.lowering.triton.mla_sparse_ws.sparse_mla"
    assert name(torch.empty(100, 48, 576, **meta)) == seesaw
    assert name(torch.empty(100, 64, 656, device="meta", dtype=torch.uint8)) == seesaw
    assert name(torch.empty(100, 64, 576, device="meta", dtype=torch.float32)) == \
        "triton:k31c.lowering.triton.mla_two_pass.sparse_mla"


def test_warp_specialized_sparse_declines_what_it_cannot_run():
    """The reasons a call goes to the two-pass kernel (checked without a GPU: CPU tensors name
    the device first; on an H200 the shape reasons are checked too)."""
    c = make_case(**{**K31, "k": 64, "requests": 2, "max_blocks": 4}, device=DEV,
                  dtype=torch.bfloat16, seed=31)
    reason = ws.why_two_pass(c["q"], c["latent_cache"], c["indices"], c["dv"])
    if not CUDA:
        assert "NVIDIA" in reason or "Gluon" in reason
        return
    assert reason is None                                     # 8 rows: key splits fill the SMs
    big = make_case(**{**K31, "k": 64}, device="cuda", dtype=torch.bfloat16, seed=32)
    assert ws.why_two_pass(big["q"], big["latent_cache"], big["indices"], 512) is None
    assert "bf16 or FP8" in ws.why_two_pass(big["q"].float(), big["latent_cache"], big["indices"], 512)
    fp8 = fp8_case(big)["latent_cache"]
    assert ws.why_two_pass(big["q"], fp8, big["indices"], 512) is None
    assert "cache row 600" in ws.why_two_pass(big["q"], fp8[..., :600], big["indices"], 512)
    assert "width" in ws.why_two_pass(big["q"], big["latent_cache"], big["indices"], 448)
    assert "strided" in ws.why_two_pass(big["q"], big["latent_cache"][::2], big["indices"], 512)


# ---- the warp-specialized dense kernel (mla_dense_ws.py, Gluon, sm_90a) ----------------------

def dense_ws_case(heads, requests, rows, max_blocks, lens, seed, row_req=None, unwritten=False,
                  unused_blocks=False):
    """A K3.1-width bf16 case on the GPU with the given row lengths (and row_req, default the
    decode layout). unwritten: the cache slots past every row of a request hold NaN (the
    reference reads the clean cache: no row sees them); unused_blocks: the table entries past
    them are -1."""
    c = make_case(**{**K31, "heads": heads, "k": 4, "requests": requests, "rows": rows,
                     "max_blocks": max_blocks}, device="cuda", dtype=torch.bfloat16, seed=seed)
    if row_req is not None:
        c["row_req"] = torch.tensor(row_req, dtype=torch.int32, device="cuda")
    c["row_len"] = torch.tensor(lens, dtype=torch.int32, device="cuda")
    assert c["row_len"].shape == c["row_req"].shape == c["q"].shape[:1]
    clean = dict(c)
    if unwritten or unused_blocks:
        cache, table = c["latent_cache"].clone(), c["block_table"].clone()
        for b in range(requests):
            mine = c["row_len"][c["row_req"] == b]
            longest = int(mine.max()) if mine.numel() else 0
            for p in range(longest, max_blocks * 64):
                if unwritten:
                    cache[table[b, p // 64], p % 64] = float("nan")
            if unused_blocks:
                table[b, -(-longest // 64):] = -1
        c = {**c, "latent_cache": cache, "block_table": table}
        clean = {**clean, "block_table": table}      # the reference never reads past lengths
    return c, torch.ops.k31c.dense_mla(*dense_args(clean))


@cuda_only
@pytest.mark.parametrize("heads,requests,rows,row_req,lens", [
    # decode, one row a request: rows of every length class (empty, one key, block ends)
    (96, 16, 1, None, [0, 1, 63, 64, 65, 2560, 1000, 2000, 7, 128, 129, 2559, 300, 301, 5, 0]),
    (40, 6, 1, None, [0, 1, 64, 2000, 77, 2559]),
    # decode, 4 rows a request (few requests): 2 passes a slab, one empty
    (96, 4, 4, None, [100, 101, 102, 103, 0, 0, 0, 0, 1, 64, 65, 2000, 2560, 2559, 2558, 1]),
    (40, 3, 4, None, [0, 1, 2, 3, 640, 641, 642, 643, 1000, 0, 1500, 64]),
    # rows of 3 requests interleaved (groups of 3 rows: a slab holds rows of 2 requests, of 3
    # at 24 heads)
    (96, 3, 3, [0, 1, 0, 2, 1, 2, 0, 1, 2], [5, 100, 1, 256, 0, 64, 2000, 33, 129]),
    (40, 3, 3, [0, 1, 0, 2, 1, 2, 0, 1, 2], [5, 100, 1, 256, 0, 64, 2000, 33, 129]),
    (24, 3, 3, [0, 1, 2, 2, 1, 0, 1, 0, 2], [5, 100, 1, 256, 0, 64, 2000, 33, 129]),
    # prefill-like: 7 rows of one request (one group of 7 rows, 11 slabs)
    (96, 1, 7, None, [1200, 1201, 1202, 1203, 1204, 1205, 1206]),
])
def test_warp_specialized_dense_matches_reference(heads, requests, rows, row_req, lens):
    """bf16 at K3.1 widths against the reference op: the registered launcher takes these
    calls itself (its kernel, not the split one); its planned splits, and one split."""
    c, want = dense_ws_case(heads, requests, rows, 40, lens, seed=60 + heads + rows,
                            row_req=row_req)
    assert dws.why_split(c["q"], c["latent_cache"], c["block_table"], c["dv"]) is None
    assert torch.isinf(want[1][c["row_len"] == 0]).all()
    assert_close(dws.dense_mla(*dense_args(c)), want, torch.bfloat16)
    assert_close(dws.launch(*dense_args(c)[:-1], splits=1), want, torch.bfloat16)


@cuda_only
@pytest.mark.parametrize("heads,requests,rows,row_req,lens,unwritten", [
    (96, 16, 1, None, [0, 1, 63, 64, 65, 2560, 1000, 2000, 7, 128, 129, 2559, 300, 301, 5, 0], False),
    (96, 4, 4, None, [100, 101, 102, 103, 0, 0, 0, 0, 1, 64, 65, 2000, 2560, 2559, 2558, 1], True),
    (40, 3, 3, [0, 1, 0, 2, 1, 2, 0, 1, 2], [5, 100, 1, 256, 0, 64, 2000, 33, 129], True),
    (96, 1, 7, None, [1200, 1201, 1202, 1203, 1204, 1205, 1206], False),
])
def test_warp_specialized_dense_fp8_latent_rows(heads, requests, rows, row_req, lens, unwritten):
    """FP8 latent rows (656 bytes), dequantised in place by the math group that scores each
    block, against the reference op on the values the kernel multiplies (`f16_values`; the fp32
    dequant moves a one-key row's lse past the bf16 tolerance); unwritten: the slots past every
    row of a request hold NaN before they are quantised (NaN scales and values that no row may
    meet); its planned splits and one split."""
    c, _ = dense_ws_case(heads, requests, rows, 40, lens, seed=100 + heads + rows, row_req=row_req,
                         unwritten=unwritten)
    clean, _ = dense_ws_case(heads, requests, rows, 40, lens, seed=100 + heads + rows, row_req=row_req)
    c8, clean8 = fp8_case(c), fp8_case(clean)
    width = clean["latent_cache"].shape[2]
    seen = f16_values(clean8["latent_cache"], width)
    want = torch.ops.k31c.dense_mla(*dense_args({**clean8, "latent_cache": seen}))
    assert c8["latent_cache"].dtype == torch.uint8
    assert dws.why_split(c8["q"], c8["latent_cache"], c8["block_table"], c8["dv"]) is None
    for got in (dws.dense_mla(*dense_args(c8)), dws.launch(*dense_args(c8)[:-1], splits=1)):
        assert torch.isfinite(got[0]).all()
        assert_close(got, want, torch.bfloat16)


@cuda_only
@pytest.mark.parametrize("splits", [2, 3, 7, 13])
def test_warp_specialized_dense_key_splits(splits):
    """Splits of 8 table columns merged by LSE: at 7 splits (2 blocks each) the last three and
    at 13 (1 block each) the last five have no block, and short rows leave more splits empty
    (their partials must carry no weight); an empty row stays out 0, lse +inf."""
    c, want = dense_ws_case(96, 3, 1, 8, [0, 70, 512], seed=70 + splits)
    assert_close(dws.launch(*dense_args(c)[:-1], splits=splits), want, torch.bfloat16)


@cuda_only
@pytest.mark.parametrize("rows,row_req", [(1, None), (4, None),
                                          (3, [0, 1, 0, 2, 1, 2, 0, 1, 2])])
def test_warp_specialized_dense_never_reads_past_the_lengths(rows, row_req):
    """Slots past every row of a request hold NaN and the table entries past them are -1 (an
    unused block): the kernel's last block of a pass has such rows, and they must not meet
    P (0 x NaN) or be attended; checked with one split and several."""
    n = 3 * rows
    lens = [(37 * t + 11) % 700 for t in range(n)]
    lens[0] = 0
    c, want = dense_ws_case(96, 3, rows, 12, lens, seed=80 + rows, row_req=row_req,
                            unwritten=True, unused_blocks=True)
    assert dws.why_split(c["q"], c["latent_cache"], c["block_table"], c["dv"]) is None
    for splits in (1, 4):
        out, lse = dws.launch(*dense_args(c)[:-1], splits=splits)
        assert torch.isfinite(out).all()
        assert_close((out, lse), want, torch.bfloat16)


@cuda_only
def test_warp_specialized_dense_at_four_rows_a_request():
    """B = 16 x R = 4 (96 programs): the registered launcher runs this kernel with its planned
    splits, and one split gives the same result."""
    c = make_case(**{**K31, "k": 4, "max_blocks": 40}, device="cuda", dtype=torch.bfloat16,
                  seed=90)
    assert dws.why_split(c["q"], c["latent_cache"], c["block_table"], c["dv"]) is None
    want = torch.ops.k31c.dense_mla(*dense_args(c))
    assert_close(dws.dense_mla(*dense_args(c)), want, torch.bfloat16)
    assert_close(dws.launch(*dense_args(c)[:-1], splits=1), want, torch.bfloat16)


def test_warp_specialized_dense_layout_and_split_plan():
    """Groups, slabs and passes from static shapes; splits that fill whole waves, at least 4
    blocks each, at most MAX_SPLITS."""
    assert dws.layout(16, 96, 16) == (1, 16, 2, 1)        # R = 1: 64 + 32 heads, one request
    assert dws.layout(64, 96, 16) == (4, 16, 6, 2)        # R = 4: a slab spans 2 rows
    assert dws.layout(9, 40, 3) == (3, 3, 2, 3)           # pairs 64-119 are rows 1, 2 (of 0-2)
    assert dws.layout(7, 96, 1) == (7, 1, 11, 2)          # prefill-like: one group of 7 rows
    assert dws.layout(10, 96, 4) == (1, 10, 2, 1)         # 10 rows, 4 requests: a row a group
    assert dws.layout(128, 1, 2) == (64, 2, 1, 64)        # 1 head: a slab of 64 rows
    assert dws.plan_splits(32, 2048, 132) == 4            # B = 16, R = 1: 128 programs
    assert dws.plan_splits(96, 512, 132) == 4             # B = 16, R = 4: 384 programs, 3 waves
    assert dws.plan_splits(96, 2048, 132) == 4
    assert dws.plan_splits(32, 8, 132) == 2               # 8 blocks: at least 4 a split
    assert dws.plan_splits(32, 3, 132) == 1
    assert dws.plan_splits(1, 1 << 16, 132) == 63         # within 3% of MAX_SPLITS' estimate
    assert dws.plan_splits(200, 2048, 132) == 9           # 14 waves of 228 blocks, not 2 of 2048


def test_warp_specialized_dense_declines_what_it_cannot_run():
    """The reasons a call goes to the split kernel: on this machine's tensors the device (or
    Gluon) first; from the arguments alone (what the compiler's report uses) the dtype, widths,
    block size, a strided cache, too many passes."""
    c = make_case(**{**K31, "k": 4, "requests": 2, "rows": 1, "max_blocks": 4}, device=DEV,
                  dtype=torch.bfloat16, seed=91)
    reason = dws.why_split(c["q"], c["latent_cache"], c["block_table"], c["dv"])
    if not CUDA:
        assert "NVIDIA" in reason or "Gluon" in reason
    else:
        assert reason is None                                 # an H200: 2 rows, 4 programs
    if dws.GLUON_ERROR is not None:
        return
    meta = dict(device="meta", dtype=torch.bfloat16)

    def why(n=16, heads=96, width=576, dv=512, blocks=(100, 64), requests=16, dtype=None,
            cache=None):
        q = torch.empty(n, heads, width, device="meta", dtype=dtype or torch.bfloat16)
        cache = torch.empty(*blocks, width, **meta) if cache is None else cache
        table = torch.empty(requests, 2048, device="meta", dtype=torch.int32)
        return dws._why_not_these_args(q, cache, table, dv)

    assert why() is None and why(heads=40) is None
    assert why(n=16, requests=4) is None                            # B = 4 x R = 4: 24 programs
    assert "bf16 or FP8" in why(dtype=torch.float32)
    assert why(cache=torch.empty(100, 64, 656, device="meta", dtype=torch.uint8)) is None
    assert "cache row 600" in why(cache=torch.empty(100, 64, 600, device="meta", dtype=torch.uint8))
    assert "width" in why(width=640) and "width" in why(dv=448)
    assert "blocks of 16 rows" in why(blocks=(400, 16))
    assert "strided" in why(cache=torch.empty(100, 64, 640, **meta)[..., :576])
    assert "passes" in why(n=128, heads=4, requests=8)             # groups of 16 rows of 4 heads
    assert why(n=64) is None                                        # B = 16 x R = 4: 96 programs


def test_warp_specialized_dense_report_names_the_kernel_that_runs():
    """h200's `runs` from fake tensors: this kernel at R = 1 and R = 4 and for FP8 latent rows,
    the split kernel for an fp32 cache, mla.py's for FP8 rows this kernel declines; with a
    symbolic row count the launcher that decides."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)
    h200 = lookup("k31c::dense_mla", "h200")
    meta = dict(device="meta", dtype=torch.bfloat16)
    table = torch.empty(16, 2048, device="meta", dtype=torch.int32)
    cache = torch.empty(100, 64, 576, **meta)

    def args(q, cache=cache):
        return (q, cache, table, None, None, 0.1, 512)

    seesaw = "triton:k31c.lowering.triton.mla_dense_ws.dense_mla"
    split = "triton:k31c.lowering.triton.mla_dense.dense_mla"
    one_row = torch.empty(16, 96, 576, **meta)
    assert h200.name_for(args(one_row)) == (seesaw if dws.GLUON_ERROR is None else split)
    assert h200.name_for(args(torch.empty(64, 96, 576, **meta))) == (
        seesaw if dws.GLUON_ERROR is None else split)
    fp32 = torch.empty(100, 64, 576, device="meta", dtype=torch.float32)
    assert h200.name_for(args(torch.empty(16, 96, 576, device="meta", dtype=torch.float32),
                              fp32)) == split
    fp8 = torch.empty(100, 64, 656, device="meta", dtype=torch.uint8)
    one_pass = "triton:k31c.lowering.triton.mla.dense_mla"
    assert h200.name_for(args(one_row, fp8)) == (seesaw if dws.GLUON_ERROR is None else one_pass)
    fp8_16 = torch.empty(400, 16, 656, device="meta", dtype=torch.uint8)      # 16-row blocks
    assert h200.name_for(args(one_row, fp8_16)) == one_pass
    mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC,
                                                      DimDynamic.STATIC])
    rows = mode.from_tensor(torch.empty(16, 96, 576, dtype=torch.bfloat16),
                            symbolic_context=dynamic)
    assert not isinstance(rows.shape[0], int)
    assert h200.name_for(args(rows)) == seesaw
