"""Triton `kda_prefill` (the registered launcher and its plans) vs the reference op on fresh random
inputs: outputs and the written-back conv windows and recurrent states (kda_cases.py draws and
compares them)."""
from functools import partial

import pytest
import torch

import kda_cases
from kda_cases import CUDA, DEV, EPS, TOKEN_KEYS, check_decode, check_prefill, make_layer, make_tokens
from k31c.lowering.triton.kda_prefill import kda_prefill, launch_kda_prefill


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
    monkeypatch.setattr(kda_cases, "W", w)
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
