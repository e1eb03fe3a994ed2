"""Measured tile tables for the Triton MoE GEMM (`pipeline.runtime.kernels.moe_tiles`): which tile a pass
launches with, where tables are found, what a bad table says, and that a tuned tile computes what the
default tile does (Triton's interpreter)."""

from __future__ import annotations

import re

import pytest
import torch
import yaml

from pipeline.errors import DgpipeError
from pipeline.model import scaled_layout as sl
from pipeline.runtime.kernels import moe, moe_tiles
from pipeline.runtime.kernels.moe_tiles import ShapeTiles, Tile, TileTable
from tests._utils.interpreter_casts import interpreted

CPU = torch.device("cpu")
T16 = Tile(block_m=16, block_n=64, block_k=256, num_warps=8, num_stages=3)
T64 = Tile(block_m=64, block_n=256, block_k=64, num_warps=4, num_stages=5)


def _table(device: str = "NVIDIA H200", operand: str = "fp8") -> TileTable:
    return TileTable(device=device, operand=operand, torch="2.11.0+cu130", triton="3.5.0",
                     shapes=[ShapeTiles(n=1408, k=2816, tiles={16: T16, 64: T64, 256: T64})])  # fmt: skip


def test_a_table_picks_the_tile_measured_nearest_by_ratio_and_only_for_its_shapes():
    table = _table()
    assert table.pick(1408, 2816, 16) == T16 and table.pick(1408, 2816, 1) == T16
    assert table.pick(1408, 2816, 31) == T16 and table.pick(1408, 2816, 33) == T64  # 32: as far from 16 as 64
    assert table.pick(1408, 2816, 32) == T16  # a tie keeps the smaller tile
    assert table.pick(1408, 2816, 10**6) == T64
    assert table.pick(2816, 704, 16) is None  # the down shape was not measured
    assert table.all_tiles() == [T16, T64]
    # the pass's tile: the table's where it has one, else the default
    assert moe.tiles(2048, 128, 1408, 2816, 1, table) == T16
    assert moe.tiles(2048, 128, 2816, 704, 1, table) == moe.default_tile(2048, 128, 1)
    assert moe.tiles(2048, 128, 1408, 2816, 1, None) == moe.default_tile(2048, 128, 1)


def test_the_measured_crossover_is_where_the_tuned_triton_gemm_stops_beating_torchs():
    """Both shapes' ms summed per rows-per-expert count: Triton's tile ms against torch's grouped GEMM's."""

    def table(triton_ms, torch_ms, down_torch_ms=None, down=(2816, 704)):
        shapes = [ShapeTiles(n=n, k=k, tiles=dict.fromkeys(triton_ms, T16), tile_ms=dict(triton_ms),
                             vendor_ms=dict(ms)) for (n, k), ms in (((1408, 2816), torch_ms),
                                                                    (down, down_torch_ms or torch_ms))]  # fmt: skip
        return TileTable(device="NVIDIA H200", operand="fp8", torch="t", triton="t", shapes=shapes)

    rows = {16: 0.1, 32: 0.2, 64: 0.4, 128: 0.8, 256: 1.6}
    assert table(rows, {r: 2 * ms for r, ms in rows.items()}).triton_rows() == 256.0  # wins everywhere
    assert table(rows, {16: 0.2, 32: 0.2, 64: 0.3, 128: 2.0, 256: 3.2}).triton_rows() == 32.0  # a tie wins
    assert table(rows, {16: 0.05, 32: 0.4, 64: 0.8, 128: 1.6, 256: 3.2}).triton_rows() == 0.0
    assert table(rows, {16: 0.2}).triton_rows() is None  # torch's kernel not timed at every count
    # a model's own shapes: the crossover of those alone; a model whose shapes were not timed has none
    torch_ms = {16: 0.2, 32: 0.2, 64: 0.3, 128: 2.0, 256: 3.2}
    assert table(rows, torch_ms).triton_rows({(1408, 2816), (2816, 704)}) == 32.0
    assert table(rows, torch_ms).triton_rows({(1024, 512), (512, 512)}) is None  # another model's shapes
    # gate|up alone: Triton loses at 64 rows per expert; summed with a down GEMM where it wins by far, it wins
    other = table(rows, torch_ms, {16: 0.2, 32: 0.2, 64: 5.0, 128: 2.0, 256: 3.2}, down=(2816, 512))
    assert other.triton_rows() == 256.0 and other.triton_rows({(1408, 2816)}) == 32.0
    assert other.triton_rows({(1408, 2816), (2816, 704)}) is None  # its down shape is another model's
    with pytest.raises(ValueError, match="tile_ms names rows per expert that `tiles` does not"):
        ShapeTiles(n=1, k=1, tiles={16: T16}, tile_ms={32: 0.1})


