"""`k31c info`: parameter counts and cache bytes of a config (nothing is allocated)."""
from __future__ import annotations

from ..config import PRESETS, config_from_name_or_path
from .common import progress


def add(sub) -> None:
    p = sub.add_parser("info", help="parameter counts and cache bytes of a config (built on the "
                                    "meta device: nothing is allocated)")
    p.add_argument("--config", default="tiny",
                   help=f"a preset ({', '.join(PRESETS)}) or a config.json / checkpoint directory")
    p.set_defaults(run=run)


def run(args) -> int:
    cfg = config_from_name_or_path(args.config)
    progress(f"counting the parameters of {args.config} (one layer of each kind, meta device)")
    from ..graph.sizes import cache_bytes, parameter_groups
    groups = parameter_groups(cfg)
    print(f"config {args.config}: {cfg.num_hidden_layers} layers ({len(cfg.kda_layers)} KDA, "
          f"{len(cfg.mla_layers)} MLA{' + indexer' if cfg.has_indexer else ''})")
    total = sum(groups.values())
    unit, div = ("B", 1e9) if total >= 1e9 else ("M", 1e6)
    for part, n in groups.items():
        print(f"  {part:<30} {n / div:10.3f} {unit}")
    print(f"  {'total':<30} {total / div:10.3f} {unit} parameters")
    c = cache_bytes(cfg)

    names = {"model": f"model ({cfg.dtype})", "bf16": "bf16" if cfg.dtype != "float32" else "bf16 (float32 keys)"}

    def formats(by_format):
        return " / ".join(f"{n} B {names.get(fmt, fmt)}" for fmt, n in by_format.items())
    print(f"  cache per token, by pool format: latent {formats(c.latent_per_token)}"
          + (f"; index keys {formats(c.index_per_token)}" if c.index_per_token else ""))
    print(f"  per request: KDA state {c.kda_state_per_request / 2**20:.1f} MiB")
    return 0
