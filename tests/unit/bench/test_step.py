"""`dgpipe bench pass`: the FLOP count behind the floor, and the command end to end on a tiny checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from pipeline.model.cost import denoise_pass_flops
from pipeline.model.network import canvas_positions
from pipeline.runtime.kv_cache import KVCache, attention_masks
from tests._utils.tiny import build_tiny


@torch.no_grad()
def test_step_flops_counts_every_matmul_the_step_runs():
    """Against torch's FLOP counter on a real step (self-conditioned denoise pass + next soft embedding)
    with the experts run dense: the counter sees every expert on every token (the count keeps the routed
    top-k) and no SDPA (added by hand: QK^T and PV over the ring-buffered sliding keys and all global ones)."""
    model = build_tiny()
    cfg, t = model.config, model.cfg
    batch, context, length = 2, 9, model.config.canvas_length
    cache = KVCache(t, batch, 64, torch.float32)
    slots = torch.arange(batch)
    pos = canvas_positions(cache.lengths[slots], context)
    ones = torch.ones_like(pos, dtype=torch.bool)
    _, kv = model.encode(
        torch.randint(3, 24, (batch, context)), pos, attention_masks(pos, ones, None, True, 6)
    )
    cache.write(slots, kv, pos, ones)
    past, meta = cache.read(slots)
    cpos = canvas_positions(cache.lengths[slots], length)
    masks = attention_masks(cpos, torch.ones_like(cpos, dtype=torch.bool), meta, False, cache.window)
    canvas = torch.randint(0, 24, (batch, length))
    soft = torch.randn(batch, length, t.hidden_size)
    for layer in model.layers:
        layer.experts.grouped = False
    with FlopCounterMode(display=False) as counter:
        logits = model.denoise_soft(canvas, soft, cpos, masks, past)
        model.soft_embedding(torch.softmax(logits, -1))
    tokens = batch * length
    d, inner = t.hidden_size, t.moe_intermediate_size
    unrouted = t.num_hidden_layers * (t.num_experts - t.top_k_experts) * 2 * 3 * d * inner * tokens
    attention = 0
    for i in range(t.num_hidden_layers):
        s = t.layer_shape(i)
        keys = (min(context, t.sliding_window - 1) if s.is_sliding else context) + length
        assert past[i][0].shape[2] + length == keys  # what the cache really holds
        attention += 2 * 2 * t.num_attention_heads * s.head_dim * keys * tokens
    assert counter.get_total_flops() > 0
    assert (
        denoise_pass_flops(cfg.text_config, batch, cfg.canvas_length, context)
        == counter.get_total_flops() - unrouted + attention
    )


@pytest.mark.slow
def test_bench_pass_cli_on_a_tiny_checkpoint(tmp_path):
    """All three systems on one tiny transformers checkpoint: rows, the split adding up, the ratios."""
    pytest.importorskip("onnxruntime")
    from typer.testing import CliRunner

    from pipeline.cli import app
    from tests._utils.hf_reference import make_hf_checkpoint

    ckpt = make_hf_checkpoint(tmp_path / "ckpt", canvas_length=8, embed_scale=25.0)
    args = ["bench", "pass", "--model", str(ckpt), "--steps", "3", "--rounds", "2", "--context", "5"]
    res = CliRunner().invoke(app, [*args, "--batch", "2", "--out", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads((tmp_path / "out" / "bench_pass.json").read_text())
    assert [x["system"] for x in r["rows"]] == [
        "dgpipe (PyTorch)",
        "transformers generate",
        "onnxruntime (exported graph)",
    ]
    ours = r["rows"][0]
    # the same steps on every arm: 2..N-1 (here step 2 of 3: transformers' step is forward 2 to forward 3,
    # and dgpipe's last step skips the soft embedding), two rounds
    assert ours["samples"] == r["rows"][1]["samples"] == r["rows"][2]["samples"] == 2
    assert 0 < r["rows"][1]["network_ms"] < r["rows"][1]["step_ms"]
    parts = ours["network_ms"] + ours["soft_embedding_ms"] + ours["sampler_ms"]
    assert 0 < parts < 1.5 * ours["step_ms"] and 0 < ours["host_ms"] < ours["step_ms"]
    assert r["floor_ms"] == pytest.approx(1000 * r["flops_per_step"] / (r["matmul_gflop_s"] * 1e9))
    assert r["ratios"]["step_over_floor"] == pytest.approx(ours["step_ms"] / r["floor_ms"])
    assert set(r["ratios"]) >= {"dgpipe_over_transformers_step", "pytorch_over_onnxruntime_step"}
    assert r["generate"] == []  # no prompt format in this checkpoint


def test_bench_pass_refuses_too_few_steps(monkeypatch, capsys):
    """Through the console entry point: exit 2 and one `error:` line, no traceback."""
    import sys

    from pipeline.cli import main

    monkeypatch.setattr(sys, "argv", ["dgpipe", "bench", "pass", "--steps", "2"])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and "'--steps'" in err and "3" in err, err
