"""`dgpipe quantize`: HF checkpoint (+ optional LoRA) -> ModelOpt quantize on the denoising path -> export.

The output directory is written atomically (temp dir beside it, renamed on success), so a failure or
Ctrl-C never leaves a half-written checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.atomic import atomic_dir, check_replaceable, json_key
from pipeline.errors import DgpipeError
from pipeline.model.config import SamplerConfig
from pipeline.model.validate import ValidatedCheckpoint, validate_checkpoint
from pipeline.runtime.prompt_format import EncodedPrompt, prompt_format_for, prompt_format_name
from pipeline.targets import Precision, check_precision_on_target, precision
from quantize import calibrate
from quantize.defaults import CALIB_SEED, CALIB_SIZE

# what an --output dir may hold for a quantize to replace it: a checkpoint whose dgpipe.json records its quantization
QUANTIZED_KIND, QUANTIZED_MARKER = (
    "a checkpoint dgpipe quantize wrote",
    json_key("dgpipe.json", "quantization"),
)
# files a serving runtime needs beside the weights, copied unchanged from the source checkpoint
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


@dataclass
class QuantizeOptions:
    model: Path
    precision: str
    output: Path
    calib_data: Path | None = None
    calib_size: int = CALIB_SIZE
    calib_steps: int = 8
    exclude: list[str] = field(default_factory=list)
    kv_cache: str = "none"
    target: str | None = None
    seed: int = 0
    export_dtype: str = "bfloat16"  # unquantized tensors and 16-bit scales; float32 for exactness tests


@dataclass
class QuantizeResult:
    output: str
    precision: str
    quant_algo: str | None
    block_size: int | None
    calib_prompts: int
    calib_steps: int
    seconds: float
    bytes: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def require_modelopt() -> None:
    try:
        import modelopt.torch.quantization  # noqa: F401
    except ImportError as e:
        raise DgpipeError(
            f"nvidia-modelopt is not importable ({e})",
            "pip install -e '.[quantize]' (needs requests, huggingface_hub)",
        ) from e


def check_options(opts: QuantizeOptions) -> Precision:
    """Every check of the options that reads nothing, so bad input fails in milliseconds."""
    p = precision(opts.precision)
    if opts.target:
        check_precision_on_target(p.name, opts.target)
    if opts.calib_size < 1:
        raise DgpipeError(f"--calib-size must be >= 1 (got {opts.calib_size})")
    if opts.calib_data is not None and not opts.calib_data.is_file():
        raise DgpipeError(
            f"--calib-data {opts.calib_data}: no such file", 'pass a JSONL file of {"text": ...}'
        )
    if opts.kv_cache not in ("none", "fp8"):
        raise DgpipeError(f"--kv-cache {opts.kv_cache!r}: choose none or fp8")
    if p.modelopt_config is None and (opts.exclude or opts.kv_cache != "none"):
        raise DgpipeError(f"--precision {p.name} is a plain cast: --exclude and --kv-cache do not apply")
    if opts.output.resolve() == opts.model.resolve():
        raise DgpipeError("--output must differ from --model (the source would be replaced)")
    check_replaceable(opts.output, QUANTIZED_KIND, QUANTIZED_MARKER)  # before calibration, not after it
    return p


def load_hf_model(path: Path):
    """The transformers model ModelOpt quantizes (fp32: calibration statistics in full precision; the
    export casts what stays unquantized to bf16)."""
    import transformers
    from transformers import DiffusionGemmaForBlockDiffusion

    transformers.logging.set_verbosity_error()  # a text-only checkpoint "misses" the vision tower: expected
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(
        path,
        dtype=torch.float32,
        use_safetensors=True,  # never unpickle (validate refused pickle files too)
    ).eval()
    return model


def calibration_prompts(opts: QuantizeOptions, ckpt: ValidatedCheckpoint) -> list[EncodedPrompt]:
    """--calib-data texts through the checkpoint's prompt format, else the format's own calibration set
    (the prompts it serves); a format without one needs --calib-data."""
    fmt = prompt_format_for(ckpt, ckpt.tokenizer() if ckpt.has_tokenizer else None)
    if opts.calib_data is not None:
        if fmt.needs_tokenizer and not ckpt.has_tokenizer:
            raise DgpipeError(f"{opts.model}: --calib-data text needs tokenizer.json in the checkpoint")
        return calibrate.jsonl_prompts(opts.calib_data, opts.calib_size, fmt.encode_prompt)
    default_set = getattr(fmt, "calibration_prompts", None)
    if default_set is not None:
        return default_set(opts.calib_size, CALIB_SEED)
    raise DgpipeError(
        f"{opts.model}: no default calibration set for this checkpoint",
        'pass --calib-data FILE.jsonl with {"text": ...} lines from the serving distribution',
    )


@contextlib.contextmanager
def _fused_experts_export_patch(model):
    """Narrow fixes for exporting INT4-AWQ fused experts with ModelOpt 0.47 (NVFP4 and FP8 export
    without them; each fix only acts on fused-expert quantizers with per-block static amax):

    1. The AWQ export averages pre_quant_scale across the experts of an MoE block and only knows
       per-expert module lists of named architectures (NotImplementedError for DiffusionGemma). Fused
       experts (`_QuantFusedExperts`) have one input quantizer per projection shared by all experts, so
       there is nothing to average: return no groups for them, defer to ModelOpt otherwise.
    2. An expert that no calibration token was routed to has no per-block weight amax; ModelOpt's
       fallback sets a per-tensor scalar, which `pack_int4_in_uint8` cannot index ("too many indices for
       tensor of dimension 0"). A static per-block weight max does not depend on data, so it is computed
       from the weight (what max calibration gives) and restored before the split.
    3. `_export_fused_experts` deep-copies the gate_up weight quantizer and slices its per-block amax to
       the gate or up half ([I, in/block]), but the copy keeps `_amax_shape_for_export` of the fused
       weight ([2I, -1]), so `export_amax` cannot reshape; the sliced amax already has the export shape.
    """
    import copy as _copy

    import modelopt.torch.export.moe_utils as moe_utils
    import modelopt.torch.export.unified_export_hf as ueh

    stash: dict[int, tuple] = {}
    for mod in model.modules():
        for attr in ("gate_up_proj", "down_proj"):
            for idx, q in enumerate(getattr(mod, f"{attr}_weight_quantizers", None) or []):
                block = (q.block_sizes or {}).get(-1) if q.is_enabled else None
                if not block or (q.block_sizes or {}).get("type") != "static":
                    continue
                amax = getattr(q, "_amax", None)
                w = getattr(mod, attr)[idx].detach().float()
                if amax is None or amax.numel() <= 1:  # expert never routed during calibration:
                    # a static per-block max of a weight does not depend on data, so take it from the weight
                    amax = w.abs().reshape(w.shape[0], -1, block).amax(-1).reshape(-1, 1)
                stash[id(q)] = (amax.detach().clone(), (w.shape[0], -1))

    def restore(q) -> None:
        saved = stash.get(id(q))
        amax = getattr(q, "_amax", None)
        if saved is not None and (amax is None or amax.dim() == 0):
            if hasattr(q, "_amax"):
                delattr(q, "_amax")
            q.amax = saved[0]
            if saved[1] is not None:
                q._amax_shape_for_export = saved[1]

    class _CopyShim:
        @staticmethod
        def deepcopy(obj):
            restore(obj)
            out = _copy.deepcopy(obj)
            if id(obj) in stash and hasattr(out, "_amax_shape_for_export"):
                del out._amax_shape_for_export
            return out

    original_list = ueh.get_experts_list
    original_export = ueh._export_quantized_weight

    def experts_list(module, model_type):
        if hasattr(getattr(module, "experts", None), "gate_up_proj_weight_quantizers"):
            return []
        return original_list(module, model_type)

    def export_weight(sub_module, dtype, weight_name="weight"):
        restore(getattr(sub_module, "weight_quantizer", None))
        return original_export(sub_module, dtype, weight_name)

    ueh.get_experts_list = experts_list
    ueh._export_quantized_weight = export_weight
    saved_copy = moe_utils.copy
    moe_utils.copy = _CopyShim  # type: ignore[assignment]
    try:
        yield
    finally:
        ueh.get_experts_list = original_list
        ueh._export_quantized_weight = original_export
        moe_utils.copy = saved_copy


ENCODER_TEXT = "model.encoder.language_model."
SCALE_SUFFIXES = (".weight_scale_2", ".input_scale", ".k_scale", ".v_scale")


def _finalize_tensors(
    out: Path, source: Path, source_names: set[str], dtype: torch.dtype = torch.bfloat16
) -> None:
    """Make the export hold what serving stacks read, whatever dtype calibration ran in:

    * transformers instantiates the vision tower even when the source checkpoint has none (a text-only
      export such as the embedded model); those randomly initialised tensors are not weights of the
      model, so they are dropped (and the byte count stays honest);
    * unquantized tensors and INT4 group scales in bf16 (calibration runs in fp32 on CPU and ModelOpt
      keeps the model dtype); per-tensor fp32 scales (`weight_scale_2`, `input_scale`, FP8's scalar
      `weight_scale`, KV `k_scale`/`v_scale`) stay fp32 as ModelOpt writes them.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    text_only = not any("vision" in s for s in source_names)

    def keep(name: str) -> bool:
        return not (text_only and "vision" in name)

    def cast(name: str, t: torch.Tensor) -> torch.Tensor:
        if t.dtype != torch.float32 or name.endswith(SCALE_SUFFIXES):
            return t
        if name.endswith(".weight_scale") and t.dim() == 0:
            return t
        return t.to(dtype)

    index = out / "model.safetensors.index.json"
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(f, "pt") as fh:
            names = fh.keys()
            tensors = {n: cast(n, fh.get_tensor(n)) for n in names if keep(n)}
            meta = fh.metadata()
        # ModelOpt 0.47 dedups the tied encoder copy of k_proj/v_proj but leaves its KV-cache scales
        # behind; fold them into the kept decoder scale (max: covers prefill and denoise) and drop them
        for n in [n for n in tensors if n.startswith(ENCODER_TEXT) and n.endswith((".k_scale", ".v_scale"))]:
            d = "model.decoder." + n[len(ENCODER_TEXT) :]
            t = tensors.pop(n)
            if d in tensors:
                tensors[d] = torch.maximum(tensors[d], t)
        save_file(tensors, str(f), metadata=meta)
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {
            k: v
            for k, v in data["weight_map"].items()
            if keep(k) and not (k.startswith(ENCODER_TEXT) and k.endswith((".k_scale", ".v_scale")))
        }
        index.write_text(json.dumps(data, indent=2) + "\n")
    exported = json.loads((out / "config.json").read_text())
    # the source config.json verbatim (transformers re-serialises some fields, e.g. the global-layer
    # geometry, in a form older readers parse differently) plus ModelOpt's quantization_config
    cfg = json.loads((source / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if "quantization_config" in exported:
        cfg["quantization_config"] = exported["quantization_config"]
    cfg["dtype"] = str(dtype).replace("torch.", "")
    has_pqs = False
    for f in out.glob("*.safetensors"):
        with safe_open(f, "pt") as fh:
            names = fh.keys()
            has_pqs = has_pqs or any(n.endswith(".pre_quant_scale") for n in names)
    for holder in (cfg.get("quantization_config"), _read_json_or_none(out / "hf_quant_config.json")):
        if isinstance(holder, dict):
            q = holder.get("quantization", holder)
            if q.get("pre_quant_scale") and not has_pqs:  # max-calibrated int4: no smoothing scales written
                q["pre_quant_scale"] = False
            if holder is not cfg.get("quantization_config"):
                (out / "hf_quant_config.json").write_text(json.dumps(holder, indent=4) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _read_json_or_none(f: Path) -> dict | None:
    return json.loads(f.read_text()) if f.is_file() else None


Phases = Callable[[str, int | None], Callable[[int], None]]  # (phase, steps or None) -> advance(k)


def _no_phases(name: str, total: int | None) -> Callable[[int], None]:
    return lambda k=1: None


def quantize_checkpoint(
    opts: QuantizeOptions,
    progress: Callable[[int], None] | None = None,
    on_quantized: Callable[[Any], None] | None = None,
    source: ValidatedCheckpoint | None = None,
    phases: Phases | None = None,
) -> QuantizeResult:
    """Quantize `opts.model`. `source` is that checkpoint as the caller validated it (with its weights
    read: `validate_checkpoint(..., weights=True)`), so the source is not read again before the model
    load; without it the checkpoint is validated here. `on_quantized(model)` sees ModelOpt's in-memory
    model after calibration, before the export rewrites it (tests compare the exported artifact with it).
    `phases(name, total)` is told when each phase starts (load, calibration with its model passes, export,
    finalize) and returns the callback that advances it: what a watched build shows."""
    phase = phases or _no_phases
    p = check_options(opts)
    # directory, config, tensor names/shapes/dtypes, finite weights; refuses pickle files outright
    src = source if source is not None else validate_checkpoint(opts.model, weights=True)
    if src.sha256 is None:
        raise DgpipeError(f"{opts.model}: the source was validated without reading its weights")
    require_modelopt()
    start = time.perf_counter()
    prompts = calibration_prompts(opts, src) if p.modelopt_config else []
    phase("load model", None)
    model = load_hf_model(opts.model)
    block = None
    with atomic_dir(opts.output, QUANTIZED_KIND, QUANTIZED_MARKER) as tmp:
        if p.modelopt_config is None:  # bf16: the unquantized reference
            phase("save checkpoint", None)
            model.to(getattr(torch, opts.export_dtype)).save_pretrained(tmp)
        else:
            import modelopt.torch.quantization as mtq
            from modelopt.torch.export import export_hf_checkpoint

            from quantize.calibrate import make_forward_loop
            from quantize.recipe import build_mtq_config, choose_block_size, quantized_input_dims

            if p.block_size:
                block = choose_block_size(p, quantized_input_dims(model, p, opts.exclude))
            cfg = build_mtq_config(p, opts.exclude, opts.kv_cache, block, p.modelopt_algorithm)
            # the served sampler settings (entropy_bound nests under sampler_config in generation_config.json)
            sampler = SamplerConfig.from_generation_config(src.generation_config)
            loops = 0

            def on_loop(total: int) -> Callable[[int], None]:
                nonlocal loops  # one phase per forward-loop call: AWQ calls it more than once
                loops += 1
                return phase("calibration" + (f" (pass {loops})" if loops > 1 else ""), total)

            phase("insert quantizers", None)
            loop = make_forward_loop(
                prompts,
                steps=opts.calib_steps,
                t_min=sampler.t_min,
                t_max=sampler.t_max,
                entropy_bound=sampler.entropy_bound,
                seed=opts.seed,
                progress=progress,
                on_loop=on_loop,
            )
            with contextlib.redirect_stdout(_Quiet()):
                mtq.quantize(model, cfg, forward_loop=loop)
            if on_quantized is not None:
                on_quantized(model)
            phase("export checkpoint", None)
            with contextlib.redirect_stdout(_Quiet()), _fused_experts_export_patch(model):
                export_hf_checkpoint(model, dtype=getattr(torch, opts.export_dtype), export_dir=tmp)
        phase("finalize tensors", None)
        _finalize_tensors(tmp, opts.model, src.tensor_names, getattr(torch, opts.export_dtype))
        for name in SIDE_FILES:
            if (opts.model / name).is_file():
                shutil.copy2(opts.model / name, tmp / name)
        meta = dict(src.dgpipe)
        meta["quantization"] = {
            "precision": p.name,
            "quant_algo": p.quant_algo,
            "block_size": block,
            "kv_cache": opts.kv_cache,
            "exclude": opts.exclude,
            "calibration": {
                "prompts": len(prompts),
                "source": str(opts.calib_data)
                if opts.calib_data
                else f"prompt format {prompt_format_name(src)} (seed {CALIB_SEED})",
                "denoise_steps": opts.calib_steps,
            },
            "source": str(opts.model),
        }
        (tmp / "dgpipe.json").write_text(json.dumps(meta, indent=2) + "\n")
    size = sum(f.stat().st_size for f in opts.output.glob("*.safetensors"))
    return QuantizeResult(
        output=str(opts.output),
        precision=p.name,
        quant_algo=p.quant_algo,
        block_size=block,
        calib_prompts=len(prompts),
        calib_steps=opts.calib_steps if prompts else 0,
        seconds=round(time.perf_counter() - start, 2),
        bytes=size,
    )


class _Quiet:
    """ModelOpt prints per-quantizer summaries to stdout; keep `--json` output parseable."""

    def write(self, s: str) -> int:
        return len(s)

    def flush(self) -> None:
        pass
