"""torch.compile'd network passes (`pipeline.runtime.compiled`) against the eager ones they replace."""

from __future__ import annotations

import pytest
import torch

from pipeline.model.config import SamplerConfig
from pipeline.runtime.compiled import compile_model, is_compiled
from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request
from tests._utils.tiny import build_tiny

pytestmark = pytest.mark.slow  # inductor compiles C++ kernels for the layer graphs: ~15 s on two CPU cores


def generate(model, reqs):
    return BlockDiffusionRuntime(model, max_batch=len(reqs), max_len=128).generate(reqs)


def test_compiled_passes_give_the_eager_tokens():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    eager, compiled = build_tiny(seed=3), build_tiny(seed=3)
    eager.cfg.eos_token_id = compiled.cfg.eos_token_id = [999]  # no early end: the whole canvas
    compile_model(compiled)
    assert is_compiled(compiled) and compile_model(compiled) is compiled  # idempotent
    counters.clear()
    sampler = SamplerConfig(max_denoising_steps=4, confidence_threshold=0.0)
    reqs = [
        Request(prompt_ids=list(range(2 + i, 2 + i + n)), max_tokens=8, sampler=sampler, seed=s, request_id=i)
        for i, (n, s) in enumerate(((5, 1), (5, 2)))
    ]
    with torch.inference_mode():
        want, got = generate(eager, reqs), generate(compiled, reqs)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert len(want[0].tokens) == 8
    # the layers ran compiled: a few graphs shared by all layers (per layer kind and pass), none broken
    # (the routed experts enter as the custom op)
    graphs = counters["stats"]["unique_graphs"]
    assert 2 <= graphs <= 16, graphs
    assert not counters["graph_break"], dict(counters["graph_break"])


# a tiny model with 16-byte aligned expert sizes in bf16, which torch's grouped GEMM needs
SIZES = {
    "hidden_size": 64,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "head_dim": 32,
    "global_head_dim": 64,
}


