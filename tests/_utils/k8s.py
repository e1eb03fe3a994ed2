"""Rendered Kubernetes objects for tests: the repository's kustomize tree, kubectl's rendering of it, the
pod specs inside workloads, and `dgpipe` run where no cluster configuration can be reached."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests._utils.cli import ROOT
from tests._utils.cli import dgpipe as run_dgpipe

K8S = ROOT / "k8s"
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl (with built-in kustomize) not installed")
IMAGE = "registry.example.com/ml/dgpipe-triton:0.4.0"


def dgpipe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`dgpipe ARGS` with this PATH and nothing else of this environment (no HOME, no KUBECONFIG: no
    cluster is reachable through the user's kube config); `env` adds variables."""
    return run_dgpipe(*args, base_env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, env=env, timeout=120)


def container(pod_spec: dict, name: str) -> dict:
    (c,) = [c for c in pod_spec["containers"] if c["name"] == name]
    return c


def kustomize(path: Path) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def pod_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    """(workload kind, pod spec) for every pod template: Deployments, Jobs, Pods, LeaderWorkerSets."""
    out = []
    for d in docs:
        if d["kind"] in ("Deployment", "Job"):
            out.append((d["kind"], d["spec"]["template"]["spec"]))
        elif d["kind"] == "Pod":
            out.append(("Pod", d["spec"]))
        elif d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            out += [
                ("LWS leader", lwt["leaderTemplate"]["spec"]),
                ("LWS worker", lwt["workerTemplate"]["spec"]),
            ]
    return out
