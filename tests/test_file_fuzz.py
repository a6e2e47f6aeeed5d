"""Property: every file systolic reads, however damaged, is either read or refused with a UserError, never another
exception, and reading never changes it.

Real files are mutated with a seeded RNG (byte flips, truncation, deletions, inserted tokens, duplicated lines, and
on the parsed structure: type swaps, deleted keys, huge and non-finite numbers, deep nesting, shared nodes that
YAML writes as aliases) and fed in-process to the reader the CLI uses for them: bundled recipes and a run
directory's config.yaml (config.read_yaml + from_dict), a Hugging Face config.json (hf_config.read_config +
model_config), safetensors files and their index (hf.Folder, every tensor read), a checkpoint step's manifest
(Checkpointer.verify) and metrics.jsonl (read_metrics and the resume's row parsing); and a prepared dataset's
index.json and unigram tables (PreparedDataset.open + unigram), a gan run's cached classifier (read_classifier)
and the arrays of a checkpoint step whose manifest is gone (restore_params: refused, or finite values). Run with
`pytest -s` to see the summary line.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import struct
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from systolic import config as config_lib
from systolic import workloads
from systolic.config import CheckpointConfig
from systolic.data import prepare, prepared
from systolic.engine import checkpoint, loop, rundir
from systolic.engine.state import TrainState
from systolic.errors import UserError
from systolic.observe import metrics
from systolic.workloads.lm.hf import convert as hf
from systolic.workloads.gan import evaluate as gan_evaluate
from systolic.workloads.lm.hf import config as hf_config

SEED = 20261204
CASES = {"recipe": 100, "run config.yaml": 60, "hf config.json": 90, "safetensors": 70, "safetensors index": 25,
         "checkpoint manifest": 40, "metrics.jsonl": 50, "prepared index.json": 60, "unigram table": 40,
         "gan classifier": 40, "checkpoint without manifest": 25}
DEEP = "__DEEP__"  # replaced by 5,000 nested brackets after serialising (json/yaml writers would recurse)


# MUTATIONS ----------------------------------------------------------------------------------------------------


def mutate_bytes(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """One byte-level damage of `data`."""
    op = rng.choice(["flip", "truncate", "delete", "insert", "duplicate line", "zero"])
    if not data:
        return rng.choice([b"", b"\x00", b"{", b"["]), "from empty"
    at = rng.randrange(len(data))
    if op == "flip":
        out = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        return bytes(out), op
    if op == "truncate":
        return data[:at], f"{op} at {at}"
    if op == "delete":
        return data[:at] + data[at + rng.randint(1, 64):], f"{op} at {at}"
    if op == "insert":
        token = rng.choice([b"\x00", b"\xff\xfe", b"NaN", b"1e999", b"-1", b"99999999999999999999999", b"&a ", b"*a",
                            b"<<: ", b"[" * 3000, b"{" * 3000, b'"', b"\n  - x\n", b": :", b"\t", b"\xe9"])
        return data[:at] + token + data[at:], f"{op} {token[:8]!r} at {at}"
    if op == "duplicate line":
        lines = data.splitlines(keepends=True)
        i = rng.randrange(len(lines))
        return b"".join(lines[: i + 1] + [lines[i]] + lines[i + 1:]), f"{op} {i}"
    return data[:at] + b"\x00" * min(16, len(data) - at) + data[at + 16:], f"{op} at {at}"


def odd_value(rng: random.Random, shared: list) -> Any:
    return rng.choice([None, True, False, "", "text", "12", [], {}, [1, 2], {"a": 1}, 0, -1, 1.5, 10**30, -(10**30),
                       2**64, float("nan"), float("inf"), -float("inf"), 1e-320, DEEP, "x" * 10_000, shared])


def mutate_tree(tree: Any, rng: random.Random) -> tuple[Any, str]:
    """One structural change of a parsed JSON/YAML tree (in place where possible; returns the new root)."""
    shared = [1, 2, 3]  # inserted twice, YAML writes it with an anchor and an alias
    nodes = [((), tree)]
    for path, node in nodes:  # every node, breadth first
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
        nodes.extend(((*path, k), v) for k, v in children)
    path, _ = rng.choice(nodes)
    if not path:
        return odd_value(rng, shared), "root replaced"
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    op = rng.choice(["swap", "swap", "delete", "share", "rename"])
    if op == "delete":
        del parent[key]
    elif op == "share":
        parent[key] = shared
        if isinstance(parent, dict):
            parent[f"{key}_twin"] = shared
    elif op == "rename" and isinstance(parent, dict):
        parent[rng.choice(["", "x" * 300, "1", "null"])] = parent.pop(key)
    else:
        parent[key] = odd_value(rng, shared)
    return tree, f"{op} at {'.'.join(map(str, path))}"


def deepen(text: str) -> str:
    return text.replace(f"'{DEEP}'", "[" * 5000 + "]" * 5000).replace(f'"{DEEP}"', "[" * 5000 + "]" * 5000).replace(
        DEEP, "[" * 5000 + "]" * 5000)


def mutate_json(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    if rng.random() < 0.4:
        return mutate_bytes(data, rng)
    tree, what = mutate_tree(json.loads(data), rng)
    return deepen(json.dumps(tree, allow_nan=True)).encode(), what


def mutate_yaml(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    if rng.random() < 0.4:
        return mutate_bytes(data, rng)
    tree, what = mutate_tree(yaml.safe_load(data), rng)
    return deepen(yaml.safe_dump(tree, sort_keys=False, width=10**6)).encode(), what


def mutate_jsonl(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    if rng.random() < 0.5:
        return mutate_bytes(data, rng)
    lines = data.splitlines(keepends=True)
    i = rng.randrange(len(lines))
    tree, what = mutate_tree(json.loads(lines[i]), rng)
    lines[i] = deepen(json.dumps(tree, allow_nan=True)).encode() + b"\n"
    return b"".join(lines), f"line {i}: {what}"


def mutate_safetensors(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """Damage to the 8-byte length or the JSON header (the tensors' bytes matter only through the offsets)."""
    (length,) = struct.unpack("<Q", data[:8])
    header, rest = data[8:8 + length], data[8 + length:]
    choice = rng.random()
    if choice < 0.2:
        new_length = rng.choice([0, 1, length - 1, length + 1, len(data), 2**32, 2**63, 2**64 - 1])
        return struct.pack("<Q", new_length) + header + rest, f"length {new_length}"
    if choice < 0.35:
        return data[: rng.randrange(len(data))], "truncated"
    if choice < 0.55:
        damaged, what = mutate_bytes(header, rng)
    else:
        tree = json.loads(header)
        name = rng.choice([k for k in tree if k != "__metadata__"])
        field = rng.choice(["dtype", "shape", "data_offsets", None])
        if field is None:
            tree, what = mutate_tree(tree, rng)
        else:
            tree[name][field] = rng.choice([odd_value(rng, []), "I8", "F8_E4M3", "BOOL", [0, 2**40], [2**62, 0], [-1, 4],
                                            [10**6], [3, 3]])
            what = f"{name}.{field} = {str(tree[name][field])[:40]}"
        damaged = deepen(json.dumps(tree)).encode()
    keep_length = rng.random() < 0.7  # usually a consistent length field, so the header itself gets parsed
    return struct.pack("<Q", len(damaged) if keep_length else length) + damaged + rest, what


# READERS: what the CLI calls for each file ----------------------------------------------------------------------


def read_recipe(path: Path) -> None:
    tree = config_lib.read_yaml(path)
    config_lib.from_dict(workloads.config_class(tree.get("workload", "lm")), tree)


def read_run_config(path: Path) -> None:
    rundir.load_config(path.parent, workloads.config_class)


def read_hf_config(path: Path) -> None:
    hf_config.model_config(hf_config.read_config(path.parent), path.parent)


def read_safetensors(path: Path) -> None:
    folder = hf.Folder(path.parent)
    for name in folder.where:
        folder.read(name)


def reader_verify(checkpointer: checkpoint.Checkpointer) -> Callable[[Path], None]:
    def read(path: Path) -> None:
        problem = checkpointer.verify(int(path.parent.name))
        assert problem is None or isinstance(problem, str)
    return read


def read_metrics(path: Path) -> None:
    rows = metrics.read_metrics(path.parent)
    for row in rows:
        assert isinstance(row["step"], int) and isinstance(row["split"], str)
        loop._numbers(row)
    [r for r in rows if r.get("step", 0) <= 5]  # noqa: B018 (what truncate_after compares)


def read_prepared(path: Path) -> None:
    dataset = prepared.PreparedDataset.open(path.parent)
    for split in prepared.SPLITS:
        dataset.unigram(split)
        dataset.tokens(split)
    dataset.describe()


def read_classifier(path: Path) -> None:
    gan_evaluate.read_classifier(path, 8 * 8, 10)


def reader_unverified(checkpointer: checkpoint.Checkpointer, abstract: Any) -> Callable[[Path], None]:
    """Restores the parameters of a step without a manifest: refused (CheckpointDamaged), or finite values."""
    def read(path: Path) -> None:
        step = int(path.relative_to(checkpointer.directory).parts[0])
        params = checkpointer.restore_params(step, abstract)
        assert all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(params))
    return read


