"""The compile cache on the GPU (skipped without CUDA; `scripts/gpu_check.sh` runs it): the h200
program of the tiny model built into a fresh cache, then loaded by a second compile that
neither captures nor generates code, its decode steps replayed as device graphs staged from the
recorded step inputs, computing what eager computes; and in fresh processes, a start from a
prebuilt compile cache with fresh Triton and Inductor caches (the compile cache alone, as on a
machine it was copied to) compiling no Triton kernel. Prints the cold and warm compile times (spec G11: warm <= 5% of
cold, no Inductor or Triton compile in it)."""
import os
import time

import pytest
import torch

import k31c.api as k31c_api
from program_scenario import max_rel_err, program_scenario
from tiny_model import make_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA device")

TOL_F32 = 2e-3      # test_gpu_program.py's float32 tolerance


def test_warm_program_loads_and_replays(tmp_path, monkeypatch):
    model = make_model().cuda()
    want = program_scenario(model, model, "cuda")
    cold = k31c_api.compile(model, target="h200", options={"cache": tmp_path})
    start = time.perf_counter()
    program_scenario(model, cold, "cuda")
    cold_s = time.perf_counter() - start
    build_cold = sum(s.build_seconds + s.capture_seconds for s in cold.report.steps.values())

    import torch._inductor as inductor
    monkeypatch.setattr(inductor, "standalone_compile", lambda *a, **k: pytest.fail("the warm start compiled"))
    monkeypatch.setattr(k31c_api, "capture_cached", lambda *a, **k: pytest.fail("the warm start captured"))
    warm = k31c_api.compile(model, target="h200", options={"cache": tmp_path})
    start = time.perf_counter()
    got = program_scenario(model, warm, "cuda")
    warm_s = time.perf_counter() - start
    build_warm = sum(s.build_seconds for s in warm.report.steps.values())
    print(f"compile cache: cold scenario {cold_s:.1f}s (builds {build_cold:.1f}s), warm scenario "
          f"{warm_s:.1f}s (loads {build_warm:.2f}s, {build_warm / build_cold:.1%} of the builds)")
    print(warm.report)
    for step in ("prefill", "decode", "verify4"):
        assert warm.report.steps[step].cache.startswith("hit"), warm.report.steps[step].cache
        assert warm.report.steps[step].fallbacks == {}
    stats = warm.graph_stats()
    assert stats["decode"]["replays"] >= 4 and stats["verify4"]["replays"] == 1
    errs = max_rel_err(got, want)
    assert max(errs) < TOL_F32, errs


