#!/usr/bin/env bash
# Step time, tokens/s and MFU of gpt2-124m and llama-1b on one NVIDIA GPU in bfloat16 with cuDNN attention, plus
# cuDNN against XLA attention (llama-1b) and a scanned against a looped layer stack (gpt2-124m): the rows and
# batch sizes are in benchmarks/harness/gpu_bench.py; then the inference engine's output tokens/s
# (benchmarks/studies/serve_engine.py, at most 4 more minutes). Under 12 minutes on one H200. Not yet run on a GPU.
#
# It needs nothing but this tree, a python3 with jax and its CUDA plugin, flax, optax, orbax-checkpoint,
# tokenizers, rich, matplotlib and pyyaml (the GPU machine's image), and the wheels that
# benchmarks/harness/gpu-wheels.sh downloads into .whl/ (at the repository's root: grain and its needs,
# tensorboardX): when .whl/ holds wheels they are installed into $SYSTOLIC_GPU_SH_SITE (default /tmp/site) with no
# registry. systolic itself runs from src/ (no pip install).
# Prints the table; JSON lines, the table and the rows' output go to $OUT (default /tmp/gpu-bench):
# gpu-bench.jsonl, gpu-bench.txt, gpu-bench.log. Exit code 2 when JAX sees no GPU, 1 when a row failed.
#
#   bash benchmarks/harness/gpu-wheels.sh                         # first, here, where the registry is reachable
#   bash benchmarks/harness/gpu.sh                                # on the GPU machine
#   SYSTOLIC_GPU_SH_DRY_RUN=1 bash benchmarks/harness/gpu.sh      # anywhere: the same pipeline, tiny models on CPU
#
# With the device tool (a session that is lent an nvidia-h200), after `bash benchmarks/harness/gpu-wheels.sh` in
# the root of the session's own checkout (the one the tool sends):
#   run(command="bash benchmarks/harness/gpu.sh", carry=[".whl"], timeout_s=600)
# $OUT's three files come back; put the table into docs/benchmarks.md ("GPU (H200)").
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root: .whl/ and src/ are there
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  SITE=${SYSTOLIC_GPU_SH_SITE:-/tmp/site}
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
status=0
"$PY" benchmarks/harness/gpu_bench.py || status=$?
# The serving row: the inference engine alone (benchmarks/studies/serve_engine.py) on llama-1b in bfloat16 with
# random weights, 16 and 64 requests in flight; its table follows the training table, JSON lines in
# $OUT/serve-engine.jsonl.
OUT_DIR=${OUT:-/tmp/gpu-bench}
mkdir -p "$OUT_DIR"
if [ -n "${SYSTOLIC_GPU_SH_DRY_RUN:-}" ]; then
  # tpu_bench.py's SERVE_DRY: few step sizes to compile (the default engine's took minutes on a loaded 2-core CPU)
  serve_args=(--levels 1,4 --prompt 32 --output 16 --max-seqs 4 --max-tokens-per-step 64)
else
  serve_args=(--recipe llama-1b --dtype bfloat16 --levels 16,64 --output 128)
fi
timeout 240 "$PY" benchmarks/studies/serve_engine.py "${serve_args[@]}" --json "$OUT_DIR/serve-engine.jsonl" \
  || { [ "$status" = 0 ] && status=1; }
exit "$status"
