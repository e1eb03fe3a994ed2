"""The dispatch table and the per-pass byte model, checked against the network's own parameter shapes."""

from __future__ import annotations

import pytest
import torch

from pipeline.model.config import ModelConfig
from pipeline.model.network import GROUPED_MM_KERNEL_MAJORS, DiffusionGemma
from pipeline.runtime import dispatch as dp


@pytest.fixture(scope="module")
def cfg26():
    return ModelConfig.from_yaml("diffusiongemma-26b-a4b")


def test_every_format_and_arch_has_one_row_and_fallbacks_say_why():
    assert set(dp.DISPATCH) == {(f, a) for f in dp.FORMATS for a in dp.ARCHS}
    for row in dp.DISPATCH.values():
        if row.native:
            assert row.linear_read == row.expert_read == row.format
        else:
            assert row.note and "B/param" in row.note
        # the name says what the row does: Triton for some passes, for every pass, or not at all
        assert row.triton == ("Triton" in row.experts), row
        assert row.torch_experts == (not row.experts.startswith("Triton")), row
    few = {k for k, r in dp.DISPATCH.items() if r.triton_rows == dp.TRITON_MAX_ROWS_PER_EXPERT}
    every = {k for k, r in dp.DISPATCH.items() if r.triton_rows == dp.EVERY_PASS}
    assert few == {("fp8", "sm90"), ("nvfp4", "sm90")} and all(
        dp.TRITON_MOE in dp.DISPATCH[k].experts for k in few
    )
    # Ada and RTX Blackwell: no grouped GEMM kernel in torch (every one runs on majors 9 and 10 alone, as
    # the network's own check says), so every format's experts take the Triton GEMM, at their own bytes or
    # FP8's (NVFP4); and FP8 on B200, whose FP8 grouped GEMM torch lacks (sm90-only)
    majors = {a: int(a[2:-1]) for a in dp.ARCHS}
    assert set(dp.NO_GROUPED_KERNEL) == {a for a, m in majors.items() if m not in GROUPED_MM_KERNEL_MAJORS}
    no_kernel = {(f, a) for f in dp.FORMATS for a in dp.NO_GROUPED_KERNEL}
    assert every == no_kernel | {("fp8", "sm100")}
    assert (
        dp.dispatch("nvfp4", "sm120").fallback and dp.dispatch("nvfp4", "sm120").expert_read == "fp8_rowwise"
    )
    assert all(dp.DISPATCH[k].expert_read in ("fp8", "fp8_rowwise", "bf16") for k in every)
    assert all(
        dp.DISPATCH[k].experts.startswith(dp.TRITON_BF16) == (k[0] in ("bf16", "int4_awq")) for k in every
    )
    assert dp.dispatch("fp8", "sm90").experts.startswith("F.scaled_grouped_mm FP8 RowWise")
    assert dp.dispatch("nvfp4", "sm100").experts.startswith("F.scaled_grouped_mm NVFP4")
    assert dp.dispatch("nvfp4", "sm90").fallback == "fp8 re-quantization"
    # a second quantized path only where torch's experts kernel may be missing and Triton's FP8 GEMM serves
    # (a torch without its grouped NVFP4 kernels; Thor, compute capability 11.0, dispatched as sm100)
    seconds = {k: r.experts_fallback for k, r in dp.DISPATCH.items() if r.experts_fallback}
    assert seconds == {("nvfp4", "sm100"): dp.TRITON_MOE_EVERY_PASS_REQ}
    assert f"where it fails its probe: {dp.TRITON_MOE_EVERY_PASS_REQ}" in dp.render_dispatch("sm100")
    assert dp.arch_of(11, 0) == "sm100"
    assert dp.arch_of(9, 0) == "sm90" and dp.arch_of(10, 3) == "sm100" and dp.arch_of(8, 0) is None


