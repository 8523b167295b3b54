"""`k31c bench kernels`: every kernel benchmark in one run on the GPU, one table.

The machine's floors (copy bandwidth, matrix rates) are measured once at the start of the run and
every row is compared with them. Usage: `python benchmarks/kernels.py [--only indexer,topk,...]`.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

FAMILIES = ("indexer", "topk", "mla", "kda", "moe", "layer")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="k31c bench kernels")
    ap.add_argument("--only", default=",".join(FAMILIES),
                    help=f"comma-separated subset of {', '.join(FAMILIES)}")
    ap.add_argument("--out", help="also write the markdown table to this file")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("k31c bench kernels: error: needs a CUDA GPU (benchmarks are measured, not simulated)",
              file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from harness import markdown, measure_machine
    fams = [f.strip() for f in args.only.split(",") if f.strip()]
    unknown = [f for f in fams if f not in FAMILIES]
    if unknown:
        print(f"k31c bench kernels: error: unknown family {unknown}; known: {FAMILIES}", file=sys.stderr)
        return 2
    machine = measure_machine()
    print(f"# {machine.name}: copy {machine.copy_gbps:.0f} GB/s, bf16 {machine.bf16_tflops:.0f} TFLOP/s",
          flush=True)
    rows = []
    for fam in fams:
        t0 = time.time()
        print(f"# running bench_{fam} ...", flush=True)
        rows += importlib.import_module(f"bench_{fam}").run(machine)
        print(f"# bench_{fam} done in {time.time() - t0:.0f} s", flush=True)
    table = markdown(rows, machine)
    print(table)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            f.write(table + "\n")
        os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
