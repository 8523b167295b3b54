"""Triton sparse_mla / dense_mla against the reference ops (torch.ops.k31c.*): the registered
kernels (warp-specialized sparse and dense on h200, Gluon kernels the GPU runs and CPU runs only
build (test_aot), two-pass sparse elsewhere and as its fallback; the split-key dense kernel
where h200's dense one hands calls to it, one-pass dense elsewhere) and the dense kernels by
name. Random inputs: shuffled block tables, -1
slots, a row with no valid index, rows of different lengths (one empty), key splits merged by
LSE.
CPU: fp32 under the Triton interpreter at small shapes; CUDA: also bf16 (and an FP8 latent cache)
at K3.1 Pro shapes (96 heads, 576 = 512 + 64 wide rows, top-k 2048)."""
import pytest
import torch

import k31c.graph.ops  # noqa: F401  (registers torch.ops.k31c.*)
from k31c.lowering.registry import lookup
from k31c.lowering.triton import mla as kernels
from k31c.lowering.triton import mla_dense as split_dense
from k31c.lowering.triton import mla_dense_plan as dense_plan
from k31c.lowering.triton import mla_dense_ws as dws
from k31c.lowering.triton import mla_sparse_ws as ws
from k31c.lowering.triton import mla_two_pass as two_pass

CUDA = torch.cuda.is_available()
DEVICES = ["cuda"] if CUDA else ["cpu"]      # no GPU: the Triton interpreter (tests/conftest.py)
DEV = DEVICES[0]
SMALL = dict(heads=8, width=80, dv=64, k=40, block_size=8, requests=3, rows=2, max_blocks=8)
K31 = dict(heads=96, width=576, dv=512, k=2048, block_size=64, requests=16, rows=4, max_blocks=64)


def make_case(heads, width, dv, k, block_size, requests, rows, max_blocks, device, dtype, seed,
              extra_blocks=5):
    """Random q/cache; each request gets a random set of physical blocks (shuffled pool), each row
    a length <= capacity and k indices drawn from its visible positions with -1 holes."""
    g = torch.Generator().manual_seed(seed)
    n = requests * rows
    num_blocks = requests * max_blocks + extra_blocks
    cache = torch.randn(num_blocks, block_size, width, generator=g)
    q = torch.randn(n, heads, width, generator=g)
    perm = torch.randperm(num_blocks, generator=g)[: requests * max_blocks]
    block_table = perm.view(requests, max_blocks).to(torch.int32)
    capacity = max_blocks * block_size
    base = torch.randint(capacity // 2, capacity - rows + 1, (requests,), generator=g)
    row_len = (base.repeat_interleave(rows) + torch.arange(rows).repeat(requests)).to(torch.int32)
    row_req = torch.arange(requests).repeat_interleave(rows).to(torch.int32)
    indices = torch.empty(n, k, dtype=torch.int32)
    for t in range(n):
        visible = int(row_len[t])
        chosen = torch.randperm(visible, generator=g)[:k]
        indices[t] = -1
        indices[t, : chosen.numel()] = chosen.to(torch.int32)
        indices[t] = indices[t, torch.randperm(k, generator=g)]            # holes anywhere
    holes = torch.rand(n, k, generator=g) < 0.2
    indices[holes] = -1
    indices[1] = -1                                                        # a row with no key
    scale = width ** -0.5 * (3.0 if dtype == torch.float32 else 1.0)       # peaky softmax in fp32
    to = dict(device=device)
    return dict(q=q.to(dtype=dtype, **to), latent_cache=cache.to(dtype=dtype, **to),
                block_table=block_table.to(**to), row_req=row_req.to(**to),
                indices=indices.to(**to), row_len=row_len.to(**to), sm_scale=scale, dv=dv)


def sparse_args(c):
    return (c["q"], c["latent_cache"], c["block_table"], c["row_req"], c["indices"], c["sm_scale"],
            c["dv"])


def dense_args(c):
    return (c["q"], c["latent_cache"], c["block_table"], c["row_req"], c["row_len"], c["sm_scale"],
            c["dv"])


def assert_close(got, want, dtype):
    (out, lse), (ref_out, ref_lse) = got, want
    assert out.dtype == ref_out.dtype and lse.dtype == torch.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    empty = torch.isinf(ref_lse) & (ref_lse > 0)
    assert torch.equal(torch.isinf(lse) & (lse > 0), empty), "empty rows must give lse = +inf"
    assert bool((out[empty] == 0).all()), "empty rows must give out = 0"
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    lse_tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], atol=lse_tol, rtol=lse_tol)
    scale = ref_out.float().abs().amax().item()
    err = (out.float() - ref_out.float()).abs().amax().item()
    assert err <= tol * scale, f"out max error {err:.3g} vs max |out| {scale:.3g}"


