"""Cold and warm starts of a compiled model: the compile cache against Inductor's own caches
(spec §8 G11: a warm start <= 5% of a cold one, no Inductor or Triton compile in it).

Four child processes (five on a GPU target), each: import k31c, make the model (a preset with
seeded random weights), `k31c.compile(model, target)`, an Engine of one pool,
`compiled.prebuild(engine, steps)` (the programs built or loaded, and on a GPU target run once,
so the Triton JIT of k31c's kernels and the decode graph's capture happen here: "start"), then
a prefill of 16 tokens and 3 decode steps ("first tokens"; a GPU row counts the kernels Triton
compiled and those it loaded from its cache in the whole child). The runs, in order:
1. `inductor cold`: the k31c cache off, fresh Inductor and Triton cache directories;
2. `inductor warm`: the k31c cache off, the same Inductor and Triton caches, filled by run 1: what
   torch's caches give without k31c's (capture, passes and Inductor's cache lookups remain);
3. `k31c cold`: an empty k31c compile cache, fresh Inductor and Triton caches;
4. `k31c warm`: the same compile cache, filled by run 3, and run 3's Triton cache;
5. (GPU targets) `k31c warm (fresh Triton cache)`: the compile cache alone, as on another machine
   it was copied to (k31c's kernels from its kernel store, runtime/kernel_store.py; Inductor's
   from its artifacts).
Each row: the imports (torch, k31c's api, Inductor's compile and load modules and the target's
kernel modules, before the clock), start (compile + prebuild), first tokens, the child's wall
time, and the start as a share of its cold run's.

    python benchmarks/compile_cache.py [--target cpu|h200] [--config tiny] [--steps prefill,decode]
                                       [--runs "k31c cold,k31c warm"] [--jit-workers N] [--out FILE]

--runs: some of the runs above by name (default all); a warm run needs its cold run.
--jit-workers: prebuild's `jit_workers` (GPU targets: the steps' Triton kernels compiled on N
threads from a dry run before their first run; default prebuild's, one per usable CPU; 0: each
at its first launch).

--config takes a preset or a config.json. `benchmarks/configs/k3.1-pro-layers.json` is K3.1 Pro's
layer structure (93 layers: 69 KDA, 24 MLA with the indexer; Block AttnRes every 12; the K3.1 Pro
attention, KDA and indexer widths the kernels see) at a hidden size of 1024 with 8 small experts
(7.1 B parameters, 14 GB in bf16): its `k31c cold` start with `--steps decode` is spec §8's G12
(the cold compile of the 93-layer decode graph) with the projections narrowed to fit one GPU;
`--runs "k31c cold"` times it alone (a child makes its 7.1 B random weights on the GPU first).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(args) -> None:
    start_wall = time.perf_counter()
    import torch

    sys.path.insert(0, str(ROOT))
    import k31c
    from k31c.config import config_from_name_or_path
    from k31c.graph.model import K31ForCausalLM
    from k31c.runtime.engine import Engine
    # what every compile and load imports, before the clock: a per-process constant (the
    # "imports" column), the same for cold and warm starts: k31c's api (its compile cache
    # included), Inductor's compile, load and kernel-loading modules, and the target's kernel
    # modules (on a GPU target Triton and k31c's Triton kernels; counted in "start" before)
    import k31c.api  # noqa: F401
    import torch._inductor.async_compile  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.standalone_compile  # noqa: F401
    from k31c.lowering.registry import kernels_for
    kernels_for(args.target)
    imports = time.perf_counter() - start_wall
    triton_builds = {"compiled": 0, "loaded": 0}      # Triton's compiles and its cache's hits
    if args.target != "cpu":
        import triton

        def listen(*, cache_hit, **_):
            triton_builds["loaded" if cache_hit else "compiled"] += 1
        if not hasattr(getattr(triton, "knobs", None), "compilation"):
            sys.exit(f"Triton {triton.__version__} has no compilation listener to count its builds by")
        triton.knobs.compilation.listener = listen
    torch.manual_seed(0)
    device = "cuda" if args.target != "cpu" else "cpu"
    with torch.device(device):               # made and initialised on the device: seconds, not
        model = K31ForCausalLM(config_from_name_or_path(args.config))   # minutes at 7.1 B
    model.reset_parameters(torch.Generator(device).manual_seed(0))
    model = model.eval().to(device)
    t0 = time.perf_counter()
    compiled = k31c.compile(model, target=args.target)
    engine = Engine(compiled, max_requests=2, max_seq_len=256)
    compiled.prebuild(engine, args.steps.split(","), jit_workers=args.jit_workers)
    t1 = time.perf_counter()
    rid = engine.add_request()
    tokens = torch.randint(0, model.config.vocab_size, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.prefill([rid], [tokens])
    for t in tokens[:3]:
        engine.decode([rid], [t])
    if device == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    # the start's parts per step built here (not loaded): capture, then the passes and code
    # generation; the rest of the start is the steps' first runs (Triton's JIT, graph capture)
    built = {s: {"capture": r.capture_seconds, "passes": sum(p.seconds for p in r.passes),
                 "build": r.build_seconds} for s, r in compiled.report.steps.items() if not r.cache.startswith("hit")}
    print(json.dumps({"start": t1 - t0, "first": t2 - t1, "wall": t2 - start_wall, "imports": imports,
                      "triton": triton_builds, "built": built,
                      "cache": {s: r.cache for s, r in compiled.report.steps.items()}}))


def run_child(args, env: dict) -> dict:
    cmd = [sys.executable, __file__, "--child", "--target", args.target, "--config", args.config,
           "--steps", args.steps] + ([] if args.jit_workers is None else ["--jit-workers", str(args.jit_workers)])
    out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"child failed ({env}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def chosen(runs: list, names: str | None) -> list:
    """The runs `names` lists (comma-separated; None: all), in their order; a warm run needs the
    cold run that fills its caches."""
    if names is None:
        return runs
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = [name for name, _ in runs]
    unknown = [n for n in wanted if n not in known]
    if unknown or not wanted:
        sys.exit(f"compile_cache: --runs {names!r}: unknown {unknown or 'nothing'}; runs: {', '.join(known)}")
    orphans = [n for n in wanted if n.split()[0] + " cold" not in wanted]
    if orphans:
        sys.exit(f"compile_cache: --runs: {', '.join(orphans)} need(s) the cold run of the same family")
    return [(name, env) for name, env in runs if name in wanted]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="cpu")
    p.add_argument("--config", default="tiny")
    p.add_argument("--steps", default="prefill,decode")
    p.add_argument("--runs", help="comma-separated run names (default: all)")
    p.add_argument("--jit-workers", type=int, default=None,
                   help="prebuild's jit_workers: threads compiling the steps' Triton kernels ahead (GPU; "
                        "default prebuild's)")
    p.add_argument("--out")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    sys.path.insert(0, str(ROOT))
    from k31c.config import config_from_name_or_path
    from k31c.errors import K31cError
    try:                        # a bad --config is said once here, not by every child
        config_from_name_or_path(args.config)
    except K31cError as e:
        sys.exit(f"compile_cache: {e}")
    with tempfile.TemporaryDirectory(prefix="k31c-bench-cache-") as tmp:
        d = Path(tmp)
        runs = [("inductor cold", {"K31C_COMPILE_CACHE": "off", "TORCHINDUCTOR_CACHE_DIR": str(d / "ind1"),
                                   "TRITON_CACHE_DIR": str(d / "tri1")}),
                ("inductor warm", {"K31C_COMPILE_CACHE": "off", "TORCHINDUCTOR_CACHE_DIR": str(d / "ind1"),
                                   "TRITON_CACHE_DIR": str(d / "tri1")}),
                ("k31c cold", {"K31C_COMPILE_CACHE": str(d / "k31c"), "TORCHINDUCTOR_CACHE_DIR": str(d / "ind2"),
                               "TRITON_CACHE_DIR": str(d / "tri2")}),
                ("k31c warm", {"K31C_COMPILE_CACHE": str(d / "k31c"), "TORCHINDUCTOR_CACHE_DIR": str(d / "ind3"),
                               "TRITON_CACHE_DIR": str(d / "tri2")})]
        if args.target != "cpu":            # the compile cache alone
            runs.append(("k31c warm (fresh Triton cache)", {"K31C_COMPILE_CACHE": str(d / "k31c"),
                                                           "TORCHINDUCTOR_CACHE_DIR": str(d / "ind4"),
                                                           "TRITON_CACHE_DIR": str(d / "tri3")}))
        runs = chosen(runs, args.runs)
        results = {}
        for name, env in runs:
            print(f"... {name}", file=sys.stderr, flush=True)
            results[name] = run_child(args, env)
    lines = [f"# Compile cache: cold and warm starts (target {args.target}, config {args.config}, "
             f"steps {args.steps})", "",
             f"`python benchmarks/compile_cache.py --target {args.target} --config {args.config} --steps {args.steps}"
             + (f' --runs "{args.runs}"' if args.runs else "")
             + (f" --jit-workers {args.jit_workers}" if args.jit_workers is not None else "") + "`",
             "", "| run | imports s | start s (compile + prebuild) | first tokens s | process wall s | start / its cold start |"
             " Triton kernels compiled / loaded from its cache |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        cold = results[name.split()[0] + " cold"]["start"]
        lines.append(f"| {name} | {r['imports']:.2f} | {r['start']:.2f} | {r['first']:.2f} | {r['wall']:.2f} | {r['start'] / cold:.1%} | "
                     + (f"{r['triton']['compiled']} / {r['triton']['loaded']} |" if args.target != "cpu" else "- |"))
    for name, r in results.items():
        if r.get("built"):
            lines += ["", f"{name}'s steps built: " + "; ".join(
                f"{s}: capture {b['capture']:.1f} s, passes {b['passes']:.1f} s, passes + code generation "
                f"{b['build']:.1f} s" for s, b in r["built"].items())]
    if "k31c warm" in results:
        lines += ["", "k31c warm's steps: " + "; ".join(f"{s}: {c}" for s, c in results["k31c warm"]["cache"].items())]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
