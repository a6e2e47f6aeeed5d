"""`systolic plan`, declared (`COMMAND`: its arguments, its platform) and run: a workload's step compiled for a
target (TPU through libtpu's compile-only devices, GPU on fake CPU devices) without running it; `--search` bisects
the lm batch size for each rematerialisation policy."""

from __future__ import annotations

import argparse
import math

from systolic import workloads
from systolic.command import Command, arg
from systolic.errors import UserError

MAX_PLAN_DEVICES = 8192  # fake or compile-only devices a plan may ask for: start-up and compile time grow with them


def mesh_overrides(spec: str) -> list[str]:
    """--mesh as mesh.* overrides (unset axes 1); none when --mesh is empty."""
    if not spec:
        return []
    import dataclasses

    from systolic.config import MeshConfig  # not runtime/mesh.py: plan calls this before jax may be imported

    AXES = [f.name for f in dataclasses.fields(MeshConfig) if f.name != "slices"]
    sizes = {axis: 1 for axis in AXES}
    given: dict[str, str] = {}
    for item in filter(None, spec.split(",")):
        axis, _, size = item.partition("=")
        if axis not in sizes or not size.isdigit() or int(size) < 1:
            raise UserError(f"--mesh {spec!r}: expected comma-separated AXIS=SIZE with AXIS one of {', '.join(AXES)} "
                            "and SIZE a positive integer, e.g. --mesh fsdp=64 or --mesh data=2,fsdp=4.")
        if axis in given:
            raise UserError(f"--mesh {spec!r} sets the {axis} axis twice ({axis}={given[axis]} and {axis}={size}); a mesh "
                            f"has one size per axis. Fix: keep one, e.g. --mesh {axis}={size}.")
        given[axis] = size
        sizes[axis] = int(size)
    if math.prod(sizes.values()) > MAX_PLAN_DEVICES:
        raise UserError(f"--mesh {spec!r} asks for {math.prod(sizes.values()):,} devices; a plan compiles on one "
                        f"host for at most {MAX_PLAN_DEVICES:,} (the largest TPU slice, v5p-8192, has 4,096 chips). "
                        "Fix: plan one slice or node group, e.g. --mesh fsdp=256, and scale the step time by the "
                        "data-parallel factor.")
    return [f"mesh.{axis}={size}" for axis, size in sizes.items()]


