"""Corpus reading (each input format, skips, user errors) and the deterministic train/validation split."""

import json
import sys
import warnings

import pytest

from systolic.data.corpus import (MIN_HELD_OUT_EXAMPLES, Document, held_out, read_documents, split_documents, split_note,
                                   stdlib_dir)
from systolic.errors import UserError


def test_single_text_file(tmp_path):
    (tmp_path / "a.txt").write_text("héllo wörld\n", encoding="utf-8")
    assert read_documents(str(tmp_path / "a.txt")) == [Document("a.txt", "héllo wörld\n")]


def test_directory_is_recursive_sorted_and_skips_hidden(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "b" / "z.txt").write_text("z")
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "c.md").write_text("c")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / ".git" / "HEAD").write_text("ref")
    (tmp_path / ".hidden.txt").write_text("h")
    docs = read_documents(str(tmp_path))
    assert docs == [Document("a.txt", "a"), Document("b/z.txt", "z"), Document("c.md", "c")]


def test_binary_and_non_utf8_files_are_skipped_with_a_warning(tmp_path):
    (tmp_path / "good.txt").write_text("text")
    (tmp_path / "nul.bin").write_bytes(b"ab\x00cd")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.warns(UserWarning, match="Skipped 2 file"):
        docs = read_documents(str(tmp_path))
    assert [d.name for d in docs] == ["good.txt"]


def test_jsonl_one_document_per_line(tmp_path):
    rows = [{"text": "first"}, {"text": "ünïcode", "id": 3}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    docs = read_documents(str(tmp_path / "c.jsonl"))
    assert docs == [Document("c.jsonl:1", "first"), Document("c.jsonl:2", "ünïcode")]


@pytest.mark.parametrize("bad_line", ["not json", '{"txt": "x"}', '{"text": 3}', "[1, 2]"])
def test_bad_jsonl_line_names_file_and_line(tmp_path, bad_line):
    (tmp_path / "c.jsonl").write_text('{"text": "ok"}\n' + bad_line + "\n")
    with pytest.raises(UserError, match=r"c\.jsonl line 2"):
        read_documents(str(tmp_path / "c.jsonl"))


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["one", None, "three"]}), tmp_path / "c.parquet")
    assert read_documents(str(tmp_path / "c.parquet")) == [
        Document("c.parquet:0", "one"),
        Document("c.parquet:2", "three"),
    ]
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "d.parquet")
    with pytest.raises(UserError, match="no column 'text'"):
        read_documents(str(tmp_path / "d.parquet"))


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # makes `import pyarrow.parquet` fail
    (tmp_path / "c.parquet").write_bytes(b"PAR1")
    with pytest.raises(UserError, match=r"pip install 'systolic\[parquet\]'"):
        read_documents(str(tmp_path / "c.parquet"))


def test_tilde_expands(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "a.txt").write_text("home")
    assert read_documents("~/a.txt") == [Document("a.txt", "home")]


def test_missing_path_and_empty_corpus_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_documents(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no usable text"):
        read_documents(str(tmp_path / "empty"))
    (tmp_path / "bin").write_bytes(b"\x00\x01")
    with pytest.raises(UserError, match="1 unreadable, binary or non-UTF-8"), pytest.warns(UserWarning):
        read_documents(str(tmp_path / "bin"))


def test_max_bytes_cuts_deterministically(tmp_path):
    for name in "abc":
        (tmp_path / f"{name}.txt").write_text(name * 10)
    docs = read_documents(str(tmp_path), max_bytes=15)
    assert docs == [Document("a.txt", "a" * 10), Document("b.txt", "b" * 5)]
    # A cut inside a multi-byte character drops the partial character instead of producing invalid text.
    (tmp_path / "a.txt").write_text("ééé")
    assert read_documents(str(tmp_path / "a.txt"), max_bytes=3) == [Document("a.txt", "é")]


def test_stdlib_default_corpus():
    # The stdlib ships a few Latin-1 test modules; their skip warning is expected and not checked here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        docs = read_documents("")
    names = [d.name for d in docs]
    assert len(docs) > 1000 and names == sorted(names)
    assert all(n.endswith(".py") for n in names) and "os.py" in names
    assert not any(part in n.split("/") for n in names for part in ("site-packages", "dist-packages"))
    assert sum(len(d.text) for d in docs) > 5_000_000
    assert stdlib_dir().is_dir()


def test_split_is_deterministic_and_non_empty():
    docs = [Document(f"doc{i}.txt", f"text {i}") for i in range(200)]
    train, val = split_documents(docs, 10.0)
    assert (train, val) == split_documents(docs, 10.0)
    assert sorted(train + val, key=docs.index) == docs
    assert 5 <= len(val) <= 40  # ~20 expected from the hash
    # A document's side depends on its name only, not on what else is in the corpus.
    assert split_documents(docs[:100], 10.0)[1] == [d for d in val if d in docs[:100]]


@pytest.mark.parametrize("val_percent", [0.001, 99.999])
def test_split_moves_one_document_when_a_side_is_empty(val_percent):
    docs = [Document("a", "1"), Document("b", "2"), Document("c", "3")]
    train, val = split_documents(docs, val_percent)
    assert train and val and len(train) + len(val) == 3
    assert (train, val) == split_documents(docs, val_percent)


def test_single_document_is_split_by_characters():
    train, val = split_documents([Document("only", "0123456789" * 10)], 5.0)
    assert train == [Document("only", "0123456789" * 9 + "01234")]
    assert val == [Document("only", "56789")]


def test_validation_never_takes_more_than_half_of_the_text_and_the_note_says_why():
    """Two files, the one the name hash holds out holding 60% of the text: the other one (40%) is held out."""
    names = ["notes.txt", "diary.txt"]
    by_hash = held_out(names, 50.0)  # one each side: two documents
    big, small = names[by_hash.index(True)], names[by_hash.index(False)]
    docs = [Document(name, "x" * (600 if name == big else 400)) for name in names]
    train, val = split_documents(docs, 50.0)
    assert [d.name for d in val] == [small] and [d.name for d in train] == [big]
    assert split_note(docs, 50.0) == (f"validation: {small}, the shortest document (40% of the text): holding out "
                                      "documents by name would have taken more than half of the text")
    even = [Document(name, "x" * 500) for name in names]  # half is not more than half: the hash's split stands
    assert [d.name for d in split_documents(even, 50.0)[1]] == [big] and split_note(even, 50.0) == ""
    assert "the last 5% of notes.txt" in split_note(docs[:1], 5.0)


def test_a_held_out_set_is_topped_up_to_its_minimum_where_the_data_allows():
    """200 pairs at 5%: about 10 by the hash, topped up to 40 (a fifth of 200, under the minimum of 50); 1,000 at 5%:
    about 50 already. Topping up only adds: every name the hash held out stays held out."""
    names = [f"pairs.jsonl:{i}" for i in range(1000)]
    plain = held_out(names[:200], 5.0)
    topped = held_out(names[:200], 5.0, at_least=MIN_HELD_OUT_EXAMPLES)
    assert sum(plain) < 20 and sum(topped) == 40
    assert all(t for p, t in zip(plain, topped) if p)
    many = held_out(names, 5.0, at_least=MIN_HELD_OUT_EXAMPLES)
    assert sum(many) >= MIN_HELD_OUT_EXAMPLES and sum(many) < 100
