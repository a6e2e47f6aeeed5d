"""Tiny random transformers models for the Hugging Face tests (tests/workloads/lm/test_hf*.py, tests/data/test_chat.py),
built from a config with no download; what the import tests share (transformers' logits and greedy tokens against
ours, an import made once per case, an export loaded back by `from_pretrained`, the inference engine's greedy
tokens); the overrides of a short fine-tune from an imported run; tokenizer folders and chats. torch and transformers
are imported when used: the test modules skip themselves when they are missing."""

import dataclasses
import json
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from systolic.config import MeshConfig
from systolic.data.tokenizer import ByteTokenizer
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import rules_for
from systolic.workloads.lm.model import decode as gen
from systolic.workloads.lm.hf import config as hf_config
from systolic.workloads.lm.hf import convert as hf
from systolic.workloads.lm.serve.engine import InferenceEngine, SamplingParams
from systolic.workloads.lm.model.build import model_graphdef, param_shardings

VOCAB = 320  # >= the byte tokenizer's 258 ids, so a fine-tune on bytes fits
TOKENS = np.random.default_rng(1).integers(0, VOCAB, (8, 12))  # 8 rows: the batch splits over a mesh's 8 devices
NEW = 16  # greedy tokens per row


def make_hf_model(family: str, positions: int = 64):
    """A tiny transformers model with random weights: matrices with std 0.2 (logits far from uniform, so argmax has
    no near-ties), norm scales near 1 and biases near 0 (a large random final-norm bias would fix the argmax);
    `positions` the Llama's context (its RoPE has no table: more costs nothing)."""
    import torch
    import transformers

    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=positions, rope_theta=50000.0, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, attn_implementation="eager")
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                         bos_token_id=0, eos_token_id=0, attn_implementation="eager")
        model = transformers.GPT2LMHeadModel(config)
    return randomize(model)


def randomize(model, ones: tuple[str, ...] = ("weight",)):
    """`model` in eval mode with random weights: matrices with std 0.2 (logits far from uniform, so argmax has no
    near-ties), vectors named with a suffix in `ones` (norm scales) near 1, the other vectors (biases) near 0."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.normal_(1.0 if name.endswith(ones) else 0.0, 0.1)
    return model.eval()


def hf_logits(model, tokens) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def hf_greedy(model, tokens, vocab_limit: int = VOCAB, new: int = NEW) -> np.ndarray:
    """`new` greedy tokens per row, of ids below vocab_limit; the end-of-text id is an ordinary token here (ours does
    not stop at it either), where min_new_tokens would forbid it."""
    import torch

    suppress = list(range(vocab_limit, VOCAB)) or None
    with torch.no_grad():
        out = model.generate(torch.tensor(tokens), attention_mask=torch.ones(tokens.shape, dtype=torch.long),
                             max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None,
                             suppress_tokens=suppress)
    return out[:, tokens.shape[1]:].numpy()


def our_logits(cfg, params, tokens) -> np.ndarray:
    """Our model's logits in float32, under whatever mesh is active."""
    graphdef = model_graphdef(dataclasses.replace(cfg, dtype="float32"), VOCAB)
    return np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, jnp.asarray(tokens, jnp.int32)))


def ours(cfg, params, tokens, new: int = NEW) -> tuple[np.ndarray, np.ndarray]:
    """(logits, greedy continuation through the KV cache) of our model in float32, under whatever mesh is active."""
    graphdef = model_graphdef(dataclasses.replace(cfg, dtype="float32"), VOCAB)
    greedy = gen.generate(graphdef, params, jnp.asarray(tokens, jnp.int32), max_new_tokens=new)
    return our_logits(cfg, params, tokens), np.asarray(greedy)


def assert_matches_transformers(model, cfg, params, label: str, tokens=TOKENS) -> tuple[np.ndarray, np.ndarray]:
    """Our float32 logits within 1e-4 of transformers' and the same greedy tokens, not a constant continuation;
    returns (transformers' logits, the greedy tokens)."""
    logits, greedy = ours(cfg, params, tokens)
    ref = hf_logits(model, tokens)
    print(f"{label}: logits max-abs-diff {np.abs(logits - ref).max():.2e} (max |logit| {np.abs(ref).max():.2f})")
    np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=0)
    np.testing.assert_array_equal(greedy, hf_greedy(model, tokens))
    assert len(np.unique(greedy)) > 3  # not a degenerate constant continuation
    return ref, greedy


def save_and_import(model, folder: Path, run_dir: Path) -> tuple:
    """(model, its save_pretrained folder, the run `systolic convert from-hf` imported from it)."""
    model.save_pretrained(folder)
    hf.import_run(folder, run_dir)
    return model, folder, run_dir


def imported_on_first_use(root: Path, make_model: Callable) -> Callable[[str], tuple]:
    """case -> (transformers model `make_model(case)`, its saved folder, the imported run), made on first use under
    `root` (a module-scoped fixture returns this, so each case is converted once)."""
    made = {}

    def get(case: str) -> tuple:
        if case not in made:
            made[case] = save_and_import(make_model(case), root / case, root / f"{case}-run")
        return made[case]

    return get


def load_sharded(folder: Path, mesh, rules, *, scan_layers: bool, **changes) -> tuple:
    """(the model config of a Hugging Face folder with `changes`, its parameters placed straight onto `mesh`)."""
    cfg = dataclasses.replace(hf_config.model_config(hf_config.read_config(folder), folder, scan_layers=scan_layers),
                              **changes)
    return cfg, hf.load_params(folder, cfg, param_shardings(cfg, VOCAB, mesh, rules))