def test_rows_without_rest_columns():
    """dv == Dl (no rope part): keys and values are the same columns."""
    c = make_case(**{**SMALL, "width": 64}, device=DEV, dtype=torch.float32, seed=9)
    assert_close(two_pass.sparse_mla(*sparse_args(c)), torch.ops.k31c.sparse_mla(*sparse_args(c)),
                 torch.float32)
    assert_close(kernels.dense_mla(*dense_args(c)), torch.ops.k31c.dense_mla(*dense_args(c)),
                 torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [None, 4])
def test_dense_matches_reference_small(device, splits):
    c = make_case(**SMALL, device=device, dtype=torch.float32, seed=3)
    c["row_len"][2] = 0                                                   # a row that sees nothing
    c["row_len"][3] = 1
    want = torch.ops.k31c.dense_mla(*dense_args(c))
    got = kernels.launch(*dense_args(c), config={"splits": splits} if splits else None)
    assert_close(got, want, torch.float32)


def test_public_launchers_and_registry():
    c = make_case(**SMALL, device=DEV, dtype=torch.float32, seed=11)
    assert_close(two_pass.sparse_mla(*sparse_args(c)), torch.ops.k31c.sparse_mla(*sparse_args(c)),
                 torch.float32)
    assert lookup("k31c::sparse_mla", "h200").fn is ws.sparse_mla
    assert lookup("k31c::sparse_mla", "mi350x").fn is two_pass.sparse_mla
    # a call the warp-specialized kernel does not take (here: fp32, and no sm_90 GPU on CI) runs
    # the two-pass kernel, with the same result
    assert ws.why_two_pass(c["q"], c["latent_cache"], c["indices"], c["dv"])
    assert_close(ws.sparse_mla(*sparse_args(c)), torch.ops.k31c.sparse_mla(*sparse_args(c)),
                 torch.float32)
    # and the compiler's report names the kernel that runs (from the arguments' metadata alone)
    h200 = lookup("k31c::sparse_mla", "h200")
    assert h200.name_for(sparse_args(c)) == "triton:k31c.lowering.triton.mla_two_pass.sparse_mla"
    meta = dict(device="meta", dtype=torch.bfloat16)
    k31 = (torch.empty(4, 96, 576, **meta), torch.empty(9, 64, 576, **meta), None, None,
           torch.empty(4, 2048, device="meta", dtype=torch.int32), 0.1, 512)
    assert h200.name_for(k31) == ("triton:k31c.lowering.triton.mla_sparse_ws.sparse_mla"
                                  if ws.GLUON_ERROR is None else h200.name_for(sparse_args(c)))
    assert lookup("k31c::dense_mla", "h200").fn is dws.dense_mla
    assert lookup("k31c::dense_mla", "mi350x").fn is kernels.dense_mla
    assert_close(kernels.dense_mla(*dense_args(c)), torch.ops.k31c.dense_mla(*dense_args(c)),
                 torch.float32)
    # h200's dense launcher hands what its kernel does not take (fp32 here) to the split kernel
    assert dws.why_split(c["q"], c["latent_cache"], c["block_table"], c["dv"])
    assert_close(dws.dense_mla(*dense_args(c)), torch.ops.k31c.dense_mla(*dense_args(c)),
                 torch.float32)
    assert lookup("k31c::dense_mla", "h200").name_for(dense_args(c)) == \
        "triton:k31c.lowering.triton.mla_dense.dense_mla"


