"""`systolic` command line: parse, dispatch, and turn user errors into one paragraph and exit code 2."""

from __future__ import annotations

import argparse
import errno
import os
import sys
import textwrap
import warnings
from pathlib import Path

from systolic.plan import command as cli_plan
from systolic.errors import UserError
from systolic.runtime import interrupts


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="systolic", description="Train, evaluate and sample JAX models, from one CPU to a pod.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser("train", help="train a workload (lm, gan, rl)", description="Train a workload from a recipe plus key=value overrides.")
    train.add_argument("workload", help="which workload: lm, gan or rl")
    _add_run_arguments(train, "train.steps=200 mesh.fsdp=2", "runs/<recipe>")

    simulate = sub.add_parser("simulate", help="run a simulation (sim workload; default recipe sim-turbulence)",
                              description="Run a PDE simulation from a recipe plus key=value overrides; pictures at the end.")
    _add_run_arguments(simulate, "grid.n=512 sim.t_end=2.0 mesh.data=8", "runs/<recipe>")

    fit = sub.add_parser("fit", help="fit a workload's parameters to observations (sim: the viscosity)",
                         description="Solve a workload's inverse problem, e.g. `systolic fit sim --recipe sim-viscosity-inverse`.")
    fit.add_argument("workload", help="which workload: sim")
    _add_run_arguments(fit, "fit.steps=200 fit.noise=0.05", "runs/<recipe>-fit")

    # Each workload declares its own eval options (Workload.options); _evaluate_run parses them, so -h is its too.
    ev = sub.add_parser("eval", add_help=False, usage="systolic eval WORKLOAD RUN_DIR [options]",
                        help="evaluate a trained run directory (lm: likelihood of text or multiple choice; rl: every "
                             "seed's policy)",
                        description="Evaluate a trained run, e.g. `systolic eval lm runs/lm-tiny --data notes.txt`, "
                                    "`systolic eval lm runs/llama --choices items.jsonl` or `systolic eval rl "
                                    "runs/rl-cartpole --episodes 100 --gymnasium`. Each workload has its own options: "
                                    "`systolic eval lm -h`, `systolic eval rl -h`.")
    ev.add_argument("workload", nargs="?", help="which workload: lm or rl")
    ev.set_defaults(print_eval_help=ev.print_help)

    gen = sub.add_parser("generate", help="sample text from a trained lm run directory")
    gen.add_argument("run_dir", type=Path)
    gen.add_argument("--prompt", help="the text to continue; with --chat, the user's message")
    gen.add_argument("--chat", action="store_true", help="render --prompt (and --system) with the run's chat template "
                     "and print only the assistant's reply")
    gen.add_argument("--system", help="with --chat: the system message before the user's")
    gen.add_argument("--max-new-tokens", type=int)
    gen.add_argument("--temperature", type=float, help="0 = greedy")
    gen.add_argument("--top-k", type=int, help="0 = off")
    gen.add_argument("--top-p", type=float, help="1.0 = off")
    gen.add_argument("--seed", type=int)

    export = sub.add_parser("export", help="write a trained lm as serialized StableHLO (jax.export) for deployment",
                            description="Export the forward pass and/or the KV-cache decode step of a run's latest "
                                        "checkpoint, e.g. `systolic export runs/lm-tiny --out model.jaxexport`; batch "
                                        "and length are symbolic. Loading needs only jax: see docs/debugging.md.")
    export.add_argument("run_dir", type=Path)
    export.add_argument("--out", type=Path, required=True, help="file to write, e.g. model.jaxexport (parameters "
                        "go beside it in model.params.npz, a description in model.json)")
    export.add_argument("--what", choices=("forward", "decode", "both"), default="forward",
                        help="forward: tokens -> logits (default); decode: tokens + KV cache -> logits + cache; both")
    export.add_argument("--platforms", help="comma-separated, of cpu, cuda, rocm, tpu (default: this machine's)")
    export.add_argument("--force", action="store_true", help="replace existing output files")

    tokenizer = sub.add_parser("tokenizer", help="train a BPE tokenizer for the lm workload (then data.tokenizer=FILE)")
    tokenizer_actions = tokenizer.add_subparsers(dest="tokenizer_action", required=True, metavar="ACTION")
    tok_train = tokenizer_actions.add_parser(
        "train", help="train a byte-level BPE on a corpus and write its tokenizer.json",
        description="Train a byte-level BPE on the training split of a corpus (data.* settings as for `systolic train "
                    "lm`; default: the Python standard library), e.g. `systolic tokenizer train --vocab-size 8192 "
                    "data.path=corpus/ --out tok.json`, then `systolic train lm data.tokenizer=tok.json`.")
    tok_train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. data.path=corpus/ data.max_bytes=5000000")
    tok_train.add_argument("--vocab-size", type=int, required=True, help="ids in the vocabulary, e.g. 8192")
    tok_train.add_argument("--out", type=Path, required=True, help="the tokenizer.json to write")
    tok_train.add_argument("--force", action="store_true", help="replace an existing --out file")

    convert = sub.add_parser("convert", help="convert lm weights from or to Hugging Face (Llama, GPT-2)",
                             description="Convert between Hugging Face folders (config.json + safetensors) and lm run "
                                         "directories, e.g. `systolic convert from-hf ./hf-llama runs/llama`, then "
                                         "`systolic train lm init.from=runs/llama data.path=notes/`.")
    directions = convert.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    from_hf = directions.add_parser("from-hf", help="a local Hugging Face folder -> a run directory (step-0 parameters)")
    from_hf.add_argument("src", type=Path, help="folder with config.json and *.safetensors (and tokenizer.json)")
    from_hf.add_argument("run_dir", type=Path, help="the run directory to create")
    from_hf.add_argument("--scan-layers", action="store_true", help="stack the layers (model.scan_layers=true)")
    to_hf = directions.add_parser("to-hf", help="a run directory's latest checkpoint -> a Hugging Face folder")
    to_hf.add_argument("run_dir", type=Path)
    to_hf.add_argument("out", type=Path, help="the folder to create (from_pretrained loads it)")
    to_hf.add_argument("--max-shard-size", default="5GB", help="split safetensors files above this size (default 5GB)")

    bench = sub.add_parser("bench", help="measure a workload's train step: step time, throughput, MFU, compile time",
                           description="Time the real train step of a recipe (warm-up excluded, median of N steps).")
    bench.add_argument("workload", help="which workload: lm")
    bench.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    bench.add_argument("--recipe")
    bench.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of a table")

    sample = sub.add_parser("sample", help="draw images from a trained gan run directory into a PNG grid",
                            description="e.g. `systolic sample gan runs/gan-digits --count 64 --out grid.png`.")
    sample.add_argument("workload", help="which workload: gan")
    sample.add_argument("run_dir", type=Path)
    sample.add_argument("--count", type=int, default=64, help="how many images (default 64)")
    sample.add_argument("--out", type=Path, help="PNG to write (default RUN_DIR/sample.png)")
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--force", action="store_true", help="replace an existing --out file")

    plan = sub.add_parser("plan", help="will a recipe fit a TPU slice or GPUs, how fast, at what cost? (no accelerator needed)",
                          description="Compile the real train step ahead of time for the target (TPU: with libtpu's "
                                      "compiler on compile-only devices; GPU: XLA:CPU on fake devices) and report "
                                      "per-chip memory, FLOPs, collectives, a roofline step time and the cost to train.")
    plan.add_argument("workload", help="which workload: lm, gan, rl, sim")
    plan.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    plan.add_argument("--recipe")
    plan.add_argument("--target", required=True, help="a Cloud TPU slice (v4-8, v5e-1 ... v5e-256, v5p-8 ..., v6e-1 ... "
                      "v6e-256; v4/v5p count TensorCores: v5p-128 is 64 chips) or a GPU (a100, h100, h200; x --mesh)")
    plan.add_argument("--mesh", default="", help="e.g. fsdp=64, data=2,fsdp=4,tensor=2, fsdp=2,expert=4, "
                      "fsdp=2,context=4 or data=2,stage=4 (unset axes are 1; default: the recipe's mesh over all the "
                      "target's chips)")
    plan.add_argument("--slices", type=int, default=1, help="TPU slices of --target joined by the data-center network, "
                      "data parallel across them (sets mesh.slices; --mesh's data axis then defaults to the rest)")
    plan.add_argument("--tokens", type=float, help="also the wall time, chip-hours and cost to train this many items "
                      "(tokens for lm), e.g. 20e9")
    plan.add_argument("--price-per-chip-hour", type=float, help="USD, instead of the table's on-demand list price")
    plan.add_argument("--search", action="store_true", help="lm: compile candidate per-chip batches (powers of 2, "
                      "bisected) x model.remat none/dots/full and report the largest batch that fits")
    plan.add_argument("--json", action="store_true", help="print one JSON object with every figure")

    sub.add_parser("info", help="platform, devices, process count and the default mesh")

    data = sub.add_parser("data", help="prepare a corpus into token shards that training memory-maps; describe one")
    data_actions = data.add_subparsers(dest="data_action", required=True, metavar="ACTION")
    prep = data_actions.add_parser(
        "prepare", help="tokenize a corpus into token shards (then `systolic train lm data.path=DIR`)",
        description="Stream a corpus (text files, a folder, .jsonl(.gz), .parquet, a Hugging Face save_to_disk "
                    "folder), tokenize it on every core and write token shards plus an index to DIR, atomically; "
                    "an interrupted run resumes when run again, e.g. `systolic data prepare corpus/ --out "
                    "data/corpus --tokenizer tok.json`.")
    prep.add_argument("src", help="the corpus to prepare")
    prep.add_argument("--out", type=Path, required=True, help="the folder to create")
    prep.add_argument("--tokenizer", default="byte", help="'byte' (default) or a tokenizer.json")
    prep.add_argument("--field", default="text", help="the text field of .jsonl/.parquet/.arrow records (default text)")
    prep.add_argument("--val-percent", type=float, default=5.0, help="share of documents held out (default 5)")
    prep.add_argument("--shard-tokens", type=int, default=1 << 26, help="tokens per shard (default 2**26)")
    prep.add_argument("--workers", type=int, default=0, help="tokenizer processes (default 0: one per core)")
    data_info = data_actions.add_parser("info", help="tokens, documents, shards, tokenizer of a prepared dataset; "
                                                     "checks every shard's SHA-256")
    data_info.add_argument("dir", type=Path)

    launch = sub.add_parser("launch", help="run N local processes of one multi-process run",
                            description="Start N processes on this machine joined by jax.distributed, e.g. "
                                        "`systolic launch --processes 2 --devices-per-process 2 -- train lm`.")
    launch.add_argument("--processes", type=int, required=True)
    launch.add_argument("--devices-per-process", type=int, help="fake CPU devices per process (CPU testing)")
    launch.add_argument("child", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the systolic command to run")
    return parser


def _add_run_arguments(parser: argparse.ArgumentParser, example: str, default_dir: str) -> None:
    """The arguments of every command that runs a recipe: overrides, --recipe, --run-dir, -q."""
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=f"config overrides, e.g. {example}")
    parser.add_argument("--recipe", help="bundled recipe name (`lm-sft`, or `sft` under `train lm`) or path to a YAML "
                        "file (default: the workload's default)")
    parser.add_argument("--run-dir", type=Path, help=f"where the run writes everything (default: {default_dir})")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    parser.add_argument("--debug", action="store_true", help="NaN/Inf checks, checkify on the train step (NaN, "
                        "out-of-bounds index, division by zero) and JAX's recompilation reasons; slower")
    parser.add_argument("--no-jit", action="store_true", help="run eagerly (jax.disable_jit) so print and pdb work "
                        "inside the step; much slower")


