"""Probes of the KDA prefill (goal G9) at bench_kda's inputs: T = 8192 tokens, one request, 96
heads x 128, chunk 64, bf16. Modes:

  passes [LABEL]   the default launch and each pass alone (conv / chunk / state / norm), for the
                   default and a few launch options (the conv pass's rows per program among them);
                   LABEL names the tree in the printout (an A/B of two trees runs this in each,
                   alternating)
  default [LABEL]  the default launch alone and each pass (a short A/B of trees)
  state            the state pass over (warps, V tile, software-pipeline stages), alone and in
                   the whole prefill (V tiles < 128 add the norm launch)
  chunk            the chunk pass over (warps, stages)
  chunks [ROWS]    the whole prefill and its passes at chunk sizes 16, 32, 64 (or ROWS alone) with launch options
                   (the math does not depend on the chunk size; bf16 rounding does: each
                   output's difference from the fp32 launch is printed too)
  profile          per-kernel GPU times of fla's chunk_kda beside ours (torch.profiler; fla-core
                   must be importable)
  builds           the sm_90a builds of the conv, state and chunk configurations above:
                   registers, spill, shared memory (no GPU needed)
  rounds [N]       the default against ROUND_OPTIONS, interleaved over N rounds (default 8):
                   each option's time every round and the median (options whose gap is within
                   one run's noise)
  once [STAGES]    two default launches running STAGES (default vcsn) and nothing else, for a
                   profiler: ncu -k regex:_kda_state_kernel -c 1 -s 1 ... try_kda_prefill.py once vcs

Every option run on the GPU is checked against the default launch's output (max difference over
the output's largest magnitude, printed). Times are medians of 10 calls (CUDA events).

    PYTHONPATH=. python benchmarks/try_kda_prefill.py passes|default|state|chunk|chunks|rounds|profile|builds|once
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

try:
    from benchmarks import bench_kda as bk
    from benchmarks.harness import time_ms
except ImportError:  # run as a script from benchmarks/
    import bench_kda as bk
    from harness import time_ms

STATE_CONFIGS = ((8, 128, 1), (8, 128, 2), (8, 64, 1), (8, 64, 2), (8, 64, 3), (4, 64, 2),
                 (4, 64, 3), (4, 32, 2), (4, 32, 3), (4, 32, 4), (8, 32, 3))   # (warps, BV, stages)
CHUNK_CONFIGS = ((2, 2), (2, 1), (2, 3), (4, 1), (4, 2))       # (warps, stages)
# launch options by chunk size, the knobs relative to the target's defaults (sm_90a builds at 16
# rows: the state pass over 64-column V tiles on 4 warps 236 registers, no spill, 63 KB of shared
# memory at 4 stages; over all 128 columns on 8 warps 232, on 4 warps 216 B of spill; the chunk
# pass on 2 warps 248 registers, on 4 warps 148, neither spills)
CHUNK_SIZE_OPTIONS = tuple(dict(chunk=c, **kw) for c, kw in (
    (64, {}), (32, {}), (16, {}), (16, dict(state_stages=2)), (16, dict(state_stages=6)),
    (16, dict(block_v=128, state_warps=8)), (16, dict(chunk_warps=4)), (16, dict(conv_warps=2)),
    (16, dict(inverse_precision="ieee"))))
CONV_CONFIGS = ((16, 4), (32, 4), (32, 8), (64, 8), (64, 16))   # (rows per program, warps)
# the default, the defaults before pipelining (Triton's CUDA default is 3 stages), other knobs
PASS_OPTIONS = (dict(), dict(state_stages=1, chunk_stages=3), dict(state_stages=1),
                dict(chunk_stages=3), dict(conv_warps=2), dict(chunk_warps=4)) + tuple(
    dict(conv_rows=r, conv_warps=w) for r, w in CONV_CONFIGS[1:])


def _inputs():
    """(layer, tokens, the prefill as a function of launch options) on bench_kda's inputs. The
    prefill advances the slot's conv and recurrent state in place; `run(fresh=True)` first puts
    back the state it started from, so outputs of two launches compare."""
    from k31c.lowering.triton.device import target_of
    from k31c.lowering.triton.kda_prefill import kernel_chunk, launch_kda_prefill
    lay, tok, slots, cu = bk.prefill_inputs()
    shipped = kernel_chunk(target_of(tok["q"].device), bk.CHUNK)   # the registered op's chunk
    start = {n: lay[n].clone() for n in ("conv_state", "recurrent")}

    def run(fresh: bool = False, chunk: int = shipped, **kw):
        if fresh:
            for n, t in start.items():
                lay[n].copy_(t)
        return launch_kda_prefill(*bk.args(tok, lay), slots, cu, bk.LB, bk.EPS, chunk, **kw)
    return lay, tok, run


def _time(fn) -> float:
    return time_ms(fn, reps=10)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max difference over the reference's largest magnitude."""
    return ((out - ref).abs().max() / ref.abs().max()).item()


