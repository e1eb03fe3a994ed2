"""`dgpipe bench gpu`: the plan (what runs where, and why not), the time budget, the result files and the
table. The GPU checks themselves run on a GPU host (tests/gpu and the pass measurements)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from pipeline.bench.gpu import checks, report

H200 = checks.Env(
    True, "NVIDIA H200", "sm90", 139.8, "580.65", "2.11.0+cu130", "13.0", True, True, True, True, cxx=True
)


def test_checks_fit_the_eight_minute_budget_by_construction():
    assert sum(c.budget_s for c in checks.CHECKS) <= checks.TOTAL_BUDGET_S - checks.END_MARGIN_S
    assert checks.TOTAL_BUDGET_S == 480
    names = [c.name for c in checks.CHECKS]
    assert names[:2] == ["build sampler kernels", "gpu tests"]
    # the quantized passes run after the tiles are tuned, so they launch with this GPU's table
    assert names.index("26B pass bf16") < names.index(checks.TILES_CHECK) < names.index("26B pass fp8")


@pytest.mark.parametrize("tiles_end", ["passes", "killed after writing", "fails writing none"])
def test_the_checks_after_the_tiles_check_launch_with_the_table_it_measured(tmp_path, monkeypatch, tiles_end):
    """They find `--out`/moe_tiles first ($DGPIPE_MOE_TILES, absolute: the checks run from the repository
    root), also where the tiles check was killed at its budget after writing its table (it writes as it
    climbs); the checks before it, and every check after a tiles check that wrote no table, use whatever
    table this host has: never one an earlier run left in `--out`."""
    say = "import os; print(os.environ.get('DGPIPE_MOE_TILES', 'unset'))"
    write = ("import os, pathlib, time; d = pathlib.Path(os.environ['DGPIPE_GPU_OUT']) / 'moe_tiles'; "
             "d.mkdir(exist_ok=True); (d / 'NVIDIA_H200-fp8.yaml').write_text('measured')")  # fmt: skip
    code = {
        "passes": write,
        "killed after writing": write + "; time.sleep(60)",
        "fails writing none": "exit(1)",
    }
    tiles = checks.GpuCheck(checks.TILES_CHECK, 3, "tunes", ("-c", code[tiles_end]), ())
    before, after = (checks.GpuCheck(name, 1, "says", ("-c", say), ()) for name in ("before", "after"))
    monkeypatch.setattr(checks, "CHECKS", (before, tiles, after))
    monkeypatch.setattr(checks, "detect_env", lambda: checks.Env(cuda=False, gpu="NVIDIA H200", torch="2.13"))
    monkeypatch.delenv("DGPIPE_MOE_TILES", raising=False)
    monkeypatch.chdir(tmp_path)
    tables = tmp_path / "out" / "moe_tiles"
    tables.mkdir(parents=True)
    (tables / "NVIDIA_H200-fp8.yaml").write_text("an earlier run's")
    (tables / "NVIDIA_B200-fp8.yaml").write_text("another GPU's: kept")
    ran = checks.run_bench_gpu(Path("out"))["checks"]
    assert ran[0]["detail"] == "unset"
    wrote = tiles_end != "fails writing none"
    assert ran[2]["detail"] == (str(tables) if wrote else "unset")
    assert sorted(p.name for p in tables.iterdir()) == ["NVIDIA_B200-fp8.yaml"] + (
        ["NVIDIA_H200-fp8.yaml"] if wrote else []
    )
    assert (tables / "NVIDIA_H200-fp8.yaml").read_text() == "measured" if wrote else True
    if tiles_end == "killed after writing":
        assert ran[1]["status"] == "timeout"
        assert ran[1]["detail"].startswith("its table of the tiles timed before it stopped (")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU plan: every GPU test skips")
def test_the_gpu_tests_spread_over_processes_where_pytest_xdist_is(monkeypatch):
    """The check runs `python -m pipeline.bench.gpu.measure tests`: tests/gpu over `GPU_TEST_WORKERS` processes with
    pytest-xdist (here: every test collected and skipped, no GPU), in one process without it."""
    check = next(c for c in checks.CHECKS if c.name == "gpu tests")
    run = subprocess.run([sys.executable, *check.argv], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"created: {checks.GPU_TEST_WORKERS}/{checks.GPU_TEST_WORKERS} workers" in run.stdout
    assert " skipped" in run.stdout.splitlines()[-1] and " passed" not in run.stdout.splitlines()[-1]
    monkeypatch.setattr(checks, "_has", lambda module: module != "xdist")
    assert "-n" not in checks.gpu_test_args() and checks.gpu_test_args()[-1] == "tests/gpu"


def test_skip_reasons_per_host():
    by = lambda env: {c.name: checks.skip_reason(c, env) for c in checks.CHECKS}
    h200 = by(H200)
    assert [n for n, r in h200.items() if r] == ["26B pass nvfp4"]
    assert "no FP4 tensor cores" in h200["26B pass nvfp4"]
    assert not any(by(replace(H200, gpu="NVIDIA B200", arch="sm100", memory_gib=179)).values())
    l40s = by(replace(H200, arch="sm89", memory_gib=44.4))
    assert "44 GiB GPU memory < 68 GiB" in l40s["26B pass bf16"] and l40s["build sampler kernels"] is None
    assert (
        by(replace(H200, nvcc=False))["build sampler kernels"] == "nvcc not found (install the CUDA toolkit)"
    )
    assert by(replace(H200, pytest=False))["gpu tests"] == "pytest not found (pip install pytest)"
    # every missing need at once: one dry run says all there is to install
    assert by(replace(H200, nvcc=False, cxx=False, ninja=False))["build sampler kernels"] == (
        "nvcc not found (install the CUDA toolkit); c++ not found (install a host C++ compiler (g++), or set "
        "$CXX); ninja not found (pip install ninja)"
    )
    # an installed wheel has no tests: the GPU tests skip, the measurements still run
    wheel = by(replace(H200, gpu_tests=False))
    assert (
        wheel["gpu tests"]
        == "tests/gpu not found (they come with a source checkout: git clone, then pip install -e .)"
    )
    assert [n for n, r in wheel.items() if r] == ["gpu tests", "26B pass nvfp4"]
    assert checks.detect_env().gpu_tests  # this checkout has them
    cpu = by(
        checks.Env(False, torch="2.13.0+cpu", nvcc=True, cxx=True, ninja=True, pytest=True, gpu_tests=True)
    )
    # off a GPU: no CUDA, and nothing said of a GPU's features
    assert set(cpu.values()) == {"no CUDA GPU visible (torch 2.13.0+cpu, CUDA build none)"}
    bare = by(checks.Env(False, torch="2.13.0+cpu"))
    assert bare["gpu tests"] == (
        "no CUDA GPU visible (torch 2.13.0+cpu, CUDA build none); pytest not found (pip install pytest); "
        "tests/gpu not found (they come with a source checkout: git clone, then pip install -e .)"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU plan")
@pytest.mark.parametrize("dry_run", [True, False])
def test_cpu_run_lists_every_check_and_writes_json_and_table(tmp_path, dry_run):
    result = checks.run_bench_gpu(tmp_path, dry_run=dry_run)
    saved = json.loads((tmp_path / checks.RESULT_FILE).read_text())
    assert [c["name"] for c in saved["checks"]] == [c.name for c in checks.CHECKS]
    assert all(c["status"] == "skipped" and c["detail"].startswith("no CUDA") for c in saved["checks"])
    # what else each check needs is named where this machine lacks it (the CI images have a C++ compiler)
    (build,) = [c for c in saved["checks"] if c["name"] == "build sampler kernels"]
    assert ("nvcc not found" in build["detail"]) == (saved["env"]["nvcc"] is False)
    table = (tmp_path / checks.TABLE_FILE).read_text()
    assert table == report.render(result) + "\n" and table.count("| skipped |") == len(checks.CHECKS)


def test_a_check_is_killed_at_its_budget_and_failures_keep_their_output(tmp_path):
    code = "import sys, time; print('started'); print('warned', file=sys.stderr); time.sleep(30)"
    slow = checks.GpuCheck("slow", 1, "sleeps", ("-c", code), ())
    res = checks._run(slow, tmp_path, tmp_path)
    assert res.status == "timeout" and res.seconds < 10
    assert res.log.splitlines() == ["started", "warned"]  # what it wrote to either stream before the kill
    bad = checks.GpuCheck("bad", 30, "fails", ("-c", "import sys; print('boom'); sys.exit(3)"), ())
    res = checks._run(bad, tmp_path, tmp_path)
    assert (res.status, res.detail) == ("failed", "boom")
    rows = checks.GpuCheck(
        "rows",
        30,
        "rows",
        ("-c", "import json, os; open(os.environ['DGPIPE_GPU_ROWS'], 'w').write(json.dumps([{'a': 1}]))"),
        (),
    )
    assert checks._run(rows, tmp_path, tmp_path).rows == [{"a": 1}]


def test_a_kill_at_the_budget_ends_what_the_check_started_and_any_bytes_are_read(tmp_path):
    """pytest-xdist's workers or nvcc, started by a check, would run on beside the next check: the kill takes
    the check's whole process group. And output that is not UTF-8 is read with replacements, not a crash
    that would end the run."""
    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(60)")  # fmt: skip
    res = checks._run(checks.GpuCheck("spawns", 2, "spawns", ("-c", code), ()), tmp_path, tmp_path)
    assert res.status == "timeout" and res.log == "started"
    status = Path(f"/proc/{pid_file.read_text()}/status")
    time.sleep(0.2)
    assert not status.exists() or "State:\tZ" in status.read_text()  # gone, or a zombie awaiting its reaper
    raw = ("-c", "import sys; sys.stdout.buffer.write(b'ok \\xff\\n')")
    res = checks._run(checks.GpuCheck("bytes", 30, "bytes", raw, ()), tmp_path, tmp_path)
    assert (res.status, res.detail) == ("passed", "ok \ufffd")


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" not in status.read_text()


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_a_bench_stopped_from_outside_kills_the_running_check_and_keeps_what_it_measured(tmp_path, how):
    """A runner's limit (`timeout`'s SIGTERM) or Ctrl-C stops the bench while a check runs: the check, in a
    process group of its own that the signal does not reach, is killed too (on a GPU it would hold its
    memory, and the next command on the host run out), and its rows so far are in gpu.json, marked
    interrupted. Before, the check ran on and its rows were lost."""
    import os
    import signal

    pid_file, out = tmp_path / "check.pid", tmp_path / "out"
    measures = ("import json, os, time; open(os.environ['DGPIPE_GPU_ROWS'], 'w').write(json.dumps([{'largest_batch': 128}])); "
                f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)")  # fmt: skip
    driver = tmp_path / "driver.py"
    driver.write_text(  # Ctrl-C raises KeyboardInterrupt, as in a terminal (a background job ignores SIGINT)
        "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from pathlib import Path\nfrom pipeline.bench.gpu import checks\n"
        f"checks.CHECKS = (checks.GpuCheck('largest batch', 120, 'measures, then runs on', ('-c', {measures!r}), ()),)\n"
        "checks.detect_env = lambda: checks.Env(cuda=False, torch='2.13')\n"
        f"checks.run_bench_gpu(Path({str(out)!r}))\n"
    )  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(Path(checks.__file__).parents[3]))
    bench = subprocess.Popen([sys.executable, str(driver)], env=env, start_new_session=True)
    deadline = time.monotonic() + 60
    while not pid_file.is_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.3)  # the pid written, the check asleep
    os.killpg(
        bench.pid, signal.SIGTERM if how == "SIGTERM" else signal.SIGINT
    )  # as `timeout` / a terminal do
    assert bench.wait(timeout=30) != 0
    time.sleep(0.2)
    assert not _alive(int(pid_file.read_text()))
    (check,) = json.loads((out / checks.RESULT_FILE).read_text())["checks"]
    assert check["status"] == "interrupted" and check["rows"] == [{"largest_batch": 128}]


def test_a_killed_checks_output_is_read_for_a_bounded_time(tmp_path, monkeypatch):
    """A process that left the check's group but kept its output open (one started in a session of its own)
    cannot hold the run past the check's budget and `STOP_WAIT_S`."""
    monkeypatch.setattr(checks, "STOP_WAIT_S", 1.0)
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(20)'], "
            "start_new_session=True); print('started', flush=True); time.sleep(60)")  # fmt: skip
    t0 = time.monotonic()
    res = checks._run(checks.GpuCheck("escapes", 1, "leaves a sleeper", ("-c", code), ()), tmp_path, tmp_path)
    assert res.status == "timeout" and res.log == "started" and time.monotonic() - t0 < 6


