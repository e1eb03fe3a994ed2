"""Write the producer fixtures with the producers' own code (run in a throwaway venv, CPU torch):

    python3.11 -m venv /tmp/producers-venv
    /tmp/producers-venv/bin/pip install torch==2.13.0 nemo-automodel==0.7.0 peft==0.21.2
    /tmp/producers-venv/bin/pip uninstall -y triton   # GPU kernels only; its 3.9 breaks AutoModel 0.7 imports
    /tmp/producers-venv/bin/python tests/data/producers/make_fixtures.py

Writes, next to this file:
  base/                      tiny random DiffusionGemma (transformers save_pretrained) with the Sudoku tokenizer
  automodel-sft/             NeMo AutoModel Checkpointer.save_model of a full fine-tune (step dir: model/
                             consolidated/ + model/shard-*.safetensors + model/.hf_metadata/)
  automodel-lora/            NeMo AutoModel LoRA (apply_lora_to_linear_modules, PeftAddon) step dir
  automodel-lora-merged/     AutoModel's own merge of that LoRA (LinearLoRA.materialize_effective_weight),
                             saved by the same Checkpointer: the oracle the merge is compared with
  unsloth-lora/              PEFT get_peft_model + save_pretrained with the arguments Unsloth's
                             FastLanguageModel.get_peft_model passes (r, lora_alpha, dropout 0, bias none; no task_type);
                             Unsloth itself imports only on a GPU
  unsloth-lora-rslora-embed/ the same with use_rslora and a LoRA on the (tied) input embedding
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
SUDOKU = HERE.parents[2] / "pipeline" / "models" / "sudoku-tiny"
TEXT = {
    "vocab_size": 24,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_global_key_value_heads": 1,
    "sliding_window": 16,
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 16,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": [1, 4],
}
DENSE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_base(out: Path) -> Path:
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    torch.manual_seed(0)
    vision = {
        "model_type": "gemma4_vision",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
    }
    cfg = DiffusionGemmaConfig(text_config=TEXT, vision_config=vision, canvas_length=82)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "vision" not in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
        model.model.decoder.embed_tokens.weight.mul_(25.0)  # O(1) logits
        for i, layer in enumerate(model.model.decoder.layers):  # the encoder's copy is the same value
            value = 0.5 + float(torch.rand(1, generator=gen))
            layer.layer_scalar.fill_(value)
            model.model.encoder.language_model.layers[i].layer_scalar.fill_(value)
    model.to(torch.bfloat16).save_pretrained(out)  # bf16, as the released checkpoint
    # keep the text model only (the vision tower is not used and would triple the fixture)
    state = {k: v for k, v in load_file(out / "model.safetensors").items() if "vision" not in k}
    from safetensors.torch import save_file

    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ):
        shutil.copy2(SUDOKU / name, out / name)
    meta = json.loads((SUDOKU / "dgpipe.json").read_text())
    (out / "dgpipe.json").write_text(
        json.dumps({k: meta[k] for k in ("task", "prompt_format", "prompt_template")})
    )
    return out


def automodel(base: Path):
    """AutoModel's native DiffusionGemma loaded from `base` through its own state-dict adapter."""
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.diffusion_gemma.model import DiffusionGemmaForBlockDiffusion
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base)
    backend = BackendConfig(
        attn="sdpa",
        linear="torch",
        rms_norm="torch_fp32",
        experts="torch_mm",
        dispatcher="torch",
        enable_hf_state_dict_adapter=True,
    )
    model = DiffusionGemmaForBlockDiffusion.from_config(config, backend=backend).to(torch.float32)
    hf = load_file(base / "model.safetensors")
    native = model.state_dict_adapter.from_hf(hf)
    _, unexpected = model.load_state_dict(native, strict=False)
    assert not unexpected, unexpected
    return model


