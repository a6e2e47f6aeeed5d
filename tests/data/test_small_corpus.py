"""README's "your own text: a file" on a small file: `systolic train lm data.path=FILE` with the default recipe
(lm-tiny: rows of 128 tokens, batches of 16) on 8 KB of text trains, its held-out tail evaluated and said so."""

import json
import sysconfig
from pathlib import Path

import pytest

from tiny import call


@pytest.mark.slow  # the default recipe compiles its own model (~15 s idle, 44 s under load)
def test_an_8_kb_file_trains_with_the_default_recipe(tmp_path):
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_bytes()[:8192]
    path = tmp_path / "notes.txt"
    path.write_bytes(text[:text.rindex(b"\n") + 1])  # whole lines: valid UTF-8
    code, out, err = call("train", "lm", f"data.path={path}", "train.steps=2", "sample.max_new_tokens=0",
                          "observe.tensorboard=false", "observe.plot=false", "--run-dir", str(tmp_path / "run"))
    assert code == 0, err
    # 5% of ~8,100 tokens is ~400: fewer than the 16 windows of 129 tokens of one eval batch, which then overlap.
    assert "validation: the last 5% of notes.txt (the corpus is one document, so its tail is held out" in out, out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "eval"] == [2] and "validation:" in out
