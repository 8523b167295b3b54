"""KDA ops and block (spec/model.md §4): chunked == recurrence, prefill continuation, varlen
batches, multi-row decode with snapshots, both gate forms, and an independent per-token oracle."""
import math

import pytest
import torch

from k31c.config import preset
from k31c.graph.blocks.kda import KimiDeltaAttention
from k31c.graph.ops.kda import kda_chunked, kda_gate, kda_recurrence, l2_normalize
from k31c.graph.step import KDALayerState, KDASnapshots, step_meta

H, K, W = 2, 16, 4
P = H * K
EPS = 1e-5
TOKEN_KEYS = ("q", "k", "v", "f", "beta", "gate")


def rand_params(gen):
    return dict(conv_weight=torch.randn(3 * P, W, generator=gen) * 0.5,
                A_log=torch.empty(H).uniform_(1, 16, generator=gen).log(),
                dt_bias=torch.randn(P, generator=gen),
                o_norm_weight=1 + 0.1 * torch.randn(K, generator=gen))


def rand_tokens(T, gen):
    t = {name: torch.randn(T, P, generator=gen) for name in ("q", "k", "v", "f", "gate")}
    t["beta"] = torch.randn(T, H, generator=gen)
    return t


def rand_state(num_slots, gen):
    return (torch.randn(num_slots, W - 1, 3 * P, generator=gen),
            0.5 * torch.randn(num_slots, H, K, K, generator=gen))


def take(tok, rows):
    return {n: t[rows] for n, t in tok.items()}


def prefill(tok, prm, conv, rec, slots, lens, lb, chunk=16):
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    return torch.ops.k31c.kda_prefill(*(tok[n] for n in TOKEN_KEYS), *prm.values(), conv, rec,
                                      torch.tensor(slots), cu, lb, EPS, chunk)


def decode(tok, prm, conv, rec, slots, rows, lb, snap_conv=None, snap_state=None):
    return torch.ops.k31c.kda_decode(*(tok[n] for n in TOKEN_KEYS), *prm.values(), conv, rec,
                                     torch.tensor(slots), rows, lb, EPS, snap_conv, snap_state)


def oracle(tok, prm, conv_hist, state, lb):
    """Hand-written per-token, per-head loop in float64 (spec §4.2-4.5), independent of the op."""
    d = {n: t.double() for n, t in {**tok, **prm}.items()}
    H, K, W = d["A_log"].numel(), d["o_norm_weight"].numel(), d["conv_weight"].shape[1]
    P = H * K
    window = [row for row in conv_hist.double()]
    S = state.double().clone()
    out = []
    for t in range(d["q"].shape[0]):
        window.append(torch.cat([d["q"][t], d["k"][t], d["v"][t]]))
        y = sum(d["conv_weight"][:, j] * window[j] for j in range(W))
        window = window[1:]
        y = y * torch.sigmoid(y)
        row = []
        for h in range(H):
            sl = slice(h * K, (h + 1) * K)
            qh, kh, vh = y[sl], y[P + h * K:P + (h + 1) * K], y[2 * P + h * K:2 * P + (h + 1) * K]
            qh = qh / torch.sqrt(qh @ qh + 1e-6)
            kh = kh / torch.sqrt(kh @ kh + 1e-6)
            x = d["f"][t, sl] + d["dt_bias"][sl]
            a = math.exp(d["A_log"][h].item())
            gh = -a * torch.log1p(torch.exp(x)) if lb is None else lb / (1 + torch.exp(-a * x))
            bh = 1 / (1 + math.exp(-d["beta"][t, h].item()))
            Sh = torch.diag(torch.exp(gh)) @ S[h]
            Sh = Sh + bh * torch.outer(kh, vh - Sh.T @ kh)
            S[h] = Sh
            oh = Sh.T @ (qh * K ** -0.5)
            oh = oh / torch.sqrt((oh * oh).mean() + EPS) * d["o_norm_weight"] \
                * torch.sigmoid(d["gate"][t, sl])
            row.append(oh)
        out.append(torch.cat(row))
    return torch.stack(out), torch.stack(window), S


