"""Generation settings across a Hugging Face round trip (data/generation_config.py): an imported chat model's
generation_config.json and config.json ids travel with the run through a fine-tune and come back on export, so
transformers' `generate` on the export stops at the end of turn (ChatML's <|im_end|>, Llama 3's <|eot_id|>);
`systolic generate` and the serving engine stop on every eos id the model declares; a run trained from scratch
exports the ids its tokenizer defines. Tiny random Llamas and byte-level BPEs built here: no download."""

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest

from tiny import LM_CLI_QUIET, TINY_LM, call
from tiny_hf import CHATML, SPECIALS, VOCAB, make_hf_model, write_hf_tokenizer

from systolic.data import generation_config
from systolic.data.tokenizer import COMPANION_FILES, ByteTokenizer
from systolic.data.chat import find_chat_template
from systolic.errors import UserError
from systolic.workloads.lm.hf import convert as hf
from systolic.workloads.lm.loaded_run import load_run
from systolic.workloads.lm.serve.engine import InferenceEngine

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Llama 3's layout without its dated system header, so a conversation fits the tiny model's 64 positions.
LLAMA3 = """{{- bos_token }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""


@dataclasses.dataclass(frozen=True)
class Style:
    specials: list[str]  # ids 0, 1, ... of the tokenizer, in this order
    template: str
    tokens: dict  # tokenizer_config.json
    config: dict  # config.json's ids
    generation: dict  # generation_config.json, as the model ships it
    end_of_turn: str


STYLES = {
    # Qwen2.5 Instruct: config.json's eos is <|im_end|> alone and it has no bos; the generation config adds the
    # end of text to the eos ids, pads with it and samples by default.
    "qwen": Style(SPECIALS, CHATML,
                  {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                  {"bos_token_id": None, "eos_token_id": 2},
                  {"bos_token_id": 0, "eos_token_id": [2, 0], "pad_token_id": 0, "do_sample": True,
                   "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}, "<|im_end|>"),
    # Llama 3.1 Instruct: the same eos list in both files, <|begin_of_text|> as bos, no padding token.
    "llama3": Style(["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                    LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
                    {"bos_token_id": 0, "eos_token_id": [1, 4]},
                    {"bos_token_id": 0, "eos_token_id": [1, 4], "do_sample": True, "temperature": 0.6, "top_p": 0.9},
                    "<|eot_id|>"),
}
QUESTION = [{"role": "user", "content": "Hi"}]
REPLY = "Hello there."
IDS = generation_config.ID_KEYS


def write_tokenizer(style: Style, folder: Path) -> Path:
    """A Hugging Face tokenizer folder: a byte-level BPE of at most VOCAB ids with the style's special tokens,
    tokenizer_config.json naming them and chat_template.jinja."""
    texts = [f"user\nHi\n\nassistant\n\n{REPLY}\n"] * 50  # a conversation: few tokens
    return write_hf_tokenizer(folder, texts, style.specials, style.tokens, style.template)


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory) -> dict[str, Path]:
    """{style: a Hugging Face folder of a tiny random Llama with the style's tokenizer, ids and generation config}."""
    root = tmp_path_factory.mktemp("hf-chat")
    out = {}
    for name, style in STYLES.items():
        folder = write_tokenizer(style, root / name)
        model = make_hf_model("llama")
        for key, value in style.config.items():
            setattr(model.config, key, value)
        model.generation_config = transformers.GenerationConfig(**style.generation)
        model.save_pretrained(folder)
        out[name] = folder
    return out


@pytest.fixture(scope="module")
def imported(hf_folders, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    for name, folder in hf_folders.items():
        hf.import_run(folder, root / name)
    return {name: root / name for name in hf_folders}


def ids_of(settings: dict) -> dict:
    return {key: settings.get(key) for key in IDS}


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("style", list(STYLES))
def test_import_keeps_the_generation_settings_and_export_writes_them_back(hf_folders, imported, tmp_path, style):
    source, run = hf_folders[style], imported[style]
    assert {generation_config.GENERATION_FILE, generation_config.MODEL_IDS_FILE} <= set(COMPANION_FILES)
    assert (run / "generation_config.json").read_bytes() == (source / "generation_config.json").read_bytes()
    assert ids_of(read_json(run / "model_token_ids.json")) == ids_of(read_json(source / "config.json"))
    assert read_json(source / "generation_config.json")["eos_token_id"] == STYLES[style].generation["eos_token_id"]

    hf.export_run(run, tmp_path / "out")
    # The whole generation config comes back (its sampling settings too), and config.json's ids are the imported ones.
    assert (tmp_path / "out" / "generation_config.json").read_bytes() == (source / "generation_config.json").read_bytes()
    assert ids_of(read_json(tmp_path / "out" / "config.json")) == ids_of(read_json(source / "config.json"))
    assert not (tmp_path / "out" / "model_token_ids.json").exists()  # the run's own file, not a Hugging Face one
    reloaded = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert reloaded.eos_token_id == STYLES[style].generation["eos_token_id"]


@pytest.mark.parametrize("style", list(STYLES))
def test_generate_and_the_engine_stop_on_every_declared_eos_id(imported, style):
    loaded = load_run(imported[style], "test")
    want = tuple(sorted({loaded.tokenizer.eot_id, *STYLES[style].generation["eos_token_id"]}))
    assert generation_config.eos_ids(loaded.tokenizer) == want
    template = find_chat_template(loaded.tokenizer)
    end_of_turn = loaded.tokenizer.token_id(STYLES[style].end_of_turn)
    assert set(want) | {end_of_turn} == set(template.stop_ids)
    engine = InferenceEngine(loaded.cfg.model, loaded.params, loaded.tokenizer, kv_pages=8, max_seqs=1)
    assert engine.eos_ids == want  # requests without stop_token_ids (completions, `systolic generate`) end there


def sft_data(path: Path) -> Path:
    """One short conversation, repeated: a fine-tune learns to answer it and to end the turn."""
    record = {"messages": [*QUESTION, {"role": "assistant", "content": REPLY}]}
    path.write_text((json.dumps(record) + "\n") * 64)
    return path


SFT = ["--recipe", "sft", "data.seq_len=64", "data.val_percent=10", "train.batch_size=8", "train.steps=30",
       "train.eval_every=30", "train.eval_batches=1", "optim.lr=1e-2", "optim.warmup_steps=2",
       "checkpoint.every_steps=30", "sample.max_new_tokens=0", "observe.progress=off", "observe.tensorboard=false",
       "observe.plot=false", "-q"]


@pytest.mark.slow  # two fine-tunes of 30 steps: about 40 s on 2 cores
@pytest.mark.parametrize("style", list(STYLES))
def test_an_sft_chat_model_exported_stops_at_the_end_of_turn_in_transformers(hf_folders, imported, tmp_path, style):
    source = hf_folders[style]
    code, _, err = call("train", "lm", *SFT, f"init.from={imported[style]}",
                        f"data.path={sft_data(tmp_path / 'chats.jsonl')}", "--run-dir", str(tmp_path / "sft"))
    assert code == 0, err
    code, out, err = call("generate", str(tmp_path / "sft"), "--chat", "--prompt", "Hi", "--temperature", "0",
                          "--max-new-tokens", "20")
    assert code == 0 and out.strip() == REPLY, (out, err)  # the reply ends at the end of turn
    assert call("convert", "to-hf", str(tmp_path / "sft"), str(tmp_path / "out"))[0] == 0

    out = tmp_path / "out"
    assert ids_of(read_json(out / "generation_config.json")) == ids_of(read_json(source / "generation_config.json"))
    assert ids_of(read_json(out / "config.json")) == ids_of(read_json(source / "config.json"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"]
    with torch.no_grad():  # the settings from generation_config.json, greedy
        new = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20,
                             do_sample=False)[0, prompt.shape[1]:].tolist()
    end_of_turn = tokenizer.convert_tokens_to_ids(STYLES[style].end_of_turn)
    assert new[-1] == end_of_turn and len(new) < 20, tokenizer.decode(new)
    assert tokenizer.decode(new[:-1]) == REPLY


def test_a_run_trained_from_scratch_exports_the_ids_its_tokenizer_defines(tmp_path):
    byte = ByteTokenizer()
    assert generation_config.exported(byte, None) == (
        {"bos_token_id": 256, "eos_token_id": 256, "pad_token_id": 257},) * 2
    folder = write_tokenizer(STYLES["qwen"], tmp_path / "tokenizer")
    # TINY_LM on text, whose program (its vocabulary padded to 320 rows, as the byte tokenizer's) other tests share;
    # the chat template travels with the tokenizer all the same.
    code, _, err = call("train", "lm", *TINY_LM, *LM_CLI_QUIET, f"data.tokenizer={folder}", "--run-dir",
                        str(tmp_path / "run"), "-q")
    assert code == 0, err
    assert call("convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "out"))[0] == 0
    # <|endoftext|> (0) ends and starts documents and pads; a reply also ends at the template's <|im_end|> (2).
    want = {"bos_token_id": 0, "eos_token_id": [0, 2], "pad_token_id": 0}
    assert ids_of(read_json(tmp_path / "out" / "config.json")) == want
    assert read_json(tmp_path / "out" / "generation_config.json") == want


def test_bad_generation_settings_are_refused_at_import(hf_folders, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(hf_folders["qwen"], folder)
    settings = read_json(folder / "generation_config.json")
    for eos in ([2, VOCAB], "<|im_end|>", [], True):
        (folder / "generation_config.json").write_text(json.dumps({**settings, "eos_token_id": eos}))
        with pytest.raises(UserError, match=re.escape(f"generation_config.json sets eos_token_id = {eos!r}; expected")):
            hf.import_run(folder, tmp_path / "run")
        assert not (tmp_path / "run").exists()
