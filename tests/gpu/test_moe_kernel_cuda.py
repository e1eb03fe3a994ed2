"""The routed-experts kernel (dg_moe.cu) on a GPU against its PyTorch oracle (moe_reference, float64).

It loads the plugin PTX that an engine for this GPU's target embeds (pipeline/engine/ptx.py) through the
CUDA driver, as TensorRT does, and launches each entry point with the grid, block, shared memory and extra
arguments that plugin.py's aot_impl computes (moe_spec), at the 26B-A4B expert shapes (d 2816, I 704,
top-8) with 32 experts."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import pytest
import torch

from pipeline.engine import moe_spec
from pipeline.engine.kernels.moe_reference import moe_experts_reference
from pipeline.sampler.kernels.build import find_nvcc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
    pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc (compiles the plugin PTX)"),
]

D, INTER, E, K = 2816, 704, 32, 8


@pytest.fixture(scope="module")
def module(tmp_path_factory: pytest.TempPathFactory):
    cu = pytest.importorskip("cuda.bindings.driver", reason="needs cuda-python (pip install cuda-python)")
    from pipeline.engine.ptx import build_plugin_ptx
    from pipeline.targets import target_for_compute_capability

    major, minor = torch.cuda.get_device_capability()
    t = target_for_compute_capability(f"{major}.{minor}")
    if t is None:
        pytest.skip(f"cc {major}.{minor} has no dgpipe target: no plugin PTX for this GPU")
    root = tmp_path_factory.mktemp("plugins")
    info = build_plugin_ptx(root, t.name)
    torch.zeros(1, device="cuda")  # torch's primary context is current
    err, mod = cu.cuModuleLoadData(Path(root / t.name / info.file).read_bytes() + b"\0")
    assert err == cu.CUresult.CUDA_SUCCESS, err
    return cu, mod


def launch(module, op: str, hidden, index, weight, *weights_and_scales) -> torch.Tensor:
    cu, mod = module
    x_dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[hidden.dtype]
    entry = moe_spec.kernel(op, x_dtype)
    err, fn = cu.cuModuleGetFunction(mod, entry.encode())
    assert err == cu.CUresult.CUDA_SUCCESS, err
    tokens, k = index.shape
    tile = moe_spec.tile(D, INTER, x_dtype)
    out = torch.full((tokens, k, D), float("nan"), device="cuda")  # every row must be written
    ptrs = [t.data_ptr() for t in (hidden, index, weight, *weights_and_scales)]
    extras = [tokens, k, D, INTER, E, tile]
    vals = (
        [ctypes.c_void_p(p) for p in ptrs]
        + [ctypes.c_int(v) for v in extras]
        + [ctypes.c_void_p(out.data_ptr())]
    )
    params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
    splits = min(-(-tokens // moe_spec.TOKENS_PER_SPLIT), moe_spec.MAX_SPLITS)
    stream = torch.cuda.current_stream().cuda_stream
    (err,) = cu.cuLaunchKernel(
        fn, E, splits, 1, moe_spec.THREADS, 1, 1, moe_spec.shared_bytes(D, INTER, x_dtype, tile), stream,
        ctypes.addressof(params), 0,
    )  # fmt: skip
    assert err == cu.CUresult.CUDA_SUCCESS, err
    torch.cuda.synchronize()
    return out.cpu()


def routing(tokens: int, skew: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, E, generator=g)
    if skew:  # every token picks expert 0: one expert's blocks run many tiles (buffer carry-over)
        logits[:, 0] += 100
    w, idx = torch.softmax(logits, -1).topk(K, -1)
    return idx, (w / w.sum(-1, keepdim=True)).float()


def weights(dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(E, 2 * INTER, D, generator=g) * D**-0.5).to(dtype)
    dn = (torch.randn(E, D, INTER, generator=g) * INTER**-0.5).to(dtype)
    return gu, dn


def check(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    assert not torch.isnan(got).any()
    err = (got.double() - want).abs().max().item()
    assert err <= rel * want.abs().max().item(), (err, want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "skew"), [(300, False), (1, False), (517, True)])
def test_moe_kernel_matches_reference(module, dtype, tokens: int, skew: bool):
    """bf16 / fp32 inputs exactly as the oracle sees them; the kernel multiplies and sums in fp32 over d =
    2816 and I = 704 terms: within 1e-3 of the largest output (fp32 sums are ~1e-6 relative)."""
    idx, w = routing(tokens, skew)
    gu, dn = weights(dtype)
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = launch(module, "MoEExperts", x.cuda(), idx.cuda(), w.cuda(), gu.cuda(), dn.cuda())
    check(got, moe_experts_reference(x, idx, w, gu, dn), 1e-3)


@pytest.mark.parametrize("act_quant", [False, True])
def test_moe_kernel_fp8(module, act_quant: bool):
    """FP8 weights (per-expert gate / up / down scales) and, with act_quant, E4M3 fake-quantised inputs: a
    different fp32 summation order can move one fake-quantised GELU product by one E4M3 step, hence 1e-2."""
    idx, w = routing(200, seed=5)
    gu, dn = weights(torch.float32, seed=6)
    gs = torch.rand(E, 2, 1).expand(E, 2, D).contiguous() * 1e-3 + 1e-4
    ds = torch.rand(E) * 1e-3 + 1e-4
    full = torch.cat([gs[:, :1].expand(-1, INTER, -1), gs[:, 1:].expand(-1, INTER, -1)], 1)
    gu8 = (gu / full).clamp(-448, 448).to(torch.float8_e4m3fn)  # saturate like ModelOpt's E4M3 cast
    dn8 = (dn / ds[:, None, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    x = torch.randn(200, D).to(torch.bfloat16)
    ins = [gu8.cuda(), gs.cuda(), dn8.cuda(), ds.cuda()]
    kw = {}
    if act_quant:
        scales = torch.rand(3, E) * 0.01 + 0.002
        ins.append(scales.cuda())
        kw["input_scale"] = scales
    op = "MoEExpertsW8A8" if act_quant else "MoEExpertsW8"
    got = launch(module, op, x.cuda(), idx.cuda(), w.cuda(), *ins)
    want = moe_experts_reference(x, idx, w, gu8, dn8, gate_up_scale=gs, down_scale=ds, **kw)
    check(got, want, 1e-2 if act_quant else 1e-3)


def test_moe_kernel_zero_rows_for_invalid_experts(module):
    idx, w = routing(40)
    idx[3, 0], idx[7, 5] = -1, E
    gu, dn = weights(torch.bfloat16)
    x = torch.randn(40, D).to(torch.bfloat16)
    got = launch(module, "MoEExperts", x.cuda(), idx.cuda(), w.cuda(), gu.cuda(), dn.cuda())
    assert got[3, 0].abs().max() == 0 and got[7, 5].abs().max() == 0
    check(got, moe_experts_reference(x, idx, w, gu, dn), 1e-3)


def nvfp4_input_scales(x: torch.Tensor, gu: torch.Tensor) -> torch.Tensor:
    """NVFP4 activation global scales [3, E] as ModelOpt calibrates them, amax / (6 * 448): x's for gate and
    up (up's doubled, so a swapped gate / up scale shows), each expert's GELU products' for down."""
    xf = x.float()
    amax = xf.abs().max()
    h = torch.stack([(torch.nn.functional.gelu(xf[:64] @ gu[e, :INTER].T, approximate="tanh")
                      * (xf[:64] @ gu[e, INTER:].T)).abs().max() for e in range(E)])  # fmt: skip
    return torch.stack([amax.expand(E), 2 * amax.expand(E), h]) / (6 * 448)


@functools.cache
def _nvfp4_experts() -> dict[str, torch.Tensor]:
    """The experts every case quantizes alike (seed 8), quantized once: ~40 s on a CPU core each time."""
    from tests._utils.nvfp4 import quantize_experts

    return quantize_experts(*weights(torch.float32, seed=8))


@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize(("tokens", "skew"), [(300, False), (1, False), (517, True)])
def test_moe_kernel_nvfp4(module, act_quant: bool, tokens: int, skew: bool):
    """NVFP4 experts (packed E2M1, E4M3 block scales, fp32 global scales; ModelOpt's quantization of random
    weights): the kernel dequantizes in registers exactly as the reference (the ONNX DequantizeLinear chain),
    so weight-only it is fp32 summation noise: 1e-3. With NVFP4 activations, x's quantization is identical
    (same bf16 inputs, same fp32 operations), but a GELU product the kernel sums in fp32 can sit on the other
    side of an E2M1 decision point than the float64 oracle's: such a flip moves a whole (token, choice) row
    by one E2M1 step of one element, so at most 1% of rows may exceed 1e-3 and none 5e-2."""
    idx, w = routing(tokens, skew, seed=7)
    if tokens > 3:
        idx[3, 0] = -1  # an invalid expert: a zero row
    gu, _ = weights(torch.float32, seed=8)
    q = _nvfp4_experts()
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    ports = ("gate_up", "gate_up_block_scale", "gate_up_scale", "down", "down_block_scale", "down_scale")
    ins = [q[p].cuda() for p in ports]
    kw = {}
    if act_quant:
        kw["input_scale"] = nvfp4_input_scales(x, gu)
        ins.append(kw["input_scale"].cuda())
    op = "MoEExpertsW4A4" if act_quant else "MoEExpertsW4"
    got = launch(module, op, x.cuda(), idx.cuda(), w.cuda(), *ins)
    want = moe_experts_reference(x, idx, w, **q, **kw)
    assert not torch.isnan(got).any()
    if tokens > 3:
        assert got[3, 0].abs().max() == 0
    if not act_quant:
        check(got, want, 1e-3)
        return
    row_err = (got.double() - want).abs().amax(-1) / want.abs().max()
    assert (row_err > 1e-3).double().mean() <= 0.01, row_err.flatten().topk(min(5, row_err.numel())).values
    assert row_err.max() <= 5e-2, row_err.max()
    plain = moe_experts_reference(x, idx, w, **q)
    assert (plain - want).abs().max() > 1e-2 * want.abs().max()  # the activations really are quantized
