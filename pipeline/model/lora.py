"""LoRA adapters of every producer, read and merged into a Hugging Face DiffusionGemma state dict.

Why dgpipe merges itself instead of `PeftModel.merge_and_unload()`: DiffusionGemma's transformers model has
two module trees (encoder for prefill/commit, decoder for denoise) over ONE tied set of weights, and
NeMo AutoModel's native model has a single stack under `model.layers` (no `.decoder.`), which PEFT cannot
map onto the transformers model at all. So each producer's key layout is normalised to the checkpoint's
tensor name (`model.decoder.layers.N.<module>.weight`), and the delta is added once per tied weight with
the producer's own formula:

* PEFT / Unsloth (peft/tuners/lora/layer.py `get_delta_weight`): W += s * B @ A, s = alpha / r, or
  alpha / sqrt(r) with `use_rslora`; `lora_embedding_A/B` on an embedding: W += s * (B @ A).T.
* NeMo AutoModel (nemo_automodel/components/_peft/lora.py `LinearLoRA`): W += (alpha / dim) * B @ A;
  adapter_config.json carries r = dim and lora_alpha = alpha.

An adapter with different deltas for the tied encoder and decoder copies cannot be represented by one set of
weights (dgpipe's runtime, vLLM and TensorRT all run one) and is refused, as are variants whose merge is not
this sum (DoRA, modules_to_save, bias training, other PEFT types, block-diagonal or activated LoRA) and
adapters whose base PEFT rewrites when it loads them (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA initialisation:
the adapter applies to a residual of the base weights), each naming the adapter_config field.

An adapter on one copy only (PEFT targets modules, and the encoder and decoder copies are separate modules
over one weight) was trained with the other pass on the base weights: merged, it adapts both passes, as
PEFT's own `merge_and_unload` does. `adapted_copies` names the copies so the merge and `dgpipe inspect` can
say so.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import DgpipeError

log = logging.getLogger(__name__)

_KEY = re.compile(
    r"^base_model\.model\.(.+?)\.lora_(A|B|embedding_A|embedding_B)(?:\.default)?(?:\.weight)?$"
)
_ENCODER = re.compile(r"^model\.encoder\.language_model\.(layers\.\d+\..+|embed_tokens)$")
_DECODER = re.compile(r"^model\.decoder\.(.+)$")
_AUTOMODEL = re.compile(r"^model\.((?:layers\.\d+\.|embed_tokens|norm|self_conditioning).*)$")
TIED_HEAD = "lm_head"
PEFT_DEFAULT_ALPHA = 8  # LoraConfig.lora_alpha's default, what PEFT uses when the field is absent
# init_lora_weights after which the saved adapter applies to a residual of the base that PEFT recomputes from
# the original weights when it loads the adapter (peft/tuners/lora/layer.py: pissa_init, olora_init, ...)
BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
CONVERTIBLE_INITS = ("pissa", "olora", "corda")  # PEFT's save_pretrained converts these to a plain LoRA
# PEFT variants whose weights are not a plain B @ A update of the targeted linears
VARIANT_FIELDS = {
    "use_bdlora": "block-diagonal LoRA",
    "alora_invocation_tokens": "activated LoRA, applied from its invocation tokens on (PEFT cannot merge it)",
    "kasa_config": "KaSA, which also truncates the base weights' singular values",
    "layer_replication": "replicated layers, which the base checkpoint does not have",
    "trainable_token_indices": "trained embedding rows beside the LoRA",
    "arrow_config": "Arrow, which routes each token among several LoRAs",
    "velora_config": "a variant whose merge is not W + s * B @ A",
    "monteclora_config": "a variant whose merge is not W + s * B @ A",
    "use_qalora": "a variant whose merge is not W + s * B @ A",
    "lora_bias": "a variant whose merge is not W + s * B @ A",
}
COPIES = {"decoder": "the decoder (denoise pass)", "encoder": "the encoder (prompt pass: prefill and commit)"}


@dataclass
class Adapter:
    """A LoRA adapter in one layout: per checkpoint tensor name, its (A, B, is_embedding, scale) pairs (the
    scale per module: `rank_pattern` / `alpha_pattern` may set it), and which of transformers' two module
    trees it adapts (`adapted_copies`)."""

    path: Path
    base: str | None
    scaling: float  # the config's r and lora_alpha: every module's without patterns
    pairs: dict[str, list[tuple[torch.Tensor, torch.Tensor, bool, float]]]
    copies: set[str]


def _refuse(adapter: Path, field: str, value: Any, why: str) -> DgpipeError:
    return DgpipeError(
        f"--adapter {adapter}: adapter_config.json {field}={value!r} is not supported ({why})",
        "merge it with the tool that trained it and pass the merged checkpoint as --model",
    )


def scaling(cfg: dict[str, Any], adapter: Path, module: str | None = None) -> tuple[int, float]:
    """(r, scale) of `module` (None: the config's default) as PEFT's LoraModel._create_and_replace picks
    them: r and lora_alpha, overridden by the first `rank_pattern` / `alpha_pattern` key that matches the end
    of the module's name (peft.utils.other.get_pattern_key); scale alpha / r, or alpha / sqrt(r) with
    rsLoRA (LoraLayer.update_layer). An absent lora_alpha is PEFT's default."""
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    patterns = {}
    for field in ("rank_pattern", "alpha_pattern"):
        patterns[field] = cfg.get(field) or {}
        if not isinstance(patterns[field], dict):
            raise DgpipeError(f"--adapter {adapter}: adapter_config.json {field} is not an object")
    if module is not None:
        r = _pattern_value(patterns["rank_pattern"], module, r)
        alpha = _pattern_value(patterns["alpha_pattern"], module, alpha)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1 or not isinstance(alpha, int | float):
        where = f" for {module}" if module else ""
        raise DgpipeError(
            f"--adapter {adapter}: adapter_config.json needs an integer r >= 1 and a numeric lora_alpha{where}"
        )
    return r, alpha / (r**0.5 if cfg.get("use_rslora") else r)


def _pattern_value(pattern: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's get_pattern_key: the first key (a regex) that matches a dotted suffix of the module name."""
    for key, value in pattern.items():
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        except re.error as e:
            raise DgpipeError(f"rank/alpha pattern {key!r} is not a regular expression ({e})") from e
    return default


def check_config(cfg: dict[str, Any], adapter: Path) -> None:
    """Refuse, naming the adapter_config.json field, what a merge of W + s * B @ A would get wrong."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _refuse(adapter, "peft_type", cfg.get("peft_type"), "only LoRA merges into the weights")
    if cfg.get("use_dora"):
        raise _refuse(adapter, "use_dora", True, "DoRA rescales each weight row by a learned magnitude")
    if cfg.get("modules_to_save"):
        raise _refuse(adapter, "modules_to_save", cfg["modules_to_save"], "full module copies, not LoRA")
    if cfg.get("bias", "none") != "none":
        raise _refuse(adapter, "bias", cfg["bias"], "trained biases; DiffusionGemma's linears have none")
    for flag, why in VARIANT_FIELDS.items():
        if cfg.get(flag):
            raise _refuse(adapter, flag, cfg[flag], why)
    if cfg.get("target_parameters"):
        raise _refuse(adapter, "target_parameters", cfg["target_parameters"], "LoRA on the MoE experts")
    init = cfg.get("init_lora_weights")
    method = init.lower().split("_niter_")[0] if isinstance(init, str) else None
    if method in BASE_REWRITING_INITS:
        fix = (
            "save it as a plain LoRA with PEFT's conversion: model.save_pretrained(DIR, "
            "path_initial_model_for_weight_conversion=INIT_DIR), INIT_DIR holding the adapter as initialised"
            if method in CONVERTIBLE_INITS
            else "merge it with the tool that trained it and pass the merged checkpoint as --model"
        )
        raise DgpipeError(
            f"--adapter {adapter}: adapter_config.json init_lora_weights={init!r} is not supported (the "
            "adapter applies to a residual of the base weights, which PEFT recomputes when it loads it)",
            fix,
        )


def adapted_copies(keys: Iterable[str]) -> set[str]:
    """Which of transformers' module trees an adapter's tensor names adapt: 'decoder', 'encoder', or both
    (AutoModel's single stack runs in both passes)."""
    copies: set[str] = set()
    for key in keys:
        m = _KEY.match(key)
        module = m.group(1) if m else key
        if _DECODER.match(module):
            copies.add("decoder")
        elif _ENCODER.match(module):
            copies.add("encoder")
        elif _AUTOMODEL.match(module):
            copies |= {"decoder", "encoder"}
    return copies


def one_copy_note(copies: set[str]) -> str | None:
    """What merging an adapter of one copy changes, or None when it adapts both."""
    if len(copies) != 1:
        return None
    (only,) = copies
    (other,) = set(COPIES) - copies
    return (
        f"adapts {COPIES[only]} only: it was trained with {COPIES[other]} on the base weights, and merged "
        "(as PEFT's merge_and_unload merges it) the adapted weights run in both passes"
    )


def checkpoint_name(module: str, adapter: Path) -> str:
    """The checkpoint tensor a LoRA module adapts, in every producer's layout: transformers' decoder
    (`model.decoder.layers.N.x`), its tied encoder copy (`model.encoder.language_model.layers.N.x`) and
    AutoModel's single stack (`model.layers.N.x`) all name `model.decoder.layers.N.x.weight`; a tied
    `lm_head` names the embedding."""
    for pattern in (_DECODER, _ENCODER, _AUTOMODEL):
        m = pattern.match(module)
        if m:
            return f"model.decoder.{m.group(1)}.weight"
    if module == TIED_HEAD:
        raise DgpipeError(
            f"--adapter {adapter}: a LoRA on lm_head, which DiffusionGemma ties to the input embedding",
            "merging it would change the embedding too; train with embed_tokens instead of lm_head",
        )
    raise DgpipeError(
        f"--adapter {adapter}: targets '{module}', which is not a DiffusionGemma text module",
        "the adapter belongs to another architecture, or adapts the vision tower: dgpipe serves text, so "
        "train it on the text modules (e.g. target_modules=r'model\\.decoder\\..*_proj')",
    )


def read_adapter(adapter: Path) -> Adapter:
    """adapter_config.json (checked) and adapter_model.safetensors, keys normalised per producer layout."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg_file, wfile = adapter / "adapter_config.json", adapter / "adapter_model.safetensors"
    if not cfg_file.is_file():
        raise DgpipeError(f"--adapter {adapter}: no adapter_config.json", "pass a LoRA adapter directory")
    if not wfile.is_file():
        raise DgpipeError(
            f"--adapter {adapter}: no adapter_model.safetensors (pickled adapters are refused)",
            "save it with save_pretrained(DIR, safe_serialization=True)",
        )
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DgpipeError(f"--adapter {adapter}: adapter_config.json is not JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise DgpipeError(f"--adapter {adapter}: adapter_config.json is not a JSON object")
    check_config(cfg, adapter)
    _, scale = scaling(cfg, adapter)
    base = cfg.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise DgpipeError(
            f"--adapter {adapter}: adapter_config.json base_model_name_or_path={base!r} is not a name"
        )
    try:
        tensors = load_file(str(wfile))
    except (SafetensorError, OSError) as e:
        raise DgpipeError(
            f"--adapter {adapter}: {wfile.name} cannot be read ({e})", "the file is damaged"
        ) from e
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if not m:
            raise DgpipeError(f"--adapter {adapter}: unexpected tensor '{key}' (not a LoRA A/B weight)")
        halves.setdefault(m.group(1), {})[m.group(2)] = t
    pairs: dict[str, list[tuple[torch.Tensor, torch.Tensor, bool, float]]] = {}
    for module, ab in sorted(halves.items()):
        emb = "embedding_A" in ab or "embedding_B" in ab
        a, b = (ab.get("embedding_A"), ab.get("embedding_B")) if emb else (ab.get("A"), ab.get("B"))
        if a is None or b is None:
            raise DgpipeError(f"--adapter {adapter}: '{module}' lacks lora_A or lora_B")
        r, module_scale = scaling(cfg, adapter, module)
        _check_rank(adapter, module, a, b, r)
        pairs.setdefault(checkpoint_name(module, adapter), []).append((a, b, emb, module_scale))
    return Adapter(adapter, base, scale, pairs, adapted_copies(halves))


def _check_rank(adapter: Path, module: str, a: torch.Tensor, b: torch.Tensor, r: int) -> None:
    """A is [r, in] and B [out, r] (PEFT's nn.Linear pair; an embedding's A is [r, vocab]) at the config's
    r, which the scale divides by: PEFT refuses to load any other shape."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise DgpipeError(
            f"--adapter {adapter}: '{module}' has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
            "not a rank-r pair [r, in] and [out, r]",
            "the adapter is damaged or a LoRA variant dgpipe does not merge",
        )
    if a.shape[0] != r:
        raise DgpipeError(
            f"--adapter {adapter}: '{module}' has rank {a.shape[0]}, adapter_config.json r={r}",
            "the config does not belong to these weights (PEFT would refuse to load them too)",
        )


def delta(a: torch.Tensor, b: torch.Tensor, s: float, embedding: bool) -> torch.Tensor:
    """PEFT's get_delta_weight in fp32: s * B @ A ((B @ A).T for an embedding). `fan_in_fan_out` is not
    read: PEFT sets it False for nn.Linear and nn.Embedding, DiffusionGemma's only adapted modules."""
    d = s * (b.float() @ a.float())
    return d.T if embedding else d


@torch.no_grad()
def merge_into(state: dict[str, torch.Tensor], ad: Adapter) -> list[str]:
    """Add every delta to `state` in place (fp32 sum, cast back to the weight's dtype), once per tied
    weight; returns the merged tensor names."""
    for name, ab in ad.pairs.items():
        if name not in state:
            raise DgpipeError(
                f"--adapter {ad.path}: adapts '{name}', which the base checkpoint does not have",
                "the adapter belongs to another architecture or base model",
            )
        deltas = [delta(a, b, s, emb) for a, b, emb, s in ab]
        for d in deltas:
            if tuple(d.shape) != tuple(state[name].shape):
                raise DgpipeError(
                    f"--adapter {ad.path}: '{name}' delta has shape {tuple(d.shape)}, the base weight "
                    f"{tuple(state[name].shape)}",
                    "the adapter was trained on a base model of another size",
                )
            if not torch.allclose(d, deltas[0], atol=1e-6, rtol=1e-4):
                raise DgpipeError(
                    f"--adapter {ad.path}: different LoRA deltas for the tied encoder and decoder copies of "
                    f"'{name}' (PEFT trains the two modules' LoRAs apart)",
                    "the model runs one set of weights in both passes: train the LoRA on one copy "
                    "(target_modules=r'model\\.decoder\\..*_proj'), or with NeMo AutoModel (one stack)",
                )
        w = state[name]
        state[name] = (w.float() + deltas[0]).to(w.dtype)
    note = one_copy_note(ad.copies)
    if note:
        log.warning("--adapter %s %s", ad.path, note)
    return sorted(ad.pairs)


def same_base(declared: str | None, base: Path) -> bool:
    """The adapter's base_model_name_or_path names this checkpoint (path, or same final name component,
    e.g. `google/diffusiongemma-26B-A4B-it` vs a local `.../diffusiongemma-26B-A4B-it`, or the Hugging Face
    cache's snapshot of that repository, `.../models--google--diffusiongemma-26B-A4B-it/snapshots/<commit>`)."""
    if not declared or declared == "N/A":
        return True  # not recorded: names and shapes still have to match
    d = declared.rstrip("/")
    if Path(d).exists() and Path(d).resolve() == base.resolve():
        return True
    where = base.resolve()
    if (
        where.parent.name == "snapshots"
        and where.parent.parent.name.lower() == "models--" + d.replace("/", "--").lower()
    ):
        return True
    return d.split("/")[-1].lower() == where.name.lower()
