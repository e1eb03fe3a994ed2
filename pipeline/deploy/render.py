"""`dgpipe manifests`: render a kustomize overlay with the values of one build.

The overlay in `k8s/overlays/<target>` carries everything that depends on the node type (GPU affinity,
limits, /dev/shm). What depends on the build (precision, GPU target, paths on the PVC), on the user
(namespace, image, replicas) and on the cluster (monitoring CRDs, LeaderWorkerSet) is layered on top by
a generated kustomization that uses kustomize's own features (namespace, images, replicas,
configMapGenerator merge, patches), never string templates. Bad input fails before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path, PurePosixPath
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

from pipeline.atomic import atomic_dir, check_replaceable
from pipeline.builddir import (
    LAYOUT,
    MANIFEST_NAME,
    BuildManifest,
    model_version_dir,
    record_stage,
)
from pipeline.deploy.kubectl import kubectl_binary
from pipeline.deploy.smoke import COMMAND as SMOKE_COMMAND
from pipeline.deploy.smoke import DEFAULT_SMOKE, SmokeTest
from pipeline.deploy.targets import DeployTarget, deploy_target
from pipeline.endpoints import MODEL_NAME, MODEL_NAME_ENV, check_model_name
from pipeline.errors import DgpipeError, validation_error
from pipeline.limits import Limits
from pipeline.onnx.contract import MODEL_FILE as ONNX_FILE
from pipeline.resources import k8s_dir

PVC_BUILD_DIR = "/models/build"  # where the build directory lives on the model PVC (k8s/base/pvc.yaml)
WORKLOAD = "dgpipe-triton"
NAMESPACE = "dgpipe"  # the default; `dgpipe manifests --namespace` renders into another
# The side objects' names, as k8s/smoke/job.yaml and k8s/loader/pod.yaml spell them (a test holds them equal):
# `dgpipe deploy` waits on, execs into and deletes them by these names
SMOKE_JOB = "dgpipe-smoke"
LOADER_POD, LOADER_CONTAINER = "dgpipe-pvc-loader", "loader"
RENDER_SUMMARY = "render.json"
MANIFESTS_OUTPUT = "a `dgpipe manifests` output"  # what an --output dir may hold for a render to replace it
# Output files, in the order `dgpipe deploy` applies them (smoke and loader are applied on their own).
STORAGE_FILE, SERVING_FILE, SMOKE_FILE, LOADER_FILE = (
    "storage.yaml",
    "dgpipe.yaml",
    "smoke-job.yaml",
    "pvc-loader.yaml",
)
STORAGE_KINDS = {"Namespace", "ServiceAccount", "PersistentVolumeClaim"}
# Serving objects (all named WORKLOAD) that one render has and another lacks (--lws-size, --no-monitoring):
# `dgpipe deploy` removes those an earlier render may have left in the cluster.
OPTIONAL_SERVING_KINDS = (
    "Deployment",
    "LeaderWorkerSet",
    "HorizontalPodAutoscaler",
    "PodMonitor",
    "PrometheusRule",
)
# The image reference grammar of the container registries' own parser, distribution/reference
# (https://github.com/distribution/reference/blob/main/regexp.go, `ReferenceRegexp`):
#   reference := name [ ":" tag ] [ "@" digest ];  name := [domain "/"] path-component ["/" path-component]*
# a domain component and a path component start and end with a letter or digit ("-rm/x:1" is refused).
_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|[-]+)"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[(?:[a-fA-F0-9:]+)\])"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_IMAGE_NAME = rf"(?:{_HOST}(?::[0-9]+)?/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_IMAGE_TAG = r"[\w][\w.-]{0,127}"
_IMAGE_DIGEST_ANY = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
IMAGE_REFERENCE = re.compile(
    rf"^(?P<name>{_IMAGE_NAME})(?::(?P<tag>{_IMAGE_TAG}))?(?:@(?P<digest>{_IMAGE_DIGEST_ANY}))?$"
)
IMAGE_NAME_MAX = 255  # distribution/reference's NameTotalLengthMax
_IMAGE_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")  # what registries serve: a pin dgpipe accepts
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# namespaces dgpipe never renders into: the cluster's own (kube-*), and `default`, where the Namespace
# object carrying the restricted Pod Security labels cannot be ours and the NetworkPolicy would select
# unrelated workloads' neighbours. A dedicated namespace is the supported layout.
RESERVED_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
DIGESTS = "digests"  # render.json: sha256 of every file written, checked by `dgpipe deploy`
RENDER_SUMMARY_MAX_BYTES = 1 << 20  # a render.json is a few kilobytes; past this it is not one


class WorkloadKind(str, Enum):
    """The object that runs the Triton pods: a Deployment, or a LeaderWorkerSet for multi-node groups."""

    DEPLOYMENT = "Deployment"
    LEADER_WORKER_SET = "LeaderWorkerSet"

    @property
    def resource(self) -> str:
        """kubectl's resource name (`deployment/NAME`)."""
        return self.value.lower()

    @property
    def api_version(self) -> str:
        """Its API group and version, as the overlays and the LWS component write it."""
        return "apps/v1" if self is WorkloadKind.DEPLOYMENT else "leaderworkerset.x-k8s.io/v1"

    @property
    def has_rollout_history(self) -> bool:
        """`kubectl rollout status/undo` know it (they do not know LeaderWorkerSets)."""
        return self is WorkloadKind.DEPLOYMENT


