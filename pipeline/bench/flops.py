"""`dgpipe bench flops`: FLOPs and bytes of one denoise pass of the exported graph, dense vs routed MoE,
at several canvases per pass, against each GPU's compute and bandwidth floors.

Counted from the graph (`pipeline.onnx.flops.graph_cost`): an exported ONNX dir, or - for a model too large to
export here - the full graph traced on the meta device without weights (`pipeline.onnx.stream.structure_graph`).
Checked against the analytic count from the config. Floors: FLOPs / dense tensor-core TFLOPS and bytes / HBM
bandwidth, per GPU of configs/targets (sm90 H100/H200, sm100 B200). A pass is memory-bound when the bandwidth
floor is the larger one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import onnx

from pipeline.bench.results import save_result
from pipeline.model.config import FLAGSHIP_CONFIG, ModelConfig
from pipeline.model.cost import denoise_pass_flops
from pipeline.onnx.flops import graph_cost, pass_dims
from pipeline.targets import target

RESULT_FILE = "bench_flops.json"
GPUS = (("sm90", "H100-SXM5-80GB"), ("sm90", "H200-SXM-141GB"), ("sm100", "B200-180GB"))


@dataclass
class FlopsRow:
    moe: str
    canvases: int
    tokens: int
    graph_tflop: float
    analytic_tflop: float
    graph_over_analytic: float
    weight_gb: float
    kv_gb: float
    floors_ms: dict[str, dict[str, float]]  # gpu -> {compute_bf16, compute_fp8, bandwidth}


def _floors(tflop: float, gb: float) -> dict[str, dict[str, float]]:
    out = {}
    for tname, product in GPUS:
        gpu = next(g for g in target(tname).gpus if g.product == product)
        row = {f"compute_{p}": tflop / t * 1e3 for p, t in gpu.dense_tflops.items() if p in ("bf16", "fp8")}
        row["bandwidth"] = gb / (gpu.bandwidth_tb_s * 1e3) * 1e3
        out[product] = row
    return out


def run(
    config: str = FLAGSHIP_CONFIG,
    batches: tuple[int, ...] = (1, 4, 8),
    past: int = 4096,
    onnx_dirs: dict[str, Path] | None = None,
    out_dir: Path | None = None,
) -> dict:
    """Rows for moe in (dense, routed) x batches. `onnx_dirs` ({"routed": dir, "dense": dir}) counts those
    exports instead of tracing `config` (which must be the config they were exported from: the analytic
    count is written from it)."""
    from pipeline.onnx.stream import structure_graph

    mcfg = ModelConfig.from_yaml(config)
    cfg = mcfg.text_config
    seq = mcfg.canvas_length
    rows = []
    for moe in ("dense", "routed"):
        if onnx_dirs and moe in onnx_dirs:
            m = onnx.load(str(Path(onnx_dirs[moe]) / "model.onnx"), load_external_data=False)
            base = str(onnx_dirs[moe])
        else:
            m, base = structure_graph(mcfg, moe), None
        for b in batches:
            c = graph_cost(m, pass_dims(b, seq, past, cfg.sliding_window), base)
            a = denoise_pass_flops(cfg, b, seq, past, routed=moe == "routed")
            gb = (c.weight_bytes + c.kv_bytes) / 1e9
            rows.append(
                FlopsRow(
                    moe=moe,
                    canvases=b,
                    tokens=b * seq,
                    graph_tflop=c.matmul_flops / 1e12,
                    analytic_tflop=a / 1e12,
                    graph_over_analytic=c.matmul_flops / a,
                    weight_gb=c.weight_bytes / 1e9,
                    kv_gb=c.kv_bytes / 1e9,
                    floors_ms=_floors(c.matmul_flops / 1e12, gb),
                )
            )
    result = {
        "config": config,
        "canvas": seq,
        "context_tokens": past,
        "weights_dtype": "bf16 (graph initializers); K/V bf16",
        "counted": "MatMul/Gemm FLOPs of one denoise pass (network + LM head); sampler and elementwise excluded",
        "rows": [asdict(r) for r in rows],
    }
    if out_dir is not None:
        result["path"] = str(save_result(out_dir, RESULT_FILE, result))
    return result


def render(r: dict) -> str:
    gpus = [p for _, p in GPUS]
    head = "| MoE | canvases | TFLOP (graph) | graph/analytic | GB read | " + " | ".join(
        f"{g.split('-')[0]} ms: bf16 / fp8 / HBM" for g in gpus
    )
    lines = [head + " |", "|" + "---|" * (5 + len(gpus))]
    for row in r["rows"]:
        cells = []
        for g in gpus:
            f = row["floors_ms"][g]
            cells.append(f"{f['compute_bf16']:.2f} / {f['compute_fp8']:.2f} / {f['bandwidth']:.2f}")
        lines.append(
            f"| {row['moe']} | {row['canvases']} | {row['graph_tflop']:.2f} | {row['graph_over_analytic']:.3f} | "
            f"{row['weight_gb'] + row['kv_gb']:.1f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)
