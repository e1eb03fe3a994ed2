"""Where torch's `F.grouped_mm` has a CUDA kernel and where its fallback reads the group offsets on the host
(which a CUDA graph cannot capture): the model's rule, the dispatch table's bf16 rows and the runtime's
`graph_safe` agree on it."""

from __future__ import annotations

import pytest
import torch

from pipeline.model import network
from pipeline.resources import EMBEDDED_MODEL
from pipeline.runtime import backends
from pipeline.runtime import dispatch as dp


@pytest.mark.parametrize(
    ("capability", "dtype", "reads_host"),
    [((9, 0), torch.bfloat16, False), ((10, 0), torch.bfloat16, False), ((10, 3), torch.bfloat16, False),
     ((8, 9), torch.bfloat16, True), ((12, 0), torch.bfloat16, True), ((8, 0), torch.bfloat16, True),
     ((9, 0), torch.float16, True)],
)  # fmt: skip
def test_grouped_mm_has_a_kernel_for_bf16_on_hopper_and_datacenter_blackwell_only(
    monkeypatch, capability, dtype, reads_host
):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert network.grouped_mm_reads_host(torch.device("cuda"), dtype) is reads_host
    assert (
        network.grouped_mm_reads_host(torch.device("cpu"), dtype) is False
    )  # the CPU kernel reads nothing back


def test_the_dispatch_table_routes_around_the_fallback_where_the_model_finds_no_kernel():
    """Where torch's grouped GEMM has no kernel, the float experts' row names dgpipe's Triton GEMM instead
    (`pipeline.runtime.routed`), on every pass."""
    for arch in dp.ARCHS:
        major = int(arch[2:-1])  # sm89 -> 8, sm120 -> 12
        assert (arch in dp.NO_GROUPED_KERNEL) == (major not in network.GROUPED_MM_KERNEL_MAJORS), arch
        for fmt in ("bf16", "int4_awq"):
            row = dp.dispatch(fmt, arch)
            no_kernel = arch in dp.NO_GROUPED_KERNEL
            assert row.experts.startswith(dp.TRITON_BF16 if no_kernel else "F.grouped_mm bf16"), row.experts
            assert row.triton_rows == (dp.EVERY_PASS if no_kernel else 0), row


def test_a_bf16_model_is_not_graph_safe_where_grouped_mm_reads_the_host(monkeypatch):
    from pipeline.model.checkpoint import load_model

    model = load_model(EMBEDDED_MODEL)[0]
    assert backends.experts_graph_safe(model)
    monkeypatch.setattr(backends, "grouped_mm_reads_host", lambda device, dtype: True)  # an sm89/sm120 GPU
    assert not backends.experts_graph_safe(model)
    # the dense form (every expert on every token: float64 here, fp32 on CUDA) reads nothing on the host
    dense = load_model(EMBEDDED_MODEL, torch.float64)[0]
    assert not dense.layers[0].experts.use_grouped(dense.embed_tokens.weight)
    assert backends.experts_graph_safe(dense)
