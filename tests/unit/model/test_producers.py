"""Recognition of each fine-tuning producer's output, on outputs the producers wrote (tests/data/producers)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from pipeline.errors import CheckpointError, DgpipeError
from pipeline.model import producers as pr
from pipeline.model.source import resolve

D = Path(__file__).resolve().parents[2] / "data" / "producers"
STEP = "epoch_0_step_1"


@pytest.mark.parametrize(
    ("sub", "kind", "weights"),
    [
        ("base", pr.BASE, "base"),
        ("automodel-sft", pr.AUTOMODEL_SFT, f"automodel-sft/{STEP}/model/consolidated"),
        (f"automodel-sft/{STEP}", pr.AUTOMODEL_SFT, f"automodel-sft/{STEP}/model/consolidated"),
        (
            f"automodel-sft/{STEP}/model/consolidated",
            pr.AUTOMODEL_SFT,
            f"automodel-sft/{STEP}/model/consolidated",
        ),
        ("automodel-lora", pr.AUTOMODEL_LORA, f"automodel-lora/{STEP}/model"),
        (f"automodel-lora/{STEP}/model", pr.AUTOMODEL_LORA, f"automodel-lora/{STEP}/model"),
        ("unsloth-lora", pr.UNSLOTH_LORA, "unsloth-lora"),
        ("unsloth-lora-rslora-embed", pr.UNSLOTH_LORA, "unsloth-lora-rslora-embed"),
    ],
)
def test_each_producer_output_is_recognised(sub, kind, weights):
    rec = pr.recognise(D / sub)
    assert (rec.kind, Path(rec.weights)) == (kind, D / weights)
    assert rec.is_adapter == (kind in pr.ADAPTERS)
    if rec.is_adapter:
        assert rec.base == "base"  # as the producer recorded it


def test_sharded_automodel_output_resolves_to_the_consolidated_weights(tmp_path):
    step = shutil.copytree(D / "automodel-sft" / STEP, tmp_path / "sft" / STEP)
    shutil.rmtree(step / "model" / "consolidated")  # save_consolidated: false
    rec = pr.recognise(tmp_path / "sft")
    assert rec.kind == pr.AUTOMODEL_SHARDED
    sharded = load_file(resolve(tmp_path / "sft", None, tmp_path / "cache") / "model.safetensors")
    consolidated = load_file(resolve(D / "automodel-sft", None, tmp_path / "cache") / "model.safetensors")
    assert sharded.keys() == consolidated.keys()
    assert all((sharded[k] == consolidated[k]).all() for k in sharded)


def test_automodel_sft_gets_the_encoder_scalars_and_the_base_side_files(tmp_path):
    out = resolve(D / "automodel-sft", None, tmp_path)
    state = load_file(out / "model.safetensors")
    raw = load_file(
        D / "automodel-sft" / STEP / "model" / "consolidated" / "model-00001-of-00001.safetensors"
    )
    assert not any(k.startswith("model.encoder.") for k in raw)  # AutoModel does not write them
    for i in (0, 1):
        enc = state[f"model.encoder.language_model.layers.{i}.layer_scalar"]
        assert enc == state[f"model.decoder.layers.{i}.layer_scalar"] and enc != 1
    # the folded per-expert scale is what AutoModel wrote: ones
    assert (state["model.decoder.layers.0.router.per_expert_scale"] == 1).all()
    assert (out / "tokenizer.json").read_bytes() == (D / "base" / "tokenizer.json").read_bytes()
    assert json.loads((out / "dgpipe.json").read_text())["source"]["kind"] == pr.AUTOMODEL_SFT
    written = (out / "model.safetensors").stat().st_mtime_ns
    assert resolve(D / "automodel-sft", None, tmp_path) == out  # cached: the second call merges nothing
    assert (out / "model.safetensors").stat().st_mtime_ns == written


def test_quantized_and_unsloth_merged_are_used_in_place(tmp_path):
    q = shutil.copytree(D / "base", tmp_path / "q")
    (q / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "FP8"}}')
    assert pr.recognise(q).kind == pr.QUANTIZED
    assert resolve(q, None, tmp_path / "cache") == q
    with pytest.raises(DgpipeError, match="needs an unquantized base"):
        resolve(q, D / "unsloth-lora", tmp_path / "cache")
    # config.json's quantization_config: ModelOpt's (quant_method modelopt) used in place, another's refused
    for method, kind in (("modelopt", pr.QUANTIZED), ("compressed-tensors", None)):
        c = shutil.copytree(D / "base", tmp_path / method)
        cfg = json.loads((c / "config.json").read_text())
        (c / "config.json").write_text(
            json.dumps(cfg | {"quantization_config": {"quant_method": method, "quant_algo": "FP8"}})
        )
        if kind:
            assert pr.recognise(c).kind == kind
        else:
            with pytest.raises(
                CheckpointError, match=r"quantized by compressed-tensors .*which dgpipe does not read"
            ):
                pr.recognise(c)
    u = shutil.copytree(D / "base", tmp_path / "u")
    cfg = json.loads((u / "config.json").read_text()) | {"unsloth_version": "2026.10.9"}
    (u / "config.json").write_text(json.dumps(cfg))
    assert pr.recognise(u).kind == pr.UNSLOTH_MERGED
    assert resolve(u, None, tmp_path / "cache") == u


def test_unknown_and_misplaced_dirs_are_one_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint dgpipe knows"):
        pr.recognise(tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        pr.recognise(tmp_path / "missing")
    with pytest.raises(DgpipeError, match="is a Hugging Face checkpoint, not a LoRA adapter"):
        resolve(D / "base", D / "base", tmp_path)
    with pytest.raises(DgpipeError, match="is a LoRA adapter"):
        resolve(D / "unsloth-lora", D / "unsloth-lora", tmp_path)
    lonely = shutil.copytree(D / "unsloth-lora", tmp_path / "a" / "b" / "c" / "d" / "e" / "lora")
    with pytest.raises(DgpipeError, match="whose base 'base' is not a local directory"):
        resolve(lonely, None, tmp_path / "cache")


def test_inspect_says_a_checkpoint_the_loaders_refuse_is_refused(tmp_path):
    """`dgpipe inspect` checks a checkpoint it loads from its own files as the loading commands do (config,
    tensor headers): another architecture's config.json is `refused`, naming why, not "loaded as is"."""
    from pipeline.model.producers import inspect_dir
    from pipeline.resources import EMBEDDED_MODEL

    ok = tmp_path / "ok"
    shutil.copytree(EMBEDDED_MODEL, ok)
    rec = inspect_dir(ok)
    assert rec.action == "loaded as is" and "config and tensor headers checked" in rec.notes[-1]
    cfg = json.loads((ok / "config.json").read_text())
    (ok / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    rec = inspect_dir(ok)
    assert rec.action.startswith("refused: ") and "model_type is 'llama'" in rec.action
