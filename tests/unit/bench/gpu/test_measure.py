"""`dgpipe bench gpu`'s measurements run end to end off a GPU (small models, the CPU): the pass against its
floor, one layer's attention, experts and sibling linears on each kernel, and the network's chains."""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest
import torch

from pipeline.bench.gpu import checks, layers, measure, report
from pipeline.model.config import ModelConfig
from pipeline.runtime.dispatch import pass_bytes
from tests._utils.interpreter_casts import interpreted_exp, interpreted_tanh, rne_casts  # noqa: F401  (fixtures)

H200 = checks.Env(
    True, "NVIDIA H200", "sm90", 139.8, "580.65", "2.11.0+cu130", "13.0", True, True, True, True, cxx=True
)


def test_attention_shapes_report_the_kernels_torch_may_pick_and_the_other_forms_agree():
    """Per attention shape of the model: the grouped form, K/V expanded to every query head and the queries
    packed along the K/V heads time the same attention (here on the CPU, where no CUDA kernel is
    eligible)."""
    from pipeline.model.config import ModelConfig

    cfg = ModelConfig.from_yaml("bench-medium").text_config
    rows = layers.attention_backends(cfg, 2, 256, torch.device("cpu"), repeats=1)
    assert [(r["kind"], r["q_heads"], r["kv_heads"], r["head_dim"], r["keys"]) for r in rows] == [
        ("sliding_attention", 8, 4, 64, 127 + 256),  # the ring holds window - 1 of the 256 cached tokens
        ("full_attention", 8, 2, 128, 256 + 256),
    ]
    for r in rows:
        assert not (r["flash"] or r["efficient"] or r["cudnn"])
        # bf16 outputs of O(1): a wrong head order differs by O(1)
        assert r["max_abs_diff"] < 1e-2 and r["max_abs_diff_packed"] < 1e-2
        assert r["ms_grouped"] > 0 and r["ms_expanded"] > 0 and r["ms_packed"] > 0
        # each backend and form first called at a key length nothing before it used: a cuDNN plan is built
        # per shape, so a length seen before would hide its cost
        new = r["new_length"]
        assert [(n["backend"], n["form"]) for n in new] == [
            (b, f)
            for b in ("flash", "efficient", "cudnn")
            for f in ("network", "network, masked", "grouped, masked", "expanded")
        ]
        assert len({n["keys"] for n in new}) == 12 and min(n["keys"] for n in new) == r["keys"] + 1
        assert all(("first_ms" in n and n["ms"] > 0) != ("error" in n) for n in new)
        assert any("first_ms" in n for n in new)  # the CPU's flash kernel runs here


def test_a_gpu_configs_targets_does_not_list_is_set_against_its_measured_copy_bandwidth():
    """No datasheet figures, no spec floors: the pass's ratio uses the bytes at the copy bandwidth measured,
    and the table shows no spec floor rather than another GPU's."""
    from pipeline.bench.gpu.report import render

    row = {"format": "fp8", "batch": 1, "kernels": "k", "ms_eager": 9.0, "ms_graph": 8.0, "spec_gpu": None,
           "floor_ms_spec": None, "compute_ms_spec": None, "floor_ms_copy": 4.0}  # fmt: skip
    env = {
        "gpu": "NVIDIA H20",
        "arch": "sm90",
        "memory_gib": 96.0,
        "driver": "1",
        "torch": "2.11",
        "cuda_version": "13.0",
    }
    md = render({"env": env, "dry_run": False, "checks": [{"name": "26B pass fp8", "status": "passed", "seconds": 1.0,
                                                          "budget_s": 60, "detail": "", "rows": [row]}]})  # fmt: skip
    assert "| fp8 | 1 | k | 9.00 | 8.00 | — | — | 2.00 | 4.00 |" in md


