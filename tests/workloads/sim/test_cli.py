"""The real `systolic simulate` / `systolic fit sim` commands on tiny grids: outputs, resume, fit, user errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import TINY_SIM as TINY

from systolic.cli import main
from systolic.engine import rundir
from systolic.engine.checkpoint import Checkpointer
from systolic.runtime.mesh import make_mesh
from systolic.workloads.sim.config import SimConfig
from systolic.workloads.sim.solver import make_simulation


def final_fields(run_dir):
    cfg = rundir.load_config(run_dir, lambda name: SimConfig)
    sim = make_simulation(cfg, make_mesh(cfg.mesh))
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
    state, _, _ = ckpt.restore(ckpt.latest_step(), sim.abstract_state)
    ckpt.close()
    return np.asarray(state.params["w_hat"]), int(state.step)


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_simulate_writes_everything_and_a_resume_gives_the_identical_field(tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert main(["simulate", *TINY, "sim.t_end=0.4", "output.frames=4", "--run-dir", str(whole)]) == 0
    for name in ("config.yaml", "metrics.jsonl", "final.png", "animation.gif", "diagnostics.png"):
        assert (whole / name).stat().st_size > 0, name
    assert any((whole / "tensorboard").iterdir())
    assert sorted(p.name for p in (whole / "frames").iterdir()) == [f"{i:06d}.npy" for i in range(5)]
    assert [r["step"] for r in records(whole)] == [0, 1, 2, 3, 4]
    assert {"time", "energy", "enstrophy", "steps", "dt"} <= set(records(whole)[-1])

    # The same run stopped after 2 frames, then the full command again: it resumes from the frame-2 checkpoint.
    quick = [*TINY, "output.images=false", "observe.tensorboard=false", "--run-dir", str(split)]
    assert main(["simulate", *quick, "sim.t_end=0.2", "output.frames=2"]) == 0
    halfway, step = final_fields(split)
    assert step == 2
    assert main(["simulate", *quick, "sim.t_end=0.4", "output.frames=4"]) == 0
    resumed, step = final_fields(split)
    reference, _ = final_fields(whole)
    assert step == 4 and not np.array_equal(halfway, reference)  # the check below compares different states
    np.testing.assert_array_equal(resumed, reference)
    assert [r["energy"] for r in records(split)] == [r["energy"] for r in records(whole)]


def test_a_checkpoint_with_the_placeholder_optimizer_state_of_earlier_versions_resumes(tmp_path, sim_config):
    """Simulations have no optimizer; earlier versions stored a placeholder optimizer state ({"none": 0}) in every
    checkpoint. Such a checkpoint still restores onto today's state, which has none: the placeholder is not read."""
    cfg = sim_config("grid.n=32", "navier_stokes.initial_wavenumber=3", "checkpoint.async_save=false")
    sim = make_simulation(cfg, make_mesh(cfg.mesh))
    state = sim.initial_state()
    ckpt = Checkpointer(tmp_path, cfg.checkpoint)
    ckpt.save(state.replace(opt_state={"none": jnp.zeros((), jnp.int32)}), None, {"workload": "sim"})
    ckpt.wait()
    assert (tmp_path / "0" / "opt_state").is_dir()  # the layout of the earlier versions' checkpoints
    restored, _, step = ckpt.restore_latest(sim.abstract_state, "sim")
    ckpt.close()
    assert step == 0 and restored.opt_state == {}
    np.testing.assert_array_equal(np.asarray(restored.params["w_hat"]), np.asarray(state.params["w_hat"]))
    assert float(restored.extra["time"]) == 0.0


