"""`dgpipe doctor`: what this machine has for each stage, with install hints for what is missing."""

from __future__ import annotations

from pipeline.cli import options as opt
from pipeline.cli import output as out

app = opt.typer_app()


@app.command()
def doctor(as_json: opt.Json = False) -> None:
    """Check what this machine has for each stage, with install hints for what is missing."""
    from pipeline.doctor import as_json as to_json
    from pipeline.doctor import run_checks

    checks = run_checks()
    if as_json:
        out.json_out(to_json(checks))
    else:
        out.lines(_render(checks))


def _render(checks) -> list[str]:
    width = max(len(c.name) for c in checks)
    rows = []
    for c in checks:
        status = out.flag("ok     ", True) if c.ok else out.flag("missing", False)
        line = f"{status} {c.name:<{width}}  {c.detail}"
        if not c.ok:
            line += f"  ({c.needed_for}: {c.hint})"
        rows.append(line)
    return rows