def test_sparse_differs_from_dense():
    """The test can fail: sparse over a strict subset of keys must not equal dense."""
    c = make_case(**SMALL, device=DEV, dtype=torch.float32, seed=5)
    sparse_out, _ = two_pass.sparse_mla(*sparse_args(c))
    dense_out, _ = kernels.dense_mla(*dense_args(c))
    assert not torch.allclose(sparse_out[0], dense_out[0], atol=1e-3)


def test_bad_arguments():
    c = make_case(**SMALL, device=DEV, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match="indices"):
        two_pass.sparse_mla(*sparse_args({**c, "indices": c["indices"].long()}))
    with pytest.raises(ValueError, match="row_len"):
        kernels.dense_mla(*dense_args({**c, "row_len": c["row_len"][:-1]}))
    with pytest.raises(ValueError, match="dv"):
        two_pass.sparse_mla(*sparse_args({**c, "dv": 81}))
    with pytest.raises(ValueError, match="latent_cache"):
        two_pass.sparse_mla(*sparse_args({**c, "latent_cache": c["latent_cache"][..., :64]}))


# ---- K3.1 Pro shapes, bf16, CUDA only --------------------------------------------------------

cuda_only = pytest.mark.skipif(not CUDA, reason="real K3.1 Pro shapes run on the GPU only")


@cuda_only
def test_dense_k31_shapes_bf16():
    c = make_case(**{**K31, "max_blocks": 40}, device="cuda", dtype=torch.bfloat16, seed=22)
    c["row_len"][5] = 0
    c["row_len"][6] = 77
    want = torch.ops.k31c.dense_mla(*dense_args(c))
    assert_close(kernels.dense_mla(*dense_args(c)), want, torch.bfloat16)


# ---- the two-pass sparse kernel (mla_two_pass.py) --------------------------------------------

@pytest.mark.parametrize("heads", [8, 5, 40])
@pytest.mark.parametrize("cfg", [None, {"bk": 32, "bk2": 16, "dvc": 64}])
def test_two_pass_matches_reference_small(heads, cfg):
    """Several key blocks per row (statistics merged across blocks), head tiles of 16 and a rest
    tile, an empty row and -1 holes, against the reference op."""
    c = make_case(**{**SMALL, "heads": heads}, device=DEV, dtype=torch.float32, seed=heads + 31)
    want = torch.ops.k31c.sparse_mla(*sparse_args(c))
    got = two_pass.launch(*sparse_args(c), config=cfg)
    assert torch.isinf(want[1][1]).all()
    assert_close(got, want, torch.float32)


def test_two_pass_rejects_bad_config():
    c = make_case(**SMALL, device=DEV, dtype=torch.float32, seed=5)
    with pytest.raises(ValueError, match="bk2"):
        two_pass.launch(*sparse_args(c), config={"bk": 32, "bk2": 24})


@cuda_only
def test_two_pass_k31_shapes():
    """bf16 rows, then FP8 e4m3 rows without a scale (upcast on load) against the reference op on
    the same rows upcast to bf16."""
    c = make_case(**K31, device="cuda", dtype=torch.bfloat16, seed=24)
    want = torch.ops.k31c.sparse_mla(*sparse_args(c))
    assert_close(two_pass.sparse_mla(*sparse_args(c)), want, torch.bfloat16)
    fp8 = (c["latent_cache"] * 0.5).to(torch.float8_e4m3fn)
    want = torch.ops.k31c.sparse_mla(*sparse_args({**c, "latent_cache": fp8.to(torch.bfloat16)}))
    assert_close(two_pass.sparse_mla(*sparse_args({**c, "latent_cache": fp8})), want,
                 torch.bfloat16)


