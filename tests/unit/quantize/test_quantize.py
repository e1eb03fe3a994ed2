"""Quantization with ModelOpt: export layout, dequantization and activation fake-quant against ModelOpt's own
math, the runtime on exported checkpoints, bad input, the memory planner CLI and the gate.

One module-scoped fixture quantizes the embedded model to fp8, int4_awq and nvfp4 (small calibration) and
keeps what ModelOpt's in-memory model computes, so the exported artifact is checked against it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "modelopt.torch.quantization", reason="nvidia-modelopt not installed (pip install -e '.[quantize]')"
)
pytest.importorskip("transformers", reason="transformers not installed")
from pipeline.errors import DgpipeError
from pipeline.model import fake_quant
from pipeline.model import modelopt as dequant
from pipeline.resources import EMBEDDED_MODEL

pytestmark = pytest.mark.slow  # ModelOpt calibrates every precision once per module: minutes on 2 cores

PROBES = ("model.decoder.layers.0.self_attn.q_proj", "model.decoder.layers.5.mlp.down_proj")


def _cli(*args: str):
    from typer.testing import CliRunner

    from pipeline.cli import app

    return CliRunner().invoke(app, list(args))


def _user_error(monkeypatch, capsys, *args: str) -> str:
    """Run the console entry point (where errors are mapped); assert exit code 2 and one `error:` line on
    stderr (not a traceback: CliRunner would report an uncaught exception as a non-zero exit too)."""
    import sys

    from pipeline.cli import main

    monkeypatch.setattr(sys, "argv", ["dgpipe", *args])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 2, (e.value.code, err)
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    return err


# ---- pure math against ModelOpt -----------------------------------------------------------------------
def test_nvfp4_weight_dequant_matches_modelopt_qtensor():
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)) * 0.05
    q, scale, scale2 = NVFP4QTensor.quantize(w.clone(), 16)
    ref = q.dequantize(dtype=torch.float32, scale=scale, double_scale=scale2, block_sizes={-1: 16})
    parts = {"weight_scale": scale, "weight_scale_2": scale2}
    ours = dequant.dequantize_weight("NVFP4", q._quantized_data, parts.get)
    assert q._quantized_data.dtype == torch.uint8 and tuple(q._quantized_data.shape) == (32, 32)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=1e-9)  # same codes and scales
    assert (ours - w).abs().max() < 0.25 * w.abs().max()  # and it is a quantization of w


def test_e2m1_rounding_ties_to_even():
    a = torch.tensor([0.0, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 9.0])
    expected = [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0]
    assert fake_quant.e2m1_round(a).tolist() == expected


def test_nvfp4_activation_fake_quant_equals_modelopt_block_math():
    """Dynamic per-16 E4M3 block scales under the static global scale, as ModelOpt's export quantizes."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    x = torch.randn(8, 96, generator=torch.Generator().manual_seed(1)) * 3
    gs = x.abs().amax() / (6 * 448)
    q, scale, _ = NVFP4QTensor.quantize(x.clone(), 16, weights_scaling_factor_2=gs)
    ref = q.dequantize(dtype=torch.float32, scale=scale, double_scale=gs, block_sizes={-1: 16})
    torch.testing.assert_close(fake_quant.nvfp4_fake_quant(x, gs), ref, rtol=0, atol=1e-6)


def test_fp8_activation_fake_quant_matches_modelopt_quantizer():
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2)) * 5
    amax = torch.tensor(12.0)
    tq = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3), axis=None), amax=amax)
    torch.testing.assert_close(fake_quant.fp8_fake_quant(x, amax / 448), tq(x), rtol=0, atol=1e-5)


def test_int4_unpack_low_nibble_is_even_row():
    packed = torch.tensor([[0x21, 0xF8]], dtype=torch.uint8)  # rows (1, 2) in col 0; rows (-8, -1) in col 1
    assert dequant.unpack_int4_rows(packed).tolist() == [[1, -8], [2, -1]]


