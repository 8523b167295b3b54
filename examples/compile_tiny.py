"""Compile the tiny model for the CPU and check it against the eager model.

    .venv/bin/python examples/compile_tiny.py

k31c.compile captures each step kind (prefill, decode) once, runs the pass pipeline and builds
the program with Inductor; the engine drives it exactly as it drives the eager model. The report
says what every pass did. Cold Inductor builds take a minute or two on two cores.
"""
import torch

import k31c
from k31c.checkpoint import load_checkpoint
from k31c.checkpoint_save import default_checkpoint
from k31c.runtime.engine import Engine

model = load_checkpoint(default_checkpoint(log=print))
compiled = k31c.compile(model, target="cpu")

prompt = list(range(1, 25))                       # longer than index_topk (16): sparse rows
eager, fast = Engine(model, max_requests=1, max_seq_len=64), Engine(compiled, max_requests=1, max_seq_len=64)
a, b = eager.add_request(), fast.add_request()
worst = (eager.prefill([a], [prompt]) - fast.prefill([b], [prompt])).abs().max()
for tok in (3, 1, 4, 1, 5):
    worst = max(worst, (eager.decode([a], [tok]) - fast.decode([b], [tok])).abs().max())
print(compiled.report)
print(f"max |eager - compiled| over prefill + 5 decode steps: {float(worst):.2e}")
assert worst < 1e-3, "compiled logits differ from the eager model"
