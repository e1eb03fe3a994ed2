"""Kubernetes rollout: every overlay renders, validates strictly against the Kubernetes
OpenAPI schemas, and obeys the policies a DGX cluster needs; `dgpipe manifests` and `dgpipe deploy`
work end to end without a cluster (deploy's live path runs against a recording stand-in for kubectl)."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline import endpoints
from pipeline.builddir import LAYOUT, BuildManifest, model_version_dir, save_manifest
from pipeline.deploy.targets import deploy_target, deploy_target_names
from pipeline.limits import Limits
from pipeline.resources import config_names
from pipeline.serving import lifecycle
from pipeline.targets import check_precision_on_target, gpu_named, target
from pipeline.threads import ENV as THREADS_ENV
from pipeline.threads import thread_count
from tests._utils.cli import ROOT
from tests._utils.k8s import IMAGE, K8S, KUBECTL, container, dgpipe, kustomize, needs_kubectl, one, pod_specs

TARGETS = ["dgx-b200", "dgx-h100", "dgx-h200", "gb200", "rtx-pro"]
# Kubernetes release whose OpenAPI schemas the objects must pass (kubectl here is 1.32), and the newest
# kubernetes-validate ships: both must accept every object.
K8S_VERSIONS = ["1.32.0", "1.35.0"]
SERVED = {  # group/versions that current clusters (1.29+) serve for the kinds we use
    "v1": {"Namespace", "ServiceAccount", "ConfigMap", "Service", "PersistentVolumeClaim", "Pod"},
    "apps/v1": {"Deployment"},
    "batch/v1": {"Job"},
    "policy/v1": {"PodDisruptionBudget"},
    "networking.k8s.io/v1": {"NetworkPolicy"},
    "autoscaling/v2": {"HorizontalPodAutoscaler"},
    "monitoring.coreos.com/v1": {"PodMonitor", "PrometheusRule"},
    "leaderworkerset.x-k8s.io/v1": {"LeaderWorkerSet"},
}
CRD_KINDS = {"PodMonitor", "PrometheusRule", "LeaderWorkerSet"}


SECRET_REF = {"name": "dgpipe-api-key", "key": "api-key"}  # the OpenAI port's key: referenced, never inlined


def config_values(docs: list[dict]) -> dict[str, str]:
    return one(docs, "ConfigMap")["data"]


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion in command/args, as the kubelet does it."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


@pytest.fixture(scope="module")
def overlays() -> dict[str, list[dict]]:
    if KUBECTL is None:
        pytest.skip("kubectl (with built-in kustomize) not installed")
    return {name: kustomize(K8S / "overlays" / name) for name in TARGETS}


@pytest.fixture(scope="module")
def side_objects() -> list[dict]:
    if KUBECTL is None:
        pytest.skip("kubectl (with built-in kustomize) not installed")
    return kustomize(K8S / "smoke") + kustomize(K8S / "loader")


@pytest.fixture(scope="module")
def lws_render(tmp_path_factory) -> dict[str, list[dict]]:
    if KUBECTL is None:
        pytest.skip("kubectl (with built-in kustomize) not installed")
    from pipeline.deploy import render as mf

    return mf.render(mf.resolve("gb200", IMAGE, lws_size=2, replicas=3))


# ---- one source for each fact ----------------------------------------------------------------------
def test_k8s_base_config_is_what_render_computes_for_the_defaults():
    """The base's dgpipe-config literals (engine limits, PVC paths, the version dir the node builds into)
    are the Limits defaults and the build layout, exactly as `dgpipe manifests` renders them without a build dir."""
    from pipeline.deploy import render as mf

    base = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    (gen,) = (g for g in base["configMapGenerator"] if g["name"] == "dgpipe-config")
    literals = dict(lit.split("=", 1) for lit in gen["literals"])
    assert literals == mf.pod_config(None, None, gpu_target="unset", precision="unset")
    assert literals["DGPIPE_MAX_CONTEXT"] == str(Limits().max_context)
    assert literals["DGPIPE_ENGINE_OUTPUT"] == str(
        model_version_dir(Path(mf.PVC_BUILD_DIR) / LAYOUT["model_repository"])
    )


def test_kubectl_is_looked_up_in_one_place(tmp_path, monkeypatch):
    """doctor, manifests and deploy agree on which kubectl runs: $DGPIPE_KUBECTL first, else PATH."""
    from pipeline.deploy.kubectl import kubectl_binary, kubectl_name
    from pipeline.doctor import check_kubectl
    from pipeline.errors import DgpipeError

    exe = tmp_path / "kubectl-stand-in"
    exe.write_text('#!/bin/sh\necho "  gitVersion: v9.99.0"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("DGPIPE_KUBECTL", str(exe))
    assert kubectl_binary() == kubectl_name() == str(exe)
    check = check_kubectl()
    assert check.ok and check.detail == f"{exe} (v9.99.0)"
    monkeypatch.setenv("DGPIPE_KUBECTL", "")
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.raises(DgpipeError, match="kubectl not found"):
        kubectl_binary()
    assert not check_kubectl().ok and kubectl_name() == "kubectl"


# ---- deploy configs <-> overlays <-> GPU targets ----------------------------------------------------
def test_every_deploy_target_has_an_overlay_and_vice_versa():
    assert deploy_target_names() == sorted(TARGETS)
    assert sorted(p.name for p in (K8S / "overlays").iterdir()) == sorted(TARGETS)


@pytest.mark.parametrize("name", TARGETS)
def test_deploy_config_is_consistent_with_gpu_targets(name):
    cfg = deploy_target(name)
    check_precision_on_target(cfg.precision, cfg.gpu_target)  # raises when the GPUs cannot run it
    expected = {"dgx-h100": (9, "fp8"), "dgx-h200": (9, "fp8"), "dgx-b200": (10, "nvfp4")}
    expected |= {"gb200": (10, "nvfp4"), "rtx-pro": (12, "nvfp4")}
    assert (cfg.compute_major, cfg.precision) == expected[name]
    if name == "rtx-pro":
        assert cfg.gpus_per_node == cfg.gpus_per_replica == 1
    assert cfg.cpu_arch == ("arm64" if name == "gb200" else "amd64")
    # GPU feature discovery labels a node with its GPU's driver name, "-" for " ": one of the target's GPUs
    names = [n.replace(" ", "-") for g in target(cfg.gpu_target).gpus for n in g.device_names]
    assert cfg.gpu_product in names


def test_a_running_gpu_finds_its_datasheet_entry_by_its_whole_driver_name():
    """Driver names (NVIDIA's open-gpu-kernel-modules README) that hold another product's name find their
    own entry or none: a PCIe H100's bandwidth is 60% of the SXM's, a GH200 is no H200."""
    found = lambda name: (g := gpu_named(name)) and g.product
    assert found("NVIDIA H100 80GB HBM3") == "H100-SXM5-80GB"
    assert found("NVIDIA H100 PCIe") == "H100-PCIe-80GB" and found("NVIDIA H100 NVL") == "H100-NVL-94GB"
    assert found("NVIDIA H200") == "H200-SXM-141GB" and found("NVIDIA H200 NVL") == "H200-NVL-141GB"
    assert found("NVIDIA GH200 480GB") == "GH200-96GB" and found("NVIDIA GH200 144G HBM3e") == "GH200-144GB"
    assert found("NVIDIA GeForce RTX 5090") == "RTX-5090" and found(" nvidia b200 ") == "B200-180GB"
    assert found("NVIDIA RTX PRO 6000 Blackwell Server Edition") == "RTX-PRO-6000-Blackwell"
    assert found("NVIDIA H20") is None and found("NVIDIA H800") is None and found("NVIDIA H100") is None
    every = [
        n.casefold() for t in map(target, config_names("targets")) for g in t.gpus for n in g.device_names
    ]
    assert len(every) == len(set(every))  # one entry per name


@needs_kubectl
@pytest.mark.parametrize("name", TARGETS)
def test_overlay_matches_its_deploy_config(overlays, name):
    docs, cfg = overlays[name], deploy_target(name)
    conf = config_values(docs)
    assert conf["DGPIPE_GPU_TARGET"] == cfg.gpu_target
    assert conf["DGPIPE_PRECISION"] == cfg.precision
    # plans go into the model's version dir, where the Triton model looks for engines/<target>
    assert conf["DGPIPE_ENGINE_OUTPUT"] == f"/models/build/{LAYOUT['model_repository']}/dgpipe/1"
    limits = Limits()
    assert (conf["DGPIPE_MAX_BATCH"], conf["DGPIPE_MAX_PROMPT"], conf["DGPIPE_MAX_CONTEXT"]) == (
        str(limits.max_batch),
        str(limits.max_prompt),
        str(limits.max_context),
    )
    dep = one(docs, "Deployment")
    spec = dep["spec"]["template"]["spec"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms == [
        {
            "matchExpressions": [
                {
                    "key": "nvidia.com/gpu.compute.major",
                    "operator": "In",
                    "values": [str(target(cfg.gpu_target).cc[0])],
                },
                {  # arch-specific (sm_XXXa) code runs on that exact capability only: 10.3 (B300) is no sm100
                    "key": "nvidia.com/gpu.compute.minor",
                    "operator": "In",
                    "values": [str(target(cfg.gpu_target).cc[1])],
                },
                {"key": "kubernetes.io/arch", "operator": "In", "values": [cfg.cpu_arch]},
            ]
        }
    ]
    preferred = spec["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred[0]["preference"]["matchExpressions"][0]["values"] == [cfg.gpu_product]
    for c in [container(spec, "triton"), *spec["initContainers"]]:  # the openai sidecar needs no GPU
        assert c["resources"]["limits"]["nvidia.com/gpu"] == str(cfg.gpus_per_replica)
        assert c["resources"]["requests"]["nvidia.com/gpu"] == str(cfg.gpus_per_replica)
        assert c["resources"]["limits"]["memory"] == cfg.memory
        # no CPU limit: compute threads follow the CPU request through the downward API, which gives
        # whole cores (rounded up), so the pods on one node do not each start a thread per node core
        assert c["resources"]["requests"]["cpu"] == cfg.cpu and "cpu" not in c["resources"]["limits"]
        (threads,) = [e for e in c["env"] if e["name"] == THREADS_ENV]
        assert threads["valueFrom"] == {"resourceFieldRef": {"resource": "requests.cpu"}}
        assert thread_count(1, {THREADS_ENV: cfg.cpu}) == int(cfg.cpu)
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": cfg.shm_size}
    assert dep["spec"]["replicas"] == cfg.replicas  # `dgpipe manifests` leaves it to the HPA (below)
    assert one(docs, "PersistentVolumeClaim")["spec"]["resources"]["requests"]["storage"] == cfg.storage
    hpa = one(docs, "HorizontalPodAutoscaler")["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (cfg.replicas, cfg.max_replicas)


# ---- rendering and schema validation ----------------------------------------------------------------
@needs_kubectl
def test_every_overlay_renders_the_full_object_set(overlays):
    for docs in overlays.values():
        assert sorted(d["kind"] for d in docs) == sorted(
            [
                *("ServiceAccount", "ConfigMap", "Service", "PersistentVolumeClaim", "Deployment"),
                *("PodDisruptionBudget", "HorizontalPodAutoscaler", "PodMonitor", "PrometheusRule"),
                "NetworkPolicy",
            ]
        )


@needs_kubectl
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_objects_validate_strictly_against_kubernetes_openapi(overlays, side_objects, lws_render, version):
    kv = pytest.importorskip("kubernetes_validate")
    docs = [d for ds in overlays.values() for d in ds] + side_objects
    docs += [d for ds in lws_render.values() for d in ds]
    checked = 0
    for d in docs:
        if d["kind"] in CRD_KINDS:
            continue
        kv.validate(d, version, strict=True)  # raises ValidationError on unknown or mistyped fields
        checked += 1
    # LeaderWorkerSet pod templates: validate them as core PodTemplates (same PodTemplateSpec schema)
    for _, spec in pod_specs(one_list(lws_render, "LeaderWorkerSet")):
        kv.validate(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "t"},
                "template": {"spec": spec},
            },
            version,
            strict=True,
        )
        checked += 1
    # 5 overlays x 8 core kinds, smoke Job + loader Pod, 10 core objects of the LWS render, 2 pod templates
    assert checked == 5 * 8 + 2 + 10 + 2


def one_list(files: dict[str, list[dict]], kind: str) -> list[dict]:
    return [d for ds in files.values() for d in ds if d["kind"] == kind]


@needs_kubectl
def test_api_versions_are_served_by_current_clusters(overlays, side_objects, lws_render):
    docs = (
        [d for ds in overlays.values() for d in ds]
        + side_objects
        + [d for ds in lws_render.values() for d in ds]
    )
    for d in docs:
        assert d["kind"] in SERVED.get(d["apiVersion"], set()), f"{d['kind']} {d['apiVersion']}"


# ---- policies -----------------------------------------------------------------------------------------
@needs_kubectl
def test_probes_ports_and_startup_budget(overlays):
    for docs in overlays.values():
        dep = one(docs, "Deployment")
        spec = dep["spec"]["template"]["spec"]
        assert [c["name"] for c in spec["containers"]] == ["triton", "openai"]
        triton = container(spec, "triton")
        assert {p["name"]: p["containerPort"] for p in triton["ports"]} == {
            "http": 8000,
            "grpc": 8001,
            "metrics": 8002,
        }
        # Triton's /v2/health/* say 200 with the backend stub gone: both probes ping the model instead
        url = ["--url", "http://127.0.0.1:8000"]
        assert triton["livenessProbe"]["exec"]["command"] == ["dgpipe", "health", "probe", "--live", *url]
        assert triton["readinessProbe"]["exec"]["command"] == ["dgpipe", "health", "probe", *url]
        # exec probes get no $(VAR) expansion: `dgpipe health probe` reads the served name from the env
        assert endpoints.MODEL_NAME_ENV in {e["name"] for e in triton["env"]}
        # graceful drain: preStop refuses new requests and waits (DRAIN_TIMEOUT_S) for those in flight,
        # tritonserver then exits within its exit timeout, all inside the grace period
        assert triton["lifecycle"]["preStop"]["exec"]["command"] == ["dgpipe", "health", "drain"]
        assert {"name": "DGPIPE_DRAIN_FILE", "value": "/tmp/dgpipe-draining"} in triton["env"]
        assert f"--exit-timeout-secs={lifecycle.EXIT_TIMEOUT_S}" in triton["args"]
        assert spec["terminationGracePeriodSeconds"] == lifecycle.TERMINATION_GRACE_S
        assert lifecycle.DRAIN_TIMEOUT_S + lifecycle.EXIT_TIMEOUT_S < lifecycle.TERMINATION_GRACE_S
        # the kubelet restarts a pod whose model answers nothing as late as `dgpipe serve` stops one
        live = triton["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] == lifecycle.WEDGED_AFTER_S
        startup = triton["startupProbe"]
        assert startup["httpGet"]["path"] == "/v2/health/ready"
        budget = startup["periodSeconds"] * startup["failureThreshold"]
        assert budget >= 30 * 60  # weights + warm-up of a 25B model
        # the engine build runs in an initContainer, where probes do not run: the Deployment's progress
        # deadline must cover a build (>= 30 min) on top of the load budget
        assert dep["spec"]["progressDeadlineSeconds"] >= budget + 30 * 60
        svc = one(docs, "Service")
        assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {
            "http": (8000, "http"),
            "grpc": (8001, "grpc"),
            "metrics": (8002, "metrics"),
            "openai": (9000, "openai"),
        }
        # the OpenAI frontend: its own port and probes, Triton over gRPC in the pod, the key from a Secret
        api = container(spec, "openai")
        assert api["image"] == triton["image"] and "nvidia.com/gpu" not in api["resources"]["limits"]
        assert api["command"][:3] == ["dgpipe", "serve", "--triton-url=grpc://127.0.0.1:8001"]
        assert "--openai-port=9000" in api["command"]
        assert {p["name"]: p["containerPort"] for p in api["ports"]} == {"openai": 9000}
        assert api["readinessProbe"]["httpGet"] == {"path": "/health", "port": "openai"}
        assert not any(
            a.startswith("--drain-timeout") for a in api["command"]
        )  # the CLI's default: one source
        assert api["livenessProbe"]["tcpSocket"] == {"port": "openai"}
        (key,) = [e for e in api["env"] if e["name"] == "DGPIPE_API_KEY"]
        assert key == {"name": "DGPIPE_API_KEY", "valueFrom": {"secretKeyRef": SECRET_REF}}  # never inlined
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items()


@needs_kubectl
def test_security_context_everywhere(overlays, side_objects, lws_render):
    docs = (
        [d for ds in overlays.values() for d in ds]
        + side_objects
        + [d for ds in lws_render.values() for d in ds]
    )
    specs = pod_specs(docs)
    assert len(specs) == 5 + 2 + 4  # overlays, smoke + loader, LWS leader + worker + smoke + loader
    for kind, spec in specs:
        assert spec["securityContext"]["runAsNonRoot"] is True, kind
        assert spec["securityContext"]["runAsUser"] != 0, kind
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, kind
        assert spec["automountServiceAccountToken"] is False, kind
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (kind, c["name"])
            assert sc["privileged"] is False, (kind, c["name"])
            assert sc["capabilities"] == {"drop": ["ALL"]}, (kind, c["name"])
            assert "limits" in c["resources"] and "memory" in c["resources"]["limits"], (kind, c["name"])


@needs_kubectl
def test_gpu_scheduling_tolerations_and_shm(overlays):
    for docs in overlays.values():
        spec = one(docs, "Deployment")["spec"]["template"]["spec"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        triton = container(spec, "triton")
        mounts = {m["mountPath"]: m for m in triton["volumeMounts"]}
        assert mounts["/dev/shm"]["name"] == "dshm"
        assert mounts["/models"].get("readOnly") is True  # serving never writes the repository


@needs_kubectl
@pytest.mark.parametrize("name", TARGETS)
def test_engine_build_runs_on_the_node_in_the_serving_image(overlays, name):
    docs, cfg = overlays[name], deploy_target(name)
    spec = one(docs, "Deployment")["spec"]["template"]["spec"]
    (build,) = spec["initContainers"]
    triton = container(spec, "triton")
    assert build["image"] == triton["image"]
    env = config_values(docs)
    assert expand(build["command"], env) == [
        "flock",
        "/models/build/.engine-build.lock",  # one build per PVC at a time
        "dgpipe",
        "engine",
        "build",
        "--onnx",
        f"/models/build/{LAYOUT['onnx']}/model.onnx",
        "--target",
        cfg.gpu_target,
        "--precision",
        cfg.precision,
        "--plugins",
        f"/models/build/{LAYOUT['plugins']}",
        "--output",
        f"/models/build/{LAYOUT['model_repository']}/dgpipe/1",
        *Limits().engine_flags(),
    ]
    assert triton["command"] == ["tritonserver"]
    args = expand(triton["args"], {**env, "DGPIPE_ADMIN_KEY": "key"})  # the Secret's value
    assert f"--model-repository=/models/build/{LAYOUT['model_repository']}" in args
    assert {"--http-port=8000", "--grpc-port=8001", "--metrics-port=8002"} <= set(args)
    # every $(VAR) the containers use is defined in their env (the kubelet leaves unknown ones verbatim)
    for c in (build, triton, container(spec, "openai")):
        names = {e["name"] for e in c["env"]}
        used = set(re.findall(r"\$\((\w+)\)", " ".join(c.get("command", []) + c.get("args", []))))
        assert used <= names, c["name"]


@needs_kubectl
def test_rollout_disruption_and_autoscaling_policy(overlays):
    adapter = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-rules.yaml").read_text())
    served_metrics = {r["name"]["as"] for r in adapter["rules"]["custom"]}
    for docs in overlays.values():
        dep = one(docs, "Deployment")
        assert dep["spec"]["strategy"] == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
        }
        pod_labels = dep["spec"]["template"]["metadata"]["labels"]
        pdb = one(docs, "PodDisruptionBudget")
        assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        hpa = one(docs, "HorizontalPodAutoscaler")
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": dep["metadata"]["name"],
        }
        names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
        assert names == {"dgpipe_active_requests"} and names <= served_metrics
        assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 600


@needs_kubectl
def test_monitoring_objects_are_well_formed(overlays):
    """PodMonitor/PrometheusRule are CRDs kubernetes-validate has no schema for: check their structure
    against the fields prometheus-operator's monitoring.coreos.com/v1 CRDs define."""
    duration = re.compile(r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?)$")
    for docs in overlays.values():
        pod_spec = one(docs, "Deployment")["spec"]["template"]["spec"]
        port_names = {p["name"] for c in pod_spec["containers"] for p in c["ports"]}
        pm = one(docs, "PodMonitor")
        assert set(pm["spec"]) == {"selector", "podMetricsEndpoints"}
        assert (
            pm["spec"]["selector"]["matchLabels"].items()
            <= one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"].items()
        )
        for ep in pm["spec"]["podMetricsEndpoints"]:
            assert set(ep) <= {"port", "path", "interval", "scrapeTimeout"}
            assert ep["port"] in port_names and ep["path"] == "/metrics"
            assert duration.match(ep["interval"]) and duration.match(ep["scrapeTimeout"])
        rule = one(docs, "PrometheusRule")
        records = set()
        for group in rule["spec"]["groups"]:
            assert set(group) == {"name", "rules"} and group["name"]
            for r in group["rules"]:
                assert set(r) <= {"record", "alert", "expr", "for", "labels", "annotations"}
                assert ("record" in r) != ("alert" in r) and isinstance(r["expr"], str) and r["expr"].strip()
                assert duration.match(r.get("for", "0"))
                records.add(r.get("record"))
        assert "dgpipe:request_latency_seconds:p95_5m" in records
        # recording rules read dgpipe's histograms as Prometheus exposes them (name_bucket with le)
        p95 = next(
            r["expr"]
            for g in rule["spec"]["groups"]
            for r in g["rules"]
            if r.get("record") == "dgpipe:request_latency_seconds:p95_5m"
        )
        assert "histogram_quantile(0.95" in p95 and "dgpipe_request_latency_seconds_bucket" in p95
        assert re.search(r"\bby \([^)]*\ble\b", p95), p95  # the quantile needs the buckets' bounds kept


def test_leaderworkerset_variant(lws_render):
    docs = [d for ds in lws_render.values() for d in ds]
    assert not [d for d in docs if d["kind"] == "Deployment"]
    (lws,) = [d for d in docs if d["kind"] == "LeaderWorkerSet"]
    spec = lws["spec"]
    assert set(spec) <= {
        "replicas",
        "startupPolicy",
        "rolloutStrategy",
        "leaderWorkerTemplate",
        "networkConfig",
    }
    assert "replicas" not in spec and spec["leaderWorkerTemplate"]["size"] == 2  # the HPA owns the count
    assert one(docs, "HorizontalPodAutoscaler")["spec"]["minReplicas"] == 3
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert spec["startupPolicy"] in ("LeaderCreated", "LeaderReady")
    assert spec["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxSurge": 0, "maxUnavailable": 1}
    cm = one(docs, "ConfigMap")["metadata"]["name"]
    for _, pod in pod_specs([lws]):
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]
        assert terms[0]["matchExpressions"][0]["values"] == ["10"]
        refs = {
            e["valueFrom"]["configMapKeyRef"]["name"]
            for c in pod["containers"]
            for e in c["env"]
            if "configMapKeyRef" in e.get("valueFrom", {})
        }
        assert refs == {cm}  # the hash-suffixed name reached the LWS templates
        assert all(c["image"] == IMAGE for c in pod["containers"] + pod["initContainers"])
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "LeaderWorkerSet"


