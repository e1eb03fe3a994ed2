"""Reference implementations of the custom sampler ops as ONNX model-local functions.

`dgpipe::SampleRows` and `dgpipe::SampleAccept` (contract: `pipeline.onnx.contract`) are TensorRT plugins on the
GPU. So that the same model file runs in onnxruntime (CI, CPU parity), it carries a FunctionProto of the
same domain and name for each, built here from standard ops. They compute exactly what
`pipeline.sampler.reference.sample_step` + `update_stability` + `should_stop` compute with `CounterDraws`:
  * the counter RNG (`pipeline.sampler.rng`) in native uint32 arithmetic (onnxruntime's CPU Mul/Add/BitwiseXor/
    BitShift have uint32 kernels that wrap modulo 2**32, which is what rng.py's int64-and-mask emulates);
  * the entropy-bound keep rule WITHOUT a sort: each position's sorted prefix sum is the sum of the
    entropies that sort before or at it under the stable order (H, index), accumulated in double and
    rounded to fp32 as torch's CPU cumsum does. O(L^2) per row, fine for a reference, and it sidesteps
    TopK's tie order.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from pipeline.onnx import contract as onnx_io
from pipeline.sampler import rng


class _Body:
    """A tiny builder for a function body: `op()` appends a node and returns its (unique) output name."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self.n = 0

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        self.n += 1
        name = out or f"{self.prefix}_{op_type.lower()}_{self.n}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], **attrs))
        return name

    def const(self, value: np.ndarray | int | float, dtype: np.dtype | type | None = None) -> str:
        arr = np.asarray(value, dtype=dtype)
        self.n += 1
        name = f"{self.prefix}_c{self.n}"
        self.nodes.append(helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(arr)))
        return name

    def const_from_attr(self, attr: str) -> str:
        """An INT64 scalar holding the function attribute `attr` (an attribute reference)."""
        self.n += 1
        name = f"{self.prefix}_attr_{attr}"
        node = helper.make_node("Constant", [], [name])
        ref = onnx.AttributeProto()
        ref.name, ref.ref_attr_name, ref.type = "value_int", attr, onnx.AttributeProto.INT
        node.attribute.append(ref)
        self.nodes.append(node)
        return name

    # ---- pipeline.sampler.rng in uint32 ----------------------------------------------------------------------
    def u32(self, x_int64: str) -> str:
        """Low 32 bits of an int64 tensor as uint32 (what `w & MASK32` does in rng.py)."""
        return self.op(
            "Cast", self.op("BitwiseAnd", x_int64, self.const(rng.MASK32, np.int64)), to=TensorProto.UINT32
        )

    def fmix32(self, x: str) -> str:
        s16, s13 = self.const(16, np.uint32), self.const(13, np.uint32)
        x = self.op("BitwiseXor", x, self.op("BitShift", x, s16, direction="RIGHT"))
        x = self.op("Mul", x, self.const(0x85EBCA6B, np.uint32))
        x = self.op("BitwiseXor", x, self.op("BitShift", x, s13, direction="RIGHT"))
        x = self.op("Mul", x, self.const(0xC2B2AE35, np.uint32))
        return self.op("BitwiseXor", x, self.op("BitShift", x, s16, direction="RIGHT"))

    def combine(self, h: str, word: str) -> str:
        left = self.op("BitShift", h, self.const(6, np.uint32), direction="LEFT")
        right = self.op("BitShift", h, self.const(2, np.uint32), direction="RIGHT")
        mixed = self.op(
            "Add", self.op("Add", self.op("Add", word, self.const(rng.GOLDEN, np.uint32)), left), right
        )
        return self.fmix32(self.op("BitwiseXor", h, mixed))

    def key_hash(self, seed: str, request: str, canvas: str, step: str, stream: int) -> str:
        h = self.fmix32(self.u32(seed))
        # the seed's high word, only where set (rng.key_hash): a logical shift of the int64's bits
        hi = self.op("Cast", self.op("BitShift", self.op("Cast", seed, to=TensorProto.UINT64),
                                     self.const(32, np.uint64), direction="RIGHT"), to=TensorProto.UINT32)  # fmt: skip
        is_set = self.op("Not", self.op("Equal", hi, self.const(0, np.uint32)))
        h = self.op("Where", is_set, self.combine(h, hi), h)
        for w in (request, canvas, step):
            h = self.combine(h, self.u32(w))
        return self.combine(h, self.const(stream, np.uint32))

    def arange_u32(self, shape_of: str, axis: int) -> str:
        """[0, n) as uint32 where n = shape_of.shape[axis]."""
        n = self.op("Shape", shape_of, start=axis, end=axis + 1)
        n = self.op("Squeeze", n)
        r = self.op("Range", self.const(0, np.int64), n, self.const(1, np.int64))
        return self.op("Cast", r, to=TensorProto.UINT32)

    def position_bits(self, key: str, like_bl: str) -> str:
        """[B, L] per-position draws (rng.position_bits): combine(key[:, None], arange(L)[None, :])."""
        pos = self.op("Unsqueeze", self.arange_u32(like_bl, 1), self.const([0], np.int64))
        return self.combine(self.op("Unsqueeze", key, self.const([1], np.int64)), pos)