def test_a_killed_checks_overrun_is_taken_from_the_next_checks_budget(tmp_path, monkeypatch):
    """A check killed at its budget takes a moment more to end (the kill, its teardown): the checks after it
    get that much less, so the command stays within the budgets' sum."""
    first, second = (checks.GpuCheck(name, 30, "runs", ("-c", "pass"), ()) for name in ("first", "second"))
    budgets: list[int] = []

    def run(check, repo, scratch, budget_s, out, tile_tables):
        budgets.append(budget_s)
        return checks.CheckResult(check.name, check.what, budget_s, "timeout", seconds=budget_s + 4.0)

    monkeypatch.setattr(checks, "CHECKS", (first, second))
    monkeypatch.setattr(checks, "detect_env", lambda: checks.Env(cuda=False, torch="2.13"))
    monkeypatch.setattr(checks, "_run", run)
    checks.run_bench_gpu(tmp_path)
    assert budgets == [30, 26]


def test_time_a_check_leaves_goes_to_the_next_within_the_total(tmp_path, monkeypatch):
    """A skipped check's budget and what a quick check leaves go to the checks after it, so a check that
    needs more than its own budget (the GPU tests, as kernels are added) still finishes, and the command
    still ends within the budgets' sum."""
    quick = checks.GpuCheck("quick", 20, "returns at once", ("-c", "pass"), ())
    skipped = checks.GpuCheck("skipped", 7, "needs a GPU", ("-c", "pass"), ("cuda",))
    code = "import time; time.sleep(3); print('done')"
    slow = checks.GpuCheck("slow", 2, "needs 3 s of its 2", ("-c", code), ())
    monkeypatch.setattr(checks, "CHECKS", (skipped, quick, slow))
    monkeypatch.setattr(checks, "detect_env", lambda: checks.Env(cuda=False, torch="2.13"))
    ran = checks.run_bench_gpu(tmp_path)["checks"]
    assert [c["status"] for c in ran] == ["skipped", "passed", "passed"]
    assert ran[1]["budget_s"] == 20 + 7 and ran[2]["detail"] == "done"
    assert 2 + 7 < ran[2]["budget_s"] <= 2 + 27 and sum(c["seconds"] for c in ran) <= 29


