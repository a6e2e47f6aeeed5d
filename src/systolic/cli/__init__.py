"""`systolic` command line: build the parser from the declared commands (the engine's, cli/commands.py and
cli/plan.py, and each workload's, workloads/*/commands.py), prepare the process (runtime/startup.py), dispatch, and
turn user errors into one paragraph and exit code 2. The CLI is the top layer: nothing in the package imports it."""

from __future__ import annotations

import argparse
import errno
import os
import sys
import textwrap
import warnings

from systolic.errors import UserError
from systolic.runtime import interrupts, startup


def _parser() -> argparse.ArgumentParser:
    # Imported here, after main() installed the interrupt handlers: they read the recipes' config schemas.
    from systolic import workloads
    from systolic.cli import commands
    from systolic.commandline import add_commands

    parser = argparse.ArgumentParser(prog="systolic", description="Train, evaluate and sample JAX models, from one CPU to a pod.")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    add_commands(sub, commands.COMMANDS)
    for name in workloads.WORKLOADS:
        add_commands(sub, workloads.get(name).own_commands, workload=name)
    add_commands(sub, commands.TOOLS)
    return parser


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
    except Exception as e:
        # A signal that landed inside C code (an extension's import, an XLA callback) can surface as another
        # exception, e.g. "ImportError: Encountered an error while initializing the extension".
        if interrupts.received():
            return _interrupted(interrupts.received())
        from systolic.runtime import xla_env

        failure = xla_env.backend_failure(e)  # jax could not start the platform JAX_PLATFORMS names
        if failure is None:
            raise
        _show_traceback_if_debugging(args)
        _print_error(failure)
        return 2
    finally:
        interrupts.restore(previous_handlers)


def _parse(argv: list[str] | None):
    """Parses the command line and prepares the process (platform, XLA flags, compile cache) for it. Returns the
    arguments and the command to run."""
    warnings.formatwarning = lambda message, category, *rest, **kw: f"warning: {message}\n"
    parser = _parser()
    # Overrides may sit between options (`a=1 --recipe r b=2`); argparse leaves the later ones unrecognised.
    args, extra = parser.parse_known_args(argv)
    command = args.command
    if command.workload_options:  # the run directory and the workload's own options: parsed when it runs
        args.options, extra = extra, []
    stray = [item for item in extra if item.startswith("-") or not command.takes_overrides]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if command.takes_overrides:
        args.overrides += extra
    if command.platform is not None:
        command.platform(args)  # before anything initialises a jax backend
    # (A host without accelerators runs on the CPU from `import systolic` on: systolic/__init__.py.)
    # args.workload: the workload the command names or whose own command it is (None for info, data, launch),
    # known before JAX starts so its XLA:CPU flags apply.
    startup.prepare(workload=args.workload, stepping=command.stepping, compiles=command.compiles)
    return args, lambda: command.run(args)


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


if __name__ == "__main__":
    entry()