_RUN_COMMANDS = ("train", "simulate", "fit", "bench", "plan")  # the commands that take a recipe plus key=value overrides
_OVERRIDE_COMMANDS = (*_RUN_COMMANDS, "tokenizer")  # the commands that take key=value overrides


# Commands that run many steps of one compiled function: they get the host allocator setting (faster steps,
# slower compilation, more host memory; runtime/host_memory.py). Short commands are mostly compilation.
_STEPPING_COMMANDS = ("train", "bench", "fit", "simulate")


def main(argv: list[str] | None = None) -> int:
    """Runs one command; returns its exit code. Errors that are the user's or the machine's are one paragraph
    (the traceback too with SYSTOLIC_DEBUG=1); anything else is a bug and propagates."""
    previous_handlers = interrupts.install()  # first: Ctrl-C and SIGTERM unwind cleanly from here on
    args = None
    try:
        args, run = _parse(argv)
        return run()
    except UserError as e:
        _show_traceback_if_debugging(args)
        _print_error(str(e))
        return e.exit_code
    except MemoryError:
        _show_traceback_if_debugging(args)
        _print_error("out of host memory. Fix: lower train.batch_size or the model size, or use more devices.")
        return 2
    except KeyboardInterrupt as e:
        return _interrupted(e.name if isinstance(e, interrupts.Interrupted) else "SIGINT")
    except OSError as e:
        if interrupts.received():
            return _interrupted(interrupts.received())
        if e.errno not in _ENVIRONMENT_ERRNOS:
            raise
        _show_traceback_if_debugging(args)
        _print_error(f"{e}. This is the machine's state, not systolic's: free disk space, fix the permissions or "
                     "pick another path, then run the command again (an interrupted run resumes from its last "
                     "checkpoint).")
        return 2
    except Exception:
        # A signal that landed inside C code (an extension's import, an XLA callback) can surface as another
        # exception, e.g. "ImportError: Encountered an error while initializing the extension".
        if interrupts.received():
            return _interrupted(interrupts.received())
        raise
    finally:
        interrupts.restore(previous_handlers)


