"""Model-level oracles on the tiny config (spec/model.md §9.5): prefill-then-decode equals one
long prefill, chunked prefill equals one prefill, batches equal single requests, verification
rows equal sequential decoding, and rollback restores the KDA state exactly."""
import pytest
import torch

import tiny_model
from k31c.runtime.engine import Engine
from tiny_model import close

LENGTHS = [1, 7, 16, 17, 48, 100]


def make_model(seed=0, **changes):
    # small AttnRes projections: non-trivial residual mixing for the oracles below
    return tiny_model.make_model(seed, res_std=0.05, **changes)


def tokens(n, seed=1, vocab=512):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def long_logits(model):
    eng = Engine(model, max_requests=4, max_seq_len=256)
    toks = tokens(max(LENGTHS) + 8)
    return toks, eng.prefill_logits(toks)


def test_logits_are_informative(long_logits):
    _, ref = long_logits
    assert torch.isfinite(ref).all()
    assert ref.std(dim=-1).min() > 0  # not constant rows


@pytest.mark.parametrize("prefix", LENGTHS)
def test_prefill_then_decode_equals_long_prefill(model, long_logits, prefix):
    toks, ref = long_logits
    eng = Engine(model, max_requests=4, max_seq_len=256)
    rid = eng.add_request()
    got = [eng.prefill([rid], [toks[:prefix]])]
    for t in toks[prefix:prefix + 6]:
        got.append(eng.decode([rid], [t]))
    got = torch.cat(got)
    close(got, ref[:prefix + 6])


def test_chunked_prefill_equals_one_prefill(model, long_logits):
    toks, ref = long_logits
    eng = Engine(model, max_requests=4, max_seq_len=256)
    rid = eng.add_request()
    parts = [toks[:17], toks[17:48], toks[48:100]]
    got = torch.cat([eng.prefill([rid], [p]) for p in parts])
    close(got, ref[:100])


def test_batched_requests_equal_single(model):
    eng = Engine(model, max_requests=4, max_seq_len=256)
    prompts = [tokens(n, seed=10 + n) for n in (5, 33, 17)]
    singles = [Engine(model, max_requests=1, max_seq_len=256).prefill_logits(p) for p in prompts]
    rids = [eng.add_request() for _ in prompts]
    got = eng.prefill(rids, prompts)
    close(got, torch.cat(singles))
    # then decode all three together, each against its own single-request run
    nxt = [3, 99, 200]
    batched = eng.decode(rids, nxt)
    for b, p in enumerate(prompts):
        solo = Engine(model, max_requests=1, max_seq_len=256)
        r = solo.add_request()
        solo.prefill([r], [p])
        close(batched[b], solo.decode([r], [nxt[b]]))


def kda_state(eng, rid):
    slot = eng.pool.requests[rid].slot
    return [(s.conv[slot].clone(), s.recurrent[slot].clone()) for s in eng.pool.kda]


@pytest.mark.parametrize("accepted", [1, 2, 4])
def test_verify_rows_equal_sequential_and_rollback_is_exact(model, accepted):
    prompt, drafts = tokens(20, seed=5), tokens(4, seed=6)
    seq = Engine(model, max_requests=2, max_seq_len=256)
    r = seq.add_request()
    seq.prefill([r], [prompt])
    seq_logits, seq_states = [], []
    for t in drafts:
        seq_logits.append(seq.decode([r], [t])[0])
        seq_states.append(kda_state(seq, r))

    ver = Engine(model, max_requests=2, max_seq_len=256)
    v = ver.add_request()
    ver.prefill([v], [prompt])
    logits, handle = ver.verify([v], [drafts])
    close(logits, torch.stack(seq_logits))
    ver.accept(handle, [accepted])
    assert ver.length(v) == len(prompt) + accepted
    snaps = handle[3]
    for (c, s), (c_seq, s_seq), snap in zip(kda_state(ver, v), seq_states[accepted - 1], snaps):
        # exactly the state verification computed after the last accepted row ...
        assert torch.equal(c, snap.conv[0, accepted - 1]) and torch.equal(s, snap.recurrent[0, accepted - 1])
        # ... which is the sequential state (up to GEMM rounding of a 4-row vs 1-row batch)
        close(c, c_seq, tol=1e-5)
        close(s, s_seq, tol=1e-5)
    # continuing after the rollback equals the sequential run that only saw accepted rows
    ref = Engine(model, max_requests=1, max_seq_len=256)
    q = ref.add_request()
    ref.prefill([q], [prompt + drafts[:accepted]])
    close(ver.decode([v], [7]), ref.decode([q], [7]))


