"""Config schema machinery: frozen dataclasses read from a recipe YAML plus dotted `key=value` overrides.

Each workload declares its config once as nested frozen dataclasses (common sections live here). Loading checks
every key against the schema, coerces and checks types, then calls each section's `validate()`, so a bad value
fails before any device work with an error that names the key, the value and what is allowed. A section typed
`Section | None` is optional: absent from a config (and from its config.yaml) unless given, for settings that
exist only with some choice (rl's `ppo` and `pqn` sections, one per `algo`).
"""

from __future__ import annotations

import dataclasses
import difflib
import keyword
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from systolic import safe_yaml
from systolic.errors import ConfigError

RECIPE_DIR = Path(__file__).parent / "recipes"


# COMMON SECTIONS ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh axes. -1 means "all remaining devices"; at most one axis may be -1."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    # Mixture-of-experts weights split over it (lm model.moe), with all-to-all dispatch; a data axis for the rest.
    # (After tensor here, for positional construction; in the mesh it sits between fsdp and tensor: runtime/mesh.py.)
    expert: int = 1
    # Each sequence split over it (lm: context parallelism, workloads/lm/parallel/context.py); attention exchanges keys/values.
    context: int = 1
    # Pipeline stages: the stacked layers split into consecutive groups, one per stage (lm with model.scan_layers;
    # lm/parallel/pipeline.py). In the mesh it sits after data: stages exchange activations point to point, rarely.
    stage: int = 1
    # TPU slices (or, off TPUs, processes) the devices span: the data axis is split across them, so only the
    # data-parallel gradient reduction crosses the data-center network (runtime/mesh.py).
    slices: int = 1

    def validate(self) -> None:
        if self.slices < 1:
            raise ConfigError(f"mesh.slices={self.slices}: expected the number of slices, at least 1. Fix: mesh.slices=1.")
        sizes = {"data": self.data, "fsdp": self.fsdp, "expert": self.expert, "context": self.context,
                 "tensor": self.tensor, "stage": self.stage}
        for name, size in sizes.items():
            if size == 0 or size < -1:
                raise ConfigError(
                    f"mesh.{name}={size} is not a valid axis size. Expected a positive integer, or -1 for "
                    f"'all remaining devices'. Fix: set mesh.{name}=1 (or -1)."
                )
        if list(sizes.values()).count(-1) > 1:
            raise ConfigError(
                f"mesh has more than one axis set to -1 ({sizes}); only one axis can take 'the rest of the "
                "devices'. Fix: give all but one axis an explicit size, e.g. mesh.data=-1 mesh.fsdp=2 mesh.tensor=1."
            )


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """Which parallelism the mesh axes mean: a named rule set from `systolic.runtime.sharding.RULE_SETS`."""

    rules: Literal["default", "dp", "fsdp", "tp"] = "default"


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-process settings. Not part of a run's saved config: they differ per process and per launch.

    Empty `coordinator` means: use the SYSTOLIC_* variables that `systolic launch` sets, else let
    `jax.distributed` detect the cluster (SLURM, Cloud TPU, Kubernetes, Open MPI) when `auto` is true, else run
    as a single process.
    """

    coordinator: str = ""  # host:port of process 0
    num_processes: int = 0
    process_id: int = -1
    auto: bool = True
    initialization_timeout_s: int = 300
    heartbeat_timeout_s: int = 60

    def validate(self) -> None:
        if self.coordinator and (self.num_processes <= 0 or not 0 <= self.process_id < self.num_processes):
            raise ConfigError(
                f"distributed.coordinator={self.coordinator} needs distributed.num_processes > 0 and "
                f"0 <= distributed.process_id < num_processes (got num_processes={self.num_processes}, "
                f"process_id={self.process_id}). Fix: pass all three on every process, e.g. "
                "distributed.num_processes=4 distributed.process_id=0 on the first host."
            )
        if self.coordinator and ":" not in self.coordinator:
            raise ConfigError(f"distributed.coordinator={self.coordinator!r} must be HOST:PORT, e.g. 10.0.0.1:1234.")


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """The engine loop's own settings, the same in every workload. Steps are the workload's loop steps: optimizer
    steps (lm, gan, `fit sim`), chunks of PPO updates (rl), frames (`simulate`)."""

    stop_at_step: int = 0  # > 0: checkpoint and stop at this step (a time-limited job); rerun to continue
    nonfinite: Literal["halt", "skip"] = "halt"  # what a non-finite loss, metric or parameter does (the update is discarded)
    max_skipped: int = 10  # with nonfinite=skip: halt after more than this many skipped steps in a row
    poison_step: int = 0  # testing aid: this step's input parameters are made NaN, to exercise the guard

    def validate(self) -> None:
        if self.max_skipped < 0 or self.poison_step < 0:
            raise ConfigError(f"loop.max_skipped={self.max_skipped} and loop.poison_step={self.poison_step} must be >= 0.")
        if self.stop_at_step < 0:
            raise ConfigError(f"loop.stop_at_step={self.stop_at_step} must be >= 0 (0 = run to the last step).")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Run length, evaluation cadence and batch of a workload trained on a dataset. `batch_size` is global (all
    devices, all processes) per optimizer step."""

    steps: int = 1000
    batch_size: int = 16
    eval_every: int = 200
    seed: int = 0

    def validate(self) -> None:
        check_positive(self, "train", ("steps", "batch_size", "eval_every"))
        check_seed("train.seed", self.seed)


