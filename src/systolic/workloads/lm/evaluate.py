"""`systolic eval lm RUN_DIR`: likelihood scoring of a trained lm, on text (`--data`) or multiple choice (`--choices`).

One jitted function scores every batch: for each row, the summed log-likelihood of its masked targets. Text is cut
into the non-overlapping windows of `data.seq_len` that training uses (`text.TokenWindows`), the remainder in one
padded, masked window, so every token is a target exactly once. A multiple-choice item scores each continuation by
the summed log-likelihood of its tokens after the context, tokenized as lm-evaluation-harness does; rows are padded
to a few bucket lengths (powers of two) so only a few shapes compile. Batches are split over the data axes of the
run's mesh and the parameters laid out by its sharding rules (`loaded_run.load_run(sharded=True)`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from systolic.data import corpus, text
from systolic.data.stream import place
from systolic.data.tokenizer import Tokenizer
from systolic.data.unicode_text import unicode_problem
from systolic.errors import UserError
from systolic.observe.progress import ProgressReporter
from systolic.runtime import memory
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import activate, logical_to_spec
from systolic.workloads.lm.loaded_run import LoadedRun, load_run

COMMAND = "systolic eval lm"
Batch = dict[str, np.ndarray]  # inputs, targets int32 (B, T); mask bool (B, T): which targets count


# SCORING ------------------------------------------------------------------------------------------------------


def make_score_step(run: LoadedRun) -> Callable[[Any, dict[str, jax.Array]], jax.Array]:
    """Jitted `(params, batch) -> (B,) float32`: each row's summed log-likelihood of its masked targets.

    The parameters keep the layout they were restored with; the batch is split over the data axes. The result is
    replicated, so every process can read it."""
    graphdef = run.graphdef

    def score_step(params, batch):
        logits = nnx.merge(graphdef, params)(batch["inputs"])  # (B, T, V) float32
        # The training loss's own cross-entropy, over every embedding row (the padded ones too), as training scores.
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])  # (B, T)
        return jnp.sum(jnp.where(batch["mask"], -nll, 0.0), axis=-1)  # (B,)

    params_sharding = jax.tree.map(lambda x: x.sharding, run.params)
    return jax.jit(score_step, in_shardings=(params_sharding, batch_sharding(run)),
                   out_shardings=NamedSharding(run.mesh, P()))


def token_logprobs(run: LoadedRun, ids: np.ndarray) -> np.ndarray:
    """float64 (P - 1,): the log-probability of each of ids[1:] after the ids before it, under the same softmax over
    every embedding row that `score_choices` sums (what a served model's `echo` with `logprobs` returns)."""
    ids = jnp.asarray(ids, jnp.int32)[None]  # (1, P)
    logits = nnx.merge(run.graphdef, run.params)(ids[:, :-1])  # (1, P - 1, V) float32
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:])  # (1, P - 1)
    return -np.asarray(nll[0], np.float64)


def batch_sharding(run: LoadedRun) -> NamedSharding:
    return NamedSharding(run.mesh, logical_to_spec(("batch", "seq"), run.rules))