def close(a, b, tol=1e-4):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("T", [1, 7, 16, 17, 48, 100])
@pytest.mark.parametrize("lb", [-5.0, None])
def test_chunked_matches_recurrence(T, lb):
    gen = torch.Generator().manual_seed(T)
    q, k = (l2_normalize(torch.randn(T, H, K, generator=gen)) for _ in range(2))
    v = torch.randn(T, H, K, generator=gen)
    g = kda_gate(torch.randn(T, P, generator=gen), torch.rand(H, generator=gen) * 2.7,
                 torch.randn(P, generator=gen), lb)
    beta = torch.rand(T, H, generator=gen)
    S0 = torch.randn(H, K, K, generator=gen)
    o_ref, S_ref = kda_recurrence(q, k, v, g, beta, K ** -0.5, S0)
    o, S = kda_chunked(q, k, v, g, beta, K ** -0.5, S0, 16)
    close(o, o_ref, 1e-5)
    close(S, S_ref, 1e-5)
    assert not torch.equal(S, S0)


@pytest.mark.parametrize("lb", [-5.0, None])
def test_prefill_matches_independent_oracle(lb):
    gen = torch.Generator().manual_seed(1)
    prm, tok = rand_params(gen), rand_tokens(37, gen)
    conv, rec = rand_state(3, gen)
    conv0, rec0 = conv.clone(), rec.clone()
    out = prefill(tok, prm, conv, rec, [1], [37], lb)
    o_ref, win_ref, S_ref = oracle(tok, prm, conv0[1], rec0[1], lb)
    close(out, o_ref)
    close(conv[1], win_ref, 0)
    close(rec[1], S_ref)
    for s in (0, 2):  # other slots untouched
        assert torch.equal(conv[s], conv0[s]) and torch.equal(rec[s], rec0[s])


@pytest.mark.parametrize("split", [2, 16, 29])
def test_prefill_in_two_parts_equals_one(split):
    gen = torch.Generator().manual_seed(split)
    prm, tok = rand_params(gen), rand_tokens(40, gen)
    conv_a, rec_a = rand_state(2, gen)
    conv_b, rec_b = conv_a.clone(), rec_a.clone()
    whole = prefill(tok, prm, conv_a, rec_a, [1], [40], -5.0)
    first = prefill(take(tok, slice(0, split)), prm, conv_b, rec_b, [1], [split], -5.0)
    rest = prefill(take(tok, slice(split, 40)), prm, conv_b, rec_b, [1], [40 - split], -5.0)
    close(torch.cat([first, rest]), whole)
    close(conv_b, conv_a, 0)
    close(rec_b, rec_a)


def test_varlen_batch_equals_each_alone():
    gen = torch.Generator().manual_seed(2)
    lens, slots = [5, 33, 0, 1], [2, 0, 4, 3]
    prm, tok = rand_params(gen), rand_tokens(sum(lens), gen)
    conv, rec = rand_state(5, gen)
    conv1, rec1 = conv.clone(), rec.clone()
    out = prefill(tok, prm, conv, rec, slots, lens, None)
    start = 0
    for n, s in zip(lens, slots):
        alone = prefill(take(tok, slice(start, start + n)), prm, conv1, rec1, [s], [n], None)
        close(out[start:start + n], alone)
        start += n
    close(conv, conv1, 0)
    close(rec, rec1)


