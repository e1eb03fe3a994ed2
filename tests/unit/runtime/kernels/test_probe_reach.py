"""The load-time probes reach every part of their kernels that served inputs reach: a kernel wrong only in a
loop's second step, a grid axis's second program, a batch row after the first, or a dtype other than bf16
fails its probe. Each wrong kernel is the real one's source with one expression changed
(`tests._utils.probes.kernel_variant`), run in Triton's interpreter; each is O(1) wrong at the 26B's
shapes, and passed the probes as they were before they were sized for this."""

from __future__ import annotations

import inspect

import pytest
import torch

from pipeline.errors import DgpipeError
from pipeline.runtime import kernels
from pipeline.runtime import probe as probing
from pipeline.runtime.kernels import chains, moe, quant, routing
from pipeline.runtime.kernels.jit import chains as jit_chains
from pipeline.runtime.kernels.jit import quant as jit_quant
from pipeline.runtime.kernels.jit import routing as jit_routing
from pipeline.runtime.probe.gemm import EXPERTS_PROBE
from pipeline.runtime.probe.quant import nvfp4_quant_rows
from pipeline.runtime.probe.routing import EXPERT_ORDER_CASES
from tests._utils.interpreter_casts import (  # noqa: F401  (fixtures)
    interpreted,
    interpreted_exp,
    interpreted_tanh,
    rne_casts,
)
from tests._utils.probes import kernel_variant

pytestmark = interpreted
CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("acc = tl.dot(a, b, acc)", "acc = tl.dot(a, b)"),  # only the last step along K counts
        ("+ (pid_m - first_block) * BLOCK_M", "+ 0 * BLOCK_M"),  # every M block an expert's first
    ],
    ids=["one-k-step", "one-m-block"],
)
def test_the_moe_gemm_probes_fail_a_kernel_wrong_past_its_first_block(
    rne_casts,  # noqa: F811
    monkeypatch,
    tmp_path,
    old,
    new,
):
    monkeypatch.setattr(moe, "_kernel", kernel_variant(moe, [(old, new)], tmp_path)._kernel)
    with pytest.raises(DgpipeError, match=r"Triton MoE GEMM \(.* tiles\) differs"):
        probing.check_triton_fp8("fp8", "fp8", CPU)
    with pytest.raises(DgpipeError, match=r"Triton bf16 MoE GEMM \(.* tiles\) differs"):
        probing.check_triton_float(CPU, torch.bfloat16)


def test_the_moe_gemm_probes_run_every_tile_past_one_block_along_k_m_and_n():
    """What the wrong kernels above stand for, for every tile a GPU may launch (the tuner's grid included):
    the probe's GEMMs take more than one step along K, one expert more than one M block, and more than one
    N block, each with a partial last block at the default tiles."""
    from pipeline.bench.gpu.tiles import BLOCK_K_BYTES, BLOCK_M, BLOCK_N

    p = EXPERTS_PROBE
    _, index, _ = p.routing(CPU, torch.bfloat16)
    rows = torch.bincount(index.flatten(), minlength=p.experts).tolist()
    assert rows[0] == p.crowded and rows[-1] == 0
    assert all(a != b for a, b in index.tolist())  # two distinct experts a token, as top-k chooses
    # the GEMM checked at every tile is gate|up's: K = hidden (FP8: a value a byte; bf16 takes half as many a step)
    for size, largest in (
        (rows[0], max(BLOCK_M)),
        (p.hidden, max(BLOCK_K_BYTES)),
        (2 * p.intermediate, max(BLOCK_N)),
    ):
        assert size > largest and size % largest  # more than one block, the last partial


COUNT_STEP = "lower += tl.sum(((x < e) & (i < slots)).to(tl.int32), axis=0)"
BATCH_ROW = "((token // seq) * out_sb + (token % seq) * out_sl + (r % heads) * out_sh)"
FLAT_ROW = "(token * out_sl + (r % heads) * out_sh)"  # right for a contiguous [B, L, H, D] output alone
PROGRAM = "b = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)\n    inside = b < blocks"


