"""`dgpipe bench moe-tiles`: time dgpipe's Triton MoE GEMM (`pipeline.runtime.kernels.moe`) over a grid of
tiles on this GPU, at a model's two expert GEMM shapes (gate|up and down) and at 1 to 16 canvases per pass,
and write the fastest tile of each as this GPU model's table (`pipeline.runtime.kernels.moe_tiles`), which
every later dgpipe process on a GPU of the same model reads.

How, and why so: the candidates are a subset of the grid vLLM's fused-MoE tuner searches
(`benchmarks/kernels/benchmark_moe.py`: M tiles 16-256, N 32-256, K 64-256, 4 or 8 warps, 2-5 stages, and a
GROUP_SIZE_M our launch order has no counterpart for), cut to what fits the GPU's shared memory per block;
the GEMMs run on the operands the pass gives them (FP8 or bf16 weights, the tokens' rows gathered by the
kernel for gate|up, the down rows written back in token-major slot order), routed uniformly at random, as
vLLM's tuner routes them; each tile's output must be the float product of its operands (one bf16 rounding
apart) or the tile is rejected; times are `triton.testing.do_bench` medians (CUDA events, L2 flushed
between runs). Compiling a candidate (two specializations: gate|up and down) costs ~1 s, the timings much
less, so where vLLM's tuner times its whole grid (for hours), this one climbs: the defaults first, then
every tile one setting away from each GEMM's fastest so far, round after round, until none is left or the
time budget is spent. A short budget still leaves a table no slower than the defaults at any point, and
so does a process killed mid-climb: once the defaults are timed, the files are written again after every
tile timed (a write takes milliseconds, a tile's compile about a second), marked `"complete": false` until
the climb ends."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.atomic import atomic_write_text
from pipeline.errors import DgpipeError, error_line
from pipeline.runtime import kernels
from pipeline.runtime.kernels.moe_tiles import ShapeTiles, Tile, TileTable, expert_shapes, file_name

RESULT_FILE, TABLE_FILE = "moe_tiles.json", "moe_tiles.md"
CANVASES = (1, 2, 4, 8, 16)
BLOCK_M, BLOCK_N, WARPS, STAGES = (16, 32, 64, 128), (64, 128, 256), (4, 8), (3, 4, 5)
BLOCK_K_BYTES = (64, 128, 256)  # along K, in bytes: FP8 64-256 values, bf16 32-128
SAME_OUTPUT = 1e-2  # relative L2 from the float product: one bf16 rounding apart; a wrong tile is O(1)
# fp32 accumulator registers a thread may hold, of the 255 it can address: the operands' fragments and the
# addresses need the rest. Compiled for sm_90a by Triton 3.6 (torch 2.11's), each of the H200's 372
# shared-memory-fitting tiles compiled; the ten 128x256 tiles on 4 warps (256 accumulator registers a
# thread) spilled over 1 KB a thread each: slow by construction, not worth a compile in the budget (the
# 32x256x256 tiles on 4 warps and 3 stages, either launch order, spilled 16-56 bytes and stay)
MAX_ACCUMULATOR_REGISTERS = 128


@dataclass(frozen=True)
class GemmShape:
    name: str  # "gate_up" (gathers the token rows) or "down" (writes rows back in slot order)
    n: int
    k: int


def gemm_shapes(hidden: int, moe_intermediate: int) -> tuple[GemmShape, GemmShape]:
    """A layer's two expert GEMMs (`moe_tiles.expert_shapes`), named: gate|up [2I, d] and down [d, I]."""
    gate_up, down = expert_shapes(hidden, moe_intermediate)
    return GemmShape("gate_up", *gate_up), GemmShape("down", *down)


def changes(a: Tile, b: Tile) -> int:
    """How many of their six settings two tiles differ in."""
    return sum(x != y for x, y in zip(a.model_dump().values(), b.model_dump().values()))


def accumulator_registers(tile: Tile) -> int:
    """fp32 registers a thread holds of the tile's [block_m, block_n] accumulator."""
    return tile.block_m * tile.block_n // (32 * tile.num_warps)


