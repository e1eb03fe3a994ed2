"""LoRA merges against each producer's own merge, on adapters the producers wrote (tests/data/producers):
AutoModel's merged model (`LinearLoRA.materialize_effective_weight`, saved by its Checkpointer) and PEFT's
`merge_and_unload` (the merge Unsloth's `save_pretrained_merged` performs), plus the refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.errors import DgpipeError
from pipeline.model import lora
from pipeline.model.source import resolve

D = Path(__file__).resolve().parents[2] / "data" / "producers"


def _merged(tmp_path: Path, adapter: Path) -> dict[str, torch.Tensor]:
    return load_file(resolve(D / "base", adapter, tmp_path) / "model.safetensors")


def test_automodel_keys_name_the_checkpoint_tensors():
    for module in (
        "model.layers.3.self_attn.q_proj",  # AutoModel's single stack
        "model.decoder.layers.3.self_attn.q_proj",  # transformers' decoder
        "model.encoder.language_model.layers.3.self_attn.q_proj",  # its tied encoder copy
    ):
        assert lora.checkpoint_name(module, D) == "model.decoder.layers.3.self_attn.q_proj.weight"


def test_automodel_lora_equals_automodel_merged_model(tmp_path):
    ours = _merged(tmp_path, D / "automodel-lora")
    ref = load_file(resolve(D / "automodel-lora-merged", None, tmp_path) / "model.safetensors")
    base = load_file(D / "base" / "model.safetensors")
    assert ours.keys() == ref.keys()
    adapted = [k for k in ours if not torch.equal(ours[k], base[k])]
    assert len(adapted) == 13  # q/k/o + mlp gate/up/down in 2 layers, v only in the sliding one
    for k in ours:
        if ".experts." in k or "per_expert_scale" in k:
            continue
        # AutoModel keeps its merged weights in float32; the merge here casts to the base dtype (bf16)
        assert torch.equal(ours[k], ref[k].to(ours[k].dtype)), k
    for layer in (0, 1):  # experts are not adapted; AutoModel folded the scale into down_proj
        p = f"model.decoder.layers.{layer}."
        ours_down = ours[p + "experts.down_proj"] * ours[p + "router.per_expert_scale"][:, None, None]
        ref_down = ref[p + "experts.down_proj"] * ref[p + "router.per_expert_scale"][:, None, None]
        torch.testing.assert_close(ours_down.float(), ref_down.float(), atol=0.02, rtol=0.01)  # bf16 products


@pytest.mark.parametrize(
    ("sub", "scale"), [("unsloth-lora", 8 / 4), ("unsloth-lora-rslora-embed", 8 / 4**0.5)]
)
def test_unsloth_lora_equals_peft_merge_and_unload(tmp_path, sub, scale):
    from peft import PeftModel
    from transformers import DiffusionGemmaForBlockDiffusion

    assert lora.read_adapter(D / sub).scaling == scale
    base = DiffusionGemmaForBlockDiffusion.from_pretrained(D / "base", dtype=torch.float32)
    ref = PeftModel.from_pretrained(base, D / sub).merge_and_unload().state_dict()
    ours = _merged(tmp_path, D / sub)
    raw = load_file(D / "base" / "model.safetensors")
    moved = 0
    for k, t in ours.items():
        # PEFT merges in float32 here; the checkpoint is bf16: equal after rounding PEFT's sum
        assert torch.equal(t, ref[k].to(t.dtype)), k
        moved += not torch.equal(t, raw[k])
    assert moved >= 13 + ("embed" in sub)


def _edit_config(tmp_path: Path, **fields) -> Path:
    ad = shutil.copytree(D / "unsloth-lora", tmp_path / "ad")
    cfg = json.loads((ad / "adapter_config.json").read_text()) | fields
    (ad / "adapter_config.json").write_text(json.dumps(cfg))
    return ad


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"use_dora": True}, "use_dora=True is not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"peft_type": "IA3"}, "peft_type='IA3'"),
        ({"bias": "all"}, "bias='all'"),
        ({"base_model_name_or_path": "google/gemma-3-1b-it"}, "was trained on 'google/gemma-3-1b-it'"),
    ],
)
def test_unsupported_variants_are_refused_naming_the_field(tmp_path, fields, needle):
    with pytest.raises(DgpipeError, match=needle):
        resolve(D / "base", _edit_config(tmp_path, **fields), tmp_path / "cache")


def test_untied_encoder_delta_and_tied_head_are_refused(tmp_path):
    ad = _edit_config(tmp_path)
    w = load_file(ad / "adapter_model.safetensors")
    dec = "base_model.model.model.decoder.layers.0.self_attn.q_proj.lora_B.weight"
    enc = dec.replace("model.decoder.", "model.encoder.language_model.")
    w[enc] = w[dec] + 1
    w[enc.replace("lora_B", "lora_A")] = w[dec.replace("lora_B", "lora_A")].clone()
    save_file(w, ad / "adapter_model.safetensors")
    with pytest.raises(DgpipeError, match="different LoRA deltas for the tied encoder and decoder"):
        resolve(D / "base", ad, tmp_path / "cache")
    w = {k: v for k, v in w.items() if "encoder" not in k}
    w["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 32)
    w["base_model.model.lm_head.lora_B.weight"] = torch.zeros(24, 4)
    save_file(w, ad / "adapter_model.safetensors")
    with pytest.raises(DgpipeError, match="a LoRA on lm_head, which DiffusionGemma ties"):
        resolve(D / "base", ad, tmp_path / "cache2")