def test_leaderworkerset_headless_services_are_not_taken_by_ours(lws_render):
    """The LWS controller creates the headless Service behind its pods' DNS names only where no Service of
    that name exists (`CreateHeadlessServiceIfNotExists`): named like the LWS under the Shared subdomain
    policy, like each group's leader pod (`<lws>-<group>`) under UniquePerReplica."""
    docs = [d for ds in lws_render.values() for d in ds]
    lws = one(docs, "LeaderWorkerSet")
    name = lws["metadata"]["name"]
    policy = lws["spec"].get("networkConfig", {}).get("subdomainPolicy", "Shared")
    ours = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    assert ours, "the serving Service is rendered"
    if policy == "Shared":
        assert name not in ours
    else:
        assert policy == "UniquePerReplica"
        assert not [s for s in ours if re.fullmatch(rf"{re.escape(name)}-\d+", s)]


def test_dockerfile_builds_on_the_ngc_triton_image():
    from pipeline.serving.server import NGC_IMAGE

    text = (ROOT / "Dockerfile").read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert froms and froms[0] == NGC_IMAGE  # the same Triton (and TensorRT) as `dgpipe serve --image`
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(r"^ENTRYPOINT\s", text, re.M)
    assert ".git" in (ROOT / ".dockerignore").read_text().split()