def test_expert_paths_time_one_layer_fp8_and_dequantized_bf16_on_the_same_routing(monkeypatch):
    """The FP8 experts' module, its grouped GEMMs alone, and the bf16 grouped path on their dequantized
    weights (here on the CPU: the grouped scaled GEMM as one F.scaled_mm per expert, bf16 out as on a GPU);
    the two outputs differ by the FP8 activation rounding only, and the table shows the row."""
    import torch.nn.functional as F

    from pipeline.runtime import tensor_cores as tc
    from tests._utils.quantized import grouped_scaled_mm_on_cpu, packed_linear

    monkeypatch.setattr(F, "scaled_grouped_mm", grouped_scaled_mm_on_cpu(torch.bfloat16))
    gen = torch.Generator().manual_seed(0)
    e, d, inner = 8, 64, 32
    gate, up, down = (
        [packed_linear("fp8", n, k, gen) for _ in range(e)] for n, k in ((inner, d), (inner, d), (d, inner))
    )
    cpu = torch.device("cpu")
    x = layers.expert_paths(tc.ScaledExperts(gate, up, down, "fp8", cpu), 2, 64, cpu, repeats=1)
    assert x["tokens"] == 64 and x["rows_per_expert"] == 16
    ms = ("ms_fp8_module", "ms_fp8_gemms", "ms_fp8_gemms_exact_accum", "ms_bf16_grouped", "ms_dequantize")
    assert all(x[k] > 0 for k in ms)
    assert 0 < x["rel_l2_bf16_vs_fp8"] < 0.1  # FP8 inputs round by up to 1/16; a wrong weight layout is O(1)
    assert x["rel_l2_fast_vs_exact_accum"] == 0  # the CPU has one accumulation mode
    assert (
        x["triton_error"] is None and x["ms_triton_gemms"] > 0 and x["ms_triton_gemms_m64"] > 0
    )  # interpreted
    assert 0 < x["rel_l2_triton_vs_torch"] < 1e-2  # bf16 outputs: truncated by the interpreter, rounded here
    row = {"format": "fp8", "batch": 1, "kernels": "k", "ms_eager": 9.0, "ms_graph": 7.0, "floor_ms_spec": 6.2,
           "floor_ms_copy": 7.0, "experts": x}  # fmt: skip
    result = {"env": asdict(H200), "dry_run": False, "checks": [
        {"name": "26B pass fp8", "status": "passed", "seconds": 1.0, "budget_s": 40, "detail": "", "rows": [row]}]}  # fmt: skip
    assert f"| layer 0 | 1 | 16 | {x['ms_fp8_module']:.2f} | {x['ms_fp8_gemms']:.2f} / " in report.render(
        result
    )


