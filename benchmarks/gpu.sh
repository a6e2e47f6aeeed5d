#!/usr/bin/env bash
# Step time, tokens/s and MFU of a ~124M GPT-2 and a ~1B Llama on one GPU, in bf16 (model.dtype=auto), with
# JAX's fused attention (jax.nn.dot_product_attention picks cuDNN's kernel on NVIDIA GPUs). Under 8 minutes
# on one H200. Needs jax[cuda12] in the environment (pip install -e '.[cuda]'); nothing is downloaded.
#
#   bash benchmarks/gpu.sh                 # prints a table; JSON lines go to ${OUT:-/tmp}/gpu-bench-*.json
set -euo pipefail
PY=${PYTHON:-python}
OUT=${OUT:-/tmp}
if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")'; then
  echo "benchmarks/gpu.sh: JAX sees no GPU (backend: $("$PY" -c 'import jax; print(jax.default_backend())')). Fix: run it on a GPU machine with jax[cuda12] installed." >&2
  exit 2
fi
"$PY" -c 'import jax; print("devices:", jax.devices())'
export SYSTOLIC_COMPILE_CACHE=${SYSTOLIC_COMPILE_CACHE:-$OUT/xla-cache}
# data.max_bytes keeps corpus reading short; the bench times the train step only.
timeout 200 "$PY" -m systolic bench lm --recipe gpt2-124m --steps 20 --json \
  train.batch_size=32 data.max_bytes=20000000 | tail -n 1 > "$OUT/gpu-bench-gpt2-124m.json"
timeout 260 "$PY" -m systolic bench lm --recipe llama-1b --steps 10 --json \
  train.batch_size=16 data.max_bytes=20000000 | tail -n 1 > "$OUT/gpu-bench-llama-1b.json"
"$PY" - "$OUT" <<'PY'
import json, sys
print(f"{'recipe':<12} {'step ms':>9} {'tokens/s':>11} {'TFLOP/s':>9} {'MFU':>6} {'compile s':>10} {'peak GiB':>9}")
for name in ("gpt2-124m", "llama-1b"):
    r = json.load(open(f"{sys.argv[1]}/gpu-bench-{name}.json"))
    mem = r["peak_memory_bytes"] / 2**30 if r["peak_memory_bytes"] else float("nan")
    print(f"{name:<12} {r['step_time_s'] * 1e3:>9.1f} {r['items_per_s']:>11,.0f} {r['flops_per_s'] / 1e12:>9.1f} "
          f"{100 * r['mfu']:>5.1f}% {r['compile_s']:>10.1f} {mem:>9.1f}")
PY
