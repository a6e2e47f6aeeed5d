"""`rl.unroll`: the rollout scan's unroll factor changes the compiled program, not the learning curve."""

import collections
import re

import jax
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params
from tiny import TINY_DQN, TINY_GRU, TINY_PQN, TINY_RL, run_steps

from systolic import config as config_lib
from systolic.errors import ConfigError
from systolic.runtime.sharding import activate
from systolic.workloads.rl.config import RLConfig
from systolic.workloads.rl.envs import make_env
from systolic.workloads.rl.train import algorithm_for, build_task

# The compiled while loops whose trip count XLA knows, by that count.
TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def train_and_compile(cfg, mesh):
    """(each chunk's metrics, the final parameters, the trip counts of the chunk program's loops) for 2 chunks."""
    prepared = build_task(cfg, mesh)
    state, metrics = run_steps(prepared.task, 2, mesh=mesh)
    with activate(mesh):
        hlo = prepared.task.train_step.lower(prepared.task.abstract_state, None).compile().as_text()
    return metrics, jax.tree.leaves(state.params), collections.Counter(map(int, TRIP_COUNT.findall(hlo)))


def test_unrolled_rollout_learns_the_same_in_a_different_program(tiny_rl):
    """The tiny config's 8-step rollouts unrolled by 3: 2 loop iterations of 3 steps, then the 2 left over after
    the loop. Same returns, episode lengths, losses and parameters, to float rounding: the unrolled program runs
    the same operations on the same random numbers (drawn before the scan), only XLA may fuse across the unrolled
    steps in another order (on this CPU they agree bit for bit)."""
    mesh = tiny_rl.mesh(1)
    metrics1, params1, loops1 = train_and_compile(tiny_rl.config(), mesh)
    metrics3, params3, loops3 = train_and_compile(tiny_rl.config("rl.unroll=3"), mesh)
    for got, want in zip(metrics3, metrics1, strict=True):
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert metrics1[1]["episodes"] > 0, "episodes ended, so the returns and lengths compared are real ones"
    for a, b in zip(params3, params1, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # The programs differ: the rollout's loop of 8 iterations (GAE's backward scan is the other 8) became one of
    # 8 // 3 = 2.
    assert loops1 - loops3 == {8: 1} and loops3 - loops1 == {2: 1}, (loops1, loops3)


def scans(jaxpr) -> list[tuple[int, int]]:
    """(length, unroll) of every scan in a jaxpr, nested ones included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            found.append((eqn.params["length"], eqn.params["unroll"]))
        for sub in jaxprs_in_params(eqn.params):
            found += scans(sub)
    return found


@pytest.mark.parametrize("overrides", [TINY_RL, TINY_GRU, TINY_PQN, TINY_DQN], ids=["ppo", "ppo-gru", "pqn", "dqn"])
def test_every_algorithm_unrolls_its_rollout(overrides):
    """Each algorithm's chunk for one seed, traced (not compiled, so quick): the unroll reaches one scan, the
    rollout's over its 8 steps, and no other (GAE's, the minibatches', the updates')."""
    cfg = config_lib.from_dict(RLConfig, config_lib.apply_overrides({}, [*overrides, "rl.unroll=3"]))
    env = make_env(cfg.env)
    algorithm = algorithm_for(cfg, env)
    init, chunk = algorithm.make_seed_fns(cfg, env, algorithm.make_optimizer(cfg))
    key = jax.random.PRNGKey(0)
    found = scans(jax.make_jaxpr(chunk)(jax.eval_shape(init, key), key).jaxpr)
    assert [scan for scan in found if scan[1] != 1] == [(8, 3)], found


@pytest.mark.parametrize("value", [0, -1])
def test_unroll_below_one_says_what_to_fix(tiny_rl, value):
    with pytest.raises(ConfigError, match=f"rl.unroll={value} must be >= 1") as info:
        tiny_rl.config(f"rl.unroll={value}")
    assert "Fix: e.g. rl.unroll=1" in str(info.value)
