"""The compile cache on the GPU (skipped without CUDA; `scripts/gpu_check.sh` runs it): the h200
program of the tiny model built into a fresh cache, then loaded by a second compile that
neither captures nor generates code, its decode steps replayed as device graphs staged from the
recorded step inputs, computing what eager computes. Prints the cold and warm compile times
(spec G11: warm <= 5% of cold)."""
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