@pytest.mark.parametrize("lb", [-5.0, None])
def test_decode_rows_sequential_and_prefill(lb):
    gen = torch.Generator().manual_seed(3)
    B, R, slots = 2, 4, [3, 1]
    prm, tok = rand_params(gen), rand_tokens(B * R, gen)
    conv, rec = rand_state(4, gen)
    states = [(conv.clone(), rec.clone()) for _ in range(3)]
    snap_conv, snap_state = torch.zeros(B, R, W - 1, 3 * P), torch.zeros(B, R, H, K, K)
    multi = decode(tok, prm, *states[0], slots, R, lb, snap_conv, snap_state)
    c1, r1 = states[1]
    single = []
    for r in range(R):
        single.append(decode(take(tok, torch.tensor([r, R + r])), prm, c1, r1, slots, 1, lb))
        for b, s in enumerate(slots):  # snapshot r = state after row r
            close(snap_conv[b, r], c1[s], 0)
            close(snap_state[b, r], r1[s])
    single = torch.stack(single, 1).flatten(0, 1)
    close(multi, single)
    as_prefill = prefill(tok, prm, *states[2], slots, [R, R], lb)
    close(multi, as_prefill)
    for c, r in states[1:]:
        close(states[0][0], c, 0)
        close(states[0][1], r)
    o_ref, win_ref, S_ref = oracle(take(tok, slice(0, R)), prm, conv[3], rec[3], lb)
    close(multi[:R], o_ref)
    close(states[0][1][3], S_ref)


def test_padding_request_touches_nothing():
    gen = torch.Generator().manual_seed(4)
    prm, tok = rand_params(gen), rand_tokens(6, gen)
    conv, rec = rand_state(2, gen)
    conv0, rec0 = conv.clone(), rec.clone()
    out = decode(tok, prm, conv, rec, [-1, 0], 3, -5.0)
    assert torch.equal(out[:3], torch.zeros(3, P))
    assert torch.equal(conv[1], conv0[1]) and torch.equal(rec[1], rec0[1])
    close(out[3:], oracle(take(tok, slice(3, 6)), prm, conv0[0], rec0[0], -5.0)[0])


def test_bf16_smoke():
    gen = torch.Generator().manual_seed(5)
    prm, tok = rand_params(gen), rand_tokens(40, gen)
    tok16 = {n: t.bfloat16() for n, t in tok.items()}
    conv, rec = rand_state(1, gen)
    conv16, rec16 = conv.bfloat16(), rec.clone()
    ref = prefill({n: t.float() for n, t in tok16.items()}, prm, conv16.float(), rec.clone(), [0], [40], -5.0)
    out = prefill(tok16, prm, conv16, rec16, [0], [40], -5.0)
    assert out.dtype == torch.bfloat16 and conv16.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    out = decode(take(tok16, slice(0, 2)), prm, conv16, rec16, [0], 2, -5.0)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


# ---- the block ---------------------------------------------------------------------------------

def block_and_state(lb, full_rank, dtype="float32", seed=0):
    cfg = preset("tiny").replace(gate_lower_bound=lb, use_full_rank_gate=full_rank, dtype=dtype)
    block = KimiDeltaAttention(cfg)
    block.reset_parameters(torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed + 1)
    Pc, Wc = cfg.kda_proj_dim, cfg.short_conv_kernel_size
    conv = torch.randn(3, Wc - 1, 3 * Pc, generator=gen).to(cfg.torch_dtype)
    rec = 0.5 * torch.randn(3, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim, generator=gen)
    return cfg, block, KDALayerState(conv, rec)


def meta(slots, lens):
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    return step_meta(slot_mapping=[], block_table=torch.zeros(len(slots), 1), row_req=[], row_len=[],
                     kda_slots=slots, cu_seqlens=cu)


