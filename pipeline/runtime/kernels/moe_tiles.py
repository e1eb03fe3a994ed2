"""Tile tables for dgpipe's Triton MoE GEMM (`pipeline.runtime.kernels.moe`): which tile sizes, warps and
pipeline stages to launch at each weight shape and number of rows per expert, measured on one GPU model.

Why tables: the best tiles of a Triton GEMM depend on the GPU (SM count, shared memory, L2), the shape and
the rows per expert, and no formula predicts them well. The field's practice is to time a grid of
candidates on each GPU model and ship the winners as data: vLLM's fused-MoE kernel reads per-GPU JSON files
(`vllm/model_executor/layers/fused_moe/configs/E=...,N=...,device_name=NVIDIA_H200,...json`, made by its
`benchmarks/kernels/benchmark_moe.py --tune`). dgpipe does the same: `dgpipe bench moe-tiles` times the
candidates on this GPU (`pipeline.bench.gpu.tiles`) and writes one YAML table per GPU model and operand
type; `dgpipe bench gpu` tunes too and leaves its table in its `--out`.

Where tables are found, first match wins: the folder $DGPIPE_MOE_TILES names (`TABLES_ENV`: a table to
try without installing it; `dgpipe bench gpu` points the checks after its tiles check at the table that
check measured), the cache (`<dgpipe cache>/moe_tiles`, where `dgpipe bench moe-tiles` writes by default:
tuned on this host) and then `configs/moe_tiles` (measured tables shipped with dgpipe). A shape or GPU with
no table keeps `kernels.moe.tiles`' own choice. The load-time probe runs every tile of the table it finds
against the float reference (`pipeline.runtime.probe`): a tile that fails there (a table from another
Triton build) turns the Triton GEMM off for that load, its fallback line naming the table to delete or tune
again; it costs speed, never a wrong answer. A table that cannot be read is an error of the load naming
its file (`TileTableError`), never a quiet fallback."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
from collections.abc import Collection
from pathlib import Path
from typing import Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

from pipeline.errors import DgpipeError
from pipeline.resources import cache_dir, configs_dir

TABLE_DIR = "moe_tiles"  # under the cache and under configs/
TABLES_ENV = "DGPIPE_MOE_TILES"  # a folder of tables searched before the cache and configs/
Operand = Literal["fp8", "bf16"]


class TileTableError(DgpipeError):
    """A tile table file that cannot be used (unreadable, malformed, or measured on another GPU): the load
    stops and names it, where a kernel failure would only send the pass to a slower path."""


class Tile(BaseModel):
    """One launch configuration of the MoE GEMM: its tile sizes (rows, output columns, reduction depth),
    warps per program, software-pipeline stages, and launch order. M blocks first (`n_fastest` False):
    programs running together share an N block, so an expert's weight tile is read once for all its M
    blocks, and the activations are read again for every N block. N blocks first: programs running together
    share M blocks, so their activation rows are read once from memory and stay in L2 across the N blocks,
    and an expert's weights are read again for each of its M blocks, from L2 while they fit (4 MB per
    expert for the 26B's gate|up). With many rows per expert (16 canvases: 256) the second reads far less
    from memory; which is faster is measured (`dgpipe bench moe-tiles`), as the tiles are."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    block_m: Literal[16, 32, 64, 128]
    block_n: Literal[32, 64, 128, 256]
    block_k: Literal[32, 64, 128, 256]
    num_warps: Literal[2, 4, 8]
    num_stages: int = Field(ge=1, le=8)
    n_fastest: bool = False

    def shared_bytes(self, element_bytes: int) -> int:
        """Shared memory its pipeline stages take (both operands' tiles per stage), the number a GPU's
        per-block limit bounds."""
        return self.num_stages * (self.block_m + self.block_n) * self.block_k * element_bytes

    def short(self) -> str:
        order = " n-first" if self.n_fastest else ""
        return f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}{order}"