# ---- the embedded model quantized once per format ---------------------------------------------------
@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> dict[str, dict]:
    """fp8, int4_awq, nvfp4 exports (fp32 unquantized tensors, so only quantization differs) plus what
    ModelOpt's in-memory model computes: fake-quant probe weights and, where its CPU forward runs, logits."""
    from quantize.run import QuantizeOptions, quantize_checkpoint

    out: dict[str, dict] = {}
    root = tmp_path_factory.mktemp("quantized")
    prompt = torch.tensor([[2, 5, *([6] * 81), 7]])  # fixed prompt and canvas, same for both implementations
    canvas = torch.randint(0, 24, (1, 82), generator=torch.Generator().manual_seed(3))
    for p in ("fp8", "int4_awq", "nvfp4"):
        rec: dict = {"prompt": prompt, "canvas": canvas}

        def grab(model, rec=rec, p=p):
            with torch.no_grad():
                rec["fq"] = (
                    {
                        n: model.get_submodule(n).weight_quantizer(model.get_submodule(n).weight)
                        for n in PROBES
                    }
                    if p != "nvfp4"
                    else {}
                )
                if p != "nvfp4":  # ModelOpt's NVFP4 forward needs CUDA
                    # the export max-merges the input amax of the tied encoder/decoder copies of a linear
                    # (one input_scale per weight); give the in-memory model the same scales
                    iq = {
                        n: m
                        for n, m in model.named_modules()
                        if n.endswith("input_quantizer") and m.is_enabled
                    }
                    for n, q in iq.items():
                        d = n.replace("model.encoder.language_model.", "model.decoder.")
                        if d != n and d in iq:
                            q.amax = iq[d].amax = torch.maximum(q.amax, iq[d].amax)
                    pkv = model.model.encoder(input_ids=prompt).past_key_values
                    rec["logits"] = model(decoder_input_ids=canvas, past_key_values=pkv).logits.float()

        res = quantize_checkpoint(
            QuantizeOptions(EMBEDDED_MODEL, p, root / p, calib_size=8, calib_steps=4, export_dtype="float32"),
            on_quantized=grab,
        )
        rec["path"] = Path(res.output)
        out[p] = rec
    return out


def _runtime_logits(model, prompt, canvas):
    from quantize.report import CanvasSet, denoise_logits

    return denoise_logits(model, CanvasSet(prompt, canvas), None)


