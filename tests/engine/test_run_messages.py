"""engine/run.py's end-of-run lines: a run re-run after its last step says it is complete and how to go on (and
nothing else), and a stop is said once."""

from tiny import LM_CLI_QUIET, TINY_LM, call

from systolic.config import CheckpointConfig, LoopConfig, ObserveConfig
from systolic.engine.loop import RunResult
from systolic.engine.run import Run


def test_a_complete_run_run_again_says_so_and_how_to_go_on(tmp_path):
    # TINY_LM as the other CLI tests run it (the compile cache has its programs); its end-of-run report is the
    # validation line (the sample, off here, is skipped by the same early return).
    args = ["train", "lm", *TINY_LM, *LM_CLI_QUIET, "--run-dir", str(tmp_path / "run")]
    code, out, err = call(*args)
    assert code == 0 and "validation: " in out and "already complete" not in out, err
    code, out, err = call(*args)
    assert code == 0, err
    assert "this run is already complete: its checkpoint is at step 10 of train.steps=10" in out, out
    assert "run the same command with train.steps above 10" in out and "pass a new --run-dir" in out
    assert "validation:" not in out  # nothing was trained: no end-of-run report again


def result(start: int, final: int, preempted: bool) -> RunResult:
    return RunResult(state=None, start_step=start, final_step=final, eval_metrics={}, first_metrics={},
                     last_metrics={}, compile_s=None, items_per_s=None, items_done=0, wall_s=0.0, preempted=preempted)


class Cfg:
    loop, checkpoint, observe = LoopConfig(), CheckpointConfig(), ObserveConfig()


def test_a_stop_is_said_once():
    """A signal's stop is said by the loop (on stderr, with the signal's name), so the run's line stays out;
    loop.stop_at_step's stop is said by the run; a finished run says nothing."""
    said: list[str] = []
    run = Run.start(Cfg(), steps=10, eval_every=5, quiet=False)
    run = Run(run.settings, said.append)
    assert run.stopped(result(0, 4, preempted=True)) and said == []
    assert run.stopped(result(0, 4, preempted=False)) and said == [
        "stopped at step 4 of 10 with a checkpoint; run the same command again to continue."]
    assert not run.stopped(result(0, 10, preempted=False)) and len(said) == 1
