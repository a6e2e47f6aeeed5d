"""DPO against TRL 1.16's DPOTrainer itself: on the same tiny random Llama (imported through systolic's converter),
reference model and pairs, TRL's own tokenization, collation and `_compute_loss` give the pairs' ids, the loss, every
parameter's gradient and the metrics, and systolic's packed rows (several pairs to a row) must give the same in
float32; for the sigmoid, IPO and robust losses. Then: the packed rows and the losses by hand, LoRA's reference
without a second weight copy, a sharded step equal to an unsharded one."""

import copy
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiny_hf import CAPITALS, CHATML, SPECIALS, VOCAB, make_hf_model, write_hf_tokenizer

from systolic import config as config_lib
from systolic.data.tokenizer import make_tokenizer
from systolic.workloads.lm.config import LMConfig
from systolic.workloads.lm.hf import tensors as hf_tensors
from systolic.workloads.lm.loaded_run import load_run
from systolic.data import preference
from systolic.workloads.lm.post import dpo, dpo_task
from systolic.workloads.lm.config import DPOConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

SEQ_LEN = 64  # the imported model's positions; each sequence at most 32 tokens


def text_pairs() -> list[dict]:
    """Standard-format pairs of different lengths: the right capital against a wrong one."""
    names = list(CAPITALS)
    return [{"prompt": f"The capital of {c} is", "chosen": f" {CAPITALS[c]}.",
             "rejected": f" {CAPITALS[names[(i + 3) % len(names)]]}, I think" + "!" * (i % 3)}
            for i, c in enumerate(names)]


def chat_pairs() -> list[dict]:
    names = list(CAPITALS)
    return [{"prompt": [{"role": "user", "content": f"Capital of {c}?"}],
             "chosen": [{"role": "assistant", "content": CAPITALS[c]}],
             "rejected": [{"role": "assistant", "content": f"{CAPITALS[names[(i + 1) % len(names)]]}?"}]}
            for i, c in enumerate(names[:6])]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"policy"/"reference": (transformers model, imported run)} sharing a byte-level BPE tokenizer with a ChatML
    template; the reference is the policy with its weights moved a little, so the log-ratios are not zero."""
    from systolic.workloads.lm.hf import convert as hf

    root = tmp_path_factory.mktemp("dpo")
    tok_dir = write_hf_tokenizer(root / "tokenizer", [p["prompt"] + p["chosen"] + p["rejected"] for p in text_pairs()] * 5,
                                 SPECIALS, {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, CHATML)
    policy = make_hf_model("llama")
    reference = copy.deepcopy(policy)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    out = {}
    for name, model in (("policy", policy), ("reference", reference)):
        model.save_pretrained(root / f"hf-{name}")
        for f in tok_dir.iterdir():
            shutil.copy(f, root / f"hf-{name}" / f.name)
        hf.import_run(root / f"hf-{name}", root / name)
        out[name] = (model, root / name)
    out["tokenizer"] = tok_dir
    return out


def hf_tokenizer(folder: Path):
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                                eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                                chat_template=CHATML)


def dpo_config(loss: str, label_smoothing: float = 0.0, reference: str = "live", overrides=()) -> LMConfig:
    tree = config_lib.apply_overrides({}, [
        "objective=dpo", "init.from=unused", "data.path=unused", "data.packing=documents", f"data.seq_len={SEQ_LEN}",
        f"dpo.loss={loss}", "dpo.beta=0.5", f"dpo.label_smoothing={label_smoothing}", f"dpo.reference={reference}",
        *overrides])
    return config_lib.from_dict(LMConfig, tree)


def trl_reference(runs, records: list[dict], dcfg: DPOConfig, tmp_path: Path):
    """TRL's DPOTrainer on `records`: (its tokenized pairs, loss, gradients by HF name, metrics)."""
    policy = copy.deepcopy(runs["policy"][0]).train()
    reference = copy.deepcopy(runs["reference"][0]).eval()
    from datasets import Dataset

    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to="none", beta=dcfg.beta,
                         loss_type=[dcfg.loss], label_smoothing=dcfg.label_smoothing, max_length=None,
                         precompute_ref_log_probs=False, bf16=False, fp16=False)
    trainer = trl.DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(records),
                             processing_class=hf_tokenizer(runs["tokenizer"]))
    examples = [trainer.train_dataset[i] for i in range(len(records))]
    batch = trainer.data_collator(examples)
    loss = trainer._compute_loss(trainer.model, batch, return_outputs=False)
    loss.backward()
    grads = {name: p.grad.numpy() for name, p in trainer.model.named_parameters()}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return examples, loss.item(), grads, metrics