@pytest.mark.parametrize(
    ("fmt", "compiled"), [("bf16", False), ("fp8", False), pytest.param("fp8", True, marks=pytest.mark.slow)]
)
def test_the_pass_measurement_runs_end_to_end_off_a_gpu(monkeypatch, fmt, compiled):
    """`measure_pass` itself, on the CPU with the embedded model's configuration and an H200's name and
    arch patched in (the grouped scaled GEMM as per-expert F.scaled_mm): every row and its diagnostics are
    filled, so a GPU session does not lose a check to a fault in this harness."""
    import torch.nn.functional as F

    import pipeline.bench.model as bench_model
    from tests._utils.quantized import grouped_scaled_mm_on_cpu

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(bench_model, "copy_bandwidth", lambda device, gib=2.0: 4.2e12)
    monkeypatch.setattr(F, "scaled_grouped_mm", grouped_scaled_mm_on_cpu(torch.bfloat16))
    monkeypatch.delenv(
        "TRITON_INTERPRET", raising=False
    )  # interpreted, the Triton GEMM takes ~30 s a pass here
    sunk: list[list[dict]] = []
    rows = measure.measure_pass(fmt, batches=(1, 2), repeats=1, sink=lambda r: sunk.append([dict(x) for x in r]),
                                compiled=compiled, config="sudoku-tiny", device=torch.device("cpu"))  # fmt: skip
    assert [r["batch"] for r in rows] == [1, 2]
    # each batch: a row as its first call starts, one after it (what a check killed there leaves), then its
    # times; both batches' times before any diagnostic, then the rows after each diagnostic of each batch
    diagnostics = 3 if compiled else 7
    assert [len(s) for s in sunk] == [1, 1, 1, 2, 2, 2] + [2] * (2 * diagnostics)
    for first, (start, after) in ((0, sunk[0:2]), (1, sunk[3:5])):
        assert start[first] == {"format": rows[0]["format"], "batch": first + 1, "kernels": rows[0]["kernels"],
                                "first_call_s": None}  # fmt: skip
        assert after[first]["first_call_s"] > 0 and after[first]["finite"] and "ms_eager" not in after[first]
    for r in rows:
        assert r["finite"] and r["ms_eager"] > 0 and r["graph_error"] is None  # off CUDA the "graph" is fn
        assert r["spec_gpu"] == "H200-SXM-141GB" and r["floor_ms_spec"] > 0 and r["compute_ms_spec"] > 0
        if compiled:  # the layers compiled (inductor's C++ here), no diagnostics that would recompile them
            assert r["format"] == "fp8 compiled" and r["experts_touched"] is None and "experts" not in r
            continue
        assert 1 <= r["experts_touched"] <= 4
        assert "moe_tiles" not in r  # the Triton GEMM cannot run here: no pass launches it
        if fmt == "fp8":
            assert r["kernels"].startswith("F.scaled_mm FP8 TensorWise") and "experts_error" not in r
            assert "failed their probe (Triton kernels run on CUDA devices" in r["kernels"]
            assert r["experts"]["tokens"] == r["batch"] * 82
            # off CUDA the load leaves the siblings apart: each diagnostic row says so
            assert [x["siblings"] for x in r["siblings"]] == ["q, k, v", "gate, up"]
            assert all("not one RowWise GEMM on this load" in x["error"] for x in r["siblings"])
            # the canvases through the serving runtime: exactly the canvases and steps asked for
            c = r["canvas"]
            assert "canvas_error" not in r and c["tokens"] == r["batch"] * c["canvases"] * 82
            assert c["steps_per_canvas"] == [16] and c["passes"]["denoise"] == c["canvases"] * 16
            assert c["ms_per_canvas"] > 0 and not c["graphs"] and c["captures"] == 0  # off CUDA: no graphs
            assert c["ms_per_canvas_new_lengths"] > 0 and c["warmup_ms_per_round"] is None
            assert c["passes"]["commit"] == 1  # the first canvas's K/V written; the second ends the request
            assert c["load_warm_tokens"] == [] and c["load_warm_s"] >= 0  # off CUDA nothing compiles
        else:
            assert "attention_error" not in r and len(r["attention"]) == 2
            # the network kernels need CUDA or the interpreter (off here): each row says why
            assert (
                "network_error" not in r
                and len(r["network"]) == 19
                and all("Triton kernels run on CUDA devices" in n["error"] for n in r["network"])
            )
            x = r["bf16_experts"]  # the Triton path needs CUDA or the interpreter (off here): torch's alone
            assert "bf16_experts_error" not in r and x["ms_torch"] > 0 and "CUDA" in x["triton_error"]


