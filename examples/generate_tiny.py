"""Generate text with the tiny random-weight model, from Python instead of the CLI.

    .venv/bin/python examples/generate_tiny.py "Hello"

The model is the one `k31c generate` uses without --checkpoint (made on first use in the user
cache directory). Its weights are random, so the text is noise: this shows the calls, not a result.
"""
import sys

from k31c.checkpoint import load_checkpoint
from k31c.checkpoint_save import default_checkpoint
from k31c.runtime.engine import Engine
from k31c.tokenizer import ByteTokenizer

prompt = sys.argv[1] if len(sys.argv) > 1 else "Hello"
model = load_checkpoint(default_checkpoint(log=print))
tokenizer = ByteTokenizer(model.config.vocab_size)
ids = tokenizer.encode(prompt, add_bos=True)

engine = Engine(model, max_requests=1, max_seq_len=len(ids) + 32)
greedy = engine.generate(ids, max_new_tokens=32)
sampled = engine.generate(ids, max_new_tokens=32, temperature=0.8, top_p=0.9, seed=1)
print("greedy token ids: ", greedy)
print("sampled token ids:", sampled)
print("sampled text:", repr(tokenizer.decode(sampled)))