def test_export_layout_is_modelopt_and_vllm_readable(quantized):
    from safetensors import safe_open

    nv = quantized["nvfp4"]["path"]
    hq = json.loads((nv / "hf_quant_config.json").read_text())["quantization"]
    cfg = json.loads((nv / "config.json").read_text())
    assert hq["quant_algo"] == "NVFP4" and cfg["quantization_config"]["quant_method"] == "modelopt"
    with safe_open(nv / "model.safetensors", "pt") as f:
        names = set(f.keys())
        e = "model.decoder.layers.0.experts.3.down_proj"
        assert f.get_tensor(f"{e}.weight").dtype == torch.uint8
        assert tuple(f.get_tensor(f"{e}.weight").shape) == (96, 48)  # [out, in/2]
        assert f.get_tensor(f"{e}.weight_scale").dtype == torch.float8_e4m3fn
        assert tuple(f.get_tensor(f"{e}.weight_scale").shape) == (96, 6)  # one per 16 inputs
        assert f.get_tensor(f"{e}.weight_scale_2").dtype == torch.float32
        assert f.get_tensor(f"{e}.input_scale").dtype == torch.float32
        # kept high precision by the recipe: router, embedding, norms, self-conditioning
        for kept in (
            "model.decoder.layers.0.router.proj.weight",
            "model.decoder.self_conditioning.gate_proj.weight",
            "model.decoder.embed_tokens.weight",
        ):
            assert (
                f.get_tensor(kept).dtype == torch.float32
                and kept.replace("weight", "weight_scale") not in names
            )
    assert not any("vision" in n for n in names)  # the source had no vision tower
    i4 = json.loads((quantized["int4_awq"]["path"] / "hf_quant_config.json").read_text())["quantization"]
    assert i4["quant_algo"] == "W4A16_AWQ" and i4["group_size"] == 32 and i4["pre_quant_scale"] is False
    assert (quantized["fp8"]["path"] / "dgpipe.json").is_file() and (
        quantized["fp8"]["path"] / "tokenizer.json"
    ).is_file()


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_the_runtime_tests_checkpoints_are_laid_out_as_modelopts_export(quantized, tmp_path, fmt):
    """tests/_utils/quantized.py writes FP8 and NVFP4 checkpoints of the embedded model without ModelOpt
    (tests/gpu run them on GPU hosts that have none): every tensor's name, dtype and shape, and the quantizer
    named in both configs, as ModelOpt's own export of the same model has them."""
    from safetensors import safe_open

    from tests._utils.quantized import build_quantized_checkpoint

    def layout(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
        out = {}
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                names = h.keys()  # a safe_open handle is not iterable
                out |= {k: (h.get_slice(k).get_dtype(), tuple(h.get_slice(k).get_shape())) for k in names}
        return out

    real, ours = quantized[fmt]["path"], build_quantized_checkpoint(tmp_path / fmt, fmt)
    assert layout(ours) == layout(real) and len(layout(real)) > 100
    for name, keys in (
        ("config.json", ("quantization_config",)),
        ("hf_quant_config.json", ("quantization",)),
    ):
        want, got = json.loads((real / name).read_text()), json.loads((ours / name).read_text())
        for key in keys:
            assert got[key]["quant_algo"] == want[key]["quant_algo"] == fmt.upper()
    assert json.loads((ours / "config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_modelopts_export_gives_sibling_linears_one_input_scale(quantized, fmt):
    """What the GPU path's shared inputs rest on (`pipeline.runtime.shared_input`), in files ModelOpt wrote:
    q, k and v have one input scale, gate and up one (`preprocess_linear_fusion`), so each group shares one
    quantization; NVFP4 siblings also share the global weight scale (gate and up: one GEMM), FP8 ones keep a
    weight scale each (gate and up: a GEMM each)."""
    from pipeline.runtime.shared_input import concatenates, shares_quantization
    from pipeline.runtime.tensor_cores import ScaledLinear

    packed = dequant.read_packed_linears(quantized[fmt]["path"])
    mode = "fp8" if fmt == "fp8" else "nvfp4"
    linear = lambda name: ScaledLinear(packed[name], mode, torch.device("cpu"), torch.float32)
    layers = {int(n.split(".")[1]) for n in packed}
    assert layers
    for i in sorted(layers):
        attn = [n for n in (f"layers.{i}.self_attn.{p}_proj" for p in "qkv") if n in packed]
        gate_up = [linear(f"layers.{i}.mlp.{p}_proj") for p in ("gate", "up")]
        assert len(attn) >= 2 and shares_quantization([linear(n) for n in attn])
        assert shares_quantization(gate_up) and concatenates(gate_up) == (fmt == "nvfp4")


@pytest.mark.parametrize("fmt", ["fp8", "int4_awq"])
def test_dequantized_weights_equal_modelopt_fake_quant(quantized, fmt):
    from pipeline.model.checkpoint import load_model

    rec = quantized[fmt]
    model, _ = load_model(rec["path"])
    for name in PROBES:
        ours = model.get_submodule(name.replace("model.decoder.", "")).weight
        torch.testing.assert_close(ours, rec["fq"][name].float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fmt", ["fp8", "int4_awq"])
def test_runtime_forward_matches_modelopt_forward(quantized, fmt):
    """dgpipe's runtime on the exported files vs ModelOpt's in-memory fake-quant model: far closer to each
    other than either is to the unquantized model. Mean gaps carry the claim; the max gap is looser because
    fp32 summation-order noise (it differs between transformers releases) can tip a single activation
    across an FP8 rounding step."""
    from pipeline.model.checkpoint import load_model

    rec = quantized[fmt]
    q_model, _ = load_model(rec["path"])
    base, _ = load_model(EMBEDDED_MODEL)
    ours = _runtime_logits(q_model, rec["prompt"], rec["canvas"])
    unquantized = _runtime_logits(base, rec["prompt"], rec["canvas"])
    gap, effect = (ours - rec["logits"]).abs(), (unquantized - rec["logits"]).abs()
    assert effect.max() > 1e-3
    assert gap.mean() < 0.01 * effect.mean(), (float(gap.mean()), float(effect.mean()))
    assert gap.max() < 0.05 * effect.max(), (float(gap.max()), float(effect.max()))
    assert (ours.argmax(-1) == rec["logits"].argmax(-1)).float().mean() >= 0.99


def test_nvfp4_checkpoint_hooks_activations_and_solves(quantized):
    from pipeline.demo import sudoku
    from pipeline.demo.evaluate import eval_sudoku
    from pipeline.model.checkpoint import load_model

    model, _ = load_model(quantized["nvfp4"]["path"])
    assert model.layers[0].self_attn.q_proj._forward_pre_hooks  # activation fake-quant installed
    rep = eval_sudoku(model, sudoku.make_dataset(20_000, 10, (45, 61)), (45, 61))
    assert rep.solve_rate >= 0.7


def test_generate_and_eval_cli_on_quantized_dir(quantized):
    d = str(quantized["nvfp4"]["path"])
    puzzle = "14...9..56925.31.8835.1.927..1732.5.259.6.7.437694.28....6.4.935.3.914..92....816"
    r = _cli("generate", puzzle, "--model", d, "--device", "cpu", "--json")
    assert r.exit_code == 0, r.output
    r = _cli("eval", "sudoku", "--model", d, "--n", "4", "--device", "cpu", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["n"] == 4, r.output


# ---- calibration path ----------------------------------------------------------------------------------
def test_calibration_loop_runs_prefill_denoise_with_self_conditioning_and_commit():
    from transformers import DiffusionGemmaForBlockDiffusion

    from pipeline.demo.prompt_format import SudokuFormat
    from quantize.calibrate import make_forward_loop
    from quantize.defaults import CALIB_SEED

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32).eval()
    calls: list[str] = []
    sc_seen: list[bool] = []
    model.model.encoder.register_forward_hook(lambda *a: calls.append("enc"))
    model.model.decoder.register_forward_pre_hook(
        lambda m, args, kw: (
            calls.append("dec"),
            sc_seen.append(kw.get("self_conditioning_logits") is not None),
        )[0],
        with_kwargs=True,
    )
    make_forward_loop(SudokuFormat().calibration_prompts(2, CALIB_SEED), steps=3, batch=2)(model)
    assert calls == ["enc", "dec", "dec", "dec", "enc"]  # prefill, 3 denoise steps, commit
    assert sc_seen == [False, True, True]


# ---- bad input, atomic output, planner CLI, gate ----------------------------------------------------------
def test_bad_input_is_one_clear_error(tmp_path, monkeypatch, capsys):
    from quantize.run import QuantizeOptions, quantize_checkpoint

    out = tmp_path / "q"
    for opts, msg in [
        (QuantizeOptions(EMBEDDED_MODEL, "fp4", out), "unknown precision 'fp4'"),
        (QuantizeOptions(tmp_path / "missing", "fp8", out), "no such checkpoint directory"),
        (QuantizeOptions(EMBEDDED_MODEL, "fp8", out, calib_data=tmp_path / "none.jsonl"), "no such file"),
        (QuantizeOptions(EMBEDDED_MODEL, "nvfp4", out, target="hopper"), "use --precision fp8"),
        (QuantizeOptions(EMBEDDED_MODEL, "fp8", out, kv_cache="int8"), "--kv-cache"),
    ]:
        with pytest.raises(DgpipeError, match=msg):
            quantize_checkpoint(opts)
    bad = tmp_path / "calib.jsonl"
    bad.write_text("\nnot json\n")
    with pytest.raises(DgpipeError, match="line 2 is not a JSON object with a 'text' field"):
        quantize_checkpoint(QuantizeOptions(EMBEDDED_MODEL, "fp8", out, calib_data=bad))
    assert not out.exists() and not list(tmp_path.glob(".q.*"))  # nothing half-written
    err = _user_error(
        monkeypatch, capsys, "quantize", "--precision", "nvfp4", "--target", "hopper", "--output", str(out)
    )
    assert "nvfp4 does not run natively on sm90" in err and "use --precision fp8" in err
    assert not out.exists()


def test_failed_export_leaves_no_output(tmp_path, monkeypatch):
    import modelopt.torch.export as mexp

    from quantize.run import QuantizeOptions, quantize_checkpoint

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(mexp, "export_hf_checkpoint", boom)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(
            QuantizeOptions(EMBEDDED_MODEL, "fp8", tmp_path / "q", calib_size=2, calib_steps=1)
        )
    assert list(tmp_path.iterdir()) == []


def test_estimate_cli_26b_figures(monkeypatch, capsys):
    r = _cli("quantize", "--estimate", "--config", "diffusiongemma-26b-a4b", "--target", "sm120", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    w = {x["precision"]: x["bytes"] for x in data["weights"]}
    assert w["nvfp4"] < 18e9 and 25e9 < w["fp8"] < 27e9 and w["bf16"] > 50e9
    assert any(s["gpu"] == "RTX-5090" and s["precision"] == "nvfp4" and s["fits"] for s in data["serving"])
    err = _user_error(
        monkeypatch, capsys, "quantize", "--estimate", "--precision", "nvfp4", "--target", "hopper"
    )
    assert "nvfp4 does not run natively on sm90" in err and "use --precision fp8" in err


def test_gate_fails_with_a_clear_message():
    from quantize.report import Row, gate

    row = lambda p, rate, drop: Row(p, "", 0, rate, rate, 3.0, 4.0, 0.0, drop)
    gate([row("bf16", 0.9, 0.0), row("fp8", 0.89, 1.0)], 2.0)
    with pytest.raises(DgpipeError, match=r"nvfp4 85.0% \(\+5.0 points below bf16\).*allowed drop is 2.0"):
        gate([row("bf16", 0.9, 0.0), row("nvfp4", 0.85, 5.0)], 2.0)


def test_text_checkpoint_with_calib_jsonl(tiny_checkpoint, tmp_path):
    """A non-Sudoku checkpoint calibrates on --calib-data text (its tokenizer and prompt format) and the
    export loads and denoises in dgpipe's runtime."""
    from pipeline.model.checkpoint import load_model
    from quantize.run import QuantizeOptions, quantize_checkpoint

    data = tmp_path / "calib.jsonl"
    data.write_text(
        "\n".join(json.dumps({"text": t}) for t in ["123456789", "987654321", "555111999"]) + "\n"
    )
    res = quantize_checkpoint(
        QuantizeOptions(
            tiny_checkpoint, "nvfp4", tmp_path / "q", calib_data=data, calib_size=2, calib_steps=2
        )
    )
    assert res.calib_prompts == 2 and res.block_size == 16
    model, _ = load_model(res.output)
    logits = _runtime_logits(model, torch.tensor([[2, 5, 6, 7]]), torch.randint(0, 24, (1, 8)))
    assert torch.isfinite(logits).all() and logits.shape == (1, 8, 24)
    with pytest.raises(DgpipeError, match="no default calibration set"):
        quantize_checkpoint(QuantizeOptions(tiny_checkpoint, "fp8", tmp_path / "q2"))


def test_mtq_config_from_recipe_and_flags():
    from pipeline.targets import precision
    from quantize.recipe import build_mtq_config, choose_block_size

    cfg = build_mtq_config(precision("int4_awq"), ["model.decoder.layers.0.*"], "fp8", block_size=32)
    rules = cfg["quant_cfg"]
    off = {r["quantizer_name"] for r in rules if r.get("enable") is False}
    assert {"*router*", "*self_conditioning*", "*embed_tokens*"} <= off  # recipe keep_high_precision
    assert {"model.decoder.layers.0.*", "model.encoder.language_model.layers.0.*"} <= off  # tied copy too
    assert (
        next(r for r in rules if r["quantizer_name"] == "*weight_quantizer")["cfg"]["block_sizes"][-1] == 32
    )
    assert any(r["quantizer_name"] == "*[kv]_bmm_quantizer" for r in rules)
    assert cfg["algorithm"] == "max"  # RTN: AWQ's per-tree smoothing cannot export tied weights
    assert choose_block_size(precision("int4_awq"), {2816, 704, 2112}) == 64  # the 26B model
    assert choose_block_size(precision("int4_awq"), {96, 192}) == 32  # the embedded model
    with pytest.raises(DgpipeError, match="no block size"):
        choose_block_size(precision("int4_awq"), {100})


def test_e2m1_rounding_equals_the_nearest_magnitude_table():
    """Against the table lookup it replaced (nearest of the 8 magnitudes, the even one at a midpoint), on
    random values and every decision point with its neighbours."""
    g = torch.Generator().manual_seed(0)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    a = torch.cat(
        [torch.rand(10_000, generator=g) * 7, mids, mids.nextafter(mids + 1), mids.nextafter(mids - 1)]
    )
    dist = (a[:, None] - fake_quant.E2M1_VALUES).abs()
    nearest = fake_quant.E2M1_VALUES[dist.argmin(-1)]  # argmin takes the first (lower) value at a tie
    tie_up = torch.isin(a, torch.tensor([0.75, 1.75, 3.5]))
    want = torch.where(tie_up, fake_quant.E2M1_VALUES[(dist.argmin(-1) + 1).clamp(max=7)], nearest)
    assert torch.equal(fake_quant.e2m1_round(a), want)


def test_nvfp4_fake_quant_uses_no_tensor_from_another_device():
    """CUDA graph capture refuses host-to-device copies: on a meta input every op's tensors stay on meta."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Devices(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat = [*args, *(kwargs or {}).values()]
            self.seen |= {t.device.type for t in flat if isinstance(t, torch.Tensor)}
            return func(*args, **(kwargs or {}))

    with Devices() as mode:
        fake_quant.nvfp4_fake_quant(torch.empty(4, 32, device="meta"), torch.empty((), device="meta"))
    assert mode.seen == {"meta"}
