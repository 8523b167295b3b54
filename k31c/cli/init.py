"""`k31c init`: a checkpoint of random weights (spec §9.5), the same bytes for the same seed."""
from __future__ import annotations

from pathlib import Path

from ..config import PRESETS, config_from_name_or_path
from ..errors import UsageError
from .common import progress, seed


def add(sub) -> None:
    p = sub.add_parser("init", help="write a checkpoint of random weights (deterministic per seed)",
                       description="Write config.json + model.safetensors with the random init of "
                                   "spec §9.5. The same config and seed give byte-identical files.")
    p.add_argument("--config", default="tiny",
                   help=f"a preset ({', '.join(PRESETS)}) or a config.json / checkpoint directory "
                        "(default: tiny)")
    p.add_argument("--seed", type=seed, default=0, help="random seed, 0..2^64-1 (default: 0)")
    p.add_argument("--out", required=True, help="output directory (must not exist, or be empty)")
    p.add_argument("--force", action="store_true",
                   help="replace a checkpoint at --out (a directory of config.json and safetensors "
                        "files only: anything else there is refused)")
    p.set_defaults(run=run)


def _check_out(arg: str, force: bool) -> Path:
    """--out checked before the model is built: a place a checkpoint may be written."""
    from ..checkpoint_files import replace_problem
    from ..fsutil import parent_problem
    if not arg:   # Path("") is `.`, which the user did not ask for
        raise UsageError("--out is empty: give the directory to write")
    out = Path(arg)
    problem = replace_problem(out, force, "--force")
    if problem:
        raise UsageError(f"--out {arg} {problem}")
    problem = parent_problem(out)
    if problem:
        raise UsageError(f"--out {arg}: {problem}")
    return out


def run(args) -> int:
    cfg = config_from_name_or_path(args.config)
    out = _check_out(args.out, args.force)
    progress(f"building the {args.config} model (seed {args.seed}) and writing {out}")
    from ..checkpoint_save import init_checkpoint
    init_checkpoint(cfg, args.seed, out, overwrite=args.force)
    print(f"wrote {out} (config {args.config}, seed {args.seed})")
    return 0
