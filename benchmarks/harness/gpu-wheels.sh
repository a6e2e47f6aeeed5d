#!/usr/bin/env bash
# Downloads into .whl/ (ignored by git) the wheels that benchmarks/harness/gpu.sh needs on the GPU machine and that its
# image lacks: that machine reaches no package registry, and its python3 3.12 already holds jax 0.11.2 (CUDA 13),
# flax, optax, orbax-checkpoint, tokenizers, safetensors, rich, matplotlib, pyyaml, numpy, absl-py, etils,
# cloudpickle, protobuf, psutil and packaging (the image's package list: /work/.library/device/KINDS.md).
# Run it here, on a machine that reaches the registry, from the repository root:
#
#   bash benchmarks/harness/gpu-wheels.sh  # ~4 MB: grain, array-record, portpicker, tensorboardX
#
# `systolic bench lm` and `systolic train lm` import grain (the data pipeline, data/text.py) and grain imports
# array_record and portpicker; `train` writes TensorBoard files with tensorboardX (observe.tensorboard). gymnax
# (rl) and scikit-learn (gan) are imported only by their workloads. Each wheel comes without its dependencies
# (--no-deps): the list below is grain's Requires-Dist minus what the image has. One version of each: two
# stop the install there. Check a wheel's needs with
#   unzip -p .whl/NAME-*.whl '*/METADATA' | grep ^Requires-Dist
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root, where gpu.sh looks for .whl/
WHEELS=(
  grain==0.2.18         # the versions tested here (jax 0.10.2 and 0.11.2)
  array-record==0.8.6   # grain: data_sources
  portpicker==1.6.0     # grain: process_prefetch (needs psutil, in the image)
  tensorboardX==2.6.5   # observe.tensorboard (needs numpy, packaging, protobuf, in the image)
)
PY=${PYTHON:-python3}
rm -rf .whl && mkdir .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${WHEELS[@]}"
ls -l .whl
du -sh .whl