def test_the_largest_batch_keeps_what_fit_and_knows_a_librarys_allocation_failure(monkeypatch):
    """Each batch that fits is sunk as it is found (a check killed at its budget keeps it), and cuBLAS's
    allocation failure, which torch passes on as a RuntimeError, ends the search as torch's own
    OutOfMemoryError does; any other error is not taken for a full GPU."""
    import torch.nn.functional as F

    from tests._utils.quantized import grouped_scaled_mm_on_cpu

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(F, "scaled_grouped_mm", grouped_scaled_mm_on_cpu(torch.bfloat16))
    setup = measure._pass_setup

    def full_from(batch: int, error: Exception):
        return lambda model, b: (_ for _ in ()).throw(error) if b >= batch else setup(model, b)

    alloc = RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    monkeypatch.setattr(measure, "_pass_setup", full_from(4, alloc))
    sunk: list[dict] = []
    search = lambda: measure.largest_batch(
        1, 64, lambda r: sunk.append(dict(r[0])), "sudoku-tiny", torch.device("cpu")
    )
    assert search() == [{"format": "fp8", "largest_batch": 2, "tried_up_to": 4}]
    assert [r["largest_batch"] for r in sunk] == [1, 2]
    monkeypatch.setattr(measure, "_pass_setup", full_from(2, ValueError("a bug, not memory")))
    with pytest.raises(ValueError, match="a bug"):
        search()
    # between the largest batch that fit and the first that did not, the gap is halved down to BATCH_STEP
    monkeypatch.setattr(measure, "BATCH_STEP", 2)
    monkeypatch.setattr(measure, "_pass_setup", full_from(7, torch.OutOfMemoryError("CUDA out of memory")))
    sunk.clear()
    assert search() == [{"format": "fp8", "largest_batch": 6, "tried_up_to": 8}]
    assert [r["largest_batch"] for r in sunk] == [1, 2, 4, 6]
    # a limit between two doublings is searched up to, to within BATCH_STEP, not stopped at the last doubling
    monkeypatch.setattr(measure, "_pass_setup", full_from(99, torch.OutOfMemoryError("CUDA out of memory")))
    row = measure.largest_batch(1, 10, lambda r: None, "sudoku-tiny", torch.device("cpu"))
    assert row == [{"format": "fp8", "largest_batch": 9, "tried_up_to": 9}]


def test_bf16_expert_paths_time_torchs_grouped_gemm_and_the_triton_gemm_on_one_routing():
    """Both paths on the interpreted kernel (the 26B's layer on a GPU): the same experts within bf16's
    rounding, and the table row."""
    from pipeline.model.checkpoint import load_model
    from pipeline.resources import EMBEDDED_MODEL

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is on where no GPU is")
    experts = load_model(EMBEDDED_MODEL, torch.bfloat16)[0].layers[0].experts
    x = layers.bf16_expert_paths(experts, 2, 64, torch.device("cpu"), repeats=1)
    assert x["tokens"] == 64 and x["rows_per_expert"] == 32 and x["triton_error"] is None
    assert x["ms_torch"] > 0 and x["ms_triton"] > 0 and 0 < x["rel_l2_triton_vs_torch"] < 2e-2  # 0.011
    row = {"format": "bf16", "batch": 1, "kernels": "k", "ms_eager": 9.0, "ms_graph": 7.0, "floor_ms_spec": 6.2,
           "floor_ms_copy": 7.0, "bf16_experts": x}  # fmt: skip
    result = {"env": asdict(H200), "dry_run": False, "checks": [
        {"name": "26B pass bf16", "status": "passed", "seconds": 1.0, "budget_s": 40, "detail": "", "rows": [row]}]}  # fmt: skip
    assert f"| layer 0 | 1 | 32 | {x['ms_torch']:.2f} | {x['ms_triton']:.2f} |" in report.render(result)


def test_sibling_paths_time_fp8_siblings_as_one_rowwise_gemm_and_apart(tmp_path):
    """The embedded FP8 checkpoint's first layer with its siblings merged as a GPU load merges them (torch's
    CPU scaled GEMMs): q|k|v and gate|up timed both ways, the same products (bit for bit on this
    repository's CI machine; within summation order elsewhere), and the table rows."""
    from pipeline.bench.gpu.network import render_siblings, sibling_paths
    from pipeline.runtime import gpu_load
    from pipeline.runtime import probe as probing
    from pipeline.runtime.shared_input import share_inputs
    from tests._utils.quantized import build_quantized_checkpoint

    path = build_quantized_checkpoint(tmp_path / "fp8", "fp8")
    probed = probing.Probe("sm90", {"linear:fp8": None, "experts:fp8": "no grouped GEMM on the CPU"})
    model = gpu_load.load_on_gpu(path, torch.bfloat16, torch.device("cpu"), probed)[0]
    share_inputs(model, merge_qkv=True, fp8_columns=True)
    rows = sibling_paths(model, 24, torch.device("cpu"), repeats=1)
    assert [r["siblings"] for r in rows] == ["q, k, v", "gate, up"] and all("error" not in r for r in rows)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert rows[0]["columns"] == [p.out_features for p in attn.qkv_kernel.parts]
    assert rows[1]["columns"] == [mlp.gate_proj.out_features, mlp.up_proj.out_features]
    for r in rows:
        assert r["ms_apart"] > 0 and r["ms_merged"] > 0 and r["rel_l2"] < 1e-2  # bf16 outputs
    table = "\n".join(
        render_siblings([*rows, {"siblings": "q, k, v", "tokens": 8, "error": "RuntimeError: a|b"}])
    )
    assert (
        f"| gate, up | 24 | {' + '.join(map(str, rows[1]['columns']))} | {rows[1]['ms_apart']:.3f} |" in table
    )
    assert "| q, k, v | 8 | — | — | — | RuntimeError: a/b | — |" in table


