"""Optimization profiles for the one-graph engine, computed from the ONNX model's own input dims.

The graph (pipeline/onnx/contract.py) serves two kinds of pass, so the engine gets one profile per kind and the
runtime gives each kind its own execution context:
  * `causal` (prefill and commit, mode = 0): batch 1..max_batch, seq 1..max(max_prompt, canvas),
    past_full 0..max_context, sliding past 0 (fresh prefill) or the ring (window - 1), sc_seq 1;
  * `denoise` (mode = 1): seq fixed at the canvas length, sc_seq 1 (first step) .. canvas.
Dims are read from the ONNX inputs (dim_param names, sums such as "past_full + seq"), so a renamed or
added input fails here with its name instead of inside the TensorRT builder. No TensorRT needed.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.engine.plan_record import ProfileRecord
from pipeline.errors import DgpipeError
from pipeline.limits import Limits
from pipeline.onnx.contract import BATCH, MODE_CAUSAL, MODE_DENOISE, PAST_FULL, PAST_SLIDING, SC_SEQ, SEQ

Bounds = dict[str, tuple[int, int, int]]  # dim name -> (min, opt, max)
MODE_INPUT = "mode"


def bounds(kind: str, limits: Limits, canvas: int, ring: int) -> Bounds:
    """Per-dim (min, opt, max) for one kind of pass. opt is the shape TensorRT tunes kernels for: one row
    for prefill (latency of a new request) and the full batch for denoise (throughput)."""
    b = limits.max_batch
    if kind == "causal":
        seq_max = max(limits.max_prompt, canvas)
        return {
            BATCH: (1, 1, b),
            SEQ: (1, min(seq_max, 512), seq_max),
            PAST_FULL: (0, 0, limits.max_context),
            PAST_SLIDING: (0, 0, ring),
            SC_SEQ: (1, 1, 1),
        }
    if kind == "denoise":
        return {
            BATCH: (1, b, b),
            SEQ: (canvas, canvas, canvas),
            PAST_FULL: (0, min(1024, limits.max_context), limits.max_context),
            PAST_SLIDING: (0, ring, ring),
            SC_SEQ: (1, canvas, canvas),
        }
    raise DgpipeError(f"unknown pass kind {kind!r}")


MODE_VALUE = {"causal": MODE_CAUSAL, "denoise": MODE_DENOISE}


def eval_dim(dim: int | str, b: Bounds) -> tuple[int, int, int]:
    """A static dim, a named symbolic dim, or a sum of them ("past_full + seq")."""
    if isinstance(dim, int):
        return dim, dim, dim
    total = [0, 0, 0]
    for term in str(dim).split("+"):
        term = term.strip()
        if term.isdigit():
            lo = opt = hi = int(term)
        elif term in b:
            lo, opt, hi = b[term]
        else:
            raise DgpipeError(
                f"ONNX input dim {dim!r}: unknown symbolic dim {term!r}",
                hint=f"the engine build knows {', '.join(sorted(b))} (pipeline/onnx/contract.py)",
            )
        total = [total[0] + lo, total[1] + opt, total[2] + hi]
    return total[0], total[1], total[2]


def make_profile(kind: str, inputs: dict[str, list[int | str]], b: Bounds) -> ProfileRecord:
    shapes: dict[str, list[list[int]]] = {}
    for name, dims in inputs.items():
        per_dim = [eval_dim(d, b) for d in dims]
        shapes[name] = [[d[i] for d in per_dim] for i in range(3)]
    values = {}
    if MODE_INPUT in inputs:  # `mode` decides output shapes (head = max(1, seq * mode)): a shape tensor
        v = MODE_VALUE[kind]
        values[MODE_INPUT] = [[v], [v], [v]]
    return ProfileRecord(name=kind, shapes=shapes, shape_values=values)


def onnx_inputs(onnx_path: Path) -> dict[str, list[int | str]]:
    """Graph input name -> dims (ints, or dim_param strings), without loading the external weights."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    out: dict[str, list[int | str]] = {}
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        dims: list[int | str] = []
        for d in inp.type.tensor_type.shape.dim:
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            elif d.HasField("dim_param"):
                dims.append(d.dim_param)
            else:
                raise DgpipeError(f"{onnx_path}: input {inp.name} has an unnamed dynamic dim")
        out[inp.name] = dims
    return out


def engine_profiles(
    inputs: dict[str, list[int | str]],
    limits: Limits,
    canvas: int,
    ring: int,
    static: dict[str, int] | None = None,
) -> list[ProfileRecord]:
    """Profile 0 = causal, profile 1 = denoise (the runtime relies on this order). `static`: model dims the
    export may have left symbolic (e.g. "vocab"), fixed at their value (contract.json "dims")."""
    limits.validate(canvas)
    fixed = {
        k: (v, v, v) for k, v in (static or {}).items() if isinstance(v, int) and not isinstance(v, bool)
    }
    return [make_profile(k, inputs, fixed | bounds(k, limits, canvas, ring)) for k in ("causal", "denoise")]
