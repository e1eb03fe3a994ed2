"""CUDA-graph replay of the denoise loop on a GPU must give exactly the eager runtime's output."""

from __future__ import annotations

import pytest
import torch

from tests._utils.generation import FIXED, generate, requests
from tests._utils.graph_replay import mixed_requests
from tests._utils.tiny import build_tiny


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_graph_replay_equals_eager_on_gpu(dtype):
    """bf16, fp16 and fp32 models on CUDA with the fused sampler: graphs captured once per round, tokens
    identical to eager. The model is finished as a load finishes it (`finish_on_device`): where torch's
    grouped GEMM has no kernel for the dtype (bf16 on Ada and RTX Blackwell, fp16 everywhere) the experts
    route on dgpipe's Triton GEMM, fp32 experts take the dense form, and the network's Triton kernels that
    pass their probes run inside the captured steps. Also over rounds whose rows stop at other steps, with
    templates and log-probabilities (`graph_replay.mixed_requests`, replayed on the CPU by
    tests/unit/runtime/test_graph_replay.py)."""
    from pipeline.runtime.backends import TorchBackend, experts_graph_safe
    from pipeline.runtime.dispatch import ARCHS, arch_of
    from pipeline.runtime.gpu_load import finish_on_device
    from pipeline.sampler.kernels.build import load_torch_extension, missing_build_tools

    missing = missing_build_tools()
    if missing is not None:
        pytest.skip(str(missing))
    if arch_of(*torch.cuda.get_device_capability()) is None:
        pytest.skip(f"{torch.cuda.get_device_name()} has no dispatch row (dgpipe's: {', '.join(ARCHS)})")
    load_torch_extension()
    cuda = torch.device("cuda")
    model = build_tiny(torch.float32, text_config={"hidden_size": 64, "moe_intermediate_size": 32})
    model = model.to(cuda, dtype)
    report = finish_on_device(model, cuda, None, None)
    if not experts_graph_safe(model):  # the Triton GEMM failed its probe: tests/gpu says so too
        pytest.skip(f"the experts read the routing on the host here: {report.summary()}")
    backend = TorchBackend(model)
    assert backend.fused and backend.graph_safe
    for made in (lambda: requests(FIXED), mixed_requests):  # and rounds of rows that stop apart
        rt_eager, eager = generate(backend, made(), graphs=False, sync_every=4)
        rt_graph, graphed = generate(backend, made(), graphs=True, sync_every=4)
        assert rt_graph.loop.captures > 0 and rt_eager.loop.captures == 0
        for a, b in zip(eager, graphed, strict=True):
            assert (a.tokens, a.steps_per_canvas, a.logprobs) == (b.tokens, b.steps_per_canvas, b.logprobs)