def our_batch(path: Path, tokenizer_dir: Path) -> dict[str, np.ndarray]:
    """Every pair of `path` (train and held-out rows together) in one batch of packed rows."""
    data = preference.load_preferences(str(path), make_tokenizer(str(tokenizer_dir)), seq_len=SEQ_LEN,
                                       val_percent=30)
    parts = [rows.batch(np.arange(len(rows))) for rows in (data.train, data.val)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def unpacked_pairs(batch: dict[str, np.ndarray]) -> dict[int, tuple[list, list]]:
    """pair id -> (chosen, rejected) token ids, read back from packed rows: the sequences whole."""
    out = {}
    for r in range(len(batch["inputs"])):
        tokens = np.concatenate([batch["inputs"][r], batch["targets"][r, -1:]])
        seg = np.concatenate([batch["segment_ids"][r], batch["segment_ids"][r, -1:]])
        for k, pid in enumerate(batch["pair_ids"][r][batch["pair_ids"][r] >= 0]):
            out[int(pid)] = tuple(tokens[seg == 2 * k + s + 1].tolist() for s in (0, 1))
    return out


@pytest.mark.parametrize("loss,smoothing,make_pairs", [
    ("sigmoid", 0.0, text_pairs),
    pytest.param("ipo", 0.0, text_pairs, marks=pytest.mark.slow),  # ~30 s each: TRL's trainer and our compile
    pytest.param("robust", 0.2, text_pairs, marks=pytest.mark.slow),
    pytest.param("sigmoid", 0.0, chat_pairs, marks=pytest.mark.slow),
], ids=["sigmoid", "ipo", "robust", "sigmoid-chat"])
def test_loss_gradients_and_metrics_equal_trl(runs, tmp_path, loss, smoothing, make_pairs):
    cfg = dpo_config(loss, smoothing)
    policy_run, reference_run = load_run(runs["policy"][1], "test"), load_run(runs["reference"][1], "test")
    records = make_pairs()
    examples, trl_loss, trl_grads, trl_metrics = trl_reference(runs, records, cfg.dpo, tmp_path)
    batch = our_batch(write_jsonl(tmp_path / "pairs.jsonl", records), runs["tokenizer"])
    if make_pairs is text_pairs:  # the short pairs share rows (the chat ones, with their template, fill a row each)
        assert (batch["pair_ids"] >= 0).sum(axis=1).max() >= 2, "rows hold several pairs"

    # The same token ids as TRL's tokenization: prompt + chosen and prompt + rejected of each pair.
    seqs = unpacked_pairs(batch)
    for i, e in enumerate(examples):
        assert seqs[i][0] == e["prompt_ids"] + e["chosen_ids"] and seqs[i][1] == e["prompt_ids"] + e["rejected_ids"]

    model_cfg = policy_run.cfg.model
    cfg = dpo_config(loss, smoothing, overrides=[f"model.{k}={v}" for k, v in config_lib.to_dict(model_cfg).items()
                                                 if not isinstance(v, dict)])
    loss_fn = dpo_task.make_dpo_loss_fn(cfg, VOCAB)
    (ours, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
        policy_run.params, jax.tree.map(jnp.asarray, batch), None, frozen=reference_run.params)
    print(f"{loss}: loss {float(ours):.6f} (TRL {trl_loss:.6f})")
    assert float(ours) == pytest.approx(trl_loss, abs=1e-5, rel=1e-5)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected", "logits/chosen", "logits/rejected"):
        assert float(metrics[name]) == pytest.approx(trl_metrics[name], abs=1e-5, rel=1e-5), name
    if make_pairs is text_pairs:
        assert 0 < trl_metrics["rewards/accuracies"] < 1, "a test that tells chosen from rejected both ways"

    flat = {tuple(k.key for k in path): np.asarray(g)
            for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
    worst = 0.0
    for p in hf_tensors.pairs(model_cfg):
        want = hf_tensors.to_ours(p.tensor, trl_grads[p.hf], flat[p.path][p.index].shape)
        np.testing.assert_allclose(flat[p.path][p.index], want, atol=1e-5, rtol=1e-5, err_msg=p.hf)
        worst = max(worst, float(np.abs(flat[p.path][p.index] - want).max()))
    print(f"{loss}: gradients max-abs-diff {worst:.2e}")


# THE PIECES BY HAND ---------------------------------------------------------------------------------------------


def test_losses_by_hand():
    policy = jnp.asarray([[-3.0, -5.0], [-4.0, -2.0]])  # (2 pairs, chosen/rejected)
    reference = jnp.asarray([[-3.5, -4.5], [-4.0, -2.5]])
    lengths = jnp.asarray([[2.0, 4.0], [1.0, 3.0]])
    beta, eps = 0.5, 0.1
    delta = np.array([0.5 - (-0.5), 0.0 - 0.5])  # ratio(chosen) - ratio(rejected)
    sigmoid = -np.log(1 / (1 + np.exp(-beta * delta)))
    ipo = (np.array([0.5 / 2 - (-0.5) / 4, 0.0 - 0.5 / 3]) - 1 / (2 * beta)) ** 2
    logsig = lambda x: -np.log1p(np.exp(-x))  # noqa: E731
    robust = (-(1 - eps) * logsig(beta * delta) + eps * logsig(-beta * delta)) / (1 - 2 * eps)
    for loss, want, ls in (("sigmoid", sigmoid, 0.0), ("ipo", ipo, 0.0), ("robust", robust, eps)):
        got = dpo.pair_losses(policy, reference, lengths, DPOConfig(loss=loss, beta=beta, label_smoothing=ls))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, err_msg=loss)
    valid = jnp.asarray([1.0, 0.0])
    m = dpo.reward_metrics(policy, reference, valid, beta)
    assert float(m["rewards/margins"]) == pytest.approx(beta * delta[0]) and float(m["rewards/accuracies"]) == 1.0


def test_sequence_sums_add_each_sequences_targets():
    values = jnp.arange(1.0, 9.0).reshape(1, 8)
    sequence = jnp.asarray([[-1, 0, 0, -1, 1, 2, 3, 3]])
    sums = np.asarray(dpo.sequence_sums(values, sequence, pairs=3))  # (1, 3, 2)
    np.testing.assert_array_equal(sums[0], [[2 + 3, 5], [6, 7 + 8], [0, 0]])


def test_pairs_that_do_not_fit_are_cut_or_dropped_and_counted(runs, tmp_path):
    long = {"prompt": "The capital of France is", "chosen": " Paris." * 30, "rejected": " Rome."}
    huge_prompt = {"prompt": "The capital of Spain is" * 20, "chosen": " Madrid.", "rejected": " Lima."}
    path = write_jsonl(tmp_path / "long.jsonl", [*text_pairs()[:3], long, huge_prompt])
    with pytest.warns(UserWarning, match="1 have a sequence .* longer than .* 32 tokens, cut to that, and 1 were dropped"):
        data = preference.load_preferences(str(path), make_tokenizer(str(runs["tokenizer"])), seq_len=SEQ_LEN,
                                           val_percent=30)
    assert (data.truncated, data.dropped, sum(data.pairs)) == (1, 1, 4)
    assert "1 cut to 32 tokens a sequence, 1 dropped" in data.describe()
    for rows in (data.train, data.val):
        batch = rows.batch(np.arange(len(rows)))
        assert batch["segment_ids"].max() <= 2 * (batch["pair_ids"] >= 0).sum(axis=1).max() + 1


# LORA, SHARDING -------------------------------------------------------------------------------------------------


def run_config(runs, *extra: str) -> LMConfig:
    """The dpo recipe from the imported policy run (its model and tokenizer), batches of 4 rows."""
    from systolic.workloads.lm import init_from

    cfg, _ = config_lib.load(LMConfig, "dpo", [f"init.from={runs['policy'][1]}", "data.path=unused",
                                               f"data.seq_len={SEQ_LEN}", "train.batch_size=4", *extra], "lm-dpo", "lm")
    return init_from.with_source_model(cfg, list(extra), runs["policy"][1].parent / "no-run")


@pytest.mark.slow  # three plans and two compiled forward passes
def test_lora_reference_is_the_base_without_adapters_and_no_second_copy(runs, tmp_path):
    from systolic.runtime import mesh as mesh_lib
    from systolic.workloads.lm import entry
    from systolic.workloads.lm.model import build
    from systolic.workloads.lm.model import lora

    cfg = run_config(runs, "model.lora.rank=4", "dpo.reference=live")
    one = jax.devices()[:1]
    program, full = entry.plan(cfg, one), entry.plan(run_config(runs), one)
    live_full = entry.plan(run_config(runs, "dpo.reference=live"), one)
    adapters = program.trainable_params
    # `systolic plan`'s parameters: the base once plus the adapters; full fine-tuning with a live reference keeps a
    # copy of the weights beside the trained ones.
    assert program.params == full.params + adapters and 0 < adapters < full.params / 10
    assert live_full.params == 2 * full.params and live_full.trainable_params == full.params

    step = dpo_task.build_dpo_step(cfg, mesh_lib.make_mesh(cfg.mesh, one), make_tokenizer(cfg.data.tokenizer),
                                   num_pairs=1)
    assert step.abstract.frozen and not lora.split(step.abstract.frozen)[0], "frozen: the base weights, no adapters"
    assert not jax.tree.leaves(lora.split(step.abstract.params)[1]), "trained: the adapters alone"

    # With adapters that change the model, the reference is still the base model's log-probabilities.
    base_params = load_run(runs["policy"][1], "test").params
    shapes = jax.eval_shape(lambda: build.init_params(cfg.model, VOCAB, jax.random.PRNGKey(0)))
    rng = np.random.default_rng(0)
    adapters_tree = jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.2, s.shape), s.dtype), lora.split(shapes)[0])
    batch = jax.tree.map(jnp.asarray, our_batch(write_jsonl(tmp_path / "p.jsonl", text_pairs()), runs["tokenizer"]))
    policy, reference, *_ = jax.jit(dpo_task.make_pair_fn(cfg, VOCAB))(adapters_tree, batch, base_params)
    plain, *_ = jax.jit(dpo_task.make_pair_fn(run_config(runs, "dpo.reference=live"), VOCAB))(
        base_params, batch, base_params)
    np.testing.assert_allclose(np.asarray(reference), np.asarray(plain), atol=1e-5)
    assert np.abs(np.asarray(policy) - np.asarray(reference)).max() > 1e-2, "the adapters act on the policy"


