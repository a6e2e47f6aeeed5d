"""`systolic plan`, declared (`COMMAND`: its arguments, its platform) and run: a workload's step compiled for a
target (TPU through libtpu's compile-only devices, GPU on fake CPU devices) without running it; `--search` bisects
the lm batch size for each rematerialisation policy."""

from __future__ import annotations

import argparse
import math

from systolic import workloads
from systolic.commandline import Command, arg
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
    _check_serve_options(args)
    if args.serve:
        return _serve(args, workload)
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
                       price_per_chip_hour=args.price_per_chip_hour, progress=_progress)
    if result.precheck and not args.json:  # nothing compiled, so no table: the lower bound's paragraph, exit 2
        raise UserError(result.out_of_memory)
    if args.json:
        print(json.dumps({"recipe": recipe, **dataclasses.asdict(result)}))
    else:
        print(command)
        print(format_plan(result))
    return 0


def _progress(line: str) -> None:
    """What the planner is compiling, on stderr: stdout keeps the report (or the one JSON object of --json)."""
    import sys

    print(line, file=sys.stderr, flush=True)


def _search(args: argparse.Namespace, workload, cfg, recipe: str, target, mesh: str, data_parallel: int,
                 command: str) -> int:
    import dataclasses
    import json

    from systolic.plan import search as plan_search
    from systolic.plan.planner import format_plan

    space = workload.plan_search
    if space is None:
        able = [name for name in workloads.WORKLOADS if workloads.get(name).plan_search is not None]
        raise UserError(f"--search varies train.batch_size and model.remat, which only the {' and '.join(able)} "
                        f"workload{'s have' if len(able) > 1 else ' has'}; got '{args.workload}'. Fix: plan "
                        f"{args.workload} with a given config (leave out --search), or e.g. systolic plan lm --recipe "
                        "llama-1b --target v6e-32 --search.")
    if not args.json:
        print(f"{command} --search: per-chip batches bisected for each model.remat (data.seq_len "
              f"{cfg.data.seq_len}, {data_parallel} data-parallel devices)")
        print(plan_search.HEADER)
    tried = plan_search.search(args.workload, workload.command("plan"), cfg, target, mesh=mesh,
                               data_parallel=data_parallel, grad_accum=cfg.train.grad_accum, remats=space.remats,
                               configure=space.configure,
                               train_items=args.tokens, price_per_chip_hour=args.price_per_chip_hour,
                               say=(lambda _: None) if args.json else print, progress=_progress)
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


SERVE_OPTIONS = ("weights", "kv", "context", "batch", "prefill_tokens")  # unset: None


def _check_serve_options(args: argparse.Namespace) -> None:
    """The serving options act with --serve only, and --tokens, --slices without it."""
    given = [f"--{k.replace('_', '-')}" for k in SERVE_OPTIONS if getattr(args, k) is not None]
    if not args.serve and given:
        raise UserError(f"{', '.join(given)} describe a serving plan, but --serve is not set. Fix: add --serve (e.g. "
                        f"systolic plan lm --serve --recipe llama-8b --target v5e-8), or leave them out.")
    if args.serve and (args.tokens is not None or args.slices > 1):
        raise UserError("--tokens and --slices describe a training plan; a serving plan (--serve) plans one slice "
                        "and prices output tokens. Fix: leave them out, or plan training without --serve.")


def _serve(args: argparse.Namespace, workload) -> int:
    """`systolic plan WORKLOAD --serve`: the inference engine's steps compiled for one replica of the target."""
    import dataclasses
    import json

    import jax

    from systolic import config as config_lib
    from systolic.plan import serving as serve_plan
    from systolic.plan import targets
    from systolic.plan.planner import devices_for, for_target

    plan_fn = workload.command("plan_serve")
    target = targets.resolve(args.target, mesh_devices=jax.device_count())
    cfg, recipe = config_lib.load(workload.config, args.recipe, args.overrides, workload.default_recipe,
                                  args.workload)
    tensor = _serve_tensor(args.mesh, target.chips, cfg.model)
    # `is not None`, not truth: a 0 given is refused, not read as "unset".
    context = (_positive("--context", args.context) if args.context is not None
               else min(DEFAULT_CONTEXT, cfg.model.max_seq_len))
    if context > cfg.model.max_seq_len:
        raise UserError(f"--context {context}: the model attends over at most model.max_seq_len="
                        f"{cfg.model.max_seq_len} positions. Fix: --context {cfg.model.max_seq_len} or less, or raise "
                        f"model.max_seq_len (e.g. model.max_seq_len={context}).")
    prefill = (_positive("--prefill-tokens", args.prefill_tokens) if args.prefill_tokens is not None
               else min(DEFAULT_PREFILL_TOKENS, context))
    if prefill > context:
        raise UserError(f"--prefill-tokens {prefill}: a prefill chunk is part of one prompt, at most --context "
                        f"{context} tokens. Fix: --prefill-tokens {context} or less.")
    batch = _positive("--batch", args.batch) if args.batch is not None else None
    if batch is not None and batch > serve_plan.MAX_BATCH:
        raise UserError(f"--batch {batch}: a decode step holds at most {serve_plan.MAX_BATCH:,} sequences (the "
                        f"engine's --max-seqs; its page tables and token ids are int32 arrays). Fix: --batch "
                        f"{serve_plan.MAX_BATCH} or less, or leave it out to plan as many as fit.")
    if args.price_per_chip_hour is not None and not 0 <= args.price_per_chip_hour < math.inf:
        raise UserError(f"--price-per-chip-hour {args.price_per_chip_hour}: expected a finite price >= 0, e.g. 1.2.")
    formats = [(w, k) for w in _formats("--weights", args.weights) for k in _formats("--kv", args.kv)]
    command = (f"systolic plan {args.workload} --serve --recipe {recipe} --target {args.target}"
               + (f" --mesh {args.mesh}" if args.mesh else "") + "".join(f" {o}" for o in args.overrides))
    say = (lambda _: None) if args.json else (lambda line: print(line, flush=True))
    say(f"{command}: {len(formats)} formats, tensor={tensor} ({target.chips // tensor} replica"
        f"{'s' if target.chips // tensor > 1 else ''}), context {context}")
    with for_target(target):
        devices = devices_for(target)[:tensor]
        report = serve_plan.plan_serving(
            lambda w, k: plan_fn(cfg, devices, weights=w, kv=k), target, formats=formats,
            context=context, prefill_tokens=prefill, tensor=tensor, batch=batch, search=args.search,
            price_per_chip_hour=args.price_per_chip_hour, say=say)
    if args.json:
        print(json.dumps({"recipe": recipe, **dataclasses.asdict(report)}))
    else:
        print(serve_plan.format_report(report))
    return 0


