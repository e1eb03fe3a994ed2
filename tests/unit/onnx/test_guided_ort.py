"""Constrained denoising on the ONNX Runtime backend: the graph's logits output is masked and re-sampled, so
a constrained batch gives the same tokens as the PyTorch backend (bf16 self-conditioning, as the graph) and
every output is in the language."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install dgpipe[engine])")

from pipeline.demo import sudoku
from pipeline.resources import EMBEDDED_MODEL
from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request
from pipeline.runtime.session import load_session
from tests._utils.onnx_graphs import GraphConditioningTorchBackend


@pytest.mark.slow  # exports the embedded model: ~35 s on 2 cores
def test_constrained_batch_through_onnxruntime_equals_pytorch(tmp_path):
    from pipeline.onnx.backend import OnnxRuntimeBackend
    from pipeline.onnx.export import export_onnx

    session = load_session(EMBEDDED_MODEL, "float32", "cpu")
    export_onnx(session.model, tmp_path / "onnx")
    ort_backend = OnnxRuntimeBackend(tmp_path / "onnx", EMBEDDED_MODEL)
    pattern = "[1-4]{40}[5-9]{41}"  # not what the model would write: only the masks make it hold
    guide = session.compile_guide("regex", pattern)
    puzzles = [p for p, _ in sudoku.make_dataset(777, 4, (45, 61))]

    def run(backend) -> list[list[int]]:
        rt = BlockDiffusionRuntime(backend, max_batch=5)
        reqs = [
            Request(session.encode_prompt(p), max_tokens=82, sampler=session.sampler(), seed=i, request_id=i, guide=guide)
            for i, p in enumerate(puzzles)
        ]  # fmt: skip
        reqs.append(
            Request(session.encode_prompt(puzzles[0]), max_tokens=82, sampler=session.sampler(), request_id=9)
        )
        return [r.tokens for r in rt.generate(reqs)]

    got = run(ort_backend)
    assert got == run(GraphConditioningTorchBackend(session.model))
    for tokens in got[:4]:
        assert re.fullmatch(pattern, session.decode(tokens)), session.decode(tokens)
    assert not re.fullmatch(pattern, session.decode(got[4]))  # the unconstrained neighbour is free