def test_a_passed_measurement_says_what_it_measured_in_the_checks_table(tmp_path, monkeypatch):
    """Its detail is its rows in one line (a pass's output ends with warnings or JSON); a failed check keeps
    its output's last line."""
    rows = [{"format": "fp8", "largest_batch": 128, "tried_up_to": 256}]
    code = (
        f"import json, os; open(os.environ['DGPIPE_GPU_ROWS'], 'w').write({json.dumps(rows)!r}); print(']')"
    )
    measured = checks.GpuCheck("largest batch", 20, "rows", ("-c", code), ())
    failed = checks.GpuCheck(
        "failed", 20, "rows, then a fault", ("-c", code + "; raise SystemExit('boom')"), ()
    )
    monkeypatch.setattr(checks, "CHECKS", (measured, failed))
    monkeypatch.setattr(checks, "detect_env", lambda: checks.Env(cuda=False, torch="2.13"))
    ran = checks.run_bench_gpu(tmp_path)["checks"]
    assert [c["detail"] for c in ran] == ["largest fp8 batch that fits: 128", "]\nboom"]
    passes = [{"batch": 1, "ms_eager": 30.0, "ms_graph": 7.44, "floor_ms_spec": 6.2},
              {"batch": 16, "ms_eager": 60.0, "ms_graph": float("nan"), "floor_ms_spec": 13.2, "compute_ms_spec": 26.0}]  # fmt: skip
    assert report.summary(passes) == "batch 1: 7.4 ms, 1.20x floor; batch 16: 60.0 ms, 2.31x floor"
    tag = {
        "layers": 30,
        "timed": 40,
        "candidates": 362,
        "triton_rows": 256.0,
        "table_file": "out/moe_tiles/H200-fp8.yaml",
    }
    tiles = [{**tag, "canvases": c, "default_ms": d, "best_ms": b, "vendor_ms": v}
             for c, d, b, v in ((1, 0.2, 0.1, 0.3), (1, 0.1, 0.1, 0.1), (16, 1.0, 0.5, None), (16, 1.0, 0.5, 2.0))]  # fmt: skip
    assert report.summary(tiles) == (
        "40 of 362 tiles timed; expert GEMMs per pass, ms by canvases, default -> tuned: 1: 9.0 -> 6.0 (torch 12.0), "
        "16: 60.0 -> 30.0 (torch -); Triton up to 256 rows per expert; out/moe_tiles/H200-fp8.yaml"
    )
    assert report.summary([]) == ""


def test_a_pass_stopped_before_its_times_says_where():
    """A pass check killed at its budget leaves the row its measurement wrote as the batch's first call began
    or ended: the table and the summary say which, and what the first call took."""
    started = {"format": "fp8 compiled", "batch": 1, "kernels": "k"}
    check = {
        "name": "26B pass fp8 compiled",
        "status": "timed out",
        "seconds": 100.0,
        "budget_s": 100,
        "detail": "",
    }
    for row, where in (({**started, "first_call_s": None}, "in its first call (under torch.compile: the compile)"),
                       ({**started, "first_call_s": 93.46, "finite": True}, "after its first call, which took 93.5 s")):  # fmt: skip
        md = report.render({"env": asdict(H200), "dry_run": False, "checks": [{**check, "rows": [row]}]})
        assert f"The fp8 compiled pass at batch 1 stopped {where} (k)." in md
        assert "| format | batch |" not in md  # no times: no row in the passes' table
        assert report.summary([row]) == f"batch 1: stopped {where}"


def test_table_shows_each_pass_against_its_floor():
    row = {"format": "fp8", "batch": 1, "kernels": "k", "ms_eager": 9.0, "ms_graph": 7.44, "floor_ms_spec": 6.2,
           "floor_ms_copy": 7.0}  # fmt: skip
    result = {"env": asdict(H200), "dry_run": False, "checks": [
        {"name": "26B pass fp8", "status": "passed", "seconds": 40.0, "budget_s": 55, "detail": "", "rows": [row]},
        {"name": "largest batch", "status": "passed", "seconds": 30.0, "budget_s": 50, "detail": "",
         "rows": [{"format": "fp8", "largest_batch": 64, "tried_up_to": 128}]}]}  # fmt: skip
    md = report.render(result)
    assert "GPU: NVIDIA H200 (sm90, 140 GiB), driver 580.65, torch 2.11.0+cu130 (CUDA 13.0)" in md
    assert (
        "| fp8 | 1 | k | 9.00 | 7.44 | 6.20 | — | 1.20 | 7.00 |" in md
    )  # a run from before the compute floor
    row16 = {**row, "batch": 16, "ms_graph": 52.0, "floor_ms_spec": 13.2, "compute_ms_spec": 26.0}
    md16 = report.render({**result, "checks": [{**result["checks"][0], "rows": [row16]}]})
    assert "| fp8 | 16 | k | 9.00 | 52.00 | 13.20 | 26.00 | 2.00 | 7.00 |" in md16  # against the larger floor
    assert "Largest batch whose fp8 pass fits: 64 (tried up to 128)." in md
    assert "Triton MoE GEMM in the" not in md  # a run from before the passes said which tiles they took
    tiled = {**row, "moe_tiles": "tiles from out/moe_tiles/NVIDIA_H200-fp8.yaml (torch 2.11, Triton 3.6)"}
    md_tiled = report.render(
        {**result, "checks": [{**result["checks"][0], "rows": [tiled, {**tiled, "batch": 16}]}]}
    )
    assert (
        md_tiled.count("Triton MoE GEMM in the fp8 passes: tiles from out/moe_tiles/NVIDIA_H200-fp8.yaml")
        == 1
    )
    row["attention"] = [{"kind": "full_attention", "q_heads": 16, "kv_heads": 2, "head_dim": 512, "keys": 512,
                         "flash": False, "efficient": False, "cudnn": False, "ms_grouped": 1.5, "ms_expanded": 0.5}]  # fmt: skip
    assert "| full_attention | 1 | 16/2 x 512 | 512 | math only | 1.50 | 0.50 | — |" in report.render(result)
    row["attention"][0]["ms_packed"] = 0.25
    assert "| full_attention | 1 | 16/2 x 512 | 512 | math only | 1.50 | 0.50 | 0.25 |" in report.render(
        result
    )
    row["attention"][0]["new_length"] = [
        {"backend": "cudnn", "form": "network", "keys": 513, "first_ms": 41.0, "ms": 0.0625},
        {"backend": "flash", "form": "network", "keys": 514, "error": "RuntimeError: No available | kernel"},
    ]
    md = report.render(result)
    assert "| full_attention | 1 | cudnn | network | 513 | 41.00 | 0.062 |" in md
    assert "| full_attention | 1 | flash | network | 514 | — | RuntimeError: No available / kernel |" in md