DEFAULT_CONTEXT = 2048
DEFAULT_PREFILL_TOKENS = 256  # `systolic serve`'s --max-tokens-per-step


def _positive(flag: str, value: int) -> int:
    if value < 1:
        raise UserError(f"{flag} {value}: expected a positive number of tokens or sequences. Fix: e.g. {flag} 256.")
    return value


def _listed(spec: str) -> list[str]:
    return [item.strip() for item in spec.split(",") if item.strip()]


def _formats(flag: str, spec: str | None) -> list[str]:
    """The formats of --weights or --kv: both of bf16 and int8 when not given; given, at least one."""
    if spec is None:
        return ["bf16", "int8"]
    listed = _listed(spec)
    if not listed:
        raise UserError(f"{flag} {spec!r} names no format. Expected formats separated by commas, e.g. {flag} "
                        f"bf16,int8. Fix: name at least one, or leave {flag} out to plan bf16 and int8.")
    return listed


def _serve_tensor(spec: str, chips: int, model) -> int:
    """The chips one replica spans: --mesh tensor=K (the rest of the slice holds replicas), by default the most chips
    of the slice that the heads and MLP columns split over evenly."""
    sizes = {o.split("=")[0].removeprefix("mesh."): int(o.split("=")[1]) for o in mesh_overrides(spec)}
    if any(size > 1 for axis, size in sizes.items() if axis not in ("tensor", "data")):
        raise UserError(f"--mesh {spec} with --serve: a serving plan splits the model over the tensor axis only (data: "
                        "replicas). Fix: e.g. --mesh tensor=4.")
    if spec:
        tensor = sizes["tensor"]
        if chips % tensor:
            raise UserError(f"--mesh {spec}: {tensor} chips a replica do not divide the target's {chips}. Fix: "
                            f"--mesh tensor=K with K dividing {chips}.")
        return tensor
    return max(k for k in range(1, chips + 1) if chips % k == 0 and model.heads % k == 0 and model.d_mlp % k == 0)


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
              "data=2,stage=4 (unset axes are 1; default: the recipe's mesh over all the target's chips); --serve: "
              "tensor=K, the chips one replica spans"),
          arg("--slices", type=int, default=1, help="TPU slices of --target joined by the data-center network, data "
              "parallel across them (sets mesh.slices; --mesh's data axis then defaults to the rest)"),
          arg("--tokens", type=float, help="also the wall time, chip-hours and cost to train this many items (tokens "
              "for lm), e.g. 20e9"),
          arg("--price-per-chip-hour", type=float, help="USD, instead of the table's on-demand list price"),
          arg("--search", action="store_true", help="lm: compile candidate per-chip batches (powers of 2, bisected) "
              "x model.remat none/dots/full and report the largest batch that fits; with --serve: the largest decode "
              "batch that fits"),
          arg("--serve", action="store_true", help="lm: plan serving instead of training: the inference engine's "
              "decode and prefill steps, sequences that fit, output tokens/s and price per million tokens"),
          arg("--weights", help="--serve: weight formats, comma-separated from bf16, int8 (weight-only), w8a8 "
              "(default bf16,int8)"),
          arg("--kv", help="--serve: KV-cache formats, from bf16 and int8 (serve's --kv-cache int8) "
              "(default bf16,int8)"),
          arg("--context", type=int, help=f"--serve: tokens a sequence holds (default {DEFAULT_CONTEXT}, at most "
              "model.max_seq_len)"),
          arg("--batch", type=int, help="--serve: plan this many sequences decoding together (default: as many as "
              "the weights leave room for in HBM)"),
          arg("--prefill-tokens", type=int, help=f"--serve: prompt tokens per prefill step (default "
              f"{DEFAULT_PREFILL_TOKENS}, serve's --max-tokens-per-step, at most --context)"),
          arg("--json", action="store_true", help="print one JSON object with every figure")))
