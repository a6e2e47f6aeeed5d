"""Tiny random transformers models for the Hugging Face tests (tests/workloads/lm/test_hf.py, tests/data/test_chat.py),
built from a config with no download, and the overrides of a short fine-tune from an imported run. torch and
transformers are imported when a model is made: the test modules skip themselves when they are missing."""

import json
from pathlib import Path

import numpy as np

VOCAB = 320  # >= the byte tokenizer's 258 ids, so a fine-tune on bytes fits


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
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
    return model.eval()


def finetune_overrides(source: Path, corpus: Path) -> list[str]:
    """`systolic train lm` overrides of a 4-step fine-tune from the imported run `source` (the same program in every
    test, so a session compiles it once)."""
    return [f"init.from={source}", f"data.path={corpus}", "data.seq_len=16", "train.batch_size=8", "train.steps=4",
            "train.eval_batches=1", "checkpoint.every_steps=2", "optim.warmup_steps=1", "sample.max_new_tokens=0",
            "observe.plot=false", "observe.tensorboard=false", "observe.progress=off"]


def write_hf_tokenizer(folder: Path, texts: list[str], specials: list[str], tokens: dict, template: str) -> Path:
    """A Hugging Face tokenizer folder as the chat tests use it: a byte-level BPE of at most VOCAB ids trained on
    `texts`, with the `specials`, tokenizer_config.json holding `tokens` (eos_token, pad_token, ...) and
    chat_template.jinja."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(specials), show_progress=False,
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
