"""GRPO's rollouts and step pieces in process (post/rollout.py, post/grpo.py, post/prompts.py): the sampler's
log-probabilities are the training forward pass's, sharded rollouts and losses are the unsharded ones, prompt records
are checked, and the stream's state round-trips its batch exactly. The CLI runs are in test_grpo_run.py."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tiny import MOE, TINY_LM
from tiny_serve import LIMIT, PAGE, VOCAB, drive, random_params, tiny_model, token_ids

from systolic import config as config_lib
from systolic.config import MeshConfig
from systolic.data.tokenizer import ByteTokenizer
from systolic.errors import ConfigError, UserError
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import activate, rules_for
from systolic.workloads.lm.config import LMConfig
from systolic.workloads.lm.post import grpo, rollout
from systolic.workloads.lm.post.prompts import Prompt, load_prompts
from systolic.workloads.lm.serve.engine import InferenceEngine, SamplingParams
from systolic.workloads.lm.model.build import param_shardings

SEQ_LEN = 24  # rows of 25 tokens: a prompt of up to 14 and a completion of up to 10
MAX_NEW = 10
TOKENIZER = ByteTokenizer()


def grpo_config(*extra: str) -> LMConfig:
    overrides = [*TINY_LM, "model.dtype=float32", "objective=grpo", "init.from=unused", "data.packing=documents",
                 "data.path=unused.jsonl", f"data.seq_len={SEQ_LEN}", f"grpo.max_completion_len={MAX_NEW}",
                 "grpo.group_size=4", "grpo.temperature=0.7", *extra]
    return config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, overrides))


# A random model rarely writes the end-of-text id: these end a completion too, so lengths vary.
STOP_IDS = (TOKENIZER.eot_id, *range(200, 256))


def prompts(n: int) -> list[Prompt]:
    texts = [f"{i % 7}+{i % 5}=" for i in range(n)]
    return [Prompt(f"p.jsonl:{i}", t, TOKENIZER.encode(t).astype(np.int32), {"answer": "0"}, STOP_IDS)
            for i, t in enumerate(texts)]


def sample(params, mesh=None, rules=None, temperature=0.7, rows=8):
    sampler = rollout.Sampler(tiny_model(), TOKENIZER, rows=rows, seq_len=SEQ_LEN, mesh=mesh, rules=rules)
    group = prompts(rows)
    seeds = [rollout.completion_seed(0, 0, j) for j in range(rows)]
    return group, sampler.complete(params, group, seeds=seeds, temperature=temperature, top_k=0, top_p=1.0,
                                   max_tokens=MAX_NEW)


def sharded(params, mesh_cfg: MeshConfig):
    mesh = mesh_lib.make_mesh(mesh_cfg)
    rules = rules_for("default", mesh)
    return jax.device_put(params, param_shardings(tiny_model(), VOCAB, mesh, rules)), mesh, rules


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_samplers_logprobs_are_the_training_forward_passes(temperature):
    """So the importance ratio of a batch's first update is 1: the engine's tempered log-probabilities (paged
    attention over the prompt, then one token at a time) against the training forward pass over the packed rows."""
    graphdef, params = random_params(tiny_model())
    group, completions = sample(params, temperature=temperature)
    assert all(len(ids) for ids in completions.ids) and not all(completions.truncated)  # some stopped early
    batch = rollout.make_batch(group, completions, np.zeros(len(group), np.float32), row_len=SEQ_LEN + 1,
                               pad_id=TOKENIZER.pad_id)
    logps, _ = grpo._forward_logps(graphdef, params, {k: jnp.asarray(v) for k, v in batch.items()}, LIMIT,
                                   temperature)
    mask = batch["loss_mask"].astype(bool)
    assert mask.sum() == sum(len(ids) for ids in completions.ids)
    gap = np.abs(np.asarray(logps) - batch["old_logps"])[mask]
    assert gap.max() < 1e-5, gap.max()
    # The default stays the raw model's log-probability, as serving reports it.
    raw = rollout.Sampler(tiny_model(), TOKENIZER, rows=8, seq_len=SEQ_LEN, mesh=None, rules=None)
    raw._serve(params)
    one = SamplingParams(max_tokens=1, temperature=0.5, seed=0, logprobs=True)
    raw.engine.add_request("a", group[0].ids.tolist(), one)
    events = []
    while raw.engine.has_work():  # a step's tokens are read in the next one's call (serve/engine.py)
        events += raw.engine.step()
    (event,) = events
    logits = nnx.merge(graphdef, params)(jnp.asarray(group[0].ids)[None])[0, -1]  # (V,)
    expected = jax.nn.log_softmax(jnp.where(jnp.arange(VOCAB) < LIMIT, logits, -jnp.inf))[event.token_id]
    assert abs(event.logprob - float(expected)) < 1e-5


def test_sharded_rollouts_and_losses_are_the_unsharded_ones():
    """The engine runs on the training mesh with the trainer's parameters where they lie (fsdp and tensor split)."""
    cfg = grpo_config()
    graphdef, params = random_params(tiny_model())
    group, plain = sample(params)
    on_mesh, mesh, rules = sharded(params, MeshConfig(data=2, fsdp=2, tensor=2))
    with activate(mesh, rules):
        _, split = sample(on_mesh, mesh, rules)
    for a, b, la, lb in zip(plain.ids, split.ids, plain.logps, split.logps, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(la, lb, atol=1e-5)
    advantages = np.linspace(-1, 1, len(group)).astype(np.float32)
    host = rollout.make_batch(group, plain, advantages, row_len=SEQ_LEN + 1, pad_id=TOKENIZER.pad_id)
    loss_fn = jax.jit(grpo.make_loss_fn(cfg, graphdef, LIMIT))
    loss, metrics = loss_fn(params, {k: jnp.asarray(v) for k, v in host.items()}, None)
    place = grpo.make_place(grpo.batch_shardings(mesh, rules, 0.0), len(group))
    with activate(mesh, rules):
        loss_s, metrics_s = loss_fn(on_mesh, place(host), None)
    assert abs(float(loss) - float(loss_s)) < 1e-6 and float(loss) != 0.0
    for k in metrics:
        assert abs(float(metrics[k]) - float(metrics_s[k])) < 1e-6, k
    assert float(metrics["clip_ratio/region_mean"]) == 0.0  # ratio 1: nothing clipped on a first update


def test_set_params_serves_new_weights_and_forgets_cached_prefixes():
    """Keys and values cached under the old weights would continue a prompt with the new ones: after set_params the
    engine answers as a fresh engine with the new weights does."""
    _, params = random_params(tiny_model())
    other = jax.tree.map(lambda x: -x, params)
    prompt = list(b"a prompt of 13")  # with its answer, 4 full pages of PAGE tokens: cached when the request ends
    greedy = SamplingParams(max_tokens=6, temperature=0.0)

    def answer(engine):
        return token_ids(drive(engine, {0: [("a", prompt, greedy)]})["a"])

    def engine_with(weights):
        return InferenceEngine(tiny_model(), weights, TOKENIZER, kv_pages=16, page_size=PAGE, max_seqs=2,
                               max_tokens_per_step=32)

    engine = engine_with(params)
    before = answer(engine)
    assert engine.stats()["kv_pages_cached"] == (len(prompt) + 6 - 1) // PAGE  # the last token is never fed back
    engine.set_params(other)
    assert engine.stats()["kv_pages_cached"] == 0
    after = answer(engine)
    assert after == answer(engine_with(other)) and after != before
    assert engine.stats()["prefix_hit_tokens"] == 0  # the second request found nothing to reuse


def test_a_batch_row_is_the_prompt_then_its_completion_in_a_segment_of_its_own():
    group = prompts(2)
    completions = rollout.Completions(
        ids=(np.array([51, 52, 256], np.int32), np.arange(60, 60 + MAX_NEW, dtype=np.int32)),
        logps=(np.array([-1, -2, -3], np.float32), -np.arange(1, MAX_NEW + 1, dtype=np.float32)),
        texts=("34", "<>" * 5), truncated=np.array([False, True]))
    batch = rollout.make_batch(group, completions, np.array([0.5, -0.5], np.float32), row_len=SEQ_LEN + 1,
                               pad_id=TOKENIZER.pad_id)
    P = len(group[0].ids)  # 4: "0+0="
    row = np.concatenate([batch["inputs"][0], batch["targets"][0, -1:]])
    assert row[:P + 3].tolist() == [*group[0].ids.tolist(), 51, 52, 256] and set(row[P + 3:]) == {TOKENIZER.pad_id}
    assert batch["loss_mask"][0].nonzero()[0].tolist() == [P - 1, P, P + 1]  # the inputs that predict the completion
    assert batch["old_logps"][0, P - 1:P + 2].tolist() == [-1, -2, -3]
    assert batch["segment_ids"][0, P + 2] == 1 and batch["segment_ids"][0, P + 3] == 2  # the padding apart
    assert batch["positions"][0, :P + 3].tolist() == list(range(P + 3))
    assert batch["advantages"].tolist() == [0.5, -0.5]
    assert completions.length_metrics() == {"completions/mean_length": 6.5, "completions/min_length": 3.0,
                                            "completions/max_length": 10.0, "completions/clipped_ratio": 0.5}


def test_the_streams_state_is_json_and_restores_the_batch_exactly():
    stream = rollout.RolloutStream(grpo_config(), None)
    host = {"old_logps": np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32),
            "inputs": np.arange(24, dtype=np.int32).reshape(4, 6), "advantages": np.array([1e-7, 2, 3, 4], np.float32)}
    stream.host, stream.rollouts, stream.served, stream.position = host, 3, 1, 12
    stream.metrics = {"reward": 0.25}
    saved = json.loads(json.dumps(stream.get_state()))
    parts = rollout.StreamParts((), None, None, lambda h: h, None, None, 0, row_len=7, warn=print)
    other = rollout.RolloutStream(grpo_config(), parts)
    other.set_state(saved)
    assert (other.position, other.rollouts, other.served, other.metrics) == (12, 3, 1, {"reward": 0.25})
    for k, v in host.items():
        assert other.host[k].dtype == v.dtype and other.host[k].tobytes() == v.tobytes()


