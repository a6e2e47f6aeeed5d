"""Opening a finished run (engine/finished.py) and resuming one (Checkpointer.restore_latest) when the checkpoint
is intact but no longer fits the run's config: a config mismatch, reported as one paragraph, with nothing moved."""

import shutil
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import yaml

from systolic import cli
from systolic import config as config_lib
from systolic.config import CheckpointConfig
from systolic.engine import checkpoint
from systolic.engine.checkpoint import MANIFEST, Checkpointer
from systolic.engine.state import TrainState
from systolic.errors import UserError


def tree_listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def flip_a_byte(step_dir: Path) -> None:
    """Flips one byte of the largest params file without changing its size (Orbax alone would not notice)."""
    victim = max((p for p in (step_dir / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))


# Checkpointer.restore_latest ---------------------------------------------------------------------------------

def small_state(step: int, width: int) -> TrainState:
    params = {"w": jnp.full((4, width), float(step)), "blocks": {0: {"b": jnp.zeros((width,))}}}
    return TrainState(step=jnp.int32(step), params=params, opt_state={}, rng=jax.random.PRNGKey(0))


def test_a_small_state_is_written_before_save_returns_a_large_one_in_the_background(tmp_path, monkeypatch):
    """With async_save, a state under BACKGROUND_WRITE_BYTES is written and sealed (its manifest) within `save`: a
    background write would take the loop's host time for longer (rl-cartpole's CLI at 1,731 against 6,199 env
    steps/s). A larger one is sealed only at the next save or `wait`."""
    folder = tmp_path / "checkpoints"
    ckpt = Checkpointer(folder, CheckpointConfig(async_save=True))
    ckpt.save(small_state(1, 8), None, {"workload": "lm"})
    assert (folder / "1" / MANIFEST).exists()
    monkeypatch.setattr(checkpoint, "BACKGROUND_WRITE_BYTES", 0)
    ckpt.save(small_state(2, 8), None, {"workload": "lm"})
    assert not (folder / "2" / MANIFEST).exists()
    ckpt.wait()
    assert (folder / "2" / MANIFEST).exists()
    ckpt.close()


@pytest.fixture
def two_steps(tmp_path) -> Path:
    """Checkpoints of a width-8 state at steps 1 and 2, sealed with their manifests."""
    ckpt = Checkpointer(tmp_path / "checkpoints", CheckpointConfig(async_save=False))
    for step in (1, 2):
        ckpt.save(small_state(step, 8), None, {"workload": "lm"})
    ckpt.wait()
    ckpt.close()
    return tmp_path / "checkpoints"


def restore_latest(folder: Path, width: int):
    ckpt = Checkpointer(folder, CheckpointConfig(async_save=False))
    try:
        return ckpt.restore_latest(jax.eval_shape(lambda: small_state(0, width)), "lm")
    finally:
        ckpt.close()


def test_restore_latest_on_a_mismatched_checkpoint_moves_nothing(two_steps):
    before = tree_listing(two_steps)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(UserError) as raised:
        warnings.simplefilter("always")
        restore_latest(two_steps, width=16)
    message = str(raised.value)
    assert "/2 does not match its config" in message and "params.w: checkpoint (4, 8), config (4, 16)" in message
    assert "params.blocks.0.b: checkpoint (8,), config (16,)" in message
    assert "Nothing was changed" in message and "backup" not in message
    assert not [w for w in caught if "damaged" in str(w.message)]
    assert tree_listing(two_steps) == before


def test_damage_still_falls_back_and_sets_the_damaged_step_aside(two_steps):
    flip_a_byte(two_steps / "2")
    with pytest.warns(UserWarning, match="step 2 .* is damaged"):
        state, _, step = restore_latest(two_steps, width=8)
    assert step == 1 and float(state.params["w"][0, 0]) == 1.0
    assert not (two_steps / "2").exists() and [p.name.startswith("damaged-2-") for p in two_steps.iterdir()].count(True) == 1


def test_a_damaged_newest_step_before_a_mismatched_one_is_not_moved_either(two_steps):
    flip_a_byte(two_steps / "2")
    before = tree_listing(two_steps)
    with pytest.warns(UserWarning, match="step 2"), pytest.raises(UserError, match="/1 does not match its config"):
        restore_latest(two_steps, width=16)
    assert tree_listing(two_steps) == before


# THE CLI ON A RUN WHOSE config.yaml WAS EDITED -----------------------------------------------------------------

@pytest.fixture(scope="module")
def lm_run(tiny_lm, tmp_path_factory) -> Path:
    """One run of the shared tiny lm config with a checkpoint at step 2, shared by this module's CLI tests."""
    root = tmp_path_factory.mktemp("finished")
    cfg = tiny_lm.make_cfg("train.steps=2", "checkpoint.every_steps=2", "checkpoint.async_save=false",
                           "train.eval_every=1000", "sample.max_new_tokens=0", "observe.plot=false",
                           "observe.tensorboard=false")
    (root / "tiny.yaml").write_text(config_lib.dump_yaml(cfg))
    assert cli.main(["train", "lm", "--recipe", str(root / "tiny.yaml"), "-q", "--run-dir", str(root / "run")]) == 0
    return root / "run"


@pytest.fixture(scope="module")
def edited_run(lm_run, tmp_path_factory) -> Path:
    """A copy of `lm_run` whose config.yaml says d_model 64: the checkpoint holds d_model 32."""
    run = tmp_path_factory.mktemp("edited") / "run"
    shutil.copytree(lm_run, run)
    tree = yaml.safe_load((run / "config.yaml").read_text())
    assert tree["model"]["d_model"] == 32
    tree["model"]["d_model"] = 64
    (run / "config.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    return run


def test_generate_from_the_unedited_run_works(lm_run, capsys):
    assert cli.main(["generate", str(lm_run), "--prompt", "def", "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().out.startswith("def")


@pytest.mark.parametrize("command", ["generate", "export", "to-hf", "train"])
def test_a_run_whose_config_was_edited_exits_2_saying_so(edited_run, command, tmp_path, capsys):
    run = str(edited_run)
    argv = {"generate": ["generate", run, "--max-new-tokens", "2"],
            "export": ["export", run, "--out", str(tmp_path / "model.jaxexport")],
            "to-hf": ["convert", "to-hf", run, str(tmp_path / "hf")],
            "train": ["train", "lm", "--recipe", str(edited_run / "config.yaml"), "-q", "--run-dir", run]}[command]
    before = tree_listing(edited_run)
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("error: ") and "Traceback" not in err
    assert "does not match its config" in err and "attn.wq: checkpoint (32, 4, 8), config (64, 4, 16)" in err
    assert "backup" not in err and "damaged" not in err
    if command == "train":  # the resume's own fix
        assert "checkpoint.resume=false" in err
    assert tree_listing(edited_run) == before
    assert not list(tmp_path.iterdir())


# A step without its manifest: it must load and be finite ---------------------------------------------------------


def test_a_manifestless_step_whose_bytes_do_not_load_is_set_aside_and_never_trained_on(two_steps):
    (two_steps / "2" / "systolic-manifest.json").unlink()
    for victim in (p for p in (two_steps / "2" / "params").rglob("*") if p.is_file() and p.stat().st_size > 200):
        data = bytearray(victim.read_bytes())
        for i in range(0, len(data), 7):
            data[i] ^= 0xFF
        victim.write_bytes(bytes(data))
    ckpt = Checkpointer(two_steps, CheckpointConfig(async_save=False))
    try:  # generate / convert to-hf / init.from read the parameters alone: one paragraph, nothing moved
        before = tree_listing(two_steps)
        with pytest.raises(UserError, match=r"checkpoints/2 is damaged: it has no manifest .* do not load"):
            ckpt.restore_params(2, jax.eval_shape(lambda: small_state(0, 8)).params)
        assert tree_listing(two_steps) == before
    finally:
        ckpt.close()
    with warnings.catch_warnings(record=True) as caught:  # a resume sets it aside and falls back to step 1
        warnings.simplefilter("always")
        state, _, step = restore_latest(two_steps, width=8)
    assert step == 1 and float(state.params["w"][0, 0]) == 1.0
    assert any("has no manifest" in str(w.message) for w in caught)
    assert [p.name for p in two_steps.iterdir() if p.name.startswith("damaged-2-")]


def test_a_manifestless_step_with_non_finite_values_is_set_aside(tmp_path):
    ckpt = Checkpointer(tmp_path / "checkpoints", CheckpointConfig(async_save=False))
    ckpt.save(small_state(1, 8), None, {"workload": "lm"})
    poisoned = small_state(2, 8)
    ckpt.save(poisoned.replace(params={**poisoned.params, "w": poisoned.params["w"].at[1, 2].set(jnp.nan)}), None,
              {"workload": "lm"})
    ckpt.wait()
    ckpt.close()
    (tmp_path / "checkpoints" / "2" / "systolic-manifest.json").unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, step = restore_latest(tmp_path / "checkpoints", width=8)
    assert step == 1
    assert any("params.w holds NaN or Inf" in str(w.message) for w in caught)
