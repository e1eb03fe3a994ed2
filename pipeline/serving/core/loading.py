"""Loading a model for serving from its repository entry: the session (checkpoint, tokenizer), the backend
(the TensorRT plan for this GPU when the repository holds a matching one, else the PyTorch model), the
server's limits from config.pbtxt's parameters, and the runtime. Transport-agnostic: the adapter passes
the model config as a dict and its logger."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import DgpipeError
from pipeline.serving import schema

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Log:
    info: Callable[[str], None]
    error: Callable[[str], None]


@dataclass
class LoadedModel:
    session: Any
    runtime: Any  # BlockDiffusionRuntime
    limits: schema.ServerLimits


def instance_count(config: dict[str, Any], visible_gpus: int) -> int:
    """How many stub processes serve this model on this host (each instance is its own: the thread budget
    is split). A KIND_GPU group without a `gpus` list puts `count` instances on every visible GPU."""

    def gpus(group: dict[str, Any]) -> int:
        if group.get("gpus"):
            return len(group["gpus"])
        return max(1, visible_gpus) if group.get("kind") == "KIND_GPU" else 1

    return sum(int(g.get("count", 1)) * gpus(g) for g in config.get("instance_group", [])) or 1


def serving_device(
    param: str, instance_kind: str | None = None, instance_device_id: str | None = None
) -> str:
    """The device an instance serves on: the repository's `device` parameter, or, for an instance Triton
    placed on a GPU (`instance_group { kind: KIND_GPU }`: the Python backend passes `model_instance_kind`
    "GPU" and `model_instance_device_id`), that GPU. Each such instance is its own process; left on "auto"
    (the current device, GPU 0) every instance of an 8-GPU group would load onto GPU 0."""
    if instance_kind != "GPU" or instance_device_id is None:
        return param
    placed = f"cuda:{int(instance_device_id)}"
    if param not in ("auto", "cuda", placed):
        raise DgpipeError(
            f"config.pbtxt places this instance on GPU {instance_device_id} (instance_group kind KIND_GPU) "
            f"but its device parameter is {param!r}",
            'set the device parameter to "auto", or use instance_group kind KIND_CPU with the device you want',
        )
    return placed


def server_limits(params: dict[str, str], positions: int, canvas_length: int) -> schema.ServerLimits:
    """The caps one request may ask for, from the repository's parameters (what `dgpipe package` writes
    when one is missing). The one place the model reads them."""
    from pipeline.limits import Limits

    fields = (*Limits.ENGINE_FIELDS, *Limits.SERVING_FIELDS)
    limits = Limits.from_record({k: int(params[k]) for k in fields if k in params}, "config.pbtxt parameters")
    return schema.ServerLimits(
        max_tokens=limits.max_tokens,
        max_steps=limits.max_steps,
        max_prompt=schema.prompt_limit(limits.max_prompt, positions, canvas_length),
        max_batch=limits.max_batch,
        max_queue=limits.max_queue,
        max_request_seconds=float(limits.max_request_seconds),
        max_prompt_bytes=limits.max_prompt_bytes,
        max_guide_bytes=limits.max_guide_bytes,
        max_regex_positions=limits.max_regex_positions,
        max_guide_seconds=limits.max_guide_seconds,
        max_guide_memory_mib=limits.max_guide_memory_mib,
        prefix_cache_mib=limits.prefix_cache_mib,
    )


def load_model(
    config: dict[str, Any],
    version_dir: Path,
    log: Log,
    instance_kind: str | None = None,
    instance_device_id: str | None = None,
) -> LoadedModel:
    """Everything the core serves with, for the model config (Triton's model_config as a dict), on the
    device `serving_device` picks from the config and the instance's placement."""
    import torch

    from pipeline.builddir import MODEL_CHECKPOINT
    from pipeline.limits import context_length
    from pipeline.model.checkpoint import open_checkpoint
    from pipeline.runtime.scheduler import BlockDiffusionRuntime
    from pipeline.runtime.session import load_session, resolve_device
    from pipeline.threads import apply_thread_policy

    instances = instance_count(config, torch.cuda.device_count())
    threads = apply_thread_policy(instances)
    log.info(f"dgpipe: {threads} compute threads per instance ({instances} instances)")
    params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
    ckpt = Path(params.get("checkpoint", MODEL_CHECKPOINT))
    ckpt = ckpt if ckpt.is_absolute() else version_dir / ckpt
    dtype = params.get("dtype", "auto")
    device = serving_device(params.get("device", "auto"), instance_kind, instance_device_id)
    dev = resolve_device(device)
    # compile: the PyTorch passes through torch.compile; the warm-up request compiles them during load
    compile = params.get("compile", "false") == "true"
    model_config = open_checkpoint(ckpt).config
    length = model_config.canvas_length
    positions = model_config.text_config.max_position_embeddings
    limits = server_limits(params, positions, length)
    # never past the model's positions: generation ends ("length") when the next canvas would not fit
    max_len = min(context_length(limits.max_prompt, limits.max_tokens, length), positions)
    admits = {"max_batch": limits.max_batch, "max_prompt": limits.max_prompt, "max_context": max_len}
    choice = _choose(version_dir, log, dev, admits)
    # with a TensorRT plan the weights live in the engine: the session then holds config + tokenizer only
    session = load_session(ckpt, dtype, device, weights=choice.kind != "tensorrt", compile=compile)
    backend = _backend(choice, session, log, dev)
    if backend is None:  # the plan failed to load: fall back to the PyTorch weights
        session = load_session(ckpt, dtype, device, compile=compile)
        backend = session.model
    if session.tensor_cores is not None:  # a quantized checkpoint on a GPU: which kernels, which fallbacks
        log.info(f"dgpipe: tensor cores: {session.tensor_cores.summary()}")
    runtime = BlockDiffusionRuntime(
        backend,
        max_len=max_len,
        max_batch=limits.max_batch,
        prefix_cache_mib=limits.prefix_cache_mib,
    )
    _warm(runtime, log)
    return LoadedModel(session, runtime, limits)


def _warm(runtime: Any, log: Log) -> None:
    """`runtime.warm_kernels()`, reported. A failure that leaves the GPU usable (out of memory, a compile
    error) costs only the warm-up: the server still comes up, and the kernels compile when a pass first
    needs them (where that fails too, the request says why). A lost CUDA context fails the load."""
    from pipeline.runtime.device_errors import unusable

    t0 = time.perf_counter()
    try:
        tokens = runtime.warm_kernels()
    except Exception as e:
        if unusable(runtime.device) is not None:
            raise
        log.error(f"dgpipe: compiling the experts' kernels ahead failed ({type(e).__name__}: {e}); "
                  "they compile when a pass first needs them")  # fmt: skip
        return
    if tokens:
        log.info(f"dgpipe: experts' kernels compiled for passes of {', '.join(map(str, tokens))} tokens "
                 f"({time.perf_counter() - t0:.1f} s)")  # fmt: skip


def _choose(version_dir: Path, log: Log, device: torch.device, admits: dict[str, int]):
    """The TensorRT plan for the instance's GPU when the repository holds a matching one, else the PyTorch
    model. A plan that is present but unusable (other TensorRT, other GPU) is logged as an error, not
    hidden."""
    from pipeline.engine.probe import gpu, tensorrt_version
    from pipeline.engine.select import choose_backend

    g = gpu(device.index or 0) if device.type == "cuda" else None
    choice = choose_backend(version_dir, g[0] if g else None, tensorrt_version(), admits)
    if choice.kind != "tensorrt":
        (log.error if choice.loud else log.info)(f"dgpipe: PyTorch runtime ({choice.reason})")
    return choice


def _backend(choice: Any, session: Any, log: Log, device: torch.device) -> Any:
    """The runtime's backend for the choice; None when a chosen plan fails to load (the log says why)."""
    if choice.kind != "tensorrt":
        return session.model
    try:
        from pipeline.engine.trt_backend import TensorRTBackend

        backend = TensorRTBackend(choice.engine_dir, session.model.config, device=str(device))
    except Exception as e:  # the server must come up
        log.error(f"dgpipe: TensorRT engine failed to load ({e}); using the PyTorch runtime")
        return None
    log.info(f"dgpipe: TensorRT runtime, {choice.reason}")
    return backend
