"""DQN: the device-resident replay buffer against a reference, its targets (truncation bootstrapped, termination
not), learning start and target-network copies, and a run through the engine (sharded == single device, the buffer
checkpointed: stop + resume bit-exact, config errors)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import TINY_DQN, run_steps

from systolic import config as config_lib
from systolic.engine import loop
from systolic.errors import ConfigError
from systolic.runtime.sharding import activate
from systolic.workloads.rl import dqn, replay
from systolic.workloads.rl.config import RLConfig
from systolic.workloads.rl.train import build_task


def tiny_dqn(*extra: str) -> RLConfig:
    return config_lib.from_dict(RLConfig, config_lib.apply_overrides({}, [*TINY_DQN, *extra]))


# THE REPLAY BUFFER --------------------------------------------------------------------------------------------


def test_buffer_overwrites_the_oldest_like_a_python_ring():
    """Batches of 3 into 7 slots, 5 times: slot contents, write position and size against a plain Python ring."""
    buffer = replay.init_buffer(7, {"x": jnp.zeros((2,), jnp.float32), "a": jnp.zeros((), jnp.int32)})
    ring, position = [None] * 7, 0
    add = jax.jit(replay.add)
    for n in range(5):
        values = np.arange(3 * n, 3 * n + 3)
        buffer = add(buffer, {"x": jnp.asarray(np.stack([values, -values], 1), jnp.float32),
                              "a": jnp.asarray(values, jnp.int32)})
        for v in values:
            ring[position], position = int(v), (position + 1) % 7
    assert (int(buffer.position), int(buffer.size)) == (position, 7)
    np.testing.assert_array_equal(np.asarray(buffer.data["a"]), ring)
    np.testing.assert_array_equal(np.asarray(buffer.data["x"][:, 1]), -np.asarray(ring, np.float32))


def test_sampling_is_uniform_over_the_filled_slots_only():
    buffer = replay.init_buffer(100, {"a": jnp.zeros((), jnp.int32)})
    buffer = replay.add(buffer, {"a": jnp.arange(1, 21, dtype=jnp.int32)})  # 20 of 100 slots hold 1..20
    drawn = np.asarray(replay.sample(buffer, 20_000, key=jax.random.PRNGKey(0))["a"])
    assert drawn.min() == 1 and drawn.max() == 20, "never an empty slot (zeros)"
    counts = np.bincount(drawn, minlength=21)[1:]
    assert np.all(np.abs(counts / 20_000 - 1 / 20) < 0.01)  # 1,000 expected each; binomial std ~31


# TARGETS ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("terminated, expected", [(False, 1.0 + 0.9 * 10.0), (True, 1.0)])
def test_truncation_bootstraps_and_termination_does_not(terminated, expected):
    """A transition cut by the time limit keeps its next observation's value (10); a terminal one has none."""
    target = dqn.td_targets(jnp.asarray([1.0]), jnp.asarray([10.0]), jnp.asarray([terminated]), gamma=0.9)
    assert float(target[0]) == pytest.approx(expected)


# THROUGH THE ENGINE -------------------------------------------------------------------------------------------


def run_chunks(cfg, mesh, n):
    prepared = build_task(cfg, mesh)
    state, metrics = run_steps(prepared.task, n, mesh=mesh)
    return prepared, state, [{k: float(v) for k, v in m.items()} for m in metrics]


def test_sharded_run_matches_single_device_and_the_buffer_fills(tiny_rl):
    _, state1, history1 = run_chunks(tiny_dqn(), tiny_rl.mesh(1), 2)
    prepared, state, history = run_chunks(tiny_dqn(), tiny_rl.mesh(2), 2)
    assert prepared.layout == "seeds"
    for got, want in zip(history, history1):
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=2e-4, atol=1e-5, err_msg=key)
    buffer = state1.extra["seeds"]["buffer"]
    # 4 updates x 64 transitions into 192 slots: full, wrapped once, the write position at 256 - 192 = 64.
    assert buffer.size.tolist() == [192, 192] and buffer.position.tolist() == [64, 64]
    assert buffer.data["obs"].shape == (2, 192, 4) and bool(jnp.any(buffer.data["terminated"]))
    assert history1[0]["loss/seed0"] != history1[0]["loss/seed1"], "seeds are independent"
    assert history1[1]["epsilon"] < history1[0]["epsilon"] <= 1.0
    assert prepared.task.train_step._cache_size() == 1


