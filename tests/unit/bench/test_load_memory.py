"""The load-memory bench: its random quantized checkpoint is what ModelOpt's layout says (every quantized
linear packed, experts one tensor per expert and projection) and loads by both routes; the bench measures
both in fresh processes and refuses bad arguments."""

from __future__ import annotations

import pytest
import torch

from pipeline.bench import load_memory as lm
from pipeline.bench.export_memory import checkpoint_bytes, model_config
from pipeline.errors import DgpipeError
from pipeline.model.checkpoint import load_model
from pipeline.model.modelopt import read_packed_linears
from pipeline.model.validate import validate_checkpoint

CONFIG = "bench-medium"


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_the_random_checkpoint_is_modelopt_layout_and_loads(tmp_path, fmt):
    cfg = model_config(CONFIG, 2)
    size = lm.write_quantized_checkpoint(tmp_path / fmt, cfg, fmt)
    validate_checkpoint(tmp_path / fmt)
    packed = read_packed_linears(tmp_path / fmt)
    t = cfg.text_config
    attention = sum(3 + t.layer_shape(i).is_sliding for i in range(2))  # global layers: no v_proj
    assert len(packed) == attention + 2 * 3 + 2 * 3 * t.num_experts  # + dense MLP + experts, per layer
    assert all(q.input_scale is not None and q.format == fmt for q in packed.values())
    assert size < checkpoint_bytes(cfg)  # packed: smaller than the bf16 model
    model, _ = load_model(tmp_path / fmt, torch.bfloat16)
    assert model.layers[1].experts.gate_up_proj.shape == (
        t.num_experts,
        2 * t.moe_intermediate_size,
        t.hidden_size,
    )
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_the_bench_measures_both_routes_in_fresh_processes(tmp_path):
    r = lm.as_dict(lm.run(CONFIG, 2, "fp8", tmp_path))
    assert set(r["routes"]) == set(lm.ROUTES)
    for route, m in r["routes"].items():
        assert m["peak_rss_gb"] > m["rss_after_imports_gb"] > 0.05, route
        assert m["seconds"] > 0
    assert r["routes"]["tensor-cores"]["device"] == "cpu, standing in for the GPU"
    assert 0 < r["checkpoint_gb"] < r["bf16_model_gb"]
    assert "| tensor-cores |" in lm.render(r)
    assert not any(tmp_path.iterdir())  # the checkpoint is deleted


def test_bad_arguments_are_refused_with_the_fix(tmp_path):
    with pytest.raises(DgpipeError, match="not a quantized format"):
        lm.run(CONFIG, 2, "int8", tmp_path)
    with pytest.raises(DgpipeError, match=r"outside 1\.\.8"):
        lm.run(CONFIG, 9, "fp8", tmp_path)
