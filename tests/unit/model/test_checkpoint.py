"""Checkpoint loading: HF layout, shards, skipped vision tower, and clear errors for broken directories."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.errors import CheckpointError
from pipeline.model import checkpoint as ck
from tests._utils.tiny import build_tiny


def _assert_same_state(model, ref) -> None:
    """Same tensor names (none missing, none extra) and bit-equal values."""
    got, want = model.state_dict(), ref.state_dict()
    assert list(got) == list(want)
    for (name, a), b in zip(got.items(), want.values(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_roundtrip_and_sharded(tiny_checkpoint: Path, tmp_path: Path):
    model, _ = ck.load_model(tiny_checkpoint)
    ref = build_tiny()
    _assert_same_state(model, ref)
    # split into two shards with an index, as large checkpoints are published
    shard_dir = tmp_path / "sharded"
    shutil.copytree(tiny_checkpoint, shard_dir)
    tensors = load_file(shard_dir / "model.safetensors")
    (shard_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    wmap = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, shard_dir / fname)
        wmap.update(dict.fromkeys(part, fname))
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    sharded, _ = ck.load_model(shard_dir)
    _assert_same_state(sharded, ref)


def test_vision_tower_is_never_read(tiny_checkpoint: Path, monkeypatch):
    tensors = load_file(tiny_checkpoint / "model.safetensors")
    tensors["model.encoder.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"] = torch.randn(64, 32)
    tensors["model.encoder.embed_vision.embedding_projection.weight"] = torch.randn(32, 32)
    save_file(tensors, tiny_checkpoint / "model.safetensors")
    read: list[str] = []
    real_open = ck.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.inner = real_open(*a, **k)

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

        def __getattr__(self, item):
            return getattr(self.inner, item)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(ck, "safe_open", Spy)
    ck.load_model(tiny_checkpoint)
    assert read and not [n for n in read if "vision" in n]


def test_per_expert_layout_is_fused(tiny_checkpoint: Path):
    """ModelOpt / vLLM write one tensor per expert and projection; the runtime fuses them back."""
    tensors = load_file(tiny_checkpoint / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            inner = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = t[e, :inner].contiguous()
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = t[e, inner:].contiguous()
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = t[e].contiguous()
        else:
            out[name] = t
    save_file(out, tiny_checkpoint / "model.safetensors")
    model, _ = ck.load_model(tiny_checkpoint)
    _assert_same_state(model, build_tiny())  # every layer's gate_up and down, every expert in its place


def _expect(path: Path, pattern: str) -> None:
    with pytest.raises(CheckpointError, match=pattern):
        ck.load_model(path)


def test_missing_directory_and_files(tiny_checkpoint: Path, tmp_path: Path):
    _expect(tmp_path / "nope", "no such checkpoint directory")
    (tiny_checkpoint / "config.json").rename(tmp_path / "c.json")
    _expect(tiny_checkpoint, r"not a checkpoint \(no config\.json\)")
    (tmp_path / "c.json").rename(tiny_checkpoint / "config.json")
    (tiny_checkpoint / "model.safetensors").unlink()
    _expect(tiny_checkpoint, "no model.safetensors")
    (tiny_checkpoint / "pytorch_model.bin").write_bytes(b"pickle")
    _expect(tiny_checkpoint, "safetensors only")


def test_corrupt_and_inconsistent(tiny_checkpoint: Path):
    cfg_path = tiny_checkpoint / "config.json"
    good = cfg_path.read_text()
    cfg_path.write_text(good[:-20])
    _expect(tiny_checkpoint, "not valid JSON")
    cfg = json.loads(good)
    cfg_path.write_text(json.dumps({**cfg, "model_type": "llama"}))
    _expect(tiny_checkpoint, "model_type.*expected 'diffusion_gemma'")
    cfg_path.write_text(
        json.dumps({**cfg, "tie_word_embeddings": False})
    )  # the head is read from the embedding
    _expect(tiny_checkpoint, "tie_word_embeddings is false")
    cfg_path.write_text(json.dumps({**cfg, "text_config": {**cfg["text_config"], "hidden_size": 48}}))
    _expect(tiny_checkpoint, r"has shape .* config.json implies")
    cfg_path.write_text(good)
    tensors = load_file(tiny_checkpoint / "model.safetensors")
    del tensors["model.decoder.layers.1.router.proj.weight"]
    save_file(tensors, tiny_checkpoint / "model.safetensors")
    _expect(tiny_checkpoint, "layers.1.router.proj.weight' is missing")
    (tiny_checkpoint / "model.safetensors").write_bytes(b"\x00" * 64)
    _expect(tiny_checkpoint, "not a readable safetensors file")


def test_failed_save_leaves_previous_checkpoint(tiny_checkpoint: Path):
    before = (tiny_checkpoint / "model.safetensors").read_bytes()

    class Boom(RuntimeError):
        pass

    with pytest.raises(Boom), ck.atomic_dir(tiny_checkpoint, "a checkpoint", "config.json") as tmp:
        (tmp / "model.safetensors").write_bytes(b"half")
        raise Boom
    assert (tiny_checkpoint / "model.safetensors").read_bytes() == before
    assert not [p for p in tiny_checkpoint.parent.iterdir() if p.name.startswith(".tiny")]


def test_a_linears_activation_scales_go_where_its_weight_is():
    """The scales are read on the CPU; a [K] pre_quant_scale there cannot multiply a GPU activation (a 0-dim
    input scale could, as a scalar). Installed beside a weight on another device (meta stands in for a GPU),
    the hooked linear runs."""
    from pipeline.model.modelopt import QuantizedLoader
    from tests._utils.quantized import quantize

    tensors = {**quantize(torch.randn(8, 16), "fp8"), "pre_quant_scale": torch.full((16,), 2.0)}
    loader = QuantizedLoader({"quant_algo": "FP8"})
    loader.weight("proj.weight", tensors["weight"], tensors.get)
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(16, 8, bias=False, device="meta")
    assert loader.install(model) == 1
    (hook,) = model.proj._forward_pre_hooks.values()
    q = hook.__defaults__[0]
    assert q.pre_quant_scale.device.type == "meta" and q.scale.device.type == "meta"
    assert model.proj(torch.randn(3, 16, device="meta")).shape == (3, 8)


def test_an_awq_pre_quant_scale_on_a_routed_expert_is_refused_not_dropped():
    """The loader applies pre_quant_scale as an input hook on dense linears; on routed experts there is no
    such hook, so dropping it would load silently wrong experts: a clear error instead."""
    from pipeline.errors import CheckpointError
    from pipeline.model.modelopt import QuantizedLoader
    from tests._utils.quantized import quantize

    tensors = {**quantize(torch.randn(8, 16), "fp8"), "pre_quant_scale": torch.full((16,), 2.0)}
    loader = QuantizedLoader({"quant_algo": "FP8"})
    dense = loader.weight("layers.0.mlp.gate_proj.weight", tensors["weight"], tensors.get)
    assert dense.shape == (8, 16) and torch.equal(
        loader.pre_quant_scales["layers.0.mlp.gate_proj"], tensors["pre_quant_scale"]
    )
    with pytest.raises(CheckpointError, match="pre_quant_scale on a routed expert") as e:
        loader.weight("layers.0.experts.3.gate_proj.weight", tensors["weight"], tensors.get)
    assert "dgpipe quantize --precision int4_awq" in str(e.value)
