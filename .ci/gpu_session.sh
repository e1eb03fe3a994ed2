#!/usr/bin/env bash
# Everything only a GPU can show, as one command for a lent H200 (device tool: run it with `carry: [".whl"]`).
# Before: fetch the wheels the device image lacks (it has torch, ninja, typer, rich; not pydantic):
#   echo /.whl/ >> .git/info/exclude
#   for p in pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.7.0 typing-inspection==0.4.2; do
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$p"; done
# Results land in $OUT (the device tool brings them back); copy the figures into BENCHMARKS.md.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
echo "== kernel correctness against the PyTorch sampler; CUDA-graph runtime against eager"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_device_loop.py 2>&1 | tee "$OUT/kernels_gpu_tests.txt"
echo "== sampler step: fused kernel vs PyTorch"
timeout 120 python3 -m pipeline.kernels.bench_gpu --out "$OUT" 2>&1 | tee "$OUT/bench_sampler.txt"
echo "== full 26B-A4B configuration, random bf16 weights, 16 fixed steps"
timeout 240 python3 -m pipeline.cli bench model --config diffusiongemma-26b-a4b --batch 1,4 --repeats 5 \
  --device cuda --dtype bfloat16 --out "$OUT" 2>&1 | tee "$OUT/bench_model.txt"
