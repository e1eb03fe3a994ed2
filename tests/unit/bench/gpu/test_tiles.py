"""`dgpipe bench moe-tiles` (`pipeline.bench.gpu.tiles`): which tiles it tries and in what order, how it
picks and rejects them, and the files it writes, run on Triton's interpreter with a stand-in timer (the
times themselves come from a GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.bench.gpu import tiles
from pipeline.errors import DgpipeError
from pipeline.runtime.kernels import moe, moe_tiles
from pipeline.runtime.kernels.moe_tiles import Tile
from tests._utils.interpreter_casts import interpreted

CPU = torch.device("cpu")


def test_candidates_start_with_the_defaults_then_one_change_and_fit_shared_memory():
    ada = tiles.candidates(1, 99 * 1024)  # FP8 on sm89 / sm120: 99 KB a block
    defaults = [moe.default_tile(m * 128, 128, 1) for m in (8, 16, 64)]  # 16-, 32- and 64-row M tiles
    assert ada[:3] == defaults == moe.default_tiles(1) and len(set(ada)) == len(ada)
    assert all(t.shared_bytes(1) <= 99 * 1024 for t in ada)
    differs = [min(sum(a != b for a, b in zip(t.model_dump().values(), d.model_dump().values())) for d in defaults)
               for t in ada]  # fmt: skip
    assert differs == sorted(differs) and differs[3] == 1
    hopper = tiles.candidates(1, 227 * 1024)
    assert (
        set(ada) < set(hopper)
        and Tile(block_m=128, block_n=256, block_k=128, num_warps=8, num_stages=4) in hopper
    )
    # its accumulator, 256 fp32 registers a thread on 4 warps, would spill: not a candidate
    assert Tile(block_m=128, block_n=256, block_k=128, num_warps=4, num_stages=4) not in hopper
    assert max(map(tiles.accumulator_registers, hopper)) == tiles.MAX_ACCUMULATOR_REGISTERS == 128
    assert (len(ada), len(hopper)) == (228, 362)
    bf16 = tiles.candidates(2, 99 * 1024)
    assert {t.block_k for t in bf16} == {32, 64, 128} and all(t.shared_bytes(2) <= 99 * 1024 for t in bf16)


def _problems(operand: str = "fp8"):
    shapes = tiles.gemm_shapes(hidden=64, moe_intermediate=48)
    assert [(s.name, s.n, s.k) for s in shapes] == [("gate_up", 96, 64), ("down", 64, 48)]
    return tiles.problems(shapes, (1, 2), canvas=16, experts=4, top_k=2, operand=operand, dev=CPU)


@interpreted
def test_the_fastest_tile_per_problem_wins_and_wrong_or_failing_tiles_are_rejected(monkeypatch):
    probs = _problems()
    assert [(p.shape.name, p.canvases, p.slots / p.experts) for p in probs] == [
        ("gate_up", 1, 8.0), ("down", 1, 8.0), ("gate_up", 2, 16.0), ("down", 2, 16.0)
    ]  # fmt: skip
    first, fast, wrong, broken, slow = (
        moe.default_tile(8 * 4, 4, 1),
        Tile(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=3),
        Tile(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3),
        Tile(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3),
        Tile(block_m=16, block_n=256, block_k=64, num_warps=4, num_stages=3),
    )
    real = moe.launch

    def launch(tile, a, a_scale, rows, *rest):
        if tile == broken:
            raise RuntimeError("out of resource: shared memory")
        if tile == wrong and rows is not None:
            rows = rows.flip(0)
        return real(tile, a, a_scale, rows, *rest)

    monkeypatch.setattr(moe, "launch", launch)
    ms = {first: 2.0, fast: 1.0, slow: 3.0}
    current = []
    timer = lambda fn: ms[current[0]]
    spy = lambda tile, *a: (current.clear(), current.append(tile), launch(tile, *a))[-1]
    monkeypatch.setattr(moe, "launch", spy)
    found = tiles.tune(probs, [first, fast, wrong, broken, slow], deadline=float("inf"), time_ms=timer)
    assert [t for t, _ in found["timed"]] == [first, fast, slow]
    assert [(t, why.split(":")[0]) for t, why in found["rejected"]] == [
        (wrong, "DgpipeError"),
        (broken, "RuntimeError"),
    ]
    assert "gate_up at 1 canvases differs from the float product by" in found["rejected"][0][1]
    with pytest.raises(DgpipeError, match="differs from the float product"):  # the first: the kernel is wrong
        tiles.tune(probs, [wrong, first], deadline=float("inf"), time_ms=timer)
    table, rows = tiles.best_table(probs, found["timed"], "cpu", "fp8", 1)
    assert {r["best"] for r in rows} == {fast.short()}
    assert [r["default_ms"] for r in rows] == [
        2.0,
        2.0,
        None,
        None,
    ]  # 16 rows per expert: 32-row default, untimed
    assert "| 16x64x64 w4 s3 | 1.000 | - |" in tiles.render_rows(rows)[-1]
    assert table.pick(96, 64, 8) == fast and table.pick(64, 48, 16) == fast
    assert sorted(table.shapes[0].tiles) == [8, 16]


@interpreted
def test_the_climb_reaches_a_tile_several_settings_from_the_defaults_timing_a_fraction_of_the_grid(
    monkeypatch,
):
    """Each round times the tiles one setting away from each problem's fastest so far: with times that fall
    toward a tile three settings from the nearest default, the climb ends there."""
    grid = tiles.candidates(1, 227 * 1024)
    target = Tile(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4, n_fastest=True)
    assert target in grid and min(tiles.changes(target, d) for d in moe.default_tiles(1)) == 3
    monkeypatch.setattr(moe, "launch", lambda tile, *a: current.__setitem__(0, tile) or torch.zeros(1))
    monkeypatch.setattr(tiles, "reference", lambda p: torch.zeros(1))
    current = [None]
    timer = lambda fn: (fn(), 1.0 + tiles.changes(current[0], target))[1]
    probs = _problems()
    found = tiles.tune(probs, moe.default_tiles(1), float("inf"), timer, neighbours=tiles.one_change(grid))
    timed = [t for t, _ in found["timed"]]
    table, _ = tiles.best_table(probs, found["timed"], "cpu", "fp8", 1)
    assert table.pick(96, 64, 16) == target and len(timed) < len(grid) / 3 and not found["rejected"]
    assert len(timed) == len(set(timed))  # no tile timed twice


@interpreted
def test_past_the_deadline_only_the_default_tiles_still_run():
    probs = _problems("bf16")
    defaults = {moe.default_tile(p.slots, p.experts, 2) for p in probs}
    extra = Tile(block_m=16, block_n=64, block_k=32, num_warps=4, num_stages=3)
    found = tiles.tune(probs, [*defaults, extra], deadline=0.0, time_ms=lambda fn: 1.0)
    assert {t for t, _ in found["timed"]} == defaults and not found["rejected"]


@interpreted
def test_a_run_writes_a_table_dgpipe_reads_back(tmp_path, monkeypatch):
    """On the embedded model's expert shapes, in the interpreter: the JSON, the markdown, and the table,
    installed where this host's dgpipe finds it."""
    monkeypatch.setenv("DGPIPE_CACHE", str(tmp_path / "cache"))
    install = tmp_path / "cache" / moe_tiles.TABLE_DIR
    result = tiles.run_moe_tiles(tmp_path / "out", "fp8", "sudoku-tiny", budget_s=1e-3, canvases=(1,),
                                 install_dir=install, device=CPU, time_ms=lambda fn: 1.0)  # fmt: skip
    assert result["timed"] >= 1 and result["candidates"] == len(tiles.candidates(1, 99 * 1024))
    saved = json.loads((tmp_path / "out" / tiles.RESULT_FILE).read_text())
    assert saved["rows"] == result["rows"] and [r["shape"] for r in saved["rows"]] == ["gate_up", "down"]
    md = (tmp_path / "out" / tiles.TABLE_FILE).read_text()
    assert "| gate_up [192, 96] | 1 |" in md and "| 1.000 | 1.00 | - | - |" in md
    # torch's grouped FP8 GEMM runs on CUDA only: not timed, and no crossover in the table
    assert result["vendor_error"] and result["triton_rows"] is None and "grouped GEMM not timed" in md
    assert f"| 1 | {2 * result['layers']:.2f} | {2 * result['layers']:.2f} | - |" in md
    found, path = moe_tiles.find_table("cpu (interpreted)", "fp8")
    assert path == install / "cpu_interpreted-fp8.yaml" and (tmp_path / "out" / path.name).is_file()
    rows_per_expert = result["rows"][0]["rows_per_expert"]
    assert found.pick(192, 96, rows_per_expert) == moe.default_tile(round(rows_per_expert * 4), 4, 1)