def test_a_random_fp8_model_on_hopper_takes_the_crossover_of_this_gpus_tile_table(monkeypatch):
    """As the runtime's load does (`gpu_load.experts_plan`): the table's measured crossover replaces the
    dispatch row's 64 rows per expert, and the pass's kernels say so."""
    from pipeline.bench.model import random_model
    from pipeline.model.config import ModelConfig
    from pipeline.runtime import probe as probing
    from pipeline.runtime.kernels import moe_tiles
    from pipeline.runtime.probe import probe_plan

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    everything = probing.Probe("sm90", {f"{kind}:{mode}": None for kind, mode, _ in probe_plan("sm90")})
    mcfg = ModelConfig.from_yaml("sudoku-tiny")
    for measured, says in (
        (None, None),
        (256.0, "(Triton up to 256 rows per expert: this GPU's tile table)"),
    ):
        monkeypatch.setattr(moe_tiles, "measured_triton_rows", lambda device, shapes, rows=measured: rows)
        model = random_model(mcfg, torch.bfloat16, torch.device("cpu"))
        kernels = measure.quantize_random(model, "fp8", everything)
        assert {layer.experts.triton_rows for layer in model.layers} == {measured or 64}
        assert measure.moe_tiles_used(model, torch.device("cpu")) == "default tiles"  # no table off CUDA
        assert (says in kernels) if says else "tile table" not in kernels


def test_the_fp8_pass_on_an_ada_gpu_follows_the_runtimes_fallback_off_a_gpu(monkeypatch):
    """`measure_pass` for FP8 with an RTX 6000 Ada's arch patched in, where the experts' only kernel is
    dgpipe's Triton GEMM: with Triton unable to run (off a GPU, no interpreter) the experts stay bf16 as the
    runtime's load leaves them, the linears stay FP8, the row says why, and the pass still measures."""
    import pipeline.bench.model as bench_model
    from pipeline.model.network import Experts
    from pipeline.runtime.dispatch import TRITON_MOE_EVERY_PASS

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA RTX 6000 Ada Generation")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(bench_model, "copy_bandwidth", lambda device, gib=2.0: 0.9e12)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    built = []
    real = measure.quantize_random
    monkeypatch.setattr(
        measure, "quantize_random", lambda model, fmt: built.append(model) or real(model, fmt)
    )
    (row,) = measure.measure_pass("fp8", batches=(1,), repeats=1, sink=lambda r: None, config="sudoku-tiny",
                              device=torch.device("cpu"))  # fmt: skip
    assert row["finite"] and row["ms_eager"] > 0
    assert f"experts: {TRITON_MOE_EVERY_PASS} failed its probe (Triton kernels run on CUDA" in row["kernels"]
    assert row["kernels"].endswith(": dequantized float path)")
    assert all(type(layer.experts) is Experts for layer in built[0].layers)
    # its floor: the bytes of the experts it ran, bf16, not the row's FP8, in the network's pass it timed
    # (no sampler, no soft embedding for a next step)
    mcfg = ModelConfig.from_yaml("sudoku-tiny")
    ran = pass_bytes(
        mcfg.text_config, "fp8", "bf16", 1, mcfg.canvas_length, measure.CONTEXT, step=False
    ).total
    assert measure.weights_read(built[0]) == ("fp8", "bf16") and row["pass_gb"] == ran / 1e9


