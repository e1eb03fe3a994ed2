"""The routed-experts plugins' contract in plain Python: ports, kernel choice, tile and launch geometry.

The exported graph has one `dgpipe::MoE` node per decoder layer (pipeline/onnx/contract.py `MOE`: hidden
[T, d], expert_index [T, K], expert_weight [T, K], gate_up [E, 2I, d], down [E, d, I], optional
input_scale [3, E]; out [T, d]). A TensorRT AOT plugin is one kernel launch, and a launch cannot both
compute every (token, expert) pair and sum a token's K expert outputs without atomics or a second pass;
so the engine build (`pipeline.engine.moe_graph`) replaces each node with a plugin that writes one fp32 row
per (token, choice) - out_k [T, K, d] - followed by ReduceSum over K and one Cast to the model dtype,
exactly the contract's "summed over k in fp32, cast once". Five plugins, one per weight format:

* `MoEExperts`      hidden, expert_index, expert_weight, gate_up, down (fp32 or bf16, all the model dtype)
* `MoEExpertsW8`    + FP8 E4M3 gate_up / down with their DequantizeLinear scales ([E, 2, d] and [E], fp32)
* `MoEExpertsW8A8`  + input_scale [3, E] (act_quant fp8: E4M3 fake quantisation of the expert inputs)
* `MoEExpertsW4`    NVFP4 (ModelOpt layout, as the export's two-level DequantizeLinear stores it): gate_up
                    FLOAT4E2M1 [E, 2I, d] with E4M3 block scales [E, 2I, d/16] and fp32 global scales
                    [E, 2, d/16]; down FLOAT4E2M1 [E, d, I], block scales [E, d, I/16], global [E]
* `MoEExpertsW4A4`  + input_scale [3, E] (act_quant nvfp4: the global scales of dynamic per-16 E4M3 block
                    scales, as pipeline.model.fake_quant.nvfp4_fake_quant)

Kernels: `dg_trt_moe_*` in pipeline/engine/kernels/csrc/dg_moe.cu (TensorRT AOT argument order: inputs,
int32 T, K, d, I, E, tile, outputs).
"""

from __future__ import annotations

from pipeline.engine.plugin_spec import NAMESPACE, Port, check_ports
from pipeline.errors import DgpipeError

ONNX_OP = "MoE"  # the exported node (pipeline/onnx/contract.py MOE)
EXPERTS_OP = "MoEExperts"
W8_OP = "MoEExpertsW8"
W8A8_OP = "MoEExpertsW8A8"
W4_OP = "MoEExpertsW4"
W4A4_OP = "MoEExpertsW4A4"
NVFP4_BLOCK = 16  # kBlock in dg_moe.cu: one E4M3 scale per 16 elements along the input dim
ACTIVATION = "gelu_tanh"

