"""`dgpipe inspect DIR`: what a directory is (which producer wrote it) and what dgpipe will do with it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli import options as opt
from pipeline.cli import output as out

app = opt.typer_app()


@app.command()
def inspect(
    path: Annotated[Path, typer.Argument(help="a checkpoint, LoRA adapter or NeMo AutoModel checkpoint dir")],
    as_json: opt.Json = False,
) -> None:
    """Say what a directory is (base, ModelOpt-quantized, AutoModel SFT or LoRA, PEFT/Unsloth LoRA) and what
    dgpipe will do with it as --model / --adapter."""
    from pipeline.model.producers import inspect_dir

    rec = inspect_dir(path)
    out.show(rec.as_dict(), as_json, _render)


def _render(r: dict) -> list[str]:
    rows = [f"{r['path']}: {r['what']} ({r['producer']})", f"  weights: {r['weights']}"]
    if r["is_adapter"]:
        rows.append(f"  base: {r['base'] or 'not recorded'} (pass it as --model, this dir as --adapter)")
    rows += [f"  {note}" for note in r["notes"]]
    rows.append(f"  dgpipe: {r['action']}")
    return rows
