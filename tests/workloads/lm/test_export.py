"""`systolic export`: one artefact, reloaded in a fresh process that imports only jax and numpy, gives the live
model's logits for two batch sizes (symbolic batch), and its decode step (KV cache) decodes greedily like it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from systolic import cli
from systolic.engine import rundir
from systolic.engine.checkpoint import Checkpointer
from systolic.engine.state import TrainState
from systolic.workloads.lm.model.transformer import make_model
from systolic.workloads.lm.loaded_run import load_run

LOADER = Path(__file__).parents[3] / "examples" / "run_exported.py"
NEW = 4  # tokens greedy-decoded by the loader


def make_run(run_dir: Path, cfg) -> None:
    """A run directory with one checkpoint of random parameters (std 0.3: logits that differ clearly by token)."""
    rundir.prepare(run_dir, cfg)
    vocab = cfg.model.padded_vocab(258)
    abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: make_model(cfg.model, vocab, 0)), nnx.Param))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: jnp.asarray(rng.normal(0.0, 0.3, x.shape), jnp.float32), abstract)
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
    ckpt.save(TrainState(step=jnp.int32(7), params=params, opt_state={}, rng=jax.random.PRNGKey(0)), None, {"workload": "lm"})
    ckpt.wait()
    ckpt.close()


@pytest.fixture(scope="module")
def exported(tiny_lm, tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    make_run(root / "run", tiny_lm.make_cfg("model.dtype=float32", "checkpoint.async_save=false"))
    assert cli.main(["export", str(root / "run"), "--out", str(root / "model.jaxexport"), "--what", "both"]) == 0
    return root


def test_fresh_process_gets_the_live_logits_for_two_batch_sizes_and_the_decode_step_matches(exported):
    prompts = [np.random.default_rng(1).integers(0, 258, shape).astype(np.int32) for shape in ((1, 7), (3, 12))]
    for i, tokens in enumerate(prompts):
        np.save(exported / f"tokens_{i}.npy", tokens)
    args = [str(exported / "model.jaxexport"), *(str(exported / f"tokens_{i}.npy") for i in range(2)),
            "--out", str(exported / "out.npz"), "--new", str(NEW)]
    # The loader runs in a new interpreter; afterwards no module of systolic or its model stack may be loaded.
    code = (f"import runpy, sys; sys.argv = {[str(LOADER), *args]!r}; runpy.run_path(sys.argv[0], run_name='__main__'); "
            "leaked = sorted(m for m in sys.modules if m.split('.')[0] in ('systolic', 'flax', 'optax', 'orbax')); "
            "assert not leaked, leaked")
    # Without JAX_PLATFORMS, as a user runs it: the loader keeps libtpu's start-up warnings (where libtpu is
    # installed on a host without a TPU) out, and says what it wrote.
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "worker hostname" not in proc.stderr and "E0000" not in proc.stderr, proc.stderr
    assert f"wrote {exported / 'out.npz'}: logits_0 (" in proc.stdout and "generated_1 (" in proc.stdout, proc.stdout
    out = np.load(exported / "out.npz")

    run = load_run(exported / "run", "export")
    forward = jax.jit(lambda params, tokens: nnx.merge(run.graphdef, params)(tokens))  # (B, T, V)
    for i, tokens in enumerate(prompts):
        # One live forward over prompt + decoded tokens: the model is causal, so its first P positions are the
        # prompt's logits, and position P - 1 + j holds the logits that chose decoded token j.
        P = tokens.shape[1]
        live = np.asarray(forward(run.params, np.concatenate([tokens, out[f"generated_{i}"]], axis=1)))
        assert out[f"logits_{i}"].shape == live[:, :P].shape
        np.testing.assert_allclose(out[f"logits_{i}"], live[:, :P], rtol=0, atol=1e-5)
        assert np.ptp(live[:, -1], axis=-1).min() > 1.0  # the comparison is not between near-uniform rows
        np.testing.assert_allclose(out[f"decode_logits_{i}"], live[:, P - 1: P - 1 + NEW], rtol=0, atol=1e-5)
        np.testing.assert_array_equal(out[f"generated_{i}"], live[:, P - 1: P - 1 + NEW].argmax(-1))  # greedy


def test_artefacts_are_symbolic_and_described(exported):
    names = sorted(p.name for p in exported.iterdir() if p.name.startswith("model"))
    assert names == ["model.decode.jaxexport", "model.jaxexport", "model.json", "model.params.npz"]
    forward = jax.export.deserialize(bytearray((exported / "model.jaxexport").read_bytes()))
    assert str(forward.in_avals[-1].shape) == "(b, t)" and forward.platforms == ("cpu",)
    manifest = json.loads((exported / "model.json").read_text())
    assert manifest["files"] == {"forward": "model.jaxexport", "decode": "model.decode.jaxexport"}
    assert manifest["checkpoint_step"] == 7 and manifest["kv_cache"]["layers"] == 2


def test_bad_input_is_one_paragraph_and_exit_2(exported, tmp_path, capsys):
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "config.yaml").write_text((exported / "run" / "config.yaml").read_text())
    cases = [
        (["export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "m.jaxexport")], "has no config.yaml"),
        (["export", str(tmp_path / "fresh"), "--out", str(tmp_path / "m.jaxexport")], "has no complete checkpoint"),
        (["export", str(exported / "run"), "--out", str(tmp_path / "m.jaxexport"), "--platforms", "cpu,gpu"],
         "gpu is not a platform"),
        (["export", str(exported / "run"), "--out", str(tmp_path / "fresh" / "config.yaml" / "m.jaxexport")],
         "config.yaml is a file"),
    ]
    for argv, fragment in cases:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.replace("\n", " ")
        assert fragment in " ".join(err.split()) and "Traceback" not in err
    assert not list(tmp_path.glob("m.*"))


def test_out_in_folders_that_do_not_exist_yet_creates_them(exported, tmp_path):
    out = tmp_path / "exp" / "deeper" / "p3.jaxexport"
    assert cli.main(["export", str(exported / "run"), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["p3.jaxexport", "p3.json", "p3.params.npz"]
