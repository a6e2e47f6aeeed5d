"""BPE tokenizers through Hugging Face `tokenizers`: train a byte-level one on a corpus, or load any tokenizer.json.

A trained tokenizer is byte-level (GPT-2 style): text is split with GPT-2's regex, each piece's UTF-8 bytes are
mapped to 256 printable symbols, and merges are learnt over those, so every string encodes and decodes back
exactly, with no unknown token. A loaded tokenizer.json (GPT-2, Llama, Mistral, ... as Hugging Face ships it)
keeps its own normaliser, pre-tokeniser, post-processor and decoder, so ids match `transformers` on that file.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from systolic import outfile
from systolic.data import corpus
from systolic.data.unicode_text import check_unicode
from systolic.errors import ConfigError, UserError

EOT_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOT_TOKEN, PAD_TOKEN)  # ids 0 and 1 of a trained tokenizer
MIN_VOCAB = 256 + len(SPECIAL_TOKENS) + 1  # the byte alphabet, the special tokens and at least one merge
MAX_VOCAB = 2**22

# Names of end-of-document, start-of-document and padding tokens across common model families, most usual first.
_EOS_NAMES = (EOT_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]", "<|im_end|>", "<|eot_id|>")
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "<|bos|>", "[CLS]")
_PAD_NAMES = (PAD_TOKEN, "<pad>", "[PAD]", "<|finetune_right_pad_id|>")
_UNK_NAMES = ("<unk>", "[UNK]", "<|unk|>")
_EOS_PATTERN = re.compile(r"end.?of.?(text|sentence|document)|endoftext|\beos\b", re.IGNORECASE)


class BPETokenizer:
    """A Hugging Face `tokenizers.Tokenizer` behind the same interface as `ByteTokenizer`.

    `eot_id` ends a document (the file's end-of-sequence token); `bos_id` starts one when the file's
    post-processor adds it (Llama), else None; `pad_id` is the file's padding token, else its unknown token
    (never produced by encoding), else `eot_id`, as Hugging Face does when a model has no padding token.
    `name` is the path the tokenizer was loaded from ("bpe" for one trained in memory).
    """

    def __init__(self, tokenizer: Tokenizer, name: str = "bpe"):
        # A special token's spelling inside text is encoded as plain text (as tiktoken does), so a document that
        # mentions "<|endoftext|>" neither ends early nor loses those characters when decoded. transformers
        # matches them by default; `split_special_tokens=True` there gives the same ids as here.
        tokenizer.encode_special_tokens = True
        self._tokenizer = tokenizer
        self.name = name
        # Ids can have holes (some files skip ids); the model needs a row for the largest one.
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.dtype = np.uint16 if self.vocab_size <= 2**16 else np.uint32
        specials = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self.special_tokens = specials  # spelling -> id of every special token, e.g. {"<|im_end|>": 2}
        # A post-processor pickles as its JSON; reading that avoids serialising the whole (maybe 10 MB) file.
        processor = tokenizer.post_processor
        template_bos, template_eos = _template_specials(json.loads(processor.__getstate__()) if processor else None)
        self.bos_id = template_bos if template_bos is not None else _first(specials, _BOS_NAMES)
        eot = template_eos if template_eos is not None else _first(specials, _EOS_NAMES)
        if eot is None:
            eot = next((i for content, i in specials.items() if _EOS_PATTERN.search(content)), None)
        if eot is None:
            raise ConfigError(
                f"The tokenizer {name} has no end-of-document token: none of its special tokens "
                f"({', '.join(sorted(specials)) or 'none'}) is one of {', '.join(_EOS_NAMES)}, and its post-processor "
                "appends none. The language model needs one to separate documents. Fix: use the tokenizer.json of a "
                f"causal language model, or train one with `systolic tokenizer train` (which adds {EOT_TOKEN})."
            )
        self.eot_id = eot
        pad = _first(specials, _PAD_NAMES)
        if pad is None:
            pad = _first(specials, _UNK_NAMES)
        self.pad_id = eot if pad is None else pad

    @classmethod
    def load(cls, path: str | Path, name: str | None = None) -> BPETokenizer:
        """Reads a Hugging Face tokenizer.json; raises ConfigError naming the file if it is not one."""
        path = Path(path)
        problem = None
        try:
            text = path.read_text(encoding="utf-8")
            json.loads(text)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            problem = f"cannot be read as JSON ({e})"
        else:
            try:
                tokenizer = Tokenizer.from_str(text)
            except Exception as e:  # the Rust side raises a bare Exception for any schema error
                problem = f"is JSON but not a Hugging Face tokenizer ({e})"
        if problem:
            raise ConfigError(
                f"The tokenizer file {path} {problem}. Expected a tokenizer.json as written by Hugging Face "
                "`tokenizers` (e.g. from a model repository, or by `systolic tokenizer train`). Fix: point "
                "data.tokenizer at an intact tokenizer.json, retrain it, or use data.tokenizer=byte."
            )
        return cls(tokenizer, name or str(path))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> np.ndarray:
        """Ids of `text`, with the special tokens the file's post-processor adds (e.g. Llama's <s>) unless
        `add_special_tokens` is False (text that continues other text, such as a completion after its prompt)."""
        try:
            return np.asarray(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids, self.dtype)
        except TypeError:  # the Rust side refuses a str it cannot convert to UTF-8
            check_unicode(text)
            raise

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` of each text, run in parallel threads by the Rust library."""
        try:
            return [np.asarray(e.ids, self.dtype) for e in self._tokenizer.encode_batch(list(texts))]
        except TypeError:
            for text in texts:
                check_unicode(text)
            raise

    def encode_with_specials(self, text: str, *, add_special_tokens: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Ids of `text` in which special tokens are spelt out, such as a rendered chat template ("<|im_end|>" is
        that token, as transformers matches it by default), with nothing added by the post-processor (as
        `apply_chat_template` tokenizes) unless `add_special_tokens` (as transformers' `tokenizer(text)`, e.g.
        Llama's <s>); and each id's [start, end) characters in `text`, int64 (N, 2)."""
        try:
            encoding = self._with_specials.encode(text, add_special_tokens=add_special_tokens)
        except TypeError:
            check_unicode(text)
            raise
        return np.asarray(encoding.ids, self.dtype), np.asarray(encoding.offsets, np.int64).reshape(-1, 2)

    @functools.cached_property
    def _with_specials(self) -> Tokenizer:
        # A second copy: matching special tokens is a setting of the Rust object, and `encode` needs it off.
        copy = Tokenizer.from_str(self._tokenizer.to_str())
        copy.encode_special_tokens = False
        return copy

    def token_id(self, token: str) -> int | None:
        """The id of the vocabulary entry or added token spelt `token` (e.g. "<|eot_id|>"), or None."""
        return self._tokenizer.token_to_id(token)

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids outside the vocabulary are dropped, and special tokens unless not
        `skip_special_tokens`."""
        ids = np.asarray(ids).reshape(-1)
        ids = ids[(ids >= 0) & (ids < self.vocab_size)]
        return self._tokenizer.decode(ids.tolist(), skip_special_tokens=skip_special_tokens)

    def save(self, path: str | Path) -> None:
        """Writes the tokenizer.json atomically: a reader sees the old file or the new one, never half of one."""
        outfile.write_bytes(Path(path), self._tokenizer.to_str(pretty=True).encode("utf-8"))

    def __repr__(self) -> str:
        return f"BPETokenizer({self.name!r}, vocab_size={self.vocab_size})"


def check_vocab_size(vocab_size: int) -> None:
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise ConfigError(
            f"A vocabulary of {vocab_size} ids (--vocab-size) is out of range. A byte-level BPE holds the 256 bytes "
            f"and {len(SPECIAL_TOKENS)} special tokens before its first merge, so it needs between {MIN_VOCAB} and "
            f"{MAX_VOCAB} ids. Fix: e.g. --vocab-size 8192."
        )


def train_bpe(texts: Iterable[str], vocab_size: int, *, length: int | None = None) -> BPETokenizer:
    """A byte-level BPE with `vocab_size` ids (fewer if the texts run out of pairs to merge): ids 0 and 1 are
    <|endoftext|> and <|pad|>, then the 256 byte symbols, then the merges in the order they were learnt."""
    check_vocab_size(vocab_size)
    tokenizer = Tokenizer(models.BPE())
    # No normaliser: normalising (NFC, lower-casing) would make decode(encode(text)) differ from the text.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen in the corpus or not
    )
    tokenizer.train_from_iterator(texts, trainer, length=length)
    return BPETokenizer(tokenizer)


def train_to_file(data_path: str, *, max_bytes: int, val_percent: float, vocab_size: int, out: Path,
                  force: bool = False) -> str:
    """`systolic tokenizer train`: trains on the training split of the corpus at `data_path` (the same split as
    `systolic train lm`, so validation text stays unseen), writes `out` atomically and returns a report that
    includes the compression on the held-out split."""
    check_vocab_size(vocab_size)
    if out.is_dir():
        raise UserError(f"--out {out} is a folder. Expected the path of the tokenizer.json to write. Fix: e.g. --out {out / 'tokenizer.json'}.")
    outfile.check(out, option="--out", suffixes=(".json",), force=force)
    docs = corpus.read_documents(data_path, max_bytes=max_bytes)
    train_docs, val_docs = corpus.split_documents(docs, val_percent)
    train_texts, val_texts = [d.text for d in train_docs], [d.text for d in val_docs]
    start = time.perf_counter()
    tokenizer = train_bpe(train_texts, vocab_size, length=len(train_texts))
    seconds = time.perf_counter() - start
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp")
        tokenizer.save(tmp)
        os.replace(tmp, out)  # whole or not at all
    except OSError as e:
        raise UserError(f"Cannot write the tokenizer to {out}: {e}. Fix: pass a writable --out path.") from None
    train_mb = sum(len(t.encode("utf-8")) for t in train_texts) / 1e6
    val_bytes = sum(len(t.encode("utf-8")) for t in val_texts)
    val_tokens = sum(len(ids) for ids in tokenizer.encode_batch(val_texts))
    short = f" (asked for {vocab_size:,}: the corpus ran out of pairs to merge)" if tokenizer.vocab_size < vocab_size else ""
    return (
        f"trained a byte-level BPE of {tokenizer.vocab_size:,} tokens{short} on {len(train_texts):,} documents "
        f"({train_mb:.1f} MB) in {seconds:.1f} s; held-out text ({len(val_texts):,} documents): "
        f"{val_tokens / val_bytes:.3f} tokens/byte ({val_bytes / val_tokens:.2f} bytes/token).\n"
        f"wrote {out}; use it with `systolic train lm data.tokenizer={out}`"
    )


def _first(specials: dict[str, int], names: Sequence[str]) -> int | None:
    return next((specials[n] for n in names if n in specials), None)


def _template_specials(processor: dict[str, Any] | None) -> tuple[int | None, int | None]:
    """(bos, eos) ids that a post-processor adds around a single sequence, e.g. Llama's `<s> $A`."""
    if not processor:
        return None, None
    kind = processor.get("type")
    if kind == "Sequence":
        found = [_template_specials(p) for p in processor.get("processors", [])]
        bos = next((b for b, _ in found if b is not None), None)
        return bos, next((e for _, e in found if e is not None), None)
    if kind in ("BertProcessing", "RobertaProcessing"):  # cls/sep as [token, id]
        return processor["cls"][1], processor["sep"][1]
    if kind != "TemplateProcessing":
        return None, None
    ids = {name: entry["ids"] for name, entry in processor.get("special_tokens", {}).items()}
    single = processor.get("single", [])
    at = next((i for i, piece in enumerate(single) if "Sequence" in piece), len(single))

    def special(piece: dict[str, Any]) -> int | None:
        token = piece.get("SpecialToken", {}).get("id")
        return ids[token][0] if token in ids and len(ids[token]) == 1 else None

    before = [special(p) for p in single[:at]]
    after = [special(p) for p in single[at + 1 :]]
    return (before[-1] if before else None), (after[0] if after else None)
