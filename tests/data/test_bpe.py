"""BPE tokenizers: a trained byte-level BPE round-trips any text and compresses code; hand-built Hugging Face
tokenizer.json files (Llama-style, GPT-2-style) load with the right special ids; ids match `transformers`."""

import json
import time

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from systolic.data.bpe import BPETokenizer, train_bpe
from systolic.data.corpus import Document, read_documents, stdlib_dir
from systolic.data.text import encode_documents
from systolic.data.tokenizer import make_tokenizer
from systolic.errors import ConfigError

VOCAB = 1024
TEXTS = [
    "def f(x):\n    return 'héllo, 世界 🚀'\n",
    "  leading and trailing spaces  \t\r\n\r\n",
    "combining: e\u0301 vs \u00e9; zero-width: a\u200bb; BOM \ufeff; NUL \x00; emoji family 👨‍👩‍👧",
    "Ελληνικά, русский, العربية, हिन्दी, 한국어 — “quotes” …",
    "<|endoftext|> is plain text here",
    "",
]


@pytest.fixture(scope="module")
def trained():
    """A BPE trained on the first ~500 kB of the standard library, and how long training took."""
    texts = [doc.text for doc in read_documents("", max_bytes=500_000)]
    start = time.perf_counter()
    tokenizer = train_bpe(texts, VOCAB, length=len(texts))
    return tokenizer, time.perf_counter() - start


def test_trained_bpe_round_trips_and_compresses(trained):
    tok, seconds = trained
    assert seconds < 30  # ~0.5 s on a free 2-core CPU
    assert (tok.vocab_size, tok.eot_id, tok.pad_id, tok.bos_id, tok.dtype) == (VOCAB, 0, 1, None, np.uint16)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids.dtype == tok.dtype and tok.decode(ids) == text
    # The special token is never produced from text: documents cannot forge an end-of-document.
    assert tok.eot_id not in tok.encode(TEXTS[4]).tolist()
    assert [ids.tolist() for ids in tok.encode_batch(TEXTS)] == [tok.encode(t).tolist() for t in TEXTS]
    # A file the tokenizer never saw (the corpus stops after ~500 kB, in alphabetical order).
    code = (stdlib_dir() / "textwrap.py").read_text(encoding="utf-8")
    ids = tok.encode(code)
    assert tok.decode(ids) == code
    assert len(ids) < 0.5 * len(code.encode("utf-8")), "a 1k-token BPE packs about 3 bytes of Python per token"
    # Special and out-of-range ids are dropped when decoding, as the byte tokenizer does.
    assert tok.decode([tok.eot_id, *tok.encode("ab"), tok.pad_id, VOCAB + 5, -1]) == "ab"


def test_save_and_load_give_the_same_tokenizer(trained, tmp_path):
    tok, _ = trained
    path = tmp_path / "tok.json"
    tok.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["tok.json"], "no temporary file is left behind"
    loaded = make_tokenizer(str(path))
    assert isinstance(loaded, BPETokenizer) and loaded.name == str(path)
    assert (loaded.vocab_size, loaded.eot_id, loaded.pad_id) == (tok.vocab_size, tok.eot_id, tok.pad_id)
    for text in TEXTS:
        assert loaded.encode(text).tolist() == tok.encode(text).tolist()
    # A folder holding a tokenizer.json (a downloaded model) works too.
    (tmp_path / "model").mkdir()
    tok.save(tmp_path / "model" / "tokenizer.json")
    assert make_tokenizer(str(tmp_path / "model")).encode(TEXTS[0]).tolist() == tok.encode(TEXTS[0]).tolist()