def many_pairs() -> list[dict]:
    """56 standard pairs: every country's capital against each wrong one."""
    return [{"prompt": f"The capital of {c} is", "chosen": f" {CAPITALS[c]}.", "rejected": f" {CAPITALS[w]}."}
            for c in CAPITALS for w in CAPITALS if w != c]


@pytest.mark.slow  # ~60 s: two meshes' steps compiled
@pytest.mark.parametrize("reference", ["cached", "live"])
def test_a_sharded_step_equals_an_unsharded_one(runs, tmp_path, reference):
    from systolic.config import MeshConfig
    from systolic.runtime import mesh as mesh_lib
    from tiny import run_steps

    path = write_jsonl(tmp_path / "many.jsonl", many_pairs())
    cfg = run_config(runs, f"data.path={path}", f"dpo.reference={reference}", "optim.lr=1e-3", "optim.warmup_steps=1")
    tokenizer = make_tokenizer(cfg.data.tokenizer)
    metrics = {}
    for name, mesh in (("one", mesh_lib.make_mesh(MeshConfig(), jax.devices()[:1])),
                       ("eight", mesh_lib.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))):
        built = dpo_task.build_dpo_task(cfg, mesh, tokenizer)
        _, metrics[name] = run_steps(built.task, 3, mesh=mesh, rules=built.rules)
    print({k: [float(m["loss"]) for m in v] for k, v in metrics.items()})
    assert metrics["one"][-1]["rewards/margins"] != 0.0
    for one, eight in zip(metrics["one"], metrics["eight"], strict=True):
        for key in ("loss", "grad_norm", "rewards/chosen", "rewards/margins", "logps/rejected", "logits/chosen"):
            assert float(eight[key]) == pytest.approx(float(one[key]), rel=1e-5, abs=1e-6), key


