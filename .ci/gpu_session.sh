#!/usr/bin/env bash
# Everything only a GPU can show, as one command on a CUDA host: the GPU tests (fused sampler kernels
# against the PyTorch oracle, CUDA-graph runtime against eager), the sampler benchmark, and the full-size
# 26B-A4B configuration with random bf16 weights. Needs torch with CUDA, nvcc, and dgpipe's dependencies
# (pip install -e '.[test,bench]'). Results go to $OUT (default: ./gpu-results); copy the figures into
# BENCHMARKS.md with the GPU name from gpu.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
echo "== kernel correctness against the PyTorch sampler; CUDA-graph runtime against eager"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.txt"
echo "== sampler step: fused kernel vs PyTorch"
timeout 120 python3 -m pipeline.bench.gpu_sampler --out "$OUT" 2>&1 | tee "$OUT/bench_sampler.txt"
echo "== full 26B-A4B configuration, random bf16 weights, 16 fixed steps"
timeout 240 python3 -m pipeline.cli bench model --config diffusiongemma-26b-a4b --batch 1,4 --repeats 5 \
  --device cuda --dtype bfloat16 --out "$OUT" 2>&1 | tee "$OUT/bench_model.txt"