@dataclasses.dataclass(frozen=True)
class AdamConfig:
    """Adam with global-norm clipping and a constant learning rate."""

    lr: float = 1e-3
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0

    def validate(self) -> None:
        check_positive(self, "optim", ("lr", "eps", "clip_norm"))
        check_in_range(self, "optim", ("b1", "b2"), 0.0, 1.0)


@dataclasses.dataclass(frozen=True)
class OptimConfig(AdamConfig):
    """AdamW with linear warmup, cosine decay to `lr * min_lr_ratio`, and global-norm clipping."""

    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1

    def validate(self) -> None:
        super().validate()
        check_in_range(self, "optim", ("min_lr_ratio",), 0.0, 1.0)
        if self.warmup_steps < 0 or self.weight_decay < 0:
            raise ConfigError(
                f"optim.warmup_steps={self.warmup_steps} and optim.weight_decay={self.weight_decay} must both be "
                ">= 0. Fix: use 0 to switch warmup or weight decay off."
            )


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints in `<run_dir>/checkpoints`; a run directory that holds one is resumed automatically."""

    every_steps: int = 500
    every_minutes: float = 0.0  # > 0: also checkpoint when this much time has passed since the last one
    keep: int = 2
    async_save: bool = True
    resume: bool = True

    def validate(self) -> None:
        check_positive(self, "checkpoint", ("every_steps", "keep"))
        if self.every_minutes < 0:
            raise ConfigError(f"checkpoint.every_minutes={self.every_minutes} must be >= 0 (0 = off).")


@dataclasses.dataclass(frozen=True)
class ObserveConfig:
    """Where progress and metrics go. `progress=auto` shows a bar only on an interactive terminal."""

    log_every: int = 10
    progress: Literal["auto", "on", "off"] = "auto"
    tensorboard: bool = True
    plot: bool = True
    profile_steps: str = ""  # "A-B": capture a JAX/XLA trace of steps A..B into <run_dir>/profile

    @property
    def profile_range(self) -> tuple[int, int] | None:
        if not self.profile_steps:
            return None
        first, _, last = self.profile_steps.partition("-")
        return int(first), int(last or first)

    def validate(self) -> None:
        check_positive(self, "observe", ("log_every",))
        try:
            rng = self.profile_range
        except ValueError:
            rng = (0, -1)
        if rng is not None and not 1 <= rng[0] <= rng[1]:
            raise ConfigError(
                f"observe.profile_steps={self.profile_steps!r} is not a step range. Expected 'A-B' with 1 <= A <= B "
                "(or a single step 'A'). Fix: e.g. observe.profile_steps=20-25."
            )


# VALIDATION HELPERS -------------------------------------------------------------------------------------------
# Every section's `validate()` uses these (the workloads' sections too), so a bad value reads the same everywhere.


def check_positive(section: Any, prefix: str, names: tuple[str, ...]) -> None:
    """A ConfigError for the first of `names` that is not greater than 0, suggesting the field's default."""
    for name in names:
        value = getattr(section, name)
        if value <= 0:
            default = field_default(section, name)
            kind = "integer" if isinstance(default, int) else "value"
            raise ConfigError(
                f"{prefix}.{name}={value} must be greater than 0. Fix: pass a positive {kind}, e.g. "
                f"{prefix}.{name}={default}."
            )


def check_in_range(section: Any, prefix: str, names: tuple[str, ...], low: float, high: float, why: str = "") -> None:
    """A ConfigError for the first of `names` outside [low, high] (`why`: what the bounds mean, if it helps),
    suggesting the field's default."""
    for name in names:
        value = getattr(section, name)
        if not low <= value <= high:
            raise ConfigError(
                f"{prefix}.{name}={value} is outside [{low:g}, {high:g}]{f'; {why}' if why else ''}. Fix: pass a "
                f"value in that range, e.g. {prefix}.{name}={field_default(section, name)}."
            )


MAX_SEED = 2**32 - 1


