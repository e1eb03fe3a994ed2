"""`dgpipe quantize --estimate`: exported bytes per precision and serving memory per GPU, from a config alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.errors import DgpipeError


def load_config(config: str):
    """CONFIG.json (HF layout) or a configs/models/<name>.yaml name."""
    from pipeline.model.config import ModelConfig

    p = Path(config)
    if p.suffix == ".json" or p.is_dir():
        return ModelConfig.from_json_file(p / "config.json" if p.is_dir() else p)
    return ModelConfig.from_yaml(config)


def estimate(
    config: str,
    precisions: list[str],
    target: str | None,
    context: int,
    concurrency: int,
    kv_cache: str,
) -> dict[str, Any]:
    """{"config", "weights": one row per precision, "serving": one row per (precision, GPU) of `target`}.

    Meta tensors only: no weights are read. Without `precisions`, every precision (and, on `target`,
    those the target runs); a precision asked for explicitly that the target cannot run is refused."""
    from pipeline.targets import all_precisions, check_precision_on_target, precision
    from pipeline.targets import target as get_target
    from quantize.planner import as_dict, serving_plan, weight_plan

    if context < 1 or concurrency < 1:
        raise DgpipeError("--context and --concurrency must be >= 1")
    cfg = load_config(config)
    names = precisions or all_precisions()
    weights = [
        as_dict(weight_plan(cfg, precision(p))) | {"gib": round(weight_plan(cfg, precision(p)).gib, 2)}
        for p in names
    ]
    serving = []
    if target:
        t = get_target(target)
        for p in names:
            if p not in t.precisions:
                if precisions:  # asked for explicitly: refuse with the rule's message
                    check_precision_on_target(p, target)
                continue
            serving += [
                as_dict(s) for s in serving_plan(cfg, precision(p), t, context, concurrency, kv_cache)
            ]
    return {"config": config, "weights": weights, "serving": serving}
