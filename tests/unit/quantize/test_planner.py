"""Memory planner and precision rules, checked against hand arithmetic for DiffusionGemma 26B-A4B."""

from __future__ import annotations

import pytest

from pipeline.errors import DgpipeError
from pipeline.model.config import ModelConfig
from pipeline.resources import load_yaml
from pipeline.targets import check_precision_on_target, precision, target
from quantize.planner import kv_cache_bytes, serving_plan, weight_plan

CFG = ModelConfig.from_dict(load_yaml("models", "diffusiongemma-26b-a4b"))

# hand arithmetic (REFERENCE §1): hidden 2816, 30 layers (25 sliding + 5 global), vocab 262144
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


def test_nvfp4_fits_18_gb_and_fp8_is_about_26_gb():
    high = CFG.text_config.vocab_size * D + 30 * D * 128  # embedding + routers stay bf16 (+ norms, SC)
    nvfp4 = weight_plan(CFG, precision("nvfp4"))
    assert nvfp4.bytes == pytest.approx(LINEAR * 4.5 / 8 + 2 * high, rel=0.01)
    assert nvfp4.bytes < 18e9
    fp8 = weight_plan(CFG, precision("fp8"))
    assert fp8.bytes == pytest.approx(LINEAR + 2 * high, rel=0.01)
    assert 25e9 < fp8.bytes < 27e9
    assert fp8.bytes - LINEAR > V * D * 2  # the tied embedding is the bulk of what stays bf16


def test_kv_cache_ring_buffer_for_sliding_layers():
    per_token_global = 2 * 2 * 512 * 2  # K and V, 2 heads x 512, bf16
    per_token_sliding = 2 * 8 * 256 * 2
    ctx = 32_768
    expected = 5 * per_token_global * ctx + 25 * per_token_sliding * 1023
    assert kv_cache_bytes(CFG, ctx, 1) == expected
    assert kv_cache_bytes(CFG, ctx, 4, bytes_per_value=1) == 2 * expected


def test_serving_plan_per_gpu():
    plans = serving_plan(CFG, precision("nvfp4"), target("sm120"), context=8192, concurrency=1)
    rtx5090 = next(p for p in plans if p.gpu == "RTX-5090")
    assert rtx5090.fits and rtx5090.total_gib < 20
    h100 = serving_plan(CFG, precision("bf16"), target("sm90"), context=8192, concurrency=1)[0]
    assert h100.fits and h100.weights_gib > 45


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