def llama_style_json() -> dict:
    """A tiny tokenizer.json laid out like Llama 2's: SentencePiece BPE with byte fallback, '▁' for spaces, <s>
    prepended by the post-processor, no padding token."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "▁he", "llo", "▁hello", "▁w", "or", "▁wor", "ld", "▁world"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab.update({piece: 259 + i for i, piece in enumerate(pieces)})
    merges = ["h e", "l l", "▁ he", "ll o", "▁he llo", "▁ w", "o r", "▁w or", "l d", "▁wor ld"]
    special = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": c, **special} for i, c in enumerate(["<unk>", "<s>", "</s>"])],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
        },
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def test_hand_built_llama_style_tokenizer(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(llama_style_json(), ensure_ascii=False), encoding="utf-8")
    tok = make_tokenizer(str(path))
    # bos from the post-processor, eos by name, pad absent -> the unknown token (never produced by encoding).
    assert (tok.bos_id, tok.eot_id, tok.pad_id, tok.vocab_size) == (1, 2, 0, 259 + 18)
    ids = tok.encode("hello world")
    assert ids.tolist() == [1, 259 + 12, 259 + 17]  # <s> ▁hello ▁world
    assert tok.decode(ids) == "hello world"
    # Characters outside the vocabulary fall back to their UTF-8 bytes and decode back.
    ids = tok.encode("hello 世")
    assert ids.tolist()[-3:] == [3 + b for b in "世".encode()] and tok.decode(ids) == "hello 世"


def _tokenizer_with(specials: list[str], processor=None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(["a", "b"])
    tok.add_special_tokens(specials)
    if processor is not None:
        tok.post_processor = processor
    return tok


@pytest.mark.parametrize("specials, processor, want", [
    # GPT-2: one token both ends documents and pads.
    (["<|endoftext|>"], processors.ByteLevel(trim_offsets=False), (None, 2, 2)),
    # Llama 3: bos from the post-processor, <|end_of_text|> by name, the fine-tuning pad token.
    (["<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>"],
     processors.Sequence([processors.ByteLevel(trim_offsets=False),
                          processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 2)])]),
     (2, 3, 4)),
    # An encoder-decoder style file whose template appends the end token: eos comes from the template.
    (["<pad>", "</s>", "<extra>"], processors.TemplateProcessing(single="$A <extra>", special_tokens=[("<extra>", 4)]), (None, 4, 2)),
    # BERT-style processing: [CLS] starts, [SEP] ends.
    (["[PAD]", "[CLS]", "[SEP]"], processors.BertProcessing(("[SEP]", 4), ("[CLS]", 3)), (3, 4, 2)),
    # Only a pattern gives the end token away (DeepSeek spells it with full-width bars).
    (["<｜end▁of▁sentence｜>"], None, (None, 2, 2)),
])
def test_special_ids_found_in_added_tokens_and_post_processor(specials, processor, want):
    tok = BPETokenizer(_tokenizer_with(specials, processor))
    assert (tok.bos_id, tok.eot_id, tok.pad_id) == want


def test_vocabulary_past_65536_ids_uses_uint32():
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    vocab.update({f"x{i}": len(alphabet) + i for i in range(70_000)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    bpe = BPETokenizer(tok)
    assert bpe.eot_id == 70_256 and bpe.dtype == np.uint32
    tokens = encode_documents([Document("a", "hé"), Document("b", "x")], bpe)
    assert tokens.dtype == np.uint32 and tokens.tolist().count(70_256) == 2
    assert bpe.decode(tokens) == "héx"


def test_bad_tokenizer_files_raise_config_errors(tmp_path):
    cases = {
        "missing.json": (None, "does not exist"),
        "truncated.json": ('{"version": "1.0", "model": {', "cannot be read as JSON"),
        "other.json": ('{"not": "a tokenizer"}', "is JSON but not a Hugging Face tokenizer"),
        "binary.json": (b"\xff\xfe\x00garbage", "cannot be read as JSON"),
    }
    for name, (content, message) in cases.items():
        if isinstance(content, bytes):
            (tmp_path / name).write_bytes(content)
        elif content is not None:
            (tmp_path / name).write_text(content)
        with pytest.raises(ConfigError, match=message) as error:
            make_tokenizer(str(tmp_path / name))
        assert "Fix:" in str(error.value) and str(tmp_path / name) in str(error.value)
    with pytest.raises(ConfigError, match="folder without a tokenizer.json"):
        make_tokenizer(str(tmp_path))
    for odd in ("bad\x00name.json", "x" * 5000, "~nobody-such/tok.json"):
        with pytest.raises(ConfigError, match="data.tokenizer="):
            make_tokenizer(odd)
    no_eos = tmp_path / "no_eos.json"
    no_eos.write_text(_tokenizer_with(["<mask>"]).to_str())
    with pytest.raises(ConfigError, match="no end-of-document token"):
        make_tokenizer(str(no_eos))


def test_ids_match_transformers(trained, tmp_path):
    """Our loader and transformers' PreTrainedTokenizerFast read the same file into the same ids."""
    transformers = pytest.importorskip("transformers")
    tok, _ = trained
    cases = {"gpt2-style.json": tok, "llama-style.json": None}
    tok.save(tmp_path / "gpt2-style.json")
    (tmp_path / "llama-style.json").write_text(json.dumps(llama_style_json(), ensure_ascii=False), encoding="utf-8")
    texts = [*TEXTS, "hello world hello"]
    for name in cases:
        ours = make_tokenizer(str(tmp_path / name))
        # split_special_tokens: "<|endoftext|>" inside text is text, in both (TEXTS[4]).
        theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / name), split_special_tokens=True)
        for text in texts:
            ids = ours.encode(text).tolist()
            assert ids == theirs.encode(text), (name, text)
            assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), (name, text)