def check_seed(key: str, value: int) -> None:
    """A seed as every consumer takes it: jax.random.PRNGKey (int64, after the +1 offsets some keys add) and
    numpy's default_rng (no negatives)."""
    if not 0 <= value <= MAX_SEED:
        raise ConfigError(f"{key}={value} is not a usable seed. Expected an integer from 0 to 2**32 - 1 = {MAX_SEED} "
                          f"(random keys and numpy generators are seeded with it). Fix: e.g. {key}=0.")


def divisor_near(n: int, target: int) -> int:
    """The divisor of n closest to target: what an error message suggests instead of a value that does not divide."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - target))


def field_default(section: Any, name: str) -> Any:
    """The default of field `name` of a config section (a dataclass or its instance)."""
    return next(f.default for f in dataclasses.fields(section) if f.name == name)


# LOADING ------------------------------------------------------------------------------------------------------


def recipe_path(recipe: str, workload: str = "") -> Path:
    """A recipe name (`lm-tiny`) resolves to the bundled YAML, and under a workload a short name to that workload's
    recipe when no recipe has the name itself (`--recipe sft` under `train lm`: lm-sft); anything with a suffix or
    slash is a file path."""
    if recipe.endswith((".yaml", ".yml")) or "/" in recipe:
        path = Path(recipe).expanduser()
        if not path.is_file():
            raise ConfigError(f"Recipe file {path} does not exist. Fix: pass an existing YAML file or a recipe name ({', '.join(list_recipes())}).")
        return path
    path = RECIPE_DIR / f"{recipe}.yaml"
    if not path.is_file() and workload:
        path = RECIPE_DIR / f"{workload}-{recipe}.yaml"
    if not path.is_file():
        names = list_recipes()
        prefix = f"{workload}-" if workload else ""
        short = [n.removeprefix(prefix) for n in names if prefix and n.startswith(prefix)]  # `--recipe sft`
        close = difflib.get_close_matches(recipe, [*names, *short], n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        tried = f" (nor '{prefix}{recipe}')" if prefix else ""
        raise ConfigError(f"Unknown recipe '{recipe}'{tried}.{hint} Available recipes: {', '.join(names)}. Or pass a "
                          "path to a YAML file.")
    return path


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def read_yaml(path: Path) -> dict[str, Any]:
    """A recipe or a run's config.yaml as a mapping of sections (safe_yaml's limits: no duplicate keys, no aliases,
    bounded size and depth)."""
    data = safe_yaml.read_file(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} holds a {type(data).__name__}, not a mapping of config sections. Fix: write it as 'section:\\n  key: value'.")
    return data


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Returns a copy of `tree` with each `a.b.c=value` set; values are parsed as YAML scalars (`2`, `1e-3`, `true`)."""
    tree = _deep_copy(tree)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"Override '{item}' is not of the form section.key=value (e.g. train.steps=200). Fix the spelling.")
        try:
            value = safe_yaml.load_text(raw, f"override '{item}'") if raw.strip() else ""
        except safe_yaml.YamlSyntaxError:  # not YAML: the text itself (refused YAML, e.g. an alias, stays an error)
            value = raw
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"Override '{item}': '{part}' is a value, not a section, so it has no key '{parts[-1]}'. Fix: set {'.'.join(parts[:-1])}=VALUE instead.")
            node = child
        node[parts[-1]] = value
    return tree


def _deep_copy(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _deep_copy(v) for k, v in tree.items()}
    return tree


def from_dict(schema: type, tree: dict[str, Any], prefix: str = "") -> Any:
    """Builds a (nested) frozen dataclass from a plain mapping, checking keys, types and values."""
    if not isinstance(tree, dict):
        raise ConfigError(f"'{prefix[:-1]}' must be a section (a mapping of keys), got {tree!r}. Fix: write it as {prefix[:-1]}.KEY=VALUE.")
    hints = typing.get_type_hints(schema)
    fields = {config_key(f.name): f for f in dataclasses.fields(schema)}
    for key in tree:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" Did you mean '{prefix}{close[0]}'?" if close else ""
            raise ConfigError(
                f"Unknown config key '{prefix}{key}'.{hint} Valid keys{' in ' + prefix[:-1] if prefix else ''}: "
                f"{', '.join(fields)}."
            )
    kwargs = {}
    for key, f in fields.items():
        if key not in tree:
            continue
        kind = hints[f.name]
        value = tree[key]
        if (section := section_type(kind)) is not None:
            # `section:` with nothing under it: an optional section absent, a required one at its defaults.
            if value is None and section is not kind:
                kwargs[f.name] = None
            else:
                kwargs[f.name] = from_dict(section, {} if value is None else value, f"{prefix}{key}.")
        else:
            kwargs[f.name] = _coerce(value, kind, f"{prefix}{key}", f.default)
    obj = schema(**kwargs)
    if hasattr(obj, "validate"):
        obj.validate()
    return obj