def test_one_seed_split_by_environments_matches_single_device(tiny_rl):
    """One seed on 2 devices: the environments are split and every device holds the whole replay buffer."""
    _, _, history1 = run_chunks(tiny_dqn("rl.num_seeds=1"), tiny_rl.mesh(1), 2)
    prepared, state, history = run_chunks(tiny_dqn("rl.num_seeds=1"), tiny_rl.mesh(2), 2)
    assert prepared.layout == "envs" and state.extra["seeds"]["buffer"].size.tolist() == [192]
    for got, want in zip(history, history1):
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=2e-4, atol=1e-5, err_msg=key)


def test_learning_starts_and_the_target_network_is_a_periodic_copy(tiny_rl):
    """learning_starts=128: the first update (64 steps) only collects. Copies every 128 steps land at the end of each
    2-update chunk, so the target equals the online network then; every 192 steps, the first copy is at update 3."""
    mesh = tiny_rl.mesh(1)
    prepared = build_task(tiny_dqn("dqn.learning_starts=129"), mesh)  # learns from update 3 (192 steps) on
    with activate(mesh):
        fresh = prepared.task.init_state()
    _, state, history = run_chunks(tiny_dqn("dqn.learning_starts=129"), mesh, 1)
    same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))  # noqa: E731
    assert same(state.params, fresh.params) and history[0]["loss"] == 0.0, "nothing learned before 129 steps"

    _, state, _ = run_chunks(tiny_dqn(), mesh, 1)
    assert not same(state.params, fresh.params)
    assert same(state.extra["seeds"]["target_params"], state.params)  # copied at 128 steps, after the last update
    _, state, _ = run_chunks(tiny_dqn("dqn.target_update_every=192"), mesh, 1)
    assert same(state.extra["seeds"]["target_params"], fresh.params)  # not copied yet at 128 steps


def test_stop_and_resume_is_bit_exact_with_the_replay_buffer(tiny_rl, tmp_path):
    """Stopped after 2 of 4 chunks (the buffer full and wrapped, the target network copied), resumed from the
    checkpoint: losses, returns and every array of the final state, buffer included, equal an uninterrupted run's."""
    cfg, mesh = tiny_dqn("observe.tensorboard=false", "observe.plot=false"), tiny_rl.mesh(1)
    prepared = build_task(cfg, mesh)

    def run(run_dir: Path, stop_at: int = 0) -> loop.RunResult:
        return tiny_rl.loop_run(prepared, cfg, run_dir, steps=4, stop_at=stop_at)

    with activate(mesh):
        straight = run(tmp_path / "straight")
        halfway = run(tmp_path / "resumed", stop_at=2)
        assert int(halfway.state.step) == 2
        buffer = halfway.state.extra["seeds"]["buffer"]
        fresh = prepared.task.init_state().extra["seeds"]["buffer"]
        assert buffer.position.tolist() == [64, 64] and buffer.size.tolist() == [192, 192]  # wrapped at the stop
        assert not np.array_equal(np.asarray(buffer.data["obs"]), np.asarray(fresh.data["obs"]))
        resumed = run(tmp_path / "resumed")
    assert resumed.start_step == 2
    a, b = tiny_rl.train_records(tmp_path / "straight"), tiny_rl.train_records(tmp_path / "resumed")
    assert [r["step"] for r in b] == [1, 2, 3, 4] and a[3]["loss"] > 0
    assert a == b, "Q-network, target network, Adam state, replay buffer, environments and RNG all resume exactly"
    for x, y in zip(jax.tree.leaves(straight.state), jax.tree.leaves(resumed.state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert straight.eval_metrics == resumed.eval_metrics


@pytest.mark.parametrize("overrides, fragment", [
    (["dqn.buffer_size=32"], "is smaller than the 64 transitions one update adds"),
    (["env.name=Pendulum-v1"], "DQN learns a Q-value per action"),
    (["pqn.lr=0.1"], "has a 'pqn' section but algo=dqn"),
    (["dqn.gamma=1.5"], "dqn.gamma=1.5 is outside [0, 1]"),
    (["dqn.batch_size=0"], "dqn.batch_size=0 must be greater than 0"),
])
def test_config_errors_say_what_to_fix(tiny_rl, overrides, fragment):
    with pytest.raises(ConfigError, match="Fix") as info:
        build_task(tiny_dqn(*overrides), tiny_rl.mesh(1))
    assert fragment in str(info.value)


def test_a_dqn_config_has_only_its_own_section():
    tree = config_lib.to_dict(tiny_dqn())
    assert "dqn" in tree and "ppo" not in tree and "pqn" not in tree
    assert config_lib.from_dict(RLConfig, tree) == tiny_dqn()
