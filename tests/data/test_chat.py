"""Chat templates against transformers' `apply_chat_template`: the same text and token ids for a ChatML (Qwen 2.5)
and a Llama 3 template over several conversations, the assistant mask, the tokenizer's companion files through
`convert from-hf` -> `convert to-hf` and a fine-tune, and `systolic generate --chat` against transformers' greedy
decoding. The tokenizers are trained here and saved by transformers itself: no download."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from tiny import call
from tiny_hf import VOCAB, finetune_overrides, make_hf_model

from systolic.data.bpe import BPETokenizer
from systolic.data.chat import ChatTemplate
from systolic.data.tokenizer import COMPANION_FILES, store_in_run
from systolic.errors import UserError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]

# Qwen 2.5's template without its tool-call branches: a default system message when the conversation has none.
CHATML = """{%- if tools %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '\\n\\n# Tools\\n' + (tools | tojson) + '<|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama 3.2's template without tools: bos_token from the special tokens, today's date through strftime_now, the
# system message moved into the first header, contents trimmed, raise_exception on other roles.
LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception("Only user and assistant roles are supported after the system message") }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# ChatML whose assistant text is wrapped in {% generation %}, as TRL's training templates do.
GENERATION = """{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' }}
    {%- if message.role == 'assistant' %}
        {%- generation %}{{- message.content + '<|im_end|>' }}{%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

SYSTEM = {"role": "system", "content": "You are brief."}
Q1 = {"role": "user", "content": "What is the capital of France?"}
A1 = {"role": "assistant", "content": "Paris."}
Q2 = {"role": "user", "content": "And of Germany? "}  # Llama 3 trims the trailing space
A2 = {"role": "assistant", "content": "Berlin, I think."}
CONVERSATIONS = [
    ([SYSTEM, Q1], True),  # a system message, then the header of the reply
    ([Q1], True),  # no system message: ChatML writes its default one, Llama 3 an empty one
    ([SYSTEM, Q1, A1, Q2, A2], False),  # several turns, ending with the assistant
    ([Q1, A1, Q2], True),
    # Special tokens spelt in a message are matched as in transformers; a None value is dropped, as there.
    ([{"role": "user", "content": "Say <|im_end|> or <|eot_id|>, ünïcode ✓", "name": None}], True),
]
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "llama3-legacy": "<|eot_id|>"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{name: a folder written by transformers' save_pretrained}: one byte-level BPE of <= VOCAB ids with every
    special token, saved with a ChatML and with a Llama 3 template (chat_template.jinja), and the Llama 3 one again
    in the older layout (the template inside tokenizer_config.json, special tokens in special_tokens_map.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [m["content"] for conversation, _ in CONVERSATIONS for m in conversation]
    bpe.train_from_iterator([*texts, "system user assistant You are a helpful assistant. Today Date"] * 20, trainer)
    root = tmp_path_factory.mktemp("tokenizers")
    for name, template, tokens in [("chatml", CHATML, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
                                   ("llama3", LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})]:
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, **tokens)
        fast.chat_template = template
        fast.save_pretrained(root / name)
    assert (root / "chatml" / "chat_template.jinja").is_file(), "transformers 5 writes the template to its own file"
    legacy = shutil.copytree(root / "llama3", root / "llama3-legacy")
    config = json.loads((legacy / "tokenizer_config.json").read_text())
    specials = {key: config.pop(key) for key in ("bos_token", "eos_token")}
    config["chat_template"] = (legacy / "chat_template.jinja").read_text()
    (legacy / "chat_template.jinja").unlink()
    (legacy / "tokenizer_config.json").write_text(json.dumps(config))
    (legacy / "special_tokens_map.json").write_text(json.dumps(specials))
    return {"chatml": root / "chatml", "llama3": root / "llama3", "llama3-legacy": legacy}


def ours(folder) -> ChatTemplate:
    return ChatTemplate.load(folder, BPETokenizer.load(folder / "tokenizer.json"))


@pytest.mark.parametrize("name", ["chatml", "llama3", "llama3-legacy"])
def test_text_and_ids_match_transformers(folders, name):
    theirs = transformers.AutoTokenizer.from_pretrained(folders[name])
    template = ours(folders[name])
    for messages, prompt in CONVERSATIONS:
        text = template.render(messages, add_generation_prompt=prompt)
        assert text == theirs.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
        want = theirs.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True, return_dict=False)
        assert template.encode(messages, add_generation_prompt=prompt).tolist() == want, text
    if name.startswith("llama3"):
        assert text.startswith("<|begin_of_text|><|start_header_id|>system") and "Today Date: " in text
    else:
        assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_assistant_mask_covers_the_assistant_turns(folders, name):
    template = ours(folders[name])
    theirs = transformers.AutoTokenizer.from_pretrained(folders[name])
    messages = [SYSTEM, Q1, A1, Q2, A2]
    ids, mask = template.encode_with_mask(messages)
    assert ids.tolist() == template.encode(messages).tolist() and mask.shape == ids.shape and mask.dtype == bool
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))  # starts and ends of masked runs
    runs = [theirs.decode(ids[start:end].tolist()) for start, end in zip(edges[::2], edges[1::2])]
    assert runs == [f"{A1['content']}{END_OF_TURN[name]}", f"{A2['content']}{END_OF_TURN[name]}"]
    # Everything else (headers, user and system text, the newline after ChatML's <|im_end|>) is unmasked.
    rest = theirs.decode(ids[~mask].tolist())
    assert "Paris" not in rest and Q2["content"].strip() in rest and rest.count(END_OF_TURN[name]) == 3


def test_generation_blocks_give_transformers_assistant_masks(folders):
    theirs = transformers.AutoTokenizer.from_pretrained(folders["chatml"])
    tokenizer = BPETokenizer.load(folders["chatml"] / "tokenizer.json")
    template = ChatTemplate(GENERATION, {"eos_token": "<|im_end|>"}, tokenizer)
    assert template.marks_generation
    for messages in ([SYSTEM, Q1, A1, Q2, A2], [Q1, A1]):
        want = theirs.apply_chat_template(messages, chat_template=GENERATION, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
        ids, mask = template.encode_with_mask(messages)
        assert ids.tolist() == want["input_ids"] and mask.astype(int).tolist() == want["assistant_masks"]
    assert template.render([Q1], add_generation_prompt=True).endswith("<|im_start|>assistant\n")


def test_stop_ids_are_the_end_of_turn_and_eos(folders):
    for name, end in [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>")]:
        template = ours(folders[name])
        want = {template.tokenizer.token_id(end), template.tokenizer.token_id("<|endoftext|>")}
        assert set(template.stop_ids) == want


def test_bad_templates_and_conversations_are_user_errors(folders):
    template = ours(folders["llama3"])
    with pytest.raises(UserError, match="Only user and assistant roles are supported"):  # raise_exception
        template.render([SYSTEM, {"role": "tool", "content": "42"}])
    with pytest.raises(UserError, match="list of messages"):
        template.render("Hi")
    with pytest.raises(UserError, match="failed on this conversation"):  # ChatML adds text to a list of parts
        ours(folders["chatml"]).render([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    tokenizer = template.tokenizer
    with pytest.raises(UserError, match="not a valid Jinja template"):
        ChatTemplate("{% for m in messages %}", {}, tokenizer)
    with pytest.raises(UserError, match="failed on this conversation"):  # the sandbox refuses Python internals
        ChatTemplate("{{ messages.__class__.__mro__ }}", {}, tokenizer).render([Q1])
    with pytest.raises(UserError, match="failed on this conversation"):
        ChatTemplate("{% set ns = namespace(_x=1) %}", {}, tokenizer).render([Q1])
    assert ChatTemplate("{{ messages | tojson }}", {}, tokenizer).render([Q1]) == json.dumps([Q1])  # no HTML escaping
    assert ours(folders["chatml"]).special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


# RUN DIRECTORIES ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_run(folders, tmp_path_factory):
    """(a tiny Llama saved with the ChatML tokenizer, its folder, the run `convert from-hf` made of it)."""
    root = tmp_path_factory.mktemp("chat-model")
    model = make_hf_model("llama")
    model.save_pretrained(root / "hf")
    for path in folders["chatml"].iterdir():
        shutil.copy(path, root / "hf" / path.name)
    assert call("convert", "from-hf", str(root / "hf"), str(root / "run"))[0] == 0
    return model, root / "hf", root / "run"


def test_template_travels_through_from_hf_and_to_hf(chat_run, tmp_path):
    _, folder, run = chat_run
    kept = sorted(name for name in COMPANION_FILES if (folder / name).is_file())
    assert kept == ["chat_template.jinja", "generation_config.json", "tokenizer_config.json"]
    for name in kept:
        assert (run / name).read_bytes() == (folder / name).read_bytes()
    code, out, err = call("convert", "to-hf", str(run), str(tmp_path / "out"))
    assert code == 0 and "chat_template.jinja" in out, err
    original = transformers.AutoTokenizer.from_pretrained(folder)
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert exported.special_tokens_map == original.special_tokens_map and exported.chat_template == CHATML
    for messages, prompt in CONVERSATIONS:
        assert (exported.apply_chat_template(messages, add_generation_prompt=prompt, return_dict=False)
                == original.apply_chat_template(messages, add_generation_prompt=prompt, return_dict=False))


def test_store_in_run_takes_a_tokenizer_json_s_companions_only(chat_run, tmp_path):
    _, folder, _ = chat_run
    run = tmp_path / "run"
    run.mkdir()
    store_in_run(run, str(folder))  # a model folder: tokenizer.json and its companions
    assert sorted(p.name for p in run.iterdir()) == ["chat_template.jinja", "generation_config.json", "tokenizer.json",
                                                     "tokenizer_config.json"]
    other = tmp_path / "made"
    other.mkdir()
    shutil.copy(folder / "tokenizer.json", other / "tok.json")
    shutil.copy(folder / "tokenizer_config.json", other / "tokenizer_config.json")
    store_in_run(run, str(other / "tok.json"))  # not named tokenizer.json: no Hugging Face folder's, no companions
    assert sorted(p.name for p in run.iterdir()) == ["tokenizer.json"], "an earlier run's template is not kept"
    store_in_run(run, "byte")
    assert not list(run.iterdir())


def test_finetune_keeps_the_template(chat_run, corpus_dir, tmp_path):
    _, folder, source = chat_run
    run = tmp_path / "finetune"
    assert call("train", "lm", *finetune_overrides(source, corpus_dir), "--run-dir", str(run))[0] == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (run / name).read_bytes() == (folder / name).read_bytes()


def test_generate_chat_matches_transformers_greedy(chat_run):
    model, folder, run = chat_run
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital?"}]
    ids = theirs.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    n = 8
    assert len(ids) + n <= model.config.max_position_embeddings
    limit = len(theirs)  # generate never picks the embedding rows past the tokenizer's ids (vocab_limit)
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1, :limit].argmax()))
    new = seq[len(ids):]
    stops = {theirs.convert_tokens_to_ids("<|im_end|>"), theirs.convert_tokens_to_ids("<|endoftext|>")}
    new = new[: next((i for i, t in enumerate(new) if t in stops), n)]
    head = theirs.decode(ids, skip_special_tokens=True)
    want = theirs.decode(ids + new, skip_special_tokens=True)[len(head):]
    print(f"reply: {want!r} ({len(new)} tokens before the stop)")
    assert want

    code, out, err = call("generate", str(run), "--chat", "--system", "Be brief.", "--prompt", "What is the capital?",
                          "--max-new-tokens", str(n), "--temperature", "0")
    assert code == 0, err
    assert out == want + "\n"  # the assistant's reply alone: no prompt, no template


def test_generate_chat_without_a_template_or_with_wrong_flags(chat_run, tmp_path):
    _, _, run = chat_run
    plain = shutil.copytree(run, tmp_path / "plain")
    (plain / "chat_template.jinja").unlink()
    for argv, message in [
        ([str(plain), "--chat", "--prompt", "Hi"], "has no chat template"),
        ([str(run), "--system", "Be brief.", "--prompt", "Hi"], "--chat is not set"),
        ([str(run), "--chat"], "--chat needs --prompt"),
    ]:
        code, _, err = call("generate", *argv)
        assert code == 2 and message in err and "Fix:" in err, err


def test_generate_chat_stops_at_the_end_of_turn(chat_run, monkeypatch):
    """The reply ends before the template's end-of-turn token, whatever the model writes after it (a random model
    never gets there by itself, so the sampler is replaced by one that writes a known reply)."""
    from systolic.workloads.lm.serve.engine import InferenceEngine

    _, folder, run = chat_run
    tokenizer = ours(folder).tokenizer
    end = tokenizer.token_id("<|im_end|>")
    written = np.concatenate([tokenizer.encode("Paris."), [end], tokenizer.encode(" Junk")])
    steps = iter(written.tolist())  # the engine's step samples one token of the request: these, one a step
    launch = InferenceEngine._launch

    def scripted(self, chunks, *args, **kwargs):
        """The launched step, its sampled row (2, max_seqs) replaced by the next scripted token (logprob bits 0)."""
        launched = launch(self, chunks, *args, **kwargs)
        if any(at is not None for at in launched.pending):
            sampled = np.zeros((2, self.max_seqs), np.int32)
            sampled[0, 0] = next(steps)
            launched.out = launched.out._replace(sampled=sampled)
            self._previous = jnp.asarray(sampled)  # what the next step reads on the device
        return launched

    monkeypatch.setattr(InferenceEngine, "_launch", scripted)
    code, out, err = call("generate", str(run), "--chat", "--prompt", "Capital?", "--max-new-tokens", str(len(written)))
    assert code == 0 and out == "Paris.\n", err