@dataclass(frozen=True)
class Image:
    name: str
    tag: str | None
    digest: str | None

    def __str__(self) -> str:
        return self.name + (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")


def parse_image(ref: str | None, where: str = "--image") -> Image:
    """The serving image, a valid reference (`IMAGE_REFERENCE`) and pinned: a tag or digest is required so
    every node runs the same TensorRT. `where` names the input in errors (the option, or render.json)."""
    hint = (
        "build and push the serving image first: docker build -t REGISTRY/dgpipe-triton:TAG . && "
        "docker push REGISTRY/dgpipe-triton:TAG, then pass --image REGISTRY/dgpipe-triton:TAG"
    )
    if not ref:
        raise DgpipeError(f"{where} is required: the cluster pulls the serving image from a registry", hint)
    m = IMAGE_REFERENCE.match(ref)
    if m is None or len(m["name"]) > IMAGE_NAME_MAX:
        raise DgpipeError(
            f"{where} {ref!r} is not a valid image reference ([REGISTRY[:PORT]/]NAME[:TAG][@DIGEST], each "
            "part starting with a letter or digit)",
            hint,
        )
    name, tag, digest = m["name"], m["tag"], m["digest"]
    if digest and not _IMAGE_DIGEST.match(digest):
        raise DgpipeError(
            f"{where} {ref!r}: the digest is not sha256:<64 lowercase hex digits>",
            "pin the digest the registry reports for the pushed image (docker inspect --format "
            "'{{index .RepoDigests 0}}' IMAGE)",
        )
    if not tag and not digest:
        raise DgpipeError(
            f"{where} {ref!r} has no tag or digest",
            "pin it (REGISTRY/dgpipe-triton:TAG or @sha256:...): engines on the PVC are tied to the "
            "image's TensorRT, so a moving :latest would silently invalidate them",
        )
    if tag == "latest" and not digest:
        raise DgpipeError(
            f"{where} {ref!r}: ':latest' is not a pinned version",
            "use a versioned tag or a digest; engines are tied to the image's TensorRT",
        )
    return Image(name, tag or None, digest or None)


def check_namespace(namespace: str, where: str = "--namespace") -> str:
    """A namespace dgpipe may render into and deploy to: a DNS-1123 label, none of the cluster's own or
    shared ones (`RESERVED_NAMESPACES`, kube-*). `where` names the input in errors."""
    if not _NAME.match(namespace):
        raise DgpipeError(f"{where} {namespace!r} is not a valid namespace name", "use a DNS-1123 label")
    if namespace in RESERVED_NAMESPACES or namespace.startswith("kube-"):
        raise DgpipeError(
            f"{where} {namespace}: a system or shared namespace",
            "deploy into a namespace of its own (default: dgpipe); dgpipe labels it for restricted pods",
        )
    return namespace


@dataclass
class RenderValues:
    """Everything the generated kustomization sets, resolved and checked."""

    target: DeployTarget
    precision: str
    image: Image
    namespace: str
    replicas: int
    smoke: SmokeTest
    monitoring: bool = True
    lws_size: int | None = None
    build_dir: Path | None = None
    config: dict[str, str] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.config[MODEL_NAME_ENV]

    @property
    def workload_kind(self) -> WorkloadKind:
        return WorkloadKind.LEADER_WORKER_SET if self.lws_size else WorkloadKind.DEPLOYMENT


def _pvc_path(manifest: BuildManifest | None, build_dir: Path | None, artifact: str) -> PurePosixPath:
    """Where an artifact of the build directory is inside the pod: the same relative path under /models/build."""
    rel = LAYOUT[artifact]
    if manifest is not None and build_dir is not None:
        rel = manifest.path_of(build_dir, artifact).relative_to(build_dir).as_posix()
    return PurePosixPath(PVC_BUILD_DIR) / rel


def _engine_limits(manifest: BuildManifest | None, gpu_target: str) -> Limits:
    """Engine caps: those the engine stage recorded as data for this target, so the plan built on the node
    matches what the build validated; the defaults without a build."""
    from pipeline.engine.stage import recorded_limits

    return recorded_limits(manifest, gpu_target) if manifest is not None else Limits()


def pod_config(
    manifest: BuildManifest | None, build_dir: Path | None, gpu_target: str, precision: str
) -> dict[str, str]:
    """The dgpipe-config values the pods read: the served model's name, paths on the PVC, engine limits, GPU
    target and precision.
    The k8s base carries these values for the defaults (a test holds it to this function)."""
    name = MODEL_NAME if manifest is None else check_model_name(manifest.model_name, "the build's model_name")
    version_dir = model_version_dir(_pvc_path(manifest, build_dir, "model_repository"), name)
    limits = _engine_limits(manifest, gpu_target)
    return {
        MODEL_NAME_ENV: name,  # the served name: the probes, the OpenAI API and the smoke Job use it
        "DGPIPE_BUILD_DIR": PVC_BUILD_DIR,
        "DGPIPE_MODEL_REPOSITORY": str(_pvc_path(manifest, build_dir, "model_repository")),
        "DGPIPE_ONNX": str(_pvc_path(manifest, build_dir, "onnx") / ONNX_FILE),
        "DGPIPE_PLUGINS": str(_pvc_path(manifest, build_dir, "plugins")),
        # the Triton model looks for engines/<target> in its version dir: the node builds the plan there
        "DGPIPE_ENGINE_OUTPUT": str(version_dir),
        **{f"DGPIPE_{k.upper()}": str(v) for k, v in limits.engine_values().items()},
        "DGPIPE_GPU_TARGET": gpu_target,
        "DGPIPE_PRECISION": precision,
    }


def _smoke_test(manifest: BuildManifest | None, build_dir: Path | None) -> SmokeTest:
    """The smoke test `dgpipe build` recorded (from the checkpoint's prompt format); for a build dir filled
    stage by stage, the one of the checkpoint it holds; the plain-text one without either."""
    if manifest is None or build_dir is None:
        return DEFAULT_SMOKE
    if manifest.smoke is not None:
        return SmokeTest.from_dict(manifest.smoke, f"{build_dir / MANIFEST_NAME}: smoke")
    ckpt = manifest.path_of(build_dir, "checkpoint")
    if not (ckpt / "config.json").is_file():
        return DEFAULT_SMOKE
    from pipeline.deploy.smoke import smoke_test_for
    from pipeline.model.checkpoint import open_checkpoint

    return smoke_test_for(open_checkpoint(ckpt))


def resolve(
    target_name: str,
    image: str | None,
    *,
    build_dir: Path | None = None,
    precision: str | None = None,
    replicas: int | None = None,
    namespace: str = NAMESPACE,
    smoke_prompt: str | None = None,
    monitoring: bool = True,
    lws_size: int | None = None,
) -> RenderValues:
    """Check every input against the deploy target, the build manifest and the precision rules."""
    from pipeline.builddir import load_manifest
    from pipeline.targets import check_precision_on_target

    cfg = deploy_target(target_name)
    manifest = load_manifest(build_dir) if build_dir is not None else None
    if manifest is not None:
        if precision is not None and precision != manifest.precision:
            raise DgpipeError(
                f"--precision {precision}: {build_dir / MANIFEST_NAME} was built for {manifest.precision}",
                f"drop --precision, or build again with --precision {precision} in a new build dir",
            )
        precision = manifest.precision
        if not manifest.targets:
            raise DgpipeError(
                f"{build_dir} records no GPU target: its engine stage has not run",
                f"finish the build: dgpipe build --build-dir {build_dir} --precision {manifest.precision} "
                f"--target {cfg.gpu_target}",
            )
        if cfg.gpu_target not in manifest.targets:
            raise DgpipeError(
                f"deploy target {cfg.name} runs {cfg.gpu_target} GPUs, but {build_dir} was built for "
                f"{', '.join(manifest.targets)}",
                f"build with --target {cfg.gpu_target}, or deploy to a target with {manifest.targets[0]} GPUs",
            )
    precision = precision or cfg.precision
    try:
        check_precision_on_target(precision, cfg.gpu_target)
    except DgpipeError as e:
        raise DgpipeError(f"deploy target {cfg.name}: {e.args[0]}", e.hint) from e
    img = parse_image(image)
    check_namespace(namespace)
    if replicas is not None and not 1 <= replicas <= cfg.max_replicas:
        raise DgpipeError(
            f"--replicas {replicas}: deploy target {cfg.name} allows 1 to {cfg.max_replicas}",
            f"pick at most max_replicas (configs/deploy/{cfg.name}.yaml)",
        )
    if lws_size is not None and not 2 <= lws_size <= cfg.max_group_size:
        raise DgpipeError(
            f"--lws-size {lws_size}: a multi-node group on {cfg.name} has 2 to {cfg.max_group_size} pods",
            f"pick a group size within max_group_size (configs/deploy/{cfg.name}.yaml)",
        )
    smoke = _smoke_test(manifest, build_dir)
    if smoke_prompt is not None:  # the user's prompt, judged by the build's check
        try:
            smoke = smoke.with_prompt(smoke_prompt)
        except DgpipeError as e:
            raise DgpipeError(f"--smoke-prompt: {e.args[0]}", e.hint) from e
    config = pod_config(manifest, build_dir, cfg.gpu_target, precision)
    return RenderValues(
        target=cfg,
        precision=precision,
        image=img,
        namespace=namespace,
        replicas=replicas or cfg.replicas,
        smoke=smoke,
        monitoring=monitoring,
        lws_size=lws_size,
        build_dir=build_dir,
        config=config,
    )


def _images(values: RenderValues) -> list[dict[str, str]]:
    entry = {"name": "dgpipe-triton", "newName": values.image.name}
    if values.image.tag:
        entry["newTag"] = values.image.tag
    if values.image.digest:
        entry["digest"] = values.image.digest
    return [entry]


def _delete(kind: str, api_version: str, name: str) -> dict[str, Any]:
    return {
        "patch": yaml.safe_dump(
            {"$patch": "delete", "apiVersion": api_version, "kind": kind, "metadata": {"name": name}}
        )
    }


def serving_kustomization(values: RenderValues) -> dict[str, Any]:
    """The kustomization layered on the overlay: every build-, user- and cluster-specific value.

    With the HPA rendered (monitoring on), the workload carries no `spec.replicas`: the HPA owns the
    count from its `minReplicas` (= `values.replicas`) up. A replica count in the applied manifest would
    make every later server-side apply conflict with the HPA's writes to it, or reset the fleet the HPA
    scaled, as the Kubernetes docs warn (Horizontal Pod Autoscaling, "Migrating Deployments and
    StatefulSets to horizontal autoscaling")."""
    hpa_min = values.replicas
    hpa_max = max(values.replicas, values.target.max_replicas)
    k: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": values.namespace,
        "resources": [f"../k8s/overlays/{values.target.name}"],
        "images": _images(values),
        "replicas": [{"name": WORKLOAD, "count": values.replicas}],
        "configMapGenerator": [
            {
                "name": "dgpipe-config",
                "behavior": "merge",
                "literals": [f"{k}={v}" for k, v in values.config.items()],
            }
        ],
        "labels": [
            {"pairs": {"dgpipe.dev/precision": values.precision}, "includeSelectors": False},
        ],
        "patches": [],
    }
    if values.monitoring:
        del k["replicas"]
        k["patches"].append(
            {
                "target": {"kind": "Deployment", "name": WORKLOAD},
                "patch": yaml.safe_dump([{"op": "remove", "path": "/spec/replicas"}]),
            }
        )
        k["patches"].append(
            {
                "target": {"kind": "HorizontalPodAutoscaler", "name": WORKLOAD},
                "patch": yaml.safe_dump(
                    [
                        {"op": "replace", "path": "/spec/minReplicas", "value": hpa_min},
                        {"op": "replace", "path": "/spec/maxReplicas", "value": hpa_max},
                    ]
                ),
            }
        )
    else:  # clusters without prometheus-operator / prometheus-adapter: no CRDs, no custom-metrics HPA
        k["patches"] += [
            _delete("PodMonitor", "monitoring.coreos.com/v1", WORKLOAD),
            _delete("PrometheusRule", "monitoring.coreos.com/v1", WORKLOAD),
            _delete("HorizontalPodAutoscaler", "autoscaling/v2", WORKLOAD),
        ]
    if values.lws_size:
        k["components"] = ["../k8s/components/leaderworkerset"]
        # the Deployment goes (its replicas patch with it); kustomize's replicas field does not know
        # LeaderWorkerSet, so the group count is patched, or removed where the HPA owns it
        k["patches"] = [p for p in k["patches"] if p.get("target", {}).get("kind") != "Deployment"]
        k["patches"].append(_delete("Deployment", "apps/v1", WORKLOAD))
        k.pop("replicas", None)
        count = (
            {"op": "remove", "path": "/spec/replicas"}
            if values.monitoring
            else {"op": "replace", "path": "/spec/replicas", "value": values.replicas}
        )
        size = {"op": "replace", "path": "/spec/leaderWorkerTemplate/size", "value": values.lws_size}
        k["patches"].append(
            {"target": {"kind": "LeaderWorkerSet", "name": WORKLOAD}, "patch": yaml.safe_dump([count, size])}
        )
    return k


