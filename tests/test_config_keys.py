"""Every config key of every workload acts: a key that a workload does not use must not exist for it.

The test walks each workload's schema and runs the workload's real commands on tiny configs with every config
class instrumented: a key counts as used when program code reads it. Reads by the schema machinery (loading,
validation, writing config.yaml, `dataclasses.replace`, equality and hashing) do not count. A key may be unread
here only if it is listed in NOT_READ_HERE with the reason (the branch that reads it is covered elsewhere).
"""

import dataclasses
import sys
import typing

import jax
import pytest

from systolic import config as config_lib
from systolic.cli import main
from systolic.workloads import get
from tiny import LM_CLI_QUIET, MOE, TINY_DQN, TINY_GAN, TINY_LM, TINY_MOE, TINY_PQN, TINY_RL, TINY_SIM, TINY_SIM3D

BOOKKEEPING = {"validate", "to_dict", "from_dict", "dump_yaml", "_coerce", "__eq__", "__hash__", "__repr__", "_diff",
               "replace", "_replace", "asdict", "_asdict_inner", "fields"}

# Keys these tiny runs do not read, each with where it acts and the test that shows it.
ON_A_BAD_STEP = {
    "loop.nonfinite": "read when a step is not finite: tests/engine/test_nonfinite.py, test_reliability.py",
    "loop.max_skipped": "read when a step is skipped: tests/engine/test_reliability.py",
}
NOT_READ_HERE = {
    "lm": ON_A_BAD_STEP,
    "gan": ON_A_BAD_STEP | {
        "data.path": "a folder of images instead of the bundled digits: tests/workloads/gan/test_cli.py",
    },
    "rl": ON_A_BAD_STEP,
    "sim": ON_A_BAD_STEP,
}


def schema_keys(schema: type, prefix: str = "") -> dict[str, tuple[type, str]]:
    """'section.key' -> (the dataclass that holds it, its field name), for every leaf key."""
    out = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key = prefix + config_lib.config_key(f.name)
        if (section := config_lib.section_type(hints[f.name])) is not None:  # optional sections too (rl's ppo, pqn)
            out.update(schema_keys(section, key + "."))
        else:
            out[key] = (schema, f.name)
    return out


def config_classes(schema: type) -> set[type]:
    hints = typing.get_type_hints(schema)
    found = {schema}
    for f in dataclasses.fields(schema):
        if (section := config_lib.section_type(hints[f.name])) is not None:
            found |= config_classes(section)
    return found


@pytest.fixture
def record_reads(monkeypatch):
    """Instruments the config classes of a schema; returns the set of (class, field) that program code read."""
    seen: set[tuple[type, str]] = set()

    def instrument(schema: type) -> set[tuple[type, str]]:
        for cls in config_classes(schema):
            names = {f.name for f in dataclasses.fields(cls)}

            def getattribute(self, name, _cls=cls, _names=names):
                if name in _names and not _bookkeeping():
                    seen.add((type(self), name))
                return object.__getattribute__(self, name)

            monkeypatch.setattr(cls, "__getattribute__", getattribute)
        return seen

    return instrument


def _bookkeeping() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in BOOKKEEPING or frame.f_code.co_filename.endswith("dataclasses.py"):
            return True
        frame = frame.f_back
    return False


def unread(workload: str, seen: set[tuple[type, str]]) -> list[str]:
    keys = schema_keys(get(workload).config)
    allowed = NOT_READ_HERE[workload]
    read_fields = {(cls.__name__, name) for cls, name in seen}
    missing = []
    for key, (cls, name) in keys.items():
        # A subclass instance (lm's train section) records under its own class; match by field on any class.
        hit = any((c.__name__, name) in read_fields for c in (cls, *cls.__subclasses__()))
        if not hit and key != "workload" and not any(key == a or key.startswith(a + ".") for a in allowed):
            missing.append(key)
    return missing


QUIET = ["-q", "observe.tensorboard=false"]