def test_prompts_are_records_with_fields_held_out_by_name(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1), "id": i}) + "\n" for i in range(40)))
    loaded = load_prompts(str(path), TOKENIZER, max_prompt_len=8, val_percent=20)
    assert len(loaded.train) + len(loaded.val) == 40 and loaded.val and loaded.train
    first = min((*loaded.train, *loaded.val), key=lambda p: p.fields["id"])
    assert first.name == "p.jsonl:1" and first.text == "0+1=" and first.fields == {"answer": "1", "id": 0}
    assert first.ids.tolist() == list(b"0+1=") and first.stop_ids == (TOKENIZER.eot_id,)
    again = load_prompts(str(path), TOKENIZER, max_prompt_len=8, val_percent=20)
    assert [p.name for p in again.val] == [p.name for p in loaded.val]


@pytest.mark.parametrize("record, message", [
    ({"answer": "1"}, "has neither `prompt` nor `messages`"),
    ({"prompt": 3}, "not a string"),
    ({"prompt": ""}, "a prompt of 0 tokens"),
    ({"prompt": "x" * 9}, "a prompt of 9 tokens, but a prompt needs 1 to 8"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "has no chat template"),  # the byte tokenizer has none
    ({"prompt": "a", "messages": []}, "has both"),
])
def test_a_bad_prompt_record_is_named_by_file_and_line(tmp_path, record, message):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(UserError, match="line 2") as error:
        load_prompts(str(path), TOKENIZER, max_prompt_len=8, val_percent=20)
    assert message in str(error.value) and "Fix:" in str(error.value)


