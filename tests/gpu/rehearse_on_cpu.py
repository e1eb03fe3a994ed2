"""Run tests/gpu's tests of dgpipe's Triton kernels and tensor-core modules on a machine without a GPU, at
their own sizes, before a GPU runs them.

    python tests/gpu/rehearse_on_cpu.py [TEST ...]      (default: every test in `REHEARSED`; ~30 min)

The kernels run in Triton's interpreter with a GPU's round-to-nearest-even casts and numpy's tanh and exp
for libdevice's (`tests/_utils/interpreter_casts`); the tests' CUDA device is the CPU; torch's top-k gets
CUDA's rule at a tie, the lower index (`aten/src/ATen/native/cuda/TensorTopK.cu` fills the last places with
the first equal values it sees; the CPU's takes others); the load's install is
`gpu_load.finish_on_device`'s CUDA part (sibling linears on one input, q|k|v and gate|up merged into one GEMM
each, then `fuse_network`) with every network kernel's probe passed, and a CUDA graph is a second eager call.
The tensor-core tests run as on an H200: the load-time probe passed for every form Hopper's dispatch rows
name, torch's CPU `F.scaled_mm` for the FP8 GEMMs (its grouped form, CUDA-only, one `F.scaled_mm` per expert
with bf16 out: `tests/_utils/quantized.grouped_scaled_mm_on_cpu`), activations quantized by the one-pass
kernels as on CUDA, and an H200's shared memory for the tuner's tiles. Tests of the GPU's own arithmetic
(fast accumulation, torch's CUDA GeLU bit for bit, the memory-efficient attention kernel), of CUDA graphs
and of the CUDA sampler are not rehearsed. So each test holds the kernels to torch's CPU forms: a check of its own bounds at its own sizes, where a
bound too tight for a sum in another order shows (torch's CUDA norms add in yet another order), not a GPU
result. Exit status 1 if any test failed."""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT))

from tests._utils.interpreter_casts import install_numpy_libdevice, install_rne_casts  # noqa: E402

REHEARSED = (
    "test_scaled_linear_equals_reference",
    "test_sibling_linears_on_one_quantization_and_one_gemm_equal_the_linears_alone",
    "test_scaled_experts_equal_fake_quant_experts",
    "test_triton_moe_gemm_is_the_float_product_of_its_operands",
    "test_the_tuners_tiles_compute_the_float_product_too",
    "test_triton_quantization_is_torchs_bit_for_bit",
    "test_triton_nvfp4_quantization_is_torchs_bit_for_bit",
    "test_the_triton_float_probe_passes_on_this_gpu",
    "test_the_layer_end_kernel_is_torchs_but_for_its_norms_sums",
    "test_the_ffn_inputs_kernel_is_torchs_but_for_its_norms_sums",
    "test_the_routing_kernels_choose_torchs_experts_and_order_them_as_its_sort",
    "test_the_norm_to_fp8_kernel_is_torchs_but_for_its_norms_sums",
    "test_the_norm_to_nvfp4_kernel_quantizes_what_it_normed_as_torch_would",
    "test_the_head_norms_kernel_is_torchs_but_for_its_norms_sums",
    "test_the_chain_kernels_are_torchs_forms_and_a_model_keeps_its_logits",
)


# what the tiles test reads of the GPU: an H200's shared memory per block (opt-in)
H200 = SimpleNamespace(
    name="NVIDIA H200", shared_memory_per_block_optin=232448, shared_memory_per_block=49152
)


def route_scores_with_cuda_ties(scores: torch.Tensor, k: int, per_expert_scale: torch.Tensor):
    """`network.route_scores` with torch's CUDA top-k rule at a tie: the lower expert first."""
    probs = F.softmax(scores, dim=-1, dtype=torch.float32)
    weights, index = (t[..., :k] for t in torch.sort(probs, dim=-1, descending=True, stable=True))
    return probs, weights / weights.sum(dim=-1, keepdim=True) * per_expert_scale[index], index