THREADS = 256  # kThreads in dg_moe.cu
MAX_TILE = 16  # kMaxTile: tokens per tile (registers per lane: 2 x tile accumulators)
# A block's static and dynamic shared memory together must fit 48 KiB without the opt-in attribute an AOT
# launch cannot set. Static: s_slot[kThreads + kMaxTile] and s_warp[kWarps] (int32), plus the 1 KiB that
# ptxas adds to every kernel's static shared memory from sm_90 on (cuobjdump --dump-resource-usage shows
# 1,088 bytes for one int[272] on sm_80 and 2,112 on sm_90, sm_90a and sm_120a): the largest over the
# targets (sm_89's MoE kernels have 1,120 bytes, the others 2,144).
SM90_RESERVED_SHARED = 1024
STATIC_SHARED = 4 * (THREADS + MAX_TILE) + 4 * (THREADS // 32) + SM90_RESERVED_SHARED
SMEM_BUDGET = 48 * 1024 - STATIC_SHARED  # dynamic shared memory per block
TOKENS_PER_SPLIT = 256  # grid.y = min(ceil(T / 256), MAX_SPLITS): each block scans T*K / grid.y slots
MAX_SPLITS = 16

_BASE = (
    Port("hidden", ("float32", "bfloat16"), ("T", "d")),
    Port("expert_index", "int64", ("T", "K")),
    Port("expert_weight", "float32", ("T", "K")),
)
EXPERTS_INPUTS = (
    *_BASE,
    Port("gate_up", ("float32", "bfloat16"), ("E", "2I", "d")),
    Port("down", ("float32", "bfloat16"), ("E", "d", "I")),
)
W8_INPUTS = (
    *_BASE,
    Port("gate_up", "float8e4m3", ("E", "2I", "d")),
    Port("gate_up_scale", "float32", ("E", "2", "d")),
    Port("down", "float8e4m3", ("E", "d", "I")),
    Port("down_scale", "float32", ("E",)),
)
W8A8_INPUTS = (*W8_INPUTS, Port("input_scale", "float32", ("3", "E")))
W4_INPUTS = (
    *_BASE,
    Port("gate_up", "float4e2m1", ("E", "2I", "d")),
    Port("gate_up_block_scale", "float8e4m3", ("E", "2I", "d/16")),
    Port("gate_up_scale", "float32", ("E", "2", "d/16")),
    Port("down", "float4e2m1", ("E", "d", "I")),
    Port("down_block_scale", "float8e4m3", ("E", "d", "I/16")),
    Port("down_scale", "float32", ("E",)),
)
W4A4_INPUTS = (*W4_INPUTS, Port("input_scale", "float32", ("3", "E")))
SPECS = {
    EXPERTS_OP: EXPERTS_INPUTS,
    W8_OP: W8_INPUTS,
    W8A8_OP: W8A8_INPUTS,
    W4_OP: W4_INPUTS,
    W4A4_OP: W4A4_INPUTS,
}
NVFP4_OPS = (W4_OP, W4A4_OP)
KERNELS = {
    (EXPERTS_OP, "float32"): "dg_trt_moe_f32",
    (EXPERTS_OP, "bfloat16"): "dg_trt_moe_bf16",
    (W8_OP, "bfloat16"): "dg_trt_moe_bf16_w8",
    (W8A8_OP, "bfloat16"): "dg_trt_moe_bf16_w8a8",
    (W4_OP, "bfloat16"): "dg_trt_moe_bf16_w4",
    (W4A4_OP, "bfloat16"): "dg_trt_moe_bf16_w4a4",
}
ENTRY_POINTS = tuple(sorted(KERNELS.values()))
_BYTES = {"float32": 4, "bfloat16": 2}


def check_inputs(op: str, dtypes: list[str], ranks: list[int]) -> None:
    """Count, dtype and rank of each input; the weights must be in the hidden states' dtype (one kernel
    instantiation per pair) unless they are FP8."""
    check_ports(op, SPECS[op], dtypes, ranks)
    if op == EXPERTS_OP and not dtypes[0] == dtypes[3] == dtypes[4]:
        raise DgpipeError(
            f"{NAMESPACE}::{op}: hidden, gate_up and down must share one dtype, got {dtypes[0]}, "
            f"{dtypes[3]}, {dtypes[4]}"
        )


def kernel(op: str, hidden_dtype: str) -> str:
    try:
        return KERNELS[(op, hidden_dtype)]
    except KeyError:
        raise DgpipeError(
            f"{NAMESPACE}::{op} has no kernel for {hidden_dtype} hidden states",
            hint="FP8 and NVFP4 expert weights run with bf16 activations: export the model in bf16",
        ) from None


def check_dims(op: str, d: int, experts: int, gate_up: tuple[int, ...], down: tuple[int, ...]) -> int:
    """The weight shapes agree with each other and with hidden's d; returns I (the expert hidden size)."""
    if len(gate_up) != 3 or len(down) != 3 or gate_up[1] % 2:
        raise DgpipeError(f"{NAMESPACE}::{op}: gate_up must be [E, 2I, d] and down [E, d, I]")
    inter = gate_up[1] // 2
    if gate_up != (experts, 2 * inter, d) or down != (experts, d, inter):
        raise DgpipeError(
            f"{NAMESPACE}::{op}: gate_up {list(gate_up)} and down {list(down)} do not fit "
            f"E={experts}, d={d} (want [E, 2I, d] and [E, d, I])"
        )
    return inter


def port_index(op: str, name: str) -> int:
    """Position of input `name` in plugin `op`'s ports (the kernel's parameter order)."""
    return [p.name for p in SPECS[op]].index(name)


def check_scales(op: str, d: int, experts: int, shapes: list[tuple[int, ...]], inter: int = 0) -> None:
    """FP8 scale inputs as the kernel indexes them: gate_up_scale [E, 2, d] (the blocked DequantizeLinear
    scale of gate_up), down_scale [E] (per-axis, axis 0), input_scale [3, E]. NVFP4 (`shapes` in port
    order after gate_up: block and global scales, `inter` = I): d and I in whole blocks of 16, gate_up's
    block scales [E, 2I, d/16] and global [E, 2, d/16], down's [E, d, I/16] and [E], input_scale [3, E]."""
    if op in NVFP4_OPS:
        if d % NVFP4_BLOCK or inter % NVFP4_BLOCK:
            raise DgpipeError(
                f"{NAMESPACE}::{op}: NVFP4 needs d and I in whole blocks of {NVFP4_BLOCK}, got d={d}, I={inter}"
            )
        names = [p.name for p in SPECS[op] if p.name.endswith("scale")]
        want = [
            (experts, 2 * inter, d // NVFP4_BLOCK),
            (experts, 2, d // NVFP4_BLOCK),
            (experts, d, inter // NVFP4_BLOCK),
            (experts,),
            (3, experts),
        ]
    else:
        names, want = (
            ["gate_up_scale", "down_scale", "input_scale"],
            [(experts, 2, d), (experts,), (3, experts)],
        )
    for port, got, expect in zip(names, shapes, want[: len(shapes)]):
        if tuple(got) != expect:
            raise DgpipeError(f"{NAMESPACE}::{op}: {port} must be {list(expect)}, got {list(got)}")


def tile(d: int, inter: int, hidden_dtype: str) -> int:
    """Tokens per tile: as many as the shared-memory budget holds (a tile's rows of x in the model dtype
    plus its fp32 GELU products), at most MAX_TILE. Every weight format needs the same: with NVFP4
    activations the rows are staged as E2M1 codes + block scales (1.5 d bytes) in the same region."""
    per_token = d * _BYTES[hidden_dtype] + inter * 4
    n = min(MAX_TILE, SMEM_BUDGET // per_token)
    if n < 1:
        raise DgpipeError(
            f"{NAMESPACE}::MoE: d={d}, I={inter} need {per_token} bytes of shared memory per token, "
            f"more than the kernel's {SMEM_BUDGET}"
        )
    return n


def shared_bytes(d: int, inter: int, hidden_dtype: str, n: int) -> int:
    return n * (inter * 4 + d * _BYTES[hidden_dtype])
