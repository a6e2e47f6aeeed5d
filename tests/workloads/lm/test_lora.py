"""LoRA (model.lora.*): the adapters add exactly rank * (in + out) parameters per targeted projection and layer and
change nothing at initialisation; only they are trained (no optimizer state for the base, whose weights stay bit for
bit); a fine-tune of an imported tiny Llama lowers its held-out loss and resumes bit for bit; `convert to-hf` merges
W + alpha / r * A B, and transformers reproduces the adapted model's logits; the adapters shard as their weights do;
bad settings are one-paragraph errors with exit code 2."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

from tiny import TINY_LM, run_steps
from tiny_hf import VOCAB, finetune_overrides, make_hf_model

from systolic import cli
from systolic import config as config_lib
from systolic.config import MeshConfig
from systolic.data.tokenizer import make_tokenizer
from systolic.errors import ConfigError
from systolic.engine import finished
from systolic.engine.state import param_count
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import activate, rules_for, with_shardings
from systolic.workloads.lm import init_from
from systolic.workloads.lm.hf import convert as hf
from systolic.workloads.lm.model import lora
from systolic.workloads.lm.config import LMConfig
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.loaded_run import load_run
from systolic.workloads.lm.generate import generate_from_run
from systolic.workloads.lm.train import build_task
from systolic.workloads.lm.model.build import init_params, model_graphdef, param_shardings

TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 12))  # for the imported model
SMALL = TOKENS % 96  # for the models built here, of 96 embedding rows
# A few steps of rank-8 adapters on every projection, at a rate that moves them visibly in 4 steps.
LORA = ["model.lora.rank=8", "model.lora.alpha=16", "model.lora.targets=all", "optim.lr=1e-2"]


def model_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=96, d_model=32, layers=2, heads=4, kv_heads=2, max_seq_len=32, dtype="float32")
    return config_lib.from_dict(ModelConfig, {**base, **kw})


def logits(cfg: ModelConfig, params, tokens) -> np.ndarray:
    graphdef = model_graphdef(dataclasses.replace(cfg, dtype="float32"), cfg.vocab_size or VOCAB)
    return np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, jnp.asarray(tokens, jnp.int32)))


def random_adapters(adapters, seed: int = 1):
    """Non-zero adapters (B included), so that they change the logits."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), len(jax.tree.leaves(adapters))))
    return jax.tree.map(lambda x: 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), adapters)


# THE ADAPTERS -------------------------------------------------------------------------------------------------