def _parse(argv: list[str] | None):
    """Parses the command line and prepares the process (platform, XLA flags, compile cache) for it. Returns the
    arguments and the command to run."""
    warnings.formatwarning = lambda message, category, *rest, **kw: f"warning: {message}\n"
    parser = _parser()
    # Overrides may sit between options (`a=1 --recipe r b=2`); argparse leaves the later ones unrecognised.
    args, extra = parser.parse_known_args(argv)
    if args.command == "eval":  # the run directory and the workload's own options: parsed in _evaluate_run
        args.options, extra = extra, []
    stray = [item for item in extra if item.startswith("-") or args.command not in _OVERRIDE_COMMANDS]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if args.command in _OVERRIDE_COMMANDS:
        args.overrides += extra
    if args.command == "plan":
        cli_plan.plan_devices(args)  # before anything initialises a jax backend
    else:
        _cpu_only_host()
    from systolic.runtime import cpu_tuning

    # Before anything creates jax's backend (XLA reads XLA_FLAGS once) or starts its thread pools (the allocator).
    cpu_tuning.apply_at_start(workload=_workload_of(args), stepping=args.command in _STEPPING_COMMANDS)
    if args.command not in ("launch", "tokenizer", "data"):  # none of them compiles anything
        from systolic.runtime import compile_cache

        compile_cache.enable()
    if args.command not in ("launch", "tokenizer", "data"):  # these need none of them (and start faster)
        _import_extensions()
    interrupts.arm()  # a signal recorded so far raises here; from now on at once
    return args, lambda: _HANDLERS[args.command](args)


