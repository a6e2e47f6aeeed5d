"""`init.from=RUN_DIR`: a training run that starts from another lm run's parameters (fine-tuning).

The source run's model section and tokenizer define the model, so they replace the recipe's; only settings
that leave the parameters unchanged (`COMPUTE_ONLY`) and this run's own adapters (`model.lora`) may differ, and an
explicit `model.*` override that contradicts the source is an error. The parameters are restored straight onto
this run's shardings and the optimizer starts fresh. Once this run has a checkpoint it resumes from that (the loop
restores before it initialises), and its saved config stands in for the source, which may then be gone.

A LoRA run (model.lora.rank > 0) is the exception: its checkpoints keep only the adapters and their optimizer
state, so its base weights are read from init.from whenever it resumes or is opened (`run_params`), and the source
must stay. A LoRA run as the source of another run gives its base with the adapters merged in.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from systolic import config as config_lib
from systolic.data.tokenizer import run_tokenizer
from systolic.engine import finished, rundir
from systolic.engine.checkpoint import Checkpointer, has_checkpoints
from systolic.engine.state import TrainState
from systolic.errors import ConfigError, UserError
from systolic.runtime.sharding import Rules, activate
from systolic.workloads.lm.model import lora, quant
from systolic.workloads.lm.config import LMConfig
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model.transformer import Transformer

# Model settings that do not change the parameters (model.quant: quantization-aware fine-tuning of float weights).
COMPUTE_ONLY = ("dtype", "remat", "attention", "quant")
OWN = (*COMPUTE_ONLY, "lora")  # model settings of this run, not the source's: the adapters sit beside its weights


def with_source_model(cfg: LMConfig, overrides: list[str], run_dir: Path) -> LMConfig:
    """`cfg` with the model section and tokenizer of the run it starts from (unchanged without init.from).
    `overrides` are the command line's; a `model.*` one that contradicts the source is a ConfigError."""
    if not cfg.init.from_:
        return cfg
    if has_checkpoints(run_dir) and (Path(run_dir) / rundir.CONFIG_FILE).is_file():
        base = rundir.load_config(run_dir, lambda _: LMConfig)  # resuming: this run's own copy of the source's
        tokenizer = base.data.tokenizer
    else:
        base = source_config(Path(cfg.init.from_))
        tokenizer = run_tokenizer(Path(cfg.init.from_).absolute(), base.data.tokenizer)
    tree = config_lib.to_dict(cfg)
    tree["model"] = {**config_lib.to_dict(base.model), **{k: tree["model"][k] for k in OWN}}
    if not any(o.startswith("data.tokenizer=") for o in overrides):
        tree["data"]["tokenizer"] = tokenizer
    tree["data"]["seq_len"] = _fitted_seq_len(cfg, base.model.max_seq_len, overrides)
    resolved = config_lib.from_dict(LMConfig, tree)
    asked = config_lib.from_dict(LMConfig, config_lib.apply_overrides(tree, [o for o in overrides if o.startswith("model.")]))
    conflicts = _differences(asked.model, resolved.model)
    if conflicts:
        raise ConfigError(
            f"init.from={cfg.init.from_} fixes the model to that run's, but the command line asks for "
            f"{'; '.join(conflicts)}. The parameters only fit the source's shapes. Fix: drop those model.* overrides "
            f"(only {', '.join('model.' + k + ('.*' if k == 'lora' else '') for k in OWN)} may differ), or leave "
            "init.from out to train from scratch."
        )
    return resolved


def _fitted_seq_len(cfg: LMConfig, context: int, overrides: list[str]) -> int:
    """data.seq_len within the source model's context: a recipe's longer rows (SFT's and DPO's 1,024, GRPO's 512) are
    cut to it, with a warning that says so; a longer data.seq_len on the command line is a ConfigError (the model,
    and so its context, is the source's)."""
    seq_len = cfg.data.seq_len
    if seq_len <= context:
        return seq_len
    if any(o.startswith("data.seq_len=") for o in overrides):
        raise ConfigError(
            f"data.seq_len={seq_len} is longer than the context of the model init.from={cfg.init.from_} gives this "
            f"run (model.max_seq_len={context}), which the model cannot attend beyond; init.from fixes the model, so "
            f"its context cannot be raised here. Fix: data.seq_len={context} (or shorter), or leave data.seq_len "
            "out to use the model's context.")
    warnings.warn(f"data.seq_len set to {context}, the context of the model init.from={cfg.init.from_} gives this "
                  f"run (model.max_seq_len), instead of the recipe's {seq_len}, which the model cannot attend over. "
                  "Set data.seq_len on the command line for shorter rows.", stacklevel=2)
    return context


def source_config(source: Path) -> LMConfig:
    """The config of the run directory `source`, which must be an lm run."""
    if (source / "config.json").is_file() and not (source / rundir.CONFIG_FILE).is_file():
        raise UserError(
            f"init.from={source} is a Hugging Face model folder, not a systolic run directory. Fix: convert it first, "
            f"`systolic convert from-hf {source} runs/NAME`, then pass init.from=runs/NAME."
        )
    if not (source / rundir.CONFIG_FILE).is_file():
        raise UserError(f"init.from={source} is not a systolic run directory (it has no {rundir.CONFIG_FILE}). Fix: pass "
                        "the directory of an lm run or of `systolic convert from-hf`.")
    return finished.read_config(source, LMConfig, f"init.from={source}")


