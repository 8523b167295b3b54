"""Token-local blocks against per-token oracles written independently: the noaux_tc router (with
groups), LatentMoE with sparse per-token dispatch, Block AttnRes, SiTU-GLU."""
import math

import pytest
import torch

from k31c.config import preset
from k31c.graph.blocks.attn_res import attn_res_norm
from k31c.graph.blocks.moe import LatentMoE
from k31c.graph.blocks.norms import RMSNorm, glu_activation


def moe(seed=0, **changes):
    cfg = preset("tiny").replace(**changes) if changes else preset("tiny")
    m = LatentMoE(cfg)
    g = torch.Generator().manual_seed(seed)
    m.reset_parameters(g)
    with torch.no_grad():  # a non-zero correction bias changes selection but not the weights
        m.gate.e_score_correction_bias.copy_(torch.randn(cfg.num_experts, generator=g) * 0.05)
    return cfg, m


def route_one(cfg, x, weight, bias):
    """Router for one token with plain Python lists (spec §7.1: sigmoid or softmax scores)."""
    logits = [float(x @ weight[e]) for e in range(cfg.num_experts)]
    if cfg.moe_router_activation_func == "softmax":
        top = max(logits)
        total = sum(math.exp(v - top) for v in logits)
        scores = [math.exp(v - top) / total for v in logits]
    else:
        scores = [1 / (1 + math.exp(-v)) for v in logits]
    choice = [s + float(b) for s, b in zip(scores, bias)]
    allowed = set(range(cfg.num_experts))
    if cfg.num_expert_group > 1 and cfg.num_expert_group > cfg.topk_group:
        size = cfg.num_experts // cfg.num_expert_group
        gscore = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2])
                  for g in range(cfg.num_expert_group)]
        keep = sorted(range(cfg.num_expert_group), key=lambda g: -gscore[g])[:cfg.topk_group]
        allowed = {e for g in keep for e in range(g * size, (g + 1) * size)}
    chosen = sorted(allowed, key=lambda e: -choice[e])[:cfg.num_experts_per_token]
    w = [scores[e] for e in chosen]
    if cfg.num_experts_per_token > 1 and cfg.moe_renormalize:
        w = [v / (sum(w) + 1e-20) for v in w]
    return chosen, [v * cfg.routed_scaling_factor for v in w]


