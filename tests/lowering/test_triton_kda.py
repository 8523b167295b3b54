"""Triton `kda_decode` / `kda_prefill` vs the reference ops (torch.ops.k31c.*) on fresh random
inputs: outputs, the written-back conv windows and recurrent states, and the per-row snapshots.

On CPU the kernels run under the Triton interpreter at small shapes (H=2, K=16/32, W=4); on a GPU
the same tests also run at K3 shapes (96 heads x 128) in bf16."""
import pytest
import torch

import k31c.graph.ops.kda  # noqa: F401  (registers torch.ops.k31c.kda_*)
from functools import partial

from k31c.lowering.triton.kda_decode import decode_tile, kda_decode, launch_kda_decode
from k31c.lowering.triton.kda_prefill import kda_prefill, launch_kda_prefill

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"        # small shapes: the GPU when there is one
W = 4
EPS = 1e-5
TOKEN_KEYS = ("q", "k", "v", "f", "beta", "gate")


def make_layer(H, K, num_slots, dtype, device, gen):
    P = H * K

    def rnd(*shape, s=1.0):
        return (s * torch.randn(*shape, generator=gen)).to(device)

    params = dict(conv_weight=rnd(3 * P, W, s=0.5),
                  A_log=torch.empty(H).uniform_(1, 16, generator=gen).log().to(device),
                  dt_bias=rnd(P), o_norm_weight=1 + rnd(K, s=0.1))
    conv = rnd(num_slots, W - 1, 3 * P).to(dtype)
    state = rnd(num_slots, H, K, K, s=0.5)
    return params, conv, state


def make_tokens(N, H, K, dtype, device, gen):
    tok = {n: torch.randn(N, H * K, generator=gen) for n in ("q", "k", "v", "f", "gate")}
    tok["beta"] = torch.randn(N, H, generator=gen)
    return {n: t.to(device=device, dtype=dtype) for n, t in tok.items()}


# Within 10x of the largest error measured (CPU interpreter and H200): fp16 small shapes reach
# 3.8e-6 (the kernels accumulate in fp32 like the reference, so they differ by fp32 rounding
# only), except where that rounding moves an output across an fp16 rounding boundary: one fp16
# step, 2^-10 relative (test_prefill_fp16_rounding_step); bf16 K3 shapes
# (H200 only) 3.1e-2 on prefill outputs, 7.8e-3 on decode outputs. fp32: prefill reaches 2.5e-5
# (chunk 64, CPU); decode, one recurrent step, 7.2e-7 on outputs of size ~2 (CPU), so it has a
# tolerance of its own.
TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.float16: dict(atol=3e-5, rtol=1e-3),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
DECODE_TOL_F32 = dict(atol=1e-5, rtol=1e-5)
COPIES = ("conv_state", "snap_conv")     # the conv windows hold input rows as they came: exact


def close(name, got, want, dtype, decode=False):
    if name in COPIES:
        assert torch.equal(got, want), f"{name}: the conv window's rows differ from the reference's"
        return
    tol = DECODE_TOL_F32 if decode and dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), **tol, msg=lambda m: f"{name}: {m}")


# ---- kda_decode ------------------------------------------------------------------------------

def run_decode(fn, tok, params, conv, state, slots, rows, lb, snaps):
    conv, state = conv.clone(), state.clone()
    snap_conv = snap_state = None
    if snaps:
        B, (_, H, K, _) = slots.shape[0], state.shape
        snap_conv = torch.full((B, rows, W - 1, 3 * H * K), 7.0, dtype=conv.dtype, device=conv.device)
        snap_state = torch.full((B, rows, H, K, K), 7.0, device=conv.device)
    out = fn(*(tok[n] for n in TOKEN_KEYS), *params.values(), conv, state, slots, rows, lb, EPS,
             snap_conv, snap_state)
    return out, conv, state, snap_conv, snap_state


