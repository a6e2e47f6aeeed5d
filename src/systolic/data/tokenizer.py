"""Byte-level tokenizer: no training, no vocabulary file, every string encodes losslessly."""

from __future__ import annotations

import numpy as np

from systolic.errors import UserError


class ByteTokenizer:
    """Ids 0-255 are UTF-8 bytes, 256 ends a document, 257 pads."""

    name = "byte"
    eot_id = 256  # <|endoftext|>, appended after every document
    pad_id = 257
    vocab_size = 258

    def encode(self, text: str) -> np.ndarray:
        """UTF-8 bytes of `text` as a uint16 array (uint8 cannot hold the special ids next to them)."""
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        """Text of `ids` (any integer array or list); special ids are dropped, broken UTF-8 becomes U+FFFD."""
        ids = np.asarray(ids).reshape(-1)
        return ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def make_tokenizer(name: str) -> ByteTokenizer:
    """The tokenizer called `name` (data.tokenizer)."""
    if name == ByteTokenizer.name:
        return ByteTokenizer()
    raise UserError(
        f"data.tokenizer={name!r} is not a known tokenizer. Expected one of: 'byte'. Fix: set data.tokenizer=byte."
    )
