"""Triton `kda_decode` (the registered launcher and its plans) vs the reference op on fresh random
inputs: outputs, the written-back conv windows and recurrent states, and the per-row snapshots
(kda_cases.py draws and compares them)."""
from functools import partial

import pytest
import torch

from kda_cases import (CUDA, DEV, EPS, TOKEN_KEYS, check_decode, close, make_layer, make_tokens,
                       run_decode)
from k31c.lowering.triton.kda_decode import decode_tile, kda_decode, launch_kda_decode


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


def test_decode_rejects_strided_slots():
    gen = torch.Generator().manual_seed(22)
    params, conv, state = make_layer(2, 16, 6, torch.float32, DEV, gen)
    tok = make_tokens(3, 2, 16, torch.float32, DEV, gen)
    slots = torch.arange(6, device=DEV)[::2]                    # 3 requests, stride 2
    with pytest.raises(ValueError, match="slots"):
        run_decode(kda_decode, tok, params, conv, state, slots, 1, -5.0, False)