def test_linears_that_failed_their_probe_say_so_and_count_as_bf16(monkeypatch):
    """As the runtime's load reports it: the row names the linears' kernel that failed and its error, and the
    pass reads them in bf16."""
    from pipeline.bench.model import random_model
    from pipeline.runtime import probe as probing
    from pipeline.runtime.dispatch import SCALED_MM_FP8
    from pipeline.runtime.probe import probe_plan

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    plan = {f"{kind}:{mode}": None for kind, mode, _ in probe_plan("sm90")}
    failed = probing.Probe("sm90", {**plan, "linear:fp8": "RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED"})
    mcfg = ModelConfig.from_yaml("sudoku-tiny")
    model = random_model(mcfg, torch.bfloat16, torch.device("cpu"))
    kernels = measure.quantize_random(model, "fp8", failed)
    assert (
        f"(linears: {SCALED_MM_FP8} failed its probe (RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED): bf16)"
        in kernels
    )
    assert measure.weights_read(model) == ("bf16", "fp8")


def test_a_pass_that_made_nans_fails_its_check_with_its_rows_kept(monkeypatch, tmp_path, capsys):
    rows = [{"batch": 1, "finite": True}, {"batch": 16, "finite": False}]
    monkeypatch.setattr(measure, "measure_pass", lambda fmt, sink, compiled: sink(rows) or rows)
    monkeypatch.setenv("DGPIPE_GPU_ROWS", str(tmp_path / "rows.json"))
    assert measure.main(["pass", "fp8"]) == 1
    assert "the fp8 pass made NaN or inf at batch [16]" in capsys.readouterr().err
    assert checks.read_rows(tmp_path / "rows.json") == rows


def test_results_compared_slice_by_slice_are_compared_as_wholes(monkeypatch):
    """`_compare` in slices of a few values (a batch-16 softcap's results would not fit twice more on an
    80 GB GPU): the same verdict and distance as over the whole results, pairs and scalars too."""
    from pipeline.bench.gpu import network

    monkeypatch.setattr(network, "COMPARE_VALUES", 10)
    a = torch.randn(7, 5, generator=torch.Generator().manual_seed(0)).bfloat16()
    b = a.clone()
    b[3, 2] += 1
    whole = float((a.float() - b.float()).norm() / b.float().norm())
    assert network._compare(a, a) == (True, 0.0)
    same, dist = network._compare((a, torch.tensor(3)), (b, torch.tensor(3)))
    assert not same and dist == pytest.approx(
        whole * b.float().norm() / (b.float().square().sum() + 9) ** 0.5
    )
    assert network._compare(torch.tensor([-0.0]), torch.tensor([0.0])) == (False, 0.0)  # bits, not values
    assert network._compare(torch.zeros(0, 5), torch.zeros(0, 5)) == (True, 0.0)
    for other in (
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int16),
    ):  # not broadcast, not cast
        with pytest.raises(ValueError, match="shape or dtype"):
            network._compare(torch.zeros(1, dtype=torch.int16), other)


