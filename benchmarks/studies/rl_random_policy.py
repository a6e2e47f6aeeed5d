"""The return of a uniformly random policy in an rl environment: the baseline a trained policy is compared against.

    python benchmarks/studies/rl_random_policy.py brax/inverted_pendulum          # 8 seeds x 8 episodes, full length
    python benchmarks/studies/rl_random_policy.py Pendulum-v1 --seeds 4 --episodes 16

Actions are drawn uniformly from the action space at every step (a discrete action uniformly from the `n`), with
the environment's own time limit, through the same adapter as training and `systolic eval rl`.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from systolic.workloads.rl.config import EnvConfig
from systolic.workloads.rl.envs import make_env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("env", help="env.name, e.g. brax/inverted_pendulum")
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--episodes", type=int, default=8, help="per seed")
    args = parser.parse_args()
    env = make_env(EnvConfig(name=args.env))
    spec = env.spec
    low, high = jnp.asarray(spec.action_low), jnp.asarray(spec.action_high)

    def episodes(key: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(E,) returns and lengths of one seed's episodes, each counted until its first end."""
        reset_key, key = jax.random.split(key)
        obs, state = jax.vmap(env.reset)(jax.random.split(reset_key, args.episodes))

        def body(carry, key):
            obs, state, total, length, alive = carry
            action_key, step_key = jax.random.split(key)
            if spec.discrete:
                action = jax.random.randint(action_key, (args.episodes,), 0, spec.action_dim)
            else:
                action = jax.random.uniform(action_key, (args.episodes, spec.action_dim), minval=low, maxval=high)
            step = jax.vmap(env.step)(jax.random.split(step_key, args.episodes), state, action, (obs, state))
            total = total + jnp.where(alive, step.reward, 0.0)
            length = length + alive.astype(jnp.int32)
            alive = alive & ~(step.terminated | step.truncated)
            return (step.obs, step.state, total, length, alive), None

        init = (obs, state, jnp.zeros((args.episodes,)), jnp.zeros((args.episodes,), jnp.int32),
                jnp.ones((args.episodes,), bool))
        (_, _, total, length, _), _ = jax.lax.scan(body, init, jax.random.split(key, spec.max_episode_steps))
        return total, length

    returns, lengths = (np.asarray(x) for x in jax.jit(jax.vmap(episodes))(
        jax.random.split(jax.random.PRNGKey(0), args.seeds)))  # (S, E)
    per_seed = returns.mean(axis=1)
    print(f"{args.env}: uniformly random actions, {args.seeds} seeds x {args.episodes} episodes (time limit "
          f"{spec.max_episode_steps}): mean return {per_seed.mean():.2f} (per seed "
          f"{', '.join(f'{r:.1f}' for r in per_seed)}), mean length {lengths.mean():.1f}")


if __name__ == "__main__":
    main()