def check_decode(H, K, B, rows, lb, snaps, dtype, device, seed, num_slots=6, pad=True, fn=kda_decode):
    gen = torch.Generator().manual_seed(seed)
    params, conv, state = make_layer(H, K, num_slots, dtype, device, gen)
    tok = make_tokens(B * rows, H, K, dtype, device, gen)
    ids = torch.randperm(num_slots, generator=gen)[:B]
    if pad:
        ids[1] = -1                                            # a padding request
    slots = ids.to(device)
    got = run_decode(fn, tok, params, conv, state, slots, rows, lb, snaps)
    want = run_decode(torch.ops.k31c.kda_decode, tok, params, conv, state, slots, rows, lb, snaps)
    for name, g, w in zip(("out", "conv_state", "recurrent", "snap_conv", "snap_state"), got, want):
        if g is not None:                # padding requests' snapshot rows stay 7 in both
            close(name, g, w, dtype, decode=True)


# the registered launcher
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("lb", [-5.0, None])
def test_decode_small(rows, lb):
    check_decode(H=2, K=16, B=3, rows=rows, lb=lb, snaps=rows > 1, dtype=torch.float32,
                 device=DEV, seed=rows + (lb is None), fn=kda_decode)


@pytest.mark.parametrize("kernel", ["split", "split-bv8"])
def test_decode_padding_rows_with_garbage_inputs(kernel):
    """A padding request's rows may hold anything (NaN here, as in graph-padded batches): its
    output rows are 0 as in the reference, and the live requests are unaffected."""
    H, K, B, rows = 2, 16, 3, 2
    gen = torch.Generator().manual_seed(21)
    params, conv, state = make_layer(H, K, 6, torch.float32, DEV, gen)
    tok = make_tokens(B * rows, H, K, torch.float32, DEV, gen)
    slots = torch.randperm(6, generator=gen)[:B].to(DEV)
    slots[1] = -1
    for t in tok.values():
        t[rows:2 * rows] = float("nan")                        # the padding request's rows
    fn = {"split": launch_kda_decode, "split-bv8": partial(launch_kda_decode, block_v=8)}[kernel]
    got = run_decode(fn, tok, params, conv, state, slots, rows, -5.0, True)
    want = run_decode(torch.ops.k31c.kda_decode, tok, params, conv, state, slots, rows, -5.0, True)
    assert not torch.isnan(got[0]).any() and bool((got[0][rows:2 * rows] == 0).all())
    for name, g, w in zip(("out", "conv_state", "recurrent", "snap_conv", "snap_state"), got, want):
        close(name, g, w, torch.float32, decode=True)


@pytest.mark.parametrize("lb", [-5.0, None])
def test_decode_value_tiles(lb):
    # 4 state programs per head, the gated norm as its own launch
    check_decode(H=2, K=32, B=3, rows=3, lb=lb, snaps=True, dtype=torch.float32, device=DEV,
                 seed=12, fn=partial(launch_kda_decode, block_v=8))


def test_decode_window_dtype_differs():
    """An fp32 conv window with fp16 inputs: the window's rows are loaded apart from the new rows
    (kda_common.window_rows' two-load form); the same-dtype tests take its one-load form."""
    H, K, B, rows = 2, 16, 3, 2
    gen = torch.Generator().manual_seed(31)
    params, conv, state = make_layer(H, K, 6, torch.float32, DEV, gen)
    tok = make_tokens(B * rows, H, K, torch.float16, DEV, gen)
    slots = torch.tensor([4, -1, 0], device=DEV)
    got = run_decode(kda_decode, tok, params, conv, state, slots, rows, -5.0, True)
    want = run_decode(torch.ops.k31c.kda_decode, tok, params, conv, state, slots, rows, -5.0, True)
    for name, g, w in zip(("out", "conv_state", "recurrent", "snap_conv", "snap_state"), got, want):
        close(name, g, w, torch.float16, decode=True)