class ShapeTiles(BaseModel):
    """The tiles of one weight shape (N output columns, K reduction), keyed by rows per expert, with the
    measured ms of each and of torch's grouped GEMM on the same operands (where this GPU has one)."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(gt=0)
    k: int = Field(gt=0)
    tiles: dict[PositiveInt, Tile] = Field(min_length=1)
    tile_ms: dict[PositiveInt, PositiveFloat] = {}
    vendor_ms: dict[PositiveInt, PositiveFloat] = {}

    @model_validator(mode="after")
    def _same_rows(self) -> ShapeTiles:
        for name in ("tile_ms", "vendor_ms"):
            if not set(getattr(self, name)) <= set(self.tiles):
                raise ValueError(f"{name} names rows per expert that `tiles` does not")
        return self

    def pick(self, rows_per_expert: float) -> Tile:
        """The tile measured nearest `rows_per_expert`, nearness by ratio (16 is as far from 8 as 32 is)."""
        at = math.log2(max(rows_per_expert, 1e-9))
        return self.tiles[min(self.tiles, key=lambda r: (abs(math.log2(r) - at), r))]


class TileTable(BaseModel):
    """One GPU model's measured tiles for one operand type; what `dgpipe bench moe-tiles` writes."""

    model_config = ConfigDict(extra="forbid")

    device: str  # torch.cuda.get_device_name, as measured
    operand: Operand
    torch: str  # the versions it was measured with (a Triton upgrade may change the best tiles)
    triton: str
    shapes: list[ShapeTiles] = Field(min_length=1)

    def pick(self, n: int, k: int, rows_per_expert: float) -> Tile | None:
        """The measured tile for this shape nearest `rows_per_expert`, or None (shape not measured)."""
        for shape in self.shapes:
            if (shape.n, shape.k) == (n, k):
                return shape.pick(rows_per_expert)
        return None

    def triton_rows(self, shapes: Collection[tuple[int, int]] | None = None) -> float | None:
        """Up to how many rows per expert the tuned Triton GEMM beat torch's grouped GEMM here at the weight
        `shapes` ((N, K) pairs; default: every shape measured), their ms summed: the largest measured count
        at which it won at every count up to it, 0 where it lost at the smallest, None where a shape was not
        measured or torch's GEMM was not timed at every count. Where the dispatch row gives Triton the passes
        with few rows per expert (Hopper), this measured crossover replaces its constant for a model whose
        expert shapes it timed; another model's shapes keep the constant."""
        measured = {(s.n, s.k): s for s in self.shapes}
        if shapes is not None and not set(shapes) <= set(measured):
            return None
        mine = list(measured.values()) if shapes is None else [measured[s] for s in sorted(set(shapes))]
        counts = sorted(set.intersection(*(set(s.tiles) for s in mine)))
        if not all(r in s.tile_ms and r in s.vendor_ms for s in mine for r in counts):
            return None
        rows = 0.0
        for r in counts:
            if sum(s.tile_ms[r] for s in mine) > sum(s.vendor_ms[r] for s in mine):
                break
            rows = float(r)
        return rows

    def all_tiles(self) -> list[Tile]:
        """Every distinct tile it names, in a stable order (what the load-time probe checks)."""
        return list(dict.fromkeys(t for s in self.shapes for _, t in sorted(s.tiles.items())))


def file_name(device: str, operand: str) -> str:
    """The table's file name: the GPU's name with its spaces and punctuation as underscores, as vLLM names
    its per-device files (`NVIDIA_H200-fp8.yaml`)."""
    return f"{re.sub(r'[^A-Za-z0-9]+', '_', device).strip('_')}-{operand}.yaml"


def search_dirs() -> list[Path]:
    """Where tables are looked for, first match wins: $DGPIPE_MOE_TILES where set, tuned on this host,
    then shipped with dgpipe."""
    dirs = [Path(os.environ[TABLES_ENV]).expanduser()] if os.environ.get(TABLES_ENV) else []
    dirs.append(cache_dir() / TABLE_DIR)
    with contextlib.suppress(DgpipeError):  # an install without its configs: only tables tuned here
        dirs.append(configs_dir() / TABLE_DIR)
    return dirs


def read_table(path: Path) -> TileTable:
    """A table file, or a TileTableError naming the file and what is wrong with it (a pydantic
    ValidationError and a file that is not UTF-8 are ValueErrors)."""
    try:
        return TileTable.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, yaml.YAMLError) as e:
        first = str(e).strip().splitlines()
        raise TileTableError(
            f"MoE tile table {path} is not valid: {' '.join(first[:3])}",
            f"delete it, or write it again with `dgpipe bench moe-tiles --out {path.parent}`",
        ) from e


def find_table(device: str, operand: str, dirs: list[Path] | None = None) -> tuple[TileTable, Path] | None:
    """The first table for this GPU model and operand type in `dirs` (default `search_dirs`), or None."""
    for d in dirs if dirs is not None else search_dirs():
        path = d / file_name(device, operand)
        if path.is_file():
            table = read_table(path)
            if table.device != device or table.operand != operand:
                raise TileTableError(
                    f"MoE tile table {path} was measured on {table.device} ({table.operand}), "
                    f"not {device} ({operand})",
                    "delete it: its name and its contents disagree",
                )
            return table, path
    return None


@functools.cache
def table_and_path(device: torch.device, operand: str) -> tuple[TileTable, Path] | None:
    """This CUDA device's table for `operand` and its file, read once per process; None off CUDA or where
    none was measured."""
    if device.type != "cuda":
        return None
    return find_table(torch.cuda.get_device_name(device), operand)


def table_for(device: torch.device, operand: str) -> TileTable | None:
    """This CUDA device's table for `operand` ("fp8" or "bf16"), read once per process; None off CUDA or
    where none was measured. A table tuned on this host (`dgpipe bench moe-tiles`) is read by the
    processes started after it."""
    found = table_and_path(device, operand)
    return found[0] if found else None


def tiles_source(device: torch.device, operand: str) -> str:
    """Where this device's MoE GEMM tiles for `operand` come from, for a report: the table's file and the
    versions it was measured with, or "default tiles"."""
    found = table_and_path(device, operand)
    if found is None:
        return "default tiles"
    table, path = found
    return f"tiles from {path} (torch {table.torch}, Triton {table.triton})"


def measured_triton_rows(device: torch.device, shapes: tuple[tuple[int, int], ...]) -> float | None:
    """This GPU's measured crossover between the Triton FP8 GEMM and torch's at a model's expert weight
    `shapes` ((N, K) of gate|up and down: `expert_shapes`; `TileTable.triton_rows`), or None: no FP8 table,
    one without these shapes or without torch's timings."""
    table = table_for(device, "fp8")
    return table.triton_rows(shapes) if table is not None else None


def expert_shapes(hidden: int, moe_intermediate: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """A MoE layer's two expert GEMM weight shapes (N, K): gate|up [2I, d], then down [d, I]."""
    return (2 * moe_intermediate, hidden), (hidden, moe_intermediate)


def operand_of(element_bytes: int) -> Operand:
    return "fp8" if element_bytes == 1 else "bf16"
