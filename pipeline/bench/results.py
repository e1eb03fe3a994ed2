"""Where benchmark results go: one JSON file per run (written atomically) and PNG plots beside it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pipeline.atomic import atomic_write_text


def save_result(out: Path, name: str, result: dict[str, Any]) -> Path:
    """Write out/name atomically as strict JSON (a value that is no finite number, such as the percentile
    of no samples, written as null: Python's JSON reads NaN, jq and JavaScript do not); return its path."""
    text = json.dumps(finite(result), indent=2, default=str, allow_nan=False)
    return atomic_write_text(out / name, text)


def finite(value: Any) -> Any:
    """`value` with every float that is NaN or infinite, at any depth of dicts, lists and tuples, as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


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
