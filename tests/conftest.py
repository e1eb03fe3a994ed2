from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from pipeline.threads import apply_thread_policy

# `make test` runs the files in parallel worker processes (pytest-xdist). Each would otherwise start as many
# compute threads as the machine has cores, and OpenMP threads that outnumber the cores spin against each
# other: on a 2-core machine the suite's torch-heavy files ran 3-10x slower. So the workers share the
# cores the way `dgpipe serve` splits them among model instances, set before torch and numpy start their
# thread pools (OpenBLAS reads OMP_NUM_THREADS once, when it loads); their subprocesses inherit the count.
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    apply_thread_policy(instances=workers)

import torch

# Without a GPU, Triton kernels run in Triton's interpreter (tests/unit/runtime/kernels/test_moe.py). The
# switch must be on before anything imports triton: its standard library (the combine functions of
# tl.sum, tl.cumsum) is jitted at import, and torch.compile's tests import it early.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # imported now, so a test that unsets the switch for a while (bench/gpu/test_measure.py) cannot be the
    # first to import it and leave its standard library compiled-mode
    with contextlib.suppress(ImportError):
        import triton.language  # noqa: F401
    from tests._utils.interpreter_patching import remove_interpreter_overheads

    remove_interpreter_overheads()

from tests._utils.tiny import build_tiny


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Commands that write to the default cache write to this session's own folder.

    The suite runs in parallel workers (`make test`: pytest-xdist); each worker is its own session, so no two
    tests share ~/.cache/dgpipe, and a developer's real cache is never touched by the tests.
    """
    os.environ["DGPIPE_CACHE"] = str(tmp_path_factory.mktemp("dgpipe-cache"))


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Path:
    """A random tiny checkpoint in HF layout, written by dgpipe (tokenizer: the Sudoku character set)."""
    from pipeline.demo import tokenizer as stok
    from pipeline.model.checkpoint import save_checkpoint

    out = tmp_path / "tiny"
    save_checkpoint(build_tiny(), out, generation_config={"max_denoising_steps": 4})
    stok.save_tokenizer(out)
    return out
