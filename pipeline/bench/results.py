"""Where benchmark results go: one JSON file per run (written atomically) and PNG plots beside it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.atomic import atomic_write_text


def save_result(out: Path, name: str, result: dict[str, Any]) -> Path:
    """Write out/name atomically; return its path."""
    return atomic_write_text(out / name, json.dumps(result, indent=2, default=str))


def save_plot(path: Path, draw) -> None:
    """One matplotlib figure (headless), drawn by `draw(ax)`, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    draw(ax)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)