def plan_devices(args: argparse.Namespace) -> None:
    """Before jax starts: plan never runs on this host's accelerators. A GPU target compiles on fake CPU devices,
    as many as --mesh asks for; a TPU target on libtpu's compile-only devices, beside one CPU device."""
    import os
    import re

    from systolic.plan.targets import CHIPS

    os.environ["JAX_PLATFORMS"] = "cpu"
    chip = CHIPS.get(args.target.strip().lower())
    if chip is None or chip.platform != "gpu":
        return
    try:
        count = math.prod(int(o.split("=")[1]) for o in mesh_overrides(args.mesh) or ["x=1"])
    except UserError:
        return  # reported properly in plan
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def plan(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    import jax

    from systolic import config as config_lib
    from systolic.plan import targets
    from systolic.plan.planner import format_plan, plan_step
    from systolic.runtime import mesh as mesh_lib

    workload = workloads.get(args.workload)
    plan_fn = workload.command("plan")
    mesh_args = mesh_overrides(args.mesh)
    target = targets.resolve(args.target, mesh_devices=jax.device_count(), slices=args.slices)
    if target.chips > MAX_PLAN_DEVICES:
        raise UserError(f"--target {args.target} --slices {args.slices} is {target.chips:,} chips; a plan compiles "
                        f"for at most {MAX_PLAN_DEVICES:,}. Fix: plan fewer slices (e.g. --slices 2): the data-parallel "
                        "step across slices scales from there.")
    if not mesh_args and target.chip.platform == "gpu":
        mesh_args = mesh_overrides("data=1")  # one GPU unless --mesh says more
    if args.slices > 1:
        if "data=" not in args.mesh:  # the data axis runs across the slices: it takes what --mesh leaves
            mesh_args = [o for o in mesh_args if not o.startswith("mesh.data=")] + ["mesh.data=-1"]
        mesh_args.append(f"mesh.slices={args.slices}")
    cfg, recipe = config_lib.load(workload.config, args.recipe, [*args.overrides, *mesh_args],
                                  workload.default_recipe, args.workload)
    if (args.tokens is not None and not 0 < args.tokens < math.inf
            or args.price_per_chip_hour is not None and not 0 <= args.price_per_chip_hour < math.inf):
        raise UserError(f"--tokens {args.tokens} / --price-per-chip-hour {args.price_per_chip_hour}: expected a "
                        "positive, finite number of items (e.g. --tokens 20e9) and a finite price >= 0 (e.g. 1.2).")
    shape = dict(zip(mesh_lib.AXES, mesh_lib.resolve_shape(cfg.mesh, target.chips)))
    mesh = " x ".join(f"{axis}={size}" for axis, size in shape.items()
                      if axis not in mesh_lib.OPTIONAL_AXES or size > 1) + (
        "" if args.mesh else " (the recipe's)")
    command = (f"systolic plan {args.workload} --recipe {recipe} --target {args.target}"
               + (f" --slices {args.slices}" if args.slices > 1 else "") + (f" --mesh {args.mesh}" if args.mesh else "")
               + "".join(f" {o}" for o in args.overrides))
    if args.search:
        return _search(args, workload, cfg, recipe, target, mesh,
                            math.prod(shape[a] for a in mesh_lib.BATCH_AXES), command)
    result = plan_step(args.workload, plan_fn, cfg, target, mesh=mesh, train_items=args.tokens,
                       price_per_chip_hour=args.price_per_chip_hour)
    if args.json:
        print(json.dumps({"recipe": recipe, **dataclasses.asdict(result)}))
    else:
        print(command)
        print(format_plan(result))
    return 0


def _search(args: argparse.Namespace, workload, cfg, recipe: str, target, mesh: str, data_parallel: int,
                 command: str) -> int:
    import dataclasses
    import json

    from systolic.plan import search as plan_search
    from systolic.plan.planner import format_plan

    if args.workload != "lm":
        raise UserError(f"--search varies train.batch_size and model.remat, which only the lm workload has; got "
                        f"'{args.workload}'. Fix: plan {args.workload} with a given config (leave out --search), or "
                        "e.g. systolic plan lm --recipe llama-1b --target v6e-32 --search.")

    def configure(cfg, remat: str, batch: int):
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=remat),
                                   train=dataclasses.replace(cfg.train, batch_size=batch))

    if not args.json:
        print(f"{command} --search: per-chip batches bisected for each model.remat (data.seq_len "
              f"{cfg.data.seq_len}, {data_parallel} data-parallel devices)")
        print(plan_search.HEADER)
    tried = plan_search.search(args.workload, workload.command("plan"), cfg, target, mesh=mesh,
                               data_parallel=data_parallel, grad_accum=cfg.train.grad_accum, configure=configure,
                               train_items=args.tokens, price_per_chip_hour=args.price_per_chip_hour,
                               say=(lambda _: None) if args.json else print)
    chosen = plan_search.best(tried)
    if args.json:
        print(json.dumps({"recipe": recipe, "candidates": [dataclasses.asdict(c) for c in tried],
                          "best": dataclasses.asdict(chosen) if chosen else None}))
    else:
        print(plan_search.format_search(tried, target.chip.hbm_bytes).splitlines()[-1])
        if chosen:
            print(f"its full plan (as `{command} model.remat={chosen.remat} train.batch_size={chosen.batch}`):")
            print(format_plan(chosen.plan))
    return 0


COMMAND = Command(
    "plan", help="will a recipe fit a TPU slice or GPUs, how fast, at what cost? (no accelerator needed)", run=plan,
    platform=plan_devices,
    description="Compile the real train step ahead of time for the target (TPU: with libtpu's compiler on "
                "compile-only devices; GPU: XLA:CPU on fake devices) and report per-chip memory, FLOPs, collectives, "
                "a roofline step time and the cost to train.",
    args=(workloads.argument("plan"),
          arg("overrides", nargs="*", metavar="KEY=VALUE"),
          arg("--recipe"),
          arg("--target", required=True, help="a Cloud TPU slice (v4-8, v5e-1 ... v5e-256, v5p-8 ..., v6e-1 ... "
              "v6e-256; v4/v5p count TensorCores: v5p-128 is 64 chips) or a GPU (a100, h100, h200; x --mesh)"),
          arg("--mesh", default="", help="e.g. fsdp=64, data=2,fsdp=4,tensor=2, fsdp=2,expert=4, fsdp=2,context=4 or "
              "data=2,stage=4 (unset axes are 1; default: the recipe's mesh over all the target's chips)"),
          arg("--slices", type=int, default=1, help="TPU slices of --target joined by the data-center network, data "
              "parallel across them (sets mesh.slices; --mesh's data axis then defaults to the rest)"),
          arg("--tokens", type=float, help="also the wall time, chip-hours and cost to train this many items (tokens "
              "for lm), e.g. 20e9"),
          arg("--price-per-chip-hour", type=float, help="USD, instead of the table's on-demand list price"),
          arg("--search", action="store_true", help="lm: compile candidate per-chip batches (powers of 2, bisected) "
              "x model.remat none/dots/full and report the largest batch that fits"),
          arg("--json", action="store_true", help="print one JSON object with every figure")))
