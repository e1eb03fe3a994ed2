"""The `dgpipe` command as a user runs it: instant help, doctor, generate, and one-line errors."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests._utils.cli import BARE_ENV
from tests._utils.cli import dgpipe as run_dgpipe

# the CLI in a fresh shell (none of this environment's DGPIPE_* settings); exit 0 unless ok=False
dgpipe = functools.partial(run_dgpipe, ok=True, base_env=BARE_ENV, timeout=300)


def test_cli_import_is_light():
    code = "import sys, pipeline.cli; bad = [m for m in ('torch', 'transformers', 'modelopt', 'tritonclient') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_version_and_help():
    assert dgpipe("--version").stdout.startswith("dgpipe ")
    assert "generate" in dgpipe("--help").stdout


def test_help_lists_every_command_without_importing_them():
    from pipeline.cli import COMMANDS

    code = (
        "import sys; from pipeline.cli import main; sys.argv = ['dgpipe', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print([m for m in sys.modules if m.startswith('pipeline.cli.') and m not in"
        " ('pipeline.cli.errors', 'pipeline.cli.output')] + [m for m in ('torch', 'rich.progress') if m in sys.modules])"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    *help_lines, imported = proc.stdout.strip().splitlines()
    assert imported == "[]"
    listed = {line.split()[1] for line in help_lines if line.startswith("│ ") and not line.startswith("│  ")}
    assert listed >= set(COMMANDS) and len(COMMANDS) == 15


def test_registry_help_is_each_commands_own():
    import inspect

    from pipeline.cli import COMMANDS, load

    for name, (_, summary) in COMMANDS.items():
        cmd = load(name)
        assert cmd.name == name and inspect.cleandoc(cmd.help) == inspect.cleandoc(summary), name


def test_cache_dir_precedence(monkeypatch, tmp_path: Path):
    from pipeline.cli.options import cache_dir

    monkeypatch.delenv("DGPIPE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == Path.home() / ".cache" / "dgpipe"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "dgpipe"
    monkeypatch.setenv("DGPIPE_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_out_not_given_is_the_commands_directory_in_the_cache(tmp_path: Path):
    """Where the help says a command writes when `--out` is not given, there it writes."""
    assert "~/.cache/dgpipe/bench-gpu" in dgpipe("bench", "gpu", "--help", env={"COLUMNS": "200"}).stdout
    dgpipe("bench", "gpu", "--dry-run", env={"DGPIPE_CACHE": str(tmp_path)})
    assert sorted(p.name for p in (tmp_path / "bench-gpu").iterdir()) == ["gpu.json", "gpu.md"]


def test_debug_variable_shows_the_traceback(tmp_path: Path):
    args = ["generate", "--model", str(tmp_path / "missing"), "x"]
    plain = dgpipe(*args, ok=False)
    debug = dgpipe(*args, ok=False, env={"DGPIPE_DEBUG": "1"})
    assert plain.returncode == debug.returncode == 2
    assert "Traceback" not in plain.stderr and "Traceback" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1] == plain.stderr.strip()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["build", "--precision", "bf16", "--build-dir", "{file}"], "{file}: a file is in the way"),
        (["bench", "requests", "{dir}"], "{dir}: is a directory, not a file"),
        (["bench", "gpu", "--dry-run", "--out", "{file}/x"], "{file}: a file is in the way"),
        (["bench", "requests", "/proc/dgpipe-nope/x.jsonl"], "/proc/dgpipe-nope: No such file or directory"),
    ],
)
def test_paths_of_the_wrong_kind_are_one_line_naming_them(tmp_path: Path, args, needle):
    """A file where a directory is needed, a directory where a file is, a path the file system refuses:
    exit 2 with the path named (they were tracebacks: FileExistsError, IsADirectoryError, ...)."""
    (tmp_path / "f").write_text("x")
    fill = {"file": str(tmp_path / "f"), "dir": str(tmp_path)}
    proc = dgpipe(*(a.format(**fill) for a in args), ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert needle.format(**fill) in proc.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["local", "--runs", "0"], "'--runs'"),
        (["local", "--batch", "0"], "'--batch'"),
        (["guided", "--fixed-steps", "0"], "'--fixed-steps'"),
        (["model", "--context", "0"], "'--context'"),
        (["flops", "--context", "-1"], "'--context'"),
        (["export-memory", "--layers", "0"], "'--layers'"),
        (["export-memory", "--moe", "foo"], "--moe foo: unknown MoE form"),
    ],
)
def test_bench_counts_out_of_range_are_refused_naming_the_option(args, needle):
    """They ran into a division by zero, a table of NaN, a traceback from a child, or a 1.6 GB layer written
    before the child failed."""
    proc = dgpipe("bench", *args, ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and needle in proc.stderr, proc.stderr


def test_doctor_json():
    rows = json.loads(dgpipe("doctor", "--json").stdout)
    names = {r["name"] for r in rows}
    assert {"python", "torch", "nvcc", "tensorrt", "nvidia-modelopt", "tritonserver", "kubectl"} <= names
    assert all(r["ok"] or r["hint"] for r in rows), "every missing requirement names how to get it"


def test_generate_json(tiny_checkpoint: Path):
    out = json.loads(
        dgpipe(
            "generate",
            "--model",
            str(tiny_checkpoint),
            "12 34",
            "--max-tokens",
            "20",
            "--steps",
            "3",
            "--json",
        ).stdout
    )
    assert len(out["tokens"]) <= 20 and out["finish_reason"] in ("stop", "length")
    assert out["steps_per_canvas"] and max(out["steps_per_canvas"]) <= 3
    assert out["sampler"]["max_denoising_steps"] == 3  # CLI beats generation_config.json (4)


def test_generate_stream_and_drafts(tiny_checkpoint: Path):
    proc = dgpipe(
        "generate",
        "--model",
        str(tiny_checkpoint),
        "12",
        "--max-tokens",
        "16",
        "--stream",
        "--drafts",
        "--steps",
        "2",
    )
    assert "[step  1]" in proc.stderr and "[step  2]" in proc.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--entropy-bound", "0"], "entropy_bound must be in [0.001, 1e+06]"),
        (["--steps", "0"], "max_denoising_steps must be >= 1"),
        (["--t-min", "0.9", "--t-max", "0.5"], "t_min (0.9) must be <= t_max (0.5)"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--canvas-length", "255"], "exceeds the context limit"),
        (["--infill", "1" * 9], "longer than the 8-token canvas"),
        (["--device", "cuda"], "no CUDA device"),
    ],
)
def test_generate_bad_input_is_one_line(tiny_checkpoint: Path, args, needle):
    proc = dgpipe("generate", "--model", str(tiny_checkpoint), "12", *args, ok=False)
    assert proc.returncode == 2
    assert needle in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_prompt_longer_than_context(tiny_checkpoint: Path):
    proc = dgpipe("generate", "--model", str(tiny_checkpoint), "12" * 200, ok=False)
    assert proc.returncode == 2 and "exceeds the context limit of 256 tokens" in proc.stderr


def test_broken_checkpoint_is_one_line(tiny_checkpoint: Path, tmp_path: Path):
    proc = dgpipe("generate", "--model", str(tmp_path / "missing"), "x", ok=False)
    assert proc.returncode == 2 and "no such checkpoint directory" in proc.stderr
    (tiny_checkpoint / "config.json").write_text('{"model_type": "gemma3"}')
    proc = dgpipe("generate", "--model", str(tiny_checkpoint), "x", ok=False)
    assert proc.returncode == 2 and "model_type" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_model_runs_a_random_weight_config(tmp_path: Path):
    """The GPU benchmark's code path, exercised on CPU with the tiny config (the 26B needs an H200)."""
    proc = dgpipe(
        "bench",
        "model",
        "--config",
        "sudoku-tiny",
        "--batch",
        "1,2",
        "--context",
        "20",
        "--repeats",
        "2",
        "--steps",
        "4",
        "--out",
        str(tmp_path),
        "--json",
    )
    out = json.loads(proc.stdout)
    assert (out["config"], out["device"], out["dtype"]) == ("sudoku-tiny", "cpu", "torch.float32")
    assert (out["context"], out["steps_per_canvas"], out["step_policy"]) == (20, 4, "fixed")
    # the weights benchmarked are the sudoku-tiny architecture in fp32: the shipped model's size
    from pipeline.model.checkpoint import load_model
    from pipeline.resources import EMBEDDED_MODEL

    shipped = load_model(EMBEDDED_MODEL)[0]
    assert out["weight_gb"] == pytest.approx(shipped.num_parameters() * 4 / 1e9, rel=1e-9)
    floor_ms = 1000 * out["weight_gb"] / out["copy_bandwidth_gb_s"]
    assert [r["batch"] for r in out["rows"]] == [1, 2]
    for r in out["rows"]:
        assert r["ms_per_denoise_pass"] > 0 and r["ms_per_sampler_step"] > 0 and r["ms_per_ar_token"] > 0
        # throughputs count batch x 82-token canvases (sudoku-tiny's canvas) and one token per AR row
        assert r["diffusion_tokens_per_s"] == pytest.approx(r["batch"] * 82 * 1000 / r["ms_per_canvas"])
        assert r["ar_tokens_per_s"] == pytest.approx(r["batch"] * 1000 / r["ms_per_ar_token"])
        assert r["floor_ms_per_pass"] == pytest.approx(floor_ms, rel=1e-6)
        assert r["pass_over_floor"] == pytest.approx(r["ms_per_denoise_pass"] / floor_ms, rel=1e-6)
        # CUDA graphs run on CUDA only: off it there is no graph figure to set against the eager one
        assert r["runtime_ms_per_canvas_graph"] is None and r["graph_speedup"] is None
        assert r["runtime_ms_per_canvas_eager"] > 0
    assert json.loads((tmp_path / "bench_model.json").read_text()) == out