def test_block_parameter_names():
    _, block, _ = block_and_state(-5.0, True)
    shapes = {n: tuple(p.shape) for n, p in block.state_dict().items()}
    assert shapes["q_conv1d.weight"] == (128, 1, 4) and shapes["g_proj.weight"] == (128, 256)
    assert shapes["A_log"] == (4,) and shapes["dt_bias"] == (128,) and shapes["o_norm.weight"] == (32,)
    assert shapes["f_a_proj.weight"] == (32, 256) and shapes["f_b_proj.weight"] == (128, 32)
    assert shapes["b_proj.weight"] == (4, 256) and shapes["o_proj.weight"] == (256, 128)
    _, low, _ = block_and_state(-5.0, False)
    assert "g_a_proj.weight" in low.state_dict() and "g_proj.weight" not in low.state_dict()
    assert block.A_log.dtype == torch.float32 and (block.A_log.exp() >= 1).all()
    dt = torch.nn.functional.softplus(block.dt_bias)
    assert (dt >= 1e-4 * 0.999).all() and (dt <= 0.1 * 1.001).all()


@pytest.mark.parametrize("lb", [-5.0, None])
@pytest.mark.parametrize("full_rank", [True, False])
def test_block_prefill_decode_and_oracle(lb, full_rank):
    cfg, block, state = block_and_state(lb, full_rank)
    x = torch.randn(2 * 9, cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    conv0, rec0 = state.conv.clone(), state.recurrent.clone()
    ref_state = KDALayerState(state.conv.clone(), state.recurrent.clone())
    with torch.no_grad():
        whole = block(x, ref_state, meta([2, 0], [9, 9]), "prefill")
        # the same tokens as a 6-token prefill then a 3-row verify step
        first = block(torch.cat([x[:6], x[9:15]]), state, meta([2, 0], [6, 6]), "prefill")
        snaps = KDASnapshots(torch.zeros(2, 3, *state.conv.shape[1:]),
                             torch.zeros(2, 3, *state.recurrent.shape[1:]))
        rest = block(torch.cat([x[6:9], x[15:18]]), state, meta([2, 0], [3, 3]), "decode", rows=3,
                     snapshots=snaps)
    close(torch.cat([first[:6], rest[:3], first[6:], rest[3:]]), whole)
    close(state.conv, ref_state.conv, 1e-5)  # projections of different row counts round differently
    close(state.recurrent, ref_state.recurrent)
    close(snaps.recurrent[:, -1], state.recurrent[[2, 0]])
    close(snaps.conv[:, -1], state.conv[[2, 0]], 0)
    # block == o_proj(independent oracle on the block's own projections), request in slot 2
    with torch.no_grad():
        xs = x[:9]
        tok = dict(q=block.q_proj(xs), k=block.k_proj(xs), v=block.v_proj(xs),
                   f=block.f_b_proj(block.f_a_proj(xs)), beta=block.b_proj(xs),
                   gate=block.output_gate_logits(xs))
        prm = dict(conv_weight=block.conv_weight(), A_log=block.A_log, dt_bias=block.dt_bias,
                   o_norm_weight=block.o_norm.weight)
        o_ref, _, _ = oracle(tok, prm, conv0[2], rec0[2], lb)
    close(whole[:9], o_ref.float() @ block.o_proj.weight.T)


def test_block_bf16_close_to_fp32():
    cfg, block32, state32 = block_and_state(-5.0, True)
    _, block16, state16 = block_and_state(-5.0, True, dtype="bfloat16")
    block16.load_state_dict(block32.state_dict())
    state32.conv.copy_(state16.conv.float())  # both start from the same bf16-exact window
    x = torch.randn(12, cfg.hidden_size, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        y32 = block32(x, state32, meta([1], [12]), "prefill")
        y16 = block16(x.bfloat16(), state16, meta([1], [12]), "prefill")
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.float(), y32, rtol=5e-2, atol=5e-3)
    torch.testing.assert_close(state16.recurrent, state32.recurrent, rtol=5e-2, atol=2e-2)


def test_block_rejects_unknown_mode():
    cfg, block, state = block_and_state(-5.0, True)
    with pytest.raises(ValueError, match="mode"):
        block(torch.randn(2, cfg.hidden_size), state, meta([0], [2]), "verify")


# ---- argument checks and op registration ------------------------------------------------------

def small_case(gen, T=5, num_slots=2):
    prm, tok = rand_params(gen), rand_tokens(T, gen)
    conv, rec = rand_state(num_slots, gen)
    return tok, prm, conv, rec


PREFILL_BAD = [
    ("q", lambda a: a.update(q=a["q"][:, :-1])),
    ("beta", lambda a: a.update(beta=a["beta"][:, :1])),
    ("conv_weight", lambda a: a.update(conv_weight=a["conv_weight"][:P])),
    ("dt_bias", lambda a: a.update(dt_bias=a["dt_bias"][:-1])),
    ("conv_state", lambda a: a.update(conv_state=a["conv_state"][:, :1])),
    ("recurrent", lambda a: a.update(recurrent=a["recurrent"].double())),
    ("recurrent", lambda a: a.update(recurrent=a["recurrent"][:1])),
    ("slots", lambda a: a.update(slots=torch.tensor([5]))),
    ("slots", lambda a: a.update(slots=a["slots"].int())),
    ("cu_seqlens", lambda a: a.update(cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))),
    ("cu_seqlens", lambda a: a.update(cu_seqlens=torch.tensor([0, 5, 5], dtype=torch.int32))),
    ("chunk_size", lambda a: a.update(chunk_size=0)),
]


