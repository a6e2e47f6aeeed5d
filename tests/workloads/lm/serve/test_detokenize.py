"""A request's text as its tokens arrive: characters split across tokens, stop strings across tokens, held-back
text, and a byte-level BPE whose streamed text equals decoding the whole continuation at once."""

import numpy as np

from systolic.data.tokenizer import ByteTokenizer
from systolic.workloads.lm.generate import continuation_text
from systolic.workloads.lm.serve.detokenize import TextStream


def stream(text: str, stop: tuple[str, ...] = (), prompt: str = "> ") -> tuple[list[str], bool, str]:
    """Feeds `text` byte by byte; returns (each token's emitted text, whether a stop string ended it, the flush)."""
    tok = ByteTokenizer()
    s = TextStream(tok, tok.encode(prompt).tolist(), stop)
    deltas = []
    for byte in tok.encode(text).tolist():
        delta, stopped = s.add(byte)
        deltas.append(delta)
        if stopped:
            return deltas, True, ""
    return deltas, False, s.finish()


def test_characters_split_across_tokens_come_out_whole():
    deltas, stopped, rest = stream("héllo wörld €")
    assert "".join(deltas) + rest == "héllo wörld €" and not stopped and rest == ""
    assert "\ufffd" not in "".join(deltas)
    assert deltas[1:3] == ["", "é"]  # the two bytes of é: nothing, then the character


def test_stop_strings_end_the_text_before_them_even_across_tokens():
    deltas, stopped, _ = stream("say hello world", stop=("lo w", "xyz"))
    assert stopped and "".join(deltas) == "say hel"
    # Text that may begin a stop string waits: "l", "lo", "lo " are held, then released when "x" breaks the match.
    deltas, stopped, rest = stream("ab lo xz", stop=("lo w",))
    assert not stopped and "".join(deltas) == "ab lo xz" and deltas[-3:] == ["", "lo x", "z"]
    # A request that ends while text is held flushes it.
    deltas, stopped, rest = stream("ab lo", stop=("lo w",))
    assert "".join(deltas) == "ab " and rest == "lo"


def test_byte_level_bpe_streams_what_decoding_everything_gives():
    from systolic.data.bpe import train_bpe

    text = "def add(x, y):\n    return x + y  # naïve sum\n"
    tok = train_bpe([text] * 20, 300)
    ids = tok.encode(text).tolist()
    prompt, new = ids[:4], ids[4:]
    s = TextStream(tok, prompt)
    out = "".join(s.add(t)[0] for t in new) + s.finish()
    assert out == continuation_text(tok, np.asarray(prompt), np.asarray(new))
