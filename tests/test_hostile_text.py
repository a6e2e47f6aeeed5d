"""Hostile text (issue 34): chat templates under their budget (time, memory, output, recursion), text that is not
Unicode at every text input (--prompt, --system, a chat, --choices, a template file, the server's requests),
data.mixture weights, XLA_FLAGS and JAX_PLATFORMS at start-up, and what a full disk prints. Each refusal is one
paragraph (exit 2 through the CLI), without a traceback, and leaves the run directory and the input files as they
were. The model: a tiny random Llama with a byte-level BPE and a ChatML template, written as a Hugging Face folder
without torch and imported with `systolic convert from-hf` (as tests/workloads/lm/serve/test_server.py does)."""

import asyncio
import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tiny import TINY_LM
from tiny_hf import write_hf_tokenizer

from systolic.cli import main
from systolic.data import template_sandbox
from systolic.data.bpe import BPETokenizer
from systolic.data.chat import ChatTemplate, find_chat_template
from systolic.data.tokenizer import ByteTokenizer
from systolic.data.unicode_text import check_unicode
from systolic.engine import checkpoint
from systolic.observe import metrics
from systolic.errors import ConfigError, UserError
from systolic.runtime import xla_env
from systolic.workloads.lm.config import DataConfig
from systolic.workloads.lm.evaluate import read_choices
from systolic.workloads.lm.hf import config as hf_config
from systolic.workloads.lm.hf import convert as hf
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.serve import openai_api as api

VOCAB = 320
MODEL = ModelConfig(d_model=32, layers=2, heads=4, kv_heads=2, max_seq_len=64, vocab_size=VOCAB)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
HI = [{"role": "user", "content": "Hi"}]