def test_a_failed_run_at_new_lengths_keeps_the_steady_canvases(monkeypatch):
    """The canvases' last run (every key length new) is an extra: if it fails, the steady run's row stays
    and says why the other is missing."""
    from pipeline.bench.gpu import canvas
    from pipeline.bench.model import random_model
    from pipeline.model.config import ModelConfig
    from pipeline.runtime.scheduler import BlockDiffusionRuntime

    mcfg = ModelConfig.from_yaml("sudoku-tiny")
    model = random_model(mcfg, torch.float32, torch.device("cpu"))
    generate = BlockDiffusionRuntime.generate

    def failing_at_new_lengths(self, requests):
        if len(requests[0].prompt_ids) == 8 + canvas.NEW_LENGTH:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return generate(self, requests)

    monkeypatch.setattr(BlockDiffusionRuntime, "generate", failing_at_new_lengths)
    row = canvas.canvas_time(model, 1, 8, torch.device("cpu"), steps=2, canvases=1)
    assert row["ms_per_canvas"] > 0 and row["passes"]["denoise"] == 2
    assert row["new_lengths_error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert "ms_per_canvas_new_lengths" not in row


def test_network_paths_time_each_chain_against_its_torch_form(rne_casts, interpreted_tanh, interpreted_exp):  # noqa: F811
    """Every chain on the interpreted kernels at the embedded model's shapes: torch's values bit for bit where
    the kernel is exact (RoPE, the residual sum, the K/V concatenation, the expert order, the FFN inputs'
    operands against the one-pass quantizations of the kernel's rows), within rounding
    where it is not,
    both timed; and the table."""
    from pipeline.bench.gpu.network import network_paths, render_network
    from pipeline.model.config import ModelConfig

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is on where no GPU is")
    cfg = ModelConfig.from_yaml("sudoku-tiny").text_config
    rows = network_paths(cfg, 2, 8, 5, torch.device("cpu"), repeats=1)
    assert [r["chain"].split(" [")[0] for r in rows] == ["RoPE q", "head norms q, k, v", "softcap", "combine", "gated GeLU",
                                                         "gated GeLU to FP8", "gated GeLU to NVFP4", "residual sum", "router input", "FFN inputs", "FFN inputs to FP8", "FFN inputs to NVFP4", "FFN inputs to NVFP4 as per-row FP8", "layer end", "input norm to FP8", "input norm to NVFP4",
                                                         "router top-k", "expert order", "K/V concatenation"]  # fmt: skip
    for r in rows:
        assert "error" not in r and r["ms_torch"] > 0 and r["ms_triton"] > 0, r
        assert r["rel_l2"] < 1e-2, r
    exact = {r["chain"].split(" [")[0]: r["bit_equal"] for r in rows}
    assert (
        exact["RoPE q"]
        is exact["residual sum"]
        is exact["router input"]
        is exact["expert order"]
        is exact["K/V concatenation"]
        is exact["FFN inputs to FP8"]
        is exact["FFN inputs to NVFP4"]
        is exact["FFN inputs to NVFP4 as per-row FP8"]
        is True
    )
    table = "\n".join(render_network(rows))
    assert table.count("\n| ") == 20 and "| K/V concatenation [2, " in table


def test_the_tiles_check_tunes_within_its_budget_and_leaves_its_table_in_the_runs_out(monkeypatch, tmp_path):
    """`measure tiles`: `run_moe_tiles` on the 26B's shapes with what is left of the check's budget once the
    process started (less a margin for writing), its files under the run's out directory, its rows tagged
    with the GPU and operand for `bench gpu`'s table."""
    import json

    from pipeline.bench.gpu import measure, tiles

    seen = {}

    def run(out, operand, config, budget_s, on_result):
        seen.update(out=out, operand=operand, config=config, budget_s=budget_s)
        result = {
            "device": "NVIDIA H200",
            "operand": "fp8",
            "layers": 30,
            "timed": 40,
            "candidates": 362,
            "triton_rows": 256.0,
            "complete": False,
            "table_files": [str(out / "NVIDIA_H200-fp8.yaml")],
            "rows": [{"shape": "down", "best_ms": 0.2}],
        }
        on_result(result)  # written as it climbs
        if seen.get("killed"):
            raise KeyboardInterrupt
        return {**result, "complete": True, "rows": [{"shape": "down", "best_ms": 0.1}]}

    monkeypatch.setattr(tiles, "run_moe_tiles", run)
    monkeypatch.setenv("DGPIPE_GPU_BUDGET_S", "100")
    monkeypatch.setenv("DGPIPE_GPU_OUT", str(tmp_path))
    monkeypatch.setenv("DGPIPE_GPU_ROWS", str(tmp_path / "rows.json"))
    assert measure.main(["tiles"]) == 0
    assert (
        seen["out"] == tmp_path / "moe_tiles"
        and seen["operand"] is None
        and seen["config"] == "diffusiongemma-26b-a4b"
    )
    assert 100 - measure.TILES_MARGIN_S - 5 < seen["budget_s"] <= 100 - measure.TILES_MARGIN_S
    monkeypatch.setenv("DGPIPE_GPU_BUDGET_S", "400")  # what the checks before it left: not all of it
    measure.main(["tiles"])
    assert seen["budget_s"] <= measure.TILES_MAX_S - measure.TILES_MARGIN_S
    rows = json.loads((tmp_path / "rows.json").read_text())
    tags = {"device": "NVIDIA H200", "operand": "fp8", "layers": 30, "timed": 40, "candidates": 362,
            "triton_rows": 256.0, "table_file": str(tmp_path / "moe_tiles" / "NVIDIA_H200-fp8.yaml")}  # fmt: skip
    assert rows == [{"shape": "down", "best_ms": 0.1, **tags, "complete": True}]
    seen["killed"] = True  # stopped mid-climb: the rows of the table it last wrote stay
    with pytest.raises(KeyboardInterrupt):
        measure.main(["tiles"])
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert rows == [{"shape": "down", "best_ms": 0.2, **tags, "complete": False}]


def test_the_canvas_table_shows_each_run_and_why_one_did_not():
    from pipeline.bench.gpu.canvas import render_canvas
    from pipeline.bench.gpu.report import render

    ok = {"batch": 1, "steps": 16, "canvases": 2, "ms_per_canvas": 151.26, "tokens_per_s": 1692.4, "tokens": 512,
          "graphs": True, "fused_sampler": True, "captures": 2, "capture_error": None,
          "passes": {"denoise": 32, "commit": 1}, "steps_per_canvas": [16], "warmup_ms_per_round": 31.04,
          "capture_ms_per_round": 40.0, "ms_per_canvas_new_lengths": 402.5, "load_warm_s": 2.54,
          "load_warm_tokens": [1, 129]}  # fmt: skip
    eager = {
        **ok,
        "batch": 4,
        "graphs": False,
        "captures": 0,
        "capture_error": "RuntimeError: operation | not permitted",
        "capture_ms_per_round": None,
        "load_warm_tokens": [],
    }
    row = {"format": "fp8", "batch": 1, "kernels": "k", "ms_eager": 30.0, "ms_graph": 25.0, "floor_ms_spec": 6.2,
           "floor_ms_copy": 7.0, "canvas": ok}  # fmt: skip
    failed = {**row, "batch": 16, "canvas_error": "OutOfMemoryError: CUDA out of memory | tried"}
    del failed["canvas"]
    env = {
        "gpu": "NVIDIA H200",
        "arch": "sm90",
        "memory_gib": 141,
        "driver": "580",
        "torch": "2.11",
        "cuda_version": "13.0",
    }
    table = render({"env": env, "dry_run": False, "checks": [{"name": "fp8 pass", "status": "passed", "seconds": 9,
                                                             "budget_s": 90, "detail": "", "rows": [row, failed]}]})  # fmt: skip
    # beside the pass's 16 graph replays (16 x 25.0 ms) and what a round's eager step and capture cost
    # and the seconds the load's warm-up passes took, with their token counts
    assert (
        "| fp8 | 1 | 16 | 151.3 | 402.5 | 400.0 | 1692 | yes (2) | 31.0 / 40.0 | yes | 32 / 1 | 2.5 (1, 129) |"
        in table
    )
    assert (
        "| fp8 | 4 | 16 | 151.3 | 402.5 | — | 1692 | no: RuntimeError: operation / not permitted | 31.0 / — | yes "
        "| 32 / 1 | 2.5 (none) |" in "\n".join(render_canvas([("fp8", eager, float("nan"))]))
    )
    assert (
        "| fp8 | 16 | — | — | — | — | — | — | — | — | — | OutOfMemoryError: CUDA out of memory / tried |"
        in table
    )
    assert render_canvas([]) == []
