"""`k31c prebuild`: build a model's step programs into the compile cache ahead of time."""
from __future__ import annotations

import time

from ..errors import RuntimeFailure, UsageError
from .common import (add_compile_args, checkpoint_config, checkpoint_dir, compile_model, load_model, log,
                     non_negative_int, pool_len, positive_int)


def add(sub) -> None:
    p = sub.add_parser("prebuild", help="build a model's step programs into the compile cache",
                       description="Compile the given step kinds for a target and store them in the "
                                   "compile cache, so that `k31c generate --target T` (or "
                                   "k31c.compile with an Engine of the same pool) loads them instead "
                                   "of compiling. Programs are specialised to the cache pool: give "
                                   "the --max-requests and --max-seq-len the later run uses.")
    p.add_argument("--checkpoint", help="checkpoint directory (default: the tiny model in the "
                                        "user cache, made on first use)")
    add_compile_args(p, default_target=None)
    p.add_argument("--steps", default="prefill,decode",
                   help="comma-separated step kinds: prefill, decode, verifyR (R rows a request, "
                        "e.g. verify4) (default: prefill,decode, what generate runs)")
    p.add_argument("--max-requests", type=positive_int, default=1,
                   help="requests the cache pool holds (default: 1, as generate)")
    p.add_argument("--max-seq-len", type=positive_int, default=None,
                   help="tokens a request holds (default: the model's maximum, at most 4096, as generate)")
    p.add_argument("--jit-workers", type=non_negative_int, default=None, metavar="N",
                   help="threads that compile the steps' Triton kernels before their first run on the "
                        "GPU, from a dry run of the steps (default: one per usable CPU; 0: each kernel "
                        "at its first launch, one after another)")
    p.set_defaults(run=run)


def run(args) -> int:
    steps = [s.strip() for s in args.steps.split(",")]
    if not all(steps):
        raise UsageError(f"--steps {args.steps!r}: expected comma-separated step kinds such as prefill,decode")
    ckpt = checkpoint_dir(args.checkpoint)
    cfg = checkpoint_config(ckpt)
    if args.max_seq_len is not None and args.max_seq_len > cfg.max_seq_len:
        raise UsageError(f"--max-seq-len {args.max_seq_len} exceeds the model's maximum length {cfg.max_seq_len}")
    model = load_model(ckpt)
    from ..graph.capture import StepKind
    from ..runtime.engine import Engine
    for s in steps:
        try:
            StepKind.parse(s)
        except ValueError as e:
            raise UsageError(f"--steps: {e}") from None
    compiled = compile_model(model, args.target, args.cache_dir, args.dense_codegen)
    if compiled.cache is None:
        raise UsageError("the compile cache is off ($K31C_COMPILE_CACHE); give --cache-dir, or unset it"
                         if args.cache_dir is None else
                         f"--target {args.target} builds with executor '{compiled.executor}', which the "
                         "compile cache does not hold yet (it holds executor 'inductor', the cpu target's)")
    engine = Engine(compiled, max_requests=args.max_requests,
                    max_seq_len=args.max_seq_len or pool_len(cfg))
    from ..compile_cache import Unwritable
    try:
        compiled.cache.entries.prepare()
    except Unwritable as e:
        raise UsageError(f"the compile cache cannot take entries: {e}") from None
    log(f"compile cache {compiled.cache.root}")
    if args.jit_workers and compiled.target.device != "cuda":
        log(f"--jit-workers: target {args.target} launches no Triton kernel (its kernels are built with "
            "its programs): nothing to compile ahead")
    for s in steps:
        start = time.perf_counter()
        ran = compiled.prebuild(engine, [s], jit_workers=args.jit_workers)
        note = compiled.report.steps[StepKind.parse(s).name].cache
        if note.startswith("not stored"):
            raise RuntimeFailure(f"{s}: {note}")
        done = ("already cached" if note.startswith("hit") else "built") + (", ran once" if ran else "")
        print(f"{s}: {done} in {time.perf_counter() - start:.1f} s ({note.split('; ')[-1]})")
    if compiled.target.device == "cuda" and not ran:
        print(f"the {args.target} programs did not run here: their Triton kernels compile at their first "
              f"run on a {args.target} GPU, into this cache's kernel store")
    return 0
