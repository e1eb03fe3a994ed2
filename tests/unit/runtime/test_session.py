"""Setting up a session: what a cold start pays for."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch


def test_loading_the_embedded_model_does_not_import_dynamo():
    """`torch._dynamo` costs seconds to import; building modules on the meta device used to pull it in
    (nn.Embedding's normal_ and a float arange go through torch._refs there)."""
    code = (
        "import sys\n"
        "from pipeline.runtime.session import load_session\n"
        "load_session()\n"
        "load_session(weights=False)\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_tools_on_a_format_that_takes_none_are_refused_naming_it():
    """The embedded model's task format reads the puzzle from the last message and has no tools: a request
    with tools is the request's problem, said as such (it was a TypeError about a keyword argument)."""
    from pipeline.errors import InputError
    from pipeline.runtime.session import load_session

    s = load_session(weights=False)
    messages = [{"role": "user", "content": "x" * 81}]
    tool = {"type": "function", "function": {"name": "f"}}
    with pytest.raises(InputError, match=r"prompt format \(SudokuFormat\) takes no tools"):
        s.encode_messages(messages, tools=[tool])


def test_a_numbered_gpu_becomes_the_current_device(monkeypatch):
    """Triton launches its kernels on the current CUDA device, not on their tensors': `--device cuda:1` makes
    GPU 1 current before the model loads there (plain `cuda` leaves the current device as it is); a session
    for a TensorRT plan (no weights) makes it current too, as the plan and its streams land there."""
    from pipeline.runtime import gpu_load, session

    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: current.append(str(dev)))
    monkeypatch.setattr(gpu_load, "load_on_gpu", lambda *a: (_ for _ in ()).throw(RuntimeError("loaded")))
    for device in ("cuda:1", "cuda"):
        with pytest.raises(RuntimeError, match="loaded"):
            session.load_session(device=device)
    assert current == ["cuda:1"]
    session.load_session(device="cuda:2", weights=False)
    assert current == ["cuda:1", "cuda:2"]