def _import_extensions() -> None:
    """Imports the compiled extensions a command may load while signals are only recorded (runtime/interrupts.py:
    an interrupt inside an extension's import can crash the process later)."""
    import jax  # noqa: F401  (jaxlib's extensions)
    import numpy  # noqa: F401

    for name in ("orbax.checkpoint", "tensorstore", "grain", "flax.nnx", "optax"):
        try:
            __import__(name)
        except ImportError:
            pass  # an optional one that is missing is reported where it is needed


def _interrupted(name: str) -> int:
    print(f"interrupted ({name}): no run directory was changed, or its last checkpoint is there to resume from",
          file=sys.stderr)
    return interrupts.EXIT_CODES.get(name, 130)


# OS errors that come from the machine or the user's paths (full disk, permissions, a read-only or vanished
# file system), not from a bug: reported as one paragraph, as a UserError is.
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO, errno.EMFILE,
                       errno.ENFILE, errno.ENAMETOOLONG, errno.ELOOP, errno.EISDIR, errno.ENOTDIR, errno.ENOENT}


def entry() -> None:
    """The `systolic` console command. Unexpected exceptions are bugs: their traceback comes with a line that says
    so. After an interrupt the process ends without running interpreter teardown, where XLA's and Orbax's
    threads, stopped mid-work, could crash it (exit 139 instead of 130)."""
    try:
        code = main()
    except SystemExit:
        raise
    except BaseException:
        import traceback

        print("internal error: a bug in systolic, not in your input. Please report it with the command you ran and "
              "this traceback (SYSTOLIC_DEBUG=1 adds the tracebacks of user errors too):", file=sys.stderr)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code in interrupts.EXIT_CODES.values():
        os._exit(code)
    sys.exit(code)


