"""`dgpipe export`: checkpoint -> ONNX dir (model.onnx + external weights + contract.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli import options as opt
from pipeline.cli import output as out

app = opt.typer_app()


@app.command()
def export(
    model: opt.Model = None,
    output: Annotated[Path | None, opt.output("ONNX dir to write (replaced atomically)")] = None,
    build_dir: Annotated[Path | None, opt.build_dir("build dir: default output + manifest record")] = None,
    precision_from_checkpoint: Annotated[
        bool, typer.Option(help="quantized checkpoints export Q/DQ (else dequantized float weights)")
    ] = True,
    moe: Annotated[
        str, typer.Option(help="MoE form: routed (dgpipe::MoE node, routed FLOPs) or dense (debugging)")
    ] = "routed",
    stream: Annotated[
        bool,
        typer.Option(
            help="stream the weights (float, or FP8 / NVFP4 packed) into the ONNX without loading the model"
        ),
    ] = False,
    dtype: Annotated[
        str | None,
        typer.Option(
            help="the graph's model dtype: float32 (onnxruntime runs it) or bfloat16 (for TensorRT engines); "
            "default float32, with --stream the checkpoint's"
        ),
    ] = None,
    as_json: opt.Json = False,
) -> None:
    """Export model + sampler step as ONNX (opset 21, dgpipe::SampleRows/SampleAccept; docs/onnx.md)."""
    from pipeline.onnx.stage import run_export
    from pipeline.runtime.session import default_model_path

    if model is None and build_dir is not None:
        model = _build_checkpoint(build_dir)
    result = run_export(
        model or default_model_path(), output, build_dir, precision_from_checkpoint, moe, stream, dtype=dtype
    )
    out.stage(result, as_json)


def _build_checkpoint(build_dir: Path) -> Path | None:
    """The checkpoint the build dir's quantize stage wrote, when it ran: what export reads by default."""
    from pipeline.builddir import MANIFEST_NAME, load_manifest

    if not (build_dir / MANIFEST_NAME).is_file():
        return None
    manifest = load_manifest(build_dir)
    return manifest.path_of(build_dir, "checkpoint") if "quantize" in manifest.stages else None
