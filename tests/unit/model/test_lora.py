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


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        (
            {"init_lora_weights": "pissa"},
            "init_lora_weights='pissa'.*path_initial_model_for_weight_conversion",
        ),
        ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights='pissa_niter_4'"),
        ({"init_lora_weights": "olora"}, "init_lora_weights='olora'.*path_initial_model_for_weight"),
        ({"init_lora_weights": "loftq"}, "init_lora_weights='loftq'.*merge it with the tool"),
        ({"use_bdlora": {"target_modules_bd_a": ["q_proj"]}}, "use_bdlora.*block-diagonal"),
        ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens.*cannot merge"),
        ({"layer_replication": [[0, 2], [1, 2]]}, "layer_replication"),
        ({"trainable_token_indices": [3, 4]}, "trainable_token_indices"),
        ({"kasa_config": {}}, None),  # an empty KaSA config is no KaSA: merged
        ({"kasa_config": {"k": 1}}, "kasa_config"),
    ],
)
def test_variants_whose_merge_is_not_the_plain_sum_are_refused(tmp_path, fields, needle):
    """PiSSA / OLoRA / CorDA / LoftQ adapters apply to a residual of the base that PEFT recomputes when it
    loads them (merged into the original base they are wrong, by more than the fine-tune moved the weights),
    and block-diagonal, activated and KaSA LoRA, replicated layers and trained token rows are no plain
    W + s * B @ A: each is refused naming its field, the convertible ones with PEFT's conversion."""
    ad = _edit_config(tmp_path, **fields)
    if needle is None:
        resolve(D / "base", ad, tmp_path / "cache")
        return
    with pytest.raises(DgpipeError, match=needle):
        resolve(D / "base", ad, tmp_path / "cache")


def test_damaged_adapters_are_named_not_tracebacks(tmp_path):
    """Mismatched ranks, a 1-D factor, a truncated file, a config whose r is not the tensors' rank and a
    base name that is not a string end in one error naming the adapter (they raised RuntimeError,
    SafetensorError and AttributeError)."""
    key = "base_model.model.model.decoder.layers.0.self_attn.q_proj.lora_{}.weight"
    cases = {
        "rank": lambda w: w | {key.format("B"): torch.zeros(w[key.format("B")].shape[0], 2)},
        "1-D": lambda w: w | {key.format("A"): torch.zeros(32)},
    }
    for name, edit in cases.items():
        ad = _edit_config(tmp_path / name)
        save_file(edit(load_file(ad / "adapter_model.safetensors")), ad / "adapter_model.safetensors")
        with pytest.raises(DgpipeError, match="not a rank-r pair"):
            lora.read_adapter(ad)
    ad = _edit_config(tmp_path / "trunc")
    data = (ad / "adapter_model.safetensors").read_bytes()
    (ad / "adapter_model.safetensors").write_bytes(data[:5])
    with pytest.raises(DgpipeError, match=r"adapter_model\.safetensors cannot be read"):
        lora.read_adapter(ad)
    with pytest.raises(DgpipeError, match=r"has rank 4, adapter_config\.json r=8"):
        lora.read_adapter(_edit_config(tmp_path / "r", r=8))
    with pytest.raises(DgpipeError, match="base_model_name_or_path=7 is not a name"):
        lora.read_adapter(_edit_config(tmp_path / "base", base_model_name_or_path=7))


def test_config_fields_peft_reads_its_own_way(tmp_path):
    """An absent lora_alpha is PEFT's default 8 (not r), and fan_in_fan_out changes nothing: PEFT sets it
    False for nn.Linear and nn.Embedding (it transposed the delta, wrong on square weights)."""
    cfg = json.loads((D / "unsloth-lora" / "adapter_config.json").read_text())
    del cfg["lora_alpha"]
    ad = _edit_config(tmp_path / "alpha")
    (ad / "adapter_config.json").write_text(json.dumps(cfg))
    assert lora.read_adapter(ad).scaling == 8 / 4
    plain = _merged(tmp_path / "plain", D / "unsloth-lora")
    flipped = _merged(tmp_path / "flipped", _edit_config(tmp_path / "fifo", fan_in_fan_out=True))
    assert all(torch.equal(plain[k], flipped[k]) for k in plain)


def test_a_hugging_face_cache_snapshot_is_the_base_it_names(tmp_path):
    """The hub cache keeps a repository at models--ORG--NAME/snapshots/<commit>: an adapter recording
    ORG/NAME names that snapshot (its last path component is the commit)."""
    snap = tmp_path / "models--google--diffusiongemma-26B-A4B-it" / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    assert lora.same_base("google/diffusiongemma-26B-A4B-it", snap)
    assert not lora.same_base("google/gemma-3-1b-it", snap)