def test_grpo_settings_that_cannot_work_are_config_errors():
    for extra, message in ((["train.batch_size=6"], "not a multiple of grpo.group_size=4"),
                           ([f"grpo.max_completion_len={SEQ_LEN}"], "leaves no room for a prompt"),
                           (["data.packing=concat"], "data.packing='concat'"),
                           (["data.max_bytes=100"], "data.max_bytes=100"),
                           (["mesh.context=2"], "mesh.context=2")):
        with pytest.raises(ConfigError, match=message):
            cfg = grpo_config(*extra)
            cfg.validate()  # the data settings (LMConfig._check_post_data, as DPO's)
            grpo.check(cfg)  # the rest


def test_rollouts_take_every_prompt_once_an_epoch_in_an_order_fixed_by_the_seed():
    parts = rollout.StreamParts(tuple(range(5)), None, None, None, None, None, 0, row_len=7, warn=print)
    taken = [rollout.RolloutStream(grpo_config(), parts)._next_prompts(3) for _ in range(1)]
    stream = rollout.RolloutStream(grpo_config(), parts)
    drawn = sum((stream._next_prompts(3) for _ in range(5)), [])
    assert drawn[:3] == taken[0] and stream.position == 15
    assert all(sorted(drawn[i:i + 5]) == list(range(5)) for i in (0, 5, 10)) and drawn[:5] != drawn[5:10]