@pytest.mark.slow
def test_fit_recovers_the_viscosity_to_one_percent(tmp_path):
    """A small version of sim-viscosity-inverse (32^2, 20 steps a trajectory, 40 Adam steps, 1% noise)."""
    run = tmp_path / "fit"
    argv = ["fit", "sim", "--recipe", "sim-viscosity-inverse", "grid.n=32", "sim.t_end=1.0", "sim.dt=0.05",
            "output.frames=4", "navier_stokes.initial_wavenumber=3", "fit.steps=40", "fit.noise=0.01",
            "observe.log_every=10", "--run-dir", str(run), "-q"]
    assert main(argv) == 0
    last = [r for r in records(run) if r["split"] == "train"][-1]
    assert last["step"] == 40 and last["relative_error"] < 0.01, last
    assert (run / "viscosity.png").exists()


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["simulate", "grid.n=36"], "cannot be split into 8 slabs"),
        (["simulate", "sim.equation=heat", "grid.n=36"], "cannot be split into 8 blocks"),
        (["simulate", "sim.equation=heat", "sim.dt=1"], "exceeds the explicit Euler stability limit"),
        (["simulate", "navier_stokes.initial_wavenumber=90"], "is not resolved on grid.n=256"),
        (["simulate", "sim.equaton=heat"], "Did you mean 'sim.equation'"),
        (["fit", "sim", "--recipe", "sim-turbulence"], "fixed time step"),
        (["fit", "sim", "--recipe", "sim-taylor-green-3d", "sim.dt=0.01"], "no fit uses it"),
        (["simulate", "--recipe", "sim-taylor-green-3d", "grid.n=36", "mesh.data=2", "mesh.fsdp=4"],
         "cannot be split into 2 x 4 pencils"),
        (["fit", "lm"], "no `fit` command"),
        (["train", "sim"], "has no `train` command; the workloads that have one: lm, gan, rl"),
        (["simulate", "--recipe", "lm-tiny"], "is for the 'lm' workload"),
    ],
)
def test_user_errors_exit_2_without_traceback(argv, fragment, capsys, tmp_path):
    assert main(argv + ["--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err.replace("\n", " "), err
    assert "Traceback" not in err


def test_a_changed_grid_does_not_resume_an_old_run(tmp_path, capsys):
    run = [*TINY, "sim.t_end=0.1", "output.frames=1", "output.images=false", "sim.dtype=float64",
           "--run-dir", str(tmp_path)]
    assert not jax.config.jax_enable_x64
    assert main(["simulate", *run]) == 0
    assert not jax.config.jax_enable_x64  # a float64 run switches 64-bit jax on only while it runs
    assert main(["simulate", *run, "grid.n=48"]) == 2
    assert "grid_n: 32 -> 48" in capsys.readouterr().err.replace("\n", " ")


@pytest.mark.slow
def test_sigterm_stops_at_a_frame_with_a_checkpoint_and_the_rerun_finishes(tmp_path):
    """Preemption as for training runs: SIGTERM finishes the current frame, checkpoints it and exits 0."""
    import signal
    import subprocess
    import sys
    import time

    run = [*TINY, "sim.t_end=5", "output.frames=100", "output.images=false", "observe.tensorboard=false",
           "checkpoint.every_steps=1000", "--run-dir", str(tmp_path)]
    argv = [sys.executable, "-m", "systolic", "simulate", *run, "observe.log_every=1"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    stopped_at = max(r["step"] for r in records(tmp_path))
    assert 2 <= stopped_at < 100
    assert (tmp_path / "checkpoints" / str(stopped_at)).is_dir()  # checkpointed at the frame it stopped on
    assert main(["simulate", *run]) == 0
    assert [r["step"] for r in records(tmp_path)] == list(range(101))


def test_simulate_3d_writes_spectra_the_dissipation_figure_and_the_vorticity_plane(tmp_path):
    from tiny import TINY_SIM3D

    run = tmp_path / "tgv"
    assert main(["simulate", *TINY_SIM3D, "mesh.data=2", "mesh.fsdp=4", "observe.tensorboard=false",
                 "--run-dir", str(run)]) == 0
    for name in ("final.png", "animation.gif", "diagnostics.png", "spectrum.png", "dissipation.png"):
        assert (run / name).stat().st_size > 0, name
    assert sorted(p.name for p in (run / "spectra").iterdir()) == [f"{i:06d}.npy" for i in range(3)]
    assert np.load(run / "frames" / "000002.npy").shape == (16, 16)  # the plane x = pi, (y, z)
    last = records(run)[-1]
    assert {"time", "energy", "enstrophy", "dissipation", "divergence", "steps", "dt"} <= set(last)
    # The 512^3 reference's dissipation at t = 0.4, matched to 0.1% on 16^3 (the flow is still smooth there).
    from systolic.workloads.sim.taylor_green import load_reference

    reference = load_reference()
    assert last["dissipation"] == pytest.approx(reference[reference[:, 0] == 0.4, 2][0], rel=1e-3)
