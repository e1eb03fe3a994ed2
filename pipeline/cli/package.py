"""`dgpipe package`: a Triton model repository (Python backend, decoupled) for a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.builddir import MODEL_NAME
from pipeline.cli import options as opt
from pipeline.cli import output as out
from pipeline.errors import DgpipeError

app = opt.typer_app()


Output = Annotated[
    Path | None,
    opt.output("model repository to write (replaced atomically); " + opt.in_cache("model_repository")),
]
Engines = Annotated[
    Path | None, typer.Option(help="TensorRT engines dir (<target>/model.plan + engine.json) to ship")
]
BuildDir = Annotated[
    Path | None,
    opt.build_dir(
        "package BUILD_DIR/checkpoint (+ its engines) into BUILD_DIR/model_repository and record it"
    ),
]


@app.command()
def package(
    model: opt.Model = None,
    adapter: opt.Adapter = None,
    output: Output = None,
    name: opt.ModelName = MODEL_NAME,
    max_batch: opt.MaxBatch = None,
    max_tokens: opt.MaxTokens = None,
    max_prompt: opt.MaxPrompt = None,
    max_steps: opt.MaxSteps = None,
    max_request_seconds: opt.MaxRequestSeconds = None,
    max_queue: opt.MaxQueue = None,
    max_prompt_bytes: opt.MaxPromptBytes = None,
    max_guide_bytes: opt.MaxGuideBytes = None,
    max_regex_positions: opt.MaxRegexPositions = None,
    max_guide_seconds: opt.MaxGuideSeconds = None,
    max_guide_memory_mib: opt.MaxGuideMemoryMib = None,
    prefix_cache_mib: opt.PrefixCacheMib = None,
    device: opt.Device = "auto",
    compile: opt.Compile = False,
    engines: Engines = None,
    build_dir: BuildDir = None,
) -> None:
    """Write a Triton model repository (Python backend, decoupled) that serves the checkpoint."""
    from pipeline.limits import Limits
    from pipeline.runtime.session import default_model_path
    from pipeline.serving.repository import package as run_package
    from pipeline.serving.repository import package_stage

    # the limit options given, by their one name (None: the build's recorded value, else the default)
    given = {k: v for k, v in locals().items() if k in Limits.model_fields}
    if build_dir is not None:
        if (
            model is not None
            or adapter is not None
            or output is not None
            or engines is not None
            or name != MODEL_NAME
        ):
            raise DgpipeError(
                "--build-dir packages the build's own checkpoint and engines under its layout and name",
                "drop --model/--adapter/--output/--engines/--name (a build takes its name from "
                "`dgpipe build --name`), or drop --build-dir",
            )
        out.stage(package_stage(build_dir, given, device=device, compile=compile), as_json=False)
        return

    repo = run_package(
        opt.model_dir(model, adapter) or default_model_path(),
        output or opt.cache_dir() / "model_repository",
        name,
        opt.limits(**given),
        device,
        engines=engines,
        compile=compile,
    )
    out.line(f"model repository: {repo} (model '{name}')")
