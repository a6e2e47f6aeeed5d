"""The engine's commands, declared in two tables: `COMMANDS` run a workload named on the command line (train,
fit, eval), `TOOLS` measure or plan one (bench; plan in cli/plan.py) or serve the engine (info, data, launch).
Each function here runs one command with its parsed arguments and returns the exit code; heavy modules are
imported inside, when it runs. The commands only one workload has are that workload's (workloads/*/commands.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from systolic import workloads
from systolic.commandline import Command, OptionParser, arg, run_arguments
from systolic.errors import UserError
from systolic.cli import plan as plan_command


def run_recipe(args: argparse.Namespace) -> int:
    """train, simulate, fit: a recipe plus overrides, run by the workload's function in a prepared run directory,
    as one transaction (engine/rundir.py)."""
    from systolic.engine import rundir
    from systolic.engine.debug import debug_mode
    from systolic.runtime import startup

    workload = workloads.get(args.workload)
    run = workload.command(args.command.name)  # before anything starts: an unsupported command is a user error
    overrides = startup.join_processes(args.overrides)
    # Its own default directory for fit: a fit's checkpoints hold a parameter, not the simulated fields that
    # `systolic simulate` of the same recipe keeps in runs/<recipe>.
    suffix = "-fit" if args.command.name == "fit" else ""
    cfg, run_dir, prepared = rundir.prepare_run(workload, args.recipe, overrides, args.run_dir, suffix)
    try:
        with debug_mode(checks=args.debug, jit=not args.no_jit):
            rundir.transaction(prepared, lambda: run(cfg, run_dir, quiet=args.quiet))
    finally:
        if prepared is not None:
            prepared.release()
    return 0


def evaluate(args: argparse.Namespace) -> int:
    if args.workload is None or args.workload.startswith("-"):
        if not {"-h", "--help"} & {args.workload, *args.options}:
            raise UserError("`systolic eval` needs a workload and a run directory, e.g. `systolic eval lm runs/lm-tiny "
                            "--data notes.txt` or `systolic eval rl runs/rl-cartpole`. Fix: add them; `systolic eval "
                            "lm -h` lists lm's options.")
        args.print_help()
        return 0
    workload = workloads.get(args.workload)
    run = workload.command("eval")
    options = vars(_workload_options(workload, "eval", args.options))
    print(run(options.pop("run_dir"), **options))
    return 0


def _workload_options(workload: workloads.Workload, command: str, argv: list[str]) -> argparse.Namespace:
    """RUN_DIR and the options `workload` declares for `command` (Workload.options), parsed from argv. An option it
    does not declare is an error that names the workloads whose command has it."""

    def make_parser(w: workloads.Workload) -> OptionParser:
        parser = OptionParser(prog=f"systolic {command} {w.name}")
        parser.add_argument("run_dir", type=Path, help="the run directory")
        for a in w.options.get(command, ()):
            parser.add_argument(*a.flags, **a.settings)
        return parser

    parser = make_parser(workload)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flag = unknown[0].split("=")[0]
        others = [workloads.get(name) for name in workloads.WORKLOADS if name != workload.name]
        owners = [w.name for w in others if command in w.options and flag in make_parser(w)._option_string_actions]
        where = f" (it is an option of `systolic {command} {owners[0]}`)" if owners else ""
        what = f"option {flag}{where}" if flag.startswith("-") else f"argument {flag!r}"
        raise UserError(f"`{parser.prog}` has no {what}. Usage: {parser.usage_line()}. Fix: leave out {flag}; "
                        f"`{parser.prog} -h` describes each option.")
    return args


def bench(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from systolic import config as config_lib
    from systolic.engine.bench import benchmark, format_table
    from systolic.runtime import startup

    workload = workloads.get(args.workload)
    build_task = workload.command("bench")
    if args.steps < 1:
        raise UserError(f"--steps {args.steps}: need at least 1 timed step.")
    cfg, recipe = config_lib.load(workload.config, args.recipe, startup.join_processes(args.overrides),
                                  workload.default_recipe, args.workload)
    with build_task(cfg) as task:
        result = benchmark(task, steps=args.steps)
    if args.json:
        print(json.dumps({"recipe": recipe, **dataclasses.asdict(result)}))
    else:
        print(f"systolic bench {args.workload} --recipe {recipe}\n{format_table(result)}")
    return 0


def info(args: argparse.Namespace) -> int:
    import jax

    from systolic.config import MeshConfig
    from systolic.runtime import mesh as mesh_lib

    devices = jax.devices()
    print(f"jax {jax.__version__}, platform {jax.default_backend()}")
    print(f"process {jax.process_index()} of {jax.process_count()}; {jax.local_device_count()} local / "
          f"{jax.device_count()} global devices: {devices[0].device_kind}")
    print(f"default mesh: {mesh_lib.describe(mesh_lib.make_mesh(MeshConfig()))}")
    return 0


def prepare_data(args: argparse.Namespace) -> int:
    from systolic.data.prepare import prepare

    print(prepare(args.src, args.out, tokenizer=args.tokenizer, field=args.field, val_percent=args.val_percent,
                  shard_tokens=args.shard_tokens, workers=args.workers))
    return 0


def arithmetic_data(args: argparse.Namespace) -> int:
    from systolic.data import arithmetic

    splits = arithmetic.make_splits(digits=args.digits, ops=arithmetic.parse_ops(args.ops), train=args.train,
                                    prompts=args.prompts, test=args.test, seed=args.seed,
                                    teacher_slips=args.teacher_slips)
    print(arithmetic.write(args.out, splits, force=args.force))
    return 0


def describe_data(args: argparse.Namespace) -> int:
    from systolic.data.prepared import PreparedDataset, is_prepared

    if not is_prepared(str(args.dir)):
        raise UserError(f"{args.dir} is not a prepared dataset (it has no index.json). Fix: point at a folder "
                        "written by `systolic data prepare SRC --out DIR`.")
    dataset = PreparedDataset.open(args.dir)
    print(f"{dataset.describe()}\n  checksums: all {sum(len(dataset.shards(s)) for s in ('train', 'validation'))} "
          "shard(s) match their SHA-256")
    return 0


def launch(args: argparse.Namespace) -> int:
    from systolic.runtime.launch import launch as launch_processes

    command = args.child[1:] if args.child[:1] == ["--"] else args.child
    if args.processes < 1 or not command:
        raise UserError("`systolic launch` needs --processes N (N >= 1) and a command after `--`, e.g. "
                        "`systolic launch --processes 2 -- train lm mesh.data=2`.")
    return launch_processes(command, args.processes, args.devices_per_process)


def _listed(command: str) -> str:
    return ", ".join(workloads.offering(command))


COMMANDS = (
    Command("train", help=f"train a workload ({_listed('train')})", run=run_recipe, stepping=True,
            description="Train a workload from a recipe plus key=value overrides.",
            args=(workloads.argument("train"), *run_arguments("train.steps=200 mesh.fsdp=2", "runs/<recipe>"))),
    Command("fit", help="fit a workload's parameters to observations (sim: the viscosity)", run=run_recipe,
            stepping=True,
            description="Solve a workload's inverse problem, e.g. `systolic fit sim --recipe sim-viscosity-inverse`.",
            args=(workloads.argument("fit"), *run_arguments("fit.steps=200 fit.noise=0.05", "runs/<recipe>-fit"))),
    # Each workload declares its own eval options (Workload.options): parsed after the workload, so -h is its too.
    Command("eval", help="evaluate a trained run directory (lm: likelihood of text or multiple choice; rl: every "
                         "seed's policy)", run=evaluate, workload_options=True,
            usage="systolic eval WORKLOAD RUN_DIR [options]",
            description="Evaluate a trained run, e.g. `systolic eval lm runs/lm-tiny --data notes.txt`, `systolic eval "
                        "lm runs/llama --choices items.jsonl` or `systolic eval rl runs/rl-cartpole --episodes 100 "
                        "--gymnasium`. Each workload has its own options: `systolic eval lm -h`, `systolic eval rl -h`.",
            args=(workloads.argument("eval", nargs="?"),)),
)

# Listed after the workloads' own commands in `systolic -h`.
TOOLS = (
    Command("bench", help="measure a workload's train step: step time, throughput, MFU, compile time", run=bench,
            stepping=True, description="Time the real train step of a recipe (warm-up excluded, median of N steps).",
            args=(workloads.argument("bench"), arg("overrides", nargs="*", metavar="KEY=VALUE"), arg("--recipe"),
                  arg("--steps", type=int, default=10, help="timed steps (default 10)"),
                  arg("--json", action="store_true", help="print one JSON object instead of a table"))),
    plan_command.COMMAND,
    Command("info", help="platform, devices, process count and the default mesh", run=info),
    Command("data", help="prepare a corpus into token shards that training memory-maps; describe one; write "
                         "arithmetic problems", subcommands=(
        Command("prepare", help="tokenize a corpus into token shards (then `systolic train lm data.path=DIR`)",
                run=prepare_data, compiles=False,
                description="Stream a corpus (text files, a folder, .jsonl(.gz), .parquet, a Hugging Face "
                            "save_to_disk folder), tokenize it on every core and write token shards plus an index to "
                            "DIR, atomically; an interrupted run resumes when run again, e.g. `systolic data prepare "
                            "corpus/ --out data/corpus --tokenizer tok.json`.",
                args=(arg("src", help="the corpus to prepare"),
                      arg("--out", type=Path, required=True, help="the folder to create"),
                      arg("--tokenizer", default="byte", help="'byte' (default) or a tokenizer.json"),
                      arg("--field", default="text", help="the text field of .jsonl/.parquet/.arrow records (default "
                          "text)"),
                      arg("--val-percent", type=float, default=5.0, help="share of documents held out (default 5)"),
                      arg("--shard-tokens", type=int, default=1 << 26, help="tokens per shard (default 2**26)"),
                      arg("--workers", type=int, default=0, help="tokenizer processes (default 0: one per core)"))),
        Command("arithmetic", help="write arithmetic problems with answers: SFT records, GRPO prompts, a held-out test",
                run=arithmetic_data, compiles=False,
                description="Draw distinct arithmetic problems (`What is 37+45?`) and write DIR/sft.jsonl (prompt/"
                            "completion records for `systolic train lm data.format=chat`), DIR/prompts.jsonl (prompt/"
                            "answer records for GRPO) and DIR/test.jsonl (held out from both), e.g. `systolic data "
                            "arithmetic --out data/arith --digits 2 --train 5000`.",
                args=(arg("--out", type=Path, required=True, help="the folder to write the three files to"),
                      arg("--digits", type=int, default=2, help="operands are below 10**digits (default 2)"),
                      arg("--ops", default="+,-", help="operators, comma-separated, from +, -, * (default +,-)"),
                      arg("--train", type=int, default=5000, help="SFT problems (default 5000)"),
                      arg("--prompts", type=int, default=1000, help="GRPO prompts (default 1000)"),
                      arg("--test", type=int, default=500, help="held-out test problems (default 500)"),
                      arg("--seed", type=int, default=0, help="the draw's seed (default 0)"),
                      arg("--teacher-slips", type=float, default=0.0, help="share of the SFT problems needing a carry "
                          "or borrow whose demonstrated answer forgets it (default 0: every answer true)"),
                      arg("--force", action="store_true", help="replace files already in DIR"))),
        Command("info", help="tokens, documents, shards, tokenizer of a prepared dataset; checks every shard's SHA-256",
                run=describe_data, compiles=False, args=(arg("dir", type=Path),)))),
    Command("launch", help="run N local processes of one multi-process run", run=launch, compiles=False,
            description="Start N processes on this machine joined by jax.distributed, e.g. `systolic launch "
                        "--processes 2 --devices-per-process 2 -- train lm`.",
            args=(arg("--processes", type=int, required=True),
                  arg("--devices-per-process", type=int, help="fake CPU devices per process (CPU testing)"),
                  arg("child", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the systolic command to run"))),
)