def cases(test) -> list[tuple[str, dict]]:
    """A test's calls as pytest makes them from its `parametrize` marks (their product): (id, arguments)."""
    calls = [("", {})]
    for mark in getattr(test, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names, values = mark.args[:2]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        rows = [v if len(names) > 1 else (v,) for v in values]
        calls = [
            (
                f"{ident}-{'-'.join(map(str, row))}".lstrip("-"),
                {**kwargs, **dict(zip(names, row, strict=True))},
            )
            for row in rows
            for ident, kwargs in calls
        ]
    return calls


def rehearse(names: list[str]) -> int:
    """Run the named tests of tests/gpu/test_tensor_cores_cuda.py as described above; how many failed."""
    import pipeline.bench.model as bench_model
    from pipeline.bench.gpu.fake_cuda import cuda_scaled_mm_checks
    from pipeline.model import network
    from pipeline.runtime import gpu_load, kernels, probe
    from pipeline.runtime import tensor_cores as tc
    from tests._utils.quantized import grouped_scaled_mm_on_cpu

    spec = importlib.util.spec_from_file_location("gpu_tests", ROOT / "tests/gpu/test_tensor_cores_cuda.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    every_kernel = probe.Probe("sm90", {f"{kind}:{mode}": None for kind, mode, _ in probe.NETWORK_FORMS})
    hopper = probe.Probe("sm90", {f"{kind}:{mode}": None for kind, mode, _ in probe.probe_plan("sm90")})
    failed = 0
    with pytest.MonkeyPatch.context() as mp:
        torch.set_num_threads(1)
        install_rne_casts(mp)
        install_numpy_libdevice(mp, "tanh")
        install_numpy_libdevice(mp, "exp")
        mp.setattr(module, "CUDA", torch.device("cpu"))
        mp.setattr(kernels.moe, "unavailable", lambda device: None)
        mp.setattr(tc, "in_one_pass", lambda triton, x: triton)  # the one-pass quantization, as on CUDA
        mp.setattr(F, "scaled_grouped_mm", grouped_scaled_mm_on_cpu(torch.bfloat16))
        mp.setattr(
            torch, "_scaled_mm_v2", cuda_scaled_mm_checks(torch._scaled_mm_v2)
        )  # CUDA's argument checks
        mp.setattr(torch.cuda, "get_device_properties", lambda device=None: H200)
        mp.setattr(network, "route_scores", route_scores_with_cuda_ties)

        def finish_as_on_cuda(model, *_):
            """`finish_on_device`'s CUDA part: sibling linears on one input (q|k|v and gate|up merged into one
            GEMM each), then every network kernel."""
            columns_read = model.embed_tokens.weight.dtype in gpu_load.NETWORK_DTYPES
            gpu_load.share_inputs(model, merge_qkv=columns_read, fp8_columns=hopper.ok(gpu_load.FP8_COLUMNS))
            return gpu_load.fuse_network(model, every_kernel, None)

        mp.setattr(gpu_load, "finish_on_device", finish_as_on_cuda)
        mp.setattr(bench_model, "_graphed", lambda step, device: (step(), step)[1])
        for name in names:
            test = getattr(module, name)
            for ident, kwargs in cases(test):
                if "probed" in inspect.signature(test).parameters:
                    kwargs = {**kwargs, "probed": hopper}
                label, start = f"{name}[{ident}]" if ident else name, time.monotonic()
                try:
                    with torch.no_grad():
                        test(**kwargs)
                    print(f"passed  {label} ({time.monotonic() - start:.0f} s)", flush=True)
                except pytest.skip.Exception as e:
                    print(f"skipped {label}: {e.msg}", flush=True)
                except Exception:
                    failed += 1
                    print(f"FAILED  {label} ({time.monotonic() - start:.0f} s)", flush=True)
                    traceback.print_exc(limit=-2)
    return failed


if __name__ == "__main__":
    sys.exit(1 if rehearse(sys.argv[1:] or list(REHEARSED)) else 0)
