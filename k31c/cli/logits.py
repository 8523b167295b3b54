"""`k31c logits`: float32 logits of one prefill, saved as .npy (for parity checks)."""
from __future__ import annotations

from ..errors import UsageError
from ..fsutil import naming, write_atomic
from .common import bad_weights, check_length, checkpoint_config, checkpoint_dir, load_model, output_file


def add(sub) -> None:
    p = sub.add_parser("logits", help="float32 logits of one prefill, saved as .npy",
                       description="Run one prefill of the given token ids and save its logits, "
                                   "float32 [T, vocab], as a NumPy .npy file (for parity checks).")
    p.add_argument("--checkpoint", help="checkpoint directory (default: the tiny model in the "
                                        "user cache, made on first use)")
    p.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--out", required=True, help="output .npy file")
    p.set_defaults(run=run)


def parse_tokens(text: str) -> list[int]:
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(t == "" for t in items):
        raise UsageError(f"--tokens {text[:40]!r}: expected comma-separated token ids such as 1,2,3")
    ids = []
    for t in items:
        try:
            ids.append(int(t))
        except ValueError:
            raise UsageError(f"--tokens: {t[:40]!r} is not an integer token id") from None
    return ids


def run(args) -> int:
    tokens = parse_tokens(args.tokens)
    out = output_file(args.out, "--out")
    ckpt = checkpoint_dir(args.checkpoint)
    cfg = checkpoint_config(ckpt)
    bad = [t for t in tokens if not 0 <= t < cfg.vocab_size]
    if bad:
        raise UsageError(f"--tokens: ids {bad[:8]} outside [0, {cfg.vocab_size}) (the model's vocab_size)")
    check_length(len(tokens), cfg, "--tokens")

    model = load_model(ckpt)
    import numpy as np

    from ..runtime.engine import Engine
    engine = Engine(model, max_requests=1, max_seq_len=len(tokens))
    logits = engine.prefill_logits(tokens).float().cpu().numpy()
    bad = int((~np.isfinite(logits)).sum())
    if bad:   # no file
        raise bad_weights(ckpt, f"{bad} of its {logits.size} logits are NaN or inf; {out} not written")
    try:
        write_atomic(out, lambda f: np.save(_Writer(f), logits))
    except OSError as e:   # a device (/dev/full) is written in place, its error without the path
        raise (naming(e, out) if e.filename is None else e) from None
    print(f"wrote {out}: float32 {list(logits.shape)}")
    return 0


class _Writer:
    """A file as np.save sees a stream: it then writes through f.write, whose failure is an
    OSError with its errno (ENOSPC), where a real file goes through ndarray.tofile, whose failure
    says only "N requested and M written"."""

    def __init__(self, f):
        self.write = f.write