def test_two_pass_gpu_tile_plan_on_k31_widths():
    """The GPU launch plan (64 + 32 head tiles, 128-key score blocks, 64-wide row steps, 256 value
    columns a program) at K3.1 Pro widths, in fp32 (under the interpreter too: its bf16 dots are
    not trusted), on a few rows: the tiling the H200 runs, checked on every machine."""
    c = make_case(**{**K31, "k": 300, "requests": 1, "rows": 2, "max_blocks": 8}, device=DEV,
                  dtype=torch.float32, seed=25)
    gpu_plan = two_pass.plan(96, None, small=False)
    assert (gpu_plan["big_ht"], gpu_plan["bk"], gpu_plan["dvc"]) == (64, 128, 256)
    want = torch.ops.k31c.sparse_mla(*sparse_args(c))
    assert_close(two_pass.launch(*sparse_args(c), config=gpu_plan), want, torch.float32)
    # few rows: 2 head tiles x 2 chunks of 256 columns would leave SMs idle -> 64 columns a program
    few = two_pass.plan(96, None, small=False, rows=2, dv=512, sm_count=132)
    assert few["dvc"] == 64 and two_pass.plan(96, None, small=False, rows=64, dv=512, sm_count=132)["dvc"] == 256
    assert_close(two_pass.launch(*sparse_args(c), config=few), want, torch.float32)


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
    lse +inf), shuffled blocks; every case must take this kernel, not the two-pass fallback."""
    c = make_case(**{**K31, "heads": heads, "k": k, "rows": rows, "block_size": block_size,
                     "max_blocks": K31["max_blocks"] * 64 // block_size}, device="cuda",
                  dtype=torch.bfloat16, seed=30 + heads + block_size)
    assert ws.why_two_pass(c["q"], c["latent_cache"], c["indices"], c["dv"]) is None
    want = torch.ops.k31c.sparse_mla(*sparse_args(c))
    assert_close(ws.sparse_mla(*sparse_args(c)), want, torch.bfloat16)


@cuda_only
@pytest.mark.parametrize("splits", [2, 3, 7])
def test_warp_specialized_sparse_key_splits(splits):
    """Key splits merged by LSE (a one-row decode's plan): 300 keys in splits of 64-key steps;
    at 7 splits the last two have no keys (their partials must carry no weight)."""
    c = make_case(**{**K31, "heads": 96, "k": 300, "requests": 3, "rows": 1}, device="cuda",
                  dtype=torch.bfloat16, seed=40 + splits)
    want = torch.ops.k31c.sparse_mla(*sparse_args(c))
    assert_close(ws.launch(*sparse_args(c)[:-1], splits=splits), want, torch.bfloat16)


def test_warp_specialized_sparse_split_plan():
    """One wave: splits fill the SMs the (row, tile) programs leave, at least 4 steps each."""
    assert ws.plan_splits(64, 96, 2048, 132) == 1          # B = 16 x R = 4: 128 programs
    assert ws.plan_splits(16, 96, 2048, 132) == 4          # B = 16 x R = 1: 32 x 4 = 128
    assert ws.plan_splits(1, 96, 2048, 132) == 8           # 32 steps, 4 a split
    assert ws.plan_splits(2, 96, 300, 132) == 1            # 5 steps: one split


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
    assert "bf16 only" in ws.why_two_pass(big["q"].float(), big["latent_cache"], big["indices"], 512)
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
    # decode, 4 rows a request (few requests: this kernel runs): 2 passes a slab, one empty
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
    """B = 16 x R = 4 (96 programs): the registered launcher runs this kernel with the splits
    that fill whole waves (4), and any other split count gives the same result."""
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
    assert "bf16 only" in why(dtype=torch.float32)
    assert "width" in why(width=640) and "width" in why(dv=448)
    assert "blocks of 16 rows" in why(blocks=(400, 16))
    assert "strided" in why(cache=torch.empty(100, 64, 640, **meta)[..., :576])
    assert "passes" in why(n=128, heads=4, requests=8)             # groups of 16 rows of 4 heads
    assert why(n=64) is None                                        # B = 16 x R = 4: 96 programs


def test_warp_specialized_dense_report_names_the_kernel_that_runs():
    """h200's `runs` from fake tensors: this kernel at R = 1 and R = 4, the split kernel for an
    fp32 cache, mla.py's for an FP8 cache; with a symbolic row count the launcher that decides."""
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
    assert h200.name_for(args(one_row, fp8)) == "triton:k31c.lowering.triton.mla.dense_mla"
    mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC,
                                                      DimDynamic.STATIC])
    rows = mode.from_tensor(torch.empty(16, 96, 576, dtype=torch.bfloat16),
                            symbolic_context=dynamic)
    assert not isinstance(rows.shape[0], int)
    assert h200.name_for(args(rows)) == seesaw