def test_bench_sweep_writes_json_and_png(tmp_path: Path):
    proc = dgpipe(
        "bench", "sweep", "--bounds", "0.1,1", "--steps", "2", "--n", "3", "--out", str(tmp_path), "--json"
    )
    out = json.loads(proc.stdout)
    assert [(p["entropy_bound"], p["max_steps"]) for p in out["points"]] == [(0.1, 2), (1.0, 2)]
    assert all(p["mean_steps"] <= 2 for p in out["points"]) and out["pareto"]
    assert (tmp_path / "sweep.png").stat().st_size > 1000


@pytest.mark.parametrize("command", [["generate", "x"], ["package", "--output", "{tmp}/repo"]])
@pytest.mark.parametrize("device", ["tpu", "mps", "meta", "cuda:x"])
def test_a_device_dgpipe_does_not_run_on_is_refused_up_front(tmp_path: Path, command, device):
    """torch names more devices than dgpipe runs on: `mps` and `tpu` were tracebacks, `meta` a misleading
    "no weights" error, and `package --device tpu` wrote a repository that failed only when Triton loaded it."""
    proc = dgpipe(*(a.format(tmp=tmp_path) for a in command), "--device", device, ok=False)
    assert proc.returncode == 2 and f"--device {device}: not a device dgpipe runs on" in proc.stderr
    assert not (tmp_path / "repo").exists()