@pytest.mark.parametrize(
    ("source", "module", "replacements", "check", "match"),
    [
        (  # only the last step of the expert order's counting sweep counts
            jit_routing, routing, [(COUNT_STEP, COUNT_STEP.replace("+=", "="))],
            lambda: probing.check_triton_expert_order(CPU), "Triton expert order differs",
        ),
        (  # k's (and q's) rotated rows and v's written as if every token were in the first batch row
            jit_chains, chains,
            [(f"row = {BATCH_ROW}[:, None] + j\n{pad}tl.store({out}", f"row = {FLAT_ROW}[:, None] + j\n{pad}tl.store({out}")
             for pad, out in (("    ", "out_ptr"), ("        ", "v_out"))],
            lambda: probing.check_triton_head_norms(CPU), "Triton head norms",
        ),
        (  # every program of the NVFP4 quantization quantizes the first blocks
            jit_quant, quant, [(PROGRAM, PROGRAM.replace("* BLOCKS +", "* 0 +"))],
            lambda: probing.check_triton_quant("nvfp4", CPU), "Triton nvfp4 activation quantization differs",
        ),
    ],
    ids=["expert-order-one-count-step", "head-norms-one-batch-row", "nvfp4-one-program"],
)  # fmt: skip
def test_a_network_probe_fails_a_kernel_wrong_past_its_first_step_row_or_program(
    rne_casts,  # noqa: F811
    monkeypatch,
    tmp_path,
    source,
    module,
    replacements,
    check,
    match,
):
    wrong = kernel_variant(source, replacements, tmp_path)
    monkeypatch.setattr(module, "_kernels", lambda: wrong)
    with pytest.raises(DgpipeError, match=match):
        check()


def test_the_network_probes_inputs_reach_past_the_first_step_row_and_program():
    """What the wrong kernels above stand for: the expert order's probe routes more slots than a counting
    step takes, the head norms' runs two batch rows, the NVFP4 quantization's more blocks than a program."""
    assert inspect.getsource(jit_chains).count(BATCH_ROW) == 2
    assert max(tokens * k for tokens, k, _ in EXPERT_ORDER_CASES) > routing.ORDER_COUNT
    assert nvfp4_quant_rows(CPU).numel() // 16 > quant.NVFP4_BLOCKS


def wrong_in(dtype: torch.dtype, form):
    """`form` with its result's first value changed where its input is `dtype`: a kernel whose `dtype`
    compile is wrong."""

    def wrong(x, *args, **kwargs):
        out = form(x, *args, **kwargs)
        if x.dtype == dtype:
            first = (out[0] if isinstance(out, tuple) else out).view(-1)[:1]
            if first.element_size() == 1:  # E4M3 or packed E2M1 codes
                first.view(torch.uint8).bitwise_xor_(1)
            else:
                first.add_(1)
        return out

    return wrong


@pytest.mark.parametrize(
    ("module", "name", "check", "dtypes"),
    [
        (chains, "softcap", lambda: probing.check_triton_softcap(CPU), (torch.float16, torch.float32)),
        (chains, "combine", lambda: probing.check_triton_combine(CPU), (torch.float16,)),
        (chains, "kv_cat", lambda: probing.check_triton_kv_cat(CPU), (torch.float16,)),
        (kernels.routing, "top_k", lambda: probing.check_triton_top_k(CPU), (torch.float16,)),
        (quant, "fp8", lambda: probing.check_triton_quant("fp8", CPU), (torch.float16, torch.float32)),
        (quant, "nvfp4", lambda: probing.check_triton_quant("nvfp4", CPU), (torch.float16, torch.float32)),
        (
            quant,
            "nvfp4_fp8_rows",
            lambda: probing.check_triton_quant("fp8_rowwise", CPU),
            (torch.float16, torch.float32),
        ),
    ],
    ids=["softcap", "combine", "kv_cat", "top_k", "fp8", "nvfp4", "fp8_rowwise"],
)
def test_a_probe_fails_a_kernel_wrong_only_in_a_dtype_a_load_hands_it(
    rne_casts,  # noqa: F811
    interpreted_tanh,  # noqa: F811
    interpreted_exp,  # noqa: F811
    monkeypatch,
    module,
    name,
    check,
    dtypes,
):
    check()
    real = getattr(module, name)
    for dtype in dtypes:
        with monkeypatch.context() as mp:
            mp.setattr(module, name, wrong_in(dtype, real))
            with pytest.raises(DgpipeError, match="differs"):
                check()