@pytest.mark.parametrize("name,spoil", PREFILL_BAD)
def test_prefill_bad_arguments(name, spoil):
    tok, prm, conv, rec = small_case(torch.Generator().manual_seed(9))
    args = dict(**tok, **prm, conv_state=conv, recurrent=rec, slots=torch.tensor([1]),
                cu_seqlens=torch.tensor([0, 5], dtype=torch.int32), lower_bound=-5.0, eps=EPS,
                chunk_size=16)
    spoil(args)
    with pytest.raises(ValueError, match=name):
        torch.ops.k31c.kda_prefill(**args)


DECODE_BAD = [
    ("rows", lambda a: a.update(rows=2)),
    ("gate", lambda a: a.update(gate=a["gate"][:1])),
    ("A_log", lambda a: a.update(A_log=a["A_log"][None])),
    ("slots", lambda a: a.update(slots=torch.tensor([0, 0]))),
    ("snap_conv", lambda a: a.update(snap_state=torch.zeros(2, 1, H, K, K))),
    ("snap_state", lambda a: a.update(snap_conv=torch.zeros(2, 1, W - 1, 3 * P),
                                      snap_state=torch.zeros(2, 2, H, K, K))),
]


@pytest.mark.parametrize("name,spoil", DECODE_BAD)
def test_decode_bad_arguments(name, spoil):
    tok, prm, conv, rec = small_case(torch.Generator().manual_seed(10), T=2)
    args = dict(**tok, **prm, conv_state=conv, recurrent=rec, slots=torch.tensor([1, 0]), rows=1,
                lower_bound=None, eps=EPS, snap_conv=None, snap_state=None)
    spoil(args)
    with pytest.raises(ValueError, match=name):
        torch.ops.k31c.kda_decode(**args)


def test_opcheck():
    gen = torch.Generator().manual_seed(11)
    tok, prm, conv, rec = small_case(gen, T=4)
    inputs = (*(tok[n] for n in TOKEN_KEYS), *prm.values(), conv, rec)
    cu = torch.tensor([0, 1, 4], dtype=torch.int32)
    torch.library.opcheck(torch.ops.k31c.kda_prefill.default,
                          (*inputs, torch.tensor([1, 0]), cu, -5.0, EPS, 2))
    snaps = (torch.zeros(2, 2, W - 1, 3 * P), torch.zeros(2, 2, H, K, K))
    torch.library.opcheck(torch.ops.k31c.kda_decode.default,
                          (*inputs, torch.tensor([1, 0]), 2, None, EPS, *snaps))
    torch.library.opcheck(torch.ops.k31c.kda_decode.default,
                          (*inputs, torch.tensor([0, 1]), 2, None, EPS, None, None))