def expert(cfg, m, e, z):
    """Routed expert e by its HF per-expert tensors (the state dict's names)."""
    sd = m.experts.state_dict()
    w1, w3, w2 = (sd[f"{e}.{w}.weight"] for w in ("w1", "w3", "w2"))
    act = (cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    return glu_activation(z @ w1.t(), z @ w3.t(), *act) @ w2.t()


@pytest.mark.parametrize("changes", [{}, dict(num_expert_group=4, topk_group=2),
                                     dict(routed_scaling_factor=2.446, num_experts_per_token=3),
                                     dict(moe_router_activation_func="softmax", num_expert_group=4, topk_group=2),
                                     dict(moe_renormalize=False, num_experts_per_token=3)])
@torch.no_grad()
def test_router_and_latent_moe_against_sparse_dispatch(changes):
    cfg, m = moe(**changes)
    x = torch.randn(11, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    idx, w = m.gate(x)
    got = m(x)
    for t in range(x.shape[0]):
        chosen, weights = route_one(cfg, x[t].double(), m.gate.weight.double(),
                                    m.gate.e_score_correction_bias.double())
        assert sorted(idx[t].tolist()) == sorted(chosen)
        order = {e: v for e, v in zip(chosen, weights)}
        assert torch.allclose(w[t].double(), torch.tensor([order[int(e)] for e in idx[t]],
                                                          dtype=torch.float64), atol=1e-6)
        z = m.routed_expert_down_proj(x[t:t + 1])
        u = sum(v * expert(cfg, m, e, z) for e, v in zip(chosen, weights))
        u = m.routed_expert_up_proj(m.routed_expert_norm(u))
        want = u + m.shared_experts(x[t:t + 1])
        torch.testing.assert_close(got[t:t + 1], want, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_attn_res_norm_against_per_token_loop():
    """The mix over bank + [partial + addend] and the RMSNorm after it, against a float64 loop."""
    g = torch.Generator().manual_seed(3)
    D, T = 16, 5
    bank = [torch.randn(T, D, generator=g) for _ in range(3)]
    partial, addend = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    norm, out_norm = RMSNorm(D, 1e-5), RMSNorm(D, 1e-6)
    proj = torch.nn.Linear(D, 1, bias=False)
    norm.weight.copy_(torch.rand(D, generator=g) + 0.5)
    out_norm.weight.copy_(torch.rand(D, generator=g) + 0.5)
    proj.weight.copy_(torch.randn(1, D, generator=g))
    s, x = attn_res_norm(partial, [addend], bank, norm, proj, out_norm)
    torch.testing.assert_close(s, partial + addend)
    same, x_none = attn_res_norm(partial, [], bank, norm, proj, out_norm)
    assert same is partial
    half = addend / 2
    s2, x2 = attn_res_norm(partial, [half, addend - half], bank, norm, proj, out_norm)   # two terms
    torch.testing.assert_close(s2, s)
    torch.testing.assert_close(x2, x)
    for t in range(T):
        cands = [b[t].double() for b in bank] + [partial[t].double() + addend[t].double()]
        w = norm.weight.double() * proj.weight[0].double()
        logits = [float((c / torch.sqrt((c * c).mean() + 1e-5)) @ w) for c in cands]
        mx = max(logits)
        e = [math.exp(v - mx) for v in logits]
        h = sum(ei / sum(e) * c for ei, c in zip(e, cands))
        want = out_norm.weight.double() * h / torch.sqrt((h * h).mean() + 1e-6)
        torch.testing.assert_close(x[t].double(), want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(x_none, x)          # the addend is part of the mix


def test_situ_matches_formula():
    g = torch.Generator().manual_seed(4)
    gate, up = torch.randn(7, 9, generator=g) * 10, torch.randn(7, 9, generator=g) * 40
    got = glu_activation(gate, up, "situ", 4.0, 25.0)
    for a, b, o in zip(gate.flatten().tolist(), up.flatten().tolist(), got.flatten().tolist()):
        want = 4.0 * math.tanh(a / 4.0) / (1 + math.exp(-a)) * 25.0 * math.tanh(b / 25.0)
        assert abs(o - want) <= 1e-4 * max(1.0, abs(want))
    silu = glu_activation(gate, up, "silu", 4.0, None)
    torch.testing.assert_close(silu, torch.nn.functional.silu(gate) * up)


def test_stacked_experts_keep_the_hf_per_expert_names():
    """The state dict names every expert's w1/w3/w2 (views of the stacks); loading those names,
    or the stacked ones, fills the stacks; an incomplete set is reported by strict loading."""
    cfg, m = moe(seed=4)
    e, inter = cfg.num_experts, cfg.moe_intermediate_size
    sd = m.state_dict()
    assert "experts.w13" not in sd and "experts.w2" not in sd
    names = [n for n in sd if n.startswith("experts.")]
    assert names == [f"experts.{i}.{w}.weight" for i in range(e) for w in ("w1", "w3", "w2")]
    w13, w2 = m.experts.w13, m.experts.w2
    for i in (0, e - 1):
        assert torch.equal(sd[f"experts.{i}.w1.weight"], w13[i, :inter])
        assert torch.equal(sd[f"experts.{i}.w3.weight"], w13[i, inter:])
        assert torch.equal(sd[f"experts.{i}.w2.weight"], w2[i])
    fresh = LatentMoE(cfg)
    fresh.load_state_dict({n: t.clone() for n, t in sd.items()})
    assert torch.equal(fresh.experts.w13, w13) and torch.equal(fresh.experts.w2, w2)
    stacked = {n: t for n, t in sd.items() if not n.startswith("experts.")}
    stacked.update({"experts.w13": w13.detach().clone(), "experts.w2": w2.detach().clone()})
    other = LatentMoE(cfg)
    other.load_state_dict(stacked)
    assert torch.equal(other.experts.w2, w2)
    partial = dict(sd)
    del partial["experts.3.w3.weight"]
    with pytest.raises(RuntimeError, match="experts.w13"):
        LatentMoE(cfg).load_state_dict(partial)