def test_one_copy_adapters_say_what_the_merge_changes(tmp_path, caplog):
    """PEFT adapts the modules it targets, and transformers' encoder and decoder copies are separate modules
    over one weight: a decoder-only adapter was trained with the prompt pass on the base weights. Merged, as
    PEFT's merge_and_unload merges it, it adapts both passes: the merge says so and records the copies, and
    `dgpipe inspect` tells it beforehand. AutoModel's single stack runs in both passes: nothing to say."""
    import logging

    from pipeline.model.producers import recognise

    assert lora.read_adapter(D / "unsloth-lora").copies == {"decoder"}
    assert lora.read_adapter(D / "automodel-lora" / "epoch_0_step_1" / "model").copies == {
        "decoder",
        "encoder",
    }
    with caplog.at_level(logging.WARNING, logger="pipeline.model.lora"):
        out = resolve(D / "base", D / "unsloth-lora", tmp_path)
    assert "adapts the decoder (denoise pass) only" in caplog.text
    assert json.loads((out / "dgpipe.json").read_text())["source"]["adapted_copies"] == ["decoder"]
    assert any("prompt pass" in n for n in recognise(D / "unsloth-lora").notes)
    assert not any("prompt pass" in n for n in recognise(D / "automodel-lora").notes)
    refused = recognise(_edit_config(tmp_path, use_dora=True))
    assert refused.action.startswith("refused: ") and "use_dora=True" in refused.action


def test_per_module_ranks_and_alphas_merge_as_peft_merges_them(tmp_path):
    """rank_pattern / alpha_pattern give some modules their own r and alpha (PEFT matches each key against
    the end of the module's name): each module's delta takes its own scale, equal to PEFT's merge_and_unload
    after rounding to the checkpoint's bf16."""
    from peft import LoraConfig, get_peft_model
    from transformers import DiffusionGemmaForBlockDiffusion

    base = DiffusionGemmaForBlockDiffusion.from_pretrained(D / "base", dtype=torch.float32)
    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=r"model\.decoder\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)",
        rank_pattern={"q_proj": 2, r"layers\.1\.mlp\.up_proj": 6},
        alpha_pattern={"o_proj": 32},
        init_lora_weights=False,  # random B: every delta is nonzero
    )
    torch.manual_seed(0)
    peft_model = get_peft_model(base, cfg)
    peft_model.save_pretrained(tmp_path / "ad")
    ad = lora.read_adapter(tmp_path / "ad")
    scales = {name: {s for *_, s in pairs} for name, pairs in ad.pairs.items()}
    assert scales["model.decoder.layers.0.self_attn.q_proj.weight"] == {8 / 2}
    assert scales["model.decoder.layers.0.self_attn.o_proj.weight"] == {32 / 4}
    assert scales["model.decoder.layers.1.mlp.up_proj.weight"] == {8 / 6}
    assert scales["model.decoder.layers.0.mlp.up_proj.weight"] == {8 / 4}
    ref = peft_model.merge_and_unload().state_dict()
    ours = _merged(tmp_path / "merged", tmp_path / "ad")
    for k, t in ours.items():
        assert torch.equal(t, ref[k].to(t.dtype)), k


@pytest.mark.parametrize(
    ("pattern", "module", "matches"),
    [
        ({"q_proj": 2}, "model.decoder.layers.0.self_attn.q_proj", True),
        ({"proj": 2}, "model.decoder.layers.0.self_attn.q_proj", False),  # a key matches whole dotted parts
        ({"self_attn.q_proj": 2}, "model.decoder.layers.0.self_attn.q_proj", True),
        ({"layers.1": 2}, "model.decoder.layers.10.self_attn.q_proj", False),  # anchored at the name's end
        ({"layers.1.self_attn.q_proj": 2}, "model.decoder.layers.10.self_attn.q_proj", False),
        ({"layers.1.self_attn.q_proj": 2}, "model.decoder.layers.1.self_attn.q_proj", True),
        ({r"layers\.\d+\.mlp\.up_proj": 2}, "model.decoder.layers.7.mlp.up_proj", True),
        ({"model.decoder.layers.0.self_attn.q_proj": 2}, "model.decoder.layers.0.self_attn.q_proj", True),
    ],
)
def test_rank_pattern_keys_match_module_names_as_peft_matches_them(pattern, module, matches):
    """A rank_pattern key takes effect where PEFT's get_pattern_key says so (the key, a regex, matching a
    whole dotted suffix of the module name): a looser match gave "proj" to every projection or layers.1's
    rank to layers.10, merging those modules with the wrong alpha / r, a silently different model. The
    expected matches are peft 0.21.2's get_pattern_key's answers (not imported here: it takes seconds)."""
    cfg = {"r": 8, "lora_alpha": 16, "rank_pattern": pattern}
    assert lora.scaling(cfg, Path("ad"), module) == ((2, 8.0) if matches else (8, 2.0))


@pytest.mark.parametrize("r", [True, False, 0, 2.0, "8", None])
def test_an_r_that_is_not_a_positive_integer_is_refused(r):
    """r: true is an int to Python (True == 1): it would merge at alpha / 1 instead of being refused as the
    malformed config it is; zero, floats, strings and a missing r are refused alike, naming the field."""
    with pytest.raises(DgpipeError, match="needs an integer r >= 1 and a numeric lora_alpha"):
        lora.scaling({"r": r, "lora_alpha": 16}, Path("ad"))
    with pytest.raises(DgpipeError, match="needs an integer r >= 1 and a numeric lora_alpha for q_proj"):
        lora.scaling({"r": 4, "lora_alpha": 16, "rank_pattern": {"q_proj": r}}, Path("ad"), "q_proj")
    assert lora.scaling({"r": 4, "lora_alpha": 16}, Path("ad")) == (4, 4.0)