def test_generate_on_h200_builds_then_loads(tmp_path):
    """`k31c generate --target h200` twice: the first builds the programs into the cache, the
    second loads them (no "compiling" line) and prints the same text. (Their logits against
    eager are the test above's; the eager text is printed beside, not compared: a greedy pick
    between near-equal random-weight logits may differ in the last bits.)"""
    import subprocess
    import sys
    env = {**os.environ, "K31C_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "k31c", "generate", "--prompt", "Hello", "--max-new-tokens", "12"]
    runs = [subprocess.run(cmd + extra, env=env, capture_output=True, text=True, timeout=500)
            for extra in ([], ["--target", "h200", "--cache-dir", str(tmp_path / "cache")],
                          ["--target", "h200", "--cache-dir", str(tmp_path / "cache")])]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    eager, cold, warm = runs
    print(cold.stderr, warm.stderr, f"eager: {eager.stdout!r}, h200: {cold.stdout!r}")
    assert "compiling the prefill step for h200" in cold.stderr
    assert "compiling" not in warm.stderr
    assert cold.stdout == warm.stdout and cold.stdout.strip()


def test_a_copied_prebuilt_cache_starts_without_compiling_a_triton_kernel(tmp_path):
    """Two processes: the first only prebuilds (`compiled.prebuild(engine, steps, jit_workers=0)`:
    on the GPU each step runs once, its kernels compiled at their first launch) into an empty compile cache with fresh Triton and Inductor caches; the
    second starts from that compile cache alone (fresh Triton and Inductor caches again, as on a
    machine it was copied to), prefills and decodes: it loads its steps and compiles no Triton
    kernel (k31c's from the cache's kernel store, Inductor's from its artifacts), and its logits
    are eager's."""
    (prebuilt, _), (warm, _) = _start_processes(tmp_path, ("prebuild", "run"))
    print(f"Triton kernels compiled / loaded: prebuild {prebuilt['builds']}, then {warm['builds']}")
    assert prebuilt["ran"] and prebuilt["builds"]["compiled"] > 0
    assert all(c.startswith("miss") for c in prebuilt["cache"].values()), prebuilt["cache"]
    assert all(c.startswith("hit") for c in warm["cache"].values()), warm["cache"]
    assert warm["builds"]["compiled"] == 0, warm["builds"]
    got, want = torch.tensor(warm["logits"]), torch.tensor(warm["eager"])
    assert ((got - want).abs().max() / want.abs().max()).item() < TOL_F32


def test_prebuild_compiles_ahead_on_threads(tmp_path):
    """`prebuild(..., jit_workers=4)` in a fresh process (fresh Triton, Inductor and compile
    caches; the CUDA allocator's free memory filled with junk first): every k31c kernel the
    steps launch is compiled on the pool's threads from the dry run, none at its first real launch, and the steps that follow compute eager's logits; a
    second process from that compile cache alone (fresh Triton and Inductor caches) compiles no
    Triton kernel: the pool's compiles went into the kernel store under the keys the JIT uses."""
    (run, said), (warm, _) = _start_processes(tmp_path, ("ahead", "run"))
    print(said[-2000:])
    assert warm["builds"]["compiled"] == 0, warm["builds"]
    ours = [(name, thread) for name, thread in run["builds"]["compiled_threads"] if name in run["k31c_kernels"]]
    # the device graph's staging kernel is launched by its capture, which a dry run does not do
    on_main = [name for name, thread in ours if not thread.startswith("k31c-jit") and name != "_stage_kernel"]
    print(f"k31c kernels compiled: {len(ours)}, at their first launch: {on_main}")
    assert run["ran"] and len(ours) >= 20
    assert on_main == []
    assert "Triton kernels ahead" in said
    got, want = torch.tensor(run["logits"]), torch.tensor(run["eager"])
    assert ((got - want).abs().max() / want.abs().max()).item() < TOL_F32


def _start_processes(tmp_path, whats) -> list:
    """`_START` run once per item of `whats`, in order, on one compile cache, each process with
    fresh Triton and Inductor caches; [(its JSON line, its stderr)]."""
    import json
    import subprocess
    import sys
    script = tmp_path / "start.py"
    script.write_text(_START)
    runs = []
    for i, what in enumerate(whats):
        env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / f"triton-{i}"),
               "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{i}")}
        out = subprocess.run([sys.executable, str(script), str(tmp_path / "cache"), what], env=env,
                             capture_output=True, text=True, timeout=500)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append((json.loads(out.stdout.strip().splitlines()[-1]), out.stderr))
    return runs


# a process of the tests above: argv[1] the compile cache, argv[2] "prebuild", "run" or "ahead"
# (prebuild on 4 threads, then run); prints a JSON line: Triton's compiles (with their threads)
# and loads, each step's cache note, and what it ran
_START = r"""
import json, sys, threading, torch, triton
from k31c import api
from k31c.config import preset
from k31c.graph.model import K31ForCausalLM
from k31c.runtime.engine import Engine
builds = {"compiled": 0, "loaded": 0, "compiled_names": [], "compiled_threads": []}
def listen(*, cache_hit, metadata=None, **_):
    builds["loaded" if cache_hit else "compiled"] += 1
    if not cache_hit:
        name = str((metadata or {}).get("name", "?"))
        builds["compiled_names"].append(name)
        builds["compiled_threads"].append((name, threading.current_thread().name))
triton.knobs.compilation.listener = listen
torch.manual_seed(0)
model = K31ForCausalLM(preset("tiny"))
model.reset_parameters(torch.Generator().manual_seed(0))
model = model.eval().cuda()
compiled = api.compile(model, target="h200", options={"cache": sys.argv[1]})
engine = Engine(compiled, max_requests=2, max_seq_len=256)
out = {}
if sys.argv[2] == "ahead":   # the allocator's free blocks full of junk (as after weights made on the GPU):
    # a dry run's unwritten outputs read as indices would be out of bounds (the executor zeroes them)
    junk = [torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, device="cuda")
            for n in [1 << 16] * 2048 + [1 << 24] * 16]
    del junk
if sys.argv[2] != "run":
    out["ran"] = compiled.prebuild(engine, ["prefill", "decode"], jit_workers=4 if sys.argv[2] == "ahead" else 0)
if sys.argv[2] != "prebuild":
    def steps(eng):
        rid = eng.add_request()
        logits = [eng.prefill([rid], [list(range(3, 19))])]
        for t in (5, 6, 7):
            logits.append(eng.decode([rid], [t]))
        return [l.float().flatten()[:64].tolist() for l in logits]
    out["logits"] = steps(engine)
    out["eager"] = steps(Engine(model, max_requests=2, max_seq_len=256))
torch.cuda.synchronize()
from k31c.runtime.jit_ahead import _jit_functions
out["k31c_kernels"] = sorted({fn.__name__ for fn in _jit_functions()})
print(json.dumps({"builds": builds, "cache": {s: r.cache for s, r in compiled.report.steps.items()}, **out}))
"""