def test_every_lm_key_acts(record_reads, tmp_path, monkeypatch):
    seen = record_reads(get("lm").config)
    # Not quiet: the sample at the end of training is printed, so its settings are read.
    assert main(["train", "lm", *TINY_LM, *LM_CLI_QUIET, "train.steps=2", "train.eval_every=1", "sample.max_new_tokens=4",
                 "observe.profile_steps=2", "observe.progress=off", "--run-dir", str(tmp_path / "lm")]) == 0
    # GRPO's sections act in a post-training run of that model (tests/workloads/lm/post/test_grpo_run.py trains one
    # further).
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{i}+1=", "answer": {i + 1}}}\n' for i in range(8)))
    assert main(["train", "lm", "--recipe", "grpo", f"init.from={tmp_path / 'lm'}", f"data.path={prompts}",
                 "data.seq_len=16", "data.val_percent=30", "grpo.group_size=4", "grpo.max_completion_len=4",
                 "grpo.beta=0.04", "train.batch_size=8", "train.steps=1", "train.eval_batches=1",
                 "reward.functions=number_match,format", "reward.weights=1,0.5", "reward.format_pattern=1", "-q",
                 "observe.tensorboard=false", "observe.plot=false", "--run-dir", str(tmp_path / "grpo")]) == 0
    # RoPE scalings read their own settings: a scaled model computes its frequencies from them (their parity with
    # transformers: tests/workloads/lm/test_hf_families.py).
    from systolic.workloads.lm.config import LMConfig
    from systolic.workloads.lm.model.rope import inverse_frequencies

    for scaling in (["type=llama3", "factor=8", "original_max_seq_len=16"],
                    ["type=yarn", "factor=4", "original_max_seq_len=16", "attention_factor=1.2", "truncate=false"]):
        overrides = [*TINY_LM, *(f"model.rope_scaling.{o}" for o in scaling)]
        cfg = config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, overrides))
        assert inverse_frequencies(cfg.model)[0].shape == (cfg.model.d_head // 2,)
    # LoRA's settings are read when the adapters are built (a LoRA run needs init.from: test_lora.py trains one).
    from flax import nnx

    from systolic.workloads.lm.model.transformer import Transformer

    lora = ["model.lora.rank=4", "model.lora.alpha=16", "model.lora.targets=q,o"]
    cfg = config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, [*TINY_LM, *lora]))
    model = nnx.eval_shape(lambda: Transformer(cfg.model, 64, rngs=nnx.Rngs(0)))
    assert model.blocks[0].attn.wo_lora.scale == 4.0 and model.blocks[0].attn.wv_lora is None
    # MoE's settings are read when its layers are built and its loss is traced (tests/workloads/lm/test_moe.py
    # trains MoE models).
    from systolic.workloads.lm.model.build import init_params, model_graphdef
    from systolic.workloads.lm.train import make_loss_fn

    moe = ["model.moe.shared_experts=1", "model.moe.shared_gate=true", "model.moe.first=1", "model.moe.every=1",
           "model.moe.capacity_factor=1", "model.moe.norm_topk_prob=false"]
    cfg = config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, [*TINY_MOE, *moe]))
    params = jax.eval_shape(lambda: init_params(cfg.model, 64, jax.random.PRNGKey(0)))
    batch = {k: jax.ShapeDtypeStruct((2, 16), jax.numpy.int32) for k in ("inputs", "targets")}
    loss, metrics = jax.eval_shape(make_loss_fn(model_graphdef(cfg.model, 64), cfg.model.moe, 0.0), params, batch, None)
    assert "moe/dropped" in metrics
    # Gemma's switches are read when the model is built and run (their parity with transformers' Gemma, Gemma 2 and
    # Gemma 3: tests/workloads/lm/test_hf_families.py); the final cap bounds every logit.
    gemma = ["model.mlp_activation=gelu_tanh", "model.embed_multiplier=8", "model.norm_placement=sandwich",
             "model.attn_logit_scale=0.2", "model.attn_logit_softcap=5", "model.final_logit_softcap=3",
             "model.sliding_window=4", "model.layer_types=[sliding,full]", "model.rope_local_theta=100"]
    cfg = config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, [*TINY_LM, *gemma]))
    logits = Transformer(cfg.model, 64, rngs=nnx.Rngs(0))(jax.numpy.zeros((1, 8), jax.numpy.int32))
    assert 0 < float(jax.numpy.abs(logits).max()) < 3
    # The switches of Phi-3, OLMo 2, SmolLM3 and Granite, of GPT-OSS and of DeepSeek-V3 are read when their models are
    # built and run (their parity with transformers: test_hf_families.py, test_hf_gpt_oss.py, test_hf_deepseek.py).
    families = [
        ["model.rope_scaling.type=longrope", "model.rope_scaling.factor=2", "model.rope_scaling.original_max_seq_len=4",
         "model.rope_scaling.short_factor=[1.0,1.5]", "model.rope_scaling.long_factor=[2.0,3.0]",
         "model.partial_rotary_factor=0.5", "model.norm_placement=post", "model.qk_norm=true",
         "model.qk_norm_scope=all", "model.no_rope_layers=[1]", "model.residual_multiplier=0.5",
         "model.logit_divisor=2"],
        [*MOE, "model.attn_sinks=true", "model.attn_out_bias=true", "model.moe.router_bias=true",
         "model.moe.expert_bias=true", "model.moe.swiglu_limit=7", "model.moe.swiglu_alpha=1.702"],
        [*MOE, "model.kv_heads=0", "model.mla.kv_lora_rank=8", "model.mla.q_lora_rank=8", "model.mla.qk_nope_head_dim=8",
         "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=8", "model.mla.rope_interleave=false",
         "model.moe.scoring=sigmoid", "model.moe.groups=2", "model.moe.topk_groups=1", "model.moe.routed_scale=2.5"],
    ]
    for switches in families:
        cfg = config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, [*TINY_LM, *switches]))
        logits = Transformer(cfg.model, 64, rngs=nnx.Rngs(0))(jax.numpy.zeros((1, 8), jax.numpy.int32))
        assert logits.shape == (1, 8, 64) and bool(jax.numpy.isfinite(logits).all())
    # Muon's settings are read when its optimizer is built, muP's base width when a muP model is (their training:
    # tests/workloads/lm/test_muon.py, test_mup.py).
    from systolic.optim.adamw import make_schedule
    from systolic.workloads.lm.optimizer import make_lm_optimizer

    overrides = [*TINY_LM, "optim.name=muon", "model.parametrization=mup", "model.mup_base_width=16"]
    cfg = config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, overrides))
    make_lm_optimizer(cfg.optim, cfg.model, make_schedule(cfg.optim, cfg.train.steps))
    assert nnx.eval_shape(lambda: Transformer(cfg.model, 64, rngs=nnx.Rngs(0))).logit_scale == 0.5
    # DPO's settings are read when its loss is traced (its runs: tests/workloads/lm/post/test_dpo*.py).
    from systolic.workloads.lm.post import dpo_task

    dpo = ["objective=dpo", "init.from=runs/base", "data.path=pairs.jsonl", "data.packing=documents", "dpo.loss=robust",
           "dpo.label_smoothing=0.1", "dpo.reference=live"]
    cfg = config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, [*TINY_LM, *dpo]))
    params = jax.eval_shape(lambda: init_params(cfg.model, 64, jax.random.PRNGKey(0)))
    batch = {k: jax.ShapeDtypeStruct((2, 16), jax.numpy.int32)
             for k in ("inputs", "targets", "segment_ids", "positions", "sequence", "pair_ids")}
    loss, metrics = jax.eval_shape(dpo_task.make_dpo_loss_fn(cfg, 64), params, batch, None, frozen=params)
    assert "rewards/margins" in metrics
    # GRPO's reward settings are read when its rewards are built (tests/workloads/lm/post/test_rewards.py).
    from systolic.workloads.lm.config import RewardConfig
    from systolic.workloads.lm.post.rewards import Rewards

    (tmp_path / "keys_reward.py").write_text("def score(prompt, completion, fields):\n    return 2.0\n")
    monkeypatch.chdir(tmp_path)  # a user's function (module:function), run in its worker under reward.timeout_s
    reward = {"functions": "number_match,format,keys_reward:score", "weights": "1,0.5,1", "answer_field": "a",
              "format_pattern": "####", "timeout_s": 5}
    rewards = Rewards(config_lib.from_dict(RewardConfig, reward, "reward."))
    assert rewards.total(rewards.score(["q"], ["#### 4"], [{"a": 4}])).tolist() == [3.5]
    assert unread("lm", seen) == [], unread("lm", seen)