# ---- dgpipe manifests / deploy ------------------------------------------------------------------------
@pytest.fixture
def build_dir(tmp_path) -> Path:
    d = tmp_path / "build"
    for sub in ("onnx", "model_repository/dgpipe/1", "plugins/sm100"):
        (d / sub).mkdir(parents=True)
    (d / "onnx" / "model.onnx").write_bytes(b"onnx")
    (d / "model_repository" / "dgpipe" / "config.pbtxt").write_text('name: "dgpipe"\n')
    man = BuildManifest(
        model="google/diffusiongemma-26B-A4B-it", precision="nvfp4", targets=["sm100", "sm120"]
    )
    man.record("export", outputs={"onnx": "onnx"})
    man.record("package", outputs={"model_repository": "model_repository"})
    save_manifest(d, man)
    return d


def sudoku_smoke() -> dict:
    """What `dgpipe build` records for the embedded Sudoku model."""
    from pipeline.deploy.smoke import smoke_test_for
    from pipeline.model.checkpoint import open_checkpoint
    from pipeline.runtime.session import default_model_path

    return smoke_test_for(open_checkpoint(default_model_path())).as_dict()


@pytest.fixture
def sudoku_build_dir(build_dir) -> Path:
    from pipeline.builddir import load_manifest

    man = load_manifest(build_dir)
    man.smoke = sudoku_smoke()
    save_manifest(build_dir, man)
    return build_dir


