"""Tiny real files of every foreign format systolic reads, written without torch or a download: a Hugging Face
folder (config.json + model.safetensors, optionally sharded with an index), for the bad-input and file-fuzz tests."""

import json
from pathlib import Path

import jax
import numpy as np

from systolic.workloads.lm.hf import convert as hf
from systolic.workloads.lm.hf import config as hf_config
from systolic.workloads.lm.model.config import ModelConfig

VOCAB = 320
TINY_MODEL = ModelConfig(d_model=32, layers=2, heads=4, kv_heads=2, max_seq_len=32, vocab_size=VOCAB)


def write_hf_folder(out: Path, *, max_shard_bytes: int = 1 << 30) -> Path:
    """A Llama-architecture Hugging Face folder of TINY_MODEL with random float32 weights."""
    out.mkdir(parents=True)
    abstract = hf.abstract_params(TINY_MODEL, VOCAB)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: rng.normal(0, 0.02, x.shape).astype(np.float32), abstract)
    hf.write_safetensors(out, hf.export_tensors(TINY_MODEL, params), max_shard_bytes)
    (out / "config.json").write_text(json.dumps(hf_config.hf_config(TINY_MODEL, VOCAB, {}), indent=2))
    return out
