"""The lm's training text: a prepared dataset (`systolic data prepare`), a mixture of them, or a raw corpus
tokenized once into the cache; and what it tells about itself (the unigram baseline, each mixture source's tokens)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from systolic.data import cached_corpus, prepared, text
from systolic.data.tokenizer import Tokenizer
from systolic.errors import UserError
from systolic.workloads.lm.config import LMConfig


@dataclasses.dataclass
class Corpus:
    train_tokens: text.Tokens  # read from shards: a prepared dataset, or a raw corpus's entry in the cache
    val_tokens: text.Tokens  # a mixture's: its sources' validation splits end to end
    val_bytes: int  # UTF-8 bytes of the validation text: the denominator of nats/byte
    num_docs: tuple[int, int]
    unigram: tuple[np.ndarray, np.ndarray]  # (vocab_size,) count of each id in train and in validation
    mixture: tuple[tuple[str, text.Tokens, float], ...] = ()  # data.mixture's (folder, training split, weight)
    origin: str = ""  # a raw corpus's start-up line: read from the cache, or tokenized and cached


def load_corpus(cfg: LMConfig, tokenizer: Tokenizer) -> Corpus:
    """A prepared dataset's folder (`systolic data prepare`), checked to hold `tokenizer`'s ids, else a raw corpus,
    tokenized by `tokenizer` on its first use into the cache (cached_corpus.py) and read from there."""
    if cfg.data.mixture_sources:
        return _load_mixture(cfg, tokenizer)
    if prepared.is_prepared(cfg.data.path):
        return _load_prepared(cfg, tokenizer)
    dataset, origin = cached_corpus.load(cfg.data.path, max_bytes=cfg.data.max_bytes, val_percent=cfg.data.val_percent,
                                         tokenizer=tokenizer)
    return dataclasses.replace(_from_dataset(dataset), origin=origin)


def _load_mixture(cfg: LMConfig, tokenizer: Tokenizer) -> Corpus:
    parts = [(_load_prepared(cfg, tokenizer, path), path, weight) for path, weight in cfg.data.mixture_sources]
    return Corpus(
        train_tokens=prepared.ConcatTokens([c.train_tokens for c, _, _ in parts]),
        val_tokens=prepared.ConcatTokens([c.val_tokens for c, _, _ in parts]),  # every source's held-out text
        val_bytes=sum(c.val_bytes for c, _, _ in parts),
        num_docs=(sum(c.num_docs[0] for c, _, _ in parts), sum(c.num_docs[1] for c, _, _ in parts)),
        unigram=(sum(c.unigram[0] for c, _, _ in parts), sum(c.unigram[1] for c, _, _ in parts)),
        mixture=tuple((path, c.train_tokens, weight) for c, path, weight in parts),
    )


def _load_prepared(cfg: LMConfig, tokenizer: Tokenizer, path: str = "") -> Corpus:
    path = path or cfg.data.path
    if not prepared.is_prepared(path):
        raise UserError(f"data.mixture names {path!r}, which is not a prepared dataset (no index.json in it). Fix: "
                        f"prepare it with `systolic data prepare SRC --out {path}`.")
    # Checks every shard's size, and the SHA-256 of those not checked before or changed since (cache.py).
    dataset = prepared.PreparedDataset.open(path, trust_verified=True)
    dataset.check_tokenizer(tokenizer)
    split_at = dataset.index["val_percent"]
    if cfg.data.max_bytes or cfg.data.val_percent != split_at:
        raise UserError(
            f"{path} is a prepared dataset, split at preparation with --val-percent {split_at} "
            f"and read whole, but this run sets data.val_percent={cfg.data.val_percent} and data.max_bytes="
            f"{cfg.data.max_bytes}. Fix: set data.val_percent={split_at} data.max_bytes=0, or prepare the data again "
            "with the split you want."
        )
    return _from_dataset(dataset)


def _from_dataset(dataset: prepared.PreparedDataset) -> Corpus:
    splits = dataset.index["splits"]
    return Corpus(
        train_tokens=dataset.tokens("train"),
        val_tokens=dataset.tokens("validation"),
        val_bytes=splits["validation"]["bytes"],
        num_docs=(splits["train"]["documents"], splits["validation"]["documents"]),
        unigram=(dataset.unigram("train"), dataset.unigram("validation")),
    )


def source_names(paths: list[str]) -> list[str]:
    """Metric names of a mixture's sources: each folder's name, numbered where two share one."""
    names = [Path(p).expanduser().resolve().name or "source" for p in paths]
    return [f"{n}_{i + 1}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def mixture_metrics(data: Corpus, global_batch: int, seq_len: int):
    """`tokens/<source>`: training tokens read from each mixture source up to and including the step."""
    names = source_names([path for path, _, _ in data.mixture])
    weights = [w for _, _, w in data.mixture]

    def metrics(step: int) -> dict[str, float]:
        rows = text.mixture_counts(step * global_batch, weights)
        return {f"tokens/{n}": float(r * seq_len) for n, r in zip(names, rows, strict=True)}

    return metrics


def baseline_nats_per_byte(data: Corpus, vocab: int) -> float:
    """The unigram model's cross-entropy on the validation text: a model that learned nothing scores this."""
    train_counts, val_counts = (np.pad(c, (0, vocab - len(c))) for c in data.unigram)
    per_token = text.unigram_cross_entropy_from_counts(train_counts, val_counts)
    return per_token * len(data.val_tokens) / data.val_bytes
