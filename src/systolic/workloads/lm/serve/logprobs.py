"""Log-probability detail in the inference engine: the most likely alternatives of each sampled token, and the
log-probabilities of a prompt's own tokens (OpenAI's `echo` with `logprobs`, vLLM's `prompt_logprobs`: how
lm-evaluation-harness scores multiple choice through a server).

Both come from a detail step (step.py), which reads out every token slot's distribution. A prompt token at
position p + 1 is scored by the logits at position p, which the chunk holding p computes; the last slot of a chunk
that stops mid-prompt is scored against the next chunk's first token, which the host knows (`targets`). A request
that wants its prompt scored is never started after a cached prefix (its logits would not be computed), and a
position computed twice (after a preemption) keeps its first value.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from systolic.workloads.lm.serve.scheduler import Chunk


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One token with its log-probability (None for a prompt's first token, which nothing predicts) and the most
    likely ids at its position, with theirs, most likely first."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class StepDetail:
    """A detail step's outputs on the host, per token slot: target log-probabilities (T,), top ids and their
    log-probabilities (T, K), most likely first."""

    target_logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray

    def top(self, slot: int, k: int) -> tuple[tuple[int, float], ...]:
        return tuple(zip(self.top_ids[slot, :k].tolist(), self.top_logprobs[slot, :k].tolist(), strict=True))


def targets(chunks: list[Chunk], tokens: int) -> np.ndarray:
    """int32 (tokens,): each token slot's next token in its sequence, as `scheduler.layout` lays the chunks out (0
    where none is known yet: a row's last slot, which samples it)."""
    out = np.zeros(tokens, np.int32)
    t = 0
    for chunk in chunks:
        following = chunk.seq.tokens[chunk.start + 1:chunk.start + chunk.count + 1]
        out[t:t + len(following)] = following
        t += chunk.count
    return out


class PromptLogprobs:
    """A prompt's tokens with their log-probabilities and `k` alternatives each, filled in as detail steps
    compute them."""

    def __init__(self, prompt: list[int], k: int):
        self.k = k
        self.values: list[TokenLogprob | None] = [TokenLogprob(prompt[0], None)] + [None] * (len(prompt) - 1)
        self._prompt = prompt
        self._missing = len(prompt) - 1

    @property
    def complete(self) -> bool:
        return self._missing == 0

    def wants(self, chunk: Chunk) -> bool:
        """Whether `chunk` computes logits that score a prompt token not yet recorded."""
        return not self.complete and chunk.start < len(self._prompt) - 1

    def record(self, chunk: Chunk, first_slot: int, detail: StepDetail) -> None:
        """Reads the scores of the prompt tokens that `chunk` (laid out from token slot `first_slot`) predicts."""
        for i in range(chunk.count):
            position = chunk.start + i + 1  # the prompt token that slot first_slot + i predicts
            if position < len(self.values) and self.values[position] is None:
                slot = first_slot + i
                self.values[position] = TokenLogprob(self._prompt[position], float(detail.target_logprobs[slot]),
                                                     detail.top(slot, self.k))
                self._missing -= 1

    def result(self) -> tuple[TokenLogprob, ...]:
        assert self.complete, "the prompt's every position is scored before its first token is sampled"
        return tuple(self.values)
