"""What an lm run's config takes from elsewhere before it is written to the run directory: the model and tokenizer of
`init.from` (init_from.py), the tokenizer a prepared dataset was made with, and, for a chat data set too small for
the recipe's batch, a batch that its examples fill. Each is taken only where the command line leaves the setting
unset, so what the user asks for stands (and is checked as before)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path

import jax

from systolic.data import prepared, sft
from systolic.data.tokenizer import make_tokenizer
from systolic.errors import UserError
from systolic.runtime import mesh as mesh_lib
from systolic.workloads.lm import init_from
from systolic.workloads.lm.config import LMConfig


def resolve_config(cfg: LMConfig, overrides: list[str], run_dir: Path) -> LMConfig:
    """`cfg` completed from init.from, the prepared data's tokenizer and the chat data's size (module docstring)."""
    cfg = init_from.with_source_model(cfg, overrides, run_dir)
    cfg = prepared_tokenizer(cfg, overrides)
    return fit_chat_batch(cfg, overrides)


def _set_on_command_line(key: str, overrides: list[str]) -> bool:
    return any(o.startswith(key + "=") for o in overrides)


def prepared_tokenizer(cfg: LMConfig, overrides: list[str]) -> LMConfig:
    """A prepared dataset records its tokenizer (a copy beside its shards, `systolic data prepare`): a run on it
    that names none (data.tokenizer at its default, byte) uses that one. init.from fixes the tokenizer instead."""
    if cfg.init.from_ or cfg.data.tokenizer != "byte" or _set_on_command_line("data.tokenizer", overrides):
        return cfg
    paths = [path for path, _ in cfg.data.mixture_sources] or [cfg.data.path]
    if not prepared.is_prepared(paths[0]):
        return cfg
    try:
        recorded = prepared.PreparedDataset.open(paths[0], verify=False).index["tokenizer"]
        spec = "byte" if recorded["sha256"] == "byte" else str(Path(paths[0]) / recorded["file"])
    except (UserError, KeyError, TypeError):
        return cfg  # a damaged index: reading the data reports it properly
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=spec))


def fit_chat_batch(cfg: LMConfig, overrides: list[str]) -> LMConfig:
    """Chat data (SFT) packs whole examples into rows of data.seq_len + 1 tokens, and a small data set (a few dozen
    conversations) fills fewer rows than the recipe's train.batch_size. Where the command line did not set the
    batch, it is lowered to the most rows that split over the data-parallel devices, with a warning that says so;
    where it did, or no batch fits, a UserError names the settings that would work for this data set."""
    if cfg.data.format != "chat" or cfg.objective != "next_token":
        return cfg
    data = sft.load_chat_corpus(cfg.data.path, make_tokenizer(cfg.data.tokenizer), seq_len=cfg.data.seq_len,
                                val_percent=cfg.data.val_percent)  # kept: the run reads it from there (sft.py)
    rows, batch = len(data.train), cfg.train.batch_size
    if rows >= batch:
        return cfg
    unit = _batch_unit(cfg)  # a batch must be a multiple of it
    fitted = rows // unit * unit
    if fitted and not _set_on_command_line("train.batch_size", overrides):
        passes = cfg.train.steps * fitted / rows
        warnings.warn(
            f"train.batch_size lowered from {batch} to {fitted}: the {data.examples[0]:,} training examples fill "
            f"{rows:,} rows of data.seq_len + 1 = {data.train.row_len} tokens, fewer than one batch of {batch}. "
            f"train.steps={cfg.train.steps} is then {passes:,.0f} passes over them: lower train.steps to train "
            "for fewer, or add examples.", stacklevel=2)
        return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=fitted))
    tokens_per_row = max(1, data.tokens[0] // max(batch, unit))
    seq_len = 2 ** max(4, int(math.log2(max(1, tokens_per_row - 1))))  # rows of seq_len + 1: a power of two below
    batch_fix = f"train.batch_size={fitted}, or " if fitted else ""
    raise UserError(
        f"The {data.examples[0]:,} training examples of data.path={cfg.data.path!r} fill {rows:,} rows of "
        f"data.seq_len + 1 = {data.train.row_len} tokens, fewer than one batch of train.batch_size={batch}. Fix: "
        f"{batch_fix}data.seq_len={seq_len} (shorter rows, more of them: {data.tokens[0]:,} tokens make about "
        f"{data.tokens[0] // (seq_len + 1):,}; longer examples are cut), or add examples."
    )


def _batch_unit(cfg: LMConfig) -> int:
    """The data-parallel devices times train.grad_accum: a batch is split over both (mesh.check_batch)."""
    try:
        shape = dict(zip(mesh_lib.AXES, mesh_lib.resolve_shape(cfg.mesh, jax.device_count())))
    except UserError:
        return cfg.train.grad_accum  # a mesh that does not fit: reported when the run builds it
    return math.prod(shape[a] for a in mesh_lib.BATCH_AXES) * cfg.train.grad_accum
