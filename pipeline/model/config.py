"""Typed views of a DiffusionGemma checkpoint's config.json and of the sampler settings.

The runtime never touches transformers' config classes: it reads the same JSON into pydantic models so
that a malformed field fails with the field's name, and so that `--help` stays fast (no torch import).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.errors import CheckpointError, SamplerError, validation_error
from pipeline.model.files import read_json  # bounded read (a link to /dev/zero must not hang)

LayerType = Literal["sliding_attention", "full_attention"]

# sanity limits (inclusive) of config.json's sizes, checked before anything is allocated: far above any
# real Gemma-family model (26B-A4B: vocab 262144, hidden 2816, 30 layers, 128 experts), far below what
# would make `generate` allocate for minutes or hang (num_hidden_layers 10**6). One place for all of them.
CONFIG_LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 21),
    "hidden_size": (1, 1 << 16),
    "intermediate_size": (1, 1 << 18),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 4096),
    "global_head_dim": (1, 4096),
    "num_global_key_value_heads": (1, 1024),
    "max_position_embeddings": (1, 1 << 24),
    "sliding_window": (1, 1 << 24),
    "num_experts": (1, 4096),
    "top_k_experts": (1, 4096),
    "moe_intermediate_size": (1, 1 << 18),
    "canvas_length": (1, 1 << 14),  # ModelConfig's
}
# configs/models/<name>.yaml of the 26B-A4B: what the benchmarks and memory estimates size by default
FLAGSHIP_CONFIG = "diffusiongemma-26b-a4b"
CONFIG_HINT = "fix config.json: it must describe a DiffusionGemma model (transformers' DiffusionGemmaConfig)"


class RopeParams(BaseModel):
    model_config = ConfigDict(extra="ignore")
    rope_type: Literal["default", "proportional"] = "default"
    rope_theta: float = 10_000.0
    partial_rotary_factor: float = 1.0


class LayerShape(BaseModel):
    """Head geometry of one layer: global layers have wider heads and fewer KV heads than sliding ones."""

    layer_type: LayerType
    head_dim: int
    num_kv_heads: int

    @property
    def is_sliding(self) -> bool:
        return self.layer_type == "sliding_attention"


def _size(default: int, name: str) -> Any:
    """A size the model allocates from, bounded by CONFIG_LIMITS[name]: pydantic checks it while parsing,
    so a corrupt or hostile config.json is refused before anything is allocated (not after minutes of it)."""
    lo, hi = CONFIG_LIMITS[name]
    return Field(default, ge=lo, le=hi)


MAX_PARAMETERS = 2 * 10**12  # what the sizes together may describe: beyond it, no machine loads it


class TextConfig(BaseModel):
    """The text backbone. Field names follow transformers' `DiffusionGemmaTextConfig` so JSON maps 1:1."""

    model_config = ConfigDict(extra="ignore")

    vocab_size: int = _size(262_144, "vocab_size")
    hidden_size: int = _size(2816, "hidden_size")
    intermediate_size: int = _size(2112, "intermediate_size")
    num_hidden_layers: int = _size(30, "num_hidden_layers")
    num_attention_heads: int = _size(16, "num_attention_heads")
    num_key_value_heads: int = _size(8, "num_key_value_heads")
    head_dim: int = _size(256, "head_dim")
    global_head_dim: int = _size(512, "global_head_dim")
    num_global_key_value_heads: int | None = Field(
        default=2,
        ge=CONFIG_LIMITS["num_global_key_value_heads"][0],
        le=CONFIG_LIMITS["num_global_key_value_heads"][1],
    )
    hidden_activation: Literal["gelu_pytorch_tanh"] = "gelu_pytorch_tanh"
    max_position_embeddings: int = _size(131_072, "max_position_embeddings")
    rms_norm_eps: float = 1e-6
    pad_token_id: int = 0
    eos_token_id: int | list[int] = 1
    bos_token_id: int = 2
    tie_word_embeddings: bool = True
    rope_parameters: dict[str, RopeParams] = Field(
        default_factory=lambda: {
            "sliding_attention": RopeParams(rope_type="default", rope_theta=10_000.0),
            "full_attention": RopeParams(
                rope_type="proportional", rope_theta=1e6, partial_rotary_factor=0.25
            ),
        }
    )
    attention_bias: bool = False
    sliding_window: int = _size(1024, "sliding_window")
    layer_types: list[LayerType] | None = None
    final_logit_softcapping: float = 30.0
    use_bidirectional_attention: Literal["vision"] | None = None
    num_experts: int = _size(128, "num_experts")
    top_k_experts: int = _size(8, "top_k_experts")
    moe_intermediate_size: int = _size(704, "moe_intermediate_size")
    per_layer_config: dict[str, dict[str, int]] | None = None

    @model_validator(mode="after")
    def _fill_layer_types(self) -> TextConfig:
        for key, override in (self.per_layer_config or {}).items():
            if not key.isdigit() or int(key) >= self.num_hidden_layers:
                raise ValueError(f"per_layer_config key {key!r} is not a layer index")
            for field_name, value in override.items():
                if not 1 <= value <= CONFIG_LIMITS["head_dim"][1]:
                    raise ValueError(f"per_layer_config[{key!r}].{field_name} is {value}")
        for name in ("rms_norm_eps", "final_logit_softcapping"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be finite and > 0 (got {getattr(self, name)})")
        for token in (self.pad_token_id, self.bos_token_id, *self.end_token_ids):
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"token id {token} is outside the vocabulary [0, {self.vocab_size})")
        if self.layer_types is None:
            self.layer_types = [
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                for i in range(self.num_hidden_layers)
            ]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        self.layer_types[-1] = "full_attention"  # transformers forces this too
        if self.top_k_experts > self.num_experts:
            raise ValueError(f"top_k_experts ({self.top_k_experts}) > num_experts ({self.num_experts})")
        if self.num_attention_heads < 1:
            raise ValueError("num_attention_heads must be >= 1")
        if self.parameter_estimate() > MAX_PARAMETERS:
            raise ValueError(
                f"these sizes describe ~{self.parameter_estimate():.3g} parameters, over the sanity limit of "
                f"{MAX_PARAMETERS:.0e}: config.json is corrupt or not a DiffusionGemma config"
            )
        return self

    def parameter_estimate(self) -> int:
        """About how many weights these sizes describe (an upper estimate: the wider head everywhere)."""
        h, dim = self.hidden_size, max(self.head_dim, self.global_head_dim)
        attention = 2 * h * self.num_attention_heads * dim + 2 * h * self.num_key_value_heads * dim
        mlp = 3 * h * self.intermediate_size + self.num_experts * 3 * h * self.moe_intermediate_size
        return self.vocab_size * h + self.num_hidden_layers * (attention + mlp)

    def layer_shape(self, idx: int) -> LayerShape:
        assert self.layer_types is not None
        kind = self.layer_types[idx]
        if kind == "sliding_attention":
            return LayerShape(layer_type=kind, head_dim=self.head_dim, num_kv_heads=self.num_key_value_heads)
        if self.per_layer_config is not None:
            # transformers zero-pads the keys to the width of the largest index ("05" in a 30-layer model);
            # a field a layer's entry leaves out is the text config's own (transformers' per-layer config
            # inherits it: 5.x writes `{"head_dim": 512}` alone when num_global_key_value_heads is unset)
            override = {int(k): v for k, v in self.per_layer_config.items()}.get(idx, {})
            return LayerShape(
                layer_type=kind,
                head_dim=override.get("head_dim", self.head_dim),
                num_kv_heads=override.get("num_key_value_heads", self.num_key_value_heads),
            )
        return LayerShape(
            layer_type=kind,
            head_dim=self.global_head_dim,
            num_kv_heads=self.num_global_key_value_heads or self.num_key_value_heads,
        )

    @property
    def end_token_ids(self) -> list[int]:
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)