def _side_kustomization(
    values: RenderValues, directory: str, patches: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": values.namespace,
        "resources": [f"../k8s/{directory}"],
        "images": _images(values),
        "patches": patches,
    }


def smoke_kustomization(values: RenderValues) -> dict[str, Any]:
    """The smoke Job with the build's test: the prompt is one argv item (no shell), $ doubled for the
    kubelet's $(VAR) expansion; the patch is YAML from yaml.safe_dump, never text with the prompt in it."""
    container = "/spec/template/spec/containers/0"
    patch = [
        {"op": "replace", "path": f"{container}/command", "value": SMOKE_COMMAND},
        {"op": "replace", "path": f"{container}/args", "value": values.smoke.args(model=values.model_name)},
    ]
    return _side_kustomization(
        values, "smoke", [{"target": {"kind": "Job", "name": SMOKE_JOB}, "patch": yaml.safe_dump(patch)}]
    )


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize DIR` as a list of objects; a kustomize error becomes one readable line."""
    proc = subprocess.run(
        [kubectl_binary(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        msg = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise DgpipeError(f"kubectl kustomize {directory.name} failed: {msg}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def namespace_object(namespace: str) -> dict[str, Any]:
    """The namespace, enforcing the restricted Pod Security Standard that every dgpipe pod meets."""
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": namespace,
            "labels": {
                "app.kubernetes.io/part-of": "dgpipe",
                "pod-security.kubernetes.io/enforce": "restricted",
                "pod-security.kubernetes.io/enforce-version": "latest",
            },
        },
    }


def render(values: RenderValues) -> dict[str, list[dict[str, Any]]]:
    """Render the overlay, the smoke Job and the PVC loader; returns objects per output file."""
    with tempfile.TemporaryDirectory(prefix="dgpipe-k8s-") as tmp:
        root = Path(tmp)
        shutil.copytree(k8s_dir(), root / "k8s")  # kustomize refuses resources outside its root
        parts = {
            "serving": serving_kustomization(values),
            "smoke": smoke_kustomization(values),
            "loader": _side_kustomization(values, "loader", []),
        }
        docs = {}
        for name, kust in parts.items():
            (root / name).mkdir()
            (root / name / "kustomization.yaml").write_text(yaml.safe_dump(kust, sort_keys=False))
            docs[name] = kustomize(root / name)
    storage = [namespace_object(values.namespace)]  # resolve() refused the shared namespaces
    storage += [d for d in docs["serving"] if d["kind"] in STORAGE_KINDS]
    return {
        STORAGE_FILE: storage,
        SERVING_FILE: [d for d in docs["serving"] if d["kind"] not in STORAGE_KINDS],
        SMOKE_FILE: docs["smoke"],
        LOADER_FILE: docs["loader"],
    }


def summary(values: RenderValues, files: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """What `dgpipe deploy` needs to know about the rendered output, and what `--json` prints."""
    return {
        "target": values.target.name,
        "gpu_target": values.target.gpu_target,
        "compute_major": values.target.compute_major,
        "precision": values.precision,
        "image": str(values.image),
        "namespace": values.namespace,
        "replicas": values.replicas,
        "workload": {"kind": values.workload_kind.value, "name": WORKLOAD},
        "lws_size": values.lws_size,
        "monitoring": values.monitoring,
        "config": values.config,
        "smoke": values.smoke.as_dict(),
        "build_dir": str(values.build_dir) if values.build_dir else None,
        "files": {
            name: [f"{d['kind']}/{d['metadata']['name']}" for d in docs] for name, docs in files.items()
        },
    }


class WorkloadRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: WorkloadKind
    name: str


class RenderSummary(BaseModel):
    """render.json as `dgpipe deploy` reads it back (`summary` writes it): every field deploy uses, typed.
    `load_summary` applies the namespace and image rules `dgpipe manifests` applied to its options on top,
    so an edited render.json cannot point a deploy at kube-system or at an invalid image reference."""

    model_config = ConfigDict(extra="allow")  # informational fields (gpu_target, precision...) pass through

    target: str
    image: str
    namespace: str
    workload: WorkloadRecord
    files: dict[str, list[str]]
    config: dict[str, str]
    smoke: dict[str, Any] | None = None  # absent from renders made before the smoke test was recorded
    digests: dict[str, str] | None = None  # absent: deploy refuses it as unverifiable (`edited_files`)


def load_summary(output: Path) -> dict[str, Any]:
    """The render.json of a `dgpipe manifests` output, bounded, parsed and checked against `RenderSummary`;
    a DgpipeError naming the file and its first problem otherwise."""
    f = output / RENDER_SUMMARY
    fix = "render again: dgpipe manifests --target TARGET --image IMG --output DIR"
    try:
        with open(f, "rb") as fh:
            data = fh.read(RENDER_SUMMARY_MAX_BYTES + 1)
    except FileNotFoundError as e:
        raise DgpipeError(f"{output}: no {RENDER_SUMMARY} (not a `dgpipe manifests` output)", fix) from e
    if len(data) > RENDER_SUMMARY_MAX_BYTES:
        raise DgpipeError(f"{f}: larger than {RENDER_SUMMARY_MAX_BYTES >> 20} MiB", fix)
    try:
        raw = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" ({e.msg} at line {e.lineno})" if isinstance(e, json.JSONDecodeError) else " (not UTF-8)"
        raise DgpipeError(f"{f}: not valid JSON{where}", fix) from e
    if not isinstance(raw, dict):
        raise DgpipeError(f"{f}: holds a JSON {type(raw).__name__}, not an object", fix)
    with validation_error(lambda where, msg: f"{f}: '{where}': {msg}", hint=fix):
        summary = RenderSummary.model_validate(raw)
    check_namespace(summary.namespace, where=f"{f}: namespace")  # the rules `dgpipe manifests` applied
    parse_image(summary.image, where=f"{f}: image")
    return summary.model_dump(mode="json")


def check_output(output: Path) -> None:
    """The output dir is replaced as a whole: refuse one that holds anything but an earlier render."""
    check_replaceable(output, MANIFESTS_OUTPUT, RENDER_SUMMARY)


def write(output: Path, values: RenderValues, files: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Write all files into a temp dir next to `output` and swap it in: never a half-rendered set."""
    check_output(output)
    info = summary(values, files)
    texts = {name: yaml.safe_dump_all(docs, sort_keys=False).encode() for name, docs in files.items()}
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in texts.items()}
    with atomic_dir(output, MANIFESTS_OUTPUT, RENDER_SUMMARY) as tmp:  # files and digests appear together
        for name, data in texts.items():
            (tmp / name).write_bytes(data)
        (tmp / RENDER_SUMMARY).write_text(json.dumps({**info, DIGESTS: digests}, indent=2) + "\n")
    return info


def edited_files(output: Path, info: dict[str, Any]) -> list[str]:
    """Rendered files whose bytes differ from the sha256 `write` recorded (all of them for a render
    without digests). Guards against unreviewed edits (a `privileged: true` added by hand), not against
    someone who also rewrites render.json."""
    digests = info.get(DIGESTS)
    if not isinstance(digests, dict) or not digests:
        return ["(no digests recorded)"]
    return [
        name
        for name, want in digests.items()
        if not (output / name).is_file() or hashlib.sha256((output / name).read_bytes()).hexdigest() != want
    ]


def record(build_dir: Path, output: Path, info: dict[str, Any]) -> None:
    """Note the stage in the build manifest (output relative to the build dir when inside it)."""
    record_stage(
        build_dir,
        "manifests",
        {"k8s": output.resolve()},
        details={
            "target": info["target"],
            "namespace": info["namespace"],
            "image": info["image"],
            "replicas": info["replicas"],
            "workload": info["workload"]["kind"],
        },
    )
