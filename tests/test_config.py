"""Config loading: recipes + overrides, and the errors users see for bad input."""

import dataclasses
import re

import pytest

from systolic import config as config_lib
from systolic.errors import ConfigError
from systolic.workloads.lm.config import LMConfig


def load(*overrides, recipe="lm-tiny"):
    cfg, _ = config_lib.load(LMConfig, recipe, list(overrides), "lm-tiny")
    return cfg


def test_recipe_and_overrides_apply():
    cfg = load("model.layers=8", "train.steps=2000", "mesh.fsdp=2", "optim.lr=1e-4", "data.path=/tmp/x")
    assert cfg.model.layers == 8 and cfg.train.steps == 2000 and cfg.mesh.fsdp == 2
    assert cfg.optim.lr == pytest.approx(1e-4) and cfg.data.path == "/tmp/x"
    assert dataclasses.is_dataclass(cfg) and cfg.model.family == "llama"


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        load().train.steps = 3


def test_round_trip_through_dict():
    cfg = load("model.kv_heads=3", "model.heads=6")
    assert config_lib.from_dict(LMConfig, config_lib.to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("model.layrs=8", "Did you mean 'model.layers'"),
        ("trian.steps=3", "Did you mean 'train'"),
        ("train.steps=abc", "should be an integer"),
        ("train.steps=0", "must be greater than 0"),
        ("model.family=lama", "Did you mean 'llama'"),
        ("model.tie_embeddings=3", "true or false"),
        ("optim.lr=fast", "should be a number"),
        ("mesh.data=0", "not a valid axis size"),
        ("train.steps.x=1", "is a value, not a section"),
        ("model", "section.key=value"),
        ("model.heads=5", "not divisible"),
        ("model.kv_heads=-1", "must be >= 0"),
        ("model.mlp_dim=-3", "must be >= 0"),
        ("model.norm_eps=0", "greater than 0"),
        ("data.seq_len=4096", "model.max_seq_len"),
        ("train.batch_size=10", "grad_accum"),
        ("model.sliding_window=-1", "model.sliding_window=-1 must be >= 0"),
        ("model.rope_scaling.type=dynamic", "Allowed values: none, linear, llama3, yarn"),
        ("model.rope_scaling.factor=0", "model.rope_scaling.factor=0.0 out of range"),
        ("model.rope_scaling.type=yarn", "needs model.rope_scaling.original_max_seq_len"),
        ("model.rope_scaling.high_freq_factor=0.5", "must be greater than low_freq_factor"),
    ],
)
def test_bad_overrides_name_key_and_fix(override, fragment):
    overrides = [override] + (["train.grad_accum=4"] if "batch_size" in override else [])
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(".", r"\.")):
        load(*overrides)


def test_llama_block_switches_are_refused_for_gpt2():
    with pytest.raises(ConfigError, match=r"model\.qk_norm=true, model\.rope_scaling\.type=linear with model\.family=gpt2"):
        load("model.family=gpt2", "model.qk_norm=true", "model.rope_scaling.type=linear", "model.rope_scaling.factor=2")