def _print_error(message: str) -> None:
    # Paths and names stay whole (a hyphen is no place to break a path someone copies).
    print(textwrap.fill(f"error: {message}", width=110, break_on_hyphens=False, break_long_words=False),
          file=sys.stderr)


def _show_traceback_if_debugging(args: argparse.Namespace) -> None:
    """SYSTOLIC_DEBUG=1: the traceback of a user's error too (what a bug report needs). Not `--debug`: its checks
    end a run with a halt whose one paragraph names the operation, the report it exists to give."""
    if os.environ.get("SYSTOLIC_DEBUG", "") not in ("", "0"):
        import traceback

        traceback.print_exc()


# Commands that run one workload without naming it on the command line.
_IMPLIED_WORKLOAD = {"simulate": "sim", "generate": "lm", "export": "lm", "convert": "lm"}


def _workload_of(args: argparse.Namespace) -> str | None:
    """The workload a command runs, known before JAX starts (for its XLA:CPU flags); None for the commands that
    run none (info, data, tokenizer, launch: a launched process reads its own)."""
    return _IMPLIED_WORKLOAD.get(args.command, getattr(args, "workload", None))


def _run(args: argparse.Namespace) -> int:
    """train, simulate, fit: a recipe plus overrides, run by the workload's command in a prepared run directory."""
    # Its own default directory for fit: a fit's checkpoints hold a parameter, not the simulated fields that
    # `systolic simulate` of the same recipe keeps in runs/<recipe>.
    name = "sim" if args.command == "simulate" else args.workload
    workload, cfg, run_dir, prepared = _prepare_run(name, args.command, args, "-fit" if args.command == "fit" else "")
    run = workload.command(args.command)
    try:
        with _debug_mode(args):
            _transaction(prepared, lambda: run(cfg, run_dir, quiet=args.quiet))
    finally:
        if prepared is not None:
            prepared.release()
    return 0


def _transaction(prepared, run) -> None:
    """A command that fails, for whatever reason (bad input found while starting, Ctrl-C, a bug), leaves the run
    directory as it was: a new one is removed, an existing one gets back its config, metrics rows and entries.
    Once the command has written a checkpoint, what it wrote is the run's history and stays (a halt, a failed
    checkpoint write, or an interrupt then resumes from there)."""
    from systolic.errors import CheckpointWriteError, TrainingHalted

    try:
        run()
    except (TrainingHalted, CheckpointWriteError):
        raise  # what the run wrote up to its halt is the evidence the message points to
    except BaseException:
        if prepared is not None and not prepared.wrote_checkpoint():
            prepared.rollback()
        raise


def _prepare_run(name: str, command: str, args: argparse.Namespace, dir_suffix: str = ""):
    """Workload module, config (recipe + overrides) and prepared run directory for a run command."""
    from systolic import config as config_lib
    from systolic import workloads
    from systolic.engine import rundir

    workload = workloads.get(name)
    workload.command(command)  # before anything starts: an unsupported command is a user error
    overrides = _start_processes(args.overrides)
    # Check the recipe's workload before its keys: another workload's sections would read as misspellings.
    recipe_path = config_lib.recipe_path(args.recipe or workload.default_recipe, name)
    declared = config_lib.read_yaml(recipe_path).get("workload", name)
    if declared != name:
        raise UserError(f"Recipe '{recipe_path.stem}' is for the '{declared}' workload, not '{name}'. Fix: pick a "
                        f"recipe for {name}, or run the {declared} workload (e.g. `systolic train {declared} --recipe "
                        f"{recipe_path.stem}`).")
    cfg, recipe = config_lib.load(workload.config, args.recipe, overrides, workload.default_recipe, name)
    run_dir = args.run_dir or Path("runs") / f"{recipe}{dir_suffix}"
    if workload.resolve_config is not None:  # settings taken from elsewhere, e.g. lm's init.from=RUN_DIR
        cfg = workload.resolve_config(cfg, overrides, run_dir)
    import jax

    prepared = rundir.prepare(run_dir, cfg) if jax.process_index() == 0 else None
    return workload, cfg, run_dir, prepared