def test_decode_k32_snapshots_fp16():
    check_decode(H=2, K=32, B=2, rows=4, lb=-5.0, snaps=True, dtype=torch.float16, device=DEV,
                 seed=11, fn=partial(launch_kda_decode, block_v=16))


def test_decode_tile_defaults():
    # per-R defaults measured on the H200 (BENCHMARKS.md, KDA); explicit knobs win
    assert decode_tile(1, 128) == (128, 4) and decode_tile(1, 64) == (64, 4) and decode_tile(4, 128) == (32, 2)
    assert decode_tile(4, 128, block_v=16) == (16, 2)
    assert decode_tile(1, 128, num_warps=8) == (128, 8)
    assert decode_tile(1, 32) == (32, 4)                       # capped at K
    with pytest.raises(ValueError, match="block_v"):
        decode_tile(1, 128, block_v=48)
    with pytest.raises(ValueError, match="num_warps"):
        decode_tile(1, 128, num_warps=3)


@pytest.mark.parametrize("rows,tile", [(1, (128, 4)), (4, (32, 2))])
def test_registered_launcher_runs_the_default_plan(rows, tile, monkeypatch):
    # the registered `k31c::kda_decode` launcher runs its launches at the per-R tile (R = 1: BV = K,
    # the norm fused into the state pass)
    import k31c.lowering.triton.kda_decode as kd
    seen = {}

    def fake(p, *a):
        seen.update(tile=(p.block_v, p.num_warps), stages=a[-1], unroll=p.unroll_rows)
        return a[0]
    monkeypatch.setattr(kd, "_run", fake)
    gen = torch.Generator().manual_seed(3)
    params, conv, state = make_layer(1, 128, 2, torch.float32, "cpu", gen)
    tok = make_tokens(2 * rows, 1, 128, torch.float32, "cpu", gen)
    kda_decode(*(tok[n] for n in TOKEN_KEYS), *params.values(), conv, state,
               torch.tensor([0, 1]), rows, -5.0, EPS, None, None)
    assert seen == dict(tile=tile, stages="psn", unroll=True)


# prep launch, lean state pass over V tiles (or whole heads, norm fused), norm
@pytest.mark.parametrize("rows,snaps", [(1, False), (1, True), (4, False), (4, True)])
@pytest.mark.parametrize("block_v", [8, 32])
def test_decode_split(rows, snaps, block_v):
    check_decode(H=2, K=32, B=3, rows=rows, lb=-5.0, snaps=snaps, dtype=torch.float32, device=DEV,
                 seed=20 + rows + block_v, num_slots=5,
                 fn=partial(launch_kda_decode, block_v=block_v))


def test_decode_split_softplus_fp16_rolled():
    check_decode(H=2, K=16, B=4, rows=3, lb=None, snaps=True, dtype=torch.float16, device=DEV,
                 seed=31, fn=partial(launch_kda_decode, block_v=8, norm_rows=4, unroll_rows=False))


def test_decode_plan_fuses_the_norm_for_whole_heads():
    from k31c.lowering.triton.kda_decode import plan
    assert plan(1, 128, 4, block_v=128).fuse_norm              # BV = K: no norm launch
    assert plan(1, 128, 4).fuse_norm and not plan(4, 128, 4).fuse_norm   # the defaults
    assert not plan(1, 128, 4, block_v=32).fuse_norm


def test_decode_pairs_the_state_pass_only_when_its_grid_fits_the_sms():
    from k31c.lowering.triton.kda_decode import plan
    one_row = plan(1, 128, 4)                       # BV = K: a program per (request, head)
    assert one_row.pairs(1, 96, 132) and not one_row.pairs(2, 96, 132)
    assert not plan(4, 128, 4).pairs(1, 96, 132)    # BV = 32: 384 programs at one request


