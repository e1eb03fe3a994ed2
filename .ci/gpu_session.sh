#!/usr/bin/env bash
# Everything only a GPU can show, as one command on a CUDA host: the GPU tests (fused sampler kernels
# against the PyTorch oracle, CUDA-graph runtime against eager), the TensorRT engine test (needs
# TensorRT) and the MoE plugin kernel, the sampler benchmark, and the full-size 26B-A4B configuration
# with random bf16 weights. Needs torch with CUDA, nvcc, and dgpipe's dependencies
# (pip install -e '.[test,bench]'). Results go to $OUT (default: ./gpu-results); copy the figures into
# BENCHMARKS.md with the GPU name from gpu.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
echo "== kernel correctness against the PyTorch sampler; CUDA-graph runtime against eager"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu \
  --ignore=tests/gpu/test_engine_trt.py --ignore=tests/gpu/test_moe_kernel_cuda.py 2>&1 | tee "$OUT/gpu_tests.txt"
echo "== TensorRT: the tiny model's bf16 engine for this GPU's target vs the PyTorch runtime; MoE plugin kernel"
python3 -c "from pipeline.engine.probe import tensorrt_version as v; print('TensorRT', v() or 'NOT INSTALLED: pip install tensorrt-cu13 (the engine test skips without it)')" \
  2>&1 | tee "$OUT/engine_tests.txt"
timeout 600 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_engine_trt.py tests/gpu/test_moe_kernel_cuda.py \
  2>&1 | tee -a "$OUT/engine_tests.txt"
echo "== sampler step: fused kernel vs PyTorch"
timeout 120 python3 -m pipeline.bench.gpu_sampler --out "$OUT" 2>&1 | tee "$OUT/bench_sampler.txt"
echo "== full 26B-A4B configuration, random bf16 weights, 16 fixed steps"
timeout 240 python3 -m pipeline.cli bench model --config diffusiongemma-26b-a4b --batch 1,4 --repeats 5 \
  --device cuda --dtype bfloat16 --out "$OUT" 2>&1 | tee "$OUT/bench_model.txt"
