"""The issue's end-to-end scenario for compiled programs, run the same way on the eager model and
on a compiled one: a short prefill, a prefill longer than index_topk, a chunked prefill onto a
prefix, decode with one request and with many of different lengths, a 4-row verification with
rollback, and decode steps after it (which see the rolled-back state); and the bench-config
models the GPU tests share."""
from __future__ import annotations

import torch

from k31c.config import preset
from k31c.graph.model import K31ForCausalLM
from k31c.runtime.engine import Engine


def bench_model() -> K31ForCausalLM:
    """The bench config with seeded random weights, on the GPU."""
    torch.manual_seed(0)
    m = K31ForCausalLM(preset("bench"))
    m.reset_parameters(torch.Generator().manual_seed(0))
    return m.eval().cuda()


def float32_twin(model) -> K31ForCausalLM:
    """The same weights in a float32 model: the oracle for bfloat16 programs."""
    twin = K31ForCausalLM(model.config.replace(dtype="float32"))
    twin.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    return twin.eval().cuda()


def program_scenario(model, step_fn, device, batch: int = 16, long_extra: int = 40,
                     **engine_kw) -> list[torch.Tensor]:
    cfg = model.config
    topk = cfg.index_topk
    gen = torch.Generator().manual_seed(7)
    toks = lambda n: torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    eng = Engine(model, max_requests=batch + 2, max_seq_len=topk + long_extra + 64, device=device,
                 step_fn=step_fn, **engine_kw)
    out = []
    short, long, chunked = eng.add_request(), eng.add_request(), eng.add_request()
    out.append(eng.prefill([short], [toks(5)]))                         # short prefill
    out.append(eng.prefill([long], [toks(topk + long_extra)]))         # longer than index_topk
    out.append(eng.prefill([chunked], [toks(11)]))
    out.append(eng.prefill([chunked], [toks(17)]))                      # a chunk onto a prefix
    others = [eng.add_request() for _ in range(batch - 3)]
    out.append(eng.prefill(others, [toks(2 + 3 * i) for i in range(len(others))]))
    everyone = [short, long, chunked] + others
    out.append(eng.decode([short], toks(1)))                            # B = 1
    for _ in range(2):
        out.append(eng.decode(everyone, toks(len(everyone))))           # B = batch, mixed lengths
    verify = [short, long, chunked]
    logits, handle = eng.verify(verify, [toks(4) for _ in verify])      # R = 4
    out.append(logits)
    eng.accept(handle, [1, 3, 4])                                       # rollback two of them
    out.append(eng.decode(verify, toks(len(verify))))
    out.append(eng.decode(everyone[:5], toks(5)))                       # another bucket
    return out


def max_rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    return [((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-6)).item()
            for g, w in zip(got, want)]
