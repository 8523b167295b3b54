"""The tiny model and the end-to-end engine scenario that several test files run (tests/conftest.py's
folder is on sys.path, so any test imports this as `tiny_model`)."""
from __future__ import annotations

import torch

from k31c.config import preset
from k31c.graph.model import K31ForCausalLM
from k31c.runtime.engine import Engine


def make_model(seed: int = 0, res_std: float = 0.5, **changes) -> K31ForCausalLM:
    """The tiny config (with `changes`) at random init. The spec's init sets the AttnRes
    projections to zero (uniform mixing); normal(0, res_std) values exercise their softmax."""
    cfg = preset("tiny")
    if changes:
        cfg = cfg.replace(**changes)
    torch.manual_seed(seed)
    m = K31ForCausalLM(cfg)
    m.reset_parameters(torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "res_proj" in name:   # drawn in fp32, as the model's init: torch 2.11 draws bf16
                p.copy_(torch.empty(p.shape).normal_(0, res_std))   # tensors from another stream
    return m.eval()


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-4) -> None:
    """max |a - b| relative to max |b| below tol."""
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
    assert err < tol, f"rel err {err:.3g}"


def engine_scenario(model, step_fn, prompts, decode_from: int, verify, decode_steps: int, **engine_kw):
    """Logits of one engine run over a fixed random token stream: a prefill of one request per
    (start, stop) slice in `prompts`, then `decode_steps` decode steps alternating the first
    request alone and all of them (tokens from position `decode_from` on), then a verification
    step of 3 rows for the requests at indices `verify`. engine_kw: more Engine arguments (cache
    formats)."""
    toks = torch.randint(0, model.config.vocab_size, (400,),
                         generator=torch.Generator().manual_seed(1)).tolist()
    eng = Engine(model, max_requests=4, max_seq_len=128, step_fn=step_fn, **engine_kw)
    rids = [eng.add_request() for _ in prompts]
    out = [eng.prefill(rids, [toks[a:b] for a, b in prompts])]
    pos = decode_from
    for i in range(decode_steps):
        step = rids[:1] if i % 2 == 0 else rids
        out.append(eng.decode(step, toks[pos:pos + len(step)]))
        pos += len(step)
    logits, _ = eng.verify([rids[i] for i in verify],
                           [toks[pos + 3 * j:pos + 3 * j + 3] for j in range(len(verify))])
    out.append(logits)
    return torch.cat(out)
