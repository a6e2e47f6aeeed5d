"""Text that is not Unicode: a str holding a lone surrogate, which no tokenizer can encode. Python makes them of
bytes that are not UTF-8 in a command-line argument or file name (surrogateescape: U+DC80-U+DCFF), and a JSON
\\ud800 escape without its pair gives one. Every text input is checked where it enters (`check_unicode` names
the flag or file) and again by every tokenizer's encode."""

from __future__ import annotations

import re

from systolic.errors import UserError

_SURROGATE = re.compile("[\ud800-\udfff]")


def unicode_problem(text: str) -> str | None:
    """What makes `text` not Unicode text, or None: a lone surrogate, what Python makes of bytes that are not UTF-8
    in a command-line argument (U+DC80-U+DCFF, surrogateescape) or a JSON \\ud800 escape without its pair gives.
    No tokenizer can encode such a string."""
    match = _SURROGATE.search(text)
    if match is None:
        return None
    code = ord(match.group())
    origin = (f"the byte 0x{code - 0xDC00:02X}, which is not valid UTF-8 there" if 0xDC80 <= code <= 0xDCFF
              else f"a lone surrogate U+{code:04X}, such as a JSON \\u{code:04x} escape without its pair")
    return f"character {match.start()} is {origin}"


def check_unicode(text: str, what: str = "The text to tokenize") -> str:
    """`text`, or a UserError naming `what` when it is not Unicode text (`unicode_problem`)."""
    problem = unicode_problem(text)
    if problem is None:
        return text
    raise UserError(f"{what} is not Unicode text: {problem}. Expected UTF-8 text. Fix: convert it to UTF-8 (e.g. "
                    "`iconv -f latin1 -t utf-8`) or remove that character.")
