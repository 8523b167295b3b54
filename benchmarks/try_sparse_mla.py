"""A/B of the registered h200 sparse MLA kernels (mla_sparse_ws.py's 32-key seesaw and
mla_sparse_half.py's half-release seesaw, which bf16 rows run) against variant modules, goal G4
(spec §8): the way its forms are compared before one is registered.

A variant is a Python file that defines `launch(q, latent_cache, block_table, row_req, indices,
sm_scale)` -> (out, lse), as mla_sparse_ws.launch does (a copy of mla_sparse_ws.py without its
@register line is one; its own kernels compile under their own names). Inputs are bench_mla's
G4 pool (B16 x R4, 96 heads, k 2048 of 128K, shuffled blocks) with -1 holes in one row, one
row with no key and one whose first 64 keys are -1; rows = 64 (G4), 16, 4 and 1 (key splits).
Per row count:
  1. every form against the reference op (`torch.ops.k31c.sparse_mla`): out max and rms error
     relative to its largest value, max |lse diff| where finite, +inf lse on the same rows;
  2. every form timed by CUDA graph replay (5 calls a graph), three rounds alternating the
     forms; us per call, TFLOP/s of the best round and the rate its programs gathered rows at
     (each 64-head tile of a row reads the row's keys; a form that only gathers, timed this
     way, gives the gathers' own rate).

    PYTHONPATH=. python benchmarks/try_sparse_mla.py path/to/variant.py [...]
    PYTHONPATH=. python benchmarks/try_sparse_mla.py --head-probe    # + the kernel on 64 / 128 heads

--head-probe times the registered kernel on 64 heads (one tile; its own key splits, then one
split) and 128 (two full tiles) beside 96 (a full tile and a half-empty one): what the padded
tile costs. At G4's 64 rows, 96 heads make 128 programs, one wave on 132 SMs, so the time is one
program's; the padding then costs SM time, not wall time, unless the programs outnumber the SMs.
"""
from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import torch

try:
    from benchmarks.bench_mla import DV, HEADS, SM_SCALE, TOPK, WIDTH, Pool, out_error
    from benchmarks.harness import graph_ms
except ImportError:  # run as a script from benchmarks/
    from bench_mla import DV, HEADS, SM_SCALE, TOPK, WIDTH, Pool, out_error
    from harness import graph_ms

ROWS = ((64, "G4 B16xR4"), (16, "B16xR1"), (4, "B4xR1"), (1, "B1xR1"))
ROUNDS = 3


def load_variant(path: str):
    """The module at `path` (a file, imported under its stem)."""
    p = Path(path)
    if not p.is_file():
        raise SystemExit(f"try_sparse_mla: no variant file {path}")
    spec = importlib.util.spec_from_file_location(p.stem, p)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "launch", None)):
        raise SystemExit(f"try_sparse_mla: {path} defines no launch()")
    return module


def main(argv: list[str]) -> int:
    from k31c.graph import ops  # noqa: F401  (torch.ops.k31c.*)
    from k31c.lowering.triton import mla_sparse_half as half
    from k31c.lowering.triton import mla_sparse_ws as registered
    # the two registered kernels: the 32-key seesaw (FP8 rows) and the half-release seesaw,
    # which the registered launcher runs on these bf16 rows
    forms = {"32-key seesaw": registered.launch, "half-release seesaw": half.launch}
    probe = "--head-probe" in argv
    forms.update({Path(a).stem: load_variant(a).launch for a in argv if a != "--head-probe"})
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    pool = Pool(128 << 10)
    table, _, idx = pool.context(128 << 10)
    idx = idx.clone()
    idx[3, 100:400] = -1                 # holes
    idx[5, :] = -1                       # a row with no key
    idx[7, :64] = -1                     # a row whose first 64-key block has no key
    for rows, label in ROWS:
        args = (pool.q[:rows], pool.cache, table, pool.row_req[:rows], idx[:rows], SM_SCALE)
        want = torch.ops.k31c.sparse_mla(*args, DV)
        for name, fn in forms.items():
            print(f"{label} {name}: {out_error(fn(*args), want, 'reference')}", flush=True)
        heads = {name: HEADS for name in forms}
        here = dict(forms)
        if probe:       # what the padded second tile costs: the kernel on 64 and on 128 heads
            for n_heads, splits in ((64, None), (64, 1), (128, None)):
                q_h = pool.q[:rows].repeat(1, 2, 1)[:, :n_heads].contiguous()
                name = f"{n_heads} heads{'' if splits is None else f', {splits} split'} (probe)"
                here[name] = functools.partial(
                    lambda q_h, splits, *a: registered.launch(q_h, *a[1:], splits=splits), q_h, splits)
                heads[name] = n_heads
        times = {name: [] for name in here}
        for _ in range(ROUNDS):
            for name, fn in here.items():
                times[name].append(graph_ms(functools.partial(fn, *args), calls=5) * 1e3)
        for name, t in times.items():
            flops = 2.0 * rows * heads[name] * TOPK * (WIDTH + DV)
            # the rows every head-tile program gathers (a row's tiles each read its keys)
            tiles = -(-heads[name] // registered.HEADS_TILE)
            gathered = rows * tiles * TOPK * WIDTH * pool.cache.element_size()
            print(f"{label} {name}: " + " / ".join(f"{x:.1f}" for x in t)
                  + f" us; best {min(t):.1f} us = {flops / min(t) / 1e6:.0f} TFLOP/s, "
                  + f"{gathered / min(t) / 1e3:.0f} GB/s of gathered rows", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