@interpreted
def test_torchs_grouped_gemm_is_timed_on_the_same_operands_and_sets_the_crossover(monkeypatch):
    """torch's grouped GEMM computes the float product of the problem's operands (bf16 `F.grouped_mm`,
    here on the CPU), its ms go in the table beside the best tile's, and the table's crossover follows."""
    probs = _problems("bf16")
    for p in probs:
        got = tiles.vendor_gemm(p)().float()
        want = tiles.reference(p)
        if p.args[-1] is not None:  # the down GEMM: torch's rows stay in expert order
            want = want.index_select(0, p.args[-1])
        assert float((got - want).norm() / want.norm()) < 2**-7
    marks = []
    monkeypatch.setattr(tiles, "vendor_gemm", lambda p: lambda: marks.append(p.canvases))
    vendor = tiles.time_vendor(probs, time_ms=lambda fn: (fn(), {1: 5.0, 2: 0.5}[marks[-1]])[1])
    assert vendor == {"ms": [5.0, 5.0, 0.5, 0.5], "error": None}
    defaults = list(dict.fromkeys(moe.default_tile(p.slots, p.experts, 2) for p in probs))
    found = tiles.tune(probs, defaults, deadline=0.0, time_ms=lambda fn: 1.0)
    table, rows = tiles.best_table(probs, found["timed"], "cpu", "bf16", 2, vendor["ms"])
    assert [r["vendor_ms"] for r in rows] == vendor[
        "ms"
    ] and table.triton_rows() == 8.0  # 16 rows: torch wins
    assert tiles.render_rows(rows)[-1].endswith("| 1.000 | 1.00 | 0.500 | 0.50 |")
    # a whole pass: both GEMMs per layer, every layer
    assert tiles.per_pass(rows, layers=30) == [
        {"canvases": 1, "default_ms": 60.0, "best_ms": 60.0, "vendor_ms": 300.0},
        {"canvases": 2, "default_ms": 60.0, "best_ms": 60.0, "vendor_ms": 30.0},
    ]
    assert tiles.render_per_pass(rows, 30)[-1] == "| 2 | 60.00 | 60.00 | 30.00 |"