def _function(
    name: str,
    inputs: list[str],
    outputs: list[str],
    body: _Body,
    attributes: list[str] | None = None,
    opset: int = onnx_io.OPSET,
) -> onnx.FunctionProto:
    return helper.make_function(
        onnx_io.DOMAIN,
        name,
        inputs,
        outputs,
        body.nodes,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(onnx_io.DOMAIN, 1)],
        # declared (unused by the body) so nodes may carry them: TensorRT reads them to pick the plugin
        attributes=[*(attributes or []), *onnx_io.PLUGIN_ATTRIBUTES],
    )


def sample_rows_function(opset: int = onnx_io.OPSET) -> onnx.FunctionProto:
    """Kernel A: entropy, max prob, argmax, Gumbel-max sample of z = logits / T, and the bf16 model's
    self-conditioning input softmax(bf16(z)) in bf16 (reference.conditioning_softmax)."""
    spec = onnx_io.SAMPLE_ROWS
    b = _Body("rows")
    logits, temperature, seed, request, canvas, step = (s.name for s in spec.inputs)
    z = b.op("Div", logits, b.op("Unsqueeze", temperature, b.const([1, 2], np.int64)))
    logp = b.op("LogSoftmax", z, axis=-1)
    plogp = b.op("Mul", b.op("Exp", logp), logp)
    ax = b.const([-1], np.int64)
    b.op("Neg", b.op("ReduceSum", plogp, ax, keepdims=0), out="entropy")
    probs = b.op("Softmax", z, axis=-1)
    b.op("ReduceMax", probs, ax, keepdims=0, out="max_prob")
    b.op("ArgMax", z, axis=-1, keepdims=0, select_last_index=0, out="argmax")
    z_bf16 = b.op("Cast", b.op("Cast", z, to=TensorProto.BFLOAT16), to=TensorProto.FLOAT)
    b.op("Cast", b.op("Softmax", z_bf16, axis=-1), to=TensorProto.BFLOAT16, out="probs")
    # Gumbel-max with the counter RNG (rng.gumbel): 23 bits -> u = (r + 0.5) * 2**-23 -> -log(-log(u))
    key = b.key_hash(seed, request, canvas, step, rng.STREAM_SAMPLE)
    entropy_like = b.op("ReduceMax", z, ax, keepdims=0)  # any [B, L] tensor, for L
    pos_key = b.op("Unsqueeze", b.position_bits(key, entropy_like), b.const([2], np.int64))
    vocab_ids = b.op("Unsqueeze", b.arange_u32(z, 2), b.const([0, 1], np.int64))
    bits = b.op("BitShift", b.combine(pos_key, vocab_ids), b.const(9, np.uint32), direction="RIGHT")
    u = b.op(
        "Mul",
        b.op("Add", b.op("Cast", bits, to=TensorProto.FLOAT), b.const(0.5, np.float32)),
        b.const(1.0 / (1 << 23), np.float32),
    )
    g = b.op("Neg", b.op("Log", b.op("Neg", b.op("Log", u))))
    b.op("ArgMax", b.op("Add", z, g), axis=-1, keepdims=0, select_last_index=0, out="sample")
    return _function(spec.name, [s.name for s in spec.inputs], [s.name for s in spec.outputs], b, opset=opset)


