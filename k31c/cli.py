"""The `k31c` command line: `k31c init | logits | generate` (more subcommands plug in the same way).

Each subcommand is one `add_<name>(subparsers)` function that declares its arguments and sets
`run`, listed in COMMANDS. Bad input is reported as one `k31c: error: ...` line (a config or
checkpoint error adds its list of problems) with exit status 2; torch is imported only by the
commands that need it, so `k31c --help` stays fast.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import unicodedata
from pathlib import Path
from typing import Callable, Optional

from .config import PRESETS, ConfigError

PROG = "k31c"


class UsageError(Exception):
    """Input the user can fix (bad argument, missing file): reported without a traceback."""


# ---- shared helpers --------------------------------------------------------------------------

def _log(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def _deterministic() -> None:
    """Same checkpoint and tokens -> same bytes out, run after run."""
    import torch
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)


def _checkpoint_dir(arg: Optional[str]) -> Path:
    from .checkpoint import default_checkpoint
    if arg is None:
        return default_checkpoint(log=_log)
    path = Path(arg)
    if not path.exists():
        raise UsageError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise UsageError(f"--checkpoint {path} is not a directory")
    return path


def _load_model(arg: Optional[str]):
    from .checkpoint import load_checkpoint
    _deterministic()
    return load_checkpoint(_checkpoint_dir(arg))


def _check_length(n: int, cfg, what: str) -> None:
    if n > cfg.max_seq_len:
        raise UsageError(f"{what} ({n} tokens) exceeds the model's maximum length {cfg.max_seq_len}")


def _parse_tokens(text: str) -> list[int]:
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(t == "" for t in items):
        raise UsageError(f"--tokens {text!r}: expected comma-separated token ids such as 1,2,3")
    ids = []
    for t in items:
        try:
            ids.append(int(t))
        except ValueError:
            raise UsageError(f"--tokens: {t!r} is not an integer token id") from None
    return ids


def _write_atomic(path: Path, write: Callable) -> None:
    """Write through a temporary file in the same directory, then rename it into place."""
    if not path.parent.is_dir():
        raise UsageError(f"--out {path}: directory {path.parent} does not exist")
    if path.is_dir():
        raise UsageError(f"--out {path} is a directory")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _printable(text: str) -> str:
    """Control characters a random model emits would drive the terminal; show them escaped."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else f"\\x{ord(c):02x}"
                   for c in text)


# ---- k31c init ----------------------------------------------------------------------------------

def add_init(sub) -> None:
    p = sub.add_parser("init", help="write a checkpoint of random weights (deterministic per seed)",
                       description="Write config.json + model.safetensors with the random init of "
                                   "spec §9.5. The same config and seed give byte-identical files.")
    p.add_argument("--config", default="tiny",
                   help=f"a preset ({', '.join(PRESETS)}) or a config.json / checkpoint directory "
                        "(default: tiny)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--out", required=True, help="output directory (must not exist, or be empty)")
    p.add_argument("--force", action="store_true", help="replace an existing checkpoint at --out")
    p.set_defaults(run=run_init)


def run_init(args) -> int:
    from .checkpoint import init_checkpoint
    if args.config not in PRESETS and not Path(args.config).exists():
        raise UsageError(f"--config {args.config!r} is neither a preset ({', '.join(PRESETS)}) "
                         "nor an existing config file or directory")
    out = Path(args.out)
    if out.exists() and not args.force and not (out.is_dir() and not any(out.iterdir())):
        raise UsageError(f"--out {out} exists and is not empty (--force replaces it)")
    init_checkpoint(args.config, args.seed, out, overwrite=args.force)
    print(f"wrote {out} (config {args.config}, seed {args.seed})")
    return 0


# ---- k31c logits --------------------------------------------------------------------------------

def add_logits(sub) -> None:
    p = sub.add_parser("logits", help="float32 logits of one prefill, saved as .npy",
                       description="Run one prefill of the given token ids and save its logits, "
                                   "float32 [T, vocab], as a NumPy .npy file (for parity checks).")
    p.add_argument("--checkpoint", help="checkpoint directory (default: the tiny model in the "
                                        "user cache, made on first use)")
    p.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--out", required=True, help="output .npy file")
    p.set_defaults(run=run_logits)


def run_logits(args) -> int:
    import numpy as np
    tokens = _parse_tokens(args.tokens)
    out = Path(args.out)
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: directory {out.parent} does not exist")
    model = _load_model(args.checkpoint)
    cfg = model.config
    bad = [t for t in tokens if not 0 <= t < cfg.vocab_size]
    if bad:
        raise UsageError(f"--tokens: ids {bad[:8]} outside [0, {cfg.vocab_size}) (the model's vocab_size)")
    _check_length(len(tokens), cfg, "--tokens")

    from .runtime.engine import Engine
    engine = Engine(model, max_requests=1, max_seq_len=len(tokens))
    logits = engine.prefill_logits(tokens).float().cpu().numpy()
    _write_atomic(out, lambda f: np.save(f, logits))
    print(f"wrote {out}: float32 {list(logits.shape)}")
    return 0


# ---- k31c generate ------------------------------------------------------------------------------