def expected_count(cfg: ModelConfig) -> int:
    """rank * (fan_in + fan_out) of every targeted projection, per layer, from the config alone."""
    d, hd = cfg.d_model, cfg.head_dim or cfg.d_model // cfg.heads
    q, kv = cfg.heads * hd, (cfg.kv_heads or cfg.heads) * hd
    m = cfg.mlp_dim or (4 * d if cfg.family == "gpt2" else -(-(8 * d // 3) // 64) * 64)
    shapes = {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, m), "up": (d, m), "down": (m, d)}
    names = shapes if cfg.lora.targets == "all" else cfg.lora.targets.split(",")
    if cfg.family == "gpt2" and cfg.lora.targets == "all":
        names = [n for n in names if n != "gate"]
    return cfg.layers * sum(cfg.lora.rank * (shapes[n][0] + shapes[n][1]) for n in names)


@pytest.mark.parametrize("kw", [
    dict(lora={"rank": 4}),  # PEFT's default targets: q, v
    dict(lora={"rank": 8, "targets": "all"}, head_dim=12, mlp_dim=48),
    dict(lora={"rank": 2, "targets": "o,down,k"}, scan_layers=True),
    dict(family="gpt2", lora={"rank": 4, "targets": "all"}, scan_layers=True),
], ids=["llama-qv", "llama-all-head_dim", "llama-o,down,k-scan", "gpt2-all-scan"])
def test_trainable_count_is_rank_times_fan_in_plus_fan_out(kw):
    cfg = model_cfg(**kw)
    full = nnx.eval_shape(lambda: init_params(cfg, 96, jax.random.PRNGKey(0)))
    adapters, base = lora.split(full)
    plain = nnx.eval_shape(lambda: init_params(lora.base_config(cfg), 96, jax.random.PRNGKey(0)))
    print(f"{kw}: {param_count(adapters)} adapter parameters beside {param_count(base)}")
    assert param_count(adapters) == expected_count(cfg)
    assert jax.tree.map(lambda a: a.shape, base) == jax.tree.map(lambda a: a.shape, plain)  # the base is the plain model
    assert lora.combine(adapters, base).keys() == full.keys()


@pytest.mark.parametrize("kw", [dict(lora={"rank": 4, "targets": "all"}),
                                dict(family="gpt2", lora={"rank": 4, "targets": "all"}, scan_layers=True)],
                         ids=["llama", "gpt2-scan"])
def test_fresh_adapters_change_nothing_and_merging_keeps_the_function(kw):
    cfg = model_cfg(**kw)
    full = jax.jit(lambda: init_params(cfg, 96, jax.random.PRNGKey(0)))()
    adapters, base = lora.split(full)
    plain = logits(lora.base_config(cfg), base, SMALL)
    np.testing.assert_array_equal(logits(cfg, full, SMALL), plain)  # B = 0: exactly the base model
    trained = random_adapters(adapters)
    adapted = logits(cfg, lora.combine(trained, base), SMALL)
    merged = logits(lora.base_config(cfg), jax.jit(lambda a, b: lora.merge(cfg, a, b))(trained, base), SMALL)
    print(f"{kw}: adapted vs base {np.abs(adapted - plain).max():.3f}, "
          f"merged vs adapted {np.abs(merged - adapted).max():.2e}")
    assert np.abs(adapted - plain).max() > 0.1
    np.testing.assert_allclose(merged, adapted, atol=1e-4, rtol=0)


def test_sharded_forward_equals_one_device():
    """On an fsdp x tensor mesh of 8 devices each adapter is split like its weight (A's input side, B's output
    side) and the forward pass equals the single-device one."""
    cfg = model_cfg(lora={"rank": 4, "targets": "all"}, scan_layers=True)
    adapters, base = lora.split(jax.jit(lambda: init_params(cfg, 96, jax.random.PRNGKey(0)))())
    params = lora.combine(random_adapters(adapters), base)
    one = logits(cfg, params, SMALL)
    mesh = mesh_lib.make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    rules = rules_for("default", mesh)
    shardings = param_shardings(cfg, 96, mesh, rules)
    attn = shardings["blocks"]["attn"]
    # The stacked layer axis L goes to the pipeline's stage axis (size 1 here), as the weights' own does.
    assert attn["wq_lora"]["a"].spec == P("stage", "fsdp", None)  # (L, D, r) like wq's (L, D, H, hd)
    assert attn["wq_lora"]["b"].spec == P("stage", None, "tensor", None)  # (L, r, H, hd)
    assert attn["wo_lora"]["a"].spec == P("stage", "tensor", None, None)  # (L, H, hd, r) like wo's (L, H, hd, D)
    assert attn["wo_lora"]["b"].spec == P("stage", None, "fsdp")  # (L, r, D)
    sharded = jax.device_put(params, shardings)
    with activate(mesh, rules):
        eight = logits(cfg, sharded, np.concatenate([SMALL, SMALL[:, ::-1]]))
    print(f"8 devices vs 1: logits max-abs-diff {np.abs(eight[:2] - one).max():.2e}")
    np.testing.assert_allclose(eight[:2], one, atol=2e-5, rtol=0)


# FINE-TUNING AN IMPORTED MODEL --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("lora-src")
    make_hf_model("llama").save_pretrained(root / "hf")
    hf.import_run(root / "hf", root / "run")
    return root / "run"


def lora_args(source: Path, corpus: Path, run: Path, *extra: str) -> list[str]:
    return ["train", "lm", *finetune_overrides(source, corpus), *LORA, *extra, "--run-dir", str(run)]


@pytest.fixture(scope="module")
def lora_run(imported, corpus_dir, tmp_path_factory):
    """A 4-step LoRA fine-tune of the imported tiny Llama, run to the end."""
    run = tmp_path_factory.mktemp("lora-run") / "run"
    assert cli.main(lora_args(imported, corpus_dir, run)) == 0
    return run


def finetune_cfg(source: Path, corpus: Path, run: Path) -> LMConfig:
    overrides = [*finetune_overrides(source, corpus), *LORA]
    recipe = config_lib.load(LMConfig, None, overrides, "lm-tiny")[0]
    return init_from.with_source_model(recipe, overrides, run)


def test_only_the_adapters_train_and_the_loss_falls(imported, corpus_dir, tmp_path):
    """On a 2 x 2 x 2 mesh: the optimizer state holds adapter-shaped moments only, the base weights come out bit for
    bit as imported, and the held-out loss falls."""
    cfg = finetune_cfg(imported, corpus_dir, tmp_path / "new")
    assert cfg.model.lora.rank == 8 and cfg.model.d_model == 64  # the source's model, this run's adapters
    mesh = mesh_lib.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    prepared = build_task(cfg, mesh, make_tokenizer(cfg.data.tokenizer))
    abstract = prepared.task.abstract_state
    assert prepared.trainable_count == param_count(abstract.params) == expected_count(cfg.model)
    print(f"trainable {prepared.trainable_count:,} of {prepared.param_count:,} parameters")

    adapter_shapes = {x.shape for x in jax.tree.leaves(abstract.params)}
    base_shapes = {x.shape for x in jax.tree.leaves(abstract.frozen)}
    moments = [x for x in jax.tree.leaves(abstract.opt_state) if x.ndim > 0]
    assert moments and {x.shape for x in moments} <= adapter_shapes and not {x.shape for x in moments} & base_shapes
    opt_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract.opt_state))
    adapter_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract.params))
    assert opt_bytes < 2 * adapter_bytes + 64  # Adam's two moments, and step counters
    print(f"optimizer state {opt_bytes:,} bytes for {adapter_bytes:,} bytes of adapters "
          f"(the base: {sum(x.size * 4 for x in jax.tree.leaves(abstract.frozen)):,} bytes)")

    state = prepared.task.init_state()
    source = load_run(imported, "test")
    for a, b in zip(jax.tree.leaves(state.frozen), jax.tree.leaves(source.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    bs = jax.tree.leaves(jax.tree.map(lambda t: t["b"], state.params, is_leaf=lambda t: isinstance(t, dict) and "b" in t))
    assert bs and not any(np.any(np.asarray(b)) for b in bs)  # B = 0: the fine-tune starts at the imported model
    before = prepared.task.evaluate(state)["loss"]
    state, metrics = run_steps(prepared.task, 4, mesh=prepared.mesh, rules=prepared.rules)
    after = prepared.task.evaluate(state)["loss"]
    print(f"held-out loss {before:.4f} -> {after:.4f} after 4 steps; train losses {[float(m['loss']) for m in metrics]}")
    assert after < before - 0.1
    for a, b in zip(jax.tree.leaves(state.frozen), jax.tree.leaves(source.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _losses(run: Path) -> dict[tuple[str, int], float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {(r["split"], r["step"]): r["loss"] for r in rows}


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_lora_run_resumes_exactly_and_checkpoints_only_adapters(imported, lora_run, corpus_dir, tmp_path, capsys):
    run = tmp_path / "resumed"
    assert cli.main([*lora_args(imported, corpus_dir, run), "loop.stop_at_step=2"]) == 0
    assert cli.main(lora_args(imported, corpus_dir, run)) == 0
    assert "resumed from checkpoint step 2" in capsys.readouterr().err
    whole, resumed = _losses(lora_run), _losses(run)
    assert sorted(whole) == [("eval", 4), ("train", 1), ("train", 2), ("train", 3), ("train", 4)]
    assert resumed == whole
    # The checkpoint holds the adapters (exactly: no other parameter) and their optimizer state, not the base.
    cfg = finished.read_config(lora_run, LMConfig, "test").model
    with finished.open_run(lora_run, LMConfig, "test") as opened:
        assert opened.step == 4
        assert opened.checkpointer.mismatch(4, {"params": lora.split(hf.abstract_params(cfg, VOCAB))[0]}) is None
    base, adapted = _bytes(imported / "checkpoints" / "0"), _bytes(lora_run / "checkpoints" / "4")
    params = _bytes(lora_run / "checkpoints" / "4" / "params")
    with capsys.disabled():
        print(f"checkpoint bytes: the imported base (parameters only) {base:,}; a LoRA step {adapted:,} ({params:,} "
              "of it adapters, the rest their Adam moments and metadata)")


def _adapters(run_dir: Path) -> dict:
    """The LoRA run's adapters as saved, on one device."""
    with finished.open_run(run_dir, LMConfig, "test") as run:
        adapters, _ = lora.split(hf.abstract_params(run.cfg.model, VOCAB))
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return run.restore_params(with_shardings(adapters, jax.tree.map(lambda _: one, adapters)))


def test_export_merges_the_adapters(imported, lora_run, corpus_dir, tmp_path, capsys):
    import torch
    import transformers

    cfg = finished.read_config(lora_run, LMConfig, "test").model
    adapters, base = _adapters(lora_run), load_run(imported, "test").params
    ours = logits(cfg, lora.combine(adapters, base), TOKENS)  # the adapted model, not merged
    plain = logits(lora.base_config(cfg), base, TOKENS)
    assert np.abs(ours - plain).max() > 1e-3, "the adapters moved"

    out = tmp_path / "hf"
    assert cli.main(["convert", "to-hf", str(lora_run), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "lora" not in json.dumps(config).lower()
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = reloaded(torch.tensor(TOKENS)).logits.numpy()
    diff = np.abs(theirs - ours).max()
    with capsys.disabled():
        print(f"merged export vs the adapted model: logits max-abs-diff {diff:.2e} (max |logit| {np.abs(ours).max():.2f})")
    assert diff <= 1e-4

    # One merged weight by the formula: q_proj = (W + alpha / r * A B) transposed to torch's (out, in).
    a = np.asarray(adapters["blocks"][1]["attn"]["wq_lora"]["a"], np.float64)  # (D, r)
    b = np.asarray(adapters["blocks"][1]["attn"]["wq_lora"]["b"], np.float64)  # (r, H, hd)
    w = np.asarray(base["blocks"][1]["attn"]["wq"], np.float64)  # (D, H, hd)
    want = (w.reshape(64, -1) + 16 / 8 * a @ b.reshape(8, -1)).T  # (H*hd, D)
    got = load_file(out / "model.safetensors")["model.layers.1.self_attn.q_proj.weight"]
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    assert np.abs(b).max() > 0

    # generate reads the run as export does: the base from init.from, the adapters merged into it.
    assert generate_from_run(lora_run, prompt="def f", max_new_tokens=3, temperature=0.0, top_k=None, top_p=None,
                             seed=None).startswith("def f")
    # The base comes from init.from: without it the run cannot be opened, and says why.
    moved = imported.with_name("moved")
    imported.rename(moved)
    try:
        assert cli.main(["generate", str(lora_run), "--max-new-tokens", "2"]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "is a LoRA run" in err and "keep only the adapters" in err and str(imported) in err
        assert cli.main(lora_args(imported, corpus_dir, lora_run)) == 2  # resuming needs the base too
        err = " ".join(capsys.readouterr().err.split())
        assert "This is a LoRA run" in err and "on the command line to resume" in err
    finally:
        moved.rename(imported)


def test_a_lora_run_as_a_source_gives_its_merged_weights(imported, lora_run, corpus_dir, tmp_path):
    cfg = finetune_cfg(lora_run, corpus_dir, tmp_path / "next")
    merged = load_run(lora_run, "test").params
    mesh = mesh_lib.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    prepared = build_task(cfg, mesh, make_tokenizer(cfg.data.tokenizer))
    state = prepared.task.init_state()
    for a, b in zip(jax.tree.leaves(state.frozen), jax.tree.leaves(merged), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_plan_counts_the_trained_parameters_and_their_optimizer_state(capsys):
    from systolic.plan.planner import Plan, format_plan

    # float32 compute: a GPU plan's bfloat16 attention promotes inside jax, which conftest's strict promotion rejects.
    overrides = [*TINY_LM, "model.lora.rank=8", "model.dtype=float32"]
    assert cli.main(["plan", "lm", *overrides, "--target", "h200", "--mesh", "fsdp=8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cfg = config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, overrides)).model
    assert result["trainable_params"] == expected_count(cfg) and result["params"] > 20 * result["trainable_params"]
    # Adam's two moments of the adapters (A split over fsdp with the embedding; B's (r, H, hd) replicated here),
    # and two step counters: nothing of the size of the base.
    assert 0 < result["optimizer_bytes"] <= 2 * 4 * expected_count(cfg) + 16
    text = format_plan(Plan(**{k: v for k, v in result.items() if k != "recipe"}))
    assert f"{expected_count(cfg):,} of them trained (the rest frozen" in text and "(optimizer state " in text


# BAD SETTINGS -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, fragments", [
    (["model.lora.rank=-1"], ["model.lora.rank=-1", "must be >= 0"]),
    (["model.lora.rank=8", "model.lora.alpha=0"], ["model.lora.alpha=0.0", "greater than 0"]),
    (["model.lora.rank=8", "model.lora.targets=q,x"], ["names x", "q, k, v, o, gate, up, down", "model.lora.targets=all"]),
    (["model.family=gpt2", "model.lora.rank=8", "model.lora.targets=gate"], ["names gate, which the gpt2 block",
                                                                            "q, k, v, o, up, down"]),
    (["model.lora.rank=8"], ["init.from is not set", "init.from=runs/base"]),
])
def test_bad_lora_settings_exit_2(tmp_path, capsys, overrides, fragments):
    assert cli.main(["train", "lm", *TINY_LM, *overrides, "-q", "--run-dir", str(tmp_path / "run")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("error:") and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_init_from_fixes_the_shapes_but_not_the_adapters(imported, corpus_dir, tmp_path):
    overrides = [*finetune_overrides(imported, corpus_dir), *LORA]
    recipe = config_lib.load(LMConfig, None, overrides, "lm-tiny")[0]
    with pytest.raises(ConfigError, match=r"model.d_model=32 .*model.lora.\* may differ"):
        init_from.with_source_model(recipe, [*overrides, "model.d_model=32"], tmp_path / "new")