def test_tiles_take_only_launchable_settings_and_say_their_shared_memory():
    assert T64.shared_bytes(1) == 5 * (64 + 256) * 64 and T64.shared_bytes(2) == 2 * T64.shared_bytes(1)
    for bad in ({"block_m": 24}, {"num_warps": 3}, {"num_stages": 0}, {"extra": 1}):
        with pytest.raises(ValueError):
            Tile(**{**T16.model_dump(), **bad})


def test_table_files_are_named_after_the_gpu_model_and_found_first_in_the_cache(tmp_path, monkeypatch):
    assert moe_tiles.file_name("NVIDIA H200", "fp8") == "NVIDIA_H200-fp8.yaml"
    name = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    assert moe_tiles.file_name(name, "bf16") == "NVIDIA_RTX_PRO_6000_Blackwell_Server_Edition-bf16.yaml"
    monkeypatch.setenv("DGPIPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(moe_tiles.TABLES_ENV, raising=False)
    dirs = moe_tiles.search_dirs()
    assert dirs[0] == tmp_path / "cache" / "moe_tiles" and dirs[1].parts[-2:] == ("configs", "moe_tiles")
    monkeypatch.setenv(moe_tiles.TABLES_ENV, str(tmp_path / "trying"))  # a folder named to try first
    assert moe_tiles.search_dirs() == [tmp_path / "trying", *dirs]
    shipped, tuned = tmp_path / "shipped", tmp_path / "tuned"
    for d, tile in ((shipped, T64), (tuned, T16)):
        d.mkdir()
        t = _table()
        t.shapes[0].tiles[16] = tile
        (d / "NVIDIA_H200-fp8.yaml").write_text(yaml.safe_dump(t.model_dump()))
    found, path = moe_tiles.find_table("NVIDIA H200", "fp8", [tuned, shipped])
    assert path == tuned / "NVIDIA_H200-fp8.yaml" and found.pick(1408, 2816, 16) == T16
    assert moe_tiles.find_table("NVIDIA H200", "fp8", [shipped])[0].pick(1408, 2816, 16) == T64
    assert moe_tiles.find_table("NVIDIA H200", "bf16", [tuned, shipped]) is None
    assert moe_tiles.find_table("NVIDIA H100 80GB HBM3", "fp8", [tuned, shipped]) is None


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("device: [unclosed", "is not valid"),
        ("device: NVIDIA H200\noperand: fp8\n", "is not valid: 3 validation errors"),
        (None, r"was measured on NVIDIA H100 \(fp8\), not NVIDIA H200 \(fp8\)"),
        (b"device: NVIDIA H200\n\xff\xfe\n", "is not valid: 'utf-8' codec can't decode byte 0xff"),
        (
            _table().model_dump() | {"shapes": [{"n": 1, "k": 1, "tiles": {0: T16.model_dump()}}]},
            r"is not valid: 1 validation error .* greater than 0",
        ),
        (
            _table().model_dump()
            | {"shapes": [{"n": 1, "k": 1, "tiles": {16: T16.model_dump()}, "tile_ms": {16: float("nan")}}]},
            "greater than 0",
        ),
    ],
)
def test_a_bad_table_is_an_error_naming_the_file_and_the_fix(tmp_path, text, says):
    """Raised when the table is read (a load's first MoE GEMM would otherwise meet it mid-pass): not YAML,
    not a table, another GPU's, not UTF-8, rows per expert or ms that are not positive."""
    path = tmp_path / "NVIDIA_H200-fp8.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif isinstance(text, dict):
        path.write_text(yaml.safe_dump(text))
    else:
        path.write_text(text if text is not None else yaml.safe_dump(_table("NVIDIA H100").model_dump()))
    with pytest.raises(moe_tiles.TileTableError, match=says) as e:
        moe_tiles.find_table("NVIDIA H200", "fp8", [tmp_path])
    assert str(path) in str(e.value) and ("delete it" in e.value.hint)