def test_serve_without_a_repository_leaves_packages_default_output_alone(tmp_path: Path):
    """`dgpipe serve` without --repo packages the embedded model: into its own dir, not into
    `dgpipe package`'s default output, which holds the user's repository."""
    mine = tmp_path / "cache" / "model_repository" / "mymodel"
    mine.mkdir(parents=True)
    (mine / "config.pbtxt").write_text('name: "mymodel"\n')
    proc = dgpipe(
        "serve",
        "--image",
        "nvcr.io/nvidia/tritonserver:25.01-py3",
        env={"DGPIPE_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stderr
    assert str(tmp_path / "cache" / "serve" / "model_repository") in proc.stdout
    assert [p.name for p in mine.parent.iterdir()] == ["mymodel"]
    assert (mine / "config.pbtxt").read_text() == 'name: "mymodel"\n'


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["bench", "guided", "--batch", "0,1"], "--batch '0,1': expected counts of at least 1"),
        (["serve", "--http-port", "99999"], "Invalid value for '--http-port'"),
        (["serve", "--openai-port", "-1"], "Invalid value for '--openai-port'"),
    ],
)
def test_counts_and_ports_out_of_range_are_usage_errors(tmp_path: Path, args, needle):
    """A zero batch divided by zero after the warm-up; port 99999 was printed as where the server listens."""
    proc = dgpipe(*args, ok=False, env={"DGPIPE_CACHE": str(tmp_path)})
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["health", "probe", "--url", "ftp://x"], "--url ftp://x: not a Triton URL"),
        (["generate", "--url", "http://127.0.0.1:9", "--model", "{tmp}", "x"], "--model with --url"),
        (["generate", "--url", "http://127.0.0.1:9", "--device", "cpu", "x"], "--device with --url"),
        (
            ["quantize", "--precision", "fp8", "--output", "{tmp}/a", "--build-dir", "{tmp}/b"],
            "exclude each other",
        ),
    ],
)
def test_options_that_cannot_apply_are_refused(tmp_path: Path, args, needle):
    """A URL scheme no probe speaks was reported as a server that is down (exit 1); a local model, dtype or
    device beside --url was ignored; --output with --build-dir was told one of them is required."""
    proc = dgpipe(*(a.format(tmp=tmp_path) for a in args), ok=False)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr
