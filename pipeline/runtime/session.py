"""A loaded checkpoint ready to serve text: model + tokenizer + prompt format + sampler defaults.

The prompt format (text or chat messages <-> tokens, infill template) is the one the checkpoint names, looked
up in `pipeline.runtime.prompt_format`; the session never branches on the task. Generation stops on the
checkpoint's end tokens: config.json's, generation_config.json's `eos_token_id` (a chat model's end-of-turn
token) and the tokenizer's `eos_token`, all set on the model config the runtime reads them from.

Shared by `dgpipe generate`, `eval`, `bench` and the Triton model so they all turn text into requests
(and tokens back into text) the same way.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.devices import check_device
from pipeline.errors import DgpipeError, InputError
from pipeline.model.checkpoint import Checkpoint, load_model
from pipeline.model.config import SamplerConfig
from pipeline.model.network import DiffusionGemma
from pipeline.model.validate import validate_checkpoint
from pipeline.resources import EMBEDDED_MODEL
from pipeline.runtime.chat_template import Message, end_token_ids
from pipeline.runtime.prompt_format import PromptFormat, prompt_format_for
from pipeline.sampler.constraints import GuideCompiler, GuideSpec, TokenAutomaton

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | None) -> torch.device:
    if device is not None:
        check_device(device)
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DgpipeError(
            f"--device {device}: no CUDA device is visible", "use --device cpu or check nvidia-smi"
        )
    return torch.device(device)


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise DgpipeError(f"--dtype {dtype}: unknown", f"choose one of: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def default_model_path() -> Path:
    if not (EMBEDDED_MODEL / "config.json").is_file():
        raise DgpipeError(
            f"the embedded model is missing from {EMBEDDED_MODEL}", "pass --model DIR or reinstall dgpipe"
        )
    return EMBEDDED_MODEL


@dataclass
class Session:
    model: DiffusionGemma
    checkpoint: Checkpoint
    tokenizer: Any  # tokenizers.Tokenizer | None
    # a quantized checkpoint on a GPU: what runs on tensor cores, what fell back and why (gpu_load.Installed)
    tensor_cores: Any = None
    prompt_format: PromptFormat = field(init=False)  # the one the checkpoint names
    _guides: GuideCompiler | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        self.prompt_format = prompt_format_for(self.checkpoint, self.tokenizer)
        configs = [self.checkpoint.config, *([self.model.config] if self.model is not None else [])]
        ends = end_token_ids(
            self.checkpoint.path,
            self.checkpoint.config.text_config.end_token_ids,
            self.checkpoint.generation_config,
            self.tokenizer,
        )
        for config in configs:  # the runtime stops on text_config.end_token_ids
            config.text_config.eos_token_id = ends

    @property
    def max_new_tokens(self) -> int | None:
        """generation_config.json's `max_new_tokens`: the checkpoint's own default for how many tokens a
        request generates when it does not say (None: it sets none; validate_checkpoint checks the value)."""
        value = self.checkpoint.generation_config.get("max_new_tokens")
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None

    @property
    def end_token_ids(self) -> list[int]:
        return self.checkpoint.config.text_config.end_token_ids

    def compile_guide(self, kind: str, guide: str) -> TokenAutomaton:
        """A constrained-decoding guide (constraints.GUIDE_TYPES) -> the automaton a Request carries; recent
        ones are cached. Refusals (unsupported schema keyword, bad regex) raise InputError naming them."""
        if self._guides is None:
            self._guides = GuideCompiler(
                self.tokenizer, self.checkpoint.config.text_config.vocab_size, self.end_token_ids
            )
        return self._guides.compile(GuideSpec(kind, guide))

    def sampler(self, **overrides: Any) -> SamplerConfig:
        """generation_config.json defaults, overridden by whatever the caller set (CLI > file > defaults)."""
        return SamplerConfig.from_generation_config(self.checkpoint.generation_config, **overrides)

    def encode_prompt(self, text: str) -> list[int]:
        if not text:
            raise InputError("prompt is empty", "pass the text to continue")
        return self.prompt_format.encode_prompt(text)

    def encode_messages(self, messages: list[Message], tools: list | None = None) -> list[int]:
        """Checked chat messages (chat_template.parse_messages) -> prompt ids, through the checkpoint's format;
        `tools` (OpenAI's function tools) rendered by the chat template as transformers renders them."""
        encode = getattr(self.prompt_format, "encode_messages", None)
        if encode is None:  # a format written before chat messages existed
            raise InputError(f"the prompt format {type(self.prompt_format).__name__} takes no chat messages")
        if not tools:
            return encode(messages)
        if "tools" not in inspect.signature(encode).parameters:  # a task format: its prompt has no tools
            raise InputError(
                f"this model's prompt format ({type(self.prompt_format).__name__}) takes no tools",
                "send the request without tools",
            )
        return encode(messages, tools=tools)

    @property
    def tool_call_format(self) -> str | None:
        """The tool-call format the checkpoint's chat template declares (ChatTemplate.tool_call_format)."""
        template = getattr(self.prompt_format, "chat_template", None)
        return None if template is None else template.tool_call_format

    def default_template(self, text: str) -> list[int] | None:
        """The prompt format's infill for this prompt (a Sudoku's givens are pinned in the canvas), or None."""
        return self.prompt_format.infill_template(text)

    def build_template(self, text: str, hole: str = "_") -> list[int]:
        """Infill template from text: each `hole` character is one free canvas position, other text is
        tokenized and pinned. Positions past the template stay free."""
        if self.tokenizer is None:
            raise InputError("infill needs a tokenizer.json in the checkpoint")
        out: list[int] = []
        for is_hole, group in itertools.groupby(text, key=lambda c: c == hole):
            chunk = "".join(group)
            out.extend(
                [-1] * len(chunk) if is_hole else self.tokenizer.encode(chunk, add_special_tokens=False).ids
            )
        if len(out) > self.model.config.canvas_length:
            raise InputError(
                f"infill template is {len(out)} tokens, longer than the {self.model.config.canvas_length}-token canvas"
            )
        return out

    def decode(self, tokens: list[int]) -> str:
        return self.prompt_format.decode(tokens)

    def decode_prompt(self, prompt_ids: list[int]) -> str:
        """The text the prompt ids stand for, whether they came from a prompt or from chat messages."""
        decode = getattr(self.prompt_format, "decode_prompt", None) or self.prompt_format.decode
        return decode(prompt_ids)


def load_session(
    model: str | Path | None = None,
    dtype: str | None = None,
    device: str | None = None,
    canvas_length: int | None = None,
    weights: bool = True,
    compile: bool = False,
) -> Session:
    """`weights=False`: config, tokenizer and a weightless (meta) model, for a runtime whose weights live
    elsewhere (a TensorRT plan) — a 26B checkpoint is then never read into memory. `compile`: the network
    passes through torch.compile (`pipeline.runtime.compiled`: faster passes after a compile per shape)."""
    dev = resolve_device(device)
    path = Path(model) if model else default_model_path()
    tensor_cores = None
    if dev.type == "cuda" and dev.index is not None:
        # Triton launches on the current device, not its tensors' (cuda:1); a TensorRT plan and its streams
        # land on the current device too
        torch.cuda.set_device(dev)
    if weights:
        if dev.type == "cuda":  # FP8 / NVFP4 weights kept in their stored format, on tensor cores
            from pipeline.runtime.gpu_load import load_on_gpu

            m, ckpt, tensor_cores = load_on_gpu(path, resolve_dtype(dtype, dev), dev)
        else:
            m, ckpt = load_model(path, resolve_dtype(dtype, dev), dev)
    else:
        ckpt = validate_checkpoint(path)  # the headers still have to match the config
        with torch.device("meta"):
            m = DiffusionGemma(ckpt.config)
    if canvas_length is not None:
        if canvas_length < 1:
            raise DgpipeError(f"--canvas-length must be >= 1 (got {canvas_length})")
        m.config.canvas_length = canvas_length
    if compile and weights:
        from pipeline.runtime.compiled import compile_model

        compile_model(m)
    tokenizer = ckpt.tokenizer() if ckpt.has_tokenizer else None
    return Session(model=m, checkpoint=ckpt, tokenizer=tokenizer, tensor_cores=tensor_cores)
