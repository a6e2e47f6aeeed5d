"""Where a PPO update's time goes on the chip: systolic's rl chunk and PureJaxRL's ppo.py, traced side by side.

    bash benchmarks/harness/tpu.sh env python3 benchmarks/peers/rl_profile.py   # on the chip (tpu.sh installs the
                                  # wheels); writes $OUT/rl-systolic.xplane.pb and $OUT/rl-purejaxrl.xplane.pb
    python benchmarks/peers/rl_profile.py --summarize $OUT/rl-systolic.xplane.pb   # here: pip install xprof

Both sides run the rl-cartpole recipe with the `--set` overrides (rl_vs_purejaxrl.py, beside this file, reads
PureJaxRL's config from the same recipe) on one device. systolic: the engine's compiled chunk step
(`rl.updates_per_chunk` updates for every seed), three chunks timed after two warm-up ones, then one traced.
PureJaxRL: its whole `train` run for one chunk's worth of updates (jit(vmap(make_train)) over the seeds, as its
README runs it), timed after one warm-up run, then one traced. Each prints its time per update and env steps/s; the
summaries then say which HLO operations take the time (the chip runs a tiny environment's step as a chain of tiny
kernels: issue 43).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import rl_vs_purejaxrl  # sys.path[0]: benchmarks/peers/

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))
from tpu_profile import summarize, traced  # noqa: E402


def profile_systolic(overrides: list[str], out: Path) -> None:
    import jax

    from systolic.config import MeshConfig
    from systolic.runtime import mesh as mesh_lib
    from systolic.runtime.sharding import DEFAULT_RULES, activate
    from systolic.workloads.rl.train import build_task

    cfg = rl_vs_purejaxrl.recipe_config(overrides)
    mesh = mesh_lib.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    with activate(mesh, DEFAULT_RULES):
        task = build_task(cfg, mesh).task
        state = task.init_state()
        t = time.perf_counter()
        for _ in range(2):  # the first compiles
            state, metrics = task.train_step(state, None)
        jax.block_until_ready(metrics)
        print(f"systolic: compile and 2 chunks {time.perf_counter() - t:.1f} s")
        t = time.perf_counter()
        for _ in range(3):
            state, metrics = task.train_step(state, None)
        jax.block_until_ready(metrics)
        report("systolic", (time.perf_counter() - t) / 3, cfg)
        holder = [state]

        def one_chunk():
            holder[0], m = task.train_step(holder[0], None)
            return m

        traced("rl-systolic", one_chunk, out)


def profile_purejaxrl(overrides: list[str], out: Path) -> None:
    import jax

    cfg = rl_vs_purejaxrl.recipe_config(overrides)
    config = rl_vs_purejaxrl.purejaxrl_config(cfg)
    config["TOTAL_TIMESTEPS"] = cfg.rl.updates_per_chunk * cfg.rl.env_steps_per_update  # one chunk's updates
    rngs = jax.random.split(jax.random.PRNGKey(cfg.rl.seed), cfg.rl.num_seeds)
    train = jax.jit(jax.vmap(rl_vs_purejaxrl.make_train(config))).lower(rngs).compile()
    jax.block_until_ready(train(rngs))
    t = time.perf_counter()
    jax.block_until_ready(train(rngs))
    report("purejaxrl", time.perf_counter() - t, cfg)
    traced("rl-purejaxrl", lambda: train(rngs), out)


def report(side: str, chunk_s: float, cfg) -> None:
    run = cfg.rl
    update_ms = 1e3 * chunk_s / run.updates_per_chunk
    rate = run.num_seeds * run.env_steps_per_update * run.updates_per_chunk / chunk_s
    print(f"{side}: {update_ms:.2f} ms an update ({run.num_steps} rollout steps, {cfg.ppo.update_epochs} x "
          f"{cfg.ppo.num_minibatches} minibatches), {rate:,.0f} env steps/s ({run.num_seeds} seeds x "
          f"{run.num_envs} environments)")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="rl.* and ppo.* overrides")
    parser.add_argument("--side", choices=("both", "systolic", "purejaxrl"), default="both")
    parser.add_argument("--summarize", metavar="XPLANE", help="print the per-operation table of a traced profile")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    if args.summarize:
        return summarize(args.summarize, args.top)
    # PureJaxRL's vmapped orthogonal init (a batched QR) can deadlock XLA:CPU's pool on jax 0.10 (docs/debugging.md);
    # an XLA:CPU flag, which the chip ignores.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {rl_vs_purejaxrl.CPU_XLA_FLAGS}".strip()
    out = Path(os.environ.get("OUT") or "/tmp/rl-profile")
    out.mkdir(parents=True, exist_ok=True)
    if args.side in ("both", "systolic"):
        profile_systolic(args.set, out)
    if args.side in ("both", "purejaxrl"):
        profile_purejaxrl(args.set, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