def test_every_gan_key_acts(record_reads, tmp_path):
    seen = record_reads(get("gan").config)
    assert main(["train", "gan", *TINY_GAN, *QUIET, "--run-dir", str(tmp_path / "gan")]) == 0
    assert unread("gan", seen) == [], unread("gan", seen)


def test_every_rl_key_acts(record_reads, tmp_path):
    seen = record_reads(get("rl").config)
    assert main(["train", "rl", *TINY_RL, *QUIET, "--run-dir", str(tmp_path / "rl")]) == 0
    # The other algorithms, from their recipes (the default one is PPO's), whose sections replace PPO's.
    for algo, tiny in (("pqn", TINY_PQN), ("dqn", TINY_DQN)):
        argv = ["train", "rl", "--recipe", f"rl-cartpole-{algo}", *tiny, *QUIET, "--run-dir", str(tmp_path / algo)]
        assert main(argv) == 0, algo
    # A continuous-action policy (Pendulum) reads what a discrete one does not: its initial log standard deviation.
    from systolic.workloads.rl.config import RLConfig
    from systolic.workloads.rl.envs import make_env
    from systolic.workloads.rl.policy import init_params

    cfg = config_lib.from_dict(RLConfig, config_lib.apply_overrides({}, [*TINY_RL, "env.name=Pendulum-v1",
                                                                          "model.init_log_std=-1.5"]))
    params = init_params(make_env(cfg.env).spec, cfg.model, key=jax.random.PRNGKey(0))
    assert float(params["log_std"][0]) == -1.5
    assert unread("rl", seen) == [], unread("rl", seen)


def test_every_sim_key_acts(record_reads, tmp_path):
    seen = record_reads(get("sim").config)
    runs = [["simulate", *TINY_SIM, "navier_stokes.forcing=kolmogorov"],
            ["simulate", *TINY_SIM, "sim.equation=heat", "sim.t_end=0.01", "sim.dt=0.001"],
            ["simulate", *TINY_SIM, "sim.equation=gray_scott", "sim.t_end=2"],
            ["simulate", *TINY_SIM3D],
            ["fit", "sim", "--recipe", "sim-viscosity-inverse", "grid.n=32", "fit.steps=2", "output.frames=2"]]
    for i, argv in enumerate(runs):
        assert main([*argv, *QUIET, "--run-dir", str(tmp_path / f"sim{i}")]) == 0, argv
    assert unread("sim", seen) == [], unread("sim", seen)
