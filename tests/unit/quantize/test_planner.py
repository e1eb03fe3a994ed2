"""Memory planner and precision rules, checked against hand arithmetic for DiffusionGemma 26B-A4B."""

from __future__ import annotations

import pytest

from pipeline.errors import DgpipeError
from pipeline.model.config import ModelConfig
from pipeline.runtime.scheduler import BlockDiffusionRuntime
from pipeline.targets import check_precision_on_target, precision, target
from quantize.planner import (
    held_weight_bytes,
    kv_cache_bytes,
    sc_state_bytes_per_sequence,
    serving_plan,
    weight_plan,
    workspace,
    workspace_bytes,
)
from tests._utils.tiny import build_tiny

CFG = ModelConfig.from_yaml("diffusiongemma-26b-a4b")

# hand arithmetic (docs/model.md, "Architecture"): hidden 2816, 30 layers (25 sliding + 5 global), vocab 262144
D, V = 2816, 262_144
SLIDING_ATTN = D * 16 * 256 * 2 + D * 8 * 256 * 2  # q, o + k, v
GLOBAL_ATTN = D * 16 * 512 * 2 + D * 2 * 512  # q, o + shared k (no v_proj)
DENSE = 3 * D * 2112
EXPERTS = 128 * 3 * D * 704
LINEAR = 25 * (SLIDING_ATTN + DENSE + EXPERTS) + 5 * (GLOBAL_ATTN + DENSE + EXPERTS)


def test_parameter_count_is_the_published_25_2b():
    w = weight_plan(CFG, precision("bf16"))
    total = w.quantized_params + w.high_precision_params
    assert total == pytest.approx(25.2e9, rel=0.005)
    assert weight_plan(CFG, precision("fp8")).quantized_params == LINEAR


# Hand count for the tests' tiny config (tests/_utils/tiny.py: hidden 32, 2 query heads, layers
# sliding, sliding, global; dense MLP 48; 4 experts of 16), parameter by parameter:
#   quantized   sliding attn 2 x (q 32x32 + k 16x32 + v 16x32 + o 32x32 = 3,072); global attn q 64x32 +
#               k 32x32 + o 32x64 = 5,120 (no v_proj); 3 x (dense 3x48x32 = 4,608 + experts 4x32x32 +
#               4x32x16 = 6,144)                                                              = 43,520
#   high        embedding 24x32 = 768; per sliding layer q/k norms 2x16 + router scale 32 + per-expert
#               scale 4 + router 4x32 + 7 layer norms x 32 = 420 (global layer: 2x32 q/k norms: 452);
#               final norm 32; self-conditioning norm 32 + 3 x 48x32 = 4,640                 =  6,732
# bytes: high precision stays bf16 (2 B); FP8 1 B; NVFP4 4 bits + one 8-bit scale per 16 = 0.5625 B;
# INT4 AWQ 4 bits + one 16-bit scale per 64 = 0.53125 B.
TINY_QUANTIZED, TINY_HIGH = 43_520, 6_732


@pytest.mark.parametrize(
    ("name", "expected_bytes"),
    [
        ("bf16", (TINY_QUANTIZED + TINY_HIGH) * 2),  # 100,504
        ("fp8", TINY_QUANTIZED + TINY_HIGH * 2),  # 56,984
        ("nvfp4", 24_480 + TINY_HIGH * 2),  # 43,520 x 0.5625 = 24,480 -> 37,944
        ("int4_awq", 23_120 + TINY_HIGH * 2),  # 43,520 x 0.53125 = 23,120 -> 36,584
    ],
)
def test_weight_bytes_of_a_tiny_config_match_a_hand_count(name, expected_bytes):
    from tests._utils.tiny import TINY

    w = weight_plan(ModelConfig.from_dict(TINY), precision(name))
    quantized = 0 if name == "bf16" else TINY_QUANTIZED
    assert (w.quantized_params, w.high_precision_params) == (
        quantized,
        TINY_QUANTIZED + TINY_HIGH - quantized,
    )
    assert w.bytes == expected_bytes


def test_26b_weights_match_the_published_sizes():
    """docs/model.md, "Speed anchors": "fits in 18 GB quantized" (NVFP4), ~25 GB (FP8) of weights per pass; bf16 is the
    25.2B parameters at 2 bytes."""
    nvfp4, fp8, bf16 = (weight_plan(CFG, precision(p)) for p in ("nvfp4", "fp8", "bf16"))
    assert 15e9 < nvfp4.bytes < 18e9
    assert 24e9 < fp8.bytes < 27e9
    assert bf16.bytes == pytest.approx(2 * 25.2e9, rel=0.005)
    assert fp8.bytes - LINEAR > V * D * 2  # the tied embedding is the bulk of what stays bf16


