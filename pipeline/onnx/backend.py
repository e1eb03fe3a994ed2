"""`ModelBackend` over an exported ONNX model in onnxruntime (CPU): the runtime drives it like the PyTorch one.

The host keeps everything stateful (KV ring buffers, masks, canvases, sampler state); each call feeds the
contract's inputs (`pipeline.onnx.contract`) and maps the outputs back. What the host fills in for the mode it
does not use: a causal pass sends one zero self-conditioning row and dummy sampler rows (the graph runs
the head on one position and its sampler outputs are ignored); a denoise pass sends `sc_embed` [B, 1, hidden]
zeros when no row has a previous step yet, and otherwise the previous step's `next_sc_embed`. Outputs come
back through DLPack. It runs fp32 graphs: onnxruntime's CPU provider has no bf16 MatMul.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeline.errors import DgpipeError
from pipeline.model.checkpoint import open_checkpoint
from pipeline.model.config import ModelConfig
from pipeline.onnx import contract as onnx_io
from pipeline.runtime.backends import KV, DenoiseResult, Masks, SamplerInputs, sample_logits
from pipeline.sampler.reference import StepOutput
from pipeline.threads import thread_count


class OnnxRuntimeBackend:
    """Runs `onnx/model.onnx`; `checkpoint` (a dir or its ModelConfig) supplies vocab, canvas, layer shapes."""

    def __init__(
        self, onnx_dir: str | Path, checkpoint: str | Path | ModelConfig, threads: int | None = None
    ) -> None:
        """`threads`: intra-op threads; default `pipeline.threads.thread_count()`, the policy torch uses."""
        import onnxruntime as ort

        onnx_dir = Path(onnx_dir)
        model_file = onnx_dir / onnx_io.MODEL_FILE
        if not model_file.is_file():
            raise DgpipeError(f"{model_file}: no ONNX model", "run `dgpipe export` first")
        contract = json.loads((onnx_dir / onnx_io.CONTRACT_FILE).read_text())
        self.config = (
            checkpoint if isinstance(checkpoint, ModelConfig) else open_checkpoint(checkpoint).config
        )
        self.layer_types: list[str] = contract["layer_types"]
        if self.layer_types != list(self.config.text_config.layer_types):
            raise DgpipeError(f"{model_file} was exported from a different model than {checkpoint}")
        inputs = {s["name"]: s for s in contract["inputs"]}
        if "sc_embed" not in inputs:
            raise DgpipeError(
                f"{model_file} takes self-conditioning probabilities (an export from before the compact "
                "self-conditioning state)",
                "re-run `dgpipe export`",
            )
        model_dtype = inputs["sc_embed"]["dtype"]
        if model_dtype != "FLOAT":  # e.g. the bf16 graph `dgpipe build` writes for TensorRT
            raise DgpipeError(
                f"{model_file} is a {model_dtype.lower()} graph, which onnxruntime's CPU provider cannot run "
                "(it has no bf16 MatMul kernels)",
                "export the reference graph with `dgpipe export --dtype float32`",
            )
        self.dtype = torch.float32
        self.device = torch.device("cpu")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads if threads is not None else thread_count()
        opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(model_file), opts, providers=["CPUExecutionProvider"])
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._ort = ort

    # ---- helpers -------------------------------------------------------------------------------------
    def _run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ort = self._ort
        values = {k: ort.OrtValue.ortvalue_from_numpy(_np(v)) for k, v in feeds.items()}
        outs = self.session.run_with_ort_values(self.output_names, values)
        return {name: torch.from_dlpack(v).clone() for name, v in zip(self.output_names, outs)}

    def _model_feeds(
        self,
        mode: int,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        sc: torch.Tensor | None,
        masks: Masks,
        past: KV | None,
    ) -> dict[str, torch.Tensor]:
        b, s = tokens.shape
        cfg = self.config.text_config
        feeds = {
            "mode": torch.tensor([mode], dtype=torch.int64),
            "tokens": tokens.to(torch.int64),
            "positions": positions.to(torch.int64),
            "sc_embed": sc.to(self.dtype)
            if sc is not None
            else torch.zeros(b, 1, cfg.hidden_size, dtype=self.dtype),
        }
        past_len = {}
        for i, kind in enumerate(self.layer_types):
            shape = cfg.layer_shape(i)
            if past is None:
                k = v = torch.zeros(b, shape.num_kv_heads, 0, shape.head_dim, dtype=self.dtype)
            else:
                k, v = past[i]
            feeds[f"past.{i}.key"], feeds[f"past.{i}.value"] = k.to(self.dtype), v.to(self.dtype)
            past_len[kind] = k.shape[2]
        for kind, name in (
            ("full_attention", "attention_mask.full"),
            ("sliding_attention", "attention_mask.sliding"),
        ):
            mask = masks.get(kind)
            n = past_len.get(kind, 0) + s
            feeds[name] = mask if mask is not None else torch.ones(b, 1, s, n, dtype=torch.bool)
        return feeds

    @staticmethod
    def _sampler_feeds(s: SamplerInputs | None, b: int, length: int) -> dict[str, torch.Tensor]:
        if s is None:  # causal pass: one harmless row of sampler state per batch row
            i64 = torch.zeros(b, dtype=torch.int64)
            f32 = torch.ones(b, dtype=torch.float32)
            tpl = torch.full((b, length), -1, dtype=torch.int64)
            return {
                "temperature": f32,
                "bound": f32,
                "seed": i64,
                "request": i64,
                "canvas": i64,
                "step": i64,
                "template": tpl,
                "prev_argmax": tpl,
                "stable_count": i64,
                "stability_threshold": i64,
                "confidence_threshold": f32 * 0,
            }
        tpl = s.template if s.template is not None else torch.full((b, length), -1, dtype=torch.int64)
        return {
            "temperature": s.temperature.float(),
            "bound": s.bound.float(),
            "seed": s.keys.seed,
            "request": s.keys.request,
            "canvas": s.keys.canvas,
            "step": s.keys.step,
            "template": tpl,
            "prev_argmax": s.prev_argmax,
            "stable_count": s.stable_count,
            "stability_threshold": s.stability_threshold,
            "confidence_threshold": s.confidence_threshold.float(),
        }

    # ---- ModelBackend ----------------------------------------------------------------------------------
    def causal(self, tokens: torch.Tensor, positions: torch.Tensor, masks: Masks, past: KV | None) -> KV:
        feeds = self._model_feeds(onnx_io.MODE_CAUSAL, tokens, positions, None, masks, past)
        feeds.update(self._sampler_feeds(None, *tokens.shape))
        return kv_from_outputs(self._run(feeds), len(self.layer_types))

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
        out = self.denoise_outputs(canvas, sc_soft, positions, masks, past, sampler)
        if sampler.allowed is not None:
            # constrained rows: the graph's sampler has no mask input, so its fp32 logits output is masked
            # and sampled again by the same sampler in PyTorch; self-conditioning stays the graph's own
            res = sample_logits(out["logits"], sampler)
            res.soft = out["next_sc_embed"]
            return res
        return denoise_result(out)

    def denoise_outputs(
        self,
        canvas: torch.Tensor,
        sc_soft: torch.Tensor | None,
        positions: torch.Tensor,
        masks: Masks,
        past: KV | None,
        sampler: SamplerInputs,
    ) -> dict[str, torch.Tensor]:
        """Every graph output of a denoise pass (logits included), for parity tests and debugging."""
        feeds = self._model_feeds(onnx_io.MODE_DENOISE, canvas, positions, sc_soft, masks, past)
        feeds.update(self._sampler_feeds(sampler, *canvas.shape))
        return self._run(feeds)


def _np(t: torch.Tensor):
    """A contiguous numpy view (bool/int/float: the backend runs fp32 graphs only)."""
    return t.detach().contiguous().numpy()


def kv_from_outputs(out: dict[str, torch.Tensor], n_layers: int) -> KV:
    """The causal pass's `present.*` outputs as the runtime's KV list (this graph's and its engines')."""
    return [(out[f"present.{i}.key"], out[f"present.{i}.value"]) for i in range(n_layers)]


def denoise_result(out: dict[str, torch.Tensor]) -> DenoiseResult:
    """A denoise pass's sampler outputs as the runtime's step result (this graph's and its engines')."""
    step = StepOutput(
        canvas=out["next_canvas"],
        argmax=out["argmax"],
        probs=None,  # stays in the graph: next_sc_embed is what the next step reads
        entropy=out["entropy"],
        kept=out["kept"],
    )
    return DenoiseResult(step, out["stable_count_out"], out["stop"], out["next_sc_embed"])
