"""A run's tokenizer as a folder that Hugging Face tooling loads (`AutoTokenizer.from_pretrained(FOLDER)`), for
clients that tokenize for themselves: lm-evaluation-harness splits a multiple-choice item's context from its
continuation with it, guidellm counts prompt lengths with it.

A BPE run is that folder already: its tokenizer.json and companions (chat_template.jinja), plus a
tokenizer_config.json naming the special tokens, written here when the run has none (a tokenizer trained by
`systolic tokenizer train`). A byte-tokenizer run keeps RUN/hf-tokenizer/: a tokenizer.json whose ids are the
bytes (a byte-level BPE without merges) and its two special tokens, <|endoftext|> (256) and <|pad|> (257), so
transformers gives the ids the byte tokenizer gives, special tokens spelt in text included. (Not RUN/tokenizer.json:
that file marks a BPE run.) `systolic serve` writes what a run lacks when it starts, and names the folder in GET
/v1/models ("root").
"""

from __future__ import annotations

import json
from pathlib import Path

from systolic import outfile
from systolic.data.bpe import BPETokenizer
from systolic.data.tokenizer import RUN_FILE, ByteTokenizer, Tokenizer

BYTE_FOLDER = "hf-tokenizer"
CONFIG_FILE = "tokenizer_config.json"


def folder(run_dir: Path, tokenizer: Tokenizer) -> Path:
    """Where the run's loadable tokenizer is (or will be)."""
    return Path(run_dir) / BYTE_FOLDER if isinstance(tokenizer, ByteTokenizer) else Path(run_dir)


def write(run_dir: Path, tokenizer: Tokenizer) -> Path:
    """Writes what the folder lacks (each file atomically) and returns it; an existing tokenizer_config.json (a
    model's own) is kept."""
    where = folder(run_dir, tokenizer)
    if isinstance(tokenizer, ByteTokenizer):
        where.mkdir(exist_ok=True)
        if not (where / RUN_FILE).is_file():
            outfile.write_bytes(where / RUN_FILE, byte_tokenizer_json().encode("utf-8"))
    if not (where / CONFIG_FILE).is_file():
        outfile.write_bytes(where / CONFIG_FILE, json.dumps(tokenizer_config(tokenizer), indent=2).encode("utf-8"))
    return where


def tokenizer_config(tokenizer: Tokenizer) -> dict[str, object]:
    """transformers' tokenizer_config.json: the fast tokenizer class and the special tokens' spellings."""
    names = {i: name for name, i in tokenizer.special_tokens.items()}
    config: dict[str, object] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                                 "eos_token": names.get(tokenizer.eot_id), "pad_token": names.get(tokenizer.pad_id)}
    bos = getattr(tokenizer, "bos_id", None) if isinstance(tokenizer, BPETokenizer) else None
    if bos is not None:
        config["bos_token"] = names[bos]
    return config


def byte_tokenizer_json() -> str:
    """The byte tokenizer as a Hugging Face tokenizer.json: each byte is GPT-2's printable symbol for it, with the
    byte's value as its id, and no merges, so every text encodes to its UTF-8 bytes and decodes back."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    alphabet = _byte_symbols()
    vocab = {symbol: byte for byte, symbol in enumerate(alphabet)}
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    by_id = sorted(ByteTokenizer.special_tokens.items(), key=lambda item: item[1])
    assert [i for _, i in by_id] == list(range(256, 256 + len(by_id))), "special ids follow the bytes"
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name, _ in by_id])
    return tokenizer.to_str(pretty=True)


def _byte_symbols() -> list[str]:
    """GPT-2's bytes_to_unicode: the printable character that byte-level BPE writes for each byte, by byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]
