"""`dgpipe package`: a Triton model repository (Python backend, decoupled) for a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.builddir import MODEL_NAME, EngineLimits
from pipeline.cli import options as opt
from pipeline.cli import output as out
from pipeline.errors import DgpipeError

app = opt.typer_app()


Output = Annotated[
    Path | None,
    opt.output("model repository to write (replaced atomically); " + opt.in_cache("model_repository")),
]
Name = Annotated[str, typer.Option(help="model name in the repository")]
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
    output: Output = None,
    name: Name = MODEL_NAME,
    max_batch: Annotated[
        int, typer.Option(help="requests that share each denoise pass")
    ] = EngineLimits.max_batch,
    max_tokens_limit: Annotated[
        int, typer.Option(help="largest max_tokens a request may ask for")
    ] = EngineLimits.max_tokens,
    max_prompt_tokens: Annotated[
        int, typer.Option(help="longest prompt accepted, in tokens")
    ] = EngineLimits.max_prompt,
    request_timeout: Annotated[
        int,
        typer.Option(
            help="seconds a request may run before the server ends it with an error and frees its slot"
        ),
    ] = EngineLimits.max_request_seconds,
    device: opt.Device = "auto",
    compile: opt.Compile = False,
    engines: Engines = None,
    build_dir: BuildDir = None,
) -> None:
    """Write a Triton model repository (Python backend, decoupled) that serves the checkpoint."""
    from pipeline.runtime.session import default_model_path
    from pipeline.serving.repository import package as run_package
    from pipeline.serving.repository import package_stage

    if build_dir is not None:
        if model is not None or output is not None or engines is not None or name != MODEL_NAME:
            raise DgpipeError(
                "--build-dir packages the build's own checkpoint and engines under its layout",
                "drop --model/--output/--engines/--name, or drop --build-dir",
            )
        limits = EngineLimits(
            max_batch=max_batch,
            max_prompt=max_prompt_tokens,
            max_tokens=max_tokens_limit,
            max_request_seconds=request_timeout,
        )
        out.stage(package_stage(build_dir, limits), as_json=False)
        return

    repo = run_package(
        model or default_model_path(),
        output or opt.cache_dir() / "model_repository",
        name,
        max_batch,
        max_tokens_limit,
        max_prompt_tokens,
        device,
        engines=engines,
        request_seconds_limit=request_timeout,
        compile=compile,
    )
    out.line(f"model repository: {repo} (model '{name}')")
