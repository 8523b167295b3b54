"""The cpu target's code generators side by side on the tiny model: the whole step graph by
Inductor (the default), and executor "program" with its dense pieces by Inductor or by IREE
(llvm-cpu: the export mi350x builds for gfx950). Per path: the decode step's time at B = 4
(after 3 warm steps, mean of 10), the time spent inside the IREE modules, and the logits' error
against eager over one engine scenario (prefill, decode, 3-row verification), relative to the
largest eager logit.

    python benchmarks/cpu_dense_codegen.py [--steps 10]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import k31c.api as k31c_api                      # noqa: E402
from k31c.graph.capture import StepKind           # noqa: E402
from k31c.runtime.engine import Engine            # noqa: E402
from tiny_model import engine_scenario, make_model  # noqa: E402

PATHS = {
    "inductor, whole graph (default)": {},
    "program, Inductor pieces": {"executor": "program", "dense_codegen": "inductor"},
    "program, IREE pieces": {"executor": "program", "dense_codegen": "iree"},
}
SCENARIO = ([(0, 40), (0, 5), (7, 18)], 100, (0, 2), 2)


def decode_ms(model, compiled, steps: int) -> float:
    eng = Engine(compiled, max_requests=4, max_seq_len=128)
    g = torch.Generator().manual_seed(3)
    rids = [eng.add_request() for _ in range(4)]
    eng.prefill(rids, [torch.randint(0, model.config.vocab_size, (16,), generator=g).tolist() for _ in rids])
    toks = torch.randint(0, model.config.vocab_size, (4 * (steps + 3),), generator=g).tolist()
    for i in range(3):
        eng.decode(rids, toks[4 * i:4 * i + 4])
    start = time.perf_counter()
    for i in range(3, 3 + steps):
        eng.decode(rids, toks[4 * i:4 * i + 4])
    return 1e3 * (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    model = make_model()
    want = engine_scenario(model, model, *SCENARIO)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; tiny model, decode B = 4\n")
    print("| path | decode ms a step | of it inside IREE modules | rel. error vs eager |")
    print("|---|---|---|---|")
    for label, options in PATHS.items():
        compiled = k31c_api.compile(model, target="cpu", options={**options, "cache": False})
        err = (engine_scenario(model, compiled, *SCENARIO) - want).abs().max() / want.abs().max()
        ms = decode_ms(model, compiled, args.steps)
        inside = ""
        if options.get("dense_codegen") == "iree":
            program = compiled._programs[StepKind("decode")]
            inside = f"{1e3 * sum(p.seconds for p in program.kernels.pieces) / program.executor.runs:.2f}"
        print(f"| {label} | {ms:.2f} | {inside} | {float(err):.1e} |")


if __name__ == "__main__":
    main()