def test_bf16_weight_bytes_are_the_networks_parameters(cfg26):
    """At batch 16 every expert is touched: linears + experts + embedding/router/self-conditioning equal
    the meta model's matrices at 2 bytes (embedding counted twice: LM head and soft embedding)."""
    with torch.device("meta"):
        model = DiffusionGemma(cfg26)
    c = cfg26.text_config
    mats = {n: p.numel() for n, p in model.named_parameters() if p.dim() >= 2}
    experts = sum(v for n, v in mats.items() if ".experts." in n)
    router = sum(v for n, v in mats.items() if ".router." in n)
    sc = sum(v for n, v in mats.items() if n.startswith("self_conditioning"))
    emb = mats["embed_tokens.weight"]
    linears = sum(mats.values()) - experts - router - sc - emb
    b = dp.pass_bytes(c, "bf16", "bf16", batch=16)
    assert b.linears == 2 * linears
    assert b.experts == pytest.approx(2 * experts, rel=1e-9)
    assert b.high_precision == 2 * (2 * emb + router + sc)
    fp8 = dp.pass_bytes(c, "fp8", "fp8", batch=16)
    assert fp8.linears == linears and fp8.experts == pytest.approx(experts, rel=1e-9)
    nv = dp.pass_bytes(c, "nvfp4", "nvfp4", batch=16)
    assert nv.experts == pytest.approx(experts * 0.5625, rel=1e-9)  # 4 bits + an 8-bit scale per 16