def test_off_cuda_no_table_is_read():
    assert moe_tiles.table_for(CPU, "fp8") is None and moe_tiles.measured_triton_rows(CPU, ((1, 1),)) is None
    assert moe_tiles.tiles_source(CPU, "fp8") == "default tiles"


def test_a_report_names_the_table_a_device_launches_with(tmp_path, monkeypatch):
    path = tmp_path / "NVIDIA_H200-fp8.yaml"
    monkeypatch.setattr(moe_tiles, "table_and_path", lambda device, operand: (_table(), path))
    assert moe_tiles.tiles_source(CPU, "fp8") == f"tiles from {path} (torch 2.11.0+cu130, Triton 3.5.0)"
    assert moe_tiles.table_for(CPU, "fp8") == _table()


@interpreted
@pytest.mark.parametrize("operand", ["fp8", "bf16"])
def test_a_pass_launches_with_its_gpus_table_and_a_tuned_tile_computes_what_the_default_does(
    operand, monkeypatch
):
    """The table this device has (here put in place of the CUDA lookup) decides the pass's tile; a tile
    wider than N and deeper than K, with other warps and stages, gives the default tile's result within one
    bf16 rounding (another K block sums in another order)."""
    gen = torch.Generator().manual_seed(11)
    e, n, k, tokens = 4, 96, 160, 60
    element_bytes = 1 if operand == "fp8" else 2
    w = torch.randn(e, n, k, generator=gen)
    a = torch.randn(tokens, k, generator=gen)
    if operand == "fp8":
        w, a = (w * 8).to(torch.float8_e4m3fn), (a * 8).to(torch.float8_e4m3fn)
        scales = (torch.rand(tokens, generator=gen) + 0.5, torch.rand(e, n, generator=gen) + 0.5)
    else:
        w, a, scales = w.bfloat16(), a.bfloat16(), (None, None)
    index = torch.randint(0, e, (tokens, 2), generator=gen)
    routing = sl.expert_order(index, e)
    args = (a, scales[0], routing.token_of, w, scales[1], routing.offs)
    want = moe.launch(moe.default_tile(tokens * 2, e, element_bytes), *args).float()
    tuned = Tile(block_m=16, block_n=256, block_k=256 // element_bytes, num_warps=8, num_stages=3)
    table = TileTable(device="cpu", operand=operand, torch="t", triton="t",
                      shapes=[ShapeTiles(n=n, k=k, tiles={30: tuned})])  # fmt: skip
    seen = []
    real = moe.launch
    monkeypatch.setattr(moe_tiles, "table_for", lambda device, op: table if op == operand else None)
    monkeypatch.setattr(moe, "launch", lambda tile, *a: seen.append(tile) or real(tile, *a))
    got = moe.moe_gemm(*args).float()
    assert seen == [tuned]
    assert float((got - want).norm() / want.norm()) < 2**-8
    assert moe.probe_tiles(CPU, element_bytes)[-1] == tuned  # the probe runs it too


def test_every_shipped_table_is_valid_and_named_after_its_gpu():
    """Tables measured by `dgpipe bench gpu` and committed to configs/moe_tiles: each reads back under the
    name dgpipe looks it up by."""
    from pipeline.resources import configs_dir

    shipped = configs_dir() / moe_tiles.TABLE_DIR
    if not any(shipped.glob("*.yaml")):
        pytest.skip("no measured table is shipped yet")
    for path in sorted(shipped.glob("*.yaml")):
        table = moe_tiles.read_table(path)
        assert moe_tiles.find_table(table.device, table.operand, [shipped]) == (table, path)


@interpreted
@pytest.mark.parametrize("operand", ["fp8", "bf16"])
def test_n_blocks_first_is_the_same_product_in_another_launch_order(operand, monkeypatch):
    """`Tile.n_fastest` swaps the grid's axes (N blocks along axis 0, which CUDA starts first): the same
    output bit for bit, rows gathered or written back in slot order; where the M blocks would exceed the
    grid's second axis, the launch keeps M first."""
    gen = torch.Generator().manual_seed(12)
    e, n, k, tokens = 5, 160, 96, 70
    element_bytes = 1 if operand == "fp8" else 2
    w, a = torch.randn(e, n, k, generator=gen), torch.randn(tokens, k, generator=gen)
    if operand == "fp8":
        w, a = (w * 8).to(torch.float8_e4m3fn), (a * 8).to(torch.float8_e4m3fn)
        scales = (torch.rand(tokens, generator=gen) + 0.5, torch.rand(e, n, generator=gen) + 0.5)
    else:
        w, a, scales = w.bfloat16(), a.bfloat16(), (None, None)
    routing = sl.expert_order(torch.randint(0, e, (tokens, 2), generator=gen), e)
    m_first = Tile(block_m=16, block_n=64, block_k=128 // element_bytes, num_warps=4, num_stages=3)
    n_first = m_first.model_copy(update={"n_fastest": True})
    assert n_first.short() == m_first.short() + " n-first"
    grids = []
    real = moe._kernel()

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(moe, "_kernel", lambda: Spy())
    for args in ((a, scales[0], routing.token_of), (a[routing.token_of], None if scales[0] is None else scales[0][routing.token_of], None)):  # fmt: skip
        for out_rows in (None, routing.order):
            tail = (w, scales[1], routing.offs, out_rows)
            torch.testing.assert_close(moe.launch(n_first, *args, *tail), moe.launch(m_first, *args, *tail),
                                       rtol=0, atol=0)  # fmt: skip
    m_blocks = -(-tokens * 2 // 16) + e
    assert grids[:2] == [(3, m_blocks), (m_blocks, 3)]
    monkeypatch.setattr(moe, "GRID_Y_MAX", m_blocks - 1)
    moe.launch(n_first, a, scales[0], routing.token_of, w, scales[1], routing.offs)
    assert grids[-1] == (m_blocks, 3)


@interpreted
def test_a_table_that_cannot_be_read_stops_the_load_naming_it(tmp_path, monkeypatch):
    """Not a quiet fallback: the probe reads the table to run its tiles, and a malformed one would otherwise
    count as the kernel failing (bf16 experts on sm120: torch's per-expert loop, no CUDA graphs)."""
    from pipeline.runtime import gpu_load
    from pipeline.runtime.probe import Probe
    from tests._utils.tiny import build_tiny

    (tmp_path / "NVIDIA_RTX_PRO_6000-bf16.yaml").write_text("device: [unclosed")
    monkeypatch.setattr(
        moe_tiles,
        "table_and_path",
        lambda device, op: moe_tiles.find_table("NVIDIA RTX PRO 6000", op, [tmp_path]),
    )
    with pytest.raises(moe_tiles.TileTableError, match=r"NVIDIA_RTX_PRO_6000-bf16\.yaml is not valid"):
        gpu_load.route_float_experts(build_tiny(torch.bfloat16), CPU, Probe("sm120"), None)


@interpreted
def test_a_table_tile_that_fails_the_probe_names_the_table_to_delete(tmp_path, monkeypatch):
    """A default tile failing is the kernel's fault (its fallback); a measured table's tile failing is the
    table's (another Triton build): the probe's message names that file and the fix."""
    from pipeline.runtime.probe import gemm

    odd = Tile(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=2)
    path = tmp_path / "NVIDIA_H200-fp8.yaml"
    table = _table().model_copy(update={"shapes": [ShapeTiles(n=384, k=320, tiles={16: odd})]})
    monkeypatch.setattr(
        moe_tiles, "table_and_path", lambda device, op: (table, path) if op == "fp8" else None
    )
    real = moe.launch

    def failing_at(tile, error):
        def launch(t, *a):
            if t != tile:
                return real(t, *a)
            if error:
                raise RuntimeError("out of resource: shared memory")
            return real(t, *a).flip(0)

        return launch

    monkeypatch.setattr(moe, "launch", failing_at(odd, error=True))
    with pytest.raises(DgpipeError, match=rf"at {odd.short()} of tiles from {re.escape(str(path))} .* does not run here: "
                                          "RuntimeError: out of resource") as e:  # fmt: skip
        gemm.check_triton_fp8("fp8", "fp8", CPU)
    assert "delete that table" in e.value.hint
    monkeypatch.setattr(moe, "launch", failing_at(odd, error=False))
    with pytest.raises(
        DgpipeError, match=rf"\({odd.short()} tiles of tiles from {re.escape(str(path))} .*\) differs"
    ) as e:
        gemm.check_triton_fp8("fp8", "fp8", CPU)
    assert "delete that table" in e.value.hint
    default = moe.default_tiles(1)[0]
    monkeypatch.setattr(moe, "launch", failing_at(default, error=True))
    with pytest.raises(RuntimeError, match="out of resource"):  # a default tile: the kernel's own failure
        gemm.check_triton_fp8("fp8", "fp8", CPU)
