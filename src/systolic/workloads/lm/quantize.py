"""`systolic quantize`: a run's model with its weights stored quantized (lm/model/quant.py), saved as a run
directory of its own that `serve`, `generate` and `eval lm` load without the float checkpoint.

The directory is what `systolic convert from-hf` writes (config.yaml, the tokenizer and its companions, a step-0
parameters-only checkpoint), with the quantized weights (Qwix QArrays: int8 or fp8 values and float32 scales) in
the checkpoint and the scheme in its metadata. It appears complete or not at all. It is for inference: training
from it (init.from) is refused, as are the exports that need float weights.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp

from systolic import config as config_lib
from systolic import outfile
from systolic.data.tokenizer import RUN_FILE, tokenizer_files
from systolic.engine import rundir
from systolic.engine.checkpoint import Checkpointer
from systolic.engine.state import TrainState
from systolic.errors import UserError
from systolic.workloads.lm.loaded_run import LoadedRun, load_run
from systolic.workloads.lm.model import quant

COMMAND = "systolic quantize"


def quantize_run(run_dir: Path, out: Path, scheme: str) -> LoadedRun:
    """Writes `out`: the run `run_dir`'s newest intact checkpoint with its weights quantized by `scheme` (a LoRA
    run merged first). Returns the quantized run as loaded."""
    run_dir, out = Path(run_dir), outfile.check_folder(Path(out), option="--out")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} already exists and is not empty; `{COMMAND}` never overwrites. Fix: pass a new "
                        "directory, or remove this one first.")
    run = load_run(run_dir, COMMAND, quantize=scheme)
    cfg = run.cfg  # as it serves: LoRA merged and model.quant the scheme's (load_run)
    tmp = out.with_name(f".{out.name}.quantizing-{os.getpid()}")
    try:
        tmp.mkdir(parents=True)
        (tmp / rundir.CONFIG_FILE).write_text(config_lib.dump_yaml(cfg), encoding="utf-8")
        if (run_dir / RUN_FILE).is_file():  # the run's own tokenizer and its companions (the chat template)
            for name, path in tokenizer_files(run_dir / RUN_FILE).items():
                shutil.copyfile(path, tmp / name)
        ckpt = Checkpointer(tmp / "checkpoints", cfg.checkpoint)
        state = TrainState(step=jnp.asarray(run.step, jnp.int32), params=run.params, opt_state={},
                           rng=jax.random.PRNGKey(0))
        ckpt.save(state, None, {"workload": "lm", "vocab": run.vocab, "params_only": True,
                                quant.META_KEY: scheme, "source": str(run_dir.absolute())})
        ckpt.wait()
        ckpt.close()
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return run
