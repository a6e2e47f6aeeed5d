"""`systolic` command line: parse, dispatch, and turn user errors into one paragraph and exit code 2."""

from __future__ import annotations

import argparse
import sys
import textwrap
import warnings
from pathlib import Path

from systolic.errors import UserError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="systolic", description="Train, evaluate and sample JAX models, from one CPU to a pod.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser("train", help="train a workload (lm)", description="Train a workload from a recipe plus key=value overrides.")
    train.add_argument("workload", help="which workload: lm")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.steps=200 mesh.fsdp=2")
    train.add_argument("--recipe", help="bundled recipe name or path to a YAML file (default: the workload's default)")
    train.add_argument("--run-dir", type=Path, help="where the run writes everything (default: runs/<recipe>)")
    train.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")

    gen = sub.add_parser("generate", help="sample text from a trained lm run directory")
    gen.add_argument("run_dir", type=Path)
    gen.add_argument("--prompt")
    gen.add_argument("--max-new-tokens", type=int)
    gen.add_argument("--temperature", type=float, help="0 = greedy")
    gen.add_argument("--top-k", type=int, help="0 = off")
    gen.add_argument("--top-p", type=float, help="1.0 = off")
    gen.add_argument("--seed", type=int)

    sub.add_parser("info", help="platform, devices, process count and the default mesh")
    return parser


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = lambda message, category, *rest, **kw: f"warning: {message}\n"
    parser = _parser()
    # Overrides may sit between options (`a=1 --recipe r b=2`); argparse leaves the later ones unrecognised.
    args, extra = parser.parse_known_args(argv)
    stray = [item for item in extra if item.startswith("-") or args.command != "train"]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if args.command == "train":
        args.overrides += extra
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "info":
            return _info()
    except UserError as e:
        print(textwrap.fill(f"error: {e}", width=110), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def _train(args: argparse.Namespace) -> int:
    from systolic import config as config_lib
    from systolic import workloads
    from systolic.engine import rundir

    workload = workloads.get(args.workload)
    cfg, recipe = config_lib.load(workload.Config, args.recipe, args.overrides, workload.DEFAULT_RECIPE)
    if cfg.workload != args.workload:
        raise UserError(f"Recipe '{recipe}' is for the '{cfg.workload}' workload, not '{args.workload}'. Fix: run "
                        f"`systolic train {cfg.workload} --recipe {recipe}` or pick a recipe for {args.workload}.")
    run_dir = args.run_dir or Path("runs") / recipe
    import jax

    if jax.process_index() == 0:
        rundir.prepare(run_dir, cfg)
    workload.train(cfg, run_dir, quiet=args.quiet)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from systolic import workloads

    print(workloads.get("lm").generate(args.run_dir, args.prompt, args.max_new_tokens, args.temperature,
                                       args.top_k, args.top_p, args.seed))
    return 0


def _info() -> int:
    import jax

    from systolic.config import MeshConfig
    from systolic.runtime import mesh as mesh_lib

    devices = jax.devices()
    print(f"jax {jax.__version__}, platform {jax.default_backend()}")
    print(f"process {jax.process_index()} of {jax.process_count()}; {jax.local_device_count()} local / "
          f"{jax.device_count()} global devices: {devices[0].device_kind}")
    print(f"default mesh: {mesh_lib.describe(mesh_lib.make_mesh(MeshConfig()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