# ---- the split-key dense kernel (mla_dense.py) -----------------------------------------------

@pytest.mark.parametrize("case,cfg", [
    ({}, None),                                        # decode layout: 2 rows a request
    ({}, {"splits": 3}),                               # partials merged by LSE
    ({}, {"group": 1, "splits": 2}),                   # one row a group
    ({"heads": 5}, {"splits": 2}),                     # tiles cut across rows (5 heads, bm 16)
    ({"block_size": 16, "max_blocks": 4}, {"bn": 16, "splits": 2}),   # a step = one cache block
    ({"block_size": 16, "max_blocks": 4}, {"bn": 16, "splits": 2, "tma": True}),  # ... a TMA box
    ({"width": 64}, None),                             # dv == Dl: no rope columns
    ({"rows": 4, "requests": 2}, {"bm": 32, "splits": 2}),
    ({"rows": 7, "requests": 2}, None),                # prefill-like: many rows a request
])
def test_split_dense_matches_reference_small(case, cfg):
    """Rows of different lengths (one empty, one with a single key), shuffled block tables, key
    splits, M tiles that span rows, against the reference op."""
    c = make_case(**{**SMALL, **case}, device=DEV, dtype=torch.float32, seed=41 + len(case))
    c["row_len"][2] = 0
    c["row_len"][3] = 1
    want = torch.ops.k31c.dense_mla(*dense_args(c))
    assert torch.isinf(want[1][2]).all()              # the empty row really is empty
    stats = {}
    got = split_dense.launch(*dense_args(c), config=cfg, stats=stats)
    if cfg and "splits" in cfg:
        assert stats["splits"] == cfg["splits"]
    if cfg and "tma" in cfg:                          # the interpreter defaults to pointer loads
        assert stats["tma_used"] == cfg["tma"]
    assert_close(got, want, torch.float32)


def test_split_dense_tma_only_on_a_contiguous_cache():
    """TMA boxes need the cache viewed as [blocks x block size, width]: a cache whose rows are
    strided (a column slice of a wider pool) takes the pointer loads even when TMA is asked for,
    and matches the reference either way."""
    c = make_case(**{**SMALL, "block_size": 16, "max_blocks": 4}, device=DEV, dtype=torch.float32,
                  seed=49)
    cfg = {"bn": 16, "splits": 2, "tma": True}
    wide = torch.randn(*c["latent_cache"].shape[:2], 96, device=DEV)
    wide[..., :80] = c["latent_cache"]
    strided = {**c, "latent_cache": wide[..., :80]}
    want = torch.ops.k31c.dense_mla(*dense_args(c))
    for case, tma in ((c, True), (strided, False)):
        stats = {}
        assert_close(split_dense.launch(*dense_args(case), config=cfg, stats=stats), want,
                     torch.float32)
        assert stats["tma_used"] == tma
    assert dense_plan.tma_fits(576, 512, 64, 64, 2, 576, 64 * 576)
    assert not dense_plan.tma_fits(576, 512, 64, 128, 2, 576, 64 * 576)   # a step over two blocks
    assert not dense_plan.tma_fits(576, 500, 64, 64, 2, 576, 64 * 576)    # parts not powers of two


