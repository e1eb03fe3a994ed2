"""fp32 tolerances derived from the reference's own fp32 noise, not tuned to one CPU.

An fp32 result is judged against a float64 oracle of the same computation, and the bound is what a
trusted fp32 implementation of that computation achieves on this machine, with these threads:

    err(ours_fp32 vs oracle_fp64) <= FACTOR * err(reference_fp32 vs oracle_fp64) + FLOOR

`reference_fp32` is transformers' fp32 run (parity tests) or dgpipe's own PyTorch fp32 run (ONNX
Runtime tests, whose graph is exported from that model). A different CPU, BLAS blocking or thread count
moves both errors together, so the ratio stays put where a fixed bound would not. Errors are
dimensionless: relative Frobenius norm ("rel") or max absolute error over the oracle's max magnitude
("max"); FLOOR (a few fp32 ulps) covers computations the reference happens to get almost exact.
"""

from __future__ import annotations

import torch

FACTOR = 4.0
FLOOR = 1e-6  # ~8 fp32 ulps at 1.0


def error(x: torch.Tensor, oracle: torch.Tensor, metric: str = "rel") -> float:
    """Dimensionless error of `x` against `oracle`, computed in float64."""
    x, oracle = x.detach().double(), oracle.detach().double()
    d = x - oracle
    if metric == "rel":
        return float(d.norm() / oracle.norm().clamp_min(1e-300))
    if metric == "max":
        return float(d.abs().max() / oracle.abs().max().clamp_min(1e-300))
    raise ValueError(f"metric must be 'rel' or 'max', not {metric!r}")


def assert_within_reference_noise(
    what: str,
    ours: torch.Tensor,
    oracle: torch.Tensor,
    reference: torch.Tensor,
    *,
    metric: str = "rel",
    factor: float = FACTOR,
    floor: float = FLOOR,
) -> float:
    """Assert err(ours, oracle) <= factor * err(reference, oracle) + floor; return the ratio
    err(ours) / err(reference) (inf when the reference is exact) so callers can report it."""
    assert ours.shape == oracle.shape == reference.shape, (what, ours.shape, oracle.shape, reference.shape)
    ours_err, ref_err = error(ours, oracle, metric), error(reference, oracle, metric)
    bound = factor * ref_err + floor
    ratio = ours_err / ref_err if ref_err > 0 else float("inf")
    assert ours_err <= bound, (
        f"{what}: {metric} error vs float64 oracle {ours_err:.3e} > bound {bound:.3e} "
        f"(= {factor:g} x reference fp32 error {ref_err:.3e} + floor {floor:.0e}); ratio {ratio:.2f}"
    )
    return ratio