def test_a_pass_that_made_nans_or_failed_its_capture_says_so_in_the_table():
    """A NaN output measures nothing: no ratio to its floor, in the table or the checks' line; a capture that
    failed says why in its cell instead of "nan"."""
    row = {"format": "fp8", "batch": 1, "kernels": "k", "ms_eager": 9.0, "ms_graph": 7.44, "floor_ms_spec": 6.2,
           "floor_ms_copy": 7.0, "finite": False}  # fmt: skip
    failed = {**row, "batch": 16, "finite": True, "ms_graph": float("nan"),
              "graph_error": "RuntimeError: operation not permitted when stream is capturing"}  # fmt: skip
    result = {"env": asdict(H200), "dry_run": False, "checks": [
        {"name": "26B pass fp8", "status": "failed", "seconds": 40.0, "budget_s": 55, "detail": "",
         "rows": [row, failed]}]}  # fmt: skip
    md = report.render(result)
    assert "| fp8 | 1 | k | 9.00 | 7.44 | 6.20 | — | — (NaN output) | 7.00 |" in md
    assert (
        "| fp8 | 16 | k | 9.00 | — RuntimeError: operation not permitted when stream is capturing | 6.20 | — | 1.45 |"
        in md
    )
    assert report.summary([row, failed]) == "batch 1: NaN output; batch 16: 9.0 ms, 1.45x floor"


