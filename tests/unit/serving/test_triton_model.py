"""The Triton model (model_repo/dgpipe_model.py and the serving core it adapts, pipeline/serving/core) runs
in the serving image: it may import the runtime and the engine's runtime side (probe, select,
trt_backend), never the engine build toolchain."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

from pipeline.resources import PACKAGE_DIR, TRITON_MODEL_SOURCE

SERVING_CORE = PACKAGE_DIR / "serving" / "core"

RUNTIME_SIDE = {"pipeline.engine.probe", "pipeline.engine.select", "pipeline.engine.trt_backend"}
BUILD_TOOLCHAIN = ("pipeline.engine.build_engine", "pipeline.engine.ptx", "pipeline.sampler.kernels.build")


def _imported_modules(source: str) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            mods |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
    return mods


def test_triton_model_imports_only_the_engine_runtime_side():
    mods = set().union(
        *(_imported_modules(p.read_text()) for p in (TRITON_MODEL_SOURCE, *SERVING_CORE.glob("*.py")))
    )
    assert {m for m in mods if m.startswith("pipeline.serving.core")}  # the model runs on the core
    engine = {m for m in mods if m.startswith("pipeline.engine")}
    assert engine == RUNTIME_SIDE  # probe for TensorRT/GPU, select for the plan, trt_backend to run it
    assert not any(m.startswith(BUILD_TOOLCHAIN) for m in mods)


def test_engine_runtime_side_does_not_pull_in_the_build_toolchain():
    """What the model imports, imported alone: nothing of the engine build comes with it."""
    code = (
        "import sys, " + ", ".join(sorted(RUNTIME_SIDE)) + "; "
        f"print([m for m in {BUILD_TOOLCHAIN!r} if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(PACKAGE_DIR.parent), "OMP_NUM_THREADS": "1"},
    )
    assert out.stdout.strip() == "[]"