def test_an_moe_policy_adds_its_router_losses_which_train_the_router_when_rewards_are_equal():
    """With model.moe the loss is GRPO's plus the weighted load-balancing and router z-losses, as in SFT: a batch
    whose groups all have equal rewards (advantages 0) gives the experts no gradient but still moves the router."""
    moe_cfg = grpo_config(*MOE, "model.moe.aux_loss_weight=0.5", "model.moe.z_loss_weight=0.25")
    dense_cfg = grpo_config(*MOE, "model.moe.aux_loss_weight=0", "model.moe.z_loss_weight=0")
    model = tiny_model(*MOE)
    graphdef, params = random_params(model)
    group, completions = sample(random_params(tiny_model())[1])  # any completions: the loss is the point here
    batch = rollout.make_batch(group, completions, np.zeros(len(group), np.float32), row_len=SEQ_LEN + 1,
                               pad_id=TOKENIZER.pad_id)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    loss, metrics = grpo.make_loss_fn(moe_cfg, graphdef, LIMIT)(params, batch, None)
    _, stats = nnx.merge(graphdef, params).with_moe_stats(batch["inputs"], segment_ids=batch["segment_ids"],
                                                         positions=batch["positions"])
    router = 0.5 * np.mean(stats.aux_loss) + 0.25 * np.mean(stats.z_loss)
    assert float(metrics["moe/grpo"]) == 0.0 and router > 0
    np.testing.assert_allclose(float(loss), router, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["moe/aux_loss"]), np.mean(stats.aux_loss), rtol=1e-6)
    grads = jax.grad(lambda p: grpo.make_loss_fn(moe_cfg, graphdef, LIMIT)(p, batch, None)[0])(params)
    router_grads = [float(np.abs(np.asarray(g)).max()) for path, g in jax.tree_util.tree_leaves_with_path(grads)
                    if "router" in jax.tree_util.keystr(path)]
    assert router_grads and max(router_grads) > 0
    # Without the router weights, equal rewards train nothing.
    dense_grads = jax.grad(lambda p: grpo.make_loss_fn(dense_cfg, graphdef, LIMIT)(p, batch, None)[0])(params)
    assert all(float(np.abs(np.asarray(g)).max()) == 0.0 for g in jax.tree.leaves(dense_grads))


def test_rows_fit_the_longest_prompt_and_completion_capped_by_data_seq_len():
    """A 4-token prompt and 10-token completions need 14 tokens: a row of 16 (+ the shifted target), not
    data.seq_len; a cap below that need gives data.seq_len's row."""
    group = prompts(8)  # "i+j=" prompts: 4 bytes each
    assert max(len(p.ids) for p in group) == 4
    assert rollout.row_length(group, 10, seq_len=512) == 17
    assert rollout.row_length(group, 60, seq_len=512) == 65
    assert rollout.row_length(group, 10, seq_len=12) == 13


def test_most_groups_without_reward_variance_warn_with_the_fix():
    cfg = grpo_config()
    assert rollout.zero_std_warning(cfg, 0.5, identical=0, groups=4, step=1) is None  # half is not most
    text = rollout.zero_std_warning(cfg, 0.75, identical=2, groups=4, step=3)
    assert "step 3" in text and "75% of the 4 groups" in text and "2 of them with 4 identical completions" in text
    assert "grpo.temperature, now 0.7" in text and "grpo.group_size, now 4" in text and "Fix:" in text
    same = rollout.Completions(ids=tuple(np.array(x, np.int32) for x in ([1, 2], [1, 2], [1, 2], [1, 3])),
                               logps=(np.zeros(2, np.float32),) * 4, texts=("",) * 4, truncated=np.zeros(4, bool))
    assert same.identical_groups(2) == 1 and same.identical_groups(4) == 0
