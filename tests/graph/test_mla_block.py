"""GatedMLA + LightningIndexer: absorbed == MHA form, a per-token oracle from the weights,
prefill-then-decode == one prefill, sparse == dense for short rows, Kimi K3 (no indexer) dense."""
from __future__ import annotations

import math

import pytest
import torch

from k31c.config import preset
from k31c.graph.blocks.mla import GatedMLA
from k31c.graph.ops.cache_write import index_row_bytes
from k31c.graph.step import MLALayerCache, step_meta

LENGTHS = [1, 7, 16, 17, 48, 100]
BLOCK = 16
NO_INDEXER = dict(index_n_heads=None, index_head_dim=None, index_topk=None)


def make_block(cfg, seed=0):
    block = GatedMLA(cfg)
    block.reset_parameters(torch.Generator().manual_seed(seed))
    with torch.no_grad():   # non-trivial norms so a swapped or skipped norm shows
        for name, p in block.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    return block.eval()


class Pool:
    """Requests sharing one shuffled block pool, caches pre-filled with random garbage."""

    def __init__(self, cfg, lengths, index="float32", seed=1):
        gen = torch.Generator().manual_seed(seed)
        need = [math.ceil(n / BLOCK) for n in lengths]
        num_blocks = sum(need) + 2
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        self.table = torch.full((len(lengths), max(need) + 1), -1, dtype=torch.int32)
        for b, n in enumerate(need):
            self.table[b, :n] = torch.tensor(perm[:n], dtype=torch.int32)
            perm = perm[n:]
        dt = cfg.torch_dtype
        latent = torch.randn(num_blocks, BLOCK, cfg.latent_dim, generator=gen).to(dt)
        if not cfg.has_indexer:
            idx = torch.zeros(0, dtype=dt)
        elif index == "fp8":
            idx = torch.randint(0, 255, (num_blocks, BLOCK * index_row_bytes(cfg.index_head_dim)),
                                generator=gen, dtype=torch.uint8)
        else:
            idx = torch.randn(num_blocks, BLOCK, cfg.index_head_dim, generator=gen).to(getattr(torch, index))
        self.cache = MLALayerCache(latent, idx)

    def meta(self, spans):
        """spans: (request, first, end) per request in row order; rows are positions first..end-1."""
        req, pos, cu = [], [], [0]
        for b, first, end in spans:
            req += [b] * (end - first)
            pos += list(range(first, end))
            cu.append(len(pos))
        pos_t = torch.tensor(pos, dtype=torch.int64)
        blocks = self.table[torch.tensor(req)].long().gather(1, (pos_t // BLOCK).unsqueeze(1)).squeeze(1)
        return step_meta(slot_mapping=blocks * BLOCK + pos_t % BLOCK, block_table=self.table, row_req=req,
                         row_len=pos_t + 1, kda_slots=torch.arange(self.table.shape[0]), cu_seqlens=cu)


def run(block, cfg, lengths, x, form, index="float32"):
    pool = Pool(cfg, lengths, index)
    meta = pool.meta([(b, 0, n) for b, n in enumerate(lengths)])
    with torch.no_grad():
        return block(x, pool.cache, meta, "prefill", attn_form=form)


def inputs(cfg, n, seed=2):
    return torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(seed)).to(cfg.torch_dtype)


def rel_err(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


# ---- an independent oracle: one request, one token at a time, straight from the weights --------

def oracle_request(block, cfg, x):
    """Per-token loop over one request (rows are positions 0..T-1): §5.2-§5.5 and §6.1-§6.3 as written."""
    w = {k: v.float() for k, v in block.state_dict().items()}
    h, dn, dr, dv, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                        cfg.v_head_dim, cfg.kv_lora_rank)
    eps = cfg.rms_norm_eps

    def rms(v, weight):
        return weight * v / torch.sqrt(v.pow(2).mean() + eps)

    x = x.float()
    c_q = [rms(w["q_a_proj.weight"] @ xt, w["q_a_layernorm.weight"]) for xt in x]
    kva = [w["kv_a_proj_with_mqa.weight"] @ xt for xt in x]
    c_kv = [rms(v[:r], w["kv_a_layernorm.weight"]) for v in kva]
    k_r = [v[r:] for v in kva]
    wkv = w["kv_b_proj.weight"].view(h, dn + dv, r)
    out = []
    for t in range(len(x)):
        visible = list(range(t + 1))
        if cfg.has_indexer:
            hi, di = cfg.index_n_heads, cfg.index_head_dim
            qi = (w["indexer.wq_b.weight"] @ c_q[t]).view(hi, di)
            wt = (w["indexer.weights_proj.weight"] @ x[t]) / math.sqrt(hi * di)

            def key(s):
                k = w["indexer.wk.weight"] @ x[s]
                k = (k - k.mean()) / torch.sqrt(k.var(unbiased=False) + cfg.index_key_norm_eps)
                return k * w["indexer.k_norm.weight"] + w["indexer.k_norm.bias"]

            score = {s: sum(float(wt[j]) * max(0.0, float(qi[j] @ key(s))) for j in range(hi)) for s in visible}
            visible = sorted(visible, key=lambda s: (score[s], s), reverse=True)[:cfg.index_topk]
        q = (w["q_b_proj.weight"] @ c_q[t]).view(h, dn + dr)
        heads = []
        for j in range(h):
            logits = torch.tensor([float(q[j, :dn] @ (wkv[j, :dn] @ c_kv[s]) + q[j, dn:] @ k_r[s])
                                   for s in visible]) / math.sqrt(dn + dr)
            p = torch.softmax(logits, 0)
            heads.append(sum(p[i] * (wkv[j, dn:] @ c_kv[s]) for i, s in enumerate(visible)))
        o = torch.cat(heads)
        if cfg.mla_use_output_gate:
            o = o * torch.sigmoid(w["g_proj.weight"] @ x[t])
        out.append(w["o_proj.weight"] @ o)
    return torch.stack(out)


# ---- tests ------------------------------------------------------------------------------------

def test_parameter_names_and_shapes_follow_hf_k3():
    cfg = preset("tiny")
    shapes = {k: tuple(v.shape) for k, v in GatedMLA(cfg).state_dict().items()}
    hq, dqk, r = 4, 48, 64
    assert shapes == {
        "q_a_proj.weight": (64, 256), "q_a_layernorm.weight": (64,), "q_b_proj.weight": (hq * dqk, 64),
        "kv_a_proj_with_mqa.weight": (r + 16, 256), "kv_a_layernorm.weight": (r,),
        "kv_b_proj.weight": (hq * (32 + 32), r), "o_proj.weight": (256, hq * 32),
        "g_proj.weight": (hq * 32, 256), "indexer.wq_b.weight": (4 * 32, 64),
        "indexer.wk.weight": (32, 256), "indexer.k_norm.weight": (32,), "indexer.k_norm.bias": (32,),
        "indexer.weights_proj.weight": (4, 256)}
    assert GatedMLA(cfg).indexer.k_norm.weight.dtype == torch.float32
    no_lora = GatedMLA(cfg.replace(q_lora_rank=None, mla_use_output_gate=False, **NO_INDEXER))
    names = set(no_lora.state_dict())
    assert "q_proj.weight" in names and not names & {"q_a_proj.weight", "g_proj.weight", "indexer.wk.weight"}


@pytest.mark.parametrize("index", ["float32", "fp8"])
def test_absorbed_equals_mha_on_shared_shuffled_pool(index):
    cfg = preset("tiny")
    block = make_block(cfg)
    x = inputs(cfg, sum(LENGTHS))
    mha = run(block, cfg, LENGTHS, x, "mha", index)
    absorbed = run(block, cfg, LENGTHS, x, "absorbed", index)
    assert torch.isfinite(mha).all() and mha.abs().max() > 0
    assert rel_err(absorbed, mha) < 1e-5


@pytest.mark.parametrize("length", [17, 40])
def test_block_matches_per_token_oracle(length):
    cfg = preset("tiny")
    block = make_block(cfg, seed=3)
    x = inputs(cfg, length, seed=4)
    expect = oracle_request(block, cfg, x)
    for form in ("mha", "absorbed"):
        assert rel_err(run(block, cfg, [length], x, form), expect) < 1e-5, form


def test_kimi_k3_without_indexer_runs_dense():
    cfg = preset("tiny").replace(**NO_INDEXER)
    block = make_block(cfg, seed=5)
    assert block.indexer is None
    lengths = [7, 48, 17]
    x = inputs(cfg, sum(lengths), seed=6)
    mha = run(block, cfg, lengths, x, "mha")
    absorbed = run(block, cfg, lengths, x, "absorbed")
    assert rel_err(absorbed, mha) < 1e-5
    expect = oracle_request(block, cfg, x[7:55])                     # request 1: dense causal
    assert rel_err(mha[7:55], expect) < 1e-5


def test_q_proj_without_lora_and_gate():
    cfg = preset("tiny").replace(q_lora_rank=None, mla_use_output_gate=False, **NO_INDEXER)
    block = make_block(cfg, seed=7)
    x = inputs(cfg, 24, seed=8)
    assert rel_err(run(block, cfg, [24], x, "absorbed"), run(block, cfg, [24], x, "mha")) < 1e-5


def test_sparse_equals_dense_only_while_rows_see_at_most_topk():
    cfg = preset("tiny")
    sparse = make_block(cfg, seed=9)
    dense = GatedMLA(cfg.replace(**NO_INDEXER)).eval()
    dense.load_state_dict({k: v for k, v in sparse.state_dict().items() if not k.startswith("indexer.")})
    x = inputs(cfg, 48, seed=10)
    a, b = run(sparse, cfg, [48], x, "absorbed"), run(dense, cfg.replace(**NO_INDEXER), [48], x, "absorbed")
    k = cfg.index_topk
    assert rel_err(a[:k], b[:k]) < 1e-6                               # rows 0..15 see ≤ 16 keys
    assert (a[k:] - b[k:]).abs().amax(-1).min() > 1e-4 * b.abs().max()   # later rows really are sparse


@pytest.mark.parametrize("index", ["float32", "fp8"])
def test_prefill_then_decode_rows_equal_one_prefill(index):
    cfg = preset("tiny")
    block = make_block(cfg, seed=11)
    lengths, tail = [17, 48], 3
    x = inputs(cfg, sum(lengths), seed=12)
    whole = run(block, cfg, lengths, x, "mha", index)
    pool = Pool(cfg, lengths, index)
    head_rows = torch.cat([x[:14], x[17:62]])
    tail_rows = torch.cat([x[14:17], x[62:65]])
    with torch.no_grad():
        block(head_rows, pool.cache, pool.meta([(0, 0, 14), (1, 0, 45)]), "prefill")
        got = block(tail_rows, pool.cache, pool.meta([(0, 14, 17), (1, 45, 48)]), "decode")
    expect = torch.cat([whole[14:17], whole[62:65]])
    assert rel_err(got, expect) < 1e-5


def test_bfloat16_block_runs_and_forms_agree():
    cfg = preset("tiny").replace(dtype="bfloat16")
    block = make_block(cfg, seed=13)
    assert block.q_a_proj.weight.dtype == torch.bfloat16
    x = inputs(cfg, 40, seed=14)
    mha = run(block, cfg, [40], x, "mha", "fp8")
    absorbed = run(block, cfg, [40], x, "absorbed", "fp8")
    assert mha.dtype == torch.bfloat16 and torch.isfinite(mha.float()).all()
    assert rel_err(absorbed, mha) < 3e-2


def test_bad_mode_and_form():
    cfg = preset("tiny")
    block = make_block(cfg)
    pool = Pool(cfg, [4])
    meta = pool.meta([(0, 0, 4)])
    x = inputs(cfg, 4)
    with pytest.raises(ValueError, match="mode"):
        block(x, pool.cache, meta, "train")
    with pytest.raises(ValueError, match="attn_form"):
        block(x, pool.cache, meta, "decode", attn_form="flash")
    with pytest.raises(ValueError, match="x"):
        block(x[None], pool.cache, meta, "decode")


class _Step(torch.nn.Module):
    def __init__(self, block, form):
        super().__init__()
        self.block, self.form = block, form

    def forward(self, x, cache, meta):
        return self.block(x, cache, meta, "prefill", attn_form=self.form)


@pytest.mark.parametrize("form", ["mha", "absorbed"])
def test_block_exports_as_one_graph_with_dynamic_rows(form):
    cfg = preset("tiny")
    block = make_block(cfg)
    pool = Pool(cfg, [17, 30])
    meta = pool.meta([(0, 0, 17), (1, 0, 30)])
    x = inputs(cfg, 47)
    n = torch.export.Dim("n", min=2, max=4096)
    rows = ({0: n}, [None, None], [{0: n}, None, {0: n}, {0: n}, None, None])
    ep = torch.export.export(_Step(block, form), (x, pool.cache, meta), dynamic_shapes=rows)
    k31c_ops = [n.target.name() for n in ep.graph.nodes if "k31c" in str(n.target)]
    attention = ["k31c::sparse_mla"] if form == "absorbed" else []
    assert k31c_ops == ["k31c::mla_cache_write", "k31c::index_cache_write", "k31c::lightning_indexer",
                        "k31c::topk_select"] + attention