def test_verify_batch_of_requests(model):
    eng = Engine(model, max_requests=3, max_seq_len=256)
    prompts = [tokens(9, seed=21), tokens(30, seed=22)]
    rows = [tokens(3, seed=23), tokens(3, seed=24)]
    rids = [eng.add_request() for _ in prompts]
    eng.prefill(rids, prompts)
    logits, handle = eng.verify(rids, rows)
    accepted = [1, 3]
    eng.accept(handle, accepted)
    nxt = [11, 222]
    after = eng.decode(rids, nxt)              # both requests continue from their accepted rows
    for b, (p, rr) in enumerate(zip(prompts, rows)):
        solo = Engine(model, max_requests=1, max_seq_len=256)
        s = solo.add_request()
        solo.prefill([s], [p])
        ref = torch.cat([solo.decode([s], [t]) for t in rr])
        close(logits[b * 3:(b + 1) * 3], ref)
        # after the rollback: the length, the KDA state and the next logits are those of a run
        # that only ever saw the accepted rows
        assert eng.length(rids[b]) == len(p) + accepted[b] + 1
        kept = Engine(model, max_requests=1, max_seq_len=256)
        k = kept.add_request()
        kept.prefill([k], [p + rr[:accepted[b]]])
        close(after[b:b + 1], kept.decode([k], [nxt[b]]))
        for (c, st), (c_ref, st_ref) in zip(kda_state(eng, rids[b]), kda_state(kept, k)):
            close(c, c_ref, tol=1e-5)
            close(st, st_ref, tol=1e-5)


@pytest.mark.parametrize("variant", [
    dict(index_n_heads=None, index_head_dim=None, index_topk=None),                  # Kimi K3: dense MLA
    dict(gate_lower_bound=None, use_full_rank_gate=False, attn_res_block_size=None,   # Kimi Linear style
         mla_use_output_gate=False, routed_expert_hidden_size=None, latent_moe_use_norm=False,
         hidden_act="silu", routed_scaling_factor=2.446),
    dict(num_expert_group=4, topk_group=2),
])
def test_relatives_prefill_then_decode(variant):
    m = make_model(seed=3, **variant)
    toks = tokens(40, seed=4)
    ref = Engine(m, max_requests=1, max_seq_len=128).prefill_logits(toks)
    eng = Engine(m, max_requests=1, max_seq_len=128)
    r = eng.add_request()
    got = [eng.prefill([r], [toks[:30]])] + [eng.decode([r], [t]) for t in toks[30:]]
    close(torch.cat(got), ref)


def test_bf16_runs_close_to_fp32():
    # Discrete choices (expert top-k, indexer top-k) flip under bf16 rounding and move a random
    # net's logits by O(1); with every expert selected and rows within index_topk the model is
    # smooth, so the comparison measures bf16 arithmetic, not flipped choices.
    smooth = dict(num_experts_per_token=8)
    m32 = make_model(seed=2, **smooth)
    m16 = make_model(seed=2, dtype="bfloat16", **smooth)
    toks = tokens(16, seed=8)
    a = Engine(m32, max_requests=1, max_seq_len=64).prefill_logits(toks)
    b = Engine(m16, max_requests=1, max_seq_len=64).prefill_logits(toks)
    assert torch.isfinite(b).all()
    close(b, a, tol=0.1)


def test_fp8_index_cache_prefill_then_decode(model, long_logits):
    """With the 132-byte FP8 index-key layout the keys are quantised identically on every path,
    so prefill-then-decode still equals one long prefill with that cache."""
    toks, _ = long_logits
    ref = Engine(model, max_requests=1, max_seq_len=256, index_cache="fp8").prefill_logits(toks[:60])
    eng = Engine(model, max_requests=1, max_seq_len=256, index_cache="fp8")
    r = eng.add_request()
    got = torch.cat([eng.prefill([r], [toks[:40]])] + [eng.decode([r], [t]) for t in toks[40:60]])
    close(got, ref)
    assert eng.pool.mla[0].index.dtype == torch.uint8
