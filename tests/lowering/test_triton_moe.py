"""Triton MoE router and routed experts vs the k31c reference ops (interpreter on CPU, compiled
on CUDA): random routing at several batch sizes, expert groups, exact ties in router scores, every
row picking the same expert (an expert spanning several row tiles), and on CUDA K3.1 Pro's widths.

Router outputs are compared as sets per row with their weights paired (the tie rule makes the
set unique); expert outputs with tolerances near the rounding of their dtype.
"""
import pytest
import torch

import k31c.graph.ops  # noqa: F401  (registers torch.ops.k31c.*)
from k31c.lowering.triton import moe_experts, moe_route

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu_only = pytest.mark.skipif(not CUDA, reason="real K3.1 Pro shapes run on CUDA only")


def _by_expert(idx: torch.Tensor, w: torch.Tensor):
    order = idx.long().sort(1).indices
    return idx.gather(1, order), w.gather(1, order)


def _check_route(x, weight, bias, *args):
    ref_idx, ref_w = torch.ops.k31c.moe_route(x, weight, bias, *args)
    got_idx, got_w = moe_route.moe_route(x, weight, bias, *args)
    assert got_idx.dtype == torch.int32 and got_w.dtype == torch.float32
    ref_idx, ref_w = _by_expert(ref_idx, ref_w)
    got_idx, got_w = _by_expert(got_idx, got_w)
    bad = (got_idx != ref_idx).any(1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:8]} select different experts"
    torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-6)
    return got_idx


def _router(gen, n, d, e, dtype=torch.float32):
    x = torch.randn(n, d, generator=gen).to(dtype)
    weight = (torch.randn(e, d, generator=gen) * d ** -0.5).to(dtype)
    bias = torch.randn(e, generator=gen) * 0.05
    return x.to(DEVICE), weight.to(DEVICE), bias.to(DEVICE)


# ---- moe_route ------------------------------------------------------------------------------------

# (k, n_group, topk_group, scoring, renormalize, scaling)
ROUTINGS = [(4, 1, 1, "sigmoid", True, 1.0), (3, 4, 2, "sigmoid", True, 2.446),
            (1, 1, 1, "sigmoid", True, 1.0), (4, 8, 3, "softmax", False, 1.0)]


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("n", [1, 29])
def test_route_random(routing, n):
    gen = torch.Generator().manual_seed(n)
    _check_route(*_router(gen, n, 96, 32), *routing)


def test_route_bf16_rows():
    gen = torch.Generator().manual_seed(5)
    _check_route(*_router(gen, 9, 64, 16, torch.bfloat16), 4, 1, 1, "sigmoid", True, 1.0)


def test_route_ties_lower_index_wins():
    """Logits exact in fp32 (small multiples of 1/8, so every summation order gives the same
    value): experts with equal rows and bias tie exactly, and groups tie on their score."""
    gen = torch.Generator().manual_seed(3)
    e, d = 16, 32
    weight = torch.randint(-2, 3, (e, d), generator=gen).float() / 8
    weight[9] = weight[4]                 # experts 4 and 9 tie everywhere
    weight[12:16] = weight[0:4]           # group 3 repeats group 0: equal group scores
    bias = torch.zeros(e)
    x = torch.randint(-2, 3, (20, d), generator=gen).float() / 8
    # row 0: only experts 4 and 9 score above the rest, and k = 1: expert 4 must win
    x[0] = weight[4] * 4
    idx = _check_route(x.to(DEVICE), weight.to(DEVICE), bias.to(DEVICE), 1, 1, 1, "sigmoid", True, 1.0)
    assert int(idx[0, 0]) == 4
    for routing in ((5, 1, 1, "sigmoid", True, 1.0), (3, 4, 1, "sigmoid", True, 1.0),
                    (6, 4, 2, "softmax", False, 1.0)):
        _check_route(x.to(DEVICE), weight.to(DEVICE), bias.to(DEVICE), *routing)
    # every score equal: the k lowest experts of the lowest-indexed kept groups
    flat = torch.zeros(3, d)
    idx = _check_route(flat.to(DEVICE), weight.to(DEVICE), bias.to(DEVICE), 3, 4, 2, "sigmoid", True, 1.0)
    assert idx.tolist() == [[0, 1, 2]] * 3


# ---- moe_experts ----------------------------------------------------------------------------------

def _experts(gen, e, width, inter, dtype):
    w13 = (torch.randn(e, 2 * inter, width, generator=gen) * width ** -0.5).to(dtype)
    w2 = (torch.randn(e, width, inter, generator=gen) * inter ** -0.5).to(dtype)
    return w13.to(DEVICE), w2.to(DEVICE)


def _routing(gen, n, e, k):
    """Distinct experts per row, positive weights."""
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)]).int()
    w = torch.rand(n, k, generator=gen) + 0.1
    return idx.to(DEVICE), w.to(DEVICE)


