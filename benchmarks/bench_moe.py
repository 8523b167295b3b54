"""Benchmark of the Triton MoE kernels at K3.1 Pro's routed-expert shapes (spec/model.md §7):
896 experts, 16 active per token, expert input width 3584 (the latent), intermediate 3072, bf16
weights (59 GB for one layer's experts), router over the 7168-wide hidden state. B = 1, 4, 16.

Rows:
- moe_experts (the h200 lowering: moe_experts.py's grouping, gate/up and down GEMMs, combine),
  routing from the Triton router on random inputs. Floor: the weights of the distinct experts
  the batch selected (3·I·W·2 bytes each) read once, plus z and the output, over the copy
  bandwidth measured now. Goal at B = 1: <= 1.3x that floor.
- moe_route (moe_route.py: logits and selection). Floor: the router weight read once.
Both are timed as CUDA-graph replays (as a decode step runs them); "k31c eager" is the same call
launched from Python. Peers, same process:
- "dense bmm (all experts)": every expert applied to every row as two batched matmuls over all
  896 experts with the GLU between, then weighted by the routing (what the reference's dense sum
  costs when batched; it reads all 59 GB);
- "reference op": the k31c reference (graph/ops/moe.py: a Python loop over all 896 experts).
Every row checks the kernel against the reference op (max error relative to the largest output,
and the router's selected sets). At B = 1 a few tile configurations of the expert kernels are
timed beside the default (rows "moe_experts cfg ..."), to show whether the plan's choice is the
fastest.

    PYTHONPATH=. python benchmarks/bench_moe.py          # ~1 minute on an H200
"""
from __future__ import annotations

import gc

import torch

try:
    from benchmarks.harness import Machine, Row, bytes_floor_ms, graph_ms, markdown, measure_machine, time_ms
except ImportError:  # run as a script from benchmarks/
    from harness import Machine, Row, bytes_floor_ms, graph_ms, markdown, measure_machine, time_ms

E, K, D, W, I = 896, 16, 7168, 3584, 3072
DEVICE = "cuda"
BATCHES = (1, 4, 16)
ACT = ("situ", 4.0, 25.0)
ROUTING = (K, 1, 1, "sigmoid", True, 1.0)          # (k, n_group, topk_group, scoring, renormalize, scale)
SWEEP = (dict(BN=32), dict(BN=128), dict(BK=64), dict(BK=256, up_stages=2, down_stages=3),
         dict(num_warps=8), dict(up_stages=4, down_stages=5))


def selected_expert_bytes(idx: torch.Tensor, inter: int = I, width: int = W, itemsize: int = 2) -> int:
    """Bytes of the weights of the distinct experts in `idx` (w13 and w2: 3·I·W values each)."""
    return int(torch.unique(idx).numel()) * 3 * inter * width * itemsize


def dense_all_experts(z, idx, w, w13, w2):
    """Every expert on every row (two bmm over all experts, the GLU between), weighted by the
    routing: the dense sum the reference defines, batched."""
    from k31c.graph.blocks.norms import glu_activation
    n, inter = z.shape[0], w13.shape[1] // 2
    gate_up = torch.bmm(z.unsqueeze(0).expand(w13.shape[0], n, -1), w13.transpose(1, 2))   # [E, N, 2I]
    h = glu_activation(gate_up[..., :inter], gate_up[..., inter:], *ACT)
    y = torch.bmm(h, w2.transpose(1, 2))                                                    # [E, N, W]
    combine = torch.zeros(n, w13.shape[0], device=z.device).scatter_add(1, idx.long(), w)
    return torch.einsum("ne,enw->nw", combine, y.float()).to(z.dtype)


def _weights(gen):
    w13 = torch.empty(E, 2 * I, W, dtype=torch.bfloat16, device=DEVICE)
    w2 = torch.empty(E, W, I, dtype=torch.bfloat16, device=DEVICE)
    for t, fan_in in ((w13, W), (w2, I)):
        for chunk in t.split(64):
            chunk.normal_(0.0, fan_in ** -0.5, generator=gen)
    return w13, w2


