#!/usr/bin/env bash
# Downloads into .whl-tpu/ (ignored by git) the wheels that benchmarks/harness/tpu.sh needs on the lent TPU v5e machine
# and that it lacks: that machine reaches no package registry, and its python3 3.11 holds only jax 0.10.2 with
# jaxlib, libtpu, numpy, scipy, pytest and hypothesis (/work/.library/device/KINDS.md). Run it here, on a machine
# that reaches the registry, from the repository root:
#
#   bash benchmarks/harness/tpu-wheels.sh  # 47 wheels, 42 MB; a call that carries them sends at most 64 MiB in all
#
# The list: systolic's dependencies (pyproject.toml) and their needs, minus what the machine has, at the versions
# this project's venv runs (`pip list`, 2026-12-06); 42 of them installed there on 2026-12-06 (NOTES-jax-stack.md,
# "The lent TPU v5e chip"). gymnax (the rl workload) imports matplotlib and seaborn at `import gymnax`, which the
# machine's own index has (`--index-url file:///opt/pypi/simple`): tpu.sh's rl part installs them from there, so
# they do not travel. chex does not travel either: neither systolic nor gymnax 1.0.1 imports it. Each wheel comes
# without its dependencies (--no-deps); one version of each (two stop the install). Check a wheel's needs with
#   unzip -p .whl-tpu/NAME-*.whl '*/METADATA' | grep ^Requires-Dist
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root, where tpu.sh looks for .whl-tpu/
WHEELS=(
  # the data pipeline (data/text.py) and its needs
  grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 cloudpickle==3.1.3 protobuf==7.36.2 psutil==7.2.2
  # models, optimizers, checkpoints, quantisation
  flax==0.12.8 optax==0.2.8 orbax-checkpoint==0.12.8 tensorstore==0.1.86 qwix==0.1.8 treescope==0.1.10
  msgpack==1.2.4 etils==1.15.0 fsspec==2026.9.0 zipp==4.1.2 typing-extensions==4.16.0 absl-py==2.5.1
  humanize==4.17.0 simplejson==4.3.0 aiofiles==25.1.0 uvloop==0.23.0 flatbuffers==25.12.19 six==1.17.0
  rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0
  # observe (TensorBoard, Prometheus), config, tokenizers, safetensors
  tensorboardX==2.6.5 prometheus-client==0.26.0 pyyaml==6.0.4 tokenizers==0.23.3 safetensors==0.8.0
  jinja2==3.1.6 markupsafe==3.0.4
  # the server (systolic serve)
  starlette==1.10.0 anyio==4.16.0 sniffio==1.3.1 idna==3.21 uvicorn==0.55.0 h11==0.16.0 click==8.5.1
  # the rl workload: gymnax and what it imports (matplotlib and seaborn come from the machine's index, above)
  gymnax==1.0.1 gymnasium==1.3.0 farama-notifications==0.0.6
  # the sim part's peer (benchmarks/peers/sim_vs_jax_cfd.py): pure Python; it needs jax, numpy and scipy (the machine's)
  # and tree-math, which needs only jax
  jax-cfd==0.2.1 tree-math==0.2.1
)
PY=${PYTHON:-python3}
rm -rf .whl-tpu && mkdir .whl-tpu
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl-tpu "${WHEELS[@]}"
echo "$(ls .whl-tpu/*.whl | wc -l) wheels, $(du -sh .whl-tpu | cut -f1)"