def _try(label: str, run, ref, stages: str, **kw) -> None:
    """One option: its difference from the default output, the whole prefill, `stages` alone."""
    try:
        err = _rel(run(fresh=True, **kw).float(), ref)
        whole = _time(lambda: run(**kw))
        alone = " ".join(f"{s}:{_time(lambda s=s: run(stages=s, **kw)):.3f}" for s in stages)
        print(f"{label}: prefill {whole:.3f} ms; alone {alone}; max diff vs default {err:.1e}", flush=True)
    except Exception as e:  # noqa: BLE001  (out of shared memory / registers: report and go on)
        print(f"{label}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)


def passes(name: str) -> None:
    _, _, run = _inputs()
    ref = run(fresh=True).float()
    for kw in PASS_OPTIONS:
        _try(f"{name} {kw}", run, ref, "vcsn", **kw)


def default(name: str) -> None:
    """With PROBE_REF=FILE set: the first tree saves its output there, later trees print their
    difference from it (an A/B of trees that should agree)."""
    _, _, run = _inputs()
    out = run(fresh=True).float()
    ref_file = os.environ.get("PROBE_REF")
    if ref_file and os.path.exists(ref_file):
        ref = torch.load(ref_file).to(out.device)
        print(f"{name}: max diff vs {ref_file} {_rel(out, ref):.1e}")
    elif ref_file:
        torch.save(out.cpu(), ref_file)
    _try(f"{name} default", run, out, "vcsn")


def state() -> None:
    _, _, run = _inputs()
    ref = run(fresh=True).float()
    for w, bv, st in STATE_CONFIGS:
        _try(f"state warps {w} BV {bv} stages {st}", run, ref, "sn" if bv < 128 else "s",
             state_warps=w, block_v=bv, state_stages=st)


def chunk() -> None:
    _, _, run = _inputs()
    ref = run(fresh=True).float()
    for w, st in CHUNK_CONFIGS:
        _try(f"chunk warps {w} stages {st}", run, ref, "c", chunk_warps=w, chunk_stages=st)


def _fp32_output() -> torch.Tensor:
    """The prefill of the same inputs cast to fp32 (fp32 scratch, exact products) at the model's
    chunk size, from the same starting state: the yardstick for the bf16 launches' rounding."""
    from k31c.lowering.triton.kda_prefill import launch_kda_prefill
    lay, tok, slots, cu = bk.prefill_inputs()
    f32 = lambda d: {n: t.float() for n, t in d.items()}  # noqa: E731
    return launch_kda_prefill(*bk.args(f32(tok), f32(lay)), slots, cu, bk.LB, bk.EPS, bk.CHUNK)


def chunks(rows: str) -> None:
    _, _, run = _inputs()
    try:
        exact = _fp32_output()
    except Exception as e:  # noqa: BLE001  (the timings still come)
        print(f"fp32 launch FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
        exact = None
    ref = run(fresh=True).float()
    for kw in CHUNK_SIZE_OPTIONS:
        if rows and kw["chunk"] != int(rows):
            continue
        if exact is not None:
            try:
                err = _rel(run(fresh=True, **kw).float(), exact)
                print(f"{kw}: max diff vs fp32 {err:.1e}", flush=True)
            except Exception:  # noqa: BLE001  (_try reports the failure)
                pass
        _try(f"{kw}", run, ref, "vcs" if kw.get("block_v", 128) == 128 else "vcsn", **kw)


def profile() -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile
    lay, tok, run = _inputs()
    for name, fn in (("fla chunk_kda", lambda: bk.fla_chunk_kda(tok, lay)), ("k31c kda_prefill", run)):
        with torch.inference_mode():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
        print(f"== {name} (5 calls)")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14,
                                        max_name_column_width=60), flush=True)