def candidates(element_bytes: int, shared_limit: int) -> list[Tile]:
    """The tiles worth timing, most likely first: the default tiles (`kernels.moe.default_tile`), then every
    grid tile within `shared_limit` bytes of shared memory and `MAX_ACCUMULATOR_REGISTERS`, ordered by how
    many of its six settings differ from the nearest default (one change before two)."""
    defaults = kernels.moe.default_tiles(element_bytes)
    grid = [
        Tile(block_m=m, block_n=n, block_k=kb // element_bytes, num_warps=w, num_stages=s, n_fastest=o)
        for m, n, kb, w, s, o in itertools.product(
            BLOCK_M, BLOCK_N, BLOCK_K_BYTES, WARPS, STAGES, (False, True)
        )
    ]
    fits = [
        t
        for t in grid
        if t.shared_bytes(element_bytes) <= shared_limit
        and accumulator_registers(t) <= MAX_ACCUMULATOR_REGISTERS
    ]
    return list(dict.fromkeys(defaults + sorted(fits, key=lambda t: min(changes(t, d) for d in defaults))))


def one_change(grid: list[Tile]) -> Callable[[Tile], list[Tile]]:
    """The tiles of `grid` that differ from a tile in one setting: the next steps of `tune`'s climb."""
    return lambda tile: [t for t in grid if changes(t, tile) == 1]


@dataclass
class Problem:
    """One GEMM as a pass of `canvases` runs it: its operands on the device and its float product."""

    shape: GemmShape
    canvases: int
    slots: int  # tokens x top-k, over `experts`
    experts: int
    args: tuple  # launch's operands after the tile
    want: torch.Tensor | None = None  # `reference`, computed once


def problems(
    shapes: tuple[GemmShape, ...],
    canvases: tuple[int, ...],
    canvas: int,
    experts: int,
    top_k: int,
    operand: str,
    dev: torch.device,
    seed: int = 0,
) -> list[Problem]:
    """The operands of every (shape, canvases) GEMM: random weights in the operand's dtype, a pass's
    `canvas` tokens per canvas routed uniformly at random over `experts`, top `top_k` each."""
    from pipeline.model import scaled_layout as sl

    gen = torch.Generator(device=dev).manual_seed(seed)
    weights = {}
    for s in shapes:
        w = torch.randn(experts, s.n, s.k, device=dev, generator=gen)
        weights[s.name] = (
            (
                w.clamp(-448, 448).to(torch.float8_e4m3fn),
                torch.rand(experts, s.n, device=dev, generator=gen) / 64,
            )
            if operand == "fp8"
            else (w.bfloat16(), None)
        )
    out = []
    for c in canvases:
        tokens = c * canvas
        index = torch.rand(tokens, experts, device=dev, generator=gen).topk(top_k, dim=-1).indices
        routing = sl.expert_order(index, experts)
        for s in shapes:
            w, w_scale = weights[s.name]
            rows = tokens * top_k if s.name == "down" else tokens
            a = torch.randn(rows, s.k, device=dev, generator=gen)
            a, a_scale = (
                (a.to(torch.float8_e4m3fn), torch.rand(rows, device=dev, generator=gen) / 8)
                if operand == "fp8"
                else (a.bfloat16(), None)
            )
            gather = s.name == "gate_up"
            args = (a, a_scale, routing.token_of if gather else None, w, w_scale, routing.offs,
                    None if gather else routing.order)  # fmt: skip
            out.append(Problem(s, c, tokens * top_k, experts, args))
    return out


def reference(p: Problem) -> torch.Tensor:
    """The problem's product in fp32 expert by expert (`probe.gemm.float_gemm`), its rows where the kernel writes
    them (`out_rows`)."""
    from pipeline.runtime.probe.gemm import float_gemm

    a, a_scale, rows, w, w_scale, offs, out_rows = p.args
    rows = rows if rows is not None else torch.arange(a.shape[0], device=a.device)
    want = float_gemm(a, a_scale, rows, w, w_scale, offs)
    return want if out_rows is None else torch.empty_like(want).index_copy_(0, out_rows, want)


def do_bench_ms(fn: Callable[[], object]) -> float:
    """Median ms of fn on the GPU: `triton.testing.do_bench` (CUDA events, L2 cache flushed between runs)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=5, rep=20, return_mode="median"))


def vendor_gemm(p: Problem) -> Callable[[], torch.Tensor]:
    """torch's grouped GEMM on the problem's operands, as a pass runs it where the Triton GEMM does not: FP8
    through `tensor_cores.grouped_gemm` (RowWise), bf16 through `F.grouped_mm`, the token rows gathered
    first in both (the Triton GEMM gathers them itself). The down rows stay in expert order: the gather
    back to token order that the pass then runs is not timed, so the comparison leans to torch."""
    a, a_scale, rows, w, w_scale, offs, _ = p.args
    if a_scale is not None:
        from pipeline.runtime.tensor_cores import grouped_gemm

        # the activations' global scale is NVFP4's only: unread for FP8
        return lambda: grouped_gemm(a if rows is None else a[rows], a_scale, w, w_scale, None, None, offs, "fp8",
                                    scale_rows=rows)  # fmt: skip
    return lambda: torch.nn.functional.grouped_mm(
        a if rows is None else a[rows], w.transpose(-2, -1), offs=offs
    )


def time_vendor(problems_: list[Problem], time_ms: Callable[[Callable[[], object]], float]) -> dict:
    """ms of torch's grouped GEMM per problem (`vendor_gemm`), or None and why where it cannot run here
    (torch's FP8 grouped GEMM is sm90-only)."""
    ms, error = [], None
    for p in problems_:
        try:
            fn = vendor_gemm(p)
            fn()
            ms.append(time_ms(fn))
        except Exception as e:  # its own field says why; the tiles are still timed
            ms.append(None)
            error = error_line(e)
    return {"ms": ms, "error": error}


def tune(
    problems_: list[Problem],
    tiles: list[Tile],
    deadline: float,
    time_ms: Callable[[Callable[[], object]], float] = do_bench_ms,
    on_tile: Callable[[int, int], None] | None = None,
    neighbours: Callable[[Tile], list[Tile]] | None = None,
    on_timed: Callable[[list, list], None] | None = None,
) -> dict:
    """Time every tile on every problem until `deadline` (time.monotonic()); the first tile and the tiles
    `kernels.moe` picks by default for these problems are always timed (`candidates` puts them first).
    With `neighbours`, a climb: once the tiles given are timed, the neighbours of each problem's fastest
    tile so far are timed next, round after round, until no untimed neighbour is left or time runs out
    (from the defaults, two rounds reach a tile two settings away; the whole grid is ~10x more tiles).
    Returns {"timed": [(tile, [ms per problem])], "rejected": [(tile, why)]}; a tile whose output is not the
    float product of its operands (`reference`, one bf16 rounding apart), or that fails to compile or launch
    (Triton's shared-memory or register limits), is rejected; the first one failing is an error (the kernel
    itself is wrong here). `on_timed(timed, rejected)`: told once the tiles given (the defaults) have all
    been tried, then after each tile timed, so that what it saves is never slower than the defaults."""
    timed, rejected = [], []
    given = len(dict.fromkeys(tiles))
    defaults = {kernels.moe.default_tile(p.slots, p.experts, p.args[0].element_size()) for p in problems_}
    queue, i = list(dict.fromkeys(tiles)), 0
    while i < len(queue):
        tile, i = queue[i], i + 1
        if i > 1 and tile not in defaults and time.monotonic() >= deadline:
            continue
        try:
            ms = []
            for p in problems_:
                got = kernels.moe.launch(tile, *p.args).float()
                p.want = reference(p) if p.want is None else p.want
                err = float((got - p.want).norm() / p.want.norm().clamp(min=1e-30))
                if not err < SAME_OUTPUT:
                    raise DgpipeError(f"{p.shape.name} at {p.canvases} canvases differs from the float product "
                                      f"by {err:.3g} (relative L2)")  # fmt: skip
                ms.append(time_ms(lambda p=p, tile=tile: kernels.moe.launch(tile, *p.args)))
            timed.append((tile, ms))
        except Exception as e:  # recorded with its reason; the other tiles still run
            if i == 1:
                raise
            rejected.append((tile, error_line(e)))
        if on_tile:
            on_tile(len(timed) + len(rejected), len(queue))
        # once every default was tried (the last may have been rejected), then after each tile timed
        if on_timed and timed and (i == given or (i > given and timed[-1][0] is tile)):
            on_timed(timed, rejected)
        if i == len(queue) and neighbours and timed and time.monotonic() < deadline:  # the next round
            bests = {min(timed, key=lambda tm, j=j: tm[1][j])[0] for j in range(len(problems_))}
            queue += [t for t in dict.fromkeys(n for b in bests for n in neighbours(b)) if t not in queue]
    return {"timed": timed, "rejected": rejected}


def best_table(
    problems_: list[Problem],
    timed: list,
    device: str,
    operand: str,
    element_bytes: int,
    vendor_ms: list[float | None] | None = None,
) -> tuple[TileTable, list[dict]]:
    """The fastest timed tile per problem as a table (with its ms and torch's, `vendor_ms`), and one row
    per problem: its default tile's ms, the best tile's and torch's."""
    rows, by_shape, best_ms, torch_ms = [], {}, {}, {}
    vendor_ms = vendor_ms or [None] * len(problems_)
    for j, p in enumerate(problems_):
        default = kernels.moe.default_tile(p.slots, p.experts, element_bytes)
        mine = {t: ms[j] for t, ms in timed}
        best = min(mine, key=lambda t: (mine[t], t != default))  # a tie keeps the default
        per_expert = p.slots / p.experts
        rows.append({"shape": p.shape.name, "n": p.shape.n, "k": p.shape.k, "canvases": p.canvases,
                     "rows_per_expert": per_expert, "default": default.short(), "default_ms": mine.get(default),
                     "best": best.short(), "best_ms": mine[best], "vendor_ms": vendor_ms[j]})  # fmt: skip
        key = max(1, round(per_expert))
        by_shape.setdefault(p.shape, {})[key] = best
        best_ms.setdefault(p.shape, {})[key] = mine[best]
        if vendor_ms[j] is not None:
            torch_ms.setdefault(p.shape, {})[key] = vendor_ms[j]
    import triton

    shapes = [ShapeTiles(n=s.n, k=s.k, tiles=t, tile_ms=best_ms[s], vendor_ms=torch_ms.get(s, {}))
              for s, t in by_shape.items()]  # fmt: skip
    table = TileTable(
        device=device, operand=operand, torch=torch.__version__, triton=triton.__version__, shapes=shapes
    )
    return table, rows


def render(result: dict) -> list[str]:
    """The summary line and `render_rows`' table."""
    rows = result.get("triton_rows")
    crossover = (
        f"torch's grouped GEMM not timed ({result.get('vendor_error')})"
        if rows is None
        else "torch's grouped GEMM is faster from the fewest rows per expert timed"
        if not rows
        else f"the tuned Triton GEMM is as fast as torch's grouped GEMM up to {rows:.0f} rows per expert"
    )
    partial = "" if result.get("complete", True) else " (stopped before the end: the best tiles timed so far)"
    return [
        f"Triton MoE GEMM tiles on {result['device']} ({result['operand']}; torch {result['torch']}, "
        f"Triton {result['triton']}): {result['timed']} of {result['candidates']} candidate tiles timed in "
        f"{result['seconds']:.0f} s{partial}, {len(result['rejected'])} rejected; do_bench medians; {crossover}",
        *render_rows(result["rows"]),
        *render_per_pass(result["rows"], result["layers"]),
    ]


def per_pass(rows: list[dict], layers: int) -> list[dict]:
    """The expert GEMMs of a whole pass per canvases: both shapes' ms times the model's MoE layers, on the
    default tiles, the best ones and torch's kernel (None where one of them was not timed)."""
    total = lambda group, key: (
        None if any(r.get(key) is None for r in group) else layers * sum(r[key] for r in group)
    )
    by_canvases: dict[int, list[dict]] = {}
    for r in rows:
        by_canvases.setdefault(r["canvases"], []).append(r)
    return [{"canvases": c, "default_ms": total(g, "default_ms"), "best_ms": total(g, "best_ms"),
             "vendor_ms": total(g, "vendor_ms")} for c, g in sorted(by_canvases.items())]  # fmt: skip


def render_per_pass(rows: list[dict], layers: int) -> list[str]:
    cell = lambda v: "-" if v is None else f"{v:.2f}"
    lines = ["", f"| canvases per pass | expert GEMMs, {layers} layers: ms default tiles | ms best tiles "
             "| ms torch grouped GEMM |", "|---:|---:|---:|---:|"]  # fmt: skip
    return lines + [f"| {p['canvases']} | {cell(p['default_ms'])} | {cell(p['best_ms'])} | {cell(p['vendor_ms'])} |"
                    for p in per_pass(rows, layers)]  # fmt: skip


def render_rows(rows: list[dict]) -> list[str]:
    """Per GEMM shape and canvases: the default tile and the best, with their ms, and torch's grouped GEMM
    on the same operands (also in `dgpipe bench gpu`'s table)."""
    if not rows:
        return []
    lines = [
        "",
        "| MoE GEMM | canvases | rows per expert | default tile | ms | best tile | ms | default / best "
        "| ms torch grouped GEMM | torch / best |",
        "|---|---:|---:|---|---:|---|---:|---:|---:|---:|",
    ]
    cell = lambda v, f: "-" if v is None else format(v, f)
    for r in rows:
        d, b, v = r["default_ms"], r["best_ms"], r.get("vendor_ms")
        lines.append(
            f"| {r['shape']} [{r['n']}, {r['k']}] | {r['canvases']} | {r['rows_per_expert']:.0f} | {r['default']} "
            f"| {cell(d, '.3f')} | {r['best']} | {b:.3f} | {cell(d and d / b, '.2f')} | {cell(v, '.3f')} "
            f"| {cell(v and v / b, '.2f')} |"
        )
    return lines


def run_moe_tiles(
    out: Path,
    operand: str | None,
    config: str,
    budget_s: float = 120.0,
    canvases: tuple[int, ...] = CANVASES,
    install_dir: Path | None = None,
    device: torch.device | None = None,
    time_ms: Callable[[Callable[[], object]], float] = do_bench_ms,
    on_tile: Callable[[int, int], None] | None = None,
    on_result: Callable[[dict], None] | None = None,
) -> dict:
    """Tune the MoE GEMM's tiles for `config`'s experts on this GPU within `budget_s`; write out/moe_tiles.json,
    out/moe_tiles.md and the table (`<GPU>-<operand>.yaml`), and the table into `install_dir` too (where
    dgpipe reads tables: `moe_tiles.search_dirs`), the files in `out` once the defaults are timed and after
    every tile timed from then on (`"complete": false`), and all of them at the end: a run stopped part-way
    leaves the table `install_dir` had. `on_result` is given each result written.
    `operand`: "fp8" or "bf16" (default: fp8 where the GPU has FP8 tensor cores). `device`, `time_ms`:
    another device and timer, for testing off a GPU."""
    import yaml

    from pipeline.model.config import ModelConfig
    from pipeline.runtime.dispatch import arch_of
    from pipeline.targets import precision

    t0 = time.monotonic()
    dev = device or torch.device("cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DgpipeError(
            "dgpipe bench moe-tiles needs a CUDA GPU: tiles are timed on the GPU model that will use them",
            "run it on the GPU host; `dgpipe bench gpu` runs it too",
        )
    why = kernels.moe.unavailable(dev)
    if why:
        raise DgpipeError(f"the Triton MoE GEMM cannot run here: {why}")
    if dev.type == "cuda":
        name, arch = torch.cuda.get_device_name(dev), arch_of(*torch.cuda.get_device_capability(dev))
        props = torch.cuda.get_device_properties(dev)  # the opt-in limit is what Triton's kernels may take
        shared = getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block)
    else:
        name, arch, shared = f"{dev.type} (interpreted)", None, 99 * 1024
    fp8_here = dev.type != "cuda" or arch in precision("fp8").native_on
    operand = operand or ("fp8" if fp8_here else "bf16")
    if operand == "fp8" and not fp8_here:
        raise DgpipeError(f"{name} ({arch}) has no FP8 tensor cores (sm89+)", "tune with --operand bf16")
    element_bytes = 1 if operand == "fp8" else 2
    mcfg = ModelConfig.from_yaml(config)
    text = mcfg.text_config
    shapes = gemm_shapes(text.hidden_size, text.moe_intermediate_size)
    todo = problems(shapes, canvases, mcfg.canvas_length, text.num_experts, text.top_k_experts, operand, dev)
    tiles = candidates(element_bytes, shared)
    from pipeline.bench.results import save_result

    def save(timed: list, rejected: list, complete: bool) -> dict:
        table, rows = best_table(todo, timed, name, operand, element_bytes, vendor["ms"])
        result = {"device": name, "arch": arch, "operand": operand, "model": config, "layers": text.num_hidden_layers,
                  "torch": table.torch, "triton_rows": table.triton_rows(), "vendor_error": vendor["error"],
                  "triton": table.triton, "shared_memory_per_block": shared, "budget_s": budget_s,
                  "seconds": time.monotonic() - t0, "complete": complete, "candidates": len(tiles),
                  "timed": len(timed), "rejected": [{"tile": t.short(), "why": w} for t, w in rejected],
                  "rows": rows, "table": table.model_dump(),
                  "timings": [{"tile": t.short(), "ms": ms} for t, ms in timed]}  # fmt: skip
        text_yaml = (
            "# dgpipe bench moe-tiles: the fastest Triton MoE GEMM tile per shape and rows per expert\n"
        )
        text_yaml += yaml.safe_dump(table.model_dump(), sort_keys=False)
        # the installed table (every later load reads it) is replaced by a finished run's alone
        targets = [out] + ([install_dir] if install_dir and complete else [])
        result["table_files"] = [str(d / file_name(name, operand)) for d in targets]
        for path in result["table_files"]:
            atomic_write_text(Path(path), text_yaml)
        save_result(out, RESULT_FILE, result)
        atomic_write_text(out / TABLE_FILE, "\n".join(render(result)) + "\n")
        if on_result:
            on_result(result)
        return result

    with torch.inference_mode():
        vendor = time_vendor(todo, time_ms)
        found = tune(todo, kernels.moe.default_tiles(element_bytes), t0 + budget_s, time_ms, on_tile,
                     one_change(tiles), on_timed=lambda timed, rejected: save(timed, rejected, complete=False))  # fmt: skip
    return save(found["timed"], found["rejected"], complete=True)