def test_kv_cache_ring_buffer_for_sliding_layers():
    """Global layers hold the context; sliding ones a ring of 1,023 tokens and room for a 256-token canvas's
    K/V past it (the denoise pass writes them there), whatever the context: what the runtime allocates."""
    per_token_global = 2 * 2 * 512 * 2  # K and V, 2 heads x 512, bf16
    per_token_sliding = 2 * 8 * 256 * 2
    for ctx in (32_768, 512):
        expected = 5 * per_token_global * ctx + 25 * per_token_sliding * (1023 + 256)
        assert kv_cache_bytes(CFG, ctx, 1) == expected
        assert kv_cache_bytes(CFG, ctx, 4, bytes_per_value=1) == 2 * expected
    runtime = BlockDiffusionRuntime(build_tiny(), max_batch=3, max_len=96)
    assert kv_cache_bytes(runtime.backend.config, 96, 3, bytes_per_value=4) == runtime.cache.nbytes()


def test_serving_plan_per_gpu():
    """The weights a plan counts are what the runtime holds on the target: an NVFP4 checkpoint's experts as
    FP8 on RTX Blackwell (no grouped GEMM in torch there), still within an RTX 5090."""
    plans = serving_plan(CFG, precision("nvfp4"), target("sm120"), context=8192, concurrency=1)
    rtx5090 = next(p for p in plans if p.gpu == "RTX-5090")
    assert rtx5090.fits and 25 < rtx5090.total_gib < 27 and 23 < rtx5090.weights_gib < 24
    h100 = serving_plan(CFG, precision("bf16"), target("sm90"), context=8192, concurrency=1)[0]
    assert h100.fits and h100.weights_gib > 45


def test_the_weights_held_follow_the_dispatch_row_not_the_checkpoints_format():
    """Where the row reads the format as stored, what the checkpoint stores (B200 NVFP4, Hopper FP8); RTX
    Blackwell's NVFP4 experts at 1 byte a weight; INT4-AWQ dequantized to bf16 on every GPU."""
    held = lambda p, t: held_weight_bytes(CFG, precision(p), target(t))
    stored = lambda p: weight_plan(CFG, precision(p)).bytes
    assert held("nvfp4", "sm100") == stored("nvfp4") and held("fp8", "sm90") == stored("fp8")
    experts = CFG.text_config.num_hidden_layers * CFG.text_config.num_experts * 3 * D * 704
    assert held("nvfp4", "sm120") - stored("nvfp4") == experts * (1 - 0.5625)
    assert all(held("int4_awq", t) == stored("bf16") for t in ("sm89", "sm90", "sm100", "sm120"))


def test_precision_rules():
    check_precision_on_target("fp8", "sm90")
    check_precision_on_target("nvfp4", "sm100")
    check_precision_on_target("nvfp4", "sm120")
    with pytest.raises(DgpipeError, match="use --precision fp8"):
        check_precision_on_target("nvfp4", "hopper")
    with pytest.raises(DgpipeError, match="unknown precision 'fp4'"):
        precision("fp4")
    with pytest.raises(DgpipeError, match="unknown GPU target"):
        target("sm75")


def test_workspace_counts_the_fp32_logits_the_runtime_allocates():
    """26B at 8 concurrent canvases of 256: the logits are fp32 (2.1 GB, not the 1.07 GB of bf16), softcapped
    in place, and the bf16 self-conditioning store (soft embeddings, hidden wide) and its gathered copy sit
    beside them with the fused sampler's bf16 probabilities."""
    cells = 8 * 256 * V
    sc = 8 * 256 * D * 2  # [C, canvas, hidden] bf16
    ws = workspace(CFG, 8)
    assert ws.logits == 2_147_483_648 == 2 * cells * 2
    assert (ws.sc_state, ws.sc_input, ws.sampler_probs) == (sc, sc, cells * 2)
    assert ws.softcap_temporaries == 0
    activations = 8 * 256 * (128 * 704) * 2  # the 128 x 704 MoE intermediate is wider than 8 x hidden
    assert ws.activations == activations
    step = sc + cells * (4 + 2) + activations  # the gathered store, logits, probabilities, activations
    assert workspace_bytes(CFG, 8, graphs=False) == sc + step  # 3.6 GB eagerly, 7.2 GB under CUDA graphs
    # under CUDA graphs the captured step's allocations stay in the graphs' pool beside the warm-up's
    assert ws.graph_pool == step and workspace_bytes(CFG, 8) == sc + 2 * step
    plan = serving_plan(CFG, precision("nvfp4"), target("sm100"), context=8192, concurrency=8)[0]
    assert plan.workspace_gib == round((sc + 2 * step) / 2**30, 2) and plan.prefix_cache_gib == 1.0
    kv = kv_cache_bytes(CFG, 8192, 8)
    assert plan.total_gib == round(
        (weight_plan(CFG, precision("nvfp4")).bytes + kv + sc + 2 * step + 2**30) / 2**30, 2
    )
    assert (
        serving_plan(CFG, precision("nvfp4"), target("sm100"), 8192, 8, prefix_cache_mib=0)[
            0
        ].prefix_cache_gib
        == 0
    )


def test_self_conditioning_state_per_sequence_is_hidden_wide():
    """The self-conditioning state's bound: at most 8 MB per sequence at the 26B's sizes (it was 268 MB of fp32 probs)."""
    assert sc_state_bytes_per_sequence(CFG) == 256 * D * 2 == 1_441_792 <= 8 * 10**6
