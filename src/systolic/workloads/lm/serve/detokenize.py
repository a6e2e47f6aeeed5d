"""A request's text as its tokens arrive: the new text of each token, with stop strings cut and held back.

Decoding one token alone can be wrong: a character split across tokens (bytes, byte-level BPE) decodes to U+FFFD
until its last byte arrives, and a decoder that strips a leading space (Llama's SentencePiece) drops one at the
start of a decode. So each token's text is the difference between two decodes that start a few tokens back
(vLLM's prefix and read offsets): cheap, as only a short window is decoded, and equal to decoding everything.

Stop strings: the text ends before the first stop string that appears in it, which may span tokens. Text that
could still become the start of a stop string (a suffix of it that is a prefix of one) is held back until the
next tokens decide; a finished request flushes what it held. With `keep_stop` (vLLM's include_stop_str_in_output)
the text ends after the stop string instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from systolic.data.tokenizer import Tokenizer

CONTEXT_TOKENS = 5  # prompt tokens decoded before the first new one, for the decoder's context (vLLM's choice)


class TextStream:
    """The text of the tokens after `prompt_ids`, one token at a time."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: tuple[str, ...] = (), *,
                 keep_stop: bool = False, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.keep_stop = keep_stop
        self.skip_special_tokens = skip_special_tokens  # False: special tokens' text is written too
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix = 0  # ids[prefix:read] were decoded for the text already produced
        self.read = len(self.ids)
        self.stop = stop
        self.pending = ""  # decoded text held back: it may start a stop string

    def add(self, token: int) -> tuple[str, bool]:
        """Appends `token`; returns (the text to emit now, whether a stop string appeared)."""
        self.ids.append(token)
        before, after = self._decode(self.ids[self.prefix:self.read]), self._decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):  # an incomplete character: wait for more bytes
            return self._release(), False
        self.pending += after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        found = [(self.pending.index(s), len(s) if self.keep_stop else 0) for s in self.stop if s in self.pending]
        if found:
            start, kept = min(found)
            text, self.pending = self.pending[:start + kept], ""
            return text, True
        return self._release(), False

    def finish(self) -> str:
        """What is left at the end: held text and any incomplete character (as U+FFFD)."""
        before, after = self._decode(self.ids[self.prefix:self.read]), self._decode(self.ids[self.prefix:])
        text = self.pending + after[len(before):] if after.startswith(before) else self.pending
        self.pending = ""
        self.prefix = self.read = len(self.ids)
        return text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _release(self) -> str:
        """The pending text less its longest suffix that begins some stop string."""
        hold = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(stop[:n]):
                    hold = n
                    break
        text = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        return text