@needs_kubectl
def test_manifests_end_to_end_with_build_manifest(build_dir):
    proc = dgpipe(
        "manifests",
        "--target",
        "dgx-b200",
        "--build-dir",
        str(build_dir),
        "--image",
        IMAGE,
        "--namespace",
        "llm",
        "--replicas",
        "3",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    out = build_dir / "k8s"
    assert info["output"] == str(out) and info["precision"] == "nvfp4" and info["compute_major"] == 10
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["storage.yaml", "dgpipe.yaml", "smoke-job.yaml", "pvc-loader.yaml", "render.json"]
    )
    docs = [
        d
        for f in ("storage.yaml", "dgpipe.yaml", "smoke-job.yaml", "pvc-loader.yaml")
        for d in yaml.safe_load_all((out / f).read_text())
        if d
    ]
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"llm"}
    ns = one(docs, "Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    dep = one(docs, "Deployment")
    assert "replicas" not in dep["spec"]
    assert {
        c["image"] for _, s in pod_specs(docs) for c in s["containers"] + s.get("initContainers", [])
    } == {IMAGE}
    assert config_values(docs)["DGPIPE_PRECISION"] == "nvfp4"
    assert one(docs, "HorizontalPodAutoscaler")["spec"]["minReplicas"] == 3
    # the build manifest records the stage with a path relative to the build dir
    man = json.loads((build_dir / "build_manifest.json").read_text())
    assert man["stages"]["manifests"]["outputs"] == {"k8s": "k8s"}
    assert man["stages"]["manifests"]["details"]["target"] == "dgx-b200"


@needs_kubectl
def test_manifests_without_monitoring_and_smoke_prompt(tmp_path):
    out = tmp_path / "k8s"
    proc = dgpipe(
        "manifests",
        "--target",
        "rtx-pro",
        "--image",
        IMAGE,
        "--output",
        str(out),
        "--no-monitoring",
        "--smoke-prompt",
        "Say hi",
    )
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all((out / "dgpipe.yaml").read_text()) if d]
    assert sorted(d["kind"] for d in docs) == [
        "ConfigMap",
        "Deployment",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Service",
    ]
    assert one(docs, "Deployment")["spec"]["replicas"] == deploy_target("rtx-pro").replicas  # no HPA
    job = next(yaml.safe_load_all((out / "smoke-job.yaml").read_text()))
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["python3", "-m", "pipeline.deploy.smoke"]
    # without a build: the plain-text format's check (a non-empty answer) on the user's prompt, sent through
    # the Service's OpenAI port with the key from the Secret
    assert c["args"] == [
        "--url",
        "http://dgpipe-triton:9000/v1",
        "--model",
        "dgpipe",
        "--format",
        "text",
        "--max-tokens",
        "64",
        "--",
        "Say hi",
    ]
    assert {"name": "DGPIPE_API_KEY", "valueFrom": {"secretKeyRef": SECRET_REF}} in c["env"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--target", "dgx-a100", "--image", IMAGE], "unknown deploy target 'dgx-a100'"),
        (
            ["--target", "dgx-h100", "--precision", "nvfp4", "--image", IMAGE],
            "nvfp4 does not run natively on sm90",
        ),
        (["--target", "dgx-b200"], "--image is required"),
        (["--target", "dgx-b200", "--image", "registry.example.com/dgpipe-triton"], "has no tag or digest"),
        (["--target", "dgx-b200", "--image", "dgpipe-triton:latest"], "is not a pinned version"),
        (["--target", "dgx-b200", "--image", IMAGE, "--namespace", "Bad_NS"], "not a valid namespace"),
    ],
)
def test_manifests_bad_input_fails_before_writing(tmp_path, args, message):
    out = tmp_path / "k8s"
    proc = dgpipe("manifests", *args, "--output", str(out))
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_manifests_refuses_a_build_for_other_gpus(tmp_path):
    d = tmp_path / "b"
    save_manifest(d, BuildManifest(model="m", precision="fp8", targets=["sm90"]))
    proc = dgpipe("manifests", "--target", "dgx-b200", "--build-dir", str(d), "--image", IMAGE)
    assert proc.returncode == 2 and "was built for sm90" in proc.stderr
    assert not (d / "k8s").exists()
    nvfp4 = tmp_path / "n"
    save_manifest(nvfp4, BuildManifest(model="m", precision="nvfp4", targets=["sm90"]))
    proc = dgpipe("manifests", "--target", "dgx-h100", "--build-dir", str(nvfp4), "--image", IMAGE)
    assert proc.returncode == 2 and "nvfp4 does not run natively" in proc.stderr and "dgx-h100" in proc.stderr


@pytest.fixture
def rendered(tmp_path) -> Path:
    if KUBECTL is None:
        pytest.skip("kubectl (with built-in kustomize) not installed")
    from pipeline.deploy import render as mf

    values = mf.resolve("dgx-h200", IMAGE, namespace="serving")
    mf.write(tmp_path / "k8s", values, mf.render(values))
    return tmp_path / "k8s"


def test_deploy_dry_run_prints_the_plan_without_a_cluster(rendered, build_dir):
    no_cluster = {"KUBECONFIG": "/nonexistent", "PATH": "/nonexistent"}  # no cluster and no kubectl
    proc = dgpipe(
        "deploy",
        "--manifests",
        str(rendered),
        "--build-dir",
        str(build_dir),
        "--upload",
        "--context",
        "dgx-prod",
        "--dry-run",
        "--json",
        env=no_cluster,
    )
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["namespace"] == "serving" and plan["workload"] == "deployment/dgpipe-triton"
    assert "Deployment/dgpipe-triton" in plan["objects"]["dgpipe.yaml"]
    cmds = [s["command"] for s in plan["steps"]]
    assert all("--context dgx-prod" in c for c in cmds)
    applies = [c for c in cmds if " apply " in c]
    assert all("--server-side --field-manager=dgpipe" in c for c in applies)
    order = [
        next(i for i, c in enumerate(cmds) if key in c)
        for key in (
            "storage.yaml",
            "pvc-loader.yaml",
            "exec -i dgpipe-pvc-loader",
            "dgpipe.yaml",
            "rollout status",
            "smoke-job.yaml",
            "wait --for=condition=complete job/dgpipe-smoke",
        )
    ]
    assert order == sorted(order)
    text = dgpipe("deploy", "--manifests", str(rendered), "--dry-run").stdout
    assert "plan: dgx-h200 -> deployment/dgpipe-triton in namespace serving" in text


def test_deploy_bad_input(tmp_path, rendered):
    proc = dgpipe("deploy", "--manifests", str(tmp_path), "--dry-run")
    assert proc.returncode == 2 and "not a `dgpipe manifests` output" in proc.stderr
    proc = dgpipe("deploy", "--manifests", str(rendered), "--upload", "--dry-run")
    assert proc.returncode == 2 and "--upload needs --build-dir" in proc.stderr
    empty = tmp_path / "empty-build"
    empty.mkdir()
    proc = dgpipe("deploy", "--manifests", str(rendered), "--build-dir", str(empty), "--upload", "--dry-run")
    assert (
        proc.returncode == 2
        and "missing build_manifest.json, onnx/model.onnx, model_repository" in proc.stderr
    )


FAKE_KUBECTL = r"""#!/bin/sh
# records every call; answers discovery; fails the calls whose arguments contain $FAKE_FAIL
echo "$*" >> "$FAKE_LOG"
if [ -n "$FAKE_STDIN" ]; then cat >> "$FAKE_STDIN"; else cat > /dev/null; fi
if [ -n "$FAKE_FAIL" ]; then case "$*" in *"$FAKE_FAIL"*) echo "error: simulated failure" >&2; exit 1;; esac; fi
case "$*" in *"jsonpath={.spec.replicas}"*) echo "${FAKE_REPLICAS:-2}"; exit 0;; esac
case "$*" in *jsonpath=*)  # the pod template: changes with each apply of the serving file, unless FAKE_SAME
  if [ -n "$FAKE_SAME" ]; then echo same; else grep -c "dgpipe.yaml" "$FAKE_LOG"; fi; exit 0;; esac
case "$*" in *api-resources*)
  [ -z "$FAKE_NO_CRDS" ] && printf 'podmonitors.monitoring.coreos.com\nprometheusrules.monitoring.coreos.com\n'
  exit 0;; esac
case "$*" in *condition=complete*) [ -n "$FAKE_JOB_FAILED" ] && { sleep 30 & echo "complete-wait sleep $!" >> "$FAKE_LOG"; wait $!; echo "complete-wait ran out" >> "$FAKE_LOG"; exit 1; };; esac
case "$*" in *condition=failed*) [ -n "$FAKE_JOB_FAILED" ] && { for _ in $(seq 100); do grep -q "complete-wait sleep" "$FAKE_LOG" && break; sleep 0.05; done; exit 0; }; sleep 30; exit 1;; esac
exit 0
"""


@pytest.fixture
def fake_kubectl(tmp_path, monkeypatch) -> Path:
    exe = tmp_path / "kubectl"
    exe.write_text(FAKE_KUBECTL)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("FAKE_LOG", str(log))
    for var in ("FAKE_FAIL", "FAKE_NO_CRDS", "FAKE_JOB_FAILED", "FAKE_SAME", "FAKE_STDIN", "FAKE_REPLICAS"):
        monkeypatch.setenv(var, "")
    return log


