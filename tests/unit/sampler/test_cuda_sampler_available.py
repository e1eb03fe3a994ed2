"""Whether the fused CUDA sampler can run, and why not: what its extension's build lacks (torch's
`cpp_extension` runs nvcc and `ninja` from PATH), decided once per process."""

from __future__ import annotations

import os

import pytest
import torch

from pipeline.errors import DgpipeError
from pipeline.sampler.kernels import build, gpu_sampler


@pytest.fixture(autouse=True)
def fresh_answer():
    gpu_sampler.cuda_sampler_unavailable.cache_clear()
    yield
    gpu_sampler.cuda_sampler_unavailable.cache_clear()


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch has CUDA")
def test_a_cpu_torch_lacks_the_cuda_build_and_the_sampler_says_so():
    missing = build.missing_build_tools()
    assert isinstance(missing, DgpipeError) and "CUDA build of torch" in str(missing)
    reason = gpu_sampler.cuda_sampler_unavailable()
    assert reason == f"no CUDA GPU visible (torch {torch.__version__})"
    assert not gpu_sampler.cuda_sampler_available()


def test_a_failed_build_is_the_reason_with_its_fix_and_is_not_retried(monkeypatch: pytest.MonkeyPatch):
    """On a GPU whose extension cannot build (here: no ninja), the answer names the missing tool and its fix,
    and the build is tried once per process, not on every call (the TensorRT backend asks every step)."""
    calls = []

    def no_ninja():
        calls.append(1)
        raise DgpipeError("building the CUDA sampler extension needs ninja", hint="pip install ninja")

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(build, "load_torch_extension", no_ninja)
    for _ in range(3):
        assert gpu_sampler.cuda_sampler_unavailable() == (
            "DgpipeError: building the CUDA sampler extension needs ninja (pip install ninja)"
        )
    assert not gpu_sampler.cuda_sampler_available() and len(calls) == 1


def test_a_build_that_fails_in_the_compiler_is_a_reason_too(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(build, "load_torch_extension", lambda: (_ for _ in ()).throw(RuntimeError("Error building extension 'dgpipe_sampler'")))  # fmt: skip
    assert gpu_sampler.cuda_sampler_unavailable() == "RuntimeError: Error building extension 'dgpipe_sampler'"


def test_the_ninja_packages_binary_goes_on_path_once(monkeypatch: pytest.MonkeyPatch):
    """torch's `cpp_extension` runs `ninja` from PATH; a virtual environment's bin directory is there only
    when it is activated."""
    ninja = pytest.importorskip("ninja")
    monkeypatch.setenv("PATH", "/nonexistent")
    build.ninja_on_path()
    build.ninja_on_path()
    assert os.environ["PATH"] == os.pathsep.join([ninja.BIN_DIR, "/nonexistent"])
    monkeypatch.delenv("PATH")
    build.ninja_on_path()
    assert os.environ["PATH"] == ninja.BIN_DIR


def test_the_extension_loads_once_per_process_and_a_failed_load_is_tried_again(monkeypatch):
    """The sampler asks for its extension every step it runs outside a CUDA graph: torch's `load` (ninja, a
    hash of the sources, the build lock) runs once, and a load that failed runs again on the next ask."""
    from torch.utils import cpp_extension

    loads, fail = [], [True]

    def load(**kwargs):
        loads.append(kwargs["name"])
        if fail[0]:
            raise RuntimeError("Error building extension 'dgpipe_sampler'")
        return "the module"

    monkeypatch.setattr(build, "missing_build_tools", lambda: None)
    monkeypatch.setattr(cpp_extension, "load", load)
    build.load_torch_extension.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="Error building"):
            build.load_torch_extension()
        fail[0] = False
        assert build.load_torch_extension() == build.load_torch_extension() == "the module"
        assert loads == [build.EXTENSION] * 2
    finally:
        build.load_torch_extension.cache_clear()
