"""TensorRTBackend: the `pipeline.runtime.backends.ModelBackend` protocol over a TensorRT plan.

The runtime (scheduling, KV cache, canvases, callbacks) is unchanged: it calls `causal` for prefill and
commit and `denoise_step` for each denoise pass, exactly as with the PyTorch backend. Here each call binds
torch CUDA tensors to the engine's I/O (`set_input_shape` / `set_tensor_address`) and runs
`execute_async_v3` on torch's current stream, so no copies cross the host and the sampler (the two AOT
plugins inside the plan) never leaves the GPU.

* Two execution contexts, one per optimization profile (0 = causal, 1 = denoise; pipeline.engine.profiles),
  so switching pass kinds never re-selects a profile. They share one activation buffer (TensorRT's
  USER_MANAGED allocation, `engine.device_memory_size_v2` bytes, the most any profile needs) instead of one
  each: both run in the order of torch's current stream, never at the same time, which is what TensorRT asks
  of contexts sharing memory.
* `mode` is a shape tensor (it decides how many positions reach the LM head): its value is bound from
  pinned host memory, as TensorRT requires for shape-tensor inputs.
* Denoise steps replay a CUDA graph: the inputs are copied into static buffers and the captured
  `execute_async_v3` is replayed. The K/V come as the cache's row views, so each step copies them once, from
  the cache into the static buffers (an eager run copies them once into contiguous tensors). A graph is valid only while shapes stay the same, so one is kept per
  context and recaptured when (batch, cached length) changes, i.e. about once per canvas; sc_embed is
  always sent full-width (zeros on a canvas's first step) so the first step does not change the shape.
  The step that captures returns the outputs of the run TensorRT needs before a capture (a capture records
  without running). If the capture is refused (a TensorRT build with host syncs in enqueue), the backend
  logs it and runs eagerly; out of memory or a lost GPU fails the step instead, as in the device loop.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from pipeline.engine.feeds import denoise_sc, engine_feeds
from pipeline.engine.plan_record import check_compatible, load_engine_manifest
from pipeline.errors import DgpipeError
from pipeline.model.config import ModelConfig
from pipeline.onnx.backend import denoise_result, kv_from_outputs
from pipeline.onnx.contract import MODE_CAUSAL, MODE_DENOISE
from pipeline.runtime.backends import KV, DenoiseResult, Masks, SamplerInputs
from pipeline.runtime.device_loop import captured, refused_capture, undo_failed_capture

log = logging.getLogger(__name__)

PROFILE = {"causal": 0, "denoise": 1}


def _torch_dtypes(trt: Any) -> dict[Any, torch.dtype]:
    return {
        trt.float32: torch.float32,
        trt.float16: torch.float16,
        trt.bfloat16: torch.bfloat16,
        trt.int64: torch.int64,
        trt.int32: torch.int32,
        trt.bool: torch.bool,
        trt.int8: torch.int8,
    }


class _Context:
    """One execution context (one profile) with its I/O bookkeeping and an optional CUDA graph."""

    def __init__(
        self, engine: Any, profile: int, trt: Any, device: torch.device, activations: torch.Tensor
    ) -> None:
        self.ctx = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        if self.ctx is None:
            raise DgpipeError("TensorRT could not create an execution context (out of GPU memory?)")
        # the activation memory every context of the backend shares (`activation_buffer`)
        self.ctx.set_device_memory(activations.data_ptr(), activations.numel())
        self.stream = torch.cuda.Stream(device=device)
        if not self.ctx.set_optimization_profile_async(profile, self.stream.cuda_stream):
            raise DgpipeError(f"TensorRT refused optimization profile {profile} (see the TensorRT log)")
        self.stream.synchronize()
        self.engine, self.trt, self.device = engine, trt, device
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.host_inputs = {n for n in self.inputs if engine.is_shape_inference_io(n)}
        types = _torch_dtypes(trt)
        self.dtypes = {n: types[engine.get_tensor_dtype(n)] for n in names}
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_key: tuple | None = None
        # every recapture (about once per canvas: the cached length is in the key) reuses this pool, and
        # captures as the runtime's device loop does: no device-wide synchronize and emptied allocator cache
        # as `torch.cuda.graph` does on entry
        self.pool = torch.cuda.graph_pool_handle()
        self.static: dict[str, torch.Tensor] = {}
        self.use_graphs = True

    def _bind(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Set shapes + addresses for `feeds` (already on the right device/dtype), allocate outputs."""
        missing = [n for n in self.inputs if n not in feeds]
        if missing:
            raise DgpipeError(f"engine inputs not provided: {missing}")
        for name in self.inputs:
            t = feeds[name]
            if not self.ctx.set_input_shape(name, tuple(t.shape)):
                raise DgpipeError(
                    f"engine input {name}: shape {tuple(t.shape)} is outside the optimization profile"
                )
            self._address(name, t)
        outs = {}
        for name in self.outputs:
            shape = tuple(self.ctx.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise DgpipeError(f"engine output {name} has an unresolved shape {shape}")
            outs[name] = torch.empty(shape, dtype=self.dtypes[name], device=self.device)
            self._address(name, outs[name])
        return outs

    def _address(self, name: str, t: torch.Tensor) -> None:
        # False where TensorRT refuses the binding (a misaligned or wrong-device pointer): said here, not as
        # a generic execute failure later
        if not self.ctx.set_tensor_address(name, t.data_ptr()):
            raise DgpipeError(f"TensorRT refused the address of engine tensor {name} (see the TensorRT log)")

    def _execute(self) -> None:
        if not self.ctx.execute_async_v3(self.stream.cuda_stream):
            raise DgpipeError("TensorRT execute_async_v3 failed (see the TensorRT log)")

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Eager: bind and execute on the context's stream, ordered after torch's current stream."""
        # TensorRT reads packed tensors: copied on torch's current stream BEFORE the context's stream waits
        # for it (a wait orders only the work queued by then)
        feeds = {n: t.contiguous() for n, t in feeds.items()}
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        outs = self._bind(feeds)
        self._execute()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        for t in (*feeds.values(), *outs.values()):
            if t.is_cuda:
                t.record_stream(self.stream)
        return outs

    def run_graph(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Replay the captured graph if the shapes are unchanged, else (re)capture; eager when capture fails."""
        if not self.use_graphs:
            return self.run(feeds)
        key = tuple((n, tuple(t.shape)) for n, t in sorted(feeds.items()))
        if key != self.graph_key:
            self._capture(feeds, key)
            if not self.use_graphs:
                return self.run(feeds)
            # the run before the capture computed this very pass from these inputs (a capture records,
            # it does not run): its outputs are the step's, a replay would compute them a second time
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            return {n: self.static[n] for n in self.outputs}
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            for name, t in feeds.items():
                if name not in self.host_inputs:
                    self.static[name].copy_(t, non_blocking=True)
                # shape-tensor values are baked into the graph: the key includes their shape, and
                # their value (the pass kind) is fixed per context
            assert self.graph is not None
            self.graph.replay()
        cur.wait_stream(self.stream)
        return {n: self.static[n] for n in self.outputs}

    def _capture(self, feeds: dict[str, torch.Tensor], key: tuple) -> None:
        # the graph being replaced stays alive until the new one is captured: once every graph that used a
        # pool is freed, torch's allocator refuses a new capture into it ("use_count > 0", as the device
        # loop found on an H200). A context replays only its latest graph, so this reserves nothing more.
        previous = self.graph  # noqa: F841 (held, not read)
        self.graph, self.graph_key = None, None
        self.static = {
            n: (t if n in self.host_inputs else t.clone(memory_format=torch.contiguous_format))
            for n, t in feeds.items()
        }
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        outs = self._bind(self.static)
        self.static.update(outs)
        current = torch.cuda.current_stream(self.device)
        # TensorRT: one run before the capture flushes deferred shape updates; its failure is the engine's
        # (the request's error), not the capture's
        with torch.cuda.stream(self.stream):
            self._execute()
        self.stream.synchronize()
        try:
            graph = captured(self._execute, self.pool, self.stream)
        except Exception as e:
            undo_failed_capture(current, self.pool)
            # out of memory or a lost GPU is raised, the step's failure; any other error is the capture's
            # refusal: this context runs eagerly from now on
            cause = refused_capture(e, torch.device(self.device))
            log.warning("CUDA graph capture of the denoise step failed (%s); running TensorRT eagerly", cause)
            self.use_graphs = False
            return
        self.graph, self.graph_key = graph, key


def activation_buffer(engine: Any, device: torch.device) -> torch.Tensor:
    """The activation memory the backend's contexts share: `device_memory_size_v2` bytes, the most any
    profile needs (what each context would allocate for itself under the default STATIC strategy), from
    torch's allocator, at the 256-byte alignment TensorRT asks for (torch's CUDA blocks have it already)."""
    size = engine.device_memory_size_v2
    block = torch.empty(size + 255, dtype=torch.uint8, device=device)
    start = -block.data_ptr() % 256
    return block[start : start + size]


class TensorRTBackend:
    """Runs a dgpipe plan (engines/<target>/model.plan) behind the runtime's backend interface."""

    def __init__(
        self, engine_dir: Path | str, config: ModelConfig, *, device: str = "cuda", cuda_graphs: bool = True
    ):
        try:
            import tensorrt as trt
        except Exception as e:
            raise DgpipeError(
                "the TensorRT runtime needs the `tensorrt` package",
                hint="use the serving image, or the PyTorch runtime",
            ) from e
        if not torch.cuda.is_available():
            raise DgpipeError("the TensorRT runtime needs a CUDA GPU; none is visible")
        self.device = torch.device(device)
        props = torch.cuda.get_device_properties(self.device)
        engine_dir = Path(engine_dir)
        self.manifest = load_engine_manifest(engine_dir)
        check_compatible(
            self.manifest, trt.__version__, f"{props.major}.{props.minor}", where=str(engine_dir)
        )
        self.config = config
        self.layer_types = list(config.text_config.layer_types)  # type: ignore[arg-type]
        self.hidden = config.text_config.hidden_size
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        # the sampler PTX is inside the plan (AOT plugins): nothing to register before deserializing
        self.engine = self._runtime.deserialize_cuda_engine((engine_dir / self.manifest.plan).read_bytes())
        if self.engine is None:
            raise DgpipeError(
                f"TensorRT could not deserialize {engine_dir / self.manifest.plan} (see its log)"
            )
        if self.engine.num_optimization_profiles < 2:
            raise DgpipeError(
                f"{engine_dir}: the plan has {self.engine.num_optimization_profiles} profile(s), needs 2"
            )
        self._activations = activation_buffer(self.engine, self.device)
        self.contexts = {
            k: _Context(self.engine, p, trt, self.device, self._activations) for k, p in PROFILE.items()
        }
        self.contexts["denoise"].use_graphs = cuda_graphs
        self.dtype = self.contexts["causal"].dtypes["past.0.key"]  # K/V cache and self-conditioning dtype
        self._mode = {
            k: torch.tensor([v], dtype=torch.int64).pin_memory()
            for k, v in (("causal", MODE_CAUSAL), ("denoise", MODE_DENOISE))
        }

    # ---- ModelBackend -------------------------------------------------------------------------------
    def causal(self, tokens: torch.Tensor, positions: torch.Tensor, masks: Masks, past: KV | None) -> KV:
        sc = torch.zeros(tokens.shape[0], 1, self.hidden, dtype=self.dtype, device=self.device)
        feeds = engine_feeds(
            "causal",
            self.config.text_config,
            self.dtype,
            self.device,
            tokens,
            positions,
            masks,
            past,
            sc,
            None,
            mode=self._mode["causal"],
        )
        return kv_from_outputs(self.contexts["causal"].run(feeds), len(self.layer_types))

    def denoise_step(
        self,
        canvas: torch.Tensor,
        sc_soft: torch.Tensor | None,
        positions: torch.Tensor,
        masks: Masks,
        past: KV,
        sampler: SamplerInputs,
        need_soft: bool = True,  # the graph computes the self-conditioning input either way
    ) -> DenoiseResult:
        b, q = canvas.shape
        sc = denoise_sc(sc_soft, b, q, self.hidden, self.dtype, self.device)
        feeds = engine_feeds(
            "denoise",
            self.config.text_config,
            self.dtype,
            self.device,
            canvas,
            positions,
            masks,
            past,
            sc,
            sampler,
            mode=self._mode["denoise"],
        )
        out = self.contexts["denoise"].run_graph(feeds)
        if sampler.allowed is None:
            return denoise_result(out)
        # constrained rows: the engine's sampler plugin has no mask input, so its fp32 logits output is
        # masked and sampled again by the same sampler (the CUDA kernels when built, else PyTorch on the GPU)
        if "logits" not in out:
            raise DgpipeError(
                "constrained decoding needs the engine's logits output, which this plan does not mark",
                "rebuild the engine from an export that keeps it (dgpipe export; dgpipe engine)",
            )
        from pipeline.runtime.backends import sample_logits
        from pipeline.sampler.kernels.gpu_sampler import cuda_sampler_available

        res = sample_logits(out["logits"], sampler, cuda=cuda_sampler_available(), cpu_fused=False)
        res.soft = out["next_sc_embed"]  # self-conditioning stays the engine's own (unmasked) signal
        return res