def test_deploy_live_path_order_against_a_recording_kubectl(rendered, build_dir, fake_kubectl, monkeypatch):
    from pipeline.deploy import rollout as dp

    monkeypatch.setenv("DGPIPE_KUBECTL", str(fake_kubectl.parent / "kubectl"))
    plan = dp.make_plan(rendered, context="dgx", upload=build_dir)
    result = dp.execute(plan, log=lambda s: None)
    calls = fake_kubectl.read_text().splitlines()
    assert calls[0].endswith("get deployment/dgpipe-triton -o jsonpath={.spec.template}")  # what runs now?
    assert calls[1].endswith("--context dgx api-resources --api-group=monitoring.coreos.com -o name")
    assert any("exec -i dgpipe-pvc-loader" in c for c in calls)
    assert calls[-1].endswith("logs job/dgpipe-smoke --tail=50")
    # every step ran but the restart: the apply changed the pod template, which rolls the pods anyway
    assert len(result["steps"]) == len(plan.steps) - 1 and not any("rollout undo" in c for c in calls)


def test_deploy_rolls_back_and_reports_a_failed_smoke_test(rendered, fake_kubectl, monkeypatch):
    from pipeline.deploy import rollout as dp
    from pipeline.errors import DgpipeError

    monkeypatch.setenv("DGPIPE_KUBECTL", str(fake_kubectl.parent / "kubectl"))
    monkeypatch.setenv("FAKE_FAIL", "wait --for=condition=complete")
    logs: list[str] = []
    with pytest.raises(DgpipeError, match="wait for the smoke Job failed: error: simulated failure") as e:
        dp.execute(dp.make_plan(rendered), log=logs.append)
    assert "rolled back to the previous revision" in str(e.value)
    calls = fake_kubectl.read_text().splitlines()
    assert any(c.endswith("rollout undo deployment/dgpipe-triton") for c in calls)
    assert any("get pods -l app.kubernetes.io/name=dgpipe" in c for c in calls)  # diagnostics collected


def test_deploy_decides_on_step_kinds_not_on_step_text(rendered, build_dir, fake_kubectl, monkeypatch):
    """Rollback and loader cleanup follow what the steps are, whatever they are called on screen."""
    from pipeline.deploy import rollout as dp
    from pipeline.errors import DgpipeError

    monkeypatch.setenv("DGPIPE_KUBECTL", str(fake_kubectl.parent / "kubectl"))
    monkeypatch.setenv("FAKE_FAIL", "wait --for=condition=complete")
    plan = dp.make_plan(rendered)
    for i, step in enumerate(plan.steps):
        step.what = f"step {i}"  # reworded for display: nothing else may change
    with pytest.raises(DgpipeError, match="rolled back to the previous revision"):
        dp.execute(plan, log=lambda s: None)
    assert any(
        c.endswith("rollout undo deployment/dgpipe-triton") for c in fake_kubectl.read_text().splitlines()
    )
    # the upload failing leaves the loader pod running: it is removed, found by kind
    fake_kubectl.write_text("")
    monkeypatch.setenv("FAKE_FAIL", "exec -i")
    plan = dp.make_plan(rendered, upload=build_dir)
    for step in plan.steps:
        step.what = "renamed"
    with pytest.raises(DgpipeError):
        dp.execute(plan, log=lambda s: None)
    assert (
        fake_kubectl.read_text()
        .splitlines()[-1]
        .endswith("delete pod dgpipe-pvc-loader --ignore-not-found --wait=false")
    )


def test_deploy_owns_what_it_renders_and_removes_what_an_earlier_render_left(rendered, tmp_path):
    """Server-side apply forces dgpipe's values over other managers' (a `kubectl rollout undo`'s template);
    objects the render toggles (workload kind, monitoring) that this render lacks are deleted, tolerating a
    kind whose CRD the cluster does not serve."""
    from pipeline.deploy import render as mf
    from pipeline.deploy import rollout as dp

    plan = dp.make_plan(rendered)
    applies = [s.argv for s in plan.steps if "--field-manager=dgpipe" in s.argv]
    assert len(applies) == 3 and all("--force-conflicts" in a for a in applies)
    pruned = [s.argv[-2] for s in plan.steps if s.kind is dp.StepKind.PRUNE]
    assert pruned == ["leaderworkerset/dgpipe-triton"]  # this render has the Deployment and monitoring
    values = mf.resolve("gb200", IMAGE, lws_size=2, monitoring=False)
    mf.write(tmp_path / "lws", values, mf.render(values))
    plan = dp.make_plan(tmp_path / "lws")
    assert [s.argv[-2] for s in plan.steps if s.kind is dp.StepKind.PRUNE] == [
        "deployment/dgpipe-triton",
        "horizontalpodautoscaler/dgpipe-triton",
        "podmonitor/dgpipe-triton",
        "prometheusrule/dgpipe-triton",
    ]
    kinds = [s.kind for s in plan.steps]
    assert (
        kinds.index(dp.StepKind.SERVING)
        < kinds.index(dp.StepKind.PRUNE)
        < kinds.index(dp.StepKind.ROLLOUT_WAIT)
    )
    unserved = 'echo "error: the server doesn\'t have a resource type \\"podmonitors\\"" >&2; exit 1'
    step = dp.Step("prune", ["sh", "-c", unserved], dp.StepKind.PRUNE, tolerate=dp.UNSERVED_KIND)
    assert dp._run(step).returncode == 0
    assert (
        dp._run(
            dp.Step("other", ["sh", "-c", "echo 'error: forbidden' >&2; exit 1"], tolerate=dp.UNSERVED_KIND)
        ).returncode
        == 1
    )


def test_deploy_checks_the_secrets_the_pods_read_before_applying(rendered, fake_kubectl, monkeypatch):
    from pipeline.deploy import rollout as dp
    from pipeline.errors import DgpipeError

    monkeypatch.setenv("DGPIPE_KUBECTL", str(fake_kubectl.parent / "kubectl"))
    plan = dp.make_plan(rendered)
    (check,) = [s for s in plan.steps if s.kind is dp.StepKind.CHECK_SECRETS]
    assert check.argv[-5:] == ["secret", "dgpipe-admin-key", "dgpipe-api-key", "-o", "name"]
    monkeypatch.setenv("FAKE_FAIL", "get secret")
    with pytest.raises(DgpipeError, match="check that the Secrets the pods read exist failed") as e:
        dp.execute(plan, log=lambda s: None)
    assert " -n serving create secret generic dgpipe-api-key --from-literal=api-key=" in e.value.hint
    assert "create secret generic dgpipe-admin-key --from-literal=admin-key=" in e.value.hint
    assert not any("dgpipe.yaml" in c for c in fake_kubectl.read_text().splitlines())


def test_the_hpa_takes_over_the_live_replica_count_without_a_scale_down(
    rendered, fake_kubectl, monkeypatch, tmp_path
):
    """The serving objects carry no replica count where the HPA owns it. A count an earlier render applied
    as `dgpipe` would be deleted by the apply that drops it (the fleet scaled to 1), so the live count is
    applied first under a manager of its own; a workload that does not exist yet has nothing to keep."""
    from pipeline.deploy import rollout as dp

    monkeypatch.setenv("DGPIPE_KUBECTL", str(fake_kubectl.parent / "kubectl"))
    monkeypatch.setenv("FAKE_REPLICAS", "5")
    sent = tmp_path / "stdin"
    monkeypatch.setenv("FAKE_STDIN", str(sent))
    plan = dp.make_plan(rendered)
    kinds = [s.kind for s in plan.steps]
    assert kinds.index(dp.StepKind.HANDOVER) == kinds.index(dp.StepKind.SERVING) - 1
    dp.execute(plan, log=lambda s: None)
    calls = fake_kubectl.read_text().splitlines()
    (handover,) = [c for c in calls if f"--field-manager={dp.HANDOVER_MANAGER}" in c]
    assert calls.index(handover) < next(i for i, c in enumerate(calls) if "dgpipe.yaml" in c)
    assert json.loads(sent.read_text()) == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "dgpipe-triton", "namespace": "serving"},
        "spec": {"replicas": 5},
    }
    fake_kubectl.write_text("")
    monkeypatch.setenv("FAKE_FAIL", "-o jsonpath={.spec.template}")  # the workload does not exist
    dp.execute(dp.make_plan(rendered), log=lambda s: None)
    assert not any(dp.HANDOVER_MANAGER in c for c in fake_kubectl.read_text().splitlines())


def test_an_upload_stopped_short_installs_nothing(build_dir, tmp_path, monkeypatch):
    """tar takes a stream cut at a file boundary for a whole archive: a file that cannot be read (or a
    kubectl killed at the timeout) must not swap half a build in. The stream's last member is the marker
    the loader's script requires; the old tree stays as it was."""
    import tarfile

    from pipeline.deploy import rollout as dp

    root = tmp_path / "pvc" / "build"
    (root / "onnx").mkdir(parents=True)
    (root / "onnx" / "model.onnx").write_bytes(b"the build that serves")
    script = dp.SWAP_SCRIPT.format(root=root, engines="model_repository/dgpipe/1/engines")
    real_add = tarfile.TarFile.add

    def add(self, name, arcname=None, *args, **kw):
        if arcname == "model_repository":
            raise PermissionError(13, "Permission denied", str(name))
        return real_add(self, name, arcname, *args, **kw)

    monkeypatch.setattr(tarfile.TarFile, "add", add)
    proc = dp._run(dp.Step("upload", ["sh", "-c", script], sends_upload=True), build_dir)
    assert proc.returncode == 1 and b"model_repository: Permission denied" in proc.stderr
    # nothing swapped in (the stand-in shell is killed with its kubectl, so it may leave its unpacking
    # dir, which the next upload clears; in the pod the script lives on and refuses the cut stream)
    assert (root / "onnx" / "model.onnx").read_bytes() == b"the build that serves"
    assert not (root / "model_repository").exists() and not (root.parent / "build.old").exists()
    monkeypatch.undo()
    # a whole stream without the marker (what a cut one looks like to tar) is refused by the script itself
    bare = subprocess.run(["tar", "-cf", "-", "-C", str(build_dir), "onnx"], capture_output=True, check=True)
    swap = subprocess.run(["sh", "-c", script], input=bare.stdout, capture_output=True)
    assert swap.returncode == 1 and b"upload incomplete" in swap.stderr
    assert (root / "onnx" / "model.onnx").read_bytes() == b"the build that serves"


