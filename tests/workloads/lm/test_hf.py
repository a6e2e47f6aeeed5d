"""Hugging Face conversion against transformers itself: tiny random Llama (grouped-query attention, a non-default
RoPE theta) and GPT-2 models are imported, must give the same logits and greedy generations, are exported back
and reloaded by `from_pretrained`; what the model does not compute is refused by name; a fine-tune starts from an
import and resumes from its own checkpoint. The other open families: test_hf_families.py."""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from tiny_hf import VOCAB, finetune_overrides, hf_logits, make_hf_model, our_logits

from systolic import cli
from systolic import config as config_lib
from systolic.config import MeshConfig
from systolic.data.tokenizer import make_tokenizer
from systolic.errors import ConfigError, UserError
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import activate, rules_for
from systolic.workloads.lm.model import decode as gen
from systolic.workloads.lm import init_from
from systolic.workloads.lm.hf import convert as hf
from systolic.workloads.lm.hf import config as hf_config
from systolic.workloads.lm.hf import tensors as hf_tensors
from systolic.workloads.lm.config import LMConfig
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model.sections import MoeConfig
from systolic.workloads.lm.loaded_run import load_run
from systolic.workloads.lm.generate import generate_from_run
from systolic.workloads.lm.train import build_task
from systolic.workloads.lm.model.build import model_graphdef, param_shardings

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 12))
NEW = 10


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{family: (transformers model, its saved folder)}; GPT-2 sharded (index path) and with a tokenizer.json."""
    from systolic.data.bpe import train_bpe

    root = tmp_path_factory.mktemp("hf")
    out = {}
    for family in ("llama", "gpt2"):
        model = make_hf_model(family)
        model.save_pretrained(root / family, max_shard_size="50KB" if family == "gpt2" else "5GB")
        out[family] = (model, root / family)
    assert (root / "gpt2" / "model.safetensors.index.json").is_file()
    train_bpe(["def f(x):\n    return x + 1\n"] * 20, 300).save(root / "gpt2" / "tokenizer.json")
    return out


@pytest.fixture(scope="module")
def imported(folders, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    for family, (_, folder) in folders.items():
        hf.import_run(folder, root / family)
    return {family: root / family for family in folders}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_import_matches_transformers(folders, imported, family):
    model, _ = folders[family]
    run = load_run(imported[family], "test")
    assert run.vocab == VOCAB and run.cfg.model.vocab_size == VOCAB
    ours, ref = our_logits(run.cfg.model, run.params, TOKENS), hf_logits(model, TOKENS)
    print(f"{family}: logits max-abs-diff {np.abs(ours - ref).max():.2e} (max |logit| {np.abs(ref).max():.2f})")
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)

    graphdef = model_graphdef(dataclasses.replace(run.cfg.model, dtype="float32"), VOCAB)
    greedy = np.asarray(gen.generate(graphdef, run.params, jnp.asarray(TOKENS, jnp.int32), max_new_tokens=NEW))
    with torch.no_grad():
        want = model.generate(torch.tensor(TOKENS), attention_mask=torch.ones(TOKENS.shape, dtype=torch.long),
                              max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    np.testing.assert_array_equal(greedy, want[:, TOKENS.shape[1]:].numpy())
    assert len(np.unique(greedy)) > 3  # not a degenerate constant continuation


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_export_round_trip(folders, imported, tmp_path, family):
    model, _ = folders[family]
    out = tmp_path / "out"
    shard = 60_000 if family == "llama" else 5 * 10**9  # llama: several files plus an index
    files = hf.export_run(imported[family], out, max_shard_bytes=shard)
    assert ("model.safetensors.index.json" in files) == (family == "llama")
    assert sorted(p.name for p in out.iterdir()) == sorted(files)
    assert not list(tmp_path.glob(".out.*")), "the temporary folder was renamed, not left behind"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [hf_config.ARCHITECTURES[family]] and config["torch_dtype"] == "float32"
    reloaded = type(model).from_pretrained(out, attn_implementation="eager").eval()
    diff = np.abs(hf_logits(reloaded, TOKENS) - hf_logits(model, TOKENS)).max()
    print(f"{family}: round-trip logits max-abs-diff {diff:.2e}")
    assert diff == 0.0  # float32 in, float32 out: the weights are copied exactly
    if family == "gpt2":  # the run's tokenizer travels along
        assert (out / "tokenizer.json").read_bytes() == (folders["gpt2"][1] / "tokenizer.json").read_bytes()


def test_tokenizer_is_copied_and_used(folders, imported):
    run = imported["gpt2"]
    assert (run / "tokenizer.json").read_bytes() == (folders["gpt2"][1] / "tokenizer.json").read_bytes()
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["data"]["tokenizer"] == str((run / "tokenizer.json").absolute())
    assert saved["model"]["scan_layers"] is False and (imported["llama"] / "config.yaml").is_file()
    assert not (imported["llama"] / "tokenizer.json").exists()  # no tokenizer.json: the byte tokenizer
    text = generate_from_run(run, prompt="def f", max_new_tokens=4, temperature=0.0, top_k=None, top_p=None, seed=None)
    assert text.startswith("def f")


def test_load_onto_mesh_of_8_devices(folders):
    """Stacked layers (scan_layers) placed straight into the default 3-D layout: each device gets its slice."""
    model, folder = folders["llama"]
    cfg = hf_config.model_config(hf_config.read_config(folder), folder, scan_layers=True)
    mesh = mesh_lib.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    rules = rules_for("default", mesh)
    params = hf.load_params(folder, cfg, param_shardings(cfg, VOCAB, mesh, rules))
    wq = params["blocks"]["attn"]["wq"]  # (L, D, H, hd), D over fsdp, H over tensor
    assert wq.shape == (2, 64, 4, 16) and wq.addressable_shards[0].data.shape == (2, 32, 2, 16)
    tokens = np.concatenate([TOKENS, TOKENS[:, ::-1]])  # 4 rows: the batch splits over data x fsdp
    with activate(mesh, rules):
        ours = our_logits(cfg, params, tokens)
    ref = hf_logits(model, tokens)
    print(f"llama on 8 devices: logits max-abs-diff {np.abs(ours - ref).max():.2e}")
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("cfg", [
    ModelConfig(family="llama", vocab_size=96, d_model=32, layers=2, heads=4, kv_heads=2, head_dim=12, mlp_dim=48),
    ModelConfig(family="gpt2", vocab_size=96, d_model=32, layers=2, heads=4, max_seq_len=16, scan_layers=True),
    ModelConfig(family="llama", vocab_size=96, d_model=32, layers=2, heads=4, kv_heads=2, qkv_bias=True, qk_norm=True,
                scan_layers=True),
    ModelConfig(family="llama", vocab_size=96, d_model=32, layers=2, heads=4, scan_layers=True,
                moe=MoeConfig(experts=4, mlp_dim=16)),  # Mixtral, experts stacked on layers
    ModelConfig(family="llama", vocab_size=96, d_model=32, layers=3, heads=4, qkv_bias=True,
                moe=MoeConfig(experts=4, mlp_dim=16, shared_experts=2, shared_gate=True, first=1)),  # Qwen2-MoE
], ids=["llama-gqa-head_dim", "gpt2-scan", "llama-qkv_bias-qk_norm-scan", "mixtral-scan", "qwen2-moe-dense-first"])
def test_tensor_map_round_trips(cfg):
    """Our params -> HF tensors -> our params is the identity, and the shapes the map predicts are the real ones."""
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(np.float32), hf.abstract_params(cfg, 96))
    exported = {name: (shape, make()) for name, shape, make in hf.export_tensors(cfg, params)}
    assert all(x.shape == shape for shape, x in exported.values())
    flat = {tuple(k.key for k in path): x for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert {p.path for p in hf_tensors.pairs(cfg)} == set(flat)
    for p in hf_tensors.pairs(cfg):
        want = flat[p.path][p.index]
        np.testing.assert_array_equal(hf_tensors.to_ours(p.tensor, exported[p.hf][1], want.shape), want)


def _write_broken(src: Path, dst: Path, family: str) -> None:
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    if family == "missing":
        tensors = load_file(dst / "model.safetensors")
        del tensors["model.layers.1.mlp.up_proj.weight"]
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    elif family == "gemma":
        config.update(model_type="gemma", architectures=["GemmaForCausalLM"])
    elif family in ("dynamic", "longrope"):
        config["rope_parameters"] = {"rope_type": family, "rope_theta": 5e5, "factor": 8.0}
    elif family == "partial-rotary":
        config["rope_parameters"]["partial_rotary_factor"] = 0.5
    elif family == "qwen3-attention-bias":
        config.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], attention_bias=True)
    (dst / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("broken, fragments", [
    ("missing", ["lacks 1 tensor", "model.layers.1.mlp.up_proj.weight", "model.layers.{i}.self_attn.q_proj.weight"]),
    # A Llama folder relabelled Gemma: its SwiGLU is not the GeGLU that Gemma computes.
    ("gemma", ["hidden_act = 'silu'", "gelu_pytorch_tanh"]),
    ("dynamic", ["rope_type = 'dynamic'", "default, linear, llama3, yarn"]),
    # LongRoPE converts (Phi-3's), with its per-dimension factors: without them it is refused by name.
    ("longrope", ["short_factor / long_factor", "two lists of positive numbers"]),
    ("partial-rotary", ["partial_rotary_factor = 0.5"]),
    ("qwen3-attention-bias", ["attention_bias = True"]),
])
def test_bad_folders_are_user_errors(folders, tmp_path, capsys, broken, fragments):
    src = tmp_path / "src"
    _write_broken(folders["llama"][1], src, broken)
    assert cli.main(["convert", "from-hf", str(src), str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.replace("\n", " ")
    assert err.startswith("error:") and "Traceback" not in err
    for fragment in fragments:
        assert fragment in " ".join(err.split()), err  # the message is wrapped at 110 columns
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob(".run.*"))


def test_parse_size():
    assert hf.parse_size("5GB") == 5 * 10**9 and hf.parse_size("2MiB") == 2 * 2**20 and hf.parse_size("1000") == 1000
    with pytest.raises(UserError, match="not a size"):
        hf.parse_size("lots")


# FINE-TUNING FROM AN IMPORT -----------------------------------------------------------------------------------


def test_init_from_takes_the_source_model_and_params(imported, corpus_dir, tmp_path):
    source = imported["llama"]
    overrides = [*finetune_overrides(source, corpus_dir), "model.dtype=float32"]
    recipe = config_lib.load(LMConfig, None, overrides, "lm-tiny")[0]
    cfg = init_from.with_source_model(recipe, overrides, tmp_path / "new")
    want = load_run(source, "test")
    assert cfg.model == dataclasses.replace(want.cfg.model, dtype="float32")  # the recipe's d_model=192 is gone
    with pytest.raises(ConfigError, match="model.d_model=32"):
        init_from.with_source_model(recipe, [*overrides, "model.d_model=32"], tmp_path / "new")

    mesh = mesh_lib.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    prepared = build_task(cfg, mesh, make_tokenizer(cfg.data.tokenizer))
    state = prepared.task.init_state()
    assert int(state.step) == 0
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)  # fresh Adam moments


def test_finetune_runs_and_resumes_without_the_source(imported, corpus_dir, tmp_path, capsys):
    source = tmp_path / "imported"
    shutil.copytree(imported["llama"], source)
    run = tmp_path / "finetune"
    argv = ["train", "lm", *finetune_overrides(source, corpus_dir), "--run-dir", str(run)]
    assert cli.main([*argv, "loop.stop_at_step=2"]) == 0
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["d_model"] == 64 and saved["init"]["from"] == str(source)
    shutil.rmtree(source)  # from now on this run resumes from its own checkpoint
    assert cli.main(argv) == 0
    assert "resumed from checkpoint step 2" in capsys.readouterr().err
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3, 4]
    # Training in the imported directory itself is refused: it has no optimizer state to resume.
    assert cli.main(["train", "lm", f"init.from={imported['llama']}", f"data.path={corpus_dir}", "data.seq_len=16",
                     "--run-dir", str(imported["llama"])]) == 2
    assert "without optimizer state" in " ".join(capsys.readouterr().err.split())
