"""Long-prompt prefill of the bench config on the GPU: tokens/s, peak memory, ratio to the floor.

One process: the bench config (`preset("bench")`, bf16) compiled with `k31c.compile(model,
target="h200")`, driven by the Engine with chunked prefill (`max_prefill_tokens` rows a step, each
chunk onto the request's own prefix). Per prompt length (default 32K and 128K tokens, random
tokens, a fresh request each): wall time of `Engine.prefill(..., logits="last")`, tokens/s, peak
GPU memory (torch.cuda.max_memory_allocated, reset before the prompt; weights and pool included)
and the ratio to the prefill's compute floor: its FLOPs over the bf16 matrix rate measured in
this run (harness.measure_machine). A warm-up prefill of two chunks first builds the program
(Inductor, Triton JIT) outside the timed prompts.

FLOPs of a prompt of L tokens (k = index_topk; every row t sees t + 1 keys):
- projections: 2 · (weights a token multiplies) per token, routed experts at their active share
  (num_experts_per_token / num_experts), lm_head included (the step computes it for every row),
  plus the absorbed form's W_UK / W_UV products (2 · 2 · Hq · d_n · r_kv per token and MLA layer);
- indexer: 2 · H_I · d_I per visible key, Σ_t (t + 1) keys per MLA layer;
- sparse MLA: 2 · Hq · (Dl + r_kv) per selected key, Σ_t min(t + 1, k) keys per MLA layer
  (layers without an indexer: every visible key);
- KDA, chunked WY form (C = kda_chunk_size, K = V = head dim) per token and head:
  2·C·K (Γ-weighted K Kᵀ) + 2·C·K (Q Kᵀ) + C·(K + V) (the block triangular solve) + 2·C·V
  (A_qk V_new) + 3 · 2·K·V (W S, Q S, the state update).

    python benchmarks/prefill.py [--lengths 32768 131072] [--chunk 8192] [--out FILE]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import bench_model, emit, flops_floor_ms, measure_machine  # noqa: E402

import k31c  # noqa: E402
from k31c.runtime.engine import Engine  # noqa: E402

LENGTHS = (32768, 131072)



def projection_flops_per_token(model) -> float:
    """2 · the weights one token multiplies: every weight matrix but the embedding table, the
    routed experts' (a parameter under `experts`, not `shared_experts`) at their active share."""
    cfg = model.config
    routed_share = cfg.num_experts_per_token / cfg.num_experts if cfg.num_experts else 1.0
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    flops = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or id(p) in lookups:
            continue
        routed = "experts" in name.split(".")
        flops += 2 * p.numel() * (routed_share if routed else 1.0)
    mla = len(cfg.mla_layers)
    flops += mla * 2 * 2 * cfg.num_attention_heads * cfg.qk_nope_head_dim * cfg.kv_lora_rank
    return flops


def prefill_flops(cfg, model, length: int) -> dict[str, float]:
    visible = length * (length + 1) / 2                       # Σ_t (t + 1)
    mla = len(cfg.mla_layers)
    parts = {"projections": projection_flops_per_token(model) * length}
    if cfg.has_indexer:
        k = cfg.index_topk
        selected = visible if length <= k else k * (k + 1) / 2 + (length - k) * k
        parts["indexer"] = mla * 2 * cfg.index_n_heads * cfg.index_head_dim * visible
    else:
        selected = visible
    parts["sparse MLA"] = mla * 2 * cfg.num_attention_heads * (cfg.latent_dim + cfg.kv_lora_rank) * selected
    C, K = cfg.kda_chunk_size, cfg.kda_head_dim
    per_head = 2 * C * K + 2 * C * K + C * (K + K) + 2 * C * K + 3 * 2 * K * K
    parts["KDA"] = len(cfg.kda_layers) * cfg.kda_num_heads * per_head * length
    return parts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    ap.add_argument("--chunk", type=int, default=8192, help="max_prefill_tokens (rows a step)")
    ap.add_argument("--out", help="also write the table to this file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/prefill.py: error: needs a CUDA device", file=sys.stderr)
        return 2
    if min(args.lengths) < 1 or args.chunk < 1:
        print("benchmarks/prefill.py: error: lengths and --chunk must be positive", file=sys.stderr)
        return 2
    start = time.perf_counter()
    machine = measure_machine()
    model = bench_model()
    cfg = model.config
    compiled = k31c.compile(model, target="h200")
    max_len = max(args.lengths) + 64
    eng = Engine(model, max_requests=1, max_seq_len=max_len, device="cuda", step_fn=compiled,
                 max_prefill_tokens=args.chunk)
    gen = torch.Generator().manual_seed(0)
    toks = lambda n: torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()  # noqa: E731

    # warm-up: a full chunk, then a chunk onto it (program build, every kernel's JIT)
    rid = eng.add_request()
    eng.prefill([rid], [toks(min(2 * args.chunk, max_len))], logits="last")
    eng.free(rid)
    torch.cuda.synchronize()
    print(f"setup (machine, model, compile, warm-up): {time.perf_counter() - start:.1f} s", flush=True)

    rows = []
    for length in args.lengths:
        prompt = toks(length)
        rid = eng.add_request()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        logits = eng.prefill([rid], [prompt], logits="last")
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() / 2**30
        if not torch.isfinite(logits).all():
            print(f"L={length}: non-finite logits", file=sys.stderr)
            return 1
        eng.free(rid)
        parts = prefill_flops(cfg, model, length)
        floor_ms = flops_floor_ms(sum(parts.values()), machine.bf16_tflops)
        rows.append((length, seconds, peak, parts, floor_ms))
        print(f"L={length}: {seconds:.2f} s, {length / seconds:,.0f} tok/s, peak {peak:.1f} GiB, "
              f"floor {floor_ms:.1f} ms ({seconds * 1e3 / floor_ms:.1f}x)", flush=True)

    report = compiled.report.steps.get("prefill")
    fallbacks = report.fallbacks if report is not None else "n/a"
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    lines = [f"Device: {machine.name}; measured bf16 {machine.bf16_tflops:.0f} TFLOP/s, copy "
             f"{machine.copy_gbps:.0f} GB/s; bench config (bf16, {weights:.1f} GiB of weights), "
             f"chunks of {args.chunk} rows, index_topk {cfg.index_topk}; prefill fallbacks: {fallbacks}",
             "", "| tokens | seconds | tokens/s | peak GiB | floor ms | ratio | floor TFLOP: "
             "projections / indexer / sparse MLA / KDA |", "|---|---|---|---|---|---|---|"]
    for length, seconds, peak, parts, floor_ms in rows:
        split = " / ".join(f"{parts.get(p, 0.0) / 1e12:.1f}"
                           for p in ("projections", "indexer", "sparse MLA", "KDA"))
        lines.append(f"| {length} | {seconds:.3f} | {length / seconds:,.0f} | {peak:.1f} | "
                     f"{floor_ms:.1f} | {seconds * 1e3 / floor_ms:.2f} | {split} |")
    lines.append(f"\ntotal wall time {time.perf_counter() - start:.1f} s")
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
