#!/usr/bin/env bash
# One prepared check for an accelerator machine (TPU or NVIDIA GPU); finishes in < 8 min.
#   1. the Pallas kernel tests of this platform, run natively against the reference;
#   2. kernel vs reference timings at Llama-3-8B shapes (32 q / 8 KV heads, head_dim 128,
#      pages of 16 and 32; 64 decodes at 2k context; a mixed batch with a 512-token
#      chunk), with the achieved memory bandwidth against the device's peak.
# Needs a Python with jax for the accelerator, pytest and numpy (PYTHON=..., default
# python3); the project itself is taken from this checkout through PYTHONPATH.
#   bash scripts/device_check.sh 2>&1 | tee device_check.log
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
date -u
$PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())" || exit 1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv

echo "== 1. kernel tests, native (tests/test_attention_kernels.py -k kernel) =="
JAXSERVE_NATIVE_KERNELS=1 timeout 270 $PY -m pytest -q -p no:cacheprovider --noconftest \
    tests/test_attention_kernels.py -k kernel --maxfail=5 -rf || status=1

echo "== 2. timings (scripts/bench_attention.py) =="
timeout 180 $PY scripts/bench_attention.py --iters 20 || status=1
exit $status
