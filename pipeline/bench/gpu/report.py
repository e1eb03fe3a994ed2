"""`dgpipe bench gpu`'s markdown table: every check, then the measured passes and their diagnostics."""

from __future__ import annotations

from pipeline.bench.gpu.canvas import render_canvas
from pipeline.bench.gpu.network import render_network, render_siblings
from pipeline.bench.gpu.tiles import per_pass, render_per_pass, render_rows


def render(result: dict) -> str:
    """One markdown table: every check, and below it one line per measured pass."""
    e = result["env"]
    head = (f"GPU: {e['gpu'] or 'none'} ({e['arch'] or '-'}, {e['memory_gib']:.0f} GiB), driver {e['driver'] or '-'}, "
            f"torch {e['torch']} (CUDA {e['cuda_version'] or 'none'}){' — dry run' if result['dry_run'] else ''}")  # fmt: skip
    lines = [head, "", "| check | status | s / budget | detail |", "|---|---|---:|---|"]
    for c in result["checks"]:
        detail = c["detail"].splitlines()[-1] if c["detail"] else ""
        lines.append(
            f"| {c['name']} | {c['status']} | {c['seconds']:.0f} / {c['budget_s']} | {detail.replace('|', '/')} |"
        )
    rows = [r for c in result["checks"] for r in c["rows"] if "ms_eager" in r]
    for r in (r for c in result["checks"] for r in c["rows"] if "largest_batch" in r):
        lines += [
            "",
            f"Largest batch whose {r['format']} pass fits: {r['largest_batch']} (tried up to {r['tried_up_to']}).",
        ]
    for r in (r for c in result["checks"] for r in c["rows"] if "first_call_s" in r and "ms_eager" not in r):
        lines += [
            "",
            f"The {r['format']} pass at batch {r['batch']} stopped {_where_stopped(r)} ({r['kernels']}).",
        ]
    if rows:
        lines += ["", "| format | batch | kernels | ms eager | ms graph | floor ms (HBM, spec) | floor ms (matmuls, "
                  "spec) | x floor | floor ms (copy bw) |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in rows:
            compute = r.get("compute_ms_spec")
            graph = (
                f"{r['ms_graph']:.2f}"
                if r["ms_graph"] == r["ms_graph"]
                else f"— {_error_cell(r, 'graph_error')}"
            )
            x_floor = f"{_x_floor(r):.2f}" if r.get("finite", True) else "— (NaN output)"
            lines.append(
                f"| {r['format']} | {r['batch']} | {r['kernels']} | {r['ms_eager']:.2f} | {graph} "
                f"| {_ms_cell(r['floor_ms_spec'])} | {_ms_cell(compute)} "
                f"| {x_floor} | {r['floor_ms_copy']:.2f} |"
            )
        # which tiles the Triton MoE GEMM launched with, where a pass ran it (runs from before say nothing)
        sources = dict.fromkeys((r["format"], r["moe_tiles"]) for r in rows if "moe_tiles" in r)
        if sources:
            lines += ["", *(f"Triton MoE GEMM in the {f} passes: {s}." for f, s in sources)]
    experts = [(r["batch"], r["experts"]) for r in rows if "experts" in r]
    if experts:
        lines += ["", "| one layer's FP8 experts | batch | rows per expert | ms FP8 module | ms torch grouped GEMMs "
                  "(fast / promoted accumulation) | fast vs promoted (rel L2) | ms Triton GEMMs (own M tile / 64) | Triton vs torch "
                  "(rel L2) | ms bf16 grouped (dequantized) | ms dequantize | bf16 vs FP8 (rel L2) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        why = lambda x, key: f"— | {_error_cell(x, key)}"
        for b, x in experts:
            torch_gemms = (f"{x['ms_fp8_gemms']:.2f} / {x['ms_fp8_gemms_exact_accum']:.2f} | {x['rel_l2_fast_vs_exact_accum']:.1e}"
                           if "ms_fp8_gemms" in x else why(x, "torch_error"))  # fmt: skip
            m64 = (
                f"{x['ms_triton_gemms_m64']:.2f}"
                if "ms_triton_gemms_m64" in x
                else _error_cell(x, "triton_m64_error")
            )
            triton = (f"{x['ms_triton_gemms']:.2f} / {m64} | {x.get('rel_l2_triton_vs_torch', float('nan')):.1e}"
                      if "ms_triton_gemms" in x else why(x, "triton_error"))  # fmt: skip
            lines.append(f"| layer 0 | {b} | {x['rows_per_expert']:.0f} | {x['ms_fp8_module']:.2f} "
                         f"| {torch_gemms} | {triton} | {x['ms_bf16_grouped']:.2f} "
                         f"| {x['ms_dequantize']:.2f} | {x['rel_l2_bf16_vs_fp8']:.3f} |")  # fmt: skip
    attention = [(r["batch"], a) for r in rows for a in r.get("attention", [])]
    if attention:
        lines += ["", "Attention, each form timed as a network pass runs it: cuDNN's kernel off.", "",
                  "| attention | batch | heads q/kv x dim | keys | kernels torch may pick (grouped) | ms grouped "
                  "| ms K/V expanded | ms queries packed |", "|---|---:|---|---:|---|---:|---:|---:|"]  # fmt: skip
        for b, a in attention:
            picks = ", ".join(k for k in ("flash", "efficient", "cudnn") if a[k]) or "math only"
            packed = f"{a['ms_packed']:.2f}" if "ms_packed" in a else "—"  # runs from before the packed form
            lines.append(f"| {a['kind']} | {b} | {a['q_heads']}/{a['kv_heads']} x {a['head_dim']} | {a['keys']} "
                         f"| {picks} | {a['ms_grouped']:.2f} | {a['ms_expanded']:.2f} | {packed} |")  # fmt: skip
        new = [(b, a["kind"], n) for b, a in attention for n in a.get("new_length", [])]
        if new:
            lines += ["", "| attention at a new key length | batch | backend | form | keys | ms first call | ms after |",
                      "|---|---:|---|---|---:|---:|---:|"]  # fmt: skip
            for b, kind, n in new:
                times = (
                    f"{n['first_ms']:.2f} | {n['ms']:.3f}"
                    if "first_ms" in n
                    else f"— | {_error_cell(n, 'error')}"
                )
                lines.append(f"| {kind} | {b} | {n['backend']} | {n['form']} | {n['keys']} | {times} |")
    lines += render_canvas([(r["format"], r["canvas"] if "canvas" in r else {"batch": r["batch"], "error": r["canvas_error"]},
                             r["ms_graph"]) for r in rows if "canvas" in r or "canvas_error" in r])  # fmt: skip
    lines += render_siblings([s for r in rows for s in r.get("siblings", [])])
    lines += render_network([n for r in rows for n in r.get("network", [])])
    bf16 = [(r["batch"], r["bf16_experts"]) for r in rows if "bf16_experts" in r]
    if bf16:
        lines += ["", "| one layer's bf16 experts | batch | rows per expert | ms torch F.grouped_mm | ms Triton MoE GEMM "
                  "| Triton vs torch (rel L2) |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        ms = lambda x, k: f"{x[f'ms_{k}']:.2f}" if f"ms_{k}" in x else f"— {_error_cell(x, f'{k}_error')}"
        for b, x in bf16:
            lines.append(f"| layer 0 | {b} | {x['rows_per_expert']:.0f} | {ms(x, 'torch')} | {ms(x, 'triton')} "
                         f"| {x.get('rel_l2_triton_vs_torch', float('nan')):.1e} |")  # fmt: skip
    tiles = [r for c in result["checks"] for r in c["rows"] if "best_ms" in r]
    lines += render_rows(tiles) + (render_per_pass(tiles, tiles[0]["layers"]) if tiles else [])
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """A measurement check's rows in one line, for the checks table: each pass's ms against its floor, the
    tuned tiles' expert GEMMs per pass, or the largest batch."""
    if not rows:
        return ""
    if "ms_eager" in rows[0]:
        return "; ".join(
            f"batch {r['batch']}: {_best_ms(r):.1f} ms, {_x_floor(r):.2f}x floor"
            if r.get("finite", True)
            else f"batch {r['batch']}: NaN output"
            for r in rows
        )
    if "first_call_s" in rows[0]:  # stopped before its first batch's times
        return f"batch {rows[0]['batch']}: stopped {_where_stopped(rows[0])}"
    if "largest_batch" in rows[0]:
        return f"largest {rows[0]['format']} batch that fits: {rows[0]['largest_batch']}"
    if "best_ms" in rows[0]:
        r, ms = rows[0], lambda v: "-" if v is None else f"{v:.1f}"
        passes = ", ".join(f"{p['canvases']}: {ms(p['default_ms'])} -> {ms(p['best_ms'])} (torch {ms(p['vendor_ms'])})"
                           for p in per_pass(rows, r["layers"]))  # fmt: skip
        crossover = "not timed" if r["triton_rows"] is None else f"{r['triton_rows']:g} rows per expert"
        return (f"{r['timed']} of {r['candidates']} tiles timed; expert GEMMs per pass, ms by canvases, default -> "
                f"tuned: {passes}; Triton up to {crossover}; {r['table_file']}")  # fmt: skip
    return ""


def _where_stopped(row: dict) -> str:
    """Where a pass stopped before its times: in its first call (under torch.compile, the compile), or after it."""
    if row["first_call_s"] is None:
        return "in its first call (under torch.compile: the compile)"
    return f"after its first call, which took {row['first_call_s']:.1f} s"


def _ms_cell(ms: float | None) -> str:
    """A floor's cell: "—" where the GPU has no datasheet figures in configs/targets."""
    return "—" if ms is None else f"{ms:.2f}"


def _error_cell(x: dict, key: str) -> str:
    """A diagnostic's error for a markdown cell: no column separators, 80 characters at most."""
    return str(x.get(key)).replace("|", "/")[:80]


def _best_ms(row: dict) -> float:
    """The pass time set against the floor: the CUDA-graph time, or eager where the graph did not run."""
    return row["ms_graph"] if row["ms_graph"] == row["ms_graph"] else row["ms_eager"]


def _x_floor(row: dict) -> float:
    """The pass time over the larger of its floors: HBM bytes and (runs since it was added) matmul FLOPs, at
    the datasheet's rates; on a GPU configs/targets does not list, the bytes at the copy bandwidth measured."""
    return _best_ms(row) / max(
        row["floor_ms_spec"] or row["floor_ms_copy"], row.get("compute_ms_spec") or 0.0
    )