def test_an_moe_policy_adds_its_router_losses_to_dpos(tmp_path):
    """DPO's loss of an MoE policy is the DPO loss (`moe/dpo`, the same as with the router weights at 0) plus the
    weighted router losses of the policy's forward pass."""
    from flax import nnx

    from tiny import MOE, TINY_LM
    from tiny_serve import VOCAB as SERVE_VOCAB
    from tiny_serve import random_params, tiny_model

    from systolic.data.tokenizer import ByteTokenizer

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(f'{{"prompt": "{i}+{i}=", "chosen": "{2 * i}", "rejected": "{2 * i + 1}"}}\n'
                             for i in range(6)))
    data = preference.load_preferences(str(pairs), ByteTokenizer(), seq_len=32, val_percent=0)
    batch = {k: jnp.asarray(v) for k, v in data.train.batch(np.arange(len(data.train))).items()}

    def loss_of(aux: float, z: float):
        overrides = [*TINY_LM, *MOE, "model.dtype=float32", "objective=dpo", "init.from=unused", "data.path=unused",
                     "data.packing=documents", "data.seq_len=32", "dpo.reference=live",
                     f"model.moe.aux_loss_weight={aux}", f"model.moe.z_loss_weight={z}"]
        cfg = config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, overrides))
        graphdef, params = random_params(tiny_model(*MOE))
        reference = jax.tree.map(lambda x: 0.9 * x, params)  # so the log-ratios are not zero
        return graphdef, params, dpo_task.make_dpo_loss_fn(cfg, SERVE_VOCAB)(params, batch, None, reference)

    graphdef, params, (loss, metrics) = loss_of(0.5, 0.25)
    _, _, (plain, plain_metrics) = loss_of(0.0, 0.0)
    _, stats = nnx.merge(graphdef, params).with_moe_stats(batch["inputs"], segment_ids=batch["segment_ids"],
                                                         positions=batch["positions"])
    router = 0.5 * np.mean(stats.aux_loss) + 0.25 * np.mean(stats.z_loss)
    assert router > 0 and float(plain) != 0.0
    np.testing.assert_allclose(float(metrics["moe/dpo"]), float(plain_metrics["moe/dpo"]), rtol=1e-6)
    np.testing.assert_allclose(float(loss), float(plain) + router, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["moe/z_loss"]), np.mean(stats.z_loss), rtol=1e-6)