class ModelConfig(BaseModel):
    """Top-level `DiffusionGemmaConfig`; the vision config is kept as raw JSON and never instantiated."""

    model_config = ConfigDict(extra="ignore")

    model_type: str
    text_config: TextConfig
    vision_config: dict[str, Any] | None = None
    canvas_length: int = _size(256, "canvas_length")
    tie_word_embeddings: bool = True

    @field_validator("model_type")
    @classmethod
    def _known_type(cls, v: str) -> str:
        if v != "diffusion_gemma":
            raise ValueError(f"model_type is {v!r}, expected 'diffusion_gemma'")
        return v

    @field_validator("tie_word_embeddings")
    @classmethod
    def _tied(cls, v: bool) -> bool:
        # the loader reads the output projection from the input embedding and skips any lm_head tensor, so
        # an untied checkpoint would run with the wrong head
        if not v:
            raise ValueError(
                "tie_word_embeddings is false: dgpipe runs DiffusionGemma's head tied to its input embedding"
            )
        return v

    @classmethod
    def from_json_file(cls, path: Path) -> ModelConfig:
        return cls.from_raw(read_json(path), source=str(path))

    @classmethod
    def from_raw(cls, raw: Any, source: str = "config") -> ModelConfig:
        """Parsed JSON of any shape (a list or null config.json is refused with the field's name)."""
        if not isinstance(raw, dict):
            raise CheckpointError(f"{source}: holds a {type(raw).__name__}, not a JSON object", CONFIG_HINT)
        if not isinstance(raw.get("text_config", {}), dict):
            raise CheckpointError(f"{source}: field 'text_config' is not an object", CONFIG_HINT)
        return cls.from_dict(raw, source)

    @classmethod
    def from_yaml(cls, name: str, **text: Any) -> ModelConfig:
        """One of configs/models by name, or a YAML file of the user's (`--config`), read strictly: a key
        this model does not have is refused by name (a config.json from transformers may carry keys dgpipe
        does not read; dgpipe's own YAML has none, so a misspelt key would silently take the 26B's
        default instead). `text`: text_config fields set over the file's (a benchmark's smaller variant)."""
        from pipeline.resources import load_yaml

        raw = load_yaml("models", name)
        for where, keys, known in (
            ("", raw, cls.model_fields),
            (
                "text_config.",
                raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {},
                TextConfig.model_fields,
            ),
        ):
            unknown = sorted(set(keys) - set(known))
            if unknown:
                close = difflib.get_close_matches(unknown[0], known, n=1)
                raise CheckpointError(
                    f"{name}: unknown key '{where}{unknown[0]}'",
                    f"did you mean '{where}{close[0]}'?" if close else f"the keys are: {', '.join(known)}",
                )
        if text:
            raw["text_config"] = {**(raw.get("text_config") or {}), **text}
        return cls.from_raw(raw, source=name)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> ModelConfig:
        raw = dict(raw)
        text = dict(raw.get("text_config") or {})
        # transformers serialises the global-layer geometry only inside per_layer_config
        raw["text_config"] = text

        def message(where: str, msg: str) -> str:
            msg = msg.removeprefix("Value error, ")
            return f"{source}: field '{where}': {msg}" if where else f"{source}: {msg}"

        with validation_error(message, CheckpointError, CONFIG_HINT):
            return cls.model_validate(raw)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json transformers writes for this model (round-trips through DiffusionGemmaConfig)."""
        text = self.text_config.model_dump(exclude={"global_head_dim", "num_global_key_value_heads"})
        text["model_type"] = "diffusion_gemma_text"
        text["rope_parameters"] = {
            k: {
                kk: vv
                for kk, vv in v.model_dump().items()
                if not (kk == "partial_rotary_factor" and vv == 1.0)
            }
            for k, v in self.text_config.rope_parameters.items()
        }
        width = len(str(self.text_config.num_hidden_layers - 1))
        text["per_layer_config"] = {
            f"{i:0{width}d}": {"head_dim": s.head_dim, "num_key_value_heads": s.num_kv_heads}
            for i in range(self.text_config.num_hidden_layers)
            if not (s := self.text_config.layer_shape(i)).is_sliding
        }
        out: dict[str, Any] = {
            "architectures": ["DiffusionGemmaForBlockDiffusion"],
            "model_type": "diffusion_gemma",
            "canvas_length": self.canvas_length,
            "tie_word_embeddings": True,
            "text_config": text,
        }
        if self.vision_config is not None:
            out["vision_config"] = self.vision_config
        return out


# the documented range (inclusive) of each float sampler knob: outside it the sampler's arithmetic is not
# meaningful (a temperature of 1e-45 divides logits to inf, 1e39 is inf in fp32; both turn probabilities to
# NaN). SamplerConfig checks them, and the server's request schema refuses a request before it is queued.
SAMPLER_RANGES: dict[str, tuple[float, float]] = {
    "t_min": (0.001, 100.0),
    "t_max": (0.001, 100.0),
    "entropy_bound": (0.001, 1e6),  # below 0.001 it keeps one token per step, as 0.001 does
    "confidence_threshold": (0.0, 100.0),  # a mean entropy in nats (ln of any vocabulary is < 100)
}


class SamplerConfig(BaseModel):
    """Entropy-bound sampler settings (docs/model.md, "Sampler"). Defaults are the published generation defaults."""

    model_config = ConfigDict(extra="forbid")

    max_denoising_steps: int = Field(48, description="denoise passes per canvas at most")
    entropy_bound: float = Field(
        0.1, description="EB-sampler budget: sum of accepted entropies minus the max"
    )
    t_min: float = Field(0.4, description="temperature at the last step")
    t_max: float = Field(0.8, description="temperature at the first step")
    stability_threshold: int = Field(
        1, description="steps the argmax canvas must stay unchanged to stop early"
    )
    confidence_threshold: float = Field(
        0.005, description="mean entropy below which a stable canvas stops; 0 = fixed steps"
    )

    @model_validator(mode="after")
    def _check(self) -> SamplerConfig:
        if self.max_denoising_steps < 1:
            raise SamplerError(f"max_denoising_steps must be >= 1 (got {self.max_denoising_steps})")
        for name, (lo, hi) in SAMPLER_RANGES.items():
            value = getattr(self, name)
            if not lo <= value <= hi:  # NaN fails it too
                # 7 significant digits: a value sent as fp32 (Triton's inputs) reads as sent, 0.0001 not 9.99e-05
                raise SamplerError(f"{name} must be in [{lo:g}, {hi:g}] (got {value:.7g})")
        if self.t_min > self.t_max:
            raise SamplerError(f"t_min ({self.t_min}) must be <= t_max ({self.t_max})")
        if self.stability_threshold < 0:
            raise SamplerError(f"stability_threshold must be >= 0 (got {self.stability_threshold})")
        return self

    def temperature(self, step: int) -> float:
        """Linear schedule from t_max at step 0 to t_min + (t_max-t_min)/N at the last step (as transformers)."""
        n = self.max_denoising_steps
        return self.t_min + (self.t_max - self.t_min) * (n - step) / n

    def transformers_kwargs(self) -> dict[str, Any]:
        """The same settings for transformers' DiffusionGemma `generate` (which refuses a confidence
        threshold of 0: 1e-30 is never reached by a mean entropy, so it is fixed steps there too)."""
        from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

        return {
            "max_denoising_steps": self.max_denoising_steps,
            "sampler_config": EntropyBoundSamplerConfig(entropy_bound=float(self.entropy_bound)),
            "t_min": self.t_min,
            "t_max": self.t_max,
            "stability_threshold": self.stability_threshold,
            "confidence_threshold": float(self.confidence_threshold) or 1e-30,
        }

    @classmethod
    def from_generation_config(cls, raw: dict[str, Any], **overrides: Any) -> SamplerConfig:
        """Read generation_config.json; `sampler_config.entropy_bound` nests the bound there."""
        vals: dict[str, Any] = {}
        for key in ("max_denoising_steps", "t_min", "t_max", "stability_threshold", "confidence_threshold"):
            if raw.get(key) is not None:
                vals[key] = raw[key]
        sc = raw.get("sampler_config") or {}
        if isinstance(sc, dict) and sc.get("entropy_bound") is not None:
            vals["entropy_bound"] = sc["entropy_bound"]
        vals.update({k: v for k, v in overrides.items() if v is not None})
        with validation_error(lambda where, msg: f"sampler setting '{where}': {msg}", SamplerError):
            return cls(**vals)
