"""A run's tokenizer as transformers loads it (data/hf_tokenizer.py), and text prompts with the chat template's
markers spelt out: the server's ids (`completion_prompt_ids`) equal transformers' on the same folder, for the byte
tokenizer and for a ChatML BPE."""

import json

import numpy as np
import pytest

from tiny_hf import CHATML, CONVERSATION, SPECIALS, write_hf_tokenizer

from systolic.data import hf_tokenizer
from systolic.data.bpe import BPETokenizer
from systolic.data.chat import ChatTemplate
from systolic.data.tokenizer import ByteTokenizer
from systolic.workloads.lm.serve.openai_api import completion_prompt_ids

transformers = pytest.importorskip("transformers")

TEXTS = ["héllo <|endoftext|> wörld\n  x<|pad|>", "plain text, no markers", "<|im_start|>user\nHi<|im_end|>\n"]


def test_byte_runs_tokenize_in_transformers_as_in_systolic(tmp_path):
    folder = hf_tokenizer.write(tmp_path, ByteTokenizer())
    assert folder == tmp_path / hf_tokenizer.BYTE_FOLDER and not (tmp_path / "tokenizer.json").exists()
    loaded = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert (loaded.eos_token_id, loaded.pad_token_id) == (256, 257)
    for text in TEXTS:
        ids = completion_prompt_ids(text, ByteTokenizer()).tolist()
        assert ids == loaded(text).input_ids, text
        assert loaded.decode(ids) == ByteTokenizer().decode(ids, skip_special_tokens=False) == text
    assert completion_prompt_ids("<|endoftext|>", ByteTokenizer()).tolist() == [256]  # one id, not 13 bytes


def test_chatml_markers_in_a_prompt_are_the_template_tokens(tmp_path):
    texts = ["system user assistant Be brief. What is the capital of France? Paris."] * 20
    folder = write_hf_tokenizer(tmp_path / "hf", texts, SPECIALS, {"eos_token": "<|im_end|>"}, CHATML, vocab_size=300)
    tokenizer = BPETokenizer.load(folder / "tokenizer.json")
    prompt = ChatTemplate.load(folder, tokenizer).render(CONVERSATION, add_generation_prompt=True)
    loaded = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = completion_prompt_ids(prompt, tokenizer).tolist()
    assert ours == loaded(prompt).input_ids
    assert ours.count(tokenizer.token_id("<|im_end|>")) == prompt.count("<|im_end|>") > 0
    # What the server did before: the markers as plain text, many more ids.
    assert len(tokenizer.encode(prompt)) > len(ours) + 4 * prompt.count("<|im_end|>")


def test_a_trained_bpe_gets_a_tokenizer_config_and_a_models_own_is_kept(tmp_path):
    texts = ["the quick brown fox jumps over the lazy dog"] * 10
    from systolic.data.bpe import train_bpe

    train_bpe(texts, 300).save(tmp_path / "tokenizer.json")
    tokenizer = BPETokenizer.load(tmp_path / "tokenizer.json")
    assert hf_tokenizer.write(tmp_path, tokenizer) == tmp_path
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert loaded.eos_token == "<|endoftext|>" and loaded.pad_token == "<|pad|>"
    assert loaded("the lazy fox").input_ids == tokenizer.encode("the lazy fox").tolist()
    own = {"eos_token": "<|endoftext|>", "model_max_length": 77}
    (tmp_path / hf_tokenizer.CONFIG_FILE).write_text(json.dumps(own))
    hf_tokenizer.write(tmp_path, tokenizer)
    assert json.loads((tmp_path / hf_tokenizer.CONFIG_FILE).read_text()) == own
    assert np.array_equal(tokenizer.encode_with_specials("a<|pad|>b")[0],
                          loaded("a<|pad|>b", add_special_tokens=False).input_ids)