def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with the byte-level tokenizer",
                       description="Greedy (temperature 0) or sampled generation. Text is encoded "
                                   "as UTF-8 bytes (ids 0..255, BOS prepended) and printed as it "
                                   "streams; the speed goes to stderr.")
    p.add_argument("--checkpoint", help="checkpoint directory (default: the tiny model in the "
                                        "user cache, made on first use)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default: 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.set_defaults(run=run_generate)


def run_generate(args) -> int:
    from .tokenizer import VOCAB_MIN, ByteTokenizer
    if args.prompt == "":
        raise UsageError("--prompt is empty")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if not args.temperature >= 0:
        raise UsageError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    model = _load_model(args.checkpoint)
    cfg = model.config
    if cfg.vocab_size < VOCAB_MIN:
        raise UsageError(f"vocab_size {cfg.vocab_size} is too small for the byte tokenizer ({VOCAB_MIN})")
    tok = ByteTokenizer(cfg.vocab_size)
    prompt = tok.encode(args.prompt, add_bos=True)
    _check_length(len(prompt) + args.max_new_tokens, cfg, "the prompt plus --max-new-tokens")

    from .runtime.engine import Engine
    engine = Engine(model, max_requests=1, max_seq_len=len(prompt) + args.max_new_tokens)
    stream = tok.stream_decoder()
    times: list[float] = []

    def on_token(token_id: int) -> None:
        times.append(time.perf_counter())
        sys.stdout.write(_printable(stream.push(token_id)))
        sys.stdout.flush()

    start = time.perf_counter()
    new = engine.generate(prompt, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          seed=args.seed, on_token=on_token)
    sys.stdout.write(_printable(stream.flush()) + "\n")
    sys.stdout.flush()
    total = times[-1] - start
    decode = (f", then {(len(new) - 1) / (times[-1] - times[0]):.1f} tokens/s decoding"
              if len(new) > 1 else "")
    _log(f"{len(new)} tokens in {total:.2f} s: {len(new) / total:.1f} tokens/s "
         f"(prompt {len(prompt)} tokens, first token after {times[0] - start:.2f} s{decode})")
    return 0


def add_info(sub) -> None:
    p = sub.add_parser("info", help="parameter counts and cache bytes of a config (built on the "
                                    "meta device: nothing is allocated)")
    p.add_argument("--config", default="tiny", help="preset name or config.json / checkpoint dir")
    p.set_defaults(run=_run_info)


def _run_info(args) -> int:
    import torch

    from .checkpoint import config_from_name_or_path
    from .graph.model import K31ForCausalLM
    cfg = config_from_name_or_path(args.config)
    with torch.device("meta"):
        model = K31ForCausalLM(cfg)
    groups: dict[str, int] = {}
    for name, p in model.named_parameters():
        part = ("indexer" if ".indexer." in name else "routed experts" if ".experts." in name
                else "attention (MLA)" if ".self_attn." in name and name.split(".")[2].isdigit()
                and cfg.is_mla_layer(int(name.split(".")[2]))
                else "KDA" if ".self_attn." in name else "embedding + lm_head"
                if "embed_tokens" in name or "lm_head" in name else "MLP / shared / router / norms")
        groups[part] = groups.get(part, 0) + p.numel()
    print(f"config {args.config}: {cfg.num_hidden_layers} layers ({len(cfg.kda_layers)} KDA, "
          f"{len(cfg.mla_layers)} MLA{' + indexer' if cfg.has_indexer else ''})")
    total = sum(groups.values())
    unit, div = ("B", 1e9) if total >= 1e9 else ("M", 1e6)
    for part, n in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {part:<30} {n / div:10.3f} {unit}")
    print(f"  {'total':<30} {total / div:10.3f} {unit} parameters")
    itemsize = torch.empty((), dtype=cfg.torch_dtype).element_size()
    latent = len(cfg.mla_layers) * cfg.latent_dim * itemsize
    index = len(cfg.mla_layers) * (cfg.index_head_dim + 4) if cfg.has_indexer else 0
    P, K = cfg.kda_proj_dim, cfg.kda_head_dim
    state = len(cfg.kda_layers) * (cfg.kda_num_heads * K * K * 4
                                   + (cfg.short_conv_kernel_size - 1) * 3 * P * itemsize)
    print(f"  cache per token: {latent} B latent + {index} B FP8 index keys; "
          f"per request KDA state {state / 2**20:.1f} MiB")
    return 0


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="run device benchmarks (needs a GPU)",
                       description="Benchmarks live in the repository's benchmarks/ folder; each "
                                   "prints measured times beside floors measured in the same run.")
    p.add_argument("suite", choices=["kernels"], help="kernels: every Triton kernel family")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the suite (--only, --out)")
    p.set_defaults(run=_run_bench)


def _run_bench(args) -> int:
    bench_dir = Path(__file__).resolve().parent.parent / "benchmarks"
    script = bench_dir / f"{args.suite}.py"
    if not script.is_file():
        raise UsageError(f"{script} not found: benchmarks run from a source checkout of k31c")
    import runpy
    sys.argv = [str(script), *args.rest]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        return int(e.code or 0)
    return 0


# ---- entry point --------------------------------------------------------------------------------

def add_inspect(sub) -> None:
    from .inspect_cmd import add_inspect as add
    add(sub)


def add_build_kernels(sub) -> None:
    from .lowering.aot import add_build_parser
    add_build_parser(sub)


COMMANDS = [add_init, add_logits, add_generate, add_info, add_inspect, add_build_kernels, add_bench]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's usage errors, in our one-line form (exit 2)
        self.print_usage(sys.stderr)
        self.exit(2, f"{PROG}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="k31c: an inference compiler for the Kimi K3.1 Pro "
                                            "architecture.")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=_Parser)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.run(args)
    except UsageError as e:
        _log(f"error: {e}")
        return 2
    except ConfigError as e:
        _log(f"error: {e}")
        return 2
    except BrokenPipeError:  # output piped into `head` and closed: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        _log("interrupted")
        return 130
    except Exception as e:
        from .checkpoint import CheckpointError
        if isinstance(e, CheckpointError):
            _log(f"error: {e}")
            return 2
        if isinstance(e, OSError):  # the environment, not the input: disk full, permissions
            _log(f"error: {e}")
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