def _rel_err(got, ref) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


def run(machine: Machine, batches=BATCHES, sweep: bool = True) -> list[Row]:
    import k31c.graph.ops  # noqa: F401  (registers torch.ops.k31c.*)
    from k31c.lowering.triton import moe_experts, moe_route
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w13, w2 = _weights(gen)
    router = torch.randn(E, D, device=DEVICE, generator=gen, dtype=torch.bfloat16) * D ** -0.5
    bias = torch.randn(E, device=DEVICE, generator=gen) * 0.01
    rows = []
    for b in batches:
        x = torch.randn(b, D, device=DEVICE, generator=gen, dtype=torch.bfloat16)
        z = torch.randn(b, W, device=DEVICE, generator=gen, dtype=torch.bfloat16)

        # ---- router
        idx, w = moe_route.moe_route(x, router, bias, *ROUTING)
        ref_idx, ref_w = torch.ops.k31c.moe_route(x, router, bias, *ROUTING)
        same = bool(torch.equal(idx.sort(1).values, ref_idx.sort(1).values))
        peers = {"k31c eager": time_ms(lambda: moe_route.moe_route(x, router, bias, *ROUTING)),
                 "reference op": time_ms(lambda: torch.ops.k31c.moe_route(x, router, bias, *ROUTING))}
        ms = graph_ms(lambda: moe_route.moe_route(x, router, bias, *ROUTING))
        rows.append(Row("moe_route", f"B{b} E{E} D{D} k={K}", ms, bytes_floor_ms(E * D * 2, machine),
                        "bytes", peers, f"sets {'==' if same else '!='} reference"))

        # ---- experts
        def call(config=None):
            return moe_experts.launch(z, idx, w, w13, w2, *ACT, config=config)
        ref = torch.ops.k31c.moe_experts(z, idx, w, w13, w2, *ACT)
        err = _rel_err(call(), ref)
        dense_err = _rel_err(dense_all_experts(z, idx, w, w13, w2), ref)
        nbytes = selected_expert_bytes(idx, I, W) + 2 * b * W * 2
        floor = bytes_floor_ms(nbytes, machine)
        peers = {"k31c eager": time_ms(call),
                 "dense bmm (all experts)": time_ms(lambda: dense_all_experts(z, idx, w, w13, w2),
                                                     warmup=1, reps=3),
                 "reference op": time_ms(lambda: torch.ops.k31c.moe_experts(z, idx, w, w13, w2, *ACT),
                                         warmup=1, reps=3)}
        ms = graph_ms(call)
        distinct = int(torch.unique(idx).numel())
        note = (f"{distinct} distinct experts ({nbytes / 1e9:.2f} GB); max err {err:.1e} of max |u| "
                f"(dense bmm {dense_err:.1e}); {peers['dense bmm (all experts)'] / ms:.0f}x dense bmm")
        if b == 1:
            note += "; goal <= 1.3x floor"
        rows.append(Row("moe_experts", f"B{b} E{E} k={K} W{W} I{I} bf16", ms, floor, "bytes", peers, note))
        if sweep and b == 1:
            default = moe_experts.plan(b * K, small=False)
            for cfg in SWEEP:
                try:
                    t = graph_ms(lambda: call(cfg))
                    rows.append(Row("moe_experts cfg", f"B{b} {cfg}", t, floor, "bytes", {},
                                    f"default {dict((k, default[k]) for k in cfg)}; "
                                    f"err {_rel_err(call(cfg), ref):.1e}"))
                except Exception as e:  # noqa: BLE001  (a config that does not fit is reported)
                    print(f"moe_experts config {cfg} failed: {type(e).__name__}: {e}")
        del x, z, ref
    del w13, w2, router
    gc.collect()
    torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    m = measure_machine()
    print(markdown(run(m), m))
