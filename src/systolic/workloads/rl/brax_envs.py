"""Brax environments behind env_api.Env's interface: `env.name: brax/<name>`, e.g. `brax/inverted_pendulum`.

Brax (an optional dependency: `pip install 'systolic[control]'`) simulates MuJoCo models in jax, so its environments
run on device, vmapped and jitted with the policy, as gymnax's do. Physics: Brax's `generalized` pipeline, its default
(Featherstone dynamics on MuJoCo's model files, which ship inside the `mujoco` package: nothing is downloaded),
about as fast as the other pipelines where we measured them and the plainest state to checkpoint
(docs/design-notes.md, this module's section).

Episodes follow Brax's own time-limit wrapper (`EpisodeWrapper`, as Brax's trainers use it): it sets `done` when an
episode terminates or reaches `env.max_episode_steps` steps (0: Brax's default of 1000), and `info["truncation"]`
when the time limit, not a terminal state, ended it. So `terminated = done and not truncation`, and a terminal step
at the time limit counts as terminated, exactly as the gymnax adapter counts it. Actions are in [-1, 1] (Brax scales
them by each actuator's gear); Brax's transitions are deterministic, so `step` ignores its key.

The state is Brax's `State` pytree flattened into a dict of strongly typed arrays named by their path, for the same
checkpointing reason as the gymnax adapter's (envs.py).
"""

from __future__ import annotations

import contextlib
import io
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from systolic.errors import ConfigError
from systolic.workloads.rl.config import EnvConfig
from systolic.workloads.rl.env_api import EnvSpec, EnvStep, as_obs, strong_array

PREFIX = "brax/"
BACKEND = "generalized"
DEFAULT_EPISODE_STEPS = 1000  # Brax's trainers' default `episode_length`
INSTALL = "pip install 'systolic[control]'"


def _brax_envs():
    """`brax.envs`, or None without Brax. Importing it prints a line to stdout when NVIDIA Warp is absent (mujoco's
    mjx.warp), which is of no use here and would break output that other programs read, such as `--json`."""
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            from brax import envs
        except ImportError:
            return None
    return envs


def names() -> list[str]:
    """Every Brax environment's name as `env.name` spells it; empty without Brax."""
    envs = _brax_envs()
    return [] if envs is None else [PREFIX + n for n in sorted(envs._envs)]  # Brax's registry has no public listing


def require(name: str) -> Any:
    """`brax.envs`; a ConfigError saying how to install Brax where it is missing (`name`: the env.name asked for)."""
    envs = _brax_envs()
    if envs is None:
        raise ConfigError(f"env.name={name!r} is a Brax environment, and Brax, an optional dependency, is not "
                          f"installed. Fix: {INSTALL} (Brax and MuJoCo at the versions systolic is tested with), "
                          "or choose a gymnax environment such as env.name=Pendulum-v1.")
    return envs


def names_note() -> str:
    """For the unknown-name error: how to get Brax's environments where they are missing."""
    return "" if _brax_envs() is not None else f" (and Brax's, as brax/<name>, after {INSTALL})"


class BraxEnv:
    """A Brax environment behind `env_api.Env`'s interface."""

    simulator = "Brax"

    def __init__(self, cfg: EnvConfig):
        """`cfg.name` one of `names()` (make_env checks)."""
        envs = require(cfg.name)
        episode_steps = cfg.max_episode_steps or DEFAULT_EPISODE_STEPS
        with warnings.catch_warnings():
            # Brax warns at every model load that its own pipelines are no longer developed; true, and not the
            # user's to act on.
            warnings.filterwarnings("ignore", message="Brax System", category=UserWarning)
            base = envs.get_environment(cfg.name.removeprefix(PREFIX), backend=BACKEND)
        self._env = envs.training.EpisodeWrapper(base, episode_steps, action_repeat=1)
        template = jax.eval_shape(self._brax_reset, jax.random.PRNGKey(0))
        d = int(base.action_size)
        self.spec = EnvSpec(name=cfg.name, obs_shape=tuple(template.obs.shape), discrete=False, action_dim=d,
                            action_low=(-1.0,) * d, action_high=(1.0,) * d, max_episode_steps=episode_steps)
        paths, self._treedef = jax.tree_util.tree_flatten_with_path(template)
        # Dict keys without dots: Orbax joins a checkpoint's nested keys with dots.
        self._keys = [jax.tree_util.keystr(p, simple=True, separator="__").replace(".", "_") for p, _ in paths]
        assert len(set(self._keys)) == len(self._keys), self._keys

    def _brax_reset(self, key: jax.Array) -> Any:
        with jax.numpy_dtype_promotion("standard"):  # Brax mixes dtypes, as gymnax does (envs.py)
            return self._env.reset(key)

    def reset(self, key: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        state = self._brax_reset(key)
        return as_obs(state.obs), self._to_dict(state)

    def step(self, key: jax.Array, state: dict[str, jax.Array], action: jax.Array,
             reset: tuple[jax.Array, dict[str, jax.Array]]) -> EnvStep:
        """One transition; an episode that ends continues from `reset`, a fresh `reset(key)` result."""
        del key  # deterministic transitions
        with jax.numpy_dtype_promotion("standard"):
            new = self._env.step(self._from_dict(state), jnp.asarray(action, jnp.float32))
        done = new.done > 0
        truncated = new.info["truncation"] > 0  # only where the time limit, not a terminal state, ended it
        terminated = done & ~truncated
        final_obs = as_obs(new.obs)
        reset_obs, reset_state = reset
        next_state = jax.tree.map(lambda r, s: jnp.where(done, r, s), reset_state, self._to_dict(new))
        return EnvStep(obs=jnp.where(done, reset_obs, final_obs), state=next_state,
                       reward=jnp.asarray(new.reward, jnp.float32), terminated=terminated, truncated=truncated,
                       final_obs=final_obs)

    def _to_dict(self, state: Any) -> dict[str, jax.Array]:
        return dict(zip(self._keys, map(strong_array, jax.tree.leaves(state)), strict=True))

    def _from_dict(self, state: dict[str, jax.Array]) -> Any:
        return jax.tree.unflatten(self._treedef, [state[k] for k in self._keys])
