"""Options shared by several commands, spelled once, and the user cache dir that replaces `./runs` defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.devices import DEVICE_CHOICES
from pipeline.limits import DEFAULTS as LIMITS  # the defaults the limit options show (None: not given)
from pipeline.limits import Limits
from pipeline.resources import cache_dir as cache_dir  # where commands write when not told
from quantize.defaults import CALIB_SIZE as CALIB_SIZE  # the --calib-size default, re-exported

Model = Annotated[
    Path | None,
    typer.Option(
        "--model",
        "-m",
        help="checkpoint dir: Hugging Face, ModelOpt-quantized, Unsloth merged, a NeMo AutoModel checkpoint "
        "(consolidated or sharded) or a LoRA adapter with a local base (`dgpipe inspect DIR` says which); "
        "default: the embedded Sudoku model",
    ),
]
Adapter = Annotated[
    Path | None,
    typer.Option(
        "--adapter",
        help="LoRA adapter dir (PEFT, Unsloth or NeMo AutoModel) merged into --model with its producer's "
        "formula (cached under ~/.cache/dgpipe/merged)",
    ),
]
Device = Annotated[str, typer.Option(help=DEVICE_CHOICES)]
Dtype = Annotated[str, typer.Option(help="float32, bfloat16, float16 or auto (bf16 on GPU, fp32 on CPU)")]
Json = Annotated[bool, typer.Option("--json", help="machine-readable output")]
ModelName = Annotated[
    str,
    typer.Option(
        "--name",
        help="the served model's name: its directory in the Triton repository and what clients send",
    ),
]
Compile = Annotated[
    bool,
    typer.Option(
        "--compile",
        help="torch.compile the network passes: faster passes after one compile per new shape "
        "(minutes on a small CPU, cached on disk); tokens equal to eager within fp32 rounding",
    ),
]


def _limit(help: str, name: str) -> typer.models.OptionInfo:
    return typer.Option(help=f"{help} (default: {getattr(LIMITS, name)})", show_default=False)


# One option per limit, named as the limit (pipeline.limits.Limits) and as its config.pbtxt parameter.
MaxBatch = Annotated[int | None, _limit("rows of one pass: requests sharing a denoise pass", "max_batch")]
MaxPrompt = Annotated[int | None, _limit("longest prompt, in tokens", "max_prompt")]
MaxContext = Annotated[
    int | None, _limit("most cached tokens a row attends to (prompt + generated)", "max_context")
]
MaxTokens = Annotated[int | None, _limit("largest max_tokens a request may ask for", "max_tokens")]
MaxSteps = Annotated[
    int | None, _limit("largest max_denoising_steps (passes per canvas) a request may ask for", "max_steps")
]
MaxRequestSeconds = Annotated[
    int | None,
    _limit(
        "seconds a request may run before the server ends it with an error and frees its slot",
        "max_request_seconds",
    ),
]
MaxQueue = Annotated[
    int | None,
    _limit(
        "requests waiting for a batch slot before one more is refused 503, retry elsewhere (0: no cap)",
        "max_queue",
    ),
]
MaxPromptBytes = Annotated[
    int | None,
    _limit(
        "largest prompt a request may send, in UTF-8 bytes (checked before tokenizing)", "max_prompt_bytes"
    ),
]
MaxGuideBytes = Annotated[
    int | None,
    _limit("largest constrained-decoding guide (schema, regex, grammar), in UTF-8 bytes", "max_guide_bytes"),
]
MaxRegexPositions = Annotated[
    int | None,
    _limit("largest regex guide, in positions once its counted repeats are unrolled", "max_regex_positions"),
]
MaxGuideSeconds = Annotated[
    int | None, _limit("seconds compiling one guide may take before it is refused (400)", "max_guide_seconds")
]
MaxGuideMemoryMib = Annotated[
    int | None, _limit("MiB compiling one guide may take before it is refused (400)", "max_guide_memory_mib")
]
PrefixCacheMib = Annotated[
    int | None,
    _limit(
        "MiB for the K/V of prompt blocks reused across requests (prefix caching; 0: off)", "prefix_cache_mib"
    ),
]
CalibSize = Annotated[int, typer.Option(help="calibration prompts")]


def model_dir(model: Path | None, adapter: Path | None) -> Path | None:
    """`--model` / `--adapter` as the one checkpoint dir every command loads (None: neither given)."""
    if model is None and adapter is None:
        return None
    from pipeline.model.source import resolve
    from pipeline.runtime.session import default_model_path

    return resolve(model or default_model_path(), adapter, cache_dir())


def limits(**values: int | None) -> Limits:
    """The limit options as one Limits (those not given: the defaults), a bad value named by its option."""
    return Limits.of("options", **values)


def output(help: str):
    """`--output DIR`: what one command writes."""
    return typer.Option("--output", help=help)


def out(help: str, cached: str):
    """`--out DIR`: where a benchmark, evaluation or training run puts its results; when not given, the
    directory `cached` under the cache dir (the callback resolves it, so a command's body sees a Path and
    the name is written once, here, for the help and the default alike)."""
    return typer.Option(
        "--out",
        help=f"{help}; {in_cache(cached)}",
        callback=lambda v: cache_dir() / cached if v is None else v,
    )


def precision(help: str = "nvfp4, fp8, int4_awq or bf16 (configs/precisions)"):
    """`--precision / -p`: the weight format a command builds or runs (every command spells it alike)."""
    return typer.Option("--precision", "-p", help=help)


def build_dir(help: str):
    """`--build-dir DIR`: a `dgpipe build` directory (build_manifest.json)."""
    return typer.Option("--build-dir", help=help)


def in_cache(sub: str) -> str:
    """The help text for a default under the cache dir."""
    return f"default: ~/.cache/dgpipe/{sub} ($DGPIPE_CACHE or $XDG_CACHE_HOME move it)"


def givens_range(text: str) -> tuple[int, int]:
    """`--givens LO-HI` (eval sudoku, train)."""
    from pipeline.errors import DgpipeError

    try:
        lo, hi = (int(x) for x in text.split("-"))
    except ValueError as e:
        raise DgpipeError(f"--givens {text!r}: expected LO-HI, e.g. 45-61") from e
    if not 17 <= lo <= hi <= 81:
        raise DgpipeError(f"--givens {text}: need 17 <= LO <= HI <= 81")
    return lo, hi


def int_list(text: str, flag: str, example: str = "") -> list[int]:
    """`--flag 1,2,4`: comma-separated counts (batch sizes, concurrency levels), each at least 1."""
    from pipeline.errors import DgpipeError

    try:
        values = [int(x) for x in text.split(",")]
    except ValueError as e:
        raise DgpipeError(f"{flag} {text!r}: expected comma-separated integers{example}") from e
    if min(values) < 1:
        raise DgpipeError(f"{flag} {text!r}: expected counts of at least 1{example}")
    return values


def typer_app(**kwargs) -> typer.Typer:
    """The `app` every command module defines: completion options live nowhere (as on the root)."""
    return typer.Typer(add_completion=False, **kwargs)
