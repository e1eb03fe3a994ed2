"""`dgpipe bench model`'s random model: allocated once, in the target dtype."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pipeline.bench.model import random_model
from pipeline.model.config import ModelConfig
from tests._utils.tiny import TINY


class Allocations(TorchDispatchMode):
    """Bytes of every real (non-meta) tensor an aten op allocates, by dtype (in-place ops allocate none)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[torch.dtype, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.is_mutable:
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.bytes[t.dtype] = self.bytes.get(t.dtype, 0) + t.numel() * t.element_size()
        return out


def test_weights_are_materialised_in_the_target_dtype_only():
    config = ModelConfig.from_dict(TINY)
    with Allocations() as seen:
        model = random_model(config, torch.bfloat16, torch.device("cpu"))
    params = list(model.parameters())
    assert {p.dtype for p in params} == {torch.bfloat16}
    param_bytes = sum(p.numel() * 2 for p in params)
    buffers = {n: b for n, b in model.named_buffers()}
    rope = sum(b.numel() * 4 for n, b in buffers.items() if "inv_freq" in n)
    scalars = sum(b.numel() * 2 for n, b in buffers.items() if "inv_freq" not in n)
    assert all(b.dtype == torch.float32 for n, b in buffers.items() if "inv_freq" in n)  # as load_model
    # the bf16 weights once, plus the scalars and the RoPE tables' bf16 placeholders (replaced in fp32);
    # fp32 only for the RoPE tables and their few CPU temporaries
    assert seen.bytes[torch.bfloat16] == param_bytes + scalars + rope // 2
    assert seen.bytes.get(torch.float32, 0) < 8 * rope < param_bytes // 10


def test_a_failed_pass_capture_is_undone_before_it_is_raised(monkeypatch):
    """`bench gpu` records a pass whose capture fails and goes on measuring: the stream the capture left
    current is put back and the allocator's recording into the pool ended (torch before 2.12 leaves it
    recording when `capture_end` raises, and every later `empty_cache` fails). torch.cuda's calls are stood
    in for (no GPU here)."""
    import contextlib

    from pipeline.bench.model import _graphed

    calls, default = (
        [],
        type("Stream", (), {"device": torch.device("cuda", 0), "wait_stream": lambda s, o: None})(),
    )

    @contextlib.contextmanager
    def refused(graph, pool=None):
        yield
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    for name, value in {"current_stream": lambda: default, "Stream": lambda: default, "graph": refused,
                        "stream": lambda s: contextlib.nullcontext(), "CUDAGraph": lambda: object(),
                        "graph_pool_handle": lambda: (0, 7), "set_stream": lambda s: calls.append("set_stream")}.items():  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(
        torch._C, "_cuda_endAllocateToPool", lambda d, p: calls.append(("end", d, p)), raising=False
    )
    with pytest.raises(RuntimeError, match="during capture"):
        _graphed(lambda: None, torch.device("cuda"))
    assert calls == ["set_stream", ("end", 0, (0, 7))]


def test_bench_model_off_cuda_reports_no_graph_figures_and_times_the_runtime_sampler(tmp_path, monkeypatch):
    """CUDA graphs exist on CUDA only: off it the graph columns are empty, not a second eager run set against
    the first (which printed "graph x 1.60" between two identical paths). The sampler timed is the runtime's
    (`sample_logits`, the cache-blocked CPU step here), not the reference."""
    from pipeline.bench import model as bench
    from pipeline.bench.model import render as render_model
    from pipeline.runtime import backends

    calls = []
    real = backends.sample_logits
    monkeypatch.setattr(bench, "sample_logits", lambda *a, **k: calls.append(k) or real(*a, **k))
    r = bench.run_bench_model("sudoku-tiny", [1], 8, 2, 2, "float32", "cpu", tmp_path)
    (row,) = r["rows"]
    assert row["runtime_ms_per_canvas_graph"] is None and row["graph_speedup"] is None
    assert row["runtime_ms_per_canvas_eager"] > 0 and row["ms_per_sampler_step"] > 0
    assert calls and all(k["cpu_fused"] and not k["cuda"] for k in calls)
    assert render_model(r)[1].split()[-2:] == ["-", "-"]
