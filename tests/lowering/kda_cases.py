"""The KDA kernel tests' shared cases (this folder is on sys.path, so the test files import it as
`kda_cases`): one layer's parameters, caches and tokens drawn at random, each Triton entry point
run beside the reference op (torch.ops.k31c.*) on copies of the same caches, and the comparison
with tolerances near the measured error.

On CPU the kernels run under the Triton interpreter at small shapes (H=2, K=16/32, W=4); on a GPU
the same tests also run at K3 shapes (96 heads x 128) in bf16."""
import torch

import k31c.graph.ops.kda  # noqa: F401  (registers torch.ops.k31c.kda_*)
from k31c.lowering.triton.kda_decode import kda_decode
from k31c.lowering.triton.kda_prefill import kda_prefill

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
