"""Fine-tuned DiffusionGemma outputs of NeMo AutoModel (LoRA, full SFT) and Unsloth (LoRA), as the producers
wrote them (tests/data/producers), through `dgpipe build --precision fp8` and `dgpipe serve`.

What is compared, for each producer, with one prompt, seed and fixed step count:
1. the served answer (HTTP generate on `dgpipe serve` of the build's repository) equals dgpipe's in-process
   generation on the build's FP8 checkpoint with the same request (sampler settings, template, seed, draw);
2. the producer's merged model run in transformers (float64, dgpipe's draws shared: tests/_utils/hf_reference)
   gives the same tokens as dgpipe on the bf16 checkpoint the build quantized (the `model` in its manifest).
   The producer's merged model: AutoModel's own LoRA merge (`automodel-lora-merged`), AutoModel's SFT
   consolidated dir, PEFT's `merge_and_unload` for the Unsloth adapter rounded to bf16 (what Unsloth's
   `save_pretrained_merged` writes for a bf16 base).
The two are separate because FP8 rounding changes this tiny random model's tokens against bf16 (measured:
6 of 18 answer tokens for the AutoModel LoRA), so an FP8 answer cannot equal the bf16 producer model token for token.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import torch

from tests._utils.availability import needs_tritonserver
from tests._utils.cli import dgpipe
from tests._utils.hf_reference import shared_draws
from tests._utils.serve import start_serve

pytest.importorskip("modelopt", reason="nvidia-modelopt is not installed (pip install dgpipe[quantize])")
pytest.importorskip("onnxruntime", reason="onnx/onnxruntime are not installed (pip install dgpipe[engine])")
pytestmark = [
    pytest.mark.slow,
    needs_tritonserver,
]

D = Path(__file__).resolve().parents[1] / "data" / "producers"
PUZZLE = "14...9..56925.31.8835.1.927..1732.5.259.6.7.437694.28....6.4.935.3.914..92....816"
SEED, STEPS, MAX_TOKENS = 7, 4, 82
CASES = {
    "automodel-lora": ["--model", str(D / "base"), "--adapter", str(D / "automodel-lora")],
    "automodel-sft": ["--model", str(D / "automodel-sft")],
    "unsloth-lora": ["--model", str(D / "base"), "--adapter", str(D / "unsloth-lora")],
}


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """One `dgpipe build --precision fp8` per producer (smallest calibration), each served once: the build
    dir and the served answer to the one request."""
    work = tmp_path_factory.mktemp("finetuned")
    out = {}
    for name, args in CASES.items():
        build = work / name
        proc = dgpipe(
            "build", "--precision", "fp8", "--target", "sm90", "--calib-size", "1", "--build-dir", str(build),
            *args, env={"DGPIPE_CACHE": str(work / "cache")},
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        (work / f"serve-{name}").mkdir()
        srv = start_serve(build / "model_repository", work / f"serve-{name}", openai=False)
        try:
            body = {
                "text_input": PUZZLE,
                "max_tokens": MAX_TOKENS,
                "seed": SEED,
                "max_denoising_steps": STEPS,
                "confidence_threshold": 0.0,
                "exclude_input_in_output": True,
            }
            req = urllib.request.Request(
                f"{srv.http}/v2/models/dgpipe/generate", json.dumps(body).encode(), method="POST"
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                out[name] = (build, json.loads(r.read())["text_output"])
        finally:
            srv.stop()
    return out


def _dgpipe_tokens(path: Path, dtype: torch.dtype, pinned: bool) -> tuple[list[int], list[int], object]:
    """dgpipe's in-process answer, as the server builds the request (`pipeline.serving.core.intake`)."""
    from pipeline.model.checkpoint import load_model
    from pipeline.model.config import SamplerConfig
    from pipeline.runtime.prompt_format import prompt_format_for
    from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request

    model, ckpt = load_model(path, dtype=dtype)
    fmt = prompt_format_for(ckpt, ckpt.tokenizer())
    ids = fmt.encode_prompt(PUZZLE)
    sampler = SamplerConfig.from_generation_config(
        ckpt.generation_config, max_denoising_steps=STEPS, confidence_threshold=0.0
    )
    req = Request(
        prompt_ids=ids,
        max_tokens=MAX_TOKENS,
        sampler=sampler,
        seed=SEED,
        draw_id=0,
        template=fmt.infill_template(PUZZLE) if pinned else None,
    )
    result = BlockDiffusionRuntime(model, max_batch=1, max_len=256).generate([req])[0]
    return ids, result.tokens, fmt


def _producer_model(name: str, build: Path):
    """The producer's merged model in transformers, float64."""
    from transformers import DiffusionGemmaForBlockDiffusion

    from pipeline.model.source import resolve

    def load(path: Path):
        return DiffusionGemmaForBlockDiffusion.from_pretrained(
            path, dtype=torch.float64, experts_implementation="eager"
        ).eval()

    cache = build / "oracle-cache"
    if name == "unsloth-lora":
        from peft import PeftModel

        merged = PeftModel.from_pretrained(load(D / "base"), D / "unsloth-lora").merge_and_unload()
        # Unsloth's save_pretrained_merged writes the merged model in 16 bits (the base's bf16)
        return merged.to(torch.bfloat16).to(torch.float64)
    # AutoModel's merged / fine-tuned weights as its consolidated dir holds them; resolve() only adds the
    # encoder layer_scalar copies AutoModel does not write (its model has one stack; transformers two)
    source = D / ("automodel-lora-merged" if name == "automodel-lora" else "automodel-sft")
    return load(resolve(source, None, cache))


@pytest.mark.parametrize("name", list(CASES))
def test_served_answer_equals_the_fp8_build_in_process(builds, name):
    build, served = builds[name]
    _, tokens, fmt = _dgpipe_tokens(build / "checkpoint", torch.float32, pinned=True)
    assert served == fmt.decode(tokens) and len(served) > 0


@pytest.mark.parametrize("name", list(CASES))
def test_producer_merged_model_in_transformers_equals_dgpipe(builds, name):
    build, _ = builds[name]
    merged = Path(json.loads((build / "build_manifest.json").read_text())["model"])
    ids, ours, _ = _dgpipe_tokens(merged, torch.float64, pinned=False)
    ref = _producer_model(name, build)
    sampler = _sampler(merged)
    with shared_draws(SEED, 0), torch.no_grad():
        out = ref.generate(
            torch.tensor([ids]), max_new_tokens=MAX_TOKENS, eos_token_id=[1, 4], pad_token_id=0,
            **sampler.transformers_kwargs(),
        )  # fmt: skip
    new = out.sequences[0, len(ids) :].tolist()
    cut = next((j for j, t in enumerate(new) if t in (1, 4)), None)
    assert ours == (new if cut is None else new[: cut + 1])
    _, untuned, _ = _dgpipe_tokens(D / "base", torch.float64, pinned=False)
    assert ours != untuned  # the fine-tuned weights decide the answer: the base model's differs


def _sampler(path: Path):
    from pipeline.model.checkpoint import open_checkpoint
    from pipeline.model.config import SamplerConfig

    gen = open_checkpoint(path).generation_config
    return SamplerConfig.from_generation_config(gen, max_denoising_steps=STEPS, confidence_threshold=0.0)