def sample_accept_function(opset: int = onnx_io.OPSET) -> onnx.FunctionProto:
    """Kernel B: entropy-bound acceptance, re-noise, template pinning, stability counter and stop flag."""
    spec = onnx_io.SAMPLE_ACCEPT
    b = _Body("accept")
    (
        entropy,
        argmax,
        sample,
        template,
        bound,
        seed,
        request,
        canvas,
        step,
        prev_argmax,
        stable_count,
        stability_threshold,
        confidence_threshold,
    ) = (s.name for s in spec.inputs)
    zero_f = b.const(0.0, np.float32)
    pinned = b.op("GreaterOrEqual", template, b.const(0, np.int64))
    h = b.op("Where", pinned, zero_f, entropy, out="entropy_out")
    # rank-free stable sort: j precedes-or-is i  <=>  h_j < h_i  or  (h_j == h_i and j <= i)
    hi = b.op("Unsqueeze", h, b.const([2], np.int64))  # [B, L, 1]
    hj = b.op("Unsqueeze", h, b.const([1], np.int64))  # [B, 1, L]
    idx = b.op("Cast", b.arange_u32(h, 1), to=TensorProto.INT64)
    ii = b.op("Unsqueeze", idx, b.const([1], np.int64))  # [L, 1]
    jj = b.op("Unsqueeze", idx, b.const([0], np.int64))  # [1, L]
    before = b.op("Or", b.op("Less", hj, hi), b.op("And", b.op("Equal", hj, hi), b.op("LessOrEqual", jj, ii)))
    hj64 = b.op("Cast", hj, to=TensorProto.DOUBLE)
    cum = b.op(
        "ReduceSum", b.op("Where", before, hj64, b.const(0.0, np.float64)), b.const([2], np.int64), keepdims=0
    )
    cum32 = b.op("Cast", cum, to=TensorProto.FLOAT)
    bound2 = b.op("Unsqueeze", bound, b.const([1], np.int64))
    keep = b.op("LessOrEqual", b.op("Sub", cum32, h), bound2, out="kept")
    # re-noise tokens (rng.uniform_tokens): (bits * vocab) >> 32
    key = b.key_hash(seed, request, canvas, step, rng.STREAM_RENOISE)
    bits64 = b.op("Cast", b.position_bits(key, h), to=TensorProto.UINT64)
    vocab64 = b.op("Cast", b.const_from_attr("vocab"), to=TensorProto.UINT64)
    noise = b.op("BitShift", b.op("Mul", bits64, vocab64), b.const(32, np.uint64), direction="RIGHT")
    noise = b.op("Cast", noise, to=TensorProto.INT64)
    b.op("Where", pinned, template, b.op("Where", keep, sample, noise), out="canvas_out")
    amax = b.op("Where", pinned, template, argmax, out="argmax_out")
    # stability counter and stop flag (sampler.update_stability / should_stop)
    differs = b.op("Cast", b.op("Not", b.op("Equal", amax, prev_argmax)), to=TensorProto.INT64)
    same = b.op("Equal", b.op("ReduceMax", differs, b.const([1], np.int64), keepdims=0), b.const(0, np.int64))
    count = b.op(
        "Where", same, b.op("Add", stable_count, b.const(1, np.int64)), b.const(0, np.int64), out="stable_out"
    )
    mean = b.op("ReduceMean", h, b.const([1], np.int64), keepdims=0)
    b.op(
        "And",
        b.op("GreaterOrEqual", count, stability_threshold),
        b.op("Less", mean, confidence_threshold),
        out="stop",
    )
    del keep
    return _function(
        spec.name,
        [s.name for s in spec.inputs],
        [s.name for s in spec.outputs],
        b,
        list(spec.attributes),
        opset,
    )


def sampler_functions(opset: int = onnx_io.OPSET) -> list[onnx.FunctionProto]:
    """Both functions, importing the model's default-domain opset (a function must match its model's)."""
    return [sample_rows_function(opset), sample_accept_function(opset)]