def test_an_upload_restarts_pods_whose_template_the_apply_left_unchanged(
    rendered, build_dir, fake_kubectl, monkeypatch
):
    """Pods keep the model they loaded: an upload under an unchanged template restarts them; a changed
    template rolls them anyway, so no restart is added."""
    from pipeline.deploy import rollout as dp

    monkeypatch.setenv("DGPIPE_KUBECTL", str(fake_kubectl.parent / "kubectl"))
    dp.execute(dp.make_plan(rendered, upload=build_dir), log=lambda s: None)
    assert not any("rollout restart" in c for c in fake_kubectl.read_text().splitlines())
    fake_kubectl.write_text("")
    monkeypatch.setenv("FAKE_SAME", "1")
    dp.execute(dp.make_plan(rendered, upload=build_dir), log=lambda s: None)
    calls = fake_kubectl.read_text().splitlines()
    (restart,) = [i for i, c in enumerate(calls) if c.endswith("rollout restart deployment/dgpipe-triton")]
    assert restart > next(i for i, c in enumerate(calls) if "dgpipe.yaml" in c)
    assert restart < next(i for i, c in enumerate(calls) if "rollout status" in c)


@pytest.mark.parametrize("case", ["upload", "unchanged template"])
def test_deploy_rolls_back_only_what_restores_the_previous_model(
    case, rendered, build_dir, fake_kubectl, monkeypatch
):
    """`rollout undo` would not restore the model an upload replaced on the PVC, and after an apply that made
    no new revision it would go back to an older, unrelated one: both are reported, not undone."""
    from pipeline.deploy import rollout as dp
    from pipeline.errors import DgpipeError

    monkeypatch.setenv("DGPIPE_KUBECTL", str(fake_kubectl.parent / "kubectl"))
    monkeypatch.setenv("FAKE_FAIL", "wait --for=condition=complete")
    if case == "unchanged template":
        monkeypatch.setenv("FAKE_SAME", "1")
    plan = dp.make_plan(rendered, upload=build_dir if case == "upload" else None)
    with pytest.raises(DgpipeError, match="wait for the smoke Job failed") as e:
        dp.execute(plan, log=lambda s: None)
    want = "the PVC holds the uploaded build" if case == "upload" else "the apply changed no pod template"
    assert f"not rolled back: {want}" in e.value.hint
    assert not any("rollout undo" in c for c in fake_kubectl.read_text().splitlines())


def test_the_upload_streams_the_build_dir_and_stops_at_its_timeout(build_dir, tmp_path):
    """The tar reaches kubectl's stdin as it is written (never built in memory); a kubectl that stops
    reading fails the step with its own message; one that hangs is killed at the step's timeout."""
    import tarfile

    from pipeline.deploy import rollout as dp

    got = tmp_path / "received.tar"
    step = dp.Step("upload", ["sh", "-c", f"cat > {got}"], dp.StepKind.UPLOAD, sends_upload=True)
    assert dp._run(step, build_dir).returncode == 0
    with tarfile.open(got) as tar:
        names = tar.getnames()
        assert "build_manifest.json" in names and "onnx/model.onnx" in names
        manifest = tar.extractfile("build_manifest.json").read()
    assert manifest == (build_dir / "build_manifest.json").read_bytes()
    quits = dp.Step("upload", ["sh", "-c", "echo 'error: pod not found' >&2; exit 1"], sends_upload=True)
    proc = dp._run(quits, build_dir)
    assert proc.returncode == 1 and b"pod not found" in proc.stderr
    hangs = dp.Step("upload", ["sleep", "30"], sends_upload=True, timeout_s=1)
    start = time.monotonic()
    proc = dp._run(hangs, build_dir)
    assert proc.returncode == 124 and b"timed out after 1 s" in proc.stderr and time.monotonic() - start < 10


def test_rollout_budget_counts_each_replica_the_fleet_may_hold(rendered, tmp_path):
    """Kubernetes restarts the progress deadline for each pod that becomes available, and pods are
    replaced one at a time: a fixed budget would cut off (and roll back) a healthy rollout of a large fleet."""
    from pipeline.deploy import render as mf
    from pipeline.deploy import rollout as dp

    serving = dp._objects(rendered / "dgpipe.yaml")
    deadline = one(serving, "Deployment")["spec"]["progressDeadlineSeconds"]
    hpa_max = one(serving, "HorizontalPodAutoscaler")["spec"]["maxReplicas"]
    assert dp.rollout_budget_s(serving) == deadline * hpa_max + dp.ROLLOUT_SLACK_S
    (wait,) = [s for s in dp.make_plan(rendered).steps if s.kind is dp.StepKind.ROLLOUT_WAIT]
    assert f"--timeout={deadline * hpa_max + dp.ROLLOUT_SLACK_S}s" in wait.argv
    values = mf.resolve("gb200", IMAGE, lws_size=2, replicas=3, monitoring=False)
    mf.write(tmp_path / "lws", values, mf.render(values))
    assert (
        dp.rollout_budget_s(dp._objects(tmp_path / "lws" / "dgpipe.yaml"))
        == deadline * 3 + dp.ROLLOUT_SLACK_S
    )


def test_lws_workload_waits_on_its_condition(tmp_path):
    from pipeline.deploy import render as mf
    from pipeline.deploy import rollout as dp

    if KUBECTL is None:
        pytest.skip("kubectl (with built-in kustomize) not installed")
    values = mf.resolve("gb200", IMAGE, lws_size=2)
    assert values.workload_kind is mf.WorkloadKind.LEADER_WORKER_SET
    mf.write(tmp_path / "k8s", values, mf.render(values))
    plan = dp.make_plan(tmp_path / "k8s")
    assert plan.workload_kind is mf.WorkloadKind.LEADER_WORKER_SET
    assert plan.workload == "leaderworkerset/dgpipe-triton"
    (wait,) = (s for s in plan.steps if s.kind is dp.StepKind.ROLLOUT_WAIT)
    assert "--for=condition=Available" in wait.argv and "rollout" not in wait.argv


def test_deploy_does_not_roll_back_what_never_existed(rendered, fake_kubectl, monkeypatch):
    from pipeline.deploy import rollout as dp
    from pipeline.errors import DgpipeError

    monkeypatch.setenv("DGPIPE_KUBECTL", str(fake_kubectl.parent / "kubectl"))
    monkeypatch.setenv("FAKE_FAIL", "deployment/dgpipe-triton")  # the probe and the rollout both fail
    with pytest.raises(DgpipeError, match=r"wait for the rollout .* failed") as e:
        dp.execute(dp.make_plan(rendered), log=lambda s: None)
    assert "nothing to roll back to" in str(e.value)
    assert not any("rollout undo" in c for c in fake_kubectl.read_text().splitlines())


def test_k8s_commands_stay_light():
    """manifests/deploy run on a laptop or CI runner: no torch, no tritonclient on import."""
    code = (
        "import sys, pipeline.deploy.render, pipeline.deploy.rollout, pipeline.deploy.targets; "
        "print([m for m in ('torch', 'tritonclient', 'transformers') if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "")},
    )
    assert out.stdout.strip() == "[]"


def test_deploy_removes_the_loader_pod_when_the_upload_fails(rendered, build_dir, fake_kubectl, monkeypatch):
    from pipeline.deploy import rollout as dp
    from pipeline.errors import DgpipeError

    monkeypatch.setenv("DGPIPE_KUBECTL", str(fake_kubectl.parent / "kubectl"))
    monkeypatch.setenv("FAKE_FAIL", "exec -i")
    with pytest.raises(DgpipeError, match="stream the build dir into /models/build on the PVC failed"):
        dp.execute(dp.make_plan(rendered, upload=build_dir), log=lambda s: None)
    calls = fake_kubectl.read_text().splitlines()
    assert calls[-1].endswith("delete pod dgpipe-pvc-loader --ignore-not-found --wait=false")
    assert not any("dgpipe.yaml" in c for c in calls)  # nothing served from a half-filled PVC