def export_and_reload(model, run_dir: Path, out: Path, architecture: str) -> tuple[dict, object]:
    """(config.json, the transformers model) of the run exported to `out` and loaded by `from_pretrained`: it names
    `architecture`, loads as `model`'s class with no missing, unexpected or mismatched tensors."""
    import transformers

    hf.export_run(run_dir, out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [architecture]
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", output_loading_info=True)
    assert type(reloaded) is type(model)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    return config, reloaded.eval()


def assert_engine_matches_transformers(model, folder: Path, *, scan_layers: bool, agree: int = NEW,
                                      **engine_options) -> InferenceEngine:
    """A Hugging Face folder's model on one device through the inference engine's paged cache, one request of TOKENS'
    first 4 rows added a step (they arrive at different steps, prompts chunked over steps): the first `agree` of
    each row's greedy tokens are transformers' among the byte tokenizer's ids (a run without tokenizer.json samples
    from those). Returns the engine."""
    mesh = mesh_lib.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    cfg, params = load_sharded(folder, mesh, rules_for("fsdp", mesh), scan_layers=scan_layers, dtype="float32")
    engine = InferenceEngine(cfg, params, ByteTokenizer(), kv_pages=64, page_size=4, max_seqs=4,
                             max_tokens_per_step=8, **engine_options)
    prompts = TOKENS[:4] % 256
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, stop_token_ids=())
    events = {}
    for step in range(200):
        if step < len(prompts):
            engine.add_request(f"r{step}", prompts[step].tolist(), greedy)
        for event in engine.step():
            events.setdefault(event.request_id, []).append(event.token_id)
        if step >= len(prompts) and not engine.has_work():
            break
    want = hf_greedy(model, prompts, vocab_limit=ByteTokenizer().vocab_size)
    for i in range(len(prompts)):
        assert [t for t in events[f"r{i}"] if t is not None][:agree] == want[i].tolist()[:agree], f"r{i}"
    return engine


def finetune_overrides(source: Path, corpus: Path) -> list[str]:
    """`systolic train lm` overrides of a 4-step fine-tune from the imported run `source` (the same program in every
    test, so a session compiles it once)."""
    return [f"init.from={source}", f"data.path={corpus}", "data.seq_len=16", "train.batch_size=8", "train.steps=4",
            "train.eval_batches=1", "checkpoint.every_steps=2", "optim.warmup_steps=1", "sample.max_new_tokens=0",
            "observe.plot=false", "observe.tensorboard=false", "observe.progress=off"]


def write_hf_tokenizer(folder: Path, texts: list[str], specials: list[str], tokens: dict, template: str,
                       vocab_size: int = VOCAB) -> Path:
    """A Hugging Face tokenizer folder as the chat tests use it: a byte-level BPE of at most `vocab_size` ids trained
    on `texts`, with the `specials` first (ids 0, 1, ...), tokenizer_config.json holding `tokens` (eos_token,
    pad_token, ...) and chat_template.jinja."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    bpe.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokens))
    (folder / "chat_template.jinja").write_text(template)
    return folder


# A chat model's tokenizer folder (tests/workloads/lm/test_sft.py, tests/test_readme.py): a byte-level BPE trained
# here on capital-city conversations, saved with a ChatML template as a Hugging Face folder has them.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML without a default system message, so the rows of the tiny model (64 positions) hold whole conversations.
CHATML = """{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
CAPITALS = {"France": "Paris", "Germany": "Berlin", "Spain": "Madrid", "Italy": "Rome", "Japan": "Tokyo",
            "Egypt": "Cairo", "Peru": "Lima", "Kenya": "Nairobi"}
SYSTEM = {"role": "system", "content": "Be brief."}
CONVERSATION = [SYSTEM, {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Germany?"},
                {"role": "assistant", "content": "Berlin, I think."}]


def chats(n: int) -> list[dict]:
    """`n` records with a pattern to learn, short enough for the tiny model's 64 positions: the assistant names the
    capital of the country the user names. Conversations, some with a system message, some of two turns; every
    fifth record is prompt/completion text."""
    rng = np.random.default_rng(0)
    countries = list(CAPITALS)
    records = []
    for i in range(n):
        a, b = (countries[j] for j in rng.choice(len(countries), 2, replace=False))
        if i % 5 == 4:
            records.append({"prompt": f"{a}:", "completion": f" {CAPITALS[a]}."})
            continue
        messages = [SYSTEM] if i % 3 == 0 else []
        messages += [{"role": "user", "content": a}, {"role": "assistant", "content": f"{CAPITALS[a]}."}]
        if i % 4 == 0:
            messages += [{"role": "user", "content": b}, {"role": "assistant", "content": f"{CAPITALS[b]}."}]
        records.append({"messages": messages})
    return records


def render(messages: list[dict]) -> str:
    """CHATML's text, for training the tokenizer."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def save_chat_tokenizer(folder: Path) -> Path:
    """A Hugging Face tokenizer folder in `folder`: a byte-level BPE of at most VOCAB ids trained on `chats`,
    tokenizer_config.json naming its special tokens and chat_template.jinja (CHATML)."""
    texts = [render(r["messages"]) if "messages" in r else r["prompt"] + r["completion"] for r in chats(200)]
    return write_hf_tokenizer(folder, [*texts, render(CONVERSATION)], SPECIALS,
                              {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, CHATML)
