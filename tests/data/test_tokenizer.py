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


# A RUN'S OWN COPY ---------------------------------------------------------------------------------------------


def _bpe_file(path, words):
    from systolic.data.bpe import train_bpe

    train_bpe([words * 20], 300).save(path)
    return str(path)


def test_a_fresh_run_stores_a_copy_and_generate_reads_it(tmp_path):
    from systolic.data.tokenizer import run_tokenizer, store_in_run, tokenizer_for_training

    run = tmp_path / "run"
    run.mkdir()
    spec = _bpe_file(tmp_path / "tok.json", "alpha beta gamma ")
    assert tokenizer_for_training(run, spec, resuming=False) == spec
    store_in_run(run, spec)
    assert (run / "tokenizer.json").read_bytes() == (tmp_path / "tok.json").read_bytes()
    assert sorted(p.name for p in run.iterdir()) == ["tokenizer.json"], "no temporary file is left behind"
    assert run_tokenizer(run, spec) == str(run / "tokenizer.json")
    assert run_tokenizer(run, "byte") == "byte"
    # A byte run in the same directory removes the stale copy, so it cannot be mistaken for the run's tokenizer.
    store_in_run(run, "byte")
    assert not (run / "tokenizer.json").exists()
    with pytest.raises(UserError, match="is missing"):
        run_tokenizer(run, spec)


def test_a_resumed_run_uses_its_copy_and_refuses_another_tokenizer(tmp_path):
    from systolic.data.tokenizer import store_in_run, tokenizer_for_training

    run = tmp_path / "run"
    run.mkdir()
    spec = _bpe_file(tmp_path / "tok.json", "alpha beta gamma ")
    other = _bpe_file(tmp_path / "other.json", "delta epsilon zeta ")
    store_in_run(run, spec)
    copy = str(run / "tokenizer.json")
    assert tokenizer_for_training(run, spec, resuming=True) == copy
    assert tokenizer_for_training(run, copy, resuming=True) == copy
    assert tokenizer_for_training(run, str(tmp_path / "gone.json"), resuming=True) == copy  # the original may be gone
    for wrong in (other, "byte"):
        with pytest.raises(UserError, match="different tokenizer"):
            tokenizer_for_training(run, wrong, resuming=True)
    byte_run = tmp_path / "byte-run"
    byte_run.mkdir()
    assert tokenizer_for_training(byte_run, "byte", resuming=True) == "byte"
    with pytest.raises(UserError, match="trained with the byte tokenizer"):
        tokenizer_for_training(byte_run, spec, resuming=True)
