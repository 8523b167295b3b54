"""Byte-level tokenizer for the tiny model: ids 0..255 are the bytes of UTF-8 text, then specials.

Random-weight models need no learned vocabulary, and bytes make any prompt encodable. Decoding
skips special and out-of-byte-range ids and replaces invalid UTF-8 with U+FFFD, so whatever a
model samples can always be shown.
"""
from __future__ import annotations

import codecs
from typing import Iterable

BOS_ID = 256
EOS_ID = 257
NUM_BYTE_IDS = 256
VOCAB_MIN = 258  # bytes + BOS + EOS: the smallest vocabulary this tokenizer fits


class ByteTokenizer:
    bos_id = BOS_ID
    eos_id = EOS_ID

    def __init__(self, vocab_size: int = 512):
        if vocab_size < VOCAB_MIN:
            raise ValueError(f"vocab_size={vocab_size}: the byte tokenizer needs at least {VOCAB_MIN} ids")
        self.vocab_size = vocab_size

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID] + ids if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < NUM_BYTE_IDS).decode("utf-8", errors="replace")

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder()


class StreamDecoder:
    """Decodes ids one at a time, holding back the bytes of an unfinished UTF-8 character."""

    def __init__(self):
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if not 0 <= token_id < NUM_BYTE_IDS:
            return ""
        return self._utf8.decode(bytes([token_id]))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