def checkpointer(out: Path, peft: bool):
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig

    cfg = CheckpointingConfig(
        checkpoint_dir=str(out),
        model_save_format="safetensors",
        is_peft=peft,
        save_consolidated=not peft,
        model_repo_id=None,
        model_cache_dir=None,
        model_state_dict_keys=None,
    )
    return Checkpointer(cfg, dp_rank=0, tp_rank=0, pp_rank=0)


def write_automodel_sft(base: Path, out: Path) -> None:
    model = automodel(base)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # stands in for training: every weight moves
        for p in model.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    checkpointer(out, peft=False).save_model(model, str(out / "epoch_0_step_1"), is_final_checkpoint=True)


def write_automodel_lora(base: Path, out: Path, merged: Path) -> None:
    from nemo_automodel.components._peft.lora import PeftConfig, apply_lora_to_linear_modules

    model = automodel(base)
    peft = PeftConfig(
        target_modules=[f"*self_attn.{m}" for m in DENSE[:4]] + [f"*.mlp.{m}" for m in DENSE[4:]],
        dim=4,
        alpha=8,
    )
    n = apply_lora_to_linear_modules(model, peft)
    assert n > 0
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # zero-initialised by AutoModel: stands in for training
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    checkpointer(out, peft=True).save_model(model, str(out / "epoch_0_step_1"), peft_config=peft)
    # AutoModel's own merged weights, into a fresh native model, saved as a full checkpoint
    effective = {
        name: mod.materialize_effective_weight().detach().clone()
        for name, mod in model.named_modules()
        if hasattr(mod, "materialize_effective_weight")
    }
    plain = automodel(base)
    with torch.no_grad():
        for name, w in effective.items():
            plain.get_submodule(name).weight.copy_(w)
    checkpointer(merged, peft=False).save_model(
        plain, str(merged / "epoch_0_step_1"), is_final_checkpoint=True
    )
    model_dir = merged / "epoch_0_step_1" / "model"  # the oracle needs the consolidated dir only
    for f in model_dir.iterdir():
        if f.name != "consolidated":
            shutil.rmtree(f) if f.is_dir() else f.unlink()


def write_unsloth_lora(base: Path, out: Path, rslora: bool) -> None:
    """PEFT calls as unsloth/models/llama.py FastLlamaModel.get_peft_model makes them (LoraConfig with
    r, lora_alpha, lora_dropout=0, bias="none", task_type CAUSAL_LM, use_rslora), on the decoder modules:
    the encoder copies are the same tied weights, so one adapter per weight."""
    from peft import LoraConfig, get_peft_model
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(4)
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(base, dtype=torch.float32)
    targets = r"model\.decoder\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
    if rslora:
        targets = rf"({targets}|model\.decoder\.embed_tokens)"
    # task_type is left unset: PEFT's CAUSAL_LM wrapper needs prepare_inputs_for_generation, which
    # DiffusionGemmaForBlockDiffusion does not have (the saved adapter is the same either way)
    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        bias="none",
        target_modules=targets,
        use_rslora=rslora,
        init_lora_weights=False,
    )
    peft_model = get_peft_model(model, cfg)
    peft_model.save_pretrained(out)
    card = out / "README.md"  # Unsloth's model card tags (unsloth/save.py) mark the producer
    card.write_text("---\nbase_model: base\nlibrary_name: peft\ntags:\n- unsloth\n---\n")


def main() -> None:
    import os

    os.chdir(HERE)  # the producers record the base as they were given it: "base", not this machine's path
    for d in HERE.iterdir():
        if d.is_dir():
            shutil.rmtree(d)
    base = write_base(Path("base"))
    write_automodel_sft(base, Path("automodel-sft"))
    write_automodel_lora(base, Path("automodel-lora"), Path("automodel-lora-merged"))
    write_unsloth_lora(base, Path("unsloth-lora"), rslora=False)
    write_unsloth_lora(base, Path("unsloth-lora-rslora-embed"), rslora=True)


if __name__ == "__main__":
    main()