# Templates that break the sandbox's budget, each reproduced against the code before the budget: a raw OverflowError,
# a RecursionError, a render that never ends, a process killed natively (exit 134) or by the kernel.
OVER_BUDGET = {
    "range too big": ("{{ range(200000) | list | length }}", "range or number too large"),
    "recursive macro": ("{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}", "recursed deeper"),
    "nested loops": ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", "ran for more"),
    "huge string": ("{{ 'x' * 10**10 }}", "memory"),
    "huge output": ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "characters, more than"),
    "cycler loop": ("{% set c = cycler(1, 2) %}{% for a in range(100000) %}{% for b in range(100000) %}"
                    "{% if c.next() > 5 %}x{% endif %}{% endfor %}{% endfor %}", "ran for more"),
    "joiner loop": ("{% set j = joiner('x' * 100000) %}{% for a in range(100000) %}{{ j() }}{% endfor %}", "was stopped"),
    "range arithmetic": ("{{ range(10) | list * 10**10 }}", "memory"),
}


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def call(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


def one_paragraph(err: str) -> str:
    assert "Traceback" not in err and err.startswith("error: ") and "\n\n" not in err.strip(), err
    return " ".join(err.split())


@pytest.fixture
def quick_budget(monkeypatch):
    """A 1 s time budget, so the loop cases end sooner (the default is TIME_BUDGET_S, 5 s)."""
    monkeypatch.setattr(template_sandbox, "TIME_BUDGET_S", 1.0)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A Hugging Face folder: config.json, random safetensors, a byte-level BPE with ChatML's special tokens, its
    tokenizer_config.json and chat_template.jinja."""
    folder = write_hf_tokenizer(tmp_path_factory.mktemp("hostile") / "hf",
                                ["system user assistant Hi there. What is the capital?"] * 20, SPECIALS,
                                {"eos_token": "<|im_end|>"}, CHATML, vocab_size=300)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: rng.normal(0, 0.2, x.shape).astype(np.float32), hf.abstract_params(MODEL, VOCAB))
    hf.write_safetensors(folder, hf.export_tensors(MODEL, params), 1 << 30)
    (folder / "config.json").write_text(json.dumps(hf_config.hf_config(MODEL, VOCAB, {})))
    return folder


@pytest.fixture(scope="module")
def chat_run(hf_folder) -> Path:
    run = hf_folder.parent / "run"
    code, err = call(["convert", "from-hf", str(hf_folder), str(run)])
    assert code == 0, err
    return run


@pytest.fixture(scope="module")
def tokenizer(hf_folder) -> BPETokenizer:
    return BPETokenizer.load(hf_folder / "tokenizer.json")


# CHAT TEMPLATES -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", OVER_BUDGET)
def test_a_template_over_its_budget_is_one_error_naming_its_file(tokenizer, quick_budget, case):
    source, said = OVER_BUDGET[case]
    template = ChatTemplate(source, {}, tokenizer, "hostile/chat_template.jinja")
    with pytest.raises(UserError, match="chat template hostile/chat_template.jinja was stopped") as caught:
        template.encode(HI)
    assert said in str(caught.value) and "Fix: restore the model's own template" in str(caught.value)
    # The worker that was killed or that refused is replaced: the next render works.
    assert ChatTemplate(CHATML, {}, tokenizer).render(HI) == "<|im_start|>user\nHi<|im_end|>\n"


def test_a_sandbox_violation_or_a_template_rule_is_a_conversation_error(tokenizer):
    for source in ("{{ messages.__class__.__mro__[1].__subclasses__() }}", "{{ ''.__class__.__base__ }}",
                   "{{ raise_exception('roles must alternate') }}", "{{ 1 / 0 }}", "{{ messages[5].content }}"):
        with pytest.raises(UserError, match="failed on this conversation"):
            ChatTemplate(source, {}, tokenizer, "t.jinja").render(HI)
    # Dunder attributes read as undefined (Jinja's sandbox), never Python's internals.
    assert ChatTemplate("{{ messages.__class__ }}|{{ cycler.__init__ }}", {}, tokenizer).render(HI) == "|"


def test_a_template_is_checked_when_a_run_takes_it(tmp_path, hf_folder, quick_budget):
    folder = Path(shutil.copytree(hf_folder, tmp_path / "hf"))
    (folder / "chat_template.jinja").write_text(OVER_BUDGET["nested loops"][0])
    with pytest.raises(UserError, match=f"{folder / 'chat_template.jinja'} was stopped"):
        find_chat_template(BPETokenizer.load(folder / "tokenizer.json"))
    # A template whose rules refuse the probe conversation is not refused: the conversations it is given decide.
    (folder / "chat_template.jinja").write_text("{% if messages[0].role != 'system' %}{{ raise_exception('x') }}"
                                                "{% endif %}{{ messages[0].content }}")
    assert find_chat_template(BPETokenizer.load(folder / "tokenizer.json")) is not None


def test_an_import_with_a_hostile_template_writes_nothing(tmp_path, hf_folder, quick_budget):
    folder = Path(shutil.copytree(hf_folder, tmp_path / "hf"))
    (folder / "chat_template.jinja").write_text(OVER_BUDGET["huge string"][0])
    before = snapshot(folder)
    code, err = call(["convert", "from-hf", str(folder), str(tmp_path / "run")])
    assert code == 2 and "chat_template.jinja was stopped" in one_paragraph(err)
    assert snapshot(folder) == before and not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", ["recursive macro", "nested loops", "huge string", "range too big"])
def test_generate_chat_with_a_hostile_template_exits_2(tmp_path, chat_run, quick_budget, case):
    run = Path(shutil.copytree(chat_run, tmp_path / "run"))
    (run / "chat_template.jinja").write_text(OVER_BUDGET[case][0])
    before = snapshot(run)
    code, err = call(["generate", str(run), "--chat", "--prompt", "Hi", "--max-new-tokens", "1"])
    assert code == 2 and f"{run / 'chat_template.jinja'} was stopped" in one_paragraph(err)
    assert snapshot(run) == before


def test_a_template_file_that_is_not_utf8_is_named(tmp_path, hf_folder):
    folder = Path(shutil.copytree(hf_folder, tmp_path / "hf"))
    (folder / "chat_template.jinja").write_bytes(b"{{ messages }}\xff\xfe")
    with pytest.raises(UserError, match="chat_template.jinja is not UTF-8 text"):
        find_chat_template(BPETokenizer.load(folder / "tokenizer.json"))


def test_the_server_answers_a_hostile_template_with_400_and_renders_the_next_request(tokenizer, quick_budget):
    hostile = ChatTemplate("{% if messages[-1].content == 'spin' %}" + OVER_BUDGET["nested loops"][0] + "{% endif %}"
                           + CHATML, {}, tokenizer, "served/chat_template.jinja")
    with pytest.raises(api.APIError) as caught:
        api.chat_prompt_ids([{"role": "user", "content": "spin"}], hostile, "m")
    assert caught.value.status == 400 and "served/chat_template.jinja was stopped" in caught.value.message
    assert len(api.chat_prompt_ids(HI, hostile, "m")) > 0


# TEXT THAT IS NOT UNICODE -------------------------------------------------------------------------------------


def test_lone_surrogates_are_named_by_every_tokenizer(tokenizer):
    for encode in (tokenizer.encode, lambda t: tokenizer.encode_with_specials(t), lambda t: tokenizer.encode_batch([t]),
                   ByteTokenizer().encode):
        with pytest.raises(UserError, match="character 1 is the byte 0xFF"):
            encode("a\udcffb")
        with pytest.raises(UserError, match="lone surrogate U\\+D800"):
            encode("a\ud800")
    assert check_unicode("é ✓ \U0001f600") == "é ✓ \U0001f600"


def _from_bytes(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")  # what Python makes of a command line's bytes


def _to_bytes(text: str) -> bytes:
    """The bytes a file or a request body holds for `text`: U+DC80-U+DCFF as the raw bytes they stand for, other
    lone surrogates as their (invalid) UTF-8 encoding."""
    return b"".join(c.encode("utf-8", "surrogateescape" if 0xDC80 <= ord(c) <= 0xDCFF else "surrogatepass") for c in text)


# Random bytes as a command line carries them, random text, and the pieces that break text and templates.
HOSTILE_TEXT = st.lists(st.one_of(
    st.binary(max_size=6).map(_from_bytes), st.text(max_size=6),
    st.sampled_from(["\ud800", "\udfff", "\udc80", "\udbff\udbff", "<|im_end|>", "{{", "{%", "}}", "\x00", "é"]),
), min_size=1, max_size=5).map("".join)


class _Body:
    """A request whose body is `data`, as `server._json_body` reads one."""

    def __init__(self, data: bytes):
        self.data = data

    async def stream(self):
        yield self.data


def _refused(read) -> bool:
    """Whether `read()` refused its input with one clean error (False: it read it)."""
    try:
        read()
    except api.APIError as e:
        assert e.status == 400 and e.message, e
        return True
    except UserError as e:
        assert str(e) and "\n\n" not in str(e)
        return True
    return False


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=HOSTILE_TEXT, where=st.sampled_from(["tokenizer", "chat", "choices", "choices-bytes", "template",
                                                 "completion-request", "chat-request", "chat-request-bytes"]))
def test_random_text_at_every_reader_is_read_or_refused(tokenizer, hf_folder, tmp_path_factory, text, where):
    """The readers behind every text input, fed random bytes and lone surrogates: each reads its input or refuses
    it with one error (an APIError of status 400 from the server's), and changes no file."""
    from systolic.workloads.lm.serve import server

    work = tmp_path_factory.mktemp("text")
    template = ChatTemplate(CHATML, {}, tokenizer)
    if where == "tokenizer":
        read = lambda: (tokenizer.encode(text), ByteTokenizer().encode(text))  # noqa: E731
    elif where == "chat":
        read = lambda: template.encode_with_mask([*HI, {"role": "assistant", "content": text}])  # noqa: E731
    elif where.startswith("choices"):
        line = json.dumps({"context": text, "choices": ["a", "b"], "label": 0}).encode()
        (work / "choices.jsonl").write_bytes((line if where == "choices" else _to_bytes(text)) + b"\n")
        read = lambda: read_choices(work / "choices.jsonl")  # noqa: E731
    elif where == "template":
        folder = Path(shutil.copytree(hf_folder, work / "hf"))
        (folder / "chat_template.jinja").write_bytes(_to_bytes(text))
        read = lambda: find_chat_template(BPETokenizer.load(folder / "tokenizer.json"))  # noqa: E731
    else:
        if where == "completion-request":
            body = json.dumps({"model": "m", "prompt": text}).encode()
        else:
            message = json.dumps(text).encode() if where == "chat-request" else b'"' + _to_bytes(text) + b'"'
            body = b'{"model": "m", "messages": [{"role": "user", "content": ' + message + b"}]}"

        def read():
            request = asyncio.run(server._json_body(_Body(body)))
            if where == "completion-request":
                return api.completion_prompt_ids(api.parse_completion(request).prompts[0], tokenizer)
            return api.chat_prompt_ids(api.parse_chat(request).messages, template, "m")
    before = snapshot(work)
    event(f"{where}: {'refused' if _refused(read) else 'read'}")
    assert snapshot(work) == before


@pytest.mark.slow  # each example is a CLI command on a model (a few seconds, more when eval compiles)
@settings(max_examples=16, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=HOSTILE_TEXT, where=st.sampled_from(["prompt", "system", "chat", "choices", "template"]))
def test_random_text_at_every_cli_input_exits_0_or_2_with_one_paragraph(chat_run, tmp_path_factory, text, where):
    work = tmp_path_factory.mktemp("text")
    run = chat_run
    argv = ["generate", str(run), "--max-new-tokens", "0"]
    if where == "prompt":
        argv.append(f"--prompt={text}")
    elif where == "system":
        argv += ["--chat", f"--system={text}", "--prompt=Hi"]
    elif where == "chat":
        argv += ["--chat", f"--prompt={text}"]
    elif where == "choices":
        (work / "choices.jsonl").write_bytes(_to_bytes(text) + b"\n")
        argv = ["eval", "lm", str(run), "--choices", str(work / "choices.jsonl")]
    else:  # a template file of random bytes beside the run's tokenizer
        run = Path(shutil.copytree(chat_run, work / "run"))
        (run / "chat_template.jinja").write_bytes(_to_bytes(text))
        argv = ["generate", str(run), "--chat", "--prompt=Hi", "--max-new-tokens", "0"]
    before = snapshot(run), snapshot(work)
    code, err = call(argv)
    event(f"{where}: exit {code}")
    assert code in (0, 2), err
    if code == 2:
        one_paragraph(err)
    assert (snapshot(run), snapshot(work)) == before


def test_cli_text_that_is_not_unicode_names_its_flag(chat_run, tmp_path):
    before = snapshot(chat_run)
    code, err = call(["generate", str(chat_run), "--prompt", "a\udcffb"])
    assert code == 2 and "sample.prompt (--prompt) is not Unicode text: character 1 is the byte 0xFF" in one_paragraph(err)
    code, err = call(["generate", str(chat_run), "--chat", "--system", "\ud800", "--prompt", "Hi"])
    assert code == 2 and "--system is not Unicode text" in one_paragraph(err)
    choices = tmp_path / "choices.jsonl"
    choices.write_text('{"context": "x", "choices": ["a\\ud800", "b"], "label": 0}\n')
    code, err = call(["eval", "lm", str(chat_run), "--choices", str(choices)])
    assert code == 2 and "line 1: a string is not Unicode text" in one_paragraph(err)
    assert snapshot(chat_run) == before
    with pytest.raises(UserError, match="lone surrogate U\\+D800"):
        read_choices(choices)


# MIXTURE WEIGHTS, START-UP SETTINGS, A FULL DISK --------------------------------------------------------------


@pytest.mark.parametrize("mixture", ["a:1e308,b:1e-308", "a:1e308,b:1e308", "a:1,b:1e-7", "a:5e-324,b:5e-324"])
def test_mixture_weights_that_grain_cannot_take_are_refused(mixture):
    with pytest.raises(ConfigError, match="the weights range from"):
        DataConfig(mixture=mixture).mixture_sources  # noqa: B018
    assert DataConfig(mixture="a:1e300,b:3e300").mixture_sources == [("a", 1e300), ("b", 3e300)]


def test_xla_flags_are_checked_before_xla_can_abort(monkeypatch):
    monkeypatch.setattr(xla_env, "_backend_started", lambda: False)
    with pytest.raises(UserError, match="Unknown flag in XLA_FLAGS: --no_such_xla_flag"):
        xla_env.check_xla_flags("--xla_force_host_platform_device_count=2 --no_such_xla_flag")
    with pytest.raises(UserError, match="not of the form --name"):
        xla_env.check_xla_flags("xla_dump_to")
    monkeypatch.setattr(xla_env, "_probe", lambda value: pytest.fail("known flags need no probe"))
    xla_env.check_xla_flags("--xla_force_host_platform_device_count=8 --xla_cpu_experimental_xnn_fusion_type=dot")


def test_xla_flags_probe_finds_a_jaxlib_that_only_pythonpath_names():
    # The lent TPU machine's jax lives in a folder PYTHONPATH names; the probe once ran `python -I`, which ignores
    # PYTHONPATH, so every flag there was "refused" (2026-12-07). The base interpreter of this venv, finding jaxlib
    # only through PYTHONPATH, must accept a flag this XLA knows and still refuse one it does not.
    import jaxlib

    base = Path(sys.base_prefix) / "bin" / "python3"
    probe = subprocess.run([str(base), "-I", "-c", "import jaxlib"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip(f"{base} has jaxlib of its own: no interpreter here lacks it")
    site = str(Path(jaxlib.__file__).parents[1])
    src = str(Path(xla_env.__file__).parents[2])
    code = ("from systolic.runtime import xla_env\n"
            "xla_env.check_xla_flags('--xla_cpu_enable_concurrency_optimized_scheduler=false')\n"
            "try:\n    xla_env.check_xla_flags('--no_such_xla_flag')\n"
            "except Exception as e:\n    print('refused:', e)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, site])}
    env.pop("XLA_FLAGS", None)
    result = subprocess.run([str(base), "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "refused: XLA_FLAGS='--no_such_xla_flag' would stop XLA" in result.stdout


def test_jax_platforms_failures_are_explained():
    error = RuntimeError("Unable to initialize backend 'tpu': NOT_FOUND: TPU initialization failed: No jellyfish "
                         "device found. (set JAX_PLATFORMS='' to automatically choose an available backend)")
    said = xla_env.backend_failure(error)
    assert "No jellyfish device found" in said and "Fix: unset JAX_PLATFORMS" in said and "set JAX_PLATFORMS=''" not in said
    assert xla_env.backend_failure(RuntimeError("something else")) is None
    assert xla_env.backend_failure(ValueError("Unable to initialize backend")) is None
    if not any("cuda" in name for name in xla_env._jax_plugins()):
        with pytest.raises(UserError, match="jax's CUDA plugin is not installed"):
            xla_env.check_platforms("cuda")
    if not xla_env.tpu_device_files():  # refused before libtpu prints its pages of warnings
        with pytest.raises(UserError, match="asks for tpu, but"):
            xla_env.check_platforms("cpu,tpu")
    xla_env.check_platforms("cpu")


@pytest.mark.slow  # two fresh CLI processes, each starting jax
def test_start_up_settings_through_the_cli(chat_run):
    before = snapshot(chat_run)
    for name, value, said in [("JAX_PLATFORMS", "tpu", "JAX_PLATFORMS"),
                              ("XLA_FLAGS", "--no_such_xla_flag", "Unknown flag in XLA_FLAGS")]:
        env = {**os.environ, name: value, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
        done = subprocess.run([sys.executable, "-m", "systolic", "generate", str(chat_run), "--prompt", "x",
                               "--max-new-tokens", "1"], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and said in one_paragraph(done.stderr), done.stderr
    assert snapshot(chat_run) == before


def test_a_full_disk_prints_no_traceback_of_the_writes_orbax_abandoned(capsys):
    """On a full disk (checked by hand on a 3 MB tmpfs: six tracebacks before, none after), tensorstore reports each
    abandoned write as an unraisable "Event loop is closed" and asyncio logs its futures when collected; a
    Checkpointer drops both, and passes anything else on."""
    hook = checkpoint._ClosedLoopCallbacks(lambda unraisable: print(f"passed on: {unraisable.exc_value}"))

    class Unraisable:
        def __init__(self, error):
            self.exc_value = error

    hook(Unraisable(RuntimeError("Event loop is closed")))
    hook(Unraisable(RuntimeError("another")))
    assert capsys.readouterr().out == "passed on: another\n"
    abandoned = logging.LogRecord("asyncio", logging.ERROR, "base_events.py", 1, "Task exception was never retrieved\n"
                                  "future: <Task ... orbax/checkpoint/_src/serialization.py ...>", None, None)
    assert not checkpoint._ORBAX_FILTER.filter(abandoned)
    other = logging.LogRecord("asyncio", logging.ERROR, "base_events.py", 1, "Task exception was never retrieved: x",
                              None, None)
    assert checkpoint._ORBAX_FILTER.filter(other)


@pytest.mark.slow  # a training run: ~50 s on a busy 2-core machine
def test_a_metrics_write_on_a_full_disk_is_one_paragraph(monkeypatch, tmp_path, corpus_dir):
    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(metrics.MetricsWriter, "flush", full)
    run = tmp_path / "run"
    code, err = call(["train", "lm", *TINY_LM, "train.steps=2", f"data.path={corpus_dir}", "sample.max_new_tokens=0",
                      "observe.tensorboard=false", "observe.plot=false", "-q", "--run-dir", str(run)])
    assert code == 2 and "No space left on device" in one_paragraph(err)