def test_gemma_switches_are_refused_where_they_cannot_act():
    """Gemma's settings (lm/hf/config.py imports them) with what cannot compute them: each a ConfigError."""
    layers = load().model.layers
    sliding = ["model.sliding_window=4", f"model.layer_types=[{','.join(['sliding', 'full'] * (layers // 2))}]"]
    cases = [
        (["model.family=gpt2", "model.final_logit_softcap=30"],
         r"model\.final_logit_softcap=30\.0 with model\.family=gpt2"),
        (["model.layer_types=[sliding]"], r"model\.layer_types lists 1 layers"),
        ([f"model.layer_types=[{','.join(['full'] * layers)}]"], r"it gives each layer's kind.*and a window"),
        (["model.rope_local_theta=10000"], r"model\.rope_local_theta=10000\.0 gives the sliding layers"),
        (["model.attn_logit_softcap=50", "model.attention=cudnn"], r"cuDNN's flash attention .* no logit soft-capping"),
        (["model.attn_logit_scale=0.1", "model.parametrization=mup"], r"muP sets the attention logits' scale"),
        (["model.mlp_activation=gelu_tanh", "model.moe.experts=4"], r"the experts are SwiGLU MLPs"),
        (["model.attn_logit_softcap=50", "mesh.context=2"], r"ring and allgather attention .* do not soft-cap"),
        (["model.final_logit_softcap=-1"], r"out of range"),
    ]
    for overrides, match in cases:
        with pytest.raises(ConfigError, match=match):
            load(*overrides)
    assert load(*sliding, "model.rope_local_theta=10000").model.local_layers == (True, False) * (layers // 2)


def test_unknown_recipe_suggests_close_match():
    with pytest.raises(ConfigError, match="Did you mean 'lm-tiny'"):
        load(recipe="lm-tine")


def test_on_off_choices_survive_yaml_booleans():
    assert load("observe.progress=off").observe.progress == "off"
    assert load("observe.progress=on").observe.progress == "on"


def test_a_workload_s_recipe_answers_to_its_short_name():
    assert config_lib.recipe_path("sft", "lm") == config_lib.RECIPE_DIR / "lm-sft.yaml"
    cfg, name = config_lib.load(LMConfig, "sft", ["data.path=chats.jsonl"], "lm-tiny", "lm")
    assert name == "lm-sft" and cfg.data.format == "chat" and cfg.data.packing == "documents"
    with pytest.raises(ConfigError, match="Unknown recipe 'sfy' \\(nor 'lm-sfy'\\). Did you mean 'sft'"):
        config_lib.recipe_path("sfy", "lm")
    with pytest.raises(ConfigError, match="Unknown recipe 'sft'"):  # no workload: names are whole
        config_lib.recipe_path("sft")


def test_an_empty_section_is_its_defaults_or_absent_when_optional():
    """`grid:` with nothing under it (YAML null) in a config.yaml: a required section at its defaults (it used to
    reach validate() as None: an AttributeError the file fuzz found), an optional one absent."""
    from systolic.workloads.rl.config import RLConfig
    from systolic.workloads.sim.config import SimConfig

    sim = config_lib.from_dict(SimConfig, {"workload": "sim", "grid": None})
    assert sim.grid == SimConfig().grid
    rl = config_lib.from_dict(RLConfig, {"workload": "rl", "algo": "ppo", "pqn": None})
    assert rl.pqn is None


FIX_PAIR = re.compile(r"[a-z_][\w.]*=\S+")


def suggested_fix(message: str) -> list[str]:
    """The overrides an error's "Fix:" offers first: its first run of consecutive key=value words."""
    found: list[str] = []
    for word in message.partition("Fix: ")[2].split():
        word = word.rstrip(".,;)")
        if FIX_PAIR.fullmatch(word):
            found.append(word)
        elif found:
            break
    return found


POST = ["data.path=x.jsonl", "init.from=x"]  # the post-training recipes' required settings (read later, not here)


@pytest.mark.parametrize("recipe, overrides", [
    ("lm-tiny", ["train.steps=0"]),
    ("lm-tiny", ["train.eval_every=0"]),
    ("lm-tiny", ["checkpoint.keep=0"]),
    ("lm-tiny", ["model.heads=5"]),
    ("lm-tiny", ["model.kv_heads=-1"]),
    ("lm-tiny", ["data.seq_len=4096"]),
    ("lm-tiny", ["data.val_percent=100"]),
    ("lm-tiny", ["train.batch_size=10", "train.grad_accum=4"]),
    ("lm-tiny", ["model.sliding_window=-1"]),
    ("lm-tiny", ["model.rope_scaling.type=yarn"]),
    ("lm-tiny", ["model.rope_scaling.high_freq_factor=0.5"]),
    ("lm-tiny", ["model.family=gpt2", "model.qk_norm=true"]),
    ("lm-tiny", ["model.rope_local_theta=10000"]),
    ("lm-tiny", ["model.attn_logit_softcap=50", "model.attention=cudnn"]),
    ("lm-tiny", ["model.mlp_activation=gelu_tanh", "model.moe.experts=4"]),
    ("lm-tiny", ["model.attn_logit_softcap=50", "mesh.context=2"]),
    ("lm-tiny", ["model.moe.experts=4", "model.moe.top_k=8"]),
    ("lm-tiny", ["model.lora.rank=4", "optim.name=muon"]),
    ("lm-grpo", [*POST, "train.batch_size=12"]),
    ("lm-grpo", [*POST, "grpo.max_completion_len=512"]),
    ("lm-grpo", [*POST, "grpo.max_completion_len=600", "data.seq_len=512", "model.max_seq_len=512"]),
    ("lm-grpo", [*POST, "grpo.group_size=1"]),
    ("lm-grpo", [*POST, "grpo.temperature=0"]),
    ("lm-grpo", [*POST, "grpo.clip_eps=2"]),
    ("lm-grpo", [*POST, "mesh.context=2"]),
    ("lm-grpo", [*POST, "reward.functions=format"]),
    ("lm-grpo", [*POST, "reward.weights=1,2"]),
    ("lm-grpo", [*POST, "reward.answer_field="]),
    ("lm-dpo", [*POST, "dpo.beta=0"]),
    ("lm-dpo", [*POST, "dpo.label_smoothing=0.7"]),
    ("lm-dpo", [*POST, "dpo.label_smoothing=0.1"]),
    ("lm-sft", [*POST, "data.packing=concat"]),
])
def test_every_fix_a_config_error_offers_works_when_applied(recipe, overrides):
    """The first key=value fix of each config check's error, appended to the overrides, makes a config that loads
    (and passes GRPO's checks of the rest of the config). init.from's data.seq_len: test_sft.py."""
    from systolic.workloads.lm.post import grpo

    def load_checked(extra: list[str]) -> LMConfig:
        cfg, _ = config_lib.load(LMConfig, recipe, [*overrides, *extra], "lm-tiny", "lm")
        if cfg.objective == "grpo":
            grpo.check(cfg)
        return cfg

    with pytest.raises(ConfigError) as error:
        load_checked([])
    fix = suggested_fix(str(error.value))
    assert fix, f"the error offers no key=value fix: {error.value}"
    load_checked(fix)
