"""The environment adapters: `make_env` picks one by `env.name`; this module is the one place that knows gymnax.

Names that start with `brax/` are Brax environments (brax_envs.py, an optional dependency); every other name is a
gymnax one. Both adapters have the interface that `env_api.Env` declares, so the algorithms never know which
simulator runs.

The gymnax adapter steps as gymnax 1.0.1 does (pinned in pyproject.toml: transition, time limit, automatic reset)
with two changes: the pre-reset observation, which a truncated episode must bootstrap from, is returned explicitly
as `EnvStep.final_obs`, and the reset target is an argument, drawn in bulk by the caller outside its step loop,
because on CPU every threefry call inside a loop is itself a small loop. Environment states leave the adapter as
plain dicts of strongly typed arrays, so a checkpoint round trip never turns a weak type strong and recompiles the
jitted step. Each change against gymnax's API: docs/design-notes.md, this module's section.

`env.hide_obs` makes any environment partially observed: `make_env` wraps the adapter in `HiddenObs`, which zeroes
those flat components of every observation it returns (`obs` and `final_obs`), so every algorithm and every
evaluation sees the same masked view; `obs_view` applies the same mask to observations from elsewhere (Gymnasium's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from systolic.errors import ConfigError
from systolic.workloads.rl import brax_envs
from systolic.workloads.rl.config import EnvConfig
from systolic.workloads.rl.env_api import Env, EnvSpec, EnvStep, as_obs, strong_array

# Gymnasium's own reward thresholds for "solved" (its registry's `reward_threshold`); Pendulum-v1 has none there,
# so the target stands in. Used for reporting only.
# brax/inverted_pendulum is MuJoCo's InvertedPendulum, whose Gymnasium threshold (InvertedPendulum-v4) is 950.
SOLVED_AT = {"CartPole-v1": 475.0, "Acrobot-v1": -100.0, "MountainCar-v0": -110.0, "MountainCarContinuous-v0": 90.0,
             "Pendulum-v1": -250.0, "brax/inverted_pendulum": 950.0}

# gymnax mixes Python floats with int32 arrays (CartPole's `force_mag * action`), which jax's strict dtype promotion
# (on in our tests) rejects; gymnax's calls, and only those, run under standard promotion.

# Environments that gymnax cannot build offline on every machine.
_NEEDS_DOWNLOAD = {"MNISTBandit-bsuite"}


def make_env(cfg: EnvConfig) -> Env:
    """The adapter for `cfg.name`: a Brax environment for `brax/<name>`, else a gymnax one; a ConfigError naming the
    closest name for one that neither simulator has (the adapters take known names only)."""
    brax = cfg.name.startswith(brax_envs.PREFIX)
    if brax:
        brax_envs.require(cfg.name)  # without Brax, how to install it comes before any talk of names
    if cfg.name not in (brax_envs.names() if brax else gymnax_names()):
        raise unknown_name_error(cfg.name)
    env = brax_envs.BraxEnv(cfg) if brax else GymnaxEnv(cfg)
    return HiddenObs(env, cfg.hide_obs) if cfg.hide_obs else env


def obs_view(hide_obs: tuple[int, ...], spec: EnvSpec) -> Callable[[Any], jax.Array]:
    """`view(obs (..., *obs_shape)) -> float32 obs` as the agent sees it, the `hide_obs` flat components zeroed;
    a ConfigError for indices the observation does not have."""
    if not hide_obs:
        return as_obs
    bad = [i for i in hide_obs if not 0 <= i < spec.obs_size]
    if bad:
        raise ConfigError(
            f"env.hide_obs={list(hide_obs)}: {bad} {'is' if len(bad) == 1 else 'are'} not a component of "
            f"{spec.name}'s observation, which has {spec.obs_size} (flat indices 0 to {spec.obs_size - 1}, shape "
            f"{spec.obs_shape}). Fix: list indices in that range, e.g. env.hide_obs=[{spec.obs_size - 1}], or "
            "env.hide_obs=[] to see everything."
        )
    if len(hide_obs) == spec.obs_size:
        raise ConfigError(
            f"env.hide_obs={list(hide_obs)} hides all {spec.obs_size} components of {spec.name}'s observation, so "
            "the agent would see nothing but zeros. Fix: leave at least one index out of env.hide_obs."
        )
    visible = np.ones(spec.obs_size, bool)
    visible[list(hide_obs)] = False
    visible = visible.reshape(spec.obs_shape)
    return lambda obs: jnp.where(visible, as_obs(obs), 0.0)


class HiddenObs:
    """An environment seen partially (`env.hide_obs`): the hidden components of every observation it returns are 0;
    the environment itself runs unchanged."""

    def __init__(self, env: Env, hide_obs: tuple[int, ...]):
        self.spec, self.simulator = env.spec, env.simulator
        self._env, self._view = env, obs_view(hide_obs, env.spec)

    def reset(self, key: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        obs, state = self._env.reset(key)
        return self._view(obs), state

    def step(self, key: jax.Array, state: dict[str, jax.Array], action: jax.Array,
             reset: tuple[jax.Array, dict[str, jax.Array]]) -> EnvStep:
        out = self._env.step(key, state, action, reset)  # `reset` came from our own reset: already masked
        return out._replace(obs=self._view(out.obs), final_obs=self._view(out.final_obs))


def gymnax_names() -> list[str]:
    """The gymnax environments the adapter can build on every machine."""
    import gymnax

    return [n for n in gymnax.registered_envs if n not in _NEEDS_DOWNLOAD]


def unknown_name_error(name: str) -> ConfigError:
    """The error for a name that neither gymnax nor Brax has, naming the closest one there is."""
    import difflib

    names = gymnax_names() + brax_envs.names()
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"env.name={name!r} is not an environment the rl workload can build.{hint} Available: "
                       f"{', '.join(names)}{brax_envs.names_note()}. Fix: pass one of these names, e.g. "
                       f"env.name={close[0] if close else 'CartPole-v1'}.")


class GymnaxEnv:
    """A gymnax environment behind `Env`'s interface."""

    simulator = "gymnax"

    def __init__(self, cfg: EnvConfig):
        """`cfg.name` one of `gymnax_names()` (make_env checks)."""
        import gymnax

        self._env, params = gymnax.make(cfg.name)
        if cfg.max_episode_steps:
            params = params.replace(max_steps_in_episode=cfg.max_episode_steps)
        self._params = params
        space = self._env.action_space(params)
        discrete = hasattr(space, "n")
        obs_shape = tuple(jax.eval_shape(lambda k: self._gymnax_reset(k)[0], jax.random.PRNGKey(0)).shape)
        if discrete:
            action_dim, low, high = int(space.n), (), ()
        else:
            action_dim = int(space.shape[0]) if space.shape else 1
            low = tuple(float(x) for x in jnp.broadcast_to(jnp.asarray(space.low), (action_dim,)))
            high = tuple(float(x) for x in jnp.broadcast_to(jnp.asarray(space.high), (action_dim,)))
        self.spec = EnvSpec(name=cfg.name, obs_shape=obs_shape, discrete=discrete, action_dim=action_dim,
                            action_low=low, action_high=high, max_episode_steps=int(params.max_steps_in_episode))
        _, template = jax.eval_shape(self._gymnax_reset, jax.random.PRNGKey(0))
        self._state_type = type(template)

    def reset(self, key: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        obs, state = self._gymnax_reset(key)
        return as_obs(obs), self._to_dict(state)

    def _gymnax_reset(self, key: jax.Array) -> tuple[jax.Array, Any]:
        with jax.numpy_dtype_promotion("standard"):  # gymnax (see above)
            return self._env.reset(key, self._params)

    def step(self, key: jax.Array, state: dict[str, jax.Array], action: jax.Array,
             reset: tuple[jax.Array, dict[str, jax.Array]]) -> EnvStep:
        """One transition; an episode that ends continues from `reset`, a fresh `reset(key)` result."""
        with jax.numpy_dtype_promotion("standard"):  # gymnax (see above)
            obs, new_state, reward, terminated, _ = self._env.step_env(key, self._from_dict(state), action,
                                                                       self._params)
            truncated = self._env.is_truncated(new_state, self._params)
        terminated = jnp.asarray(terminated, bool)
        # A terminal step at the time limit counts as terminated: there is nothing to bootstrap from.
        truncated = jnp.asarray(truncated, bool) & ~terminated
        done = terminated | truncated
        final_obs = as_obs(obs)
        reset_obs, reset_state = reset
        next_state = jax.tree.map(lambda r, s: jnp.where(done, r, s), reset_state, self._to_dict(new_state))
        return EnvStep(obs=jnp.where(done, reset_obs, final_obs), state=next_state,
                       reward=jnp.asarray(reward, jnp.float32), terminated=terminated, truncated=truncated,
                       final_obs=final_obs)

    def _to_dict(self, state: Any) -> dict[str, jax.Array]:
        return {f.name: strong_array(getattr(state, f.name)) for f in dataclasses.fields(state)}

    def _from_dict(self, state: dict[str, jax.Array]) -> Any:
        return self._state_type(**state)