def section_type(kind: Any) -> type | None:
    """The dataclass of a section field: `Section`, or `Section | None` for an optional section (one that exists
    only in some configs, e.g. the settings of the algorithm a run chose); None for a plain key."""
    if dataclasses.is_dataclass(kind):
        return kind
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        sections = [a for a in typing.get_args(kind) if dataclasses.is_dataclass(a)]
        return sections[0] if sections else None
    return None


MAX_INT = 2**63 - 1  # what numpy and XLA take as an int64; a larger Python int is an OverflowError there


def _shown(value: Any) -> str:
    """A value as an error message quotes it: an integer too long to read is named by its digit count."""
    if isinstance(value, int) and len(str(value)) > 24:
        return f"{'-' if value < 0 else ''}<a {len(str(abs(value)))}-digit number>"
    return repr(value)


def _example(default: Any, fallback: Any) -> Any:
    return default if isinstance(default, (int, float)) and not isinstance(default, bool) else fallback


def _coerce(value: Any, kind: Any, key: str, default: Any = None) -> Any:
    origin = typing.get_origin(kind)
    if origin is Literal:
        choices = typing.get_args(kind)
        if isinstance(value, bool):  # YAML 1.1 reads on/off/yes/no as booleans; the choice may be spelt so
            value = next((c for c in choices if str(c).lower() in (("on", "true", "yes") if value else ("off", "false", "no"))), value)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"{key}={value!r} is not allowed.{hint} Allowed values: {', '.join(map(str, choices))}.")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(kind)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, default)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} should be a list, e.g. {key}=[1,2]. Fix the value.")
        (elem, _ellipsis) = typing.get_args(kind)
        return tuple(_coerce(v, elem, key) for v in value)
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} should be true or false. Fix: {key}=true or {key}=false.")
    if kind is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            if not -MAX_INT <= value <= MAX_INT:
                raise ConfigError(
                    f"{key}={_shown(value)} is outside the range of a 64-bit integer, +-(2**63 - 1), which every "
                    "integer setting must fit (no count, size or step of a run comes near it). Fix: pass the value "
                    f"you meant, e.g. {key}={_example(default, 8)}."
                )
            return value
        raise ConfigError(f"{key}={value!r} should be an integer, got {type(value).__name__}. Fix: e.g. {key}=8.")
    if kind is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an integer past float's range, e.g. 10**400
                number = math.inf
        elif isinstance(value, str):
            try:
                number = float(value)  # YAML 1.1 reads `1e-3` as a string
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                # One check for every float setting: none gives nan or inf a meaning, and comparisons with nan are all
                # false, so a range check further on would let it through to the run (a NaN viscosity never ends).
                raise ConfigError(
                    f"{key}={_shown(value)} is not a finite number. Every float setting must be finite; nan and inf "
                    f"mean nothing here. Fix: pass a finite value, e.g. {key}={_example(default, 0.001)}."
                )
            return number
        raise ConfigError(f"{key}={value!r} should be a number, got {type(value).__name__}. Fix: e.g. {key}=0.001.")
    if kind is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}={value!r} should be a string. Fix: quote it, e.g. {key}='text'.")
    raise TypeError(f"config schema type {kind} for {key} is not supported")  # a schema bug, not user input


def to_dict(cfg: Any) -> dict[str, Any]:
    """The plain-data form of a config, as written to `<run_dir>/config.yaml`."""
    out = {}
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), config_key(f.name)
        if value is None and section_type(hints[f.name]) is not None:
            continue  # an optional section this config does not have: no key for it at all
        if dataclasses.is_dataclass(value):
            out[key] = to_dict(value)
        elif isinstance(value, tuple):
            out[key] = list(value)
        else:
            out[key] = value
    return out


def config_key(field_name: str) -> str:
    """A field's key in YAML and overrides. PEP 8 spells a field named after a Python keyword with a trailing
    underscore (`from_`); the config spells it without (`init.from=RUN_DIR`)."""
    return field_name[:-1] if field_name.endswith("_") and keyword.iskeyword(field_name[:-1]) else field_name


def load(schema: type, recipe: str | None, overrides: list[str], default_recipe: str,
         workload: str = "") -> tuple[Any, str]:
    """Reads a recipe (bundled name, short name under `workload`, or YAML path), applies overrides, validates.
    Returns (config, recipe name)."""
    path = recipe_path(recipe or default_recipe, workload)
    tree = read_yaml(path)
    tree = apply_overrides(tree, overrides)
    return from_dict(schema, tree), path.stem


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
