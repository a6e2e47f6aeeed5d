"""The loop's hooks (`Task.add_hook(fn, every=N)`): when they run, on a toy task through the real loop, across a
stop and resume."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

from systolic.config import CheckpointConfig, LoopConfig, ObserveConfig
from systolic.engine import loop
from systolic.engine.guard import guard_step
from systolic.engine.state import TrainState
from systolic.engine.step import CHECKED, make_train_step


def loss_fn(params, batch, key):
    del batch, key
    return jnp.sum((params["w"] - 1.0) ** 2), {}


def make_task(calls: list[tuple[str, int, int]]) -> loop.Task:
    tx = optax.sgd(0.1)
    params = {"w": jnp.zeros((4,), jnp.float32)}

    def init_state() -> TrainState:
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                          rng=jax.random.PRNGKey(0))

    step = jax.jit(guard_step(make_train_step(loss_fn, tx), check=CHECKED), donate_argnums=0)
    task = loop.Task(workload="toy", abstract_state=jax.eval_shape(init_state), init_state=init_state,
                     train_step=step, data=None, meta={"workload": "toy"})
    # Each call records the hook, the loop's step and the step the state it was handed is at.
    task.add_hook(lambda step, state: calls.append(("every 3", step, int(state.step))), every=3)
    task.add_hook(lambda step, state: calls.append(("every step", step, int(state.step))))
    return task


def run(run_dir: Path, calls: list, stop_at: int = 0) -> loop.RunResult:
    settings = loop.LoopSettings(
        steps=7, eval_every=7, loop=LoopConfig(stop_at_step=stop_at),
        checkpoint=CheckpointConfig(every_steps=1000, async_save=False),
        observe=ObserveConfig(log_every=1, progress="off", tensorboard=False, plot=False),
    )
    return loop.train(make_task(calls), settings, run_dir)


def test_hooks_run_at_multiples_of_every_in_order_and_at_the_same_steps_across_a_resume(tmp_path):
    whole: list = []
    run(tmp_path / "whole", whole)
    assert [step for name, step, _ in whole if name == "every 3"] == [0, 3, 6]  # step 0: a fresh run's first state
    assert [step for name, step, _ in whole if name == "every step"] == list(range(8))
    assert all(step == state_step for _, step, state_step in whole), whole  # each sees the state after its step
    assert whole[:2] == [("every 3", 0, 0), ("every step", 0, 0)]  # in the order they were added

    first: list = []
    assert run(tmp_path / "resumed", first, stop_at=4).final_step == 4
    second: list = []
    result = run(tmp_path / "resumed", second)
    assert result.start_step == 4 and result.final_step == 7
    assert [step for name, step, _ in second if name == "every 3"] == [6]  # not step 4: the resume's start state
    assert first + second == whole


def test_a_hook_runs_every_one_or_more_steps():
    with pytest.raises(ValueError, match="every=0"):
        loop.Hook(lambda step, state: None, every=0)


def test_evaluate_at_start_writes_a_fresh_runs_step_0_eval_row_after_its_hooks(tmp_path):
    """A post-training run's starting point (lm GRPO's held-out reward): step 0's eval row, not again on a resume."""
    import json

    calls: list = []
    task = make_task(calls)
    task.evaluate = lambda state: calls.append(("evaluate", int(state.step), 0)) or {"w0": float(state.params["w"][0])}
    task.evaluate_at_start = True
    settings = loop.LoopSettings(
        steps=4, eval_every=2, loop=LoopConfig(stop_at_step=3),
        checkpoint=CheckpointConfig(every_steps=1000, async_save=False),
        observe=ObserveConfig(log_every=1, progress="off", tensorboard=False, plot=False))
    loop.train(task, settings, tmp_path)
    loop.train(task, dataclasses.replace(settings, loop=LoopConfig()), tmp_path)
    assert calls[:3] == [("every 3", 0, 0), ("every step", 0, 0), ("evaluate", 0, 0)]
    assert [step for name, step, _ in calls if name == "evaluate"] == [0, 2, 4]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["w0"]) for r in rows if r["split"] == "eval"][0] == (0, 0.0)