def test_decode_rejects_bad_stages():
    with pytest.raises(ValueError, match="stages"):
        check_decode(H=2, K=16, B=2, rows=1, lb=-5.0, snaps=False, dtype=torch.float32,
                     device=DEV, seed=0, fn=partial(launch_kda_decode, stages="pxn"))


@pytest.mark.skipif(not CUDA, reason="K3 shapes run on the GPU only")
@pytest.mark.parametrize("rows,snaps", [(1, False), (4, True)])
def test_decode_k3_shapes_cuda(rows, snaps):
    check_decode(H=96, K=128, B=16, rows=rows, lb=-5.0, snaps=snaps, dtype=torch.bfloat16,
                 device="cuda", seed=rows, num_slots=20, fn=kda_decode)


@pytest.mark.skipif(not CUDA, reason="K3 shapes run on the GPU only")
@pytest.mark.parametrize("num_warps", [4, 8])
def test_decode_k3_shapes_whole_head_cuda(num_warps):
    """BV = K: one program a head with the gated norm fused (bench_kda's sweep times it)."""
    check_decode(H=96, K=128, B=16, rows=1, lb=-5.0, snaps=False, dtype=torch.bfloat16, device="cuda",
                 seed=3, num_slots=20, fn=partial(launch_kda_decode, block_v=128, num_warps=num_warps))


@pytest.mark.skipif(not CUDA, reason="PDL needs the GPU")
@pytest.mark.parametrize("rows,snaps", [(1, False), (4, True)])
def test_decode_state_first_is_the_plain_launch_cuda(rows, snaps):
    """The state pass launched as the prep's PDL dependent (its state loaded before the wait)
    gives bit for bit what the plain launch order gives, and both match the reference."""
    gen = torch.Generator().manual_seed(40 + rows)
    params, conv, state = make_layer(96, 128, 20, torch.bfloat16, "cuda", gen)
    tok = make_tokens(16 * rows, 96, 128, torch.bfloat16, "cuda", gen)
    ids = torch.randperm(20, generator=gen)[:16]
    ids[3] = -1
    slots = ids.cuda()
    paired, plain = (run_decode(partial(launch_kda_decode, state_first=f), tok, params, conv, state,
                                slots, rows, -5.0, snaps) for f in (True, False))
    want = run_decode(torch.ops.k31c.kda_decode, tok, params, conv, state, slots, rows, -5.0, snaps)
    for name, a, b, w in zip(("out", "conv_state", "recurrent", "snap_conv", "snap_state"), paired,
                             plain, want):
        if a is not None:
            assert torch.equal(a, b), name
            close(name, a, w, torch.bfloat16)


def test_decode_rejects_bad_layout():
    gen = torch.Generator().manual_seed(0)
    params, conv, state = make_layer(2, 16, 3, torch.float32, "cpu", gen)
    tok = make_tokens(2, 2, 16, torch.float32, "cpu", gen)
    with pytest.raises(ValueError, match="recurrent"):
        kda_decode(*(tok[n] for n in TOKEN_KEYS), *params.values(), conv,
                   state.transpose(2, 3), torch.tensor([0, 1]), 1, -5.0, EPS, None, None)
    with pytest.raises(ValueError, match="rows"):
        kda_decode(*(tok[n] for n in TOKEN_KEYS), *params.values(), conv, state,
                   torch.tensor([0, 1]), 3, -5.0, EPS, None, None)


# ---- kda_prefill -----------------------------------------------------------------------------

def run_prefill(fn, tok, params, conv, state, slots, cu, lb, chunk):
    conv, state = conv.clone(), state.clone()
    out = fn(*(tok[n] for n in TOKEN_KEYS), *params.values(), conv, state, slots, cu, lb, EPS, chunk)
    return out, conv, state


