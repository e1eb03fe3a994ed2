"""Deploy targets (dgx-h100, dgx-b200, ...): a DGX node type as a config, not as code.

Each `configs/deploy/<name>.yaml` says which GPU target its engines are built for (`configs/targets`),
the default precision, the GFD product label and the sizes the pod needs. The kustomize overlay of the
same name (`k8s/overlays/<name>`) must agree with it; tests check both against `configs/targets`, and
which precision may run where is decided only by `pipeline.targets.check_precision_on_target`.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline.errors import DgpipeError, validation_error
from pipeline.resources import config_names, load_yaml

_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T|m)?$")


class DeployTarget(BaseModel):
    """One node type of a GPU cluster and how one Triton replica is sized on it."""

    model_config = ConfigDict(extra="forbid")  # shipped YAML: a misspelt key is an error, not a default

    name: str
    description: str
    gpu_target: str  # configs/targets/<gpu_target>.yaml: the arch the engines are built for
    precision: str  # default precision on this node type (must run natively there)
    gpu_product: str  # value of the GFD label nvidia.com/gpu.product (preferred, not required)
    cpu_arch: Literal["amd64", "arm64"]  # kubernetes.io/arch: GB200 trays have Grace (arm64) hosts
    gpus_per_node: int = Field(ge=1)
    gpus_per_replica: int = Field(ge=1)
    replicas: int = Field(ge=1)
    max_replicas: int = Field(ge=1)  # --replicas and the HPA's maxReplicas stay within it
    max_group_size: int = Field(ge=2)  # --lws-size: pods of one multi-node group (nodes that share a fabric)
    shm_size: str  # /dev/shm for Triton's Python backend (tensors cross processes through it)
    storage: str  # PVC size: checkpoint + ONNX + engines + model repository
    cpu: str
    memory: str

    @field_validator("shm_size", "storage", "cpu", "memory")
    @classmethod
    def _quantity(cls, v: str) -> str:
        if not _QUANTITY.match(v):
            raise ValueError(f"{v!r} is not a Kubernetes quantity (e.g. 16Gi, 500m, 8)")
        return v

    @property
    def compute_major(self) -> int:
        """GFD `nvidia.com/gpu.compute.major` of nodes whose GPUs run this target's engines."""
        from pipeline.targets import target

        return target(self.gpu_target).cc[0]


def deploy_target_names() -> list[str]:
    return config_names("deploy")


@cache
def deploy_target(name: str) -> DeployTarget:
    """Load and check a deploy target: known GPU target, a precision it runs, a replica that fits a node."""
    from pipeline.targets import check_precision_on_target, target

    names = deploy_target_names()
    if name not in names:
        raise DgpipeError(f"unknown deploy target '{name}'", f"choose one of: {', '.join(names)}")
    with validation_error(lambda where, msg: f"configs/deploy/{name}.yaml: {where}: {msg}"):
        cfg = DeployTarget(**load_yaml("deploy", name))
    target(cfg.gpu_target)  # unknown GPU target -> DgpipeError naming the known ones
    check_precision_on_target(cfg.precision, cfg.gpu_target)
    if cfg.gpus_per_replica > cfg.gpus_per_node:
        raise DgpipeError(
            f"configs/deploy/{name}.yaml: gpus_per_replica {cfg.gpus_per_replica} > gpus_per_node "
            f"{cfg.gpus_per_node}",
            "a replica must fit on one node (use the LeaderWorkerSet variant for multi-node groups)",
        )
    if cfg.replicas > cfg.max_replicas:
        raise DgpipeError(
            f"configs/deploy/{name}.yaml: replicas {cfg.replicas} > max_replicas {cfg.max_replicas}"
        )
    return cfg