def test_activation_bytes_are_every_gemms_input_and_output_and_attentions_operands(cfg26):
    """Counted from the meta model's modules: each GEMM's input (siblings read theirs once: q, k, v; gate,
    up) and output once per token (the routed experts' per slot), and attention's Q, K, V read and output
    written once; bf16."""
    with torch.device("meta"):
        model = DiffusionGemma(cfg26)
    c, tokens = cfg26.text_config, 3 * 256
    mlp = lambda m: (
        m.gate_proj.in_features
        + 2 * m.gate_proj.out_features
        + m.down_proj.in_features
        + m.down_proj.out_features
    )
    per_token = 0
    for layer in model.layers:
        a = layer.self_attn
        qkv = [m for m in (a.q_proj, a.k_proj, a.v_proj) if m is not None]  # global layers: V is K
        per_token += (
            a.q_proj.in_features
            + sum(m.out_features for m in qkv)
            + a.o_proj.in_features
            + a.o_proj.out_features
        )
        per_token += 2 * a.q_proj.out_features + 2 * a.k_proj.out_features  # Q, K, V read; output written
        per_token += mlp(layer.mlp)
        _, two_i, d = layer.experts.gate_up_proj.shape
        per_token += c.top_k_experts * (d + two_i + two_i // 2 + d)
    per_token += mlp(model.self_conditioning)
    assert dp.pass_bytes(c, "fp8", "fp8", batch=3).activations == 2 * tokens * per_token


def test_experts_touched_and_kv_and_floor(cfg26):
    c = cfg26.text_config
    assert dp.experts_touched(c, 1) == pytest.approx(c.top_k_experts)
    assert dp.experts_touched(c, 256) > 127.9
    kv = dp.pass_bytes(c, "bf16", "bf16", 1, past=2048).kv - dp.pass_bytes(c, "bf16", "bf16", 1).kv
    # the network's pass alone (what `dgpipe bench gpu` times): no sampler traffic, no second table read
    step, net = (
        dp.pass_bytes(c, "fp8", "fp8", 16, past=256),
        dp.pass_bytes(c, "fp8", "fp8", 16, past=256, step=False),
    )
    tokens, table = 16 * 256, c.vocab_size * c.hidden_size * 2
    assert step.logits - net.logits == tokens * c.vocab_size * (4 + 2 + 2)
    assert step.high_precision - net.high_precision == table
    assert (step.linears, step.experts, step.kv, step.activations) == (
        net.linears,
        net.experts,
        net.kv,
        net.activations,
    )
    sliding = sum(c.layer_shape(i).is_sliding for i in range(c.num_hidden_layers))
    per_tok = {
        s: c.layer_shape(i).num_kv_heads * c.layer_shape(i).head_dim * 4
        for i in range(6)
        for s in [c.layer_shape(i).is_sliding]
    }
    assert kv == sliding * 1023 * per_tok[True] + (c.num_hidden_layers - sliding) * 2048 * per_tok[False]
    assert dp.floor_ms(4.8e9, "H200-SXM-141GB") == pytest.approx(1.0)


def test_floor_table_fp8_hopper_and_nvfp4_b200_read_their_floor(cfg26):
    rows = {(r.gpu, r.format, r.batch): r for r in dp.floor_table(cfg26.text_config)}
    for key in (("H100-SXM5-80GB", "fp8", 1), ("H200-SXM-141GB", "fp8", 16), ("B200-180GB", "nvfp4", 1)):
        assert rows[key].ratio == 1.0
    assert rows["H200-SXM-141GB", "nvfp4", 1].ratio > 1.4  # the named fallback costs bytes
    assert "| H200-SXM-141GB | fp8 | 1 |" in dp.render_floor_table(list(rows.values()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_doctor_says_no_cuda_on_cpu():
    from pipeline.doctor import check_tensor_cores

    (row,) = check_tensor_cores()
    assert (row.name, row.ok, row.detail) == ("tensor cores", False, "no CUDA")


@pytest.mark.parametrize(
    ("capability", "gpu"), [((11, 0), "NVIDIA Thor"), ((12, 0), "NVIDIA GeForce RTX 5090")]
)
def test_doctor_names_the_nvfp4_experts_path_a_load_takes(monkeypatch, tmp_path, capability, gpu):
    """On sm100 (Thor, compute capability 11.0, included) an NVFP4 load runs the experts on the row's second
    path where torch's grouped NVFP4 GEMM fails its probe (Triton FP8, re-quantized); on RTX Blackwell, which
    torch's grouped GEMMs refuse, on that path always, a named fallback. Doctor's row says so, as the
    dispatch table does."""
    from pipeline import doctor
    from pipeline.runtime import probe as probing

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    monkeypatch.setenv("DGPIPE_CACHE", str(tmp_path))
    arch = dp.arch_of(*capability)
    ran = probing.Probe(arch, {"linear:nvfp4": None, "experts:nvfp4": "no kernel image"})
    monkeypatch.setattr(probing, "probe", lambda device: ran)
    checks = {c.name: c for c in doctor.check_tensor_cores()}
    row = checks["nvfp4 dispatch"]
    if arch == "sm100":
        assert row.ok and row.hint == ""
        assert row.detail.endswith(f"; where it fails its probe: {dp.TRITON_MOE_EVERY_PASS_REQ}")
        # Thor takes B200's rows, but not torch's grouped GEMMs: said once, with what the load does instead
        grouped = checks["torch grouped GEMMs"]
        assert not grouped.ok and grouped.detail.startswith("compute capability 11.0 takes sm100's rows")
        assert "Triton MoE GEMM" in grouped.hint
    else:
        assert not row.ok and row.detail.endswith(f"experts {dp.TRITON_MOE_EVERY_PASS_REQ}")
        assert row.hint.startswith("fallback experts: fp8 re-quantization: torch's grouped GEMMs run on")
    assert dp.TRITON_MOE_EVERY_PASS_REQ in dp.render_dispatch(arch)


def test_doctor_on_a_gpu_host_lists_the_rows_and_what_the_probe_ran(monkeypatch, tmp_path):
    """On an H200 (patched in): one line per format's row, the MoE GEMM's tile tables, then one per probed
    kernel, a failure with its error; a probe that cannot run at all is one failed line, not a traceback."""
    from pipeline import doctor
    from pipeline.runtime import probe as probing

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setenv("DGPIPE_CACHE", str(tmp_path))
    (tmp_path / "moe_tiles").mkdir()
    (tmp_path / "moe_tiles" / "NVIDIA_H200-bf16.yaml").write_text("device: NVIDIA H200\n")
    ran = probing.Probe("sm90", {"linear:fp8": None, "triton:fp8": "out of resources: shared memory"})
    monkeypatch.setattr(probing, "probe", lambda device: ran)
    checks = {c.name: c for c in doctor.check_tensor_cores()}
    assert (
        checks["gpu spec"].ok
        and checks["gpu spec"].detail == "NVIDIA H200: H200-SXM-141GB, 141 GiB, 4.8 TB/s"
    )
    unlisted = doctor.check_gpu_spec("NVIDIA H20")
    assert (
        not unlisted.ok and "not in configs/targets" in unlisted.detail and "configs/targets" in unlisted.hint
    )
    assert [n for n in checks if n.endswith("dispatch")] == [f"{f} dispatch" for f in dp.FORMATS]
    assert checks["fp8 dispatch"].ok and not checks["nvfp4 dispatch"].ok  # Hopper: NVFP4 on its fallback
    assert checks["fp8 dispatch"].hint == "" and checks["nvfp4 dispatch"].hint.startswith(
        "fallback fp8 re-quantization: Hopper has no FP4 tensor cores"
    )
    assert checks["kernel linear:fp8"].ok and checks["kernel linear:fp8"].detail == "ran on tiny operands"
    triton = checks["kernel triton:fp8"]
    assert not triton.ok and triton.detail == "out of resources: shared memory" and "fallback" in triton.hint
    tiles_fp8, tiles_bf16 = checks["moe tiles fp8"], checks["moe tiles bf16"]
    assert tiles_fp8.ok and tiles_fp8.detail == "default tiles" and "dgpipe bench moe-tiles" in tiles_fp8.hint
    assert not tiles_bf16.ok and "NVIDIA_H200-bf16.yaml is not valid" in tiles_bf16.detail

    def broken(device):
        raise RuntimeError("CUDA error: no kernel image is available")

    monkeypatch.setattr(probing, "probe", broken)
    (line,) = [c for c in doctor.check_tensor_cores() if "probe" in c.name]
    assert (line.name, line.ok) == ("kernel probe", False) and "no kernel image" in line.detail


def test_docs_show_the_tables_the_code_computes(cfg26):
    from pathlib import Path

    doc = (Path(__file__).parents[3] / "docs" / "engine.md").read_text()
    assert dp.render_dispatch() in doc
    assert dp.render_floor_table(dp.floor_table(cfg26.text_config)) in doc


def test_flop_parts_are_two_flops_per_weight_and_token(cfg26):
    """The linears' and experts' FLOPs are 2 per weight per token (per routed slot for the experts), the
    weights counted from the meta model; the parts add up to the whole pass's count."""
    from pipeline.model.cost import denoise_pass_flop_parts, denoise_pass_flops

    with torch.device("meta"):
        model = DiffusionGemma(cfg26)
    c, tokens = cfg26.text_config, 3 * 256
    mats = {n: p.numel() for n, p in model.named_parameters() if p.dim() >= 2}
    linears = sum(v for n, v in mats.items() if ".self_attn." in n or ".mlp." in n)
    experts = sum(v for n, v in mats.items() if ".experts." in n)
    f = denoise_pass_flop_parts(c, 3, 256, 100)
    assert f.linears == 2 * tokens * linears
    assert f.experts == 2 * tokens * c.top_k_experts * experts // c.num_experts
    assert f.total == denoise_pass_flops(c, 3, 256, 100)
    assert denoise_pass_flop_parts(c, 3, 256, 100, routed=False).experts == 2 * tokens * experts
    # the network's pass alone: without the next step's soft embedding (probs @ E)
    net = denoise_pass_flop_parts(c, 3, 256, 100, step=False)
    assert f.other - net.other == 2 * tokens * c.vocab_size * c.hidden_size and net.experts == f.experts


def test_compute_floor_runs_each_part_at_its_formats_rate(cfg26):
    """FP8 on an H200: linears and experts at 1,979 TFLOPS, the rest at 989; one canvas is bound by memory,
    16 by compute (25.8 ms of matmuls against 13.9 ms of bytes); a rate the GPU entry lacks gives None."""
    from pipeline.model.cost import denoise_pass_flop_parts

    c = cfg26.text_config
    f = denoise_pass_flop_parts(c, 16, 256, 0)
    fp8 = dp.compute_ms(c, dp.dispatch("fp8", "sm90"), 16, "H200-SXM-141GB")
    assert fp8 == pytest.approx(((f.linears + f.experts) / 1979e12 + f.other / 989e12) * 1e3)
    bf16 = dp.compute_ms(c, dp.dispatch("bf16", "sm90"), 16, "H200-SXM-141GB")
    assert bf16 == pytest.approx(f.total / 989e12 * 1e3)
    # B200's FP8 experts on the Triton GEMM: linears and experts at FP8's rate
    b200 = dp.compute_ms(c, dp.dispatch("fp8", "sm100"), 16, "B200-180GB")
    assert b200 == pytest.approx(((f.linears + f.experts) / 4500e12 + f.other / 2250e12) * 1e3)
    assert dp.compute_ms(c, dp.dispatch("nvfp4", "sm120"), 16, "RTX-PRO-6000-Blackwell") is None
    rows = {(r.gpu, r.format, r.batch): r for r in dp.floor_table(c)}
    assert rows["H200-SXM-141GB", "fp8", 1].bound == "memory"
    h200_16 = rows["H200-SXM-141GB", "fp8", 16]
    assert h200_16.bound == "compute" and h200_16.compute_ms == pytest.approx(fp8)
    assert 25 < h200_16.compute_ms < 27 and 13.5 < h200_16.path_ms < 14
    assert rows["RTX-PRO-6000-Blackwell", "fp8", 16].bound == "—"