def test_split_dense_rows_of_several_requests_in_one_tile():
    """row_req not in the decode layout (rows of one group belong to different requests, in any
    order): the kernel runs one pass per request inside a tile and still matches."""
    c = make_case(**{**SMALL, "requests": 3, "rows": 2}, device=DEV, dtype=torch.float32, seed=43)
    c["row_req"] = torch.tensor([2, 0, 0, 1, 2, 1], dtype=torch.int32, device=DEV)
    want = torch.ops.k31c.dense_mla(*dense_args(c))
    for cfg in ({"group": 2}, {"group": 3, "bm": 32, "splits": 2}):
        stats = {}
        got = split_dense.launch(*dense_args(c), config=cfg, stats=stats)
        assert stats["passes"] >= 2
        assert_close(got, want, torch.float32)
    five = {**c, "q": c["q"][:5], "row_req": c["row_req"][:5], "row_len": c["row_len"][:5]}
    stats = {}                                         # 5 rows, 3 requests: one row a group
    assert_close(split_dense.launch(*dense_args(five), stats=stats),
                 torch.ops.k31c.dense_mla(*dense_args(five)), torch.float32)
    assert stats["group"] == 1
    one_pass_only = split_dense.launch(*dense_args(c), config={"group": 2, "passes": 1})
    assert not torch.allclose(one_pass_only[0], want[0], atol=1e-3)   # the second pass matters


@pytest.mark.parametrize("case,cfg", [({}, None),                       # keys across blocks
                                      ({"block_size": 16, "max_blocks": 4}, {"bn": 16, "splits": 2}),
                                      ({"block_size": 16, "max_blocks": 4},   # -1 block: a box of zeros
                                       {"bn": 16, "splits": 2, "tma": True})])