def load_params(source: Path, model: ModelConfig, abstract_params: Any) -> Any:
    """The newest intact checkpoint's parameters of the run `source` (a LoRA run's merged with its base), restored
    onto the shardings of `abstract_params` (ShapeDtypeStructs). Raises a UserError when they do not fit `model`."""
    src = source_config(source)
    conflicts = _differences(model, src.model)
    if conflicts:
        raise ConfigError(f"init.from={source}: this run's model differs from the source's ({'; '.join(conflicts)}). "
                          f"Fix: use the source's model settings (see {source / rundir.CONFIG_FILE}).")
    with finished.open_run(source, LMConfig, f"init.from={source}") as run:
        if run.meta().get(quant.META_KEY):
            raise UserError(f"init.from={source} holds weights quantized for inference (`systolic quantize` wrote "
                            "it); training needs the float weights. Fix: init.from the float run it was quantized "
                            "from (to train with quantized matmuls, set model.quant=int8).")
        rows = run.meta().get("vocab")
        want = abstract_params["embed"].shape[0]
        if rows is not None and rows != want:
            raise UserError(
                f"init.from={source} has {rows} embedding rows (its tokenizer's vocabulary, padded), this run {want}: "
                "the two runs use different tokenizers. Fix: leave data.tokenizer out so the source's is used."
            )
        return run_params(run, abstract_params)


def run_params(run: finished.FinishedRun, abstract_params: Any) -> Any:
    """The model parameters of the open lm run `run`, onto the shardings of `abstract_params` (the model's without
    adapters). A LoRA run's checkpoint holds only its adapters: its base comes from its own init.from, and the
    adapters are merged into it (W + alpha / r * A B), so what comes back is a plain model that computes the same."""
    mcfg = run.cfg.model
    if not mcfg.lora.rank:
        return run.restore_params(abstract_params)
    check_lora_base(mcfg, run.cfg.init.from_, f"{run.run_dir} is a LoRA run")
    base = load_params(Path(run.cfg.init.from_), lora.base_config(mcfg), abstract_params)
    vocab = abstract_params["embed"].shape[0]
    full = nnx.eval_shape(lambda: nnx.to_pure_dict(nnx.state(Transformer(mcfg, vocab, rngs=nnx.Rngs(0)), nnx.Param)))
    # The adapters are small: replicated over the parameters' devices, merged into each weight where it lives.
    first = jax.tree.leaves(abstract_params)[0].sharding
    whole = NamedSharding(first.mesh, P()) if isinstance(first, NamedSharding) else first
    adapters = run.restore_params(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole),
                                               lora.split(full)[0]))
    shardings = jax.tree.map(lambda a: a.sharding, abstract_params)
    merge = jax.jit(functools.partial(lora.merge, mcfg), out_shardings=shardings, donate_argnums=1)
    return merge(adapters, base)


def check_lora_base(model: ModelConfig, source: str, who: str) -> None:
    """A LoRA run's base weights are its init.from's: a UserError that says so when that is not a run directory."""
    if model.lora.rank and not (Path(source) / rundir.CONFIG_FILE).is_file():
        raise UserError(
            f"{who} (model.lora.rank={model.lora.rank}): its checkpoints keep only the adapters, and its base weights "
            f"are those of init.from={source or '(unset)'}, which is not a run directory (any more). Fix: put the run "
            "it was trained from back at that path, or give init.from the path where it is now (on the command line "
            f"to resume, in the run's {rundir.CONFIG_FILE} to open it)."
        )


def make_init_state(source: Path, model: ModelConfig, abstract_params: Any,
                    start: Callable[[Any, jax.Array], TrainState], key: jax.Array, shardings: TrainState, mesh: Mesh,
                    rules: Rules) -> Callable[[], TrainState]:
    """Task.init_state for a run that starts from `source`: its parameters, restored onto `abstract_params` (the
    base weights' with model.lora), made into the step-0 state (fresh optimizer) by `start(params, key)`."""
    # Donating the restored parameters lets the state reuse their memory instead of holding two copies.
    start = jax.jit(start, out_shardings=shardings, donate_argnums=0)

    def init_state() -> TrainState:
        check_lora_base(model, str(source), "This is a LoRA run")
        params = load_params(source, lora.base_config(model), abstract_params)
        with activate(mesh, rules):
            return start(params, key)

    return init_state


def check_not_imported(run_dir: Path) -> None:
    """A directory written by `systolic convert from-hf` holds parameters without optimizer state: training
    starts from it with init.from, never in it."""
    if not has_checkpoints(run_dir):
        return
    ckpt = Checkpointer(Path(run_dir) / "checkpoints", config_lib.CheckpointConfig())
    try:
        step = ckpt.latest_step()
        imported = step is not None and ckpt.restore_meta(step).get("params_only", False)
    finally:
        ckpt.close()
    if imported:
        raise UserError(
            f"{run_dir} holds imported parameters without optimizer state, so it cannot be trained in place. Fix: "
            f"start a new run from it, `systolic train lm init.from={run_dir} --run-dir runs/NEW`."
        )


def _differences(asked: ModelConfig, source: ModelConfig) -> list[str]:
    return [f"model.{f.name}={getattr(asked, f.name)!r} (source: {getattr(source, f.name)!r})"
            for f in dataclasses.fields(ModelConfig)
            if f.name not in OWN and getattr(asked, f.name) != getattr(source, f.name)]

