"""Tokenizers for the lm workload, picked by `data.tokenizer`: "byte" (the default) or a path to a tokenizer.json.

The byte tokenizer needs no training and no file. A BPE tokenizer (`systolic.data.bpe`) is a Hugging Face
tokenizer.json, trained by `systolic tokenizer train` or shipped with a model. A run trained with one keeps a
copy as RUN_DIR/tokenizer.json, so the run directory alone is enough to resume and to generate. A model's
tokenizer.json comes with companion files (its special tokens and chat template, `systolic.data.chat`), which
travel with it into the run and back out to Hugging Face.

A spec becomes a `Tokenizer` by `make_tokenizer` once, where a run or a config is opened (training starts,
`lm/loaded_run.load_run`, `systolic plan` and `bench`, `data prepare`, an import from Hugging Face); everything below
that takes the object. The functions here that read a run directory only decide which spec to open.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from systolic import outfile
from systolic.data.unicode_text import check_unicode
from systolic.errors import ConfigError, UserError


RUN_FILE = "tokenizer.json"  # a run's own copy of its BPE tokenizer, in the run directory
# Files of a Hugging Face folder that belong to its tokenizer.json: special tokens (tokenizer_config.json, or
# special_tokens_map.json in old folders) and the chat template (chat_template.jinja since transformers 5, else an
# entry of tokenizer_config.json); the model's generation settings, its eos ids above all (generation_config.json,
# and model_token_ids.json that an import writes: `systolic.data.generation_config`). Not the named extra
# templates of additional_chat_templates/.
COMPANION_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "generation_config.json",
                   "model_token_ids.json")


class Tokenizer(Protocol):
    """What the lm workload needs from a tokenizer. `dtype` is the smallest unsigned type that holds every id."""

    name: str  # the spec it was made from: "byte", or the path of its tokenizer.json (or of a folder holding one)
    vocab_size: int
    eot_id: int  # appended after every document
    pad_id: int
    dtype: type

    def encode(self, text: str, *, add_special_tokens: bool = True) -> np.ndarray: ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def encode_with_specials(self, text: str, *, add_special_tokens: bool = False) -> tuple[np.ndarray, np.ndarray]:
        ...

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """Ids 0-255 are UTF-8 bytes, 256 ends a document, 257 pads."""

    name = "byte"
    eot_id = 256  # <|endoftext|>, appended after every document
    pad_id = 257
    vocab_size = 258
    dtype = np.uint16  # uint8 cannot hold the special ids next to the bytes
    special_tokens = {"<|endoftext|>": 256, "<|pad|>": 257}  # as data/hf_tokenizer.py spells them for transformers

    def encode(self, text: str, *, add_special_tokens: bool = True) -> np.ndarray:
        """UTF-8 bytes of `text` as a uint16 array (bytes have no special tokens to add)."""
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            check_unicode(text)
            raise
        return np.frombuffer(data, np.uint8).astype(np.uint16)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    def encode_with_specials(self, text: str, *, add_special_tokens: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Ids of `text` in which the special tokens' spellings ("<|endoftext|>") are those tokens, as transformers
        reads text with the run's tokenizer.json (data/hf_tokenizer.py); and each id's [start, end) characters,
        int64 (N, 2). (The bytes have nothing to add at the start.)"""
        ids, offsets, start = [], [], 0
        for piece in re.split(f"({'|'.join(map(re.escape, self.special_tokens))})", text):
            if piece in self.special_tokens:
                ids.append(self.special_tokens[piece])
                offsets.append((start, start + len(piece)))
            else:  # every byte of a character spans that character
                ids.extend(self.encode(piece).tolist())
                chars = start + np.repeat(np.arange(len(piece)), [len(c.encode("utf-8")) for c in piece])
                offsets.extend(zip(chars.tolist(), (chars + 1).tolist()))
            start += len(piece)
        return np.asarray(ids, self.dtype), np.asarray(offsets, np.int64).reshape(-1, 2)

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        """Text of `ids` (any integer array or list); special ids are dropped (or spelt out, when not
        `skip_special_tokens`), broken UTF-8 becomes U+FFFD."""
        if skip_special_tokens and isinstance(ids, list):  # the serving engine's few ids a token: no numpy round trip
            return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
        ids = np.asarray(ids).reshape(-1)
        if not skip_special_tokens:
            names = {i: name for name, i in self.special_tokens.items()}
            cuts = [0, *np.flatnonzero(ids >= 256).tolist(), len(ids)]
            return "".join(self.decode(ids[a:b]) + (names.get(int(ids[b]), "") if b < len(ids) else "")
                           for a, b in zip(cuts, cuts[1:]))
        return ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def make_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer `data.tokenizer=spec` names: "byte", or a tokenizer.json (or a folder holding one).

    Raises ConfigError when the file is missing or is not a tokenizer.json.
    """
    if spec == ByteTokenizer.name:
        return ByteTokenizer()
    from systolic.data.bpe import BPETokenizer  # imports the Rust library only when a BPE is used

    return BPETokenizer.load(tokenizer_file(spec), name=spec)


def tokenizer_file(spec: str) -> Path:
    """The tokenizer.json that `spec` names; ConfigError if there is none."""
    path = Path(spec)
    try:
        path = path.expanduser()
        if path.is_dir() and (path / RUN_FILE).is_file():
            return path / RUN_FILE
        if path.is_file():
            return path
        problem = "is a folder without a tokenizer.json in it" if path.is_dir() else "does not exist"
    except (OSError, ValueError, RuntimeError) as e:  # a name too long for the file system, a NUL byte, ~nosuchuser
        problem = f"is not a usable path ({e})"
    raise ConfigError(
        f"data.tokenizer={spec!r} {problem}. Expected 'byte' (the built-in byte-level tokenizer) or the path of a "
        "Hugging Face tokenizer.json (or of a folder holding one, such as a downloaded model). Fix: correct the path, "
        "train one with `systolic tokenizer train --vocab-size 8192 data.path=CORPUS --out tok.json`, or set "
        "data.tokenizer=byte."
    )


# THE RUN DIRECTORY'S COPY -------------------------------------------------------------------------------------


def run_tokenizer(run_dir: Path, spec: str) -> str:
    """What `make_tokenizer` should load for the finished or running run in `run_dir` trained with
    data.tokenizer=`spec`: "byte", or the run's own copy RUN_DIR/tokenizer.json (never the original path, which
    may be relative to another folder, changed or gone)."""
    if spec == ByteTokenizer.name:
        return spec
    copy = Path(run_dir) / RUN_FILE
    if not copy.is_file():
        raise UserError(
            f"{run_dir} was trained with data.tokenizer={spec!r}, but its copy of that tokenizer, {copy}, is "
            "missing, so its token ids cannot be turned into text. Fix: copy the tokenizer.json that the run was "
            f"trained with to {copy}."
        )
    return str(copy)


def tokenizer_for_training(run_dir: Path, spec: str, *, resuming: bool) -> str:
    """The data.tokenizer a training run in `run_dir` uses. A fresh run uses `spec`. A run that resumes from
    its checkpoints uses its own copy, after checking that `spec` names the same tokenizer (the checkpoints'
    embedding rows mean that tokenizer's ids); `spec` may point at a file that no longer exists."""
    if not resuming:
        return spec
    copy = Path(run_dir) / RUN_FILE
    has_copy = copy.is_file()
    trained_with = f"the tokenizer in {copy}" if has_copy else "the byte tokenizer (data.tokenizer=byte)"
    if spec == ByteTokenizer.name or not has_copy:
        same = spec == ByteTokenizer.name and not has_copy
    else:
        try:
            same = tokenizer_file(spec).read_bytes() == copy.read_bytes()
        except ConfigError:
            same = True  # the original is gone: the copy is the tokenizer
    if not same:
        raise UserError(
            f"{run_dir} holds checkpoints of a run trained with {trained_with}, but this run asks for "
            f"data.tokenizer={spec!r}, a different tokenizer; the checkpoints' embeddings would be read as the wrong "
            f"tokens. Fix: pass a new --run-dir, or resume with the run's own tokenizer (data.tokenizer="
            f"{copy if copy.is_file() else 'byte'})."
        )
    return spec if spec == ByteTokenizer.name else str(copy)


def tokenizer_files(source: Path) -> dict[str, Path]:
    """What travels with the tokenizer.json `source`, by the name each has in a run or a Hugging Face folder:
    tokenizer.json itself and the companions beside it. Only a file named tokenizer.json has companions: a
    `tok.json` (as `systolic tokenizer train` writes) is no Hugging Face folder's, whatever lies beside it."""
    source = Path(source)
    companions = [source.with_name(name) for name in COMPANION_FILES] if source.name == RUN_FILE else []
    return {RUN_FILE: source, **{p.name: p for p in companions if p.is_file()}}


def store_in_run(run_dir: Path, spec: str) -> None:
    """Makes `run_dir` self-contained: copies the tokenizer.json that `spec` names to RUN_DIR/tokenizer.json, and
    its companions beside it, each atomically; removes a tokenizer (for the byte tokenizer) or companions that an
    earlier run left in the same directory and that `spec` does not have."""
    run_dir = Path(run_dir)
    copy = run_dir / RUN_FILE
    files = {} if spec == ByteTokenizer.name else tokenizer_files(tokenizer_file(spec))
    if copy.exists() and RUN_FILE in files and files[RUN_FILE].resolve() == copy.resolve():
        return  # resuming from the run's own copy
    for name in (RUN_FILE, *COMPANION_FILES):
        if name in files:
            outfile.write_bytes(run_dir / name, files[name].read_bytes())
        else:
            (run_dir / name).unlink(missing_ok=True)
