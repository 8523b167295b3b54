"""`k31c generate`: text with the byte-level tokenizer, streamed as it is generated."""
from __future__ import annotations

import sys
import time

from ..errors import UsageError
from .common import (add_compile_args, bad_weights, check_length, checkpoint_config, checkpoint_dir,
                     compile_model, finite_float, load_model, log, pool_len, positive_int, printable, seed,
                     utf8_text)

MIN_TEMPERATURE = 1e-3   # below it sampling is greedy in effect and logits / T overflow float32


def add(sub) -> None:
    p = sub.add_parser("generate", help="generate text with the byte-level tokenizer",
                       description="Greedy (temperature 0) or sampled generation. Text is encoded "
                                   "as UTF-8 bytes (ids 0..255, BOS prepended) and printed as it "
                                   "streams; generation stops at EOS; the speed goes to stderr.")
    p.add_argument("--checkpoint", help="checkpoint directory (default: the tiny model in the "
                                        "user cache, made on first use)")
    p.add_argument("--prompt", required=True, type=utf8_text, help="prompt text")
    p.add_argument("--max-new-tokens", type=positive_int, default=32,
                   help="tokens to generate at most (default: 32)")
    p.add_argument("--temperature", type=finite_float, default=0.0,
                   help=f"0 = greedy, else at least {MIN_TEMPERATURE} (default: 0)")
    p.add_argument("--top-p", type=finite_float, default=1.0, help="nucleus sampling mass (default: 1)")
    p.add_argument("--seed", type=seed, default=0, help="sampling seed, 0..2^64-1 (default: 0)")
    add_compile_args(p, default_target="eager")
    p.set_defaults(run=run)


def _check_args(args) -> None:
    if sys.stdout is None:   # started with stdout closed (`>&-`)
        raise UsageError("standard output is closed: generate prints its text there")
    if args.prompt == "":
        raise UsageError("--prompt is empty")
    t = args.temperature
    if t < 0:
        raise UsageError(f"--temperature must be >= 0, got {t}")
    if 0 < t < MIN_TEMPERATURE:
        raise UsageError(f"--temperature {t}: must be 0 (greedy) or at least {MIN_TEMPERATURE} "
                         "(smaller ones overflow the scaled logits)")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    for given, flag in ((args.cache_dir, "--cache-dir"), (args.dense_codegen, "--dense-codegen")):
        if args.target == "eager" and given is not None:
            raise UsageError(f"{flag} applies to a compiled target (--target cpu); "
                             "--target eager compiles nothing")


def run(args) -> int:
    from ..tokenizer import VOCAB_MIN, ByteTokenizer
    _check_args(args)
    ckpt = checkpoint_dir(args.checkpoint)
    cfg = checkpoint_config(ckpt)
    if cfg.vocab_size < VOCAB_MIN:
        raise UsageError(f"vocab_size {cfg.vocab_size} is too small for the byte tokenizer ({VOCAB_MIN})")
    tok = ByteTokenizer(cfg.vocab_size)
    prompt = tok.encode(args.prompt, add_bos=True)
    check_length(len(prompt) + args.max_new_tokens, cfg, "the prompt plus --max-new-tokens")

    model = load_model(ckpt)
    from ..runtime.engine import Engine, NonFiniteLogits
    needed = len(prompt) + args.max_new_tokens
    if args.target == "eager":
        engine = Engine(model, max_requests=1, max_seq_len=needed)
    else:   # the compile cache's programs are specialised to the pool: one length for all prompts
        compiled = compile_model(model, args.target, args.cache_dir, args.dense_codegen)
        engine = Engine(compiled, max_requests=1, max_seq_len=pool_len(cfg, needed))
        if compiled.target.device == "cuda":    # its kernels compiled on threads, not one by one at first launch
            compiled.prebuild(engine, ["prefill", "decode"])
    stream = tok.stream_decoder()
    times: list[float] = []
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"

    def show(text: str) -> str:
        # an output encoding without a character (PYTHONIOENCODING=ascii: U+FFFD, é) gets its escape
        return printable(text).encode(encoding, "backslashreplace").decode(encoding)

    def on_token(token_id: int) -> None:
        times.append(time.perf_counter())
        sys.stdout.write(show(stream.push(token_id)))
        sys.stdout.flush()

    start = time.perf_counter()
    try:
        new = engine.generate(prompt, args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, seed=args.seed, on_token=on_token, eos_id=tok.eos_id)
    except NonFiniteLogits as e:
        where = f"after {len(times)} generated tokens" if times else "for the prompt"
        raise bad_weights(ckpt, f"{e} {where}") from None
    finally:  # also on Ctrl-C: the partial text ends its line
        if times:
            sys.stdout.write(show(stream.flush()) + "\n")
            sys.stdout.flush()
    total = times[-1] - start
    decode = (f", then {(len(new) - 1) / (times[-1] - times[0]):.1f} tokens/s decoding"
              if len(new) > 1 else "")
    stop = ", stopped at EOS" if new[-1] == tok.eos_id else ""
    log(f"{len(new)} tokens in {total:.2f} s: {len(new) / total:.1f} tokens/s "
        f"(prompt {len(prompt)} tokens, first token after {times[0] - start:.2f} s{decode}{stop})")
    return 0
