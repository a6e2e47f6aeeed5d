"""The inference engine tests' shared pieces (tests/workloads/lm/serve/): TINY_LM's model in float32 with random
weights drawn by NumPy (jax.random under jit compiles slowly on CPU), the `generate` reference, and a driver that
feeds requests to an engine at given steps."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tiny import MOE, TINY_LM

from systolic import config as config_lib
from systolic.workloads.lm.model import decode as gen
from systolic.workloads.lm.config import LMConfig
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model.transformer import make_model

VOCAB = 320  # the byte tokenizer's 258 ids, padded to a multiple of 64
LIMIT = 258  # ids the engine samples from: the tokenizer's
PAGE = 4  # tokens per page: TINY_LM's 32 positions are 8 pages, so prompts cross page boundaries
# Each model the lm workload has, as overrides of TINY_LM's model: what test_engine.py runs through the engine.
VARIANTS = {
    "gqa": [],
    "scan": ["model.scan_layers=true"],
    "gpt2": ["model.family=gpt2", "model.kv_heads=0"],
    "qwen": ["model.qk_norm=true", "model.qkv_bias=true"],
    "moe": MOE,
    "lora": ["model.lora.rank=4", "model.lora.targets=all"],
    "window": ["model.sliding_window=6"],
}


@functools.cache
def tiny_model(*extra: str) -> ModelConfig:
    """TINY_LM's model (2 layers, 4 query heads sharing 2 key/value heads, 32 positions) in float32, with `extra`
    overrides."""
    overrides = [*TINY_LM, "model.dtype=float32", *extra]
    return config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, overrides)).model


@functools.cache
def random_params(cfg: ModelConfig, std: float = 0.3) -> tuple[nnx.GraphDef, dict]:
    """graphdef and random parameters (pure dict, every entry drawn, LoRA's B too, so adapters change the output)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: make_model(cfg, VOCAB, 0)), nnx.Param)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: jnp.asarray(rng.normal(0.0, std, x.shape), jnp.float32), nnx.to_pure_dict(abstract))
    return graphdef, params


def reference(cfg: ModelConfig, prompts: np.ndarray, new: int) -> np.ndarray:
    """`generate`'s greedy continuations (B, new) of prompts (B, P), from the tokenizer's ids only."""
    graphdef, params = random_params(cfg)
    return np.asarray(gen.generate(graphdef, params, jnp.asarray(prompts, jnp.int32), max_new_tokens=new,
                                   vocab_limit=LIMIT))


def drive(engine, arrivals: dict[int, list[tuple]], max_steps: int = 10_000) -> dict[str, list]:
    """Adds each (request_id, prompt_ids, SamplingParams) of arrivals[step] before that step, steps until no work
    is left; returns each request's TokenEvents."""
    events = collections.defaultdict(list)
    step = 0
    while step <= max(arrivals, default=0) or engine.has_work():
        for request in arrivals.get(step, ()):
            engine.add_request(*request)
        for event in engine.step():
            events[event.request_id].append(event)
        step += 1
        assert step < max_steps, "the engine did not finish its requests"
    return dict(events)


def token_ids(events: list) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]