def check_prefill(H, K, lens, slot_ids, lb, chunk, dtype, device, seed, num_slots=6, fn=kda_prefill):
    gen = torch.Generator().manual_seed(seed)
    params, conv, state = make_layer(H, K, num_slots, dtype, device, gen)
    tok = make_tokens(sum(lens), H, K, dtype, device, gen)
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    slots = torch.tensor(slot_ids, device=device)
    got = run_prefill(fn, tok, params, conv, state, slots, cu, lb, chunk)
    want = run_prefill(torch.ops.k31c.kda_prefill, tok, params, conv, state, slots, cu, lb, chunk)
    for name, g, w in zip(("out", "conv_state", "recurrent"), got, want):
        close(name, g, w, dtype)


@pytest.mark.parametrize("lb", [-5.0, None])
def test_prefill_varlen(lb):
    # lengths: several chunks with a ragged tail, shorter than the conv window, empty, one chunk
    check_prefill(H=2, K=16, lens=[37, 2, 0, 16], slot_ids=[4, 0, 2, 5], lb=lb, chunk=32,
                  dtype=torch.float32, device=DEV, seed=1 + (lb is None))


def test_prefill_chunk32_k32_padding():
    check_prefill(H=2, K=32, lens=[45, 9], slot_ids=[3, -1], lb=-5.0, chunk=16,
                  dtype=torch.float32, device=DEV, seed=5)


def test_prefill_value_tiles():
    # the state pass split over 2 V tiles; the gated norm then runs as its own launch
    check_prefill(H=2, K=32, lens=[21, 40], slot_ids=[-1, 1], lb=-5.0, chunk=16,
                  dtype=torch.float32, device=DEV, seed=8, fn=partial(launch_kda_prefill, block_v=16))


def test_prefill_fp16():
    check_prefill(H=2, K=16, lens=[20, 13], slot_ids=[1, 2], lb=-5.0, chunk=16,
                  dtype=torch.float16, device=DEV, seed=6)


def test_prefill_fp16_rounding_step():
    """A ragged fp16 case where one output lands one fp16 step (2^-10 relative) from the
    reference's: the fp32 math rounds the other way at an fp16 boundary (the tolerance above)."""
    check_prefill(H=2, K=16, lens=[37, 2, 0, 16], slot_ids=[4, 0, 2, 5], lb=-5.0, chunk=32,
                  dtype=torch.float16, device=DEV, seed=74)


@pytest.mark.parametrize("lb", [-5.0, None])
def test_prefill_four_block_chunks(lb):
    """Chunks of 64 rows (four 16-row blocks: the blocked (I + M)^-1 with every off-diagonal
    block and the solutions written back in descending order), ragged tails, a padding
    request."""
    check_prefill(H=2, K=16, lens=[150, 3, 64, 70], slot_ids=[2, 5, -1, 0], lb=lb, chunk=64,
                  dtype=torch.float32, device=DEV, seed=80 + (lb is None))


@pytest.mark.parametrize("rows", [2, 32, 64])
def test_prefill_conv_rows(rows):
    """The conv pass with other rows per program than the chunk pass's 16-row blocks: a request's
    first block reads the cached window, the later ones only its own rows (2 rows: blocks
    shorter than the window; 64: the whole chunk); ragged tails, an empty and a padding request.
    A bad value is refused."""
    check_prefill(H=2, K=16, lens=[150, 3, 0, 70], slot_ids=[2, 5, 1, -1], lb=-5.0, chunk=64,
                  dtype=torch.float32, device=DEV, seed=90 + rows,
                  fn=partial(launch_kda_prefill, conv_rows=rows))
    with pytest.raises(ValueError, match="conv_rows"):
        check_prefill(H=2, K=16, lens=[4], slot_ids=[1], lb=-5.0, chunk=16, dtype=torch.float32,
                      device=DEV, seed=0, fn=partial(launch_kda_prefill, conv_rows=32))


