"""One tiny config per workload, shared by every test, the one helper that runs a few train steps and the one that
calls the CLI in the test's process.

Fixtures build their configs from these lists and CLI tests pass them as overrides, so the tests compile the
same programs and the session's persistent compile cache (conftest.py) compiles each one once. A test that needs
something else appends overrides after the list (later overrides win) and says why. The lm learning-rate
schedule is part of the compiled step, so `train.steps=N` is a different program: change it only where the run
length matters.
"""

import contextlib
import io

import jax

from systolic.cli import main
from systolic.runtime.sharding import DEFAULT_RULES, Rules, activate

# 2 layers of grouped-query attention (4 query heads sharing 2 key/value heads), 8 sequences of 16 tokens a step.
TINY_LM = [
    "model.d_model=32", "model.layers=2", "model.heads=4", "model.kv_heads=2", "model.max_seq_len=32",
    "data.seq_len=16", "train.batch_size=8", "train.eval_batches=1", "optim.warmup_steps=2", "train.steps=10",
]
# TINY_LM's MLPs as mixtures of 4 experts of width 32, 2 per token (Mixtral's routing): tests/workloads/lm/test_moe.py.
MOE = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.mlp_dim=32"]
TINY_MOE = [*TINY_LM, *MOE]
# What a CLI run of TINY_LM adds: a slice of the default corpus (the standard library) and no sampling, TensorBoard
# or plots. A test of one of those turns it back on after this list.
LM_CLI_QUIET = ["data.max_bytes=300000", "data.val_percent=30", "sample.max_new_tokens=0", "observe.tensorboard=false",
                "observe.plot=false"]

TINY_GAN = ["model.latent_dim=8", "model.g_channels=32", "model.d_channels=32", "train.batch_size=16",
            "train.steps=4", "gan.eval_samples=64", "checkpoint.every_steps=2", "checkpoint.async_save=false",
            "observe.log_every=1", "observe.tensorboard=false", "observe.plot=false"]

# 2 seeds x 8 CartPole environments, 8-step rollouts, 2 updates a chunk.
TINY_RL = [
    "rl.num_seeds=2", "rl.num_envs=8", "rl.num_steps=8", "rl.updates_per_chunk=2", "rl.total_env_steps=512",
    "rl.eval_episodes=2", "model.hidden=16", "env.max_episode_steps=40", "ppo.update_epochs=2",
    "ppo.num_minibatches=2", "ppo.anneal_lr=false", "checkpoint.every_steps=2", "observe.log_every=1",
]
# The same run shape with PQN: its section replaces PPO's (a config has only the chosen algorithm's).
TINY_PQN = [o for o in TINY_RL if not o.startswith("ppo.")] + [
    "algo=pqn", "pqn.update_epochs=2", "pqn.num_minibatches=2", "pqn.anneal_lr=false", "pqn.lr=1e-3"]
# And with DQN: a 192-transition replay buffer (it wraps in the 4th update of 64 steps), learning from the 2nd
# update (128 env steps), the target network copied every 2 updates (128 env steps).
TINY_DQN = [o for o in TINY_RL if not o.startswith("ppo.")] + [
    "algo=dqn", "dqn.buffer_size=192", "dqn.batch_size=16", "dqn.learning_starts=128", "dqn.target_update_every=128",
    "dqn.lr=1e-3"]

# And with memory: a GRU of 8 units on CartPole with both velocities hidden (recurrent PPO, ppo_rnn.py).
TINY_GRU = [*TINY_RL, "model.gru_size=8", "env.hide_obs=[1,3]"]

# `systolic simulate` arguments: the turbulence recipe on a 32^2 grid.
TINY_SIM = ["--recipe", "sim-turbulence", "grid.n=32", "navier_stokes.initial_wavenumber=3", "output.image_pixels=16",
            "checkpoint.every_steps=2", "checkpoint.async_save=false", "-q"]


def run_steps(task, n: int, *, mesh: jax.sharding.Mesh, rules: Rules = DEFAULT_RULES) -> tuple:
    """Initialises `task`'s state under `mesh` and `rules` and runs `n` train steps on its own data (or on None, for
    a task that makes its own, as rl does).

    Returns (the state after n steps, each step's metrics fetched to the host)."""
    with activate(mesh, rules):
        state = task.init_state()
        metrics = []
        for _ in range(n):
            state, step_metrics = task.train_step(state, None if task.data is None else next(task.data))
            metrics.append(jax.device_get(step_metrics))
    return state, metrics


def call(*argv: str) -> tuple[int, str, str]:
    """`systolic ARGV` in this process: (exit code, stdout, stderr with its white space folded, as the CLI wraps error
    paragraphs); a traceback on stderr fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    assert "Traceback" not in err.getvalue()
    return code, out.getvalue(), " ".join(err.getvalue().split())

# `systolic simulate` arguments for the 3-D solver: the Taylor-Green recipe on a 16^3 grid, two frames.
TINY_SIM3D = ["--recipe", "sim-taylor-green-3d", "grid.n=16", "sim.t_end=0.4", "output.frames=2",
              "output.image_pixels=16", "checkpoint.every_steps=2", "checkpoint.async_save=false", "-q"]