@pytest.mark.parametrize(
    ("args", "says"),
    [((), "needs a CUDA GPU: tiles are timed on the GPU model that will use them"),
     (("--operand", "int4"), "--operand must be fp8 or bf16 (got 'int4')"), (("--budget-s", "0"), "--budget-s must be > 0")],
)  # fmt: skip
def test_the_command_says_what_is_wrong_in_one_line(monkeypatch, capsys, tmp_path, args, says):
    import sys

    from pipeline.cli import main

    monkeypatch.setattr(sys, "argv", ["dgpipe", "bench", "moe-tiles", "--out", str(tmp_path), *args])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert (
        e.value.code == 2 and err.startswith("error: ") and says in err and len(err.strip().splitlines()) == 1
    )


def test_bench_gpus_table_shows_the_tuned_tiles_beside_torchs_grouped_gemm():
    from dataclasses import asdict

    from pipeline.bench.gpu import checks, report

    row = {"shape": "down", "n": 2816, "k": 704, "canvases": 16, "rows_per_expert": 256.0, "default": "64x128x128 w4 s4",
           "default_ms": 0.5, "best": "128x128x128 w8 s3", "best_ms": 0.25, "vendor_ms": 1.0, "layers": 30}  # fmt: skip
    check = {
        "name": "MoE GEMM tiles",
        "status": "passed",
        "seconds": 30.0,
        "budget_s": 30,
        "detail": "",
        "rows": [row],
    }
    env = asdict(checks.Env(cuda=True, gpu="NVIDIA H200", arch="sm90", memory_gib=140, torch="2.11"))
    md = report.render({"env": env, "dry_run": False, "checks": [check]})
    want = "| down [2816, 704] | 16 | 256 | 64x128x128 w4 s4 | 0.500 | 128x128x128 w8 s3 | 0.250 | 2.00 | 1.000 | 4.00 |"
    assert want in md.splitlines() and md.splitlines()[-1] == "| 16 | 15.00 | 7.50 | 30.00 |"
    assert tiles.render_rows([{**row, "default_ms": None, "vendor_ms": None}])[-1].endswith(
        "| 128x128x128 w8 s3 | 0.250 | - | - | - |"
    )
    assert tiles.render_rows([]) == []