# relative to the output's largest magnitude; bf16: a summation order can move a rounding by an ulp
TOL = {torch.float32: dict(rtol=1e-5, atol=2e-6), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


def _check_experts(z, idx, w, w13, w2, act=("situ", 4.0, 25.0), config=None):
    ref = torch.ops.k31c.moe_experts(z, idx, w, w13, w2, *act)
    got = moe_experts.launch(z, idx, w, w13, w2, *act, config=config)
    assert got.dtype == z.dtype and got.shape == z.shape
    scale = float(ref.float().abs().max())
    tol = TOL[z.dtype]
    torch.testing.assert_close(got.float() / scale, ref.float() / scale, rtol=tol["rtol"], atol=tol["atol"])


@pytest.mark.parametrize("n", [1, 6, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_random_routing(n, dtype):
    gen = torch.Generator().manual_seed(n)
    e, k, width, inter = 16, 4, 48, 40          # widths off the tiles: masked edges
    w13, w2 = _experts(gen, e, width, inter, dtype)
    z = torch.randn(n, width, generator=gen).to(dtype).to(DEVICE)
    _check_experts(z, *_routing(gen, n, e, k), w13, w2)


def test_experts_grouping_bound():
    assert moe_experts.plan(moe_experts.GROUP_ONE_MAX)["group"] == "one"
    assert moe_experts.plan(moe_experts.GROUP_ONE_MAX + 1)["group"] == "three"
    with pytest.raises(ValueError, match="'one' takes at most"):
        moe_experts.plan(moe_experts.GROUP_ONE_MAX + 1, config={"group": "one"})


@pytest.mark.parametrize("act", [("silu", 4.0, None), ("situ", 4.0, None), ("situ", 0.5, 2.0)])
def test_experts_activations(act):
    gen = torch.Generator().manual_seed(11)
    w13, w2 = _experts(gen, 8, 32, 32, torch.float32)
    z = (torch.randn(5, 32, generator=gen) * 3).to(DEVICE)      # gate values well past ±beta
    _check_experts(z, *_routing(gen, 5, 8, 2), w13, w2, act)


@pytest.mark.parametrize("group", ["one", "three"])
def test_experts_all_rows_pick_one_expert(group):
    """40 rows all pick expert 3 first: its rows span three tiles of 16 (the worst-case grid);
    one assignment names no expert. Both groupings (one program, three launches) at this size."""
    gen = torch.Generator().manual_seed(2)
    e, k, n = 8, 3, 40
    w13, w2 = _experts(gen, e, 32, 32, torch.float32)
    z = torch.randn(n, 32, generator=gen).to(DEVICE)
    idx, w = _routing(gen, n, e - 1, k)
    idx = torch.where(idx >= 3, idx + 1, idx)                   # the others avoid expert 3
    idx[:, 0] = 3
    idx[5, 1] = -1
    _check_experts(z, idx, w, w13, w2, config={"group": group})
    idx[:] = 3                                                  # and the same expert k times
    _check_experts(z, idx, w, w13, w2)


def test_experts_router_output_and_large_tiles():
    """Routing from the Triton router, with the prefill tile (BM = 64) forced."""
    gen = torch.Generator().manual_seed(4)
    x, weight, bias = _router(gen, 37, 64, 16)
    idx, w = moe_route.moe_route(x, weight, bias, 4, 4, 2, "sigmoid", True, 2.0)
    w13, w2 = _experts(gen, 16, 64, 48, torch.float32)
    z = torch.randn(37, 64, generator=gen).to(DEVICE)
    _check_experts(z, idx, w, w13, w2, config=dict(BM=64))


def test_experts_skip_an_invalid_expert():
    """An index outside 0..E-1 contributes nothing (the reference raises on it)."""
    gen = torch.Generator().manual_seed(6)
    w13, w2 = _experts(gen, 8, 32, 32, torch.float32)
    z = torch.randn(4, 32, generator=gen).to(DEVICE)
    idx, w = _routing(gen, 4, 8, 2)
    bad = idx.clone()
    bad[1, 1], bad[2, 0] = -1, 8
    zeroed = w.clone()
    zeroed[1, 1] = zeroed[2, 0] = 0.0
    ref = torch.ops.k31c.moe_experts(z, idx, zeroed, w13, w2, "situ", 4.0, 25.0)
    got = moe_experts.moe_experts(z, bad, w, w13, w2, "situ", 4.0, 25.0)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="outside 0..7"):
        torch.ops.k31c.moe_experts(z, bad, w, w13, w2, "situ", 4.0, 25.0)


def test_argument_errors_name_the_input():
    z = torch.zeros(2, 8)
    w13, w2 = torch.zeros(4, 6, 8), torch.zeros(4, 8, 3)
    idx, w = torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 2)
    with pytest.raises(ValueError, match="idx: expected int32"):
        moe_experts.moe_experts(z, idx.long(), w, w13, w2, "situ", 4.0, None)
    with pytest.raises(ValueError, match="w2: expected"):
        moe_experts.moe_experts(z, idx, w, w13, w2[:, :, :2], "situ", 4.0, None)
    with pytest.raises(ValueError, match="act must be one of"):
        moe_experts.moe_experts(z, idx, w, w13, w2, "gelu", 4.0, None)
    x, weight = torch.zeros(2, 8), torch.zeros(6, 8)
    with pytest.raises(ValueError, match="n_group must be a positive divisor"):
        moe_route.moe_route(x, weight, torch.zeros(6), 2, 4, 1, "sigmoid", True, 1.0)
    with pytest.raises(ValueError, match="bias: expected float32"):
        moe_route.moe_route(x, weight, torch.zeros(6, dtype=torch.bfloat16), 2, 1, 1, "sigmoid", True, 1.0)


def test_benchmark_floor_and_dense_peer():
    """bench_moe's floor counts each selected expert once; its dense peer is the reference's sum."""
    from benchmarks.bench_moe import ACT, dense_all_experts, selected_expert_bytes
    idx = torch.tensor([[3, 5], [5, 7], [3, 0]], dtype=torch.int32)
    assert selected_expert_bytes(idx, inter=10, width=6) == 4 * 3 * 10 * 6 * 2
    gen = torch.Generator().manual_seed(8)
    w13, w2 = _experts(gen, 8, 16, 24, torch.float32)
    z = torch.randn(3, 16, generator=gen).to(DEVICE)
    w = torch.rand(3, 2, generator=gen).to(DEVICE)
    ref = torch.ops.k31c.moe_experts(z, idx.to(DEVICE), w, w13, w2, *ACT)
    torch.testing.assert_close(dense_all_experts(z, idx.to(DEVICE), w, w13, w2), ref, rtol=1e-5, atol=1e-6)


# ---- K3.1 Pro shapes (CUDA) -----------------------------------------------------------------------

@gpu_only
@pytest.mark.parametrize("n", [1, 16, 64])
def test_route_real_shapes(n):
    gen = torch.Generator().manual_seed(n)
    _check_route(*_router(gen, n, 7168, 896, torch.bfloat16), 16, 1, 1, "sigmoid", True, 1.0)


@gpu_only
@pytest.mark.parametrize("n", [1, 4, 16, 64])
def test_experts_real_widths(n):
    """K3.1 Pro's expert widths (3584 in, 3072 intermediate, bf16, k = 16) over 64 experts."""
    gen = torch.Generator(device=DEVICE).manual_seed(n)
    e, k, width, inter = 64, 16, 3584, 3072
    w13 = torch.randn(e, 2 * inter, width, device=DEVICE, generator=gen, dtype=torch.bfloat16) * width ** -0.5
    w2 = torch.randn(e, width, inter, device=DEVICE, generator=gen, dtype=torch.bfloat16) * inter ** -0.5
    z = torch.randn(n, width, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    idx = torch.rand(n, e, device=DEVICE, generator=gen).argsort(1)[:, :k].int()
    w = torch.rand(n, k, device=DEVICE, generator=gen) + 0.1
    _check_experts(z, idx, w, w13, w2)


# ---- padding rows (row_len 0: a device graph's bucket padding) -------------------------------------

def test_route_padding_rows_select_no_expert():
    """Rows with row_len 0 get idx -1 and weight 0, in the reference and the kernel; the other
    rows route as without row_len."""
    gen = torch.Generator().manual_seed(11)
    x, weight, bias = _router(gen, 7, 64, 16)
    row_len = torch.tensor([5, 0, 3, 0, 0, 9, 1], dtype=torch.int32, device=DEVICE)
    args = (4, 1, 1, "sigmoid", True, 1.0)
    plain_idx, plain_w = torch.ops.k31c.moe_route(x, weight, bias, *args)
    for idx, w in (torch.ops.k31c.moe_route(x, weight, bias, *args, row_len),
                   moe_route.moe_route(x, weight, bias, *args, row_len)):
        dead = row_len == 0
        assert (idx[dead] == -1).all() and (w[dead] == 0).all()
        got_idx, got_w = _by_expert(idx[~dead], w[~dead])
        want_idx, want_w = _by_expert(plain_idx[~dead], plain_w[~dead])
        assert torch.equal(got_idx, want_idx)
        torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


def test_experts_rows_without_experts_are_zero():
    """idx -1 selects no expert: such a row's output is 0 in the reference and the kernel."""
    gen = torch.Generator().manual_seed(12)
    w13, w2 = _experts(gen, 8, 32, 32, torch.float32)
    z = torch.randn(5, 32, generator=gen).to(DEVICE)
    idx, w = _routing(gen, 5, 8, 2)
    idx[1], idx[3] = -1, -1
    w[1], w[3] = 0.0, 0.0
    ref = torch.ops.k31c.moe_experts(z, idx, w, w13, w2, "situ", 4.0, 25.0)
    got = moe_experts.moe_experts(z, idx, w, w13, w2, "situ", 4.0, 25.0)
    assert (ref[[1, 3]] == 0).all() and ref[[0, 2, 4]].abs().amax() > 0
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-6)