def _start_processes(overrides: list[str]) -> list[str]:
    """Joins the multi-process run, if any, from the `distributed.*` overrides (which differ per process and so
    are not part of the run's config); returns the other overrides."""
    from systolic import config as config_lib
    from systolic.config import DistributedConfig
    from systolic.runtime import distributed

    mine = [o for o in overrides if o.startswith("distributed.")]
    tree = config_lib.apply_overrides({}, mine).get("distributed", {})
    distributed.initialize(config_lib.from_dict(DistributedConfig, tree, "distributed."))
    return [o for o in overrides if not o.startswith("distributed.")]


def _bench(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from systolic import config as config_lib
    from systolic import workloads
    from systolic.engine.bench import benchmark, format_table

    workload = workloads.get(args.workload)
    build_task = workload.command("bench")
    if args.steps < 1:
        raise UserError(f"--steps {args.steps}: need at least 1 timed step.")
    cfg, recipe = config_lib.load(workload.config, args.recipe, _start_processes(args.overrides), workload.default_recipe,
                                  args.workload)
    with build_task(cfg) as task:
        result = benchmark(task, steps=args.steps)
    if args.json:
        print(json.dumps({"recipe": recipe, **dataclasses.asdict(result)}))
    else:
        print(f"systolic bench {args.workload} --recipe {recipe}\n{format_table(result)}")
    return 0


def _cpu_only_host() -> None:
    """On a host with no accelerator device files, JAX_PLATFORMS=cpu (unless the user set it): with libtpu
    installed, jax would otherwise probe for a TPU at start-up and print libtpu's warnings about not finding one."""
    import glob
    import os

    if "JAX_PLATFORMS" in os.environ:
        return
    tpu = glob.glob("/dev/accel*") or [p for p in glob.glob("/dev/vfio/*") if not p.endswith("/vfio")]
    gpu = glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/kfd")
    if not tpu and not gpu:
        os.environ["JAX_PLATFORMS"] = "cpu"


def _launch(args: argparse.Namespace) -> int:
    from systolic.runtime.launch import launch

    command = args.child[1:] if args.child[:1] == ["--"] else args.child
    if args.processes < 1 or not command:
        raise UserError("`systolic launch` needs --processes N (N >= 1) and a command after `--`, e.g. "
                        "`systolic launch --processes 2 -- train lm mesh.data=2`.")
    return launch(command, args.processes, args.devices_per_process)


def _evaluate_run(args: argparse.Namespace) -> int:
    from systolic import workloads

    if args.workload is None or args.workload.startswith("-"):
        if not {"-h", "--help"} & {args.workload, *args.options}:
            raise UserError("`systolic eval` needs a workload and a run directory, e.g. `systolic eval lm runs/lm-tiny "
                            "--data notes.txt` or `systolic eval rl runs/rl-cartpole`. Fix: add them; `systolic eval "
                            "lm -h` lists lm's options.")
        args.print_eval_help()
        return 0
    workload = workloads.get(args.workload)
    evaluate = workload.command("eval")
    options = vars(_workload_options(workload, "eval", args.options))
    print(evaluate(options.pop("run_dir"), **options))
    return 0


class _OptionParser(argparse.ArgumentParser):
    """A workload command's own options: a parse error is a UserError (one paragraph, exit 2), not argparse's exit."""

    def error(self, message: str):
        raise UserError(f"`{self.prog}`: {message}. Usage: {self.usage_line()}. Fix: correct the arguments; "
                        f"`{self.prog} -h` describes each.")

    def usage_line(self) -> str:
        return " ".join(self.format_usage().split()).removeprefix("usage: ")


def _workload_options(workload, command: str, argv: list[str]) -> argparse.Namespace:
    """RUN_DIR and the options `workload` declares for `command` (Workload.options), parsed from argv. An option it
    does not declare is an error that names the workloads whose command has it."""
    from systolic import workloads

    def make_parser(w) -> _OptionParser:
        parser = _OptionParser(prog=f"systolic {command} {w.name}")
        parser.add_argument("run_dir", type=Path, help="the run directory")
        w.options.get(command, lambda _: None)(parser)
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


def _debug_mode(args: argparse.Namespace):
    """--debug and --no-jit for the whole run (engine/debug.py)."""
    from systolic.engine.debug import debug_mode

    return debug_mode(checks=args.debug, jit=not args.no_jit)


def _export(args: argparse.Namespace) -> int:
    from systolic.workloads.lm.export import export_run

    platforms = [p.strip() for p in args.platforms.split(",")] if args.platforms else None
    paths = export_run(args.run_dir, args.out, what=args.what, platforms=platforms, force=args.force)
    print("wrote " + ", ".join(f"{p} ({p.stat().st_size / 1e6:.2f} MB)" for p in paths))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from systolic import workloads

    print(workloads.get("lm").command("generate")(args.run_dir, args.prompt, args.max_new_tokens, args.temperature,
                                                  args.top_k, args.top_p, args.seed, chat=args.chat,
                                                  system=args.system))
    return 0


def _train_tokenizer(args: argparse.Namespace) -> int:
    from systolic import config as config_lib
    from systolic.data.bpe import train_to_file
    from systolic.workloads.lm.config import LMConfig

    tree = config_lib.apply_overrides({}, args.overrides)
    read = ("data.path=", "data.max_bytes=", "data.val_percent=")  # what a tokenizer is trained from
    others = [item for item in args.overrides if not item.startswith(read)]
    if others:
        raise UserError(f"`systolic tokenizer train` reads only data.* settings (data.path, data.max_bytes, "
                        f"data.val_percent), but got {', '.join(others)}. Fix: drop those overrides, e.g. "
                        "`systolic tokenizer train --vocab-size 8192 data.path=corpus/ --out tok.json`.")
    data = config_lib.from_dict(LMConfig, tree).data
    print(train_to_file(data.path, max_bytes=data.max_bytes, val_percent=data.val_percent, vocab_size=args.vocab_size,
                        out=args.out, force=args.force))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from systolic.workloads.lm.hf import convert as hf

    if args.direction == "from-hf":
        cfg = hf.import_run(args.src, args.run_dir, scan_layers=args.scan_layers)
        print(f"converted {args.src} ({cfg.model.family}, {cfg.model.layers} layers, d_model {cfg.model.d_model}, "
              f"vocabulary {cfg.model.vocab_size}) into {args.run_dir}; fine-tune with `systolic train lm "
              f"init.from={args.run_dir} data.path=...`")
    else:
        files = hf.export_run(args.run_dir, args.out, max_shard_bytes=hf.parse_size(args.max_shard_size))
        print(f"wrote {args.out}: {', '.join(files)}")
    return 0


def _sample(args: argparse.Namespace) -> int:
    from systolic import workloads

    sample = workloads.get(args.workload).command("sample")
    print(sample(args.run_dir, count=args.count, out=args.out, seed=args.seed, force=args.force))
    return 0


def _data(args: argparse.Namespace) -> int:
    if args.data_action == "prepare":
        from systolic.data.prepare import prepare

        print(prepare(args.src, args.out, tokenizer=args.tokenizer, field=args.field, val_percent=args.val_percent,
                      shard_tokens=args.shard_tokens, workers=args.workers))
    else:
        from systolic.data.prepared import PreparedDataset, is_prepared

        if not is_prepared(str(args.dir)):
            raise UserError(f"{args.dir} is not a prepared dataset (it has no index.json). Fix: point at a folder "
                            "written by `systolic data prepare SRC --out DIR`.")
        dataset = PreparedDataset.open(args.dir)
        print(f"{dataset.describe()}\n  checksums: all {sum(len(dataset.shards(s)) for s in ('train', 'validation'))} "
              "shard(s) match their SHA-256")
    return 0


def _info(args: argparse.Namespace) -> int:
    import jax

    from systolic.config import MeshConfig
    from systolic.runtime import mesh as mesh_lib

    devices = jax.devices()
    print(f"jax {jax.__version__}, platform {jax.default_backend()}")
    print(f"process {jax.process_index()} of {jax.process_count()}; {jax.local_device_count()} local / "
          f"{jax.device_count()} global devices: {devices[0].device_kind}")
    print(f"default mesh: {mesh_lib.describe(mesh_lib.make_mesh(MeshConfig()))}")
    return 0


_HANDLERS = {"train": _run, "simulate": _run, "fit": _run, "eval": _evaluate_run, "export": _export,
             "generate": _generate, "convert": _convert, "tokenizer": _train_tokenizer, "sample": _sample,
             "info": _info, "data": _data, "bench": _bench, "plan": cli_plan.plan, "launch": _launch}


if __name__ == "__main__":
    entry()
