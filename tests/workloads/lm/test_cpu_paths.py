"""The CPU-only formulations in `lm/model/cpu.py` compute the same function as the plain ones."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from systolic.runtime import cpu_settings
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model.cpu import causal_attention, gradient_barrier, project
from systolic.workloads.lm.model.transformer import Transformer


def _reference_attention(q, k, v):
    """float64 NumPy causal grouped-query attention: q (B, T, H, hd), k/v (B, T, KV, hd)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, H, hd = q.shape
    rep = H // k.shape[2]
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)  # (B, T, H, hd)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def test_causal_attention_matches_float64_reference():
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(kq, (2, 7, 4, 8))
    k, v = jax.random.normal(kk, (2, 7, 2, 8)), jax.random.normal(kv, (2, 7, 2, 8))
    np.testing.assert_allclose(causal_attention(q, k, v), _reference_attention(q, k, v), atol=2e-6)


def test_project_is_tensordot():
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 3, 4))
    w = jax.random.normal(jax.random.PRNGKey(2), (3, 4, 6))
    np.testing.assert_allclose(project(x, w, contract=2), np.tensordot(np.asarray(x, np.float64), np.asarray(w, np.float64), 2), atol=1e-5)


def test_gradient_barrier_is_the_identity_and_survives_compilation():
    f = lambda x: jnp.sin(gradient_barrier(jnp.cos(x))).sum()  # noqa: E731
    x = jnp.linspace(0.0, 1.0, 8)
    np.testing.assert_allclose(jax.grad(f)(x), -np.cos(np.cos(np.asarray(x))) * np.sin(np.asarray(x)), rtol=1e-6)
    hlo = jax.jit(jax.grad(f)).lower(x).compile().as_text()
    assert "while" in hlo, "XLA simplified the barrier's loop away: it no longer stops fusion"


@pytest.fixture
def set_cpu_tweaks(monkeypatch):
    """Sets SYSTOLIC_CPU_TWEAKS for one test: the settings, read once per process, are read again on each call
    and after the test (when monkeypatch has restored the environment)."""

    def set_(value: str) -> None:
        monkeypatch.setenv("SYSTOLIC_CPU_TWEAKS", value)
        cpu_settings.settings.cache_clear()

    yield set_
    cpu_settings.settings.cache_clear()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_model_with_and_without_cpu_rewrites_agree(family, set_cpu_tweaks):
    cfg = ModelConfig(family=family, d_model=32, layers=2, heads=4, kv_heads=2 if family == "llama" else 0,
                      max_seq_len=16, dtype="float32")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)), jnp.int32)

    def loss_and_grads(setting):
        set_cpu_tweaks(setting)
        graphdef, params = nnx.split(Transformer(cfg, 64, rngs=nnx.Rngs(params=0)), nnx.Param)
        loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(nnx.merge(graphdef, p)(tokens), tokens).mean()  # noqa: E731
        return jax.jit(jax.value_and_grad(loss))(params)

    (loss_plain, grads_plain), (loss_cpu, grads_cpu) = loss_and_grads("none"), loss_and_grads("all")
    np.testing.assert_allclose(loss_cpu, loss_plain, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_cpu), jax.tree.leaves(grads_plain)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_causal_attention_gradients_match_the_plain_formulation():
    kq, kk, kv, kg = jax.random.split(jax.random.PRNGKey(3), 4)
    q = jax.random.normal(kq, (2, 9, 6, 8))
    k, v = jax.random.normal(kk, (2, 9, 2, 8)), jax.random.normal(kv, (2, 9, 2, 8))
    weight = jax.random.normal(kg, q.shape)  # a loss that is not symmetric in the outputs
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * weight)  # noqa: E731
    plain = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    got = jax.grad(loss(causal_attention), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(plain), argnums=(0, 1, 2))(q, k, v)
    assert float(jnp.abs(want[1]).max()) > 0.1  # the comparison is not between zeros
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=2e-5)