def test_prefill_doubling_inverse_blocks():
    """The chunk pass's diagonal blocks inverted by doubling: chunk 32 (two blocks), several chunks
    with a ragged tail, a padding request and an empty one, the unbounded gate (a truncated
    doubling fails these)."""
    check_prefill(H=2, K=16, lens=[37, 2, 0, 16], slot_ids=[4, 0, 2, 5], lb=-5.0, chunk=32,
                  dtype=torch.float32, device=DEV, seed=11)
    check_prefill(H=2, K=32, lens=[45, 9], slot_ids=[3, -1], lb=None, chunk=16,
                  dtype=torch.float32, device=DEV, seed=12)


def test_prefill_plan_names_a_bad_inverse_precision():
    """inverse_precision takes only fp32-accurate dot precisions; another value is named."""
    from k31c.lowering.targets import get_target
    from k31c.lowering.triton.kda_prefill import plan
    assert plan(get_target("h200"), 1, 16, 128, 4, torch.bfloat16, -5.0).inverse_precision == "tf32x3"
    with pytest.raises(ValueError, match="inverse_precision"):
        plan(get_target("h200"), 1, 16, 128, 4, torch.bfloat16, -5.0, inverse_precision="tf32")


def test_prefill_stages():
    """With V whole there is no norm launch: the conv, chunk and state passes are the whole prefill;
    anything but letters of "vcsn" is refused."""
    check_prefill(H=2, K=16, lens=[20, 13], slot_ids=[1, 2], lb=-5.0, chunk=16,
                  dtype=torch.float32, device=DEV, seed=9, fn=partial(launch_kda_prefill, stages="vcs"))
    with pytest.raises(ValueError, match="stages"):
        check_prefill(H=2, K=16, lens=[4], slot_ids=[1], lb=-5.0, chunk=16, dtype=torch.float32,
                      device=DEV, seed=0, fn=partial(launch_kda_prefill, stages="vcx"))


@pytest.mark.skipif(not CUDA, reason="K3 shapes run on the GPU only")
@pytest.mark.parametrize("lb", [-5.0, None])
def test_prefill_k3_shapes_cuda(lb):
    check_prefill(H=96, K=128, lens=[300, 1, 700, 64], slot_ids=[3, 7, -1, 0], lb=lb, chunk=64,
                  dtype=torch.bfloat16, device="cuda", seed=7, num_slots=8, fn=launch_kda_prefill)


@pytest.mark.parametrize("w", [2, 3])
def test_other_conv_widths(w, monkeypatch):
    """A short conv of 2 or 3 taps (K3.1 has 4; bench_kda times the chunk pass at 2 to price the
    taps): the window of 1-2 rows, prefill and decode with snapshots."""
    import sys
    monkeypatch.setattr(sys.modules[__name__], "W", w)
    check_prefill(H=2, K=16, lens=[37, 2, 0, 16], slot_ids=[4, 0, 2, 5], lb=-5.0, chunk=32,
                  dtype=torch.float32, device=DEV, seed=60 + w)
    check_decode(H=2, K=16, B=3, rows=2, lb=None, snaps=True, dtype=torch.float32, device=DEV,
                 seed=62 + w)


def test_prefill_rejects_bad_chunk():
    gen = torch.Generator().manual_seed(0)
    params, conv, state = make_layer(2, 16, 3, torch.float32, "cpu", gen)
    tok = make_tokens(4, 2, 16, torch.float32, "cpu", gen)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="chunk_size"):
        kda_prefill(*(tok[n] for n in TOKEN_KEYS), *params.values(), conv, state,
                    torch.tensor([0]), cu, -5.0, EPS, 24)


def test_decode_rejects_strided_slots():
    gen = torch.Generator().manual_seed(22)
    params, conv, state = make_layer(2, 16, 6, torch.float32, DEV, gen)
    tok = make_tokens(3, 2, 16, torch.float32, DEV, gen)
    slots = torch.arange(6, device=DEV)[::2]                    # 3 requests, stride 2
    with pytest.raises(ValueError, match="slots"):
        run_decode(kda_decode, tok, params, conv, state, slots, 1, -5.0, False)