def batch_rows(run: LoadedRun, requested: int) -> int:
    """Rows per batch: `requested` rounded up to a multiple of the data-parallel devices (padding rows are masked)."""
    dp = mesh_lib.data_parallel_size(run.mesh)
    return -(-requested // dp) * dp


def score_batches(run: LoadedRun, batches: Iterator[Batch], count: int, *, rows: int,
                  label: str) -> np.ndarray:
    """Every row's summed log-likelihood, float64 (count * rows,), with a progress bar over the `count` batches."""
    step = make_score_step(run)
    sharding = batch_sharding(run)
    lo, hi = mesh_lib.local_rows(sharding, rows)
    reporter = ProgressReporter(total=count, start=0, mode=run.cfg.observe.progress, description=label,
                                unit="batch", enabled=jax.process_index() == 0)
    every = 1 if sys.stderr.isatty() else max(1, count // 10)  # plain lines (piped output): about ten of them
    sums: list[np.ndarray] = []
    pending = None
    try:
        with activate(run.mesh, run.rules):
            for i, batch in enumerate(batches):
                # Each process places only the rows its devices hold.
                scores = step(run.params, place({k: v[lo:hi] for k, v in batch.items()}, sharding, rows))
                if pending is not None:  # fetched one batch late, so the host prepares the next while this runs
                    sums.append(np.asarray(pending, np.float64))
                pending = scores
                if i == 0:
                    reporter.restart_clock(1)  # the first batch compiled; the ETA counts from here
                if (i + 1) % every == 0 or i + 1 == count:
                    reporter.update(i + 1, {"rows x length": f"{rows} x {batch['inputs'].shape[1]}"})
            if pending is not None:
                sums.append(np.asarray(pending, np.float64))
    finally:
        reporter.close()
    return np.concatenate(sums) if sums else np.zeros(0)


def _padded(batch: Batch, rows: int) -> Batch:
    """A short last batch filled up to `rows` with masked rows."""
    missing = rows - len(batch["inputs"])
    return {k: np.pad(v, ((0, missing), (0, 0))) for k, v in batch.items()}


# TEXT ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TextScore:
    tokens: int  # targets scored
    bytes: int  # UTF-8 bytes of the documents' text
    nats: float  # summed negative log-likelihood

    @property
    def nats_per_token(self) -> float:
        return self.nats / self.tokens

    @property
    def nats_per_byte(self) -> float:
        return self.nats / self.bytes

    def metrics(self) -> dict[str, float | int]:
        return {"tokens": self.tokens, "bytes": self.bytes, "nats_per_token": self.nats_per_token,
                "nats_per_byte": self.nats_per_byte, "bits_per_byte": self.nats_per_byte / math.log(2),
                "perplexity": math.exp(self.nats_per_token)}


def text_ids(docs: Sequence[corpus.Document], tokenizer: Tokenizer) -> np.ndarray:
    """The documents as training reads them (each followed by the end-of-text id), after one end-of-text id: every
    document after the first starts after one in training, so the first document's first token is scored too."""
    eot = np.array([tokenizer.eot_id], tokenizer.dtype)
    return np.concatenate([eot, text.encode_documents(docs, tokenizer)])


def text_batches(ids: np.ndarray, seq_len: int, rows: int) -> tuple[Iterator[Batch], int]:
    """Batches of `rows` windows that make every id but the first a target exactly once: the non-overlapping windows
    of `text.TokenWindows` (seq_len + 1 ids, consecutive windows sharing one), then the rest in one window padded and
    masked, then masked rows to fill the last batch. Returns (the batches, how many)."""
    targets = len(ids) - 1
    windows = -(-targets // seq_len)
    count = -(-windows // rows)
    offsets = np.arange(seq_len + 1)

    def batches() -> Iterator[Batch]:
        padded = np.zeros(windows * seq_len + 1, np.int32)  # the pad id 0 only ever sits where the mask is off
        padded[: len(ids)] = ids
        for first in range(0, windows, rows):
            starts = np.arange(first, min(first + rows, windows)) * seq_len  # (b,)
            window = padded[starts[:, None] + offsets]  # (b, seq_len + 1)
            mask = starts[:, None] + offsets[1:] < len(ids)  # (b, seq_len): the target exists
            yield _padded({"inputs": window[:, :-1], "targets": window[:, 1:], "mask": mask}, rows)

    return batches(), count


def score_text(run: LoadedRun, docs: Sequence[corpus.Document], *, rows: int) -> TextScore:
    """The summed negative log-likelihood of the documents, read as `text_ids` says, in windows of data.seq_len."""
    ids = text_ids(docs, run.tokenizer)
    batches, count = text_batches(ids, run.cfg.data.seq_len, rows)
    sums = score_batches(run, batches, count, rows=rows, label="eval text")
    return TextScore(tokens=len(ids) - 1, bytes=sum(len(d.text.encode("utf-8")) for d in docs), nats=-float(sums.sum()))


def read_text(path: str) -> list[corpus.Document]:
    """The documents of a text file, a folder of them, a .jsonl (field text) or a .parquet, as data.path reads them."""
    if not Path(path).expanduser().exists():
        raise UserError(f"--data {path}: no such file or folder. Expected a text file, a folder of text files, a "
                        ".jsonl (field 'text') or a .parquet file (column 'text'). Fix: correct the path.")
    return corpus.read_documents(str(Path(path).expanduser()))


# MULTIPLE CHOICE ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Item:
    context: str
    choices: tuple[str, ...]
    label: int  # index of the right choice


def read_choices(path: Path) -> list[Item]:
    """The items of a JSONL file, one `{"context": str, "choices": [str, ...], "label": int}` a line (blank lines
    skipped); a UserError naming the line for anything else."""
    path = Path(path).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"--choices {path}: no such file. Expected a JSONL file with one item a line, "
                        '{"context": "...", "choices": ["...", "..."], "label": 0}. Fix: correct the path.') from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--choices {path}: cannot read it as UTF-8 text ({e}). Fix: pass a UTF-8 JSONL "
                        "file.") from None
    items = [_parse_item(path, number, line) for number, line in enumerate(lines, 1) if line.strip()]
    if not items:
        raise UserError(f"--choices {path} holds no items (every line is blank). Fix: write one JSON object a line, "
                        '{"context": "...", "choices": ["...", "..."], "label": 0}.')
    return items


def _parse_item(path: Path, number: int, line: str) -> Item:
    def bad(problem: str) -> UserError:
        return UserError(f"--choices {path}, line {number}: {problem}. Expected one JSON object a line, "
                         '{"context": "...", "choices": ["...", "..."], "label": 0}: a context string, two or more '
                         "non-empty continuations and the index of the right one. Fix: correct that line.")

    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise bad(f"not valid JSON ({e.msg} at column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # a 5,000-digit number, deep nesting
        raise bad(f"not readable JSON ({type(e).__name__})") from None
    if not isinstance(item, dict):
        raise bad(f"a JSON {type(item).__name__}, not an object")
    if "label" not in item and "gold" in item:
        raise bad('no "label" (it has "gold", lm-evaluation-harness\'s name: rename it to "label")')
    missing = [key for key in ("context", "choices", "label") if key not in item]
    if missing:
        raise bad(f"no {', '.join(repr(k) for k in missing)}")
    context, choices, label = item["context"], item["choices"], item["label"]
    if not isinstance(context, str):
        raise bad(f'"context" is a {type(context).__name__}, not a string')
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise bad(f'"choices" is {json.dumps(choices)[:80]}, not a list of two or more non-empty strings')
    problem = next(filter(None, map(unicode_problem, (context, *choices))), None)
    if problem:  # a JSON \ud800 escape without its pair
        raise bad(f"a string is not Unicode text ({problem})")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
        raise bad(f'"label" is {json.dumps(label)}, not an index into the {len(choices)} choices '
                  f'(0 to {len(choices) - 1})')
    return Item(context=context, choices=tuple(choices), label=label)


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[np.ndarray, np.ndarray]:
    """(context ids, continuation ids) as lm-evaluation-harness's `loglikelihood` makes them: whitespace at the end
    of the context moves to the front of the continuation; the continuation's ids are those of context +
    continuation after the context's own (a BPE merges across the boundary as it would in running text); an empty
    context is the end-of-text id. For the byte tokenizer this is the two encodings end to end."""
    eot = np.array([tokenizer.eot_id], np.int32)
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
        return eot, tokenizer.encode(continuation).astype(np.int32)
    context_ids = tokenizer.encode(context).astype(np.int32)
    whole = tokenizer.encode(context + continuation).astype(np.int32)
    return context_ids, whole[len(context_ids):]


def bucket_length(length: int, max_len: int) -> int:
    """The padded row length for a row of `length` inputs: the next power of two (at least 16), at most max_len."""
    return min(max(16, 1 << (length - 1).bit_length()), max_len)


@dataclasses.dataclass(frozen=True)
class Pair:
    ids: np.ndarray  # int32 (n,): context then continuation, left-truncated to max_len + 1
    scored: int  # the last `scored` ids (the continuation) are the targets


def make_pairs(items: Sequence[Item], tokenizer: Tokenizer, max_len: int, path: Path) -> list[Pair]:
    """Every (context, choice) of every item, in order, as rows of at most max_len inputs: the context is cut on the
    left (its oldest tokens go), the continuation kept whole."""
    pairs = []
    for number, item in enumerate(items, 1):
        for k, choice in enumerate(item.choices):
            context_ids, continuation_ids = encode_pair(tokenizer, item.context, choice)
            if not 0 < len(continuation_ids) <= max_len:
                raise UserError(
                    f"--choices {path}, item {number}: choice {k} is {len(continuation_ids)} tokens; a continuation is "
                    f"scored whole after at least one token of context, so it must be 1 to {max_len} tokens "
                    f"(model.max_seq_len={max_len}). Fix: shorten that choice.")
            ids = np.concatenate([context_ids, continuation_ids])[-(max_len + 1):]
            pairs.append(Pair(ids=ids, scored=len(continuation_ids)))
    return pairs


def pair_batches(pairs: Sequence[Pair], max_len: int, rows: int) -> tuple[list[tuple[np.ndarray, int]], int]:
    """The pairs grouped by bucket length into batches of `rows`. Returns ([(pair indices, bucket length)], count)."""
    by_bucket: dict[int, list[int]] = {}
    for index, pair in enumerate(pairs):
        by_bucket.setdefault(bucket_length(len(pair.ids) - 1, max_len), []).append(index)
    plan = [(np.array(indices[i : i + rows]), length) for length, indices in sorted(by_bucket.items())
            for i in range(0, len(indices), rows)]
    return plan, len(plan)


def pair_batch(pairs: Sequence[Pair], indices: np.ndarray, length: int, rows: int) -> Batch:
    """One batch: each pair's inputs (its ids but the last) and targets (its ids but the first), right-padded to
    `length`; the mask marks the continuation's targets. Causal attention keeps the padding out of the real rows."""
    inputs = np.zeros((len(indices), length), np.int32)
    targets = np.zeros((len(indices), length), np.int32)
    mask = np.zeros((len(indices), length), bool)
    for row, index in enumerate(indices):
        ids, n = pairs[index].ids, len(pairs[index].ids) - 1
        inputs[row, :n], targets[row, :n] = ids[:-1], ids[1:]
        mask[row, n - pairs[index].scored : n] = True
    return _padded({"inputs": inputs, "targets": targets, "mask": mask}, rows)


def score_choices(run: LoadedRun, items: Sequence[Item], *, rows: int,
                  path: Path = Path("choices")) -> list[np.ndarray]:
    """Each item's summed log-likelihoods, float64 (choices,), in the file's order; `path` names the file in errors."""
    max_len = run.cfg.model.max_seq_len
    pairs = make_pairs(items, run.tokenizer, max_len, path)
    plan, count = pair_batches(pairs, max_len, rows)
    sums = score_batches(run, (pair_batch(pairs, idx, length, rows) for idx, length in plan), count, rows=rows,
                         label="eval choices")
    flat = np.empty(len(pairs))
    for b, (indices, _) in enumerate(plan):
        flat[indices] = sums[b * rows : b * rows + len(indices)]
    ends = np.cumsum([len(item.choices) for item in items])
    return np.split(flat, ends[:-1])


def accuracies(items: Sequence[Item], loglikelihoods: Sequence[np.ndarray]) -> dict[str, float]:
    """acc: the highest summed log-likelihood picks the label; acc_norm: the highest per character of the
    continuation, as lm-evaluation-harness's acc_norm divides by `len(choice)`. Ties go to the first choice."""
    acc = [int(np.argmax(ll)) == item.label for item, ll in zip(items, loglikelihoods, strict=True)]
    norm = [int(np.argmax(ll / np.array([len(c) for c in item.choices], np.float64))) == item.label
            for item, ll in zip(items, loglikelihoods, strict=True)]
    return {"acc": float(np.mean(acc)), "acc_norm": float(np.mean(norm)), "correct": int(sum(acc)),
            "correct_norm": int(sum(norm))}


def check_batch_fits(run: LoadedRun, rows: int, length: int) -> None:
    """A UserError, before anything is traced, when one batch of `rows` x `length` tokens (the shortest this
    command will score) cannot fit: its float32 logits over the vocabulary and its residual stream, on the
    devices beside the parameters, and its inputs, targets and mask on the host."""
    model = run.cfg.model
    vocab = run.tokenizer.vocab_size
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(run.params))
    batch = rows * length * (4 * (vocab + model.d_model) + 4 + 4 + 1)
    memory.check_fits(params + batch, list(run.mesh.devices.flat),
                      what=(f"Scoring batches of {rows:,} rows of {length} tokens (float32 logits over {vocab:,} "
                            f"token ids and the {model.d_model}-wide residual stream per token, beside the parameters)"),
                      fix="a smaller --batch-size (leave it out for the run's micro-batch).")


# THE COMMAND --------------------------------------------------------------------------------------------------


def evaluate_run(run_dir: Path, *, data: str | None = None, choices: Path | None = None, batch_size: int | None = None,
                 devices: list[jax.Device] | None = None, quantize: str | None = None) -> str:
    """`systolic eval lm RUN_DIR --data FILE | --choices FILE.jsonl`: a short table, then the figures as one JSON
    object on the last line. `devices` (default: all) is for tests."""
    if (data is None) == (choices is None):
        raise UserError(f"`{COMMAND}` scores either text or multiple choice, so it takes exactly one of --data FILE "
                        f"and --choices FILE.jsonl, but got {'both' if data is not None else 'neither'}. Fix: e.g. "
                        f"`{COMMAND} {run_dir} --data notes.txt` or `{COMMAND} {run_dir} --choices items.jsonl`.")
    if batch_size is not None and batch_size < 1:
        raise UserError(f"--batch-size {batch_size} must be at least 1. Fix: e.g. --batch-size 8, or leave it out "
                        "for the run's micro-batch (train.batch_size / train.grad_accum).")
    # Bad input first, before the checkpoint is read and anything compiles.
    docs = read_text(data) if data is not None else None
    items = read_choices(choices) if choices is not None else None
    run = load_run(Path(run_dir), COMMAND, sharded=True, devices=devices, quantize=quantize)
    # Default: training's micro-batch, which its own evaluation uses and which fits in memory (forward only, less).
    rows = batch_rows(run, batch_size or run.cfg.train.batch_size // run.cfg.train.grad_accum)
    check_batch_fits(run, rows, run.cfg.data.seq_len if docs is not None else bucket_length(1, run.cfg.model.max_seq_len))
    weights = f"; {run.quantized} weights" if run.quantized else ""
    head = f"{COMMAND} {run_dir}: checkpoint step {run.step}{weights}; {run.layout}; batches of {rows} rows"
    if docs is not None:
        score = score_text(run, docs, rows=rows)
        figures = score.metrics()
        lines = [f"{head} of data.seq_len={run.cfg.data.seq_len} tokens",
                 f"text: {data} ({len(docs):,} document(s), {score.bytes:,} bytes)",
                 f"  tokens       {score.tokens:,}",
                 f"  loss         {figures['nats_per_token']:.4f} nats/token",
                 f"  nats/byte    {figures['nats_per_byte']:.4f}",
                 f"  bits/byte    {figures['bits_per_byte']:.4f}",
                 f"  perplexity   {figures['perplexity']:.4f} (per token)"]
    else:
        lls = score_choices(run, items, rows=rows, path=Path(choices))
        figures = {"items": len(items), "continuations": sum(len(i.choices) for i in items), **accuracies(items, lls)}
        lines = [head, f"multiple choice: {choices} ({figures['items']:,} items, {figures['continuations']:,} "
                       "continuations)",
                 f"  acc          {figures['acc']:.4f} ({figures['correct']}/{len(items)})",
                 f"  acc_norm     {figures['acc_norm']:.4f} ({figures['correct_norm']}/{len(items)}; per character "
                 "of the continuation)"]
    return "\n".join([*lines, json.dumps({"checkpoint_step": run.step, **figures})])