def test_split_dense_skips_unused_blocks(case, cfg):
    """A -1 block-table entry inside a row's visible positions holds no keys (as in the one-pass
    kernel); oracle: the reference sparse_mla over the visible positions outside that block."""
    c = make_case(**{**SMALL, **case}, device=DEV, dtype=torch.float32, seed=48)
    bs = c["latent_cache"].shape[1]
    table = c["block_table"].clone()
    table[0, 1] = -1                                     # request 0's second block
    n = c["q"].shape[0]
    width = int(c["row_len"].max())
    indices = torch.full((n, width), -1, dtype=torch.int32)
    for t in range(n):
        pos = [p for p in range(int(c["row_len"][t]))
               if not (int(c["row_req"][t]) == 0 and p // bs == 1)]
        indices[t, : len(pos)] = torch.tensor(pos, dtype=torch.int32)
    want = torch.ops.k31c.sparse_mla(c["q"], c["latent_cache"], c["block_table"], c["row_req"],
                                     indices.to(DEV), c["sm_scale"], c["dv"])
    got = split_dense.launch(c["q"], c["latent_cache"], table, c["row_req"], c["row_len"],
                             c["sm_scale"], c["dv"], config=cfg)
    assert_close(got, want, torch.float32)


def test_split_dense_plan():
    from k31c.lowering.targets import get_target
    h200 = get_target("h200")
    p = dense_plan.plan(h200, 64, 96, 16, 128 << 10, small=False)       # B16 x R4, 96 heads
    assert (p["group"], p["tiles"], p["groups"], p["passes"]) == (4, 6, 16, 2)
    assert (p["bm"], p["bn"], p["num_warps"]) == (64, 64, 8)
    assert 1 <= p["splits"] <= dense_plan.MAX_SPLITS
    p1 = dense_plan.plan(h200, 16, 96, 16, 128 << 10, small=False)      # R = 1: 64 + 32 heads
    assert (p1["group"], p1["tiles"], p1["passes"]) == (1, 2, 1)
    assert dense_plan.rows_per_group(10, 4) == 1 and dense_plan.rows_per_group(2, 4) == 1
    # makespan: waves of 132 programs x key blocks per split
    assert dense_plan.choose_splits(96, 4096, 132, 64) in (4, 11)
    assert dense_plan.choose_splits(1056, 4096, 132, 64) == 1      # 8 full waves already
    assert dense_plan.choose_splits(1, 4096, 132, 64) == 64


def test_split_dense_tile_fits_shared_memory():
    """The key step shrinks where q and two key buffers would not fit the target's shared memory
    (fp32 rows at K3.1 widths), and a launch that still runs out halves it and remembers that."""
    from k31c.lowering.targets import get_target
    h200 = get_target("h200")
    assert dense_plan.shared_bytes(64, 64, 576, 2) == 229376 <= h200.shared_memory  # sm_90a build
    cols = dense_plan.block_cols(576, 512)
    assert cols == 576 and dense_plan.block_cols(80, 64) == 80
    assert dense_plan.plan(h200, 64, 96, 16, 1 << 17, small=False, cols=cols, elem=2)["bn"] == 64
    assert dense_plan.plan(h200, 64, 96, 16, 1 << 17, small=False, cols=cols, elem=4)["bn"] == 16


def test_split_dense_halves_the_step_when_out_of_resources(monkeypatch):
    import triton
    real = split_dense._dense_split_kernel
    tried = []

    class TooBigAtFirstStep:        # the planned step runs out of shared memory, half of it fits
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                tried.append(kwargs["BN"])
                if kwargs["BN"] == tried[0]:
                    raise triton.runtime.errors.OutOfResources(300000, 232448, "shared memory")
                return real[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(split_dense, "_dense_split_kernel", TooBigAtFirstStep())
    monkeypatch.setattr(split_dense, "_SMALLER_STEP", {})
    c = make_case(**SMALL, device=DEV, dtype=torch.float32, seed=47)
    want = torch.ops.k31c.dense_mla(*dense_args(c))
    assert_close(split_dense.dense_mla(*dense_args(c)), want, torch.float32)
    assert_close(split_dense.dense_mla(*dense_args(c)), want, torch.float32)
    first = tried[0]
    assert first > 16 and tried == [first, first // 2, first // 2]   # then the step that fit
    with pytest.raises(triton.runtime.errors.OutOfResources):   # an explicit step is not changed
        split_dense.launch(*dense_args(c), config={"bn": first})


@pytest.mark.skipif(CUDA, reason="fp32 rows at these tiles exceed shared memory; on the GPU the "
                                 "bf16 K3.1 tests below run them")
def test_split_dense_gpu_tile_plan_on_k31_widths():
    """The GPU tiles for bf16 (64 M-rows, 64-key steps = one 64-row cache block) at K3.1 Pro
    widths, in fp32 under the interpreter, on a few rows of two requests."""
    c = make_case(**{**K31, "k": 1, "requests": 2, "rows": 2, "max_blocks": 4}, device=DEV,
                  dtype=torch.float32, seed=45)
    gpu = dense_plan.plan(get_target_h200(), 4, 96, 2, 4 * 64, {"splits": 2}, small=False)
    assert (gpu["bm"], gpu["bn"], gpu["group"]) == (64, 64, 2)
    assert_close(split_dense.launch(*dense_args(c), config=gpu),
                 torch.ops.k31c.dense_mla(*dense_args(c)), torch.float32)


def get_target_h200():
    from k31c.lowering.targets import get_target
    return get_target("h200")


def test_split_dense_bad_arguments():
    c = make_case(**SMALL, device=DEV, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match="row_len"):
        split_dense.dense_mla(*dense_args({**c, "row_len": c["row_len"].long()}))
    with pytest.raises(ValueError, match="group"):
        split_dense.launch(*dense_args(c), config={"group": 0})


@cuda_only
@pytest.mark.parametrize("rows,cfg", [(4, None), (1, None), (4, {"splits": 1}), (4, {"splits": 5}),
                                      (4, {"bn": 32, "num_stages": 3}), (4, {"tma": False})])
def test_split_dense_k31_shapes_bf16(rows, cfg):
    c = make_case(**{**K31, "rows": rows, "max_blocks": 40}, device="cuda", dtype=torch.bfloat16,
                  seed=46 + rows)
    c["row_len"][1] = 0
    c["row_len"][2] = 77
    want = torch.ops.k31c.dense_mla(*dense_args(c))
    assert_close(split_dense.launch(*dense_args(c), config=cfg), want, torch.bfloat16)
    if cfg is None:
        assert_close(split_dense.dense_mla(*dense_args(c)), want, torch.bfloat16)
