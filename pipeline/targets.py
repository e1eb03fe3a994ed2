"""Precisions and GPU targets, and the one place that decides which precision runs natively where.

Both come from YAML (configs/precisions, configs/targets) so adding a GPU or a recipe is a config change.
"""

from __future__ import annotations

from functools import cache

from pydantic import BaseModel, ConfigDict

from pipeline.errors import DgpipeError
from pipeline.resources import config_names, load_yaml


class GPU(BaseModel):
    model_config = ConfigDict(extra="forbid")  # shipped YAML: a misspelt key is an error, not a default

    product: str
    # what the driver calls it (`torch.cuda.get_device_name`, nvidia-smi), exactly: how a running GPU finds
    # its entry (`gpu_named`). GPU feature discovery's label nvidia.com/gpu.product is a name, "-" for " ".
    device_names: list[str] = []
    memory_gib: float
    bandwidth_tb_s: float
    # dense (no 2:4 sparsity) tensor-core TFLOPS per precision, from NVIDIA's datasheets; the compute floor
    # of `dgpipe bench flops`. Empty where not recorded.
    dense_tflops: dict[str, float] = {}


class Target(BaseModel):
    model_config = ConfigDict(extra="forbid")  # shipped YAML: a misspelt key is an error, not a default

    name: str
    arch: str
    compute_capability: str
    gpus: list[GPU]
    precisions: list[str]
    default_precision: str

    @property
    def cc(self) -> tuple[int, int]:
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)


class Precision(BaseModel):
    model_config = ConfigDict(extra="forbid")  # shipped YAML: a misspelt key is an error, not a default

    name: str
    modelopt_config: str | None
    quant_algo: str | None
    weight_bits: int
    block_size: int
    scale_bits: int
    activations: str
    native_on: list[str]
    quantize: list[str]
    keep_high_precision: list[str]
    modelopt_algorithm: str | None = None  # overrides the stock config's calibration algorithm
    fallback_block_sizes: list[int] = []  # tried in order when block_size does not divide a layer's inputs

    def weight_bytes_per_param(self) -> float:
        """Stored bytes per quantized weight, block scales included (NVFP4: 4 + 8/16 bits = 0.5625 B)."""
        bits = self.weight_bits + (self.scale_bits / self.block_size if self.block_size else 0)
        return bits / 8


@cache
def precision(name: str) -> Precision:
    if name not in config_names("precisions"):
        raise DgpipeError(
            f"unknown precision '{name}'", f"choose one of: {', '.join(config_names('precisions'))}"
        )
    return Precision(**load_yaml("precisions", name))


@cache
def target(name: str) -> Target:
    aliases = {"hopper": "sm90", "blackwell": "sm100", "rtx-blackwell": "sm120", "ada": "sm89"}
    name = aliases.get(name, name)
    if name not in config_names("targets"):
        raise DgpipeError(
            f"unknown GPU target '{name}'",
            f"choose one of: {', '.join(config_names('targets'))} (or hopper, blackwell)",
        )
    return Target(**load_yaml("targets", name))


def gpu_named(device_name: str) -> GPU | None:
    """The configs/targets entry of the GPU the driver calls `device_name`, or None for one no target lists.
    Whole names only: "NVIDIA H100 PCIe" is not "NVIDIA H100 80GB HBM3", and "NVIDIA GH200 480GB" is no H200,
    though each name holds the other's product name. A GPU's bandwidth and tensor-core rates set its floors."""
    key = device_name.strip().casefold()
    for t in map(target, config_names("targets")):
        for g in t.gpus:
            if any(n.casefold() == key for n in g.device_names):
                return g
    return None


def target_for_compute_capability(cc: str) -> Target | None:
    """The target whose engines and arch-specific PTX (sm_90a, sm_100a, sm_120a) run on a GPU of compute
    capability `cc` ("9.0"), or None. Exact match only: a TensorRT plan and `a`-suffixed PTX load on the
    compute capability they were built for, never on a "nearest" one."""
    return next((t for t in map(target, config_names("targets")) if t.compute_capability == cc), None)


def all_precisions() -> list[str]:
    return config_names("precisions")


# quant_algo spellings other producers write for a dgpipe precision (older ModelOpt / TensorRT-LLM exports)
_QUANT_ALGO_ALIASES = {"INT4_AWQ": "W4A16_AWQ"}


def precision_for_quant_algo(algo: str) -> Precision | None:
    """The precision whose recipe exports `quant_algo` (ModelOpt's `hf_quant_config.json`), or None for an
    algorithm no dgpipe precision produces. The one mapping from a quantized checkpoint to its precision."""
    algo = algo.upper()
    algo = _QUANT_ALGO_ALIASES.get(algo, algo)
    for name in all_precisions():
        p = precision(name)
        if p.quant_algo is not None and p.quant_algo.upper() == algo:
            return p
    return None


def supported_quant_algos() -> list[str]:
    """Every quant_algo `precision_for_quant_algo` maps, aliases included."""
    algos = [p.quant_algo for p in map(precision, all_precisions()) if p.quant_algo]
    return algos + [a for a, canonical in _QUANT_ALGO_ALIASES.items() if canonical in algos]


def check_precision_on_target(precision_name: str, target_name: str) -> None:
    """Refuse a precision the target's tensor cores cannot run, and say which one to use instead."""
    p, t = precision(precision_name), target(target_name)
    if p.name not in t.precisions:
        native = ", ".join(p.native_on)
        raise DgpipeError(
            f"--precision {p.name} does not run natively on {t.name} ({t.gpus[0].product.split('-')[0]}, sm{t.cc[0]}{t.cc[1]}): "
            f"{p.name} needs {native}",
            f"use --precision {t.default_precision} for {t.name}",
        )