def test_the_whole_command_ends_within_its_total_whatever_the_checks_overrun(tmp_path, monkeypatch):
    """Each check runs at most until the total's deadline (less the margin for the command's start and the
    last kill's output); a check left with under a second is skipped, saying why. A killed check's overrun
    under a second is taken from the next one too (floored, not truncated toward zero)."""
    monkeypatch.setattr(checks, "TOTAL_BUDGET_S", 8)
    monkeypatch.setattr(checks, "END_MARGIN_S", 2)
    monkeypatch.setattr(checks, "STOP_WAIT_S", 1.0)
    hang = ("-c", "import time; time.sleep(60)")
    runs = [checks.GpuCheck(name, 3, "hangs", hang, ()) for name in ("a", "b", "c")]
    monkeypatch.setattr(checks, "CHECKS", tuple(runs))
    monkeypatch.setattr(checks, "detect_env", lambda: checks.Env(cuda=False, torch="2.13"))
    t0 = time.monotonic()
    ran = checks.run_bench_gpu(tmp_path)["checks"]
    assert time.monotonic() - t0 < 8
    assert [c["status"] for c in ran] == ["timeout", "timeout", "skipped"], ran
    assert ran[1]["budget_s"] == 2  # 3 less the first's overrun, floored
    assert ran[2]["detail"] == "no time left of the command's 8 s: the checks before it overran"


def test_json_on_stdout_is_strict_json_like_the_files(capsys):
    """`--json` prints what gpu.json holds: NaN (a failed capture's time) and infinities as null, so strict
    parsers (jq, JSON.parse) read it."""
    import json

    from pipeline.cli import output

    def strict(text: str) -> object:
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in --json output"))

    result = {"checks": [{"rows": [{"ms_graph": float("nan"), "x": float("inf"), "ms_eager": 1.5}]}]}
    want = {"checks": [{"rows": [{"ms_graph": None, "x": None, "ms_eager": 1.5}]}]}
    output.json_out(result)
    assert strict(capsys.readouterr().out) == want
    output.json_out(result, compact=True)
    assert strict(capsys.readouterr().out) == want