# THE PROPERTY -------------------------------------------------------------------------------------------------


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_cases(kind: str, originals: list[Path], mutate, read: Callable[[Path], None], count: int, rng: random.Random,
              tally: Counter, failures: list[str]) -> None:
    """`count` cases: each restores every original, damages one, reads it, checks the outcome and the file."""
    saved = {p: p.read_bytes() for p in originals}
    for case in range(count):
        target = originals[case % len(originals)]
        for path, data in saved.items():
            path.write_bytes(data)
        damaged, what = mutate(saved[target], rng)
        target.write_bytes(damaged)
        before = sha(target)
        try:
            read(target)
            tally[f"{kind}: read"] += 1
        except UserError as e:
            tally[f"{kind}: refused"] += 1
            if not str(e).strip():
                failures.append(f"{kind} case {case} ({target.name}, {what}): a UserError without a message")
        except Exception:  # noqa: BLE001 - the property under test
            failures.append(f"{kind} case {case} ({target.name}, {what[:100]}):\n{traceback.format_exc(limit=-3)[-1500:]}")
        if sha(target) != before:
            failures.append(f"{kind} case {case} ({target.name}, {what}): reading changed the file")
    for path, data in saved.items():
        path.write_bytes(data)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One copy of every kind of file, each in its own folder as the readers expect it."""
    from tiny_files import write_hf_folder

    root = tmp_path_factory.mktemp("fuzz")
    recipes = root / "recipes"
    shutil.copytree(config_lib.RECIPE_DIR, recipes)
    runs = []
    for workload in ("lm", "sim", "rl", "gan"):
        w = workloads.get(workload)
        cfg, _ = config_lib.load(w.config, None, [], w.default_recipe, workload)
        (root / f"run-{workload}").mkdir()
        (root / f"run-{workload}" / rundir.CONFIG_FILE).write_text(config_lib.dump_yaml(cfg))
        runs.append(root / f"run-{workload}" / rundir.CONFIG_FILE)
    single = write_hf_folder(root / "hf")
    sharded = write_hf_folder(root / "hf-sharded", max_shard_bytes=40_000)
    step = root / "checkpoints" / "7"
    for name, data in {"params/a": b"\x01" * 300, "params/b": b"\x02" * 10, "meta/metadata": b'{"workload": "lm"}'}.items():
        (step / name).parent.mkdir(parents=True, exist_ok=True)
        (step / name).write_bytes(data)
    checkpoint._write_manifest(step)
    source = root / "text"
    source.mkdir()
    for i in range(12):
        (source / f"doc{i}.txt").write_text(f"document {i}: def f(x):\n    return x * {i}\n" * 3)
    prepare.prepare(str(source), root / "prepared", val_percent=20.0)
    classifier = root / "gan" / gan_evaluate.CLASSIFIER_FILE
    classifier.parent.mkdir()
    params = gan_evaluate.init_classifier(jax.random.PRNGKey(0), 8 * 8, 10)
    np.savez(classifier, **{f"{name}.{k}": np.asarray(v) for name, layer in params.items() for k, v in layer.items()})
    unverified = root / "unverified"
    saver = checkpoint.Checkpointer(unverified, CheckpointConfig(async_save=False))
    weights = {"w": jnp.linspace(-1.0, 1.0, 4 * 64).reshape(4, 64), "b": jnp.ones((64,))}
    saver.save(TrainState(step=jnp.int32(3), params=weights, opt_state={}, rng=jax.random.PRNGKey(0)), None,
               {"workload": "lm"})
    saver.wait()  # seals the step with its manifest, which the next line removes
    saver.close()
    (unverified / "3" / checkpoint.MANIFEST).unlink()
    (root / "run-metrics").mkdir()
    rows = [{"step": s, "split": "train", "loss": 3.0 / s, "lr": 1e-3, "grad_norm": "nan" if s == 3 else 0.5}
            for s in range(1, 9)] + [{"step": 8, "split": "eval", "loss": 0.4}]
    (root / "run-metrics" / metrics.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"recipes": sorted(recipes.glob("*.yaml")), "runs": runs, "hf": single, "sharded": sharded, "step": step,
            "metrics": root / "run-metrics" / metrics.METRICS_FILE, "prepared": root / "prepared",
            "classifier": classifier, "unverified": unverified / "3", "weights": weights}


def test_every_damaged_file_is_read_or_refused_and_left_unchanged(files):
    # Every original reads cleanly: the cases below damage working files, not already broken ones.
    for path in files["recipes"]:
        config_lib.read_yaml(path)  # (lm-sft alone is incomplete: it needs data.path)
    for path in files["runs"]:
        read_run_config(path)
    read_hf_config(files["hf"] / "config.json")
    read_safetensors(files["hf"] / "model.safetensors")
    read_safetensors(files["sharded"] / "model.safetensors.index.json")
    checkpointer = checkpoint.Checkpointer(files["step"].parent, CheckpointConfig(async_save=False))
    assert checkpointer.verify(7) is None
    read_metrics(files["metrics"])
    read_prepared(files["prepared"] / prepared.INDEX_FILE)
    read_classifier(files["classifier"])
    unverified = checkpoint.Checkpointer(files["unverified"].parent, CheckpointConfig(async_save=False))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), files["weights"])
    reader_unverified(unverified, abstract)(files["unverified"] / "params")

    rng, tally, failures = random.Random(SEED), Counter(), []
    shards = sorted(files["sharded"].glob("*.safetensors"))
    plan = [
        ("recipe", files["recipes"], mutate_yaml, read_recipe),
        ("run config.yaml", files["runs"], mutate_yaml, read_run_config),
        ("hf config.json", [files["hf"] / "config.json"], mutate_json, read_hf_config),
        ("safetensors", [files["hf"] / "model.safetensors", *shards], mutate_safetensors, read_safetensors),
        ("safetensors index", [files["sharded"] / "model.safetensors.index.json"], mutate_json, read_safetensors),
        ("checkpoint manifest", [files["step"] / checkpoint.MANIFEST], mutate_json, reader_verify(checkpointer)),
        ("metrics.jsonl", [files["metrics"]], mutate_jsonl, read_metrics),
        ("prepared index.json", [files["prepared"] / prepared.INDEX_FILE], mutate_json, read_prepared),
        ("unigram table", sorted(files["prepared"].glob("*-unigram.npy")), mutate_bytes,
         lambda path: read_prepared(path.parent / prepared.INDEX_FILE)),
        ("gan classifier", [files["classifier"]], mutate_bytes, read_classifier),
        ("checkpoint without manifest", sorted(p for p in (files["unverified"] / "params").rglob("*") if p.is_file()),
         mutate_bytes, reader_unverified(unverified, abstract)),
    ]
    for kind, originals, mutate, read in plan:
        run_cases(kind, originals, mutate, read, CASES[kind], rng, tally, failures)
    checkpointer.close()
    unverified.close()

    total = sum(tally.values())
    kinds = ", ".join(f"{kind} {CASES[kind]} ({tally[f'{kind}: refused']} refused)" for kind in CASES)
    print(f"\nfile fuzz: {total} cases, {sum(v for k, v in tally.items() if k.endswith('refused'))} refused with a "
          f"UserError, the rest read; {kinds}")
    assert not failures, f"{len(failures)} of {total} cases failed:\n\n" + "\n\n".join(failures[:10])
    assert total >= 300