def test_deploy_stops_before_applying_when_a_crd_is_missing(rendered, fake_kubectl, monkeypatch):
    from pipeline.deploy import rollout as dp
    from pipeline.errors import DgpipeError

    monkeypatch.setenv("DGPIPE_KUBECTL", str(fake_kubectl.parent / "kubectl"))
    monkeypatch.setenv("FAKE_NO_CRDS", "1")
    with pytest.raises(
        DgpipeError, match=r"serves PodMonitor .* failed: podmonitors\.monitoring\.coreos\.com not found"
    ) as e:
        dp.execute(dp.make_plan(rendered), log=lambda s: None)
    assert "--no-monitoring" in str(e.value)
    assert not any(" apply " in f" {c} " for c in fake_kubectl.read_text().splitlines())


def test_a_cluster_kubectl_cannot_reach_is_not_told_to_install_crds(rendered, fake_kubectl, monkeypatch):
    """The CRD check is the plan's first contact with the cluster: kubectl failing there (an unknown
    --context, no credentials) was answered with "install prometheus-operator"."""
    from pipeline.deploy import rollout as dp
    from pipeline.errors import DgpipeError

    monkeypatch.setenv("DGPIPE_KUBECTL", str(fake_kubectl.parent / "kubectl"))
    monkeypatch.setenv("FAKE_FAIL", "api-resources")
    with pytest.raises(DgpipeError, match=r"serves PodMonitor .* failed") as e:
        dp.execute(dp.make_plan(rendered), log=lambda s: None)
    assert "check the context and credentials" in str(e.value) and "cluster-info" in str(e.value)
    assert "prometheus-operator" not in str(e.value)


def test_deploy_sees_a_failed_smoke_job_without_waiting_out_the_timeout(rendered, fake_kubectl, monkeypatch):
    from pipeline.deploy import rollout as dp
    from pipeline.errors import DgpipeError

    monkeypatch.setenv("DGPIPE_KUBECTL", str(fake_kubectl.parent / "kubectl"))
    monkeypatch.setenv("FAKE_JOB_FAILED", "1")
    with pytest.raises(DgpipeError, match="wait for the smoke Job failed: the Job reached condition Failed"):
        dp.execute(dp.make_plan(rendered), log=lambda s: None)
    calls = fake_kubectl.read_text().splitlines()
    # both conditions were awaited at once, and the success wait (the stand-in's sleeps 30 s, then logs)
    # was stopped when the failure condition came, not waited out
    assert any("wait --for=condition=complete job/dgpipe-smoke" in c for c in calls)
    assert any("wait --for=condition=failed job/dgpipe-smoke" in c for c in calls)
    assert "complete-wait ran out" not in calls
    assert any(c.endswith("rollout undo deployment/dgpipe-triton") for c in calls)
    (sleep,) = [int(c.split()[-1]) for c in calls if c.startswith("complete-wait sleep ")]
    # the losing wait was stopped with what it started (its sleep), not left running
    deadline = time.monotonic() + 2
    while running(sleep) and time.monotonic() < deadline:  # a SIGKILLed process can show R for a moment
        time.sleep(0.05)
    assert not running(sleep)


def running(pid: int) -> bool:
    """Whether `pid` still runs: a killed process may stay a zombie until init reaps it, which some
    containers' init never does (/proc/<pid>/stat's state field)."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:  # gone
        return False
    return state not in ("Z", "X")


def test_engine_limits_follow_the_limits_the_engine_stage_recorded(build_dir):
    """The node builds its plan for the limits the engine stage recorded as data (not re-parsed from its
    command line): per target, else the stage's; the defaults without a record."""
    from pipeline.builddir import load_manifest
    from pipeline.deploy import render as mf

    man = load_manifest(build_dir)
    recorded = Limits(max_batch=4, max_prompt=1024, max_context=4096).engine_values()
    man.record(
        "engine",
        {"engines": "engines"},
        engines={"sm100": {"status": "deferred", "command": ["dgpipe"], "limits": recorded}},
    )
    save_manifest(build_dir, man)
    conf = mf.resolve("dgx-b200", IMAGE, build_dir=build_dir).config
    assert (conf["DGPIPE_MAX_BATCH"], conf["DGPIPE_MAX_PROMPT"], conf["DGPIPE_MAX_CONTEXT"]) == (
        "4",
        "1024",
        "4096",
    )
    assert conf["DGPIPE_ENGINE_OUTPUT"] == "/models/build/model_repository/dgpipe/1"
    no_record = mf.resolve("rtx-pro", IMAGE, build_dir=build_dir).config["DGPIPE_MAX_BATCH"]
    assert no_record == str(Limits().max_batch)  # no sm120 record, no stage limits: the default
    man.stages["engine"].details["limits"] = Limits(max_batch=2).engine_values()  # the stage's own
    save_manifest(build_dir, man)
    assert mf.resolve("rtx-pro", IMAGE, build_dir=build_dir).config["DGPIPE_MAX_BATCH"] == "2"
    assert mf.resolve("dgx-b200", IMAGE, build_dir=build_dir).config["DGPIPE_MAX_BATCH"] == "4"


def test_a_bad_limits_record_is_a_clear_error(build_dir):
    from pipeline.builddir import load_manifest
    from pipeline.deploy import render as mf

    man = load_manifest(build_dir)
    man.record("engine", {"engines": "engines"}, engines={"sm100": {"limits": {"max_batch": "lots"}}})
    save_manifest(build_dir, man)
    from pipeline.errors import DgpipeError

    with pytest.raises(DgpipeError, match="engine limits for sm100: --max-batch"):
        mf.resolve("dgx-b200", IMAGE, build_dir=build_dir)


def test_upload_swap_script_replaces_the_build_dir_and_keeps_node_built_plans(tmp_path, build_dir):
    """The script the loader pod runs, run here with sh and the same tar stream `dgpipe deploy` sends."""
    from pipeline.deploy import rollout as dp

    root = tmp_path / "pvc" / "build"
    eng = "model_repository/dgpipe/1/engines"
    (root / eng / "sm100").mkdir(parents=True)
    (root / eng / "sm100" / "model.plan").write_bytes(b"plan built on the node")
    (root / "onnx").mkdir()
    (root / "onnx" / "stale.onnx").write_bytes(b"old")
    script = dp.SWAP_SCRIPT.format(root=root, engines=eng)
    assert dp._run(dp.Step("upload", ["sh", "-c", script], sends_upload=True), build_dir).returncode == 0
    assert (root / "onnx" / "model.onnx").read_bytes() == b"onnx"
    assert not (root / "onnx" / "stale.onnx").exists()  # the old copy is gone, not merged
    assert (root / "model_repository" / "dgpipe" / "config.pbtxt").is_file()
    assert (root / eng / "sm100" / "model.plan").read_bytes() == b"plan built on the node"
    assert (root / "build_manifest.json").is_file()
    assert sorted(p.name for p in root.parent.iterdir()) == ["build"]  # no .upload/.old left behind


def test_manifests_never_replaces_a_directory_it_did_not_write(tmp_path):
    precious = tmp_path / "project"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    proc = dgpipe("manifests", "--target", "dgx-b200", "--image", IMAGE, "--output", str(precious))
    assert proc.returncode == 2 and "is not a `dgpipe manifests` output" in proc.stderr
    assert (precious / "notes.txt").read_text() == "keep me"


def test_monitoring_reads_only_metrics_the_triton_model_exports():
    """Every dgpipe_ series the HPA, the adapter rules and the PrometheusRule read is one the model
    registers (a histogram through its _bucket/_sum/_count series), so a renamed metric fails here."""
    from pipeline.serving.core import metrics

    source = Path(metrics.__file__).read_text()
    kinds = {name: kind for kind, name in re.findall(r'(counter|gauge|histogram)\(\s*"(dgpipe_\w+)"', source)}
    assert kinds["dgpipe_active_requests"] == kinds["dgpipe_queued_requests"] == "gauge"
    assert kinds["dgpipe_request_latency_seconds"] == "histogram"
    files = [K8S / "base" / "hpa.yaml", K8S / "base" / "prometheusrule.yaml"]
    files.append(K8S / "monitoring" / "prometheus-adapter-rules.yaml")
    code = [ln for f in files for ln in f.read_text().splitlines() if not ln.lstrip().startswith("#")]
    used = {n for ln in code for n in re.findall(r"\bdgpipe_\w+", ln)}
    assert used
    for name in used:
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in kinds or kinds.get(base) == "histogram", name


# ---- the smoke test that fits the model -----------------------------------------------------------------
def test_build_records_the_sudoku_smoke_test():
    from pipeline.demo import sudoku

    smoke = sudoku_smoke()
    assert smoke["prompt_format"] == "sudoku" and smoke["prompt"] == sudoku.EXAMPLE_PUZZLE
    assert smoke["max_tokens"] == 82 and "valid Sudoku solution" in smoke["check"]


def test_build_writes_the_smoke_test_into_the_manifest(tiny_checkpoint, tmp_path):
    """run_build records it before any stage runs (the stages themselves are tested in tests/e2e): stopped
    as the first stage would start, the manifest on disk already holds it."""
    from pipeline.build import BuildOptions, run_build
    from pipeline.build.events import BuildStarted
    from pipeline.builddir import load_manifest
    from pipeline.deploy.smoke import smoke_test_for
    from pipeline.model.validate import validate_checkpoint

    class Stop(Exception):
        pass

    def emit(event):
        if isinstance(event, BuildStarted):
            raise Stop

    with pytest.raises(Stop):
        run_build(BuildOptions(tiny_checkpoint, "bf16", tmp_path / "build"), emit)
    smoke = load_manifest(tmp_path / "build").smoke
    assert smoke and smoke == smoke_test_for(validate_checkpoint(tiny_checkpoint)).as_dict()


