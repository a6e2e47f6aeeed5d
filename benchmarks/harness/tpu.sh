#!/usr/bin/env bash
# systolic on one TPU v5e chip, in parts (benchmarks/harness/tpu_bench.py holds the rows and the budgets):
#   test   `pytest -m tpu` (tests/tpu/: splash against XLA attention, 50 steps against the CPU's, checkpoints across
#          platforms and a bit-exact resume, an int8 x int8 train step, rl, gan and sim runs against the CPU's), one
#          process
#   train  `systolic bench lm` rows: gpt2-124m, llama-1b cut to 8 layers, llama-1b-v5e; step time, tokens/s, MFU
#          against the 197 TFLOP/s bf16 data sheet, compile time
#   serve  benchmarks/studies/serve_engine.py, bfloat16: llama-1b at 1/16/64/256 requests in flight, gemma3-1b at
#          1/64, a Gemma-2B shape at 64/256 (tok/s, TTFT, TPOT, warm-up)
#   serve-int8  benchmarks/studies/serve_engine.py, quantized weights drawn quantized: llama-1b with --quantize w8a8
#          and in bfloat16 at 64/256, then a Llama-3-8B shape with int8 weights and an int8 KV cache at 1/64 (bf16
#          weights do not fit one chip)
#   serve-steps  benchmarks/studies/serve_engine.py with more tokens a step (--max-tokens-per-step): llama-1b in
#          bfloat16 with 1,024 (1/64/256 in flight) and 256 (64/256), w8a8 with 1,024 (64/256), gemma3-1b with 512
#          (1/64), then the Llama-3-8B shape with int8 weights (1/64)
#   rl     benchmarks/peers/rl_vs_purejaxrl.py, one alternated pair each: PPO on CartPole with 2,048 environments x 8
#          seeds, then the rl-cartpole recipe (8 x 4), then the recipe with rl.unroll=8 (a quarter of its steps),
#          systolic against PureJaxRL's ppo.py: env steps/s, final return
#   sim    float32: benchmarks/peers/sim_vs_jax_cfd.py at 1024^2 (2-D turbulence, systolic against jax-cfd: steps/s
#          and agreement), benchmarks/studies/dns3d_fft_share.py at 128^3 and 256^3 (Taylor-Green DNS: steps/s, the
#          FFTs' share and their memory roofline), then `systolic simulate` sim-turbulence on 1024^2 if the budget
#          leaves time
#   gan    `systolic train gan --recipe gan-dcgan-64` on the bundled digits: images/s and MFU
# Default: all eight in order. One command there runs at most 10 minutes: the parts named share 8 minutes, each
# within its own budget, and a row that would start with too little left says "skipped: budget".
#
# It needs this tree, the machine's python3 3.11 with jax 0.10.2 and libtpu (PYTHONPATH names their folder: this
# appends to it), and the wheels that benchmarks/harness/tpu-wheels.sh downloads into .whl-tpu/ (at the repository's
# root, as .jax-cache/): when that holds wheels they are installed into $SYSTOLIC_TPU_SH_SITE (default /tmp/site) with
# no registry. matplotlib and seaborn (gymnax imports them; the rl part) and scikit-learn and pillow (the gan part's
# bundled digits) come from the machine's own index when it has one. systolic runs from src/ (no pip install).
# JAX's persistent compilation cache is .jax-cache/ (ignored; carry it to reuse compiles from an earlier call).
# Prints the table; in $OUT (default /tmp/tpu-bench): tpu-bench.txt, tpu-bench.jsonl, tpu-bench.log, pytest.xml,
# serve-engine.jsonl, sim.jsonl. Exit code 2 when JAX sees no TPU, 1 when a row failed.
#
#   bash benchmarks/harness/tpu-wheels.sh                       # first, here, where the registry is reachable
#   bash benchmarks/harness/tpu.sh test train                   # on the TPU machine
#   SYSTOLIC_TPU_SH_DRY_RUN=1 bash benchmarks/harness/tpu.sh    # anywhere: the same pipeline, tiny models on CPU
#   bash benchmarks/harness/tpu.sh env python3 benchmarks/kernels/splash_blocks.py    # any command, same environment
#
# With the device tool (a session lent a tpu-v5e), after `bash benchmarks/harness/tpu-wheels.sh` in the root of the
# session's own checkout (the one the tool sends):
#   run(command="bash benchmarks/harness/tpu.sh test train", carry=[".whl-tpu", ".jax-cache"], timeout_s=600)
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root: .whl-tpu/, .jax-cache/ and src/ are there
PY=${PYTHON:-python3}
SITE=${SYSTOLIC_TPU_SH_SITE:-/tmp/site}
if compgen -G ".whl-tpu/*.whl" >/dev/null; then
  # Appended: the machine's own jax, jaxlib and numpy stay first.
  PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" .whl-tpu/*.whl
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$SITE"
fi
# Only the rl part needs matplotlib and seaborn (gymnax imports both), only the gan part scikit-learn and pillow (its
# bundled digits), and the test part both (tests/tpu/test_workload_parity.py runs rl and gan); the others start
# sooner without.
from_index=()
if [ $# -eq 0 ] || [ "$1" = env ] || [[ " $* " == *" rl "* || " $* " == *" test "* ]]; then
  "$PY" -c "import matplotlib, seaborn" 2>/dev/null || from_index+=(matplotlib seaborn)
fi
if [ $# -eq 0 ] || [[ " $* " == *" gan "* || " $* " == *" test "* ]]; then
  "$PY" -c "import sklearn, PIL" 2>/dev/null || from_index+=(scikit-learn pillow)
fi
if [ ${#from_index[@]} -gt 0 ] && [ -d /opt/pypi/simple ]; then
  # The machine's own index (KINDS.md), into a folder of its own, appended last so that numpy stays the machine's.
  PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated -q --only-binary=:all: --no-cache-dir \
    --index-url file:///opt/pypi/simple --target "$SITE-index" "${from_index[@]}" \
    && export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$SITE-index" \
    || echo "tpu.sh: ${from_index[*]} did not install from /opt/pypi"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${SYSTOLIC_TPU_SH_DRY_RUN:-}" ]; then
  # CPU programs stay out of .jax-cache/, which a call to the chip may carry (64 MiB in all).
  export JAX_PLATFORMS=cpu SYSTOLIC_COMPILE_CACHE=${SYSTOLIC_COMPILE_CACHE:-${TMPDIR:-/tmp}/systolic-tpu-sh-dry-xla}
fi
export SYSTOLIC_COMPILE_CACHE=${SYSTOLIC_COMPILE_CACHE:-$PWD/.jax-cache}
if [ "${1:-}" = env ]; then
  # `tpu.sh env CMD ...`: CMD alone in this environment (the wheels installed, src/ and them on PYTHONPATH), no
  # table: the chip's probes, e.g. `bash benchmarks/harness/tpu.sh env python3 benchmarks/peers/rl_profile.py`.
  shift
  exec "$@"
fi
exec "$PY" benchmarks/harness/tpu_bench.py "$@"
