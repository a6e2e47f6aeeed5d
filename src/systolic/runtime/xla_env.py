"""The environment variables that JAX and XLA read when they start, checked before they can fail the process:
XLA_FLAGS (XLA aborts the whole process, natively, on a flag it does not know or a value it cannot parse) and
JAX_PLATFORMS (a platform this host or this installation does not have: a RuntimeError, or an AssertionError for a
GPU platform without its plugin, deep inside jax). Both become one paragraph, exit 2, before any run directory is
touched (`check_at_start`), or where the backend starts (`backend_failure`, for what only starting it can tell)."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys

from systolic.errors import UserError

# Flags whose names and values are known good (systolic's own XLA:CPU flags, fake CPU devices): no probe for them.
KNOWN_FLAGS = {
    "xla_force_host_platform_device_count": r"\d+",
    "xla_cpu_experimental_ynn_fusion_type": r"[a-z_,]*",
    "xla_cpu_experimental_xnn_fusion_type": r"[a-z_,]*",
}
_FLAG = re.compile(r"--?([A-Za-z0-9_]+)(?:=(.*))?")
# Creates XLA's CPU client, which parses XLA_FLAGS, in a process that may abort: jaxlib alone, no jax (~0.5 s).
_PROBE = "from jaxlib import _jax; _jax.get_tfrt_cpu_client(asynchronous=False)"
_LOG_LINE = re.compile(r"[EF]\d{4} .*\] ")
_GPU_PLATFORMS = {"cuda": ("cuda",), "rocm": ("rocm",), "gpu": ("cuda", "rocm")}


def check_at_start() -> None:
    """Raises UserError for an XLA_FLAGS that XLA would abort on, or a JAX_PLATFORMS naming a platform that is not
    installed. Call before anything creates jax's backend."""
    check_xla_flags(os.environ.get("XLA_FLAGS", ""))
    check_platforms(os.environ.get("JAX_PLATFORMS", ""))


def check_xla_flags(value: str) -> None:
    """Each flag must be `--name` or `--name=value`; a flag outside KNOWN_FLAGS (or a known one with a value of the
    wrong form) is tried in a subprocess once per process, unless jax's backend is already running (the flags
    were parsed then)."""
    unsure = False
    for flag in value.split():
        match = _FLAG.fullmatch(flag)
        if match is None:
            raise _bad_flags(value, f"{flag!r} is not of the form --name or --name=value")
        name, given = match.groups()
        unsure |= name not in KNOWN_FLAGS or not re.fullmatch(KNOWN_FLAGS[name], given or "")
    if unsure and not _backend_started():
        problem = _probe(value)
        if problem:
            raise _bad_flags(value, problem)


def check_platforms(value: str) -> None:
    """A GPU platform needs jax's plugin for it (without one jax fails with an AssertionError); TPU needs libtpu and
    a TPU's device files. Whether the device itself answers is known only when jax starts it (`backend_failure`)."""
    import importlib.util

    plugins = _jax_plugins()
    for platform in filter(None, (p.strip().lower() for p in value.split(","))):
        if platform in _GPU_PLATFORMS and not any(kind in name for kind in _GPU_PLATFORMS[platform] for name in plugins):
            missing = f"jax's {platform.upper() if platform != 'gpu' else 'GPU'} plugin is not installed"
        elif platform == "tpu" and importlib.util.find_spec("libtpu") is None:
            missing = "libtpu is not installed"
        elif platform == "tpu" and not tpu_device_files():  # else libtpu prints pages of warnings before it fails
            missing = "this host has no TPU (no /dev/accel* or /dev/vfio/* device)"
        else:
            continue
        raise UserError(f"JAX_PLATFORMS={value!r} asks for {platform}, but {missing}, so jax cannot start it. "
                        f"{_PLATFORMS_FIX}")


def tpu_device_files() -> list[str]:
    """A TPU VM's device files: /dev/accel* (v2 to v5e) or /dev/vfio/N (v5p, v6e)."""
    import glob

    return glob.glob("/dev/accel*") or [p for p in glob.glob("/dev/vfio/*") if not p.endswith("/vfio")]


def backend_failure(error: BaseException) -> str | None:
    """The paragraph for jax's failure to start the platform JAX_PLATFORMS names (a TPU platform on a host without
    a TPU), or None for any other error."""
    text = str(error)
    if not (isinstance(error, RuntimeError) and text.startswith("Unable to initialize backend")):
        return None
    first = text.split(" (set JAX_PLATFORMS=")[0]  # jax's own hint, which the fix below replaces
    return (f"JAX could not start its platform ({first}; JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}). "
            f"{_PLATFORMS_FIX}")


_PLATFORMS_FIX = ("Expected a platform this host has: cpu always; cuda with an NVIDIA GPU, its driver and jax[cuda12]; "
                  "tpu on a TPU VM with jax[tpu]. Fix: unset JAX_PLATFORMS (systolic picks cpu on a host without "
                  "accelerators), or name a platform this host has.")


def _jax_plugins() -> set[str]:
    """The PJRT plugins jax finds, as it finds them: the `jax_plugins` entry points (jax_cuda12_plugin's
    "xla_cuda12") and the modules of the `jax_plugins` namespace package (jax-cuda12-pjrt's)."""
    import pkgutil
    from importlib import metadata

    names = {entry.name for entry in metadata.entry_points(group="jax_plugins")}
    try:
        import jax_plugins
    except ImportError:
        return names
    return names | {module.name for module in pkgutil.iter_modules(jax_plugins.__path__)}


def _bad_flags(value: str, problem: str) -> UserError:
    return UserError(f"XLA_FLAGS={value!r} would stop XLA at start-up: {problem}. XLA ends the process on a flag it "
                     "does not know or a value it cannot read, so systolic checks them first. Expected flags of this "
                     "jaxlib's XLA, e.g. --xla_force_host_platform_device_count=8. Fix: correct or remove that flag "
                     "(`unset XLA_FLAGS` to start without any).")


def _backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


@functools.cache
def _probe(value: str) -> str | None:
    """What XLA says about XLA_FLAGS=`value` when it parses them, or None when it accepts them."""
    env = {**os.environ, "XLA_FLAGS": value}
    # Isolated (no current folder, no user site) but with this process's own import path: jaxlib may live in a
    # folder only PYTHONPATH names (the lent TPU machine's), which -I alone would hide.
    code = f"import sys; sys.path[:] = {sys.path!r}; {_PROBE}"
    result = subprocess.run([sys.executable, "-I", "-c", code], env=env, capture_output=True, text=True,
                            errors="replace", timeout=120)
    if result.returncode == 0:
        return None
    # XLA's log lines (E1206 01:01:51.55 6315 file.cc:63] message): its first error names the flag; the usage text
    # it prints after it lists every flag.
    logged = [line.split("] ", 1)[-1] for line in result.stderr.splitlines() if _LOG_LINE.match(line)]
    if not logged and "Traceback (most recent call last)" in result.stderr:
        return None  # Python failed before XLA read a flag: no verdict on them (jax itself reports what is wrong)
    said = (logged or [f"exit status {result.returncode}"])[0].strip()
    return f"XLA said {said!r}"
