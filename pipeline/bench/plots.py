"""The PNG figure of each speed benchmark whose module draws none of its own (local, pass, model, guided):
one chart of the figures its table leads with, drawn from the result it saved as JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.bench.results import save_plot


def local_plot(result: dict[str, Any], path: Path) -> Path:
    """`dgpipe bench local`: tokens/s of each system and step policy."""
    rows = result["rows"]
    labels = [f"{r['system']}\n{r['policy']}" for r in rows]

    def draw(ax) -> None:
        ax.barh(labels, [r["tokens_per_s"] for r in rows])
        ax.invert_yaxis()
        ax.set_xlabel("tokens/s (median)")
        ax.set_title(
            f"{Path(result['model']).name}: {result['dtype']} on {result['device']}, batch {result['batch']}"
        )

    save_plot(path, draw)
    return path


def pass_plot(result: dict[str, Any], path: Path) -> Path:
    """`dgpipe bench pass`: each system's step, split where it was timed inside (network, soft embedding,
    sampler; the rest is dgpipe's host work, or all of a step timed as a whole), against the matmul floor."""
    rows = result["rows"]
    shares = (("network_ms", "network"), ("soft_embedding_ms", "soft embedding"), ("sampler_ms", "sampler"))

    def draw(ax) -> None:
        names = [r["system"] for r in rows]
        parts = {label: [r[key] or 0.0 for r in rows] for key, label in shares}
        parts["host / rest of the step"] = [
            max(r["step_ms"] - sum(p[i] for p in parts.values()), 0.0) for i, r in enumerate(rows)
        ]
        bottom = [0.0] * len(rows)
        for label, part in parts.items():
            ax.bar(names, part, bottom=bottom, label=label)
            bottom = [b + p for b, p in zip(bottom, part, strict=True)]
        ax.axhline(result["floor_ms"], color="black", linestyle="--", label="matmul floor")
        ax.set_ylabel("ms per denoise step (median)")
        ax.set_title(
            f"{Path(result['model']).name}: batch {result['batch']}, {result['steps_per_canvas']} fixed steps"
        )
        ax.legend(fontsize=7)
        ax.tick_params(axis="x", labelsize=7)

    save_plot(path, draw)
    return path


def model_plot(result: dict[str, Any], path: Path) -> Path:
    """`dgpipe bench model`: ms per denoise pass against the bandwidth floor, by batch."""
    rows = result["rows"]

    def draw(ax) -> None:
        batches = [r["batch"] for r in rows]
        ax.plot(batches, [r["ms_per_denoise_pass"] for r in rows], "o-", label="measured")
        ax.plot(batches, [r["floor_ms_per_pass"] for r in rows], "k--", label="weights / copy bandwidth")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("canvases per pass")
        ax.set_ylabel("ms per denoise pass (median)")
        ax.set_title(f"{result['config']} random {result['dtype']} on {result['device']}")
        ax.legend()

    save_plot(path, draw)
    return path


def guided_plot(result: dict[str, Any], path: Path) -> Path:
    """`dgpipe bench guided`: wall time per run with and without the guide, per policy and batch."""
    rows = result["rows"]
    labels = [f"{r['policy']}\nbatch {r['batch']}" for r in rows]

    def draw(ax) -> None:
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["ms_total"] for r in rows], width=0.4, label="free")
        ax.bar([i + 0.2 for i in x], [r["ms_total_guided"] for r in rows], width=0.4, label="guided (regex)")
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_ylabel("ms per run (median)")
        ax.set_title(result["model"])
        ax.legend()

    save_plot(path, draw)
    return path
