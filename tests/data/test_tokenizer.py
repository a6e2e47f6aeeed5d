"""The byte tokenizer: lossless round trip, special ids, the factory."""

import numpy as np
import pytest

from systolic.data.tokenizer import ByteTokenizer, make_tokenizer
from systolic.errors import UserError


def test_round_trip_of_unicode_text():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo, 世界 🚀'\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint16 and len(ids) == len(text.encode("utf-8"))
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text


def test_special_ids_are_dropped_and_broken_utf8_replaced():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eot_id, tok.pad_id, tok.name) == (258, 256, 257, "byte")
    ids = np.concatenate([tok.encode("ab"), [tok.eot_id, tok.pad_id], tok.encode("c")])
    assert tok.decode(ids) == "abc"
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"  # half of a two-byte character
    assert tok.encode("").shape == (0,) and tok.decode([]) == ""


def test_make_tokenizer():
    assert isinstance(make_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(UserError, match="data.tokenizer='bpe'"):
        make_tokenizer("bpe")
