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
    # bf16 rows: the half-release seesaw, which the registered launcher hands them to
    assert h200.name_for(k31) == ("triton:k31c.lowering.triton.mla_sparse_half.sparse_mla"
                                  if ws.GLUON_ERROR is None else h200.name_for(sparse_args(c)))
    # FP8 latent rows (656 bytes) run the 32-key seesaw, dequantised on chip
    k31_fp8 = (k31[0], torch.empty(9, 64, 656, device="meta", dtype=torch.uint8), *k31[2:])
    assert h200.name_for(k31_fp8) == ("triton:k31c.lowering.triton.mla_sparse_ws.sparse_mla"
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
    # 96 programs: s = 11 is the least makespan (8 waves x 373 blocks = 2984), s = 4 (3 waves x
    # 1024 = 3072) the fewest splits within 3% of it
    assert dense_plan.choose_splits(96, 4096, 132, 64) == 4
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