def builds() -> None:
    from k31c.lowering import aot
    from k31c.lowering.triton import kda_prefill as kp
    conv_spec, chunk_spec, state_spec = kp.aot_specs(aot.default_shapes("h200"))

    def build(label, spec):
        try:
            b = aot.build_spec(spec, "h200")
            print(f"{label}: regs {b.n_regs} spill {b.scratch_bytes or 0} smem {b.shared}", flush=True)
        except aot.KernelCompileError as e:
            print(f"{label}: FAILED {str(e)[:160]}", flush=True)
    for r, w in CONV_CONFIGS:
        build(f"conv rows {r} warps {w}", conv_spec._replace(
            constexprs=dict(conv_spec.constexprs, RB=r), num_warps=w))
    for w, bv, st in STATE_CONFIGS:
        sig = dict(state_spec.signature, **({"o_raw_ptr": "*fp32"} if bv < 128 else {}))
        build(f"state warps {w} BV {bv} stages {st}", state_spec._replace(
            constexprs=dict(state_spec.constexprs, BV=bv), signature=sig, num_warps=w, num_stages=st))
    for w, st in CHUNK_CONFIGS:
        build(f"chunk warps {w} stages {st}", chunk_spec._replace(num_warps=w, num_stages=st))


# options whose gap to the default is within one sweep's noise (BENCHMARKS.md, KDA)
ROUND_OPTIONS = (dict(), dict(state_stages=5), dict(state_stages=6), dict(state_stages=3))


def rounds(n: int) -> None:
    _, _, run = _inputs()
    ref = run(fresh=True).float()
    for kw in ROUND_OPTIONS[1:]:
        print(f"{kw}: max diff vs default {_rel(run(fresh=True, **kw).float(), ref):.1e}", flush=True)
    times = {i: [] for i in range(len(ROUND_OPTIONS))}
    for r in range(n):
        order = range(len(ROUND_OPTIONS)) if r % 2 == 0 else reversed(range(len(ROUND_OPTIONS)))
        for i in order:
            times[i].append(_time(lambda: run(**ROUND_OPTIONS[i])))
    for i, kw in enumerate(ROUND_OPTIONS):
        print(f"{kw or 'default'}: median {statistics.median(times[i]):.3f} ms over {n} rounds: "
              + " ".join(f"{t:.3f}" for t in times[i]), flush=True)


def once(stages: str) -> None:
    _, _, run = _inputs()
    for _ in range(2):
        run(stages=stages)
    torch.cuda.synchronize()


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    label = sys.argv[2] if len(sys.argv) > 2 else "tree"
    modes = {"passes": lambda: passes(label), "default": lambda: default(label), "state": state,
             "chunk": chunk, "chunks": lambda: chunks(label if len(sys.argv) > 2 else ""),
             "profile": profile, "builds": builds,
             "rounds": lambda: rounds(int(sys.argv[2]) if len(sys.argv) > 2 else 8),
             "once": lambda: once(sys.argv[2] if len(sys.argv) > 2 else "vcsn")}
    if mode not in modes:
        sys.exit(f"usage: try_kda_prefill.py {'|'.join(modes)}")
    modes[mode]()