@interpreted
def test_a_run_stopped_mid_climb_leaves_the_table_of_the_tiles_it_timed(tmp_path):
    """Killed by its budget (here interrupted at the fifth tile's first timing): once the defaults are
    timed, the table, the JSON and the markdown are written after every tile, marked incomplete, and the
    rows handed on are those of the table on disk."""
    shapes = 2  # gate|up and down, one canvas
    defaults = len(moe.default_tiles(1))
    calls, handed = [], []

    def timer(fn):  # each tile a little faster than the last; the fifth never finishes
        calls.append(1)
        if len(calls) > (defaults + 1) * shapes:
            raise KeyboardInterrupt
        return 10.0 - len(calls) / 10

    out, install = tmp_path / "out", tmp_path / "cache" / "moe_tiles"
    install.mkdir(parents=True)
    (install / "cpu_interpreted-fp8.yaml").write_text("the table a finished run installed")
    with pytest.raises(KeyboardInterrupt):
        tiles.run_moe_tiles(out, "fp8", "sudoku-tiny", budget_s=1e6, canvases=(1,), device=CPU, time_ms=timer,
                            on_result=handed.append, install_dir=install)  # fmt: skip
    # what every later load reads is replaced by a finished run alone
    assert (install / "cpu_interpreted-fp8.yaml").read_text() == "the table a finished run installed"
    saved = json.loads((out / tiles.RESULT_FILE).read_text())
    assert saved["complete"] is False and saved["timed"] == defaults + 1 and len(handed) == 2
    assert handed[-1]["rows"] == saved["rows"] and [r["best_ms"] for r in saved["rows"]] == [9.3, 9.2]
    assert saved["rows"][0]["best"] != saved["rows"][0]["default"]  # the climb's first tile, faster
    table = moe_tiles.read_table(out / "cpu_interpreted-fp8.yaml")
    assert table == moe_tiles.TileTable.model_validate(saved["table"])
    assert "stopped before the end" in (out / tiles.TABLE_FILE).read_text()


@interpreted
def test_the_partial_table_is_saved_once_every_default_was_tried_even_if_the_last_was_rejected():
    """`tune`'s `on_timed` fires when the given tiles are through, whatever the last one's fate, then after
    every tile timed; never before the defaults are all tried (a table of some of them could be slower)."""
    probs = _problems("fp8")
    defaults = moe.default_tiles(1)
    last, extra = defaults[-1], defaults[0].model_copy(update={"num_stages": 2})
    seen = []
    real = moe.launch

    def launch(tile, *a, **k):
        if tile == last:
            raise RuntimeError("out of resource: shared memory")
        return real(tile, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "launch", launch)
        tiles.tune(probs, defaults, float("inf"), lambda fn: 1.0, neighbours=lambda t: [extra],
                   on_timed=lambda timed, rejected: seen.append((len(timed), len(rejected))))  # fmt: skip
    assert seen == [(len(defaults) - 1, 1), (len(defaults), 1)]
