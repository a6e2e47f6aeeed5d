"""The rl train step through the engine: sharded == single device, no recompiles, exact resume, config errors."""

import jax
import numpy as np
import pytest
from tiny import run_steps

from systolic.errors import ConfigError
from systolic.runtime.sharding import activate
from systolic.workloads.rl.train import build_task


def run_chunks(cfg, mesh, n: int):
    """(prepared task, final state, per-chunk metrics as floats)."""
    prepared = build_task(cfg, mesh)
    state, metrics = run_steps(prepared.task, n, mesh=mesh)
    return prepared, state, [{k: float(v) for k, v in m.items()} for m in metrics]


@pytest.fixture(scope="module")
def single_device(tiny_rl):
    """The reference: the tiny config's first two chunks on one device."""
    return run_chunks(tiny_rl.config(), tiny_rl.mesh(1), 2)


@pytest.mark.parametrize("devices, layout", [(2, "seeds"), (8, "envs")])
def test_sharded_run_matches_single_device(tiny_rl, single_device, devices, layout):
    """2 seeds on 2 devices: one seed each. 2 seeds on 8 devices: every seed's 8 environments split 8 ways, so each
    minibatch's gradient is averaged across devices. Both follow the single-device run."""
    _, state1, history1 = single_device
    prepared, state, history = run_chunks(tiny_rl.config(), tiny_rl.mesh(devices), 2)
    assert prepared.layout == layout
    for got, want in zip(history, history1):
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=2e-4, atol=1e-5, err_msg=key)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(state1.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    # The state really is split: every device holds a slice of the environment states...
    env_leaf = jax.tree.leaves(state.extra["envs"])[0]
    assert len({d for d in env_leaf.sharding.device_set}) == devices
    assert env_leaf.addressable_shards[0].data.size * devices == env_leaf.size
    # ...and the second chunk reused the first one's compilation (no sharding or weak-type drift).
    assert prepared.task.train_step._cache_size() == 1


def test_metrics_are_per_seed_and_learning_moves(single_device):
    _, _, history = single_device
    first = history[0]
    for name in ("episode_return", "episode_length", "loss", "entropy"):
        assert {f"{name}/seed0", f"{name}/seed1"} <= first.keys()
    assert first["loss/seed0"] != first["loss/seed1"], "seeds are independent"
    assert np.isclose(first["episode_return"], (first["episode_return/seed0"] + first["episode_return/seed1"]) / 2)
    assert history[1]["entropy"] < np.log(2) and history[0]["loss"] != history[1]["loss"]


def test_resume_continues_the_same_learning_curve(tiny_rl, tmp_path):
    cfg, mesh = tiny_rl.config("observe.tensorboard=false", "observe.plot=false"), tiny_rl.mesh(1)
    prepared = build_task(cfg, mesh)  # one task for all three runs: the loop restores or inits through it
    with activate(mesh):
        straight = tiny_rl.loop_run(prepared, cfg, tmp_path / "straight", steps=4)
        halfway = tiny_rl.loop_run(prepared, cfg, tmp_path / "resumed", steps=4, stop_at=2)
        assert int(halfway.state.step) == 2
        # The checkpoint holds a state that differs from a fresh one (so the comparison below means something).
        fresh = prepared.task.init_state()
        assert not np.allclose(np.asarray(jax.tree.leaves(halfway.state.params)[0]),
                               np.asarray(jax.tree.leaves(fresh.params)[0]))
        resumed = tiny_rl.loop_run(prepared, cfg, tmp_path / "resumed", steps=4)
    assert resumed.start_step == 2
    a, b = tiny_rl.train_records(tmp_path / "straight"), tiny_rl.train_records(tmp_path / "resumed")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert a[2]["episode_return/seed0"] != a[0]["episode_return/seed0"]
    assert a == b, "environment states, episode counters, optimizer and RNG all resume exactly"
    assert straight.eval_metrics == resumed.eval_metrics
    assert prepared.task.train_step._cache_size() == 1, "a restored state has the same types and shardings"


@pytest.mark.parametrize("overrides, devices, fragment", [
    (["ppo.num_minibatches=3"], 1, "cannot be split into ppo.num_minibatches=3"),
    (["rl.num_seeds=3", "rl.num_envs=3", "ppo.num_minibatches=1"], 2, "neither splits evenly over the 2"),
    (["mesh.tensor=2"], 1, "mesh.tensor=2"),
    (["env.name=CartPol-v1"], 1, "Did you mean 'CartPole-v1'"),
    (["ppo.gamma=1.5"], 1, "ppo.gamma=1.5 is outside [0, 1]"),
])
def test_config_errors_say_what_to_fix(tiny_rl, overrides, devices, fragment):
    with pytest.raises(ConfigError, match="Fix") as info:
        build_task(tiny_rl.config(*overrides), tiny_rl.mesh(devices))
    assert fragment in str(info.value)
