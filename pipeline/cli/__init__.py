"""The `dgpipe` command: a registry of commands, each in its own module, imported only when chosen.

`dgpipe --help` lists the registry's one-line help without importing any command module, so it stays
instant however heavy a command's imports are (torch, transformers, modelopt, tritonclient).
"""

from __future__ import annotations

import importlib
import sys
from typing import Annotated

import click
import typer
from typer.core import TyperGroup

from pipeline import __version__

# name -> (module under pipeline/cli/, one-line help). Each module defines `app`: a typer.Typer holding one
# command, or a group of them. The order here is the order of `dgpipe --help`.
COMMANDS: dict[str, tuple[str, str]] = {
    "doctor": (
        "doctor",
        "Check what this machine has for each stage, with install hints for what is missing.",
    ),
    "inspect": (
        "inspect",
        "Say what a directory is (base, ModelOpt-quantized, AutoModel SFT or LoRA, PEFT/Unsloth LoRA) and what\n"
        "    dgpipe will do with it as --model / --adapter.",
    ),
    "generate": ("generate", "Generate with block diffusion, in-process or from a Triton server (--url)."),
    "export": (
        "export",
        "Export model + sampler step as ONNX (opset 21, dgpipe::SampleRows/SampleAccept; docs/onnx.md).",
    ),
    "build": (
        "build",
        "Run every stage: quantize -> export ONNX -> sampler PTX + TensorRT engines (here, or the step for the\n"
        "    target node) -> Triton model repository, recorded in BUILD_DIR/build_manifest.json.",
    ),
    "package": (
        "package",
        "Write a Triton model repository (Python backend, decoupled) that serves the checkpoint.",
    ),
    "serve": (
        "serve",
        "Start a real Triton server and the OpenAI-compatible API beside it, wait until ready, stop on Ctrl-C.",
    ),
    "health": (
        "health",
        "Probe a served model (readiness/liveness) or drain it before shutdown.",
    ),
    "manifests": (
        "manifests",
        "Render the kustomize overlay for a DGX node type with this build's values (kubectl kustomize).",
    ),
    "deploy": (
        "deploy",
        "Apply with kubectl (server-side), wait for the rollout, run the smoke Job; roll back on failure.",
    ),
    "train": (
        "train",
        "Train the embedded Sudoku DiffusionGemma (diffusion + causal-LM objectives, curriculum, symmetries).",
    ),
    "quantize": (
        "quantize",
        "Quantize with NVIDIA ModelOpt (calibrated on the denoising path) and export in ModelOpt's HF layout.",
    ),
    "eval": ("eval", "Accuracy evaluations."),
    "bench": ("bench", "Benchmarks (results as JSON, a table and PNG plots)."),
    "engine": ("engine", "TensorRT engines: build on the target GPU node, check against this node."),
}


def load(name: str) -> click.Command:
    """Import the command's module and turn its `app` into a click command named `name`."""
    module, _ = COMMANDS[name]
    sub = importlib.import_module(f"{__name__}.{module}").app
    cmd = typer.main.get_command(sub)
    cmd.name = name
    return cmd


class LazyGroup(TyperGroup):
    """Commands come from COMMANDS: listed (help, typo suggestions) from the registry, imported when run."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.commands = {name: click.Command(name, help=text) for name, (_, text) in COMMANDS.items()}
        self._listing = False

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        return self.commands[cmd_name] if self._listing else load(cmd_name)

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self._listing = True  # the listing reads the registry's summaries; nothing is imported for it
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


app = typer.Typer(
    cls=LazyGroup,
    help="DiffusionGemma deployment pipeline: load -> quantize -> export -> engines -> Triton -> Kubernetes.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version_cb(value: bool) -> None:
    if value:
        typer.echo(f"dgpipe {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version_cb, is_eager=True, help="print the version")
    ] = False,
) -> None:
    from pipeline.threads import apply_thread_policy

    apply_thread_policy()  # once, before any command imports torch (README: Threads)


def main() -> None:
    """Console entry point: mapped errors (pipeline/cli/errors.py) become one line on stderr and an exit code."""
    from pipeline.cli import errors

    errors.terminate_like_interrupt()  # serve installs its own drain handler over it
    try:
        app()
    except errors.handled() as e:
        sys.exit(errors.report(e))


if __name__ == "__main__":
    main()
