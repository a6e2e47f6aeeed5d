"""BPE tokenizers through the real CLI: `systolic tokenizer train`, a tiny `systolic train lm` with
data.tokenizer=FILE that keeps its own copy, `systolic generate` and resume from that copy, and bad input."""

import contextlib
import io
import os

import pytest

from tiny import TINY_LM

from systolic.cli import main
from systolic.data.tokenizer import ByteTokenizer, make_tokenizer
from systolic.workloads.lm.generate import continuation_text

# The model and step of tests/test_bad_input.py's run, with a BPE of <= 320 ids (the byte tokenizer's padded
# vocabulary): the same programs, so a whole test session compiles them once.
TINY = [*TINY_LM, "train.steps=1", "sample.max_new_tokens=0", "observe.tensorboard=false", "observe.plot=false",
        "data.val_percent=30", "-q"]


def call(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse's own usage errors
            code = e.code
    assert "Traceback" not in err.getvalue()
    return code, out.getvalue(), " ".join(err.getvalue().split())  # the CLI wraps error paragraphs


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory, corpus_dir):
    """A BPE trained by the CLI on the test corpus, and a 1-step run trained with it."""
    root = tmp_path_factory.mktemp("bpe-run")
    tok = root / "made" / "tok.json"
    code, out, err = call("tokenizer", "train", "--vocab-size", "300", f"data.path={corpus_dir}", "--out", str(tok))
    assert code == 0, err
    assert "trained a byte-level BPE of 300 tokens" in out and "tokens/byte" in out and tok.is_file()
    run = root / "run"
    code, _, err = call("train", "lm", *TINY, f"data.path={corpus_dir}", f"data.tokenizer={tok}", "--run-dir", str(run))
    assert code == 0, err
    return tok, run


def test_tokenizer_train_reports_compression(bpe_run):
    tok, _ = bpe_run
    bpe = make_tokenizer(str(tok))
    assert bpe.vocab_size == 300 and bpe.eot_id == 0
    assert not list(tok.parent.glob("*.tmp")), "the output is written atomically"


def test_run_keeps_a_copy_that_generate_and_resume_use(bpe_run, corpus_dir, tmp_path, monkeypatch):
    tok, run = bpe_run
    assert (run / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert "tokenizer: " + str(tok) in (run / "config.yaml").read_text()  # the config records what the user passed
    # Self-contained: the original is gone and the command runs from another folder.
    hidden = tok.with_name("moved.json")
    os.replace(tok, hidden)
    monkeypatch.chdir(tmp_path)
    try:
        code, out, err = call("generate", str(run), "--prompt", "def ", "--max-new-tokens", "6", "--temperature", "0")
        assert code == 0, err
        assert out.startswith("def ") and len(out.rstrip("\n")) > len("def ")
        # Resume also reads the run's copy (the run is complete, so this restores and stops: no compile).
        code, _, err = call("train", "lm", *TINY[:-1], f"data.path={corpus_dir}", f"data.tokenizer={tok}",
                            "--run-dir", str(run))
        assert code == 0 and "resumed from checkpoint step 1" in err, err
        # generate really decodes with the copy: without it the run's ids cannot become text.
        copy = run / "tokenizer.json"
        saved = copy.read_bytes()
        copy.unlink()
        code, _, err = call("generate", str(run), "--max-new-tokens", "2")
        assert code == 2 and "tokenizer.json" in err and "is missing" in err
        copy.write_bytes(saved)
    finally:
        os.replace(hidden, tok)


def test_resume_with_another_tokenizer_is_refused(bpe_run, corpus_dir):
    _, run = bpe_run
    before = sorted(p.name for p in run.iterdir())
    code, _, err = call("train", "lm", *TINY, f"data.path={corpus_dir}", "data.tokenizer=byte", "--run-dir", str(run))
    assert code == 2 and "different tokenizer" in err and "Fix:" in err
    assert sorted(p.name for p in run.iterdir()) == before


@pytest.mark.parametrize("content, message", [(None, "does not exist"), ('{"version": "1.0",', "cannot be read as JSON")])
def test_missing_or_corrupt_tokenizer_through_the_cli(tmp_path, corpus_dir, content, message):
    path = tmp_path / "tok.json"
    if content is not None:
        path.write_text(content)
    run = tmp_path / "run"
    code, _, err = call("train", "lm", *TINY, f"data.path={corpus_dir}", f"data.tokenizer={path}", "--run-dir", str(run))
    assert code == 2 and message in err and "Fix:" in err
    assert not run.exists(), "a failed start leaves no run directory behind"


def test_tokenizer_train_bad_input(tmp_path, corpus_dir):
    out = str(tmp_path / "tok.json")
    for argv, message in [
        (["--vocab-size", "100", "--out", out], "out of range"),
        (["--vocab-size", "400", "data.path=/no/such/corpus", "--out", out], "does not exist"),
        (["--vocab-size", "400", "model.d_model=8", "--out", out], "reads only data.*"),
        (["--vocab-size", "400", f"data.path={corpus_dir}", "--out", str(tmp_path)], "is a folder"),
    ]:
        code, _, err = call("tokenizer", "train", *argv)
        assert code == 2 and message in err and "Fix:" in err, err
    assert not (tmp_path / "tok.json").exists()
    code, _, err = call("tokenizer", "train", "--out", out)  # argparse: a usage line, exit 2
    assert code == 2 and "--vocab-size" in err


def test_continuation_keeps_the_space_a_llama_decoder_strips():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from systolic.data.bpe import BPETokenizer

    words = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "▁hello": 3, "▁world": 4}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    words.decoder = decoders.Metaspace(prepend_scheme="first")
    words.add_special_tokens(["<unk>", "<s>", "</s>"])
    llama_like = BPETokenizer(words)
    prompt, new = llama_like.encode("hello"), llama_like.encode("hello world")[1:]
    assert new.tolist() == [4] and llama_like.decode(new) == "world", "the decoder strips a text's leading space"
    assert continuation_text(llama_like, prompt, new) == " world"
    byte = ByteTokenizer()
    assert continuation_text(byte, byte.encode("def"), byte.encode(" f")) == " f"
