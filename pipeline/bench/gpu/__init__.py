"""`dgpipe bench gpu`: everything only a GPU can show, as one command that ends within 8 minutes.

The checks, in order, each in its own subprocess under its own time budget (the budgets add up to at most
`TOTAL_BUDGET_S`, so the command ends in time by construction, whatever hangs). Time a check leaves unused,
and the budgets of the checks this host skips, go to the checks after it (`run_bench_gpu`): the GPU tests,
which grow with every kernel, get what a quick kernel build and a GPU without FP4 leave over:
1. build the CUDA sampler kernels (torch extension, nvcc + ninja);
2. the GPU tests (tests/gpu, over `GPU_TEST_WORKERS` processes): fused sampler kernels against the PyTorch
   oracle, CUDA-graph runtime against eager, tensor-core linears/experts against the dequantized reference
   (and the TensorRT checks, which skip without TensorRT);
3. the 26B-A4B random-weight denoise pass in bf16, FP8 and (where the GPU has FP4 tensor cores) NVFP4,
   each format through the kernels `pipeline.runtime.dispatch` picks for this GPU, at batch 1 and 16:
   eager and CUDA-graph milliseconds per pass against its floor: the larger of the byte model's HBM time
   (peak bandwidth from configs/targets, and the measured device copy bandwidth) and its matmuls' time at
   the dense tensor-core peak (`dispatch.compute_ms`: 16 canvases are bound by compute on Hopper); with
   diagnostics: where the time went (profiler), one layer's experts and attention on each kernel that
   can run them, its FP8 sibling linears as one GEMM and apart, and each of the network's one-kernel
   chains against its torch form (`network`);
4. the largest batch whose pass fits in GPU memory (doubling from 16, then to within 8 canvases;
   fastest format).

Needs torch with CUDA, nvcc (and ninja) for the kernels, pytest for the tests; nothing is downloaded.
`--dry-run` lists every check with the reason it would be skipped here, and runs nothing.
Results: `gpu.json` and `gpu.md` (one table) in `--out`.

The modules: `checks` (what runs, its budget, running them in turn), `measure` (the pass and the largest
batch, in the check subprocesses), `layers` and `network` (one layer's attention, experts, sibling linears
and element-wise chains on each kernel that can run them), `report` (the table). Beside them: `sampler`
(the fused sampler kernels timed against the PyTorch step) and, for a machine without a GPU, `trace`
(`dgpipe bench gpu-trace`: every dispatch row's pass on fake CUDA tensors, `fake_cuda`).
"""