def _fp8_tiny(monkeypatch):
    """A tiny bf16 model whose linears and experts are the tensor-core FP8 modules, on the CPU (scaled_mm runs
    there; the grouped GEMM is one F.scaled_mm per expert, bf16 out as on the GPU)."""
    import torch.nn.functional as F

    from pipeline.runtime import tensor_cores as tc
    from tests._utils.quantized import grouped_scaled_mm_on_cpu, packed_linear

    monkeypatch.setattr(F, "scaled_grouped_mm", grouped_scaled_mm_on_cpu(torch.bfloat16))
    gen = torch.Generator().manual_seed(0)
    model, cpu = build_tiny(torch.bfloat16, seed=3, text_config=SIZES), torch.device("cpu")
    torch.manual_seed(0)
    for layer in model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, m in list(parent.named_children()):
                if isinstance(m, torch.nn.Linear):
                    q = packed_linear("fp8", m.out_features, m.in_features, gen)
                    setattr(parent, name, tc.ScaledLinear(q, "fp8", cpu, torch.bfloat16))
        e, two_i, d = layer.experts.gate_up_proj.shape
        mk = lambda n, k, e=e: [packed_linear("fp8", n, k, gen) for _ in range(e)]
        layer.experts = tc.ScaledExperts(mk(two_i // 2, d), mk(two_i // 2, d), mk(d, two_i // 2), "fp8", cpu)
    return model


def _denoise_logits(model) -> torch.Tensor:
    from pipeline.model.network import canvas_positions
    from pipeline.runtime.kv_cache import KVCache, attention_masks

    cache, slots, g = (
        KVCache(model.cfg, 2, 64, torch.bfloat16),
        torch.arange(2),
        torch.Generator().manual_seed(5),
    )
    pos = canvas_positions(cache.lengths[slots], 9)
    ones = torch.ones_like(pos, dtype=torch.bool)
    with torch.inference_mode():
        prompt = torch.randint(3, 24, (2, 9), generator=g)
        cache.write(
            slots,
            model.encode_kv(prompt, pos, attention_masks(pos, ones, None, True, cache.window)),
            pos,
            ones,
        )
        past, meta = cache.read(slots)
        cpos = canvas_positions(cache.lengths[slots], 8)
        masks = attention_masks(cpos, torch.ones_like(cpos, dtype=torch.bool), meta, False, cache.window)
        soft = torch.randn(2, 8, 64, generator=g).bfloat16()
        return model.denoise_soft(torch.randint(0, 24, (2, 8), generator=g), soft, cpos, masks, past).float()


def test_tensor_core_layers_compile_whole_and_compute_the_eager_pass(monkeypatch):
    """The FP8 modules inside compiled layers: no graph break (their vendor GEMMs are opaque ops, the
    quantization around them traced), one graph per layer kind and pass, and the eager logits. Measured
    noise: inductor keeps fused bf16 intermediates in fp32, which moves FP8 codes that sit on a rounding
    boundary: 22% relative L2 from eager on this random model; with the casts emulated 4.8% (the same model
    unquantized: 3.7%)."""

    eager, compiled = _fp8_tiny(monkeypatch), _fp8_tiny(monkeypatch)
    compiled.load_state_dict(eager.state_dict())  # the same FP8 weights and scales
    assert _compiled_layers_distance(eager, compiled) < 0.1


def _compiled_layers_distance(eager, compiled) -> float:
    """`compiled` compiled by layer and run as `eager` is: no graph break, one graph per layer kind and pass
    (prefill: sliding; denoise: sliding, global); returns the relative L2 of its logits from eager's."""
    from torch._dynamo.utils import counters

    want = _denoise_logits(eager)
    compile_model(compiled)
    counters.clear()
    with torch._inductor.config.patch(emulate_precision_casts=True):
        got = _denoise_logits(compiled)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 3
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("triton", [False, True])
def test_float_experts_routed_on_the_device_compile_in_the_layers(triton):
    """`pipeline.runtime.routed` inside compiled layers: torch's grouped GEMM traced with a quantized
    checkpoint's input rounding (FP8 on B200), or the Triton GEMM as its opaque op (Ada, RTX Blackwell;
    Triton's interpreter here): no graph break, one graph per layer kind and pass, the eager logits."""
    import os

    from pipeline.model.fake_quant import InputQuantizer
    from pipeline.runtime import routed

    if triton and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is on where no GPU is")
    quants = (
        None
        if triton
        else {
            "gate_up": InputQuantizer("fp8", torch.tensor(0.02)),
            "down": InputQuantizer("fp8", torch.tensor(0.01)),
        }
    )
    models = [build_tiny(torch.bfloat16, seed=3, text_config=SIZES) for _ in range(2)]
    for m in models:
        for layer in m.layers:
            layer.experts = routed.RoutedExperts(layer.experts, triton, quants)
    eager, compiled = models
    # one layer's experts compiled vs eager: 0.3% (bf16 outputs); through this tiny random model's 8 layers
    # and softcap the logits move 2-15% (3 seeds, both forms), the eager experts' own bf16 noise amplified
    assert _compiled_layers_distance(eager, compiled) < 0.25
    experts = eager.layers[0].experts
    gen = torch.Generator().manual_seed(0)
    x, index = (
        torch.randn(16, 64, generator=gen).bfloat16(),
        torch.randint(0, experts.num_experts, (16, 2), generator=gen),
    )
    weights = torch.rand(16, 2, generator=gen)
    with torch.inference_mode():
        one = torch.compile(experts, fullgraph=True)(x, index, weights).float()
        ref = experts(x, index, weights).float()
    assert float((one - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bf16_grouped_experts_are_traced_and_other_dtypes_run_as_one_opaque_op(dtype):
    """bf16 experts (Hopper, B200) enter the compiled graph as torch's grouped GEMMs with the routing, gated
    GeLU and combine around them, which inductor fuses (the fused kernels' own forms stay out of compilers);
    other dtypes, which torch's fake grouped GEMM refuses, as `dgpipe::routed_experts`. The same output."""
    from pipeline.runtime.compiled import _register_routed_experts_op
    from tests._utils.compile import compiled_whole, graph_targets

    _register_routed_experts_op()
    experts = build_tiny(dtype, seed=3, text_config=SIZES).layers[0].experts
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, experts.gate_up_proj.shape[2], generator=gen).to(dtype)
    index = torch.randint(0, experts.num_experts, (16, 2), generator=gen)
    weights = torch.rand(16, 2, generator=gen).to(dtype)
    compiled, graphs = compiled_whole(experts)
    with torch.inference_mode():
        got, want = compiled(x, index, weights), experts(x, index, weights)
    targets = graph_targets(graphs[0])
    opaque = any("routed_experts" in t for t in targets)
    assert opaque == (dtype != torch.bfloat16), targets
    assert any("grouped_mm" in t for t in targets) == (dtype == torch.bfloat16)
    torch.testing.assert_close(got, want)