@needs_kubectl
def test_manifests_render_the_build_smoke_test(sudoku_build_dir):
    from pipeline.demo import sudoku

    proc = dgpipe("manifests", "--target", "dgx-b200", "--build-dir", str(sudoku_build_dir), "--image", IMAGE)
    assert proc.returncode == 0, proc.stderr
    assert (
        "smoke test: " + repr(sudoku.EXAMPLE_PUZZLE) in proc.stdout and "valid Sudoku solution" in proc.stdout
    )
    out = sudoku_build_dir / "k8s"
    job = next(yaml.safe_load_all((out / "smoke-job.yaml").read_text()))
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["python3", "-m", "pipeline.deploy.smoke"]
    assert c["args"] == [
        *("--url", "http://dgpipe-triton:9000/v1", "--model", "dgpipe"),
        *("--format", "sudoku", "--max-tokens", "82", "--"),
        sudoku.EXAMPLE_PUZZLE,
    ]
    assert "SMOKE_PROMPT" not in {e["name"] for e in c["env"]}
    assert json.loads((out / "render.json").read_text())["smoke"]["prompt"] == sudoku.EXAMPLE_PUZZLE
    # deploy --dry-run says what the smoke Job sends and what it expects
    proc = dgpipe("deploy", "--build-dir", str(sudoku_build_dir), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert (
        f"smoke test: {sudoku.EXAMPLE_PUZZLE!r} (sudoku format), expects a valid Sudoku solution"
        in proc.stdout
    )
    plan = json.loads(dgpipe("deploy", "--build-dir", str(sudoku_build_dir), "--dry-run", "--json").stdout)
    assert plan["smoke"] == sudoku_smoke()


HOSTILE = [
    "$(DGPIPE_BUILD_DIR) `id` $HOME; rm -rf / #",
    "'; kubectl delete ns prod; echo '",
    'x": y --- kind: Pod {a: [b]} *alias &anchor !!python/object:os.system "q" # c',
    "- --url http://evil:8000",
]


@needs_kubectl
@pytest.mark.parametrize("prompt", HOSTILE)
def test_smoke_prompt_is_one_literal_argv_item(tmp_path, prompt, monkeypatch):
    """YAML/shell metacharacters reach the smoke process verbatim as one argument: no shell runs, the
    YAML is written by yaml.safe_dump, and $ is doubled for the kubelet's $(VAR) expansion."""
    from pipeline.deploy import render as mf
    from pipeline.deploy.smoke import main

    values = mf.resolve("rtx-pro", IMAGE, smoke_prompt=prompt)
    mf.write(tmp_path / "k8s", values, mf.render(values))
    docs = list(yaml.safe_load_all((tmp_path / "k8s" / "smoke-job.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["Job"]
    (c,) = docs[0]["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["python3", "-m", "pipeline.deploy.smoke"] and c["args"][-2] == "--"
    assert c["args"][-1] == prompt.replace("$", "$$")
    # what the kubelet hands the process: $$ -> $ (no variable of that name is expanded)
    assert re.sub(r"\$\$", "$", c["args"][-1]) == prompt
    seen = {}

    def fake_run(url, fmt, p, n, model):
        seen.update(url=url, fmt=fmt, prompt=p, model=model)
        return {"ok": True}

    import pipeline.deploy.smoke as smoke

    monkeypatch.setattr(smoke, "run_smoke", fake_run)
    assert main([*c["args"][:-1], prompt]) == 0  # the argv the container starts with
    assert seen == {"url": "http://dgpipe-triton:9000/v1", "fmt": "text", "prompt": prompt, "model": "dgpipe"}


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("line one\nline two", "control"),
        ("tab\there", "control"),
        ("nul\x00", "control"),
        ("esc\x1b[31m", "control"),
        ("bidi \u202e override", "control"),
        ("   ", "must not be empty"),
        ("x" * 5000, "over 4096"),
    ],
)
def test_unsafe_smoke_prompts_are_refused(tmp_path, prompt, message):
    from pipeline.deploy import render as mf
    from pipeline.errors import DgpipeError

    with pytest.raises(DgpipeError, match=message):
        mf.resolve("rtx-pro", IMAGE, smoke_prompt=prompt)
    assert not (tmp_path / "k8s").exists()


@pytest.mark.parametrize(
    "fmt, prompt, answer, ok",
    [
        ("sudoku", "SOLVED", "SOLVED", True),
        ("sudoku", "SOLVED", "1" * 81, False),
        ("sudoku", "SOLVED", "", False),
        ("text", "Why?", "Rayleigh scattering.", True),
        ("text", "Why?", "  ", False),
    ],
)
def test_smoke_check_per_prompt_format(fmt, prompt, answer, ok):
    from pipeline.demo import sudoku
    from pipeline.deploy.smoke import check_answer

    solution = sudoku.solve(sudoku.EXAMPLE_PUZZLE)
    prompt = sudoku.EXAMPLE_PUZZLE if prompt == "SOLVED" else prompt
    answer = solution if answer == "SOLVED" else answer
    assert (check_answer(fmt, prompt, answer) is None) == ok


def test_a_build_dir_without_a_recorded_smoke_test_uses_its_checkpoint(build_dir):
    """A build dir filled stage by stage (no `dgpipe build`): the checkpoint it holds decides the test."""
    from pipeline.deploy import render as mf
    from pipeline.runtime.session import default_model_path

    assert mf.resolve("dgx-b200", IMAGE, build_dir=build_dir).smoke.prompt_format == "text"  # no checkpoint
    shutil.copytree(default_model_path(), build_dir / "checkpoint")
    smoke = mf.resolve("dgx-b200", IMAGE, build_dir=build_dir).smoke
    assert smoke.as_dict() == sudoku_smoke()


@needs_kubectl
def test_a_named_build_is_served_probed_and_smoke_tested_under_its_name(build_dir):
    """`dgpipe build --name tiny-chat`: the pods get the name from dgpipe-config, the node builds its plan
    into that model's version dir, the OpenAI API serves it, and the smoke Job asks for it."""
    from pipeline.builddir import load_manifest
    from pipeline.deploy import render as mf
    from pipeline.errors import DgpipeError

    man = load_manifest(build_dir)
    man.model_name = "tiny-chat"
    save_manifest(build_dir, man)
    values = mf.resolve("dgx-b200", IMAGE, build_dir=build_dir)
    docs = mf.render(values)
    serving = docs[mf.SERVING_FILE]
    env = config_values(serving)
    assert env[endpoints.MODEL_NAME_ENV] == "tiny-chat"
    assert env["DGPIPE_ENGINE_OUTPUT"] == f"/models/build/{LAYOUT['model_repository']}/tiny-chat/1"
    spec = one(serving, "Deployment")["spec"]["template"]["spec"]
    openai = container(spec, "openai")
    assert "--name=tiny-chat" in expand(openai["command"], env)
    for c in (container(spec, "triton"), openai):
        (ref,) = [e for e in c["env"] if e["name"] == endpoints.MODEL_NAME_ENV]
        assert ref["valueFrom"]["configMapKeyRef"]["key"] == endpoints.MODEL_NAME_ENV
    job = one(docs[mf.SMOKE_FILE], "Job")
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "tiny-chat"
    man.model_name = "../etc"  # a hand-edited manifest
    save_manifest(build_dir, man)
    with pytest.raises(
        DgpipeError, match=re.escape("the build's model_name '../etc' is not a valid model name")
    ):
        mf.resolve("dgx-b200", IMAGE, build_dir=build_dir)


@needs_kubectl
def test_the_smoke_job_and_the_loader_may_run_beside_the_serving_pods(side_objects):
    """Their image is the multi-GB serving image: on a GPU node that serves it is already pulled, on a CPU
    node its pull would eat into the Job's 600 s and the loader's deadline. They tolerate the GPU taint and
    prefer the serving pods' nodes."""
    for kind, spec in pod_specs(side_objects):
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        (term,) = spec["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        selector = term["podAffinityTerm"]["labelSelector"]["matchLabels"]
        assert selector == {"app.kubernetes.io/name": "dgpipe", "app.kubernetes.io/component": "triton"}, kind


@needs_kubectl
def test_the_side_objects_are_named_as_deploy_addresses_them(side_objects):
    """`dgpipe deploy` waits on, execs into and deletes the smoke Job and the loader pod by name: the YAML
    must spell the names the rollout uses, or a deploy waits for a pod that never exists."""
    from pipeline.deploy import render as mf

    names = {o["kind"]: o["metadata"]["name"] for o in side_objects}
    assert names == {"Job": mf.SMOKE_JOB, "Pod": mf.LOADER_POD}
    (pod,) = (o for o in side_objects if o["kind"] == "Pod")
    assert [c["name"] for c in pod["spec"]["containers"]] == [mf.LOADER_CONTAINER]
