"""The worked port in docs/porting-from-pytorch.md, runnable: a character-level MLP in PyTorch and in Flax NNX.

With the PyTorch weights copied in, the NNX model gives the same logits, and one SGD step (NNX style and pure
functional style) gives the same loss and the same new weights, to 1e-5. Every code block of the guide's worked
port appears verbatim in this file, so the guide cannot drift from code that runs.
"""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

GUIDE = Path(__file__).parents[1] / "docs" / "porting-from-pytorch.md"
VOCAB, CONTEXT, D_EMBED, D_HIDDEN, LR = 32, 8, 16, 64, 0.1


# --- PyTorch -------------------------------------------------------------------------------------------------

class TorchCharMLP(nn.Module):
    """Predicts the next character from the previous `context` characters."""

    def __init__(self, vocab: int, context: int, d_embed: int, d_hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_embed)
        self.hidden = nn.Linear(context * d_embed, d_hidden)
        self.norm = nn.LayerNorm(d_hidden)
        self.out = nn.Linear(d_hidden, vocab)

    def forward(self, idx):  # idx: (B, context) int64
        x = self.embed(idx).flatten(1)  # (B, context * d_embed)
        x = F.gelu(self.norm(self.hidden(x)))  # (B, d_hidden)
        return self.out(x)  # (B, vocab) logits


def torch_train_step(model, opt, idx, targets):
    opt.zero_grad()
    loss = F.cross_entropy(model(idx), targets)
    loss.backward()
    opt.step()
    return loss.item()


# --- JAX / Flax NNX ------------------------------------------------------------------------------------------

class CharMLP(nnx.Module):
    """Predicts the next character from the previous `context` characters."""

    def __init__(self, vocab: int, context: int, d_embed: int, d_hidden: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d_embed, rngs=rngs)
        self.hidden = nnx.Linear(context * d_embed, d_hidden, rngs=rngs)
        self.norm = nnx.LayerNorm(d_hidden, epsilon=1e-5, rngs=rngs)  # PyTorch's eps; Flax defaults to 1e-6
        self.out = nnx.Linear(d_hidden, vocab, rngs=rngs)

    def __call__(self, idx):  # idx: (B, context) int32
        x = self.embed(idx).reshape(idx.shape[0], -1)  # (B, context * d_embed)
        x = jax.nn.gelu(self.norm(self.hidden(x)), approximate=False)  # PyTorch's GELU is the exact erf form
        return self.out(x)  # (B, vocab) logits


def loss_fn(model, idx, targets):
    logits = model(idx)  # (B, vocab)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@nnx.jit
def train_step(model, optimizer, idx, targets):
    loss, grads = nnx.value_and_grad(loss_fn)(model, idx, targets)
    optimizer.update(model, grads)  # updates model's parameters and optimizer's state
    return loss


def load_torch_weights(model: CharMLP, state_dict) -> None:
    """Copies a PyTorch state_dict into the NNX model. nn.Linear stores its weight (out, in); nnx.Linear's
    kernel is (in, out), so matrices are transposed."""
    w = {name: jnp.asarray(t.detach().cpu().numpy()) for name, t in state_dict.items()}
    model.embed.embedding[...] = w["embed.weight"]
    model.hidden.kernel[...] = w["hidden.weight"].T
    model.hidden.bias[...] = w["hidden.bias"]
    model.norm.scale[...] = w["norm.weight"]
    model.norm.bias[...] = w["norm.bias"]
    model.out.kernel[...] = w["out.weight"].T
    model.out.bias[...] = w["out.bias"]


def make_pure_train_step(graphdef, tx):
    """The same step as a pure function of plain arrays, the form systolic's engine jits and shards."""

    @jax.jit
    def pure_train_step(params, opt_state, idx, targets):
        def pure_loss(params):
            return loss_fn(nnx.merge(graphdef, params), idx, targets)

        loss, grads = jax.value_and_grad(pure_loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return pure_train_step


# --- Checks --------------------------------------------------------------------------------------------------


def make_pair():
    torch.manual_seed(0)
    reference = TorchCharMLP(VOCAB, CONTEXT, D_EMBED, D_HIDDEN)
    model = CharMLP(VOCAB, CONTEXT, D_EMBED, D_HIDDEN, rngs=nnx.Rngs(0))
    load_torch_weights(model, reference.state_dict())
    own_init = CharMLP(VOCAB, CONTEXT, D_EMBED, D_HIDDEN, rngs=nnx.Rngs(0)).hidden.kernel[...]
    assert not np.allclose(own_init, model.hidden.kernel[...]), "the copy replaced NNX's own initial weights"
    return reference, model


def batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, VOCAB, (16, CONTEXT))
    targets = rng.integers(0, VOCAB, (16,))
    return idx, targets


def assert_same_weights(reference, model):
    got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    want = {name: t.detach().numpy() for name, t in reference.state_dict().items()}
    np.testing.assert_allclose(got["embed"]["embedding"], want["embed.weight"], rtol=1e-5, atol=1e-5)
    for layer in ("hidden", "out"):
        np.testing.assert_allclose(got[layer]["kernel"], want[f"{layer}.weight"].T, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[layer]["bias"], want[f"{layer}.bias"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["norm"]["scale"], want["norm.weight"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["norm"]["bias"], want["norm.bias"], rtol=1e-5, atol=1e-5)


def test_same_logits_with_copied_weights():
    reference, model = make_pair()
    idx, _ = batch()
    want = reference(torch.from_numpy(idx)).detach().numpy()
    got = model(jnp.asarray(idx, jnp.int32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_one_sgd_step_matches():
    reference, model = make_pair()
    idx, targets = batch()
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    want_loss = torch_train_step(reference, opt, torch.from_numpy(idx), torch.from_numpy(targets))

    optimizer = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)
    loss = train_step(model, optimizer, jnp.asarray(idx, jnp.int32), jnp.asarray(targets, jnp.int32))
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    assert_same_weights(reference, model)


def test_pure_functional_step_matches_the_nnx_step():
    _, model = make_pair()
    idx, targets = (jnp.asarray(a, jnp.int32) for a in batch())
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)  # a nested dict of arrays, like a state_dict
    tx = optax.sgd(LR)
    opt_state = tx.init(params)
    pure_train_step = make_pure_train_step(graphdef, tx)
    params, opt_state, pure_loss = pure_train_step(params, opt_state, idx, targets)

    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    loss = train_step(model, optimizer, idx, targets)
    np.testing.assert_allclose(pure_loss, loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 params, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def _lines(text: str) -> list[str]:
    return [line.split("  # noqa")[0].strip() for line in text.splitlines() if line.strip()]


def test_guide_shows_this_code():
    """Each block of the worked port is a run of lines of this file (indentation aside); imports may sit anywhere."""
    text = GUIDE.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text[text.index("## A worked port") :], re.DOTALL)
    assert len(blocks) >= 4
    source = _lines(Path(__file__).read_text(encoding="utf-8"))
    joined = "\n".join(source)
    for block in blocks:
        lines = _lines(block)
        imports = [line for line in lines if line.startswith(("import ", "from "))]
        code = [line for line in lines if line not in imports]
        # `import torch` is `torch = pytest.importorskip("torch")` here, so the test skips without torch.
        present = [line in source or f'{line[7:]} = pytest.importorskip("{line[7:]}")' in source for line in imports]
        assert all(present), f"an import of the guide is not in this file: {imports}"
        assert "\n".join(code) in joined, f"the guide's code is not in {Path(__file__).name}:\n{block}"
