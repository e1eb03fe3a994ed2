"""`dgpipe deploy`: apply rendered manifests with kubectl, wait, smoke-test, roll back on failure.

The plan is a list of kubectl commands built from the `dgpipe manifests` output alone, so `--dry-run`
prints exactly what would run and needs no cluster. The live path shells out to kubectl (server-side
apply with field manager `dgpipe`, forcing conflicts: dgpipe is the owner of record of what it renders),
because kubectl already owns kubeconfig, contexts, auth plugins and apply semantics; dgpipe adds the
order, the waiting, the smoke request and the rollback.

Filling the PVC (`--upload BUILD_DIR`): a short-lived loader pod mounts the model PVC and the build
directory is streamed into it as a tar over `kubectl exec` (what `kubectl cp` does, minus its
directory-nesting surprises), unpacked beside the old copy and swapped in with `mv`. Running pods keep
the model they loaded, so when the apply leaves their template as it was, they are restarted (rolled
like any template change) onto the new build.

Rollback (`kubectl rollout undo`) happens only where it restores what ran before: the apply made a new
revision and no upload replaced the model on the PVC, which every pod, rolled back or not, would load.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import posixpath
import shlex
import signal
import subprocess
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, auto
from pathlib import Path
from typing import Any

import yaml

from pipeline.builddir import ENGINES_DIR, LAYOUT, MANIFEST_NAME
from pipeline.deploy.kubectl import kubectl_binary, kubectl_name
from pipeline.deploy.render import (
    LOADER_CONTAINER,
    LOADER_FILE,
    LOADER_POD,
    OPTIONAL_SERVING_KINDS,
    PVC_BUILD_DIR,
    SERVING_FILE,
    SMOKE_FILE,
    SMOKE_JOB,
    STORAGE_FILE,
    WORKLOAD,
    WorkloadKind,
    edited_files,
    load_summary,
)
from pipeline.errors import DgpipeError
from pipeline.onnx.contract import MODEL_FILE as ONNX_FILE
from pipeline.resources import k8s_dir

FIELD_MANAGER = "dgpipe"
# Where the HPA owns the replica count, the serving objects carry none; a count dgpipe applied before (a
# render without monitoring, or from a dgpipe that wrote one) would be deleted by the apply that drops it,
# scaling the fleet to 1. The live count
# is applied first under this manager, so another owner keeps it (Kubernetes, "Server-Side Apply":
# "Transferring ownership"); the HPA takes it over on its next change.
HANDOVER_MANAGER = "dgpipe-replicas-handover"
UNSERVED_KIND = "the server doesn't have a resource type"  # kubectl, for a kind whose CRD is not installed
RESTARTED_AT = "dgpipe.dev/restartedAt"  # pod-template annotation that restarts a LeaderWorkerSet's pods
ROLLOUT_SLACK_S = 600
# Custom resources the rendered objects may use: kind -> (API group, plural, how to get it served)
CRDS = {
    "PodMonitor": (
        "monitoring.coreos.com",
        "podmonitors",
        "install prometheus-operator, or render with --no-monitoring",
    ),
    "PrometheusRule": (
        "monitoring.coreos.com",
        "prometheusrules",
        "install prometheus-operator, or render with --no-monitoring",
    ),
    "LeaderWorkerSet": (
        "leaderworkerset.x-k8s.io",
        "leaderworkersets",
        "install the LeaderWorkerSet controller, or render without --lws-size",
    ),
}
# What the pods read from the build directory; engines are never uploaded: they are built on the node.
UPLOAD_ITEMS = (MANIFEST_NAME, LAYOUT["onnx"], LAYOUT["plugins"], LAYOUT["model_repository"])
# Unpack next to the live copy, carry over the plans the nodes built (`dgpipe engine build` keeps a plan
# only while it is current for the new ONNX, precision and plugins, and rebuilds it otherwise), then swap.
# The stream ends with `UPLOAD_COMPLETE`: tar takes a stream cut at a file boundary (kubectl killed at the
# timeout, a file that could not be read) for a whole archive, so without the marker the swap would install
# half a build.
UPLOAD_COMPLETE = ".dgpipe-upload-complete"
SWAP_SCRIPT = (
    'set -eu; root={root}; eng={engines}; new="$root.upload"; old="$root.old"; '
    'rm -rf "$new" "$old"; mkdir -p "$new"; tar -xf - -C "$new"; '
    f'if [ ! -f "$new/{UPLOAD_COMPLETE}" ]; then rm -rf "$new"; echo "upload incomplete" >&2; exit 1; fi; '
    f'rm -f "$new/{UPLOAD_COMPLETE}"; '
    'if [ -d "$root/$eng" ] && [ ! -e "$new/$eng" ]; then '
    'mkdir -p "$(dirname "$new/$eng")"; mv "$root/$eng" "$new/$eng"; fi; '
    'if [ -d "$root" ]; then mv "$root" "$old"; fi; mv "$new" "$root"; rm -rf "$old"'
)


class StepKind(Enum):
    """What a step of the plan does: execution decides on these, never on the step's display text."""

    CHECK_CRD = auto()
    STORAGE = auto()
    CHECK_SECRETS = auto()
    LOADER_START = auto()
    LOADER_WAIT = auto()
    UPLOAD = auto()
    LOADER_DELETE = auto()
    HANDOVER = auto()  # the live replica count kept under a manager of its own before the HPA takes it
    SERVING = auto()
    PRUNE = auto()
    RESTART = auto()  # runs only after an upload that left the pod template unchanged
    ROLLOUT_WAIT = auto()
    SMOKE_CLEAN = auto()
    SMOKE_START = auto()
    SMOKE_WAIT = auto()
    SMOKE_LOGS = auto()


@dataclass(frozen=True)
class Kubectl:
    """kubectl as the plan's commands spell it: the binary and context, the namespace, dgpipe's apply."""

    kc: list[str]
    ns: list[str]

    @property
    def apply(self) -> list[str]:
        return [*self.kc, "apply", "--server-side", f"--field-manager={FIELD_MANAGER}", "--force-conflicts"]

    @classmethod
    def of(cls, binary: str, context: str | None, namespace: str) -> Kubectl:
        return cls([binary] + (["--context", context] if context else []), ["--namespace", namespace])

    def in_ns(self, *args: str) -> list[str]:
        return [*self.kc, *self.ns, *args]


@dataclass
class Step:
    """One kubectl invocation of the plan and what it is for."""

    what: str
    argv: list[str]
    kind: StepKind | None = None  # None: not a plan step (probes, diagnosis, rollback, cleanup)
    sends_upload: bool = False  # stdin is a tar stream of the build dir
    timeout_s: float = 600.0
    show_output: bool = False
    expect_output: str | None = None  # the step fails unless stdout contains this
    fails_if: list[str] | None = None  # runs alongside; if it succeeds first, the step has failed
    tolerate: str | None = None  # a failure whose stderr says this counts as success
    hint: str | None = None  # how to fix it, when the failure has one obvious cause

    def shell(self) -> str:
        cmd = shlex.join(self.argv)
        if self.fails_if:
            cmd += f"   (fails fast on: {shlex.join(self.fails_if)})"
        if self.sends_upload:  # the stream dgpipe writes: these items, then the completion marker
            return f"tar -C BUILD_DIR -cf - {' '.join(UPLOAD_ITEMS)} {UPLOAD_COMPLETE} | {cmd}"
        return cmd


@dataclass
class Plan:
    summary: dict[str, Any]
    steps: list[Step] = field(default_factory=list)
    upload: Path | None = None
    context: str | None = None
    kubectl: str = "kubectl"

    @property
    def namespace(self) -> str:
        return self.summary["namespace"]

    @property
    def k(self) -> Kubectl:
        """The kubectl the plan's steps name, in the plan's context and namespace."""
        return Kubectl.of(self.kubectl, self.context, self.namespace)

    @property
    def workload_kind(self) -> WorkloadKind:
        return WorkloadKind(self.summary["workload"]["kind"])

    @property
    def workload(self) -> str:
        return f"{self.workload_kind.resource}/{self.summary['workload']['name']}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "context": self.context,
            "target": self.summary["target"],
            "image": self.summary["image"],
            "workload": self.workload,
            "objects": self.summary["files"],
            "smoke": self.summary.get("smoke"),  # None for manifests rendered before it was recorded
            "upload": str(self.upload) if self.upload else None,
            "steps": [{"what": s.what, "command": s.shell()} for s in self.steps],
        }


def read_summary(manifests_dir: Path, allow_edited: bool = False) -> dict[str, Any]:
    """render.json, after checking every rendered file against the sha256 recorded at render time."""
    info = load_summary(manifests_dir)  # bounded, parsed, typed; namespace and image rules as manifests
    for name in (STORAGE_FILE, SERVING_FILE, SMOKE_FILE):
        if not (manifests_dir / name).is_file():
            raise DgpipeError(f"{manifests_dir / name} is missing", "render the manifests again")
    edited = edited_files(manifests_dir, info)
    if edited and not allow_edited:
        raise DgpipeError(
            f"{manifests_dir}: {', '.join(edited)} changed after `dgpipe manifests` rendered it",
            "render again (dgpipe manifests ...) to deploy dgpipe's objects, or pass --allow-edited to apply "
            "the edited files as they are, after reviewing them",
        )
    info["edited"] = edited if allow_edited else []
    return info


def _check_upload(build_dir: Path) -> None:
    missing = [
        p
        for p in (MANIFEST_NAME, f"{LAYOUT['onnx']}/{ONNX_FILE}", LAYOUT["model_repository"])
        if not (build_dir / p).exists()
    ]
    if missing:
        raise DgpipeError(
            f"--upload {build_dir}: missing {', '.join(missing)}",
            "run the export and package stages into this build dir first (dgpipe build)",
        )


def make_plan(
    manifests_dir: Path,
    context: str | None = None,
    upload: Path | None = None,
    rollout_timeout_s: int | None = None,
    smoke_timeout_s: int = 600,
    allow_edited: bool = False,
) -> Plan:
    """The kubectl commands of a deploy, in order; nothing here touches a cluster: the cluster's checks,
    storage, the upload, the serving objects and what an earlier render left, the rollout, the smoke test."""
    info = read_summary(manifests_dir, allow_edited)
    if upload is not None:
        _check_upload(upload)
    # the plan names kubectl as the user would type it, so --dry-run works where kubectl is not installed
    plan = Plan(summary=info, upload=upload, context=context, kubectl=kubectl_name())
    k = plan.k
    serving = _objects(manifests_dir / SERVING_FILE)
    plan.steps += _crd_checks(k, info)
    plan.steps.append(
        Step("create namespace, service account and model PVC", [*k.apply, "-f", str(manifests_dir / STORAGE_FILE)],
             StepKind.STORAGE)
    )  # fmt: skip
    plan.steps += _secret_check(k, info, [*serving, *_objects(manifests_dir / SMOKE_FILE)])
    if upload is not None:
        plan.steps += _upload_steps(k, info, manifests_dir)
    plan.steps += _serving_steps(k, info, plan, manifests_dir)
    rollout = rollout_timeout_s or rollout_budget_s(serving)
    plan.steps.append(
        Step("wait for the rollout (engine build on the node + model load)", _wait_rollout(k, plan, rollout),
             StepKind.ROLLOUT_WAIT, timeout_s=rollout + 60)
    )  # fmt: skip
    plan.steps += _smoke_steps(k, manifests_dir, smoke_timeout_s)
    return plan


def _crd_checks(k: Kubectl, info: dict[str, Any]) -> list[Step]:
    """The custom resources the rendered objects use, each checked served before anything is applied."""
    served = {name.split("/")[0] for objs in info["files"].values() for name in objs}
    steps = []
    for kind in sorted(served & CRDS.keys()):
        group, plural, fix = CRDS[kind]
        steps.append(
            Step(f"check that the cluster serves {kind} ({group})",
                 [*k.kc, "api-resources", f"--api-group={group}", "-o", "name"], StepKind.CHECK_CRD, timeout_s=60,
                 expect_output=f"{plural}.{group}", hint=fix)
        )  # fmt: skip
    return steps


def _secret_check(k: Kubectl, info: dict[str, Any], objects: list[dict[str, Any]]) -> list[Step]:
    """The Secrets the pods read, checked present before the pods wait on them (CreateContainerConfigError)."""
    secrets = secret_refs(objects)
    if not secrets:
        return []
    create = "; ".join(
        f"{shlex.join([*k.kc, '-n', info['namespace'], 'create', 'secret', 'generic', name])} "
        f'--from-literal={key}="$(openssl rand -hex 32)"'
        for name, key in secrets.items()
    )
    hint = (f"create the missing ones, then deploy again: {create} (kubectl's Forbidden instead of NotFound: "
            "this deploy may not read Secrets in the namespace)")  # fmt: skip
    return [Step("check that the Secrets the pods read exist", k.in_ns("get", "secret", *secrets, "-o", "name"),
                 StepKind.CHECK_SECRETS, timeout_s=60, hint=hint)]  # fmt: skip


def _upload_steps(k: Kubectl, info: dict[str, Any], manifests_dir: Path) -> list[Step]:
    """The loader pod, the build dir streamed into it and swapped in (`SWAP_SCRIPT`), the pod removed."""
    conf = info["config"]
    engines_rel = posixpath.join(
        posixpath.relpath(conf["DGPIPE_ENGINE_OUTPUT"], conf["DGPIPE_BUILD_DIR"]), ENGINES_DIR
    )
    swap = SWAP_SCRIPT.format(root=PVC_BUILD_DIR, engines=engines_rel)
    return [
        Step("start the PVC loader pod", [*k.apply, "-f", str(manifests_dir / LOADER_FILE)], StepKind.LOADER_START),
        Step("wait for the loader pod", k.in_ns("wait", "--for=condition=Ready", f"pod/{LOADER_POD}", "--timeout=600s"),
             StepKind.LOADER_WAIT, timeout_s=660),
        Step(f"stream the build dir into {PVC_BUILD_DIR} on the PVC",
             k.in_ns("exec", "-i", LOADER_POD, "-c", LOADER_CONTAINER, "--", "sh", "-c", swap), StepKind.UPLOAD,
             sends_upload=True, timeout_s=7200),
        Step("delete the loader pod", k.in_ns("delete", "pod", LOADER_POD, "--ignore-not-found", "--wait=false"),
             StepKind.LOADER_DELETE),
    ]  # fmt: skip


def _serving_steps(k: Kubectl, info: dict[str, Any], plan: Plan, manifests_dir: Path) -> list[Step]:
    """The replica count handed over to the HPA, the serving objects, the objects an earlier render left,
    and the restart onto an uploaded build."""
    rendered = set(info["files"][SERVING_FILE])
    steps = []
    if f"HorizontalPodAutoscaler/{WORKLOAD}" in rendered:
        steps.append(
            Step(f"keep {plan.workload}'s live replica count while the HPA takes it over (if it exists)",
                 k.in_ns("apply", "--server-side", f"--field-manager={HANDOVER_MANAGER}", "-f", "-"),
                 StepKind.HANDOVER, timeout_s=120)
        )  # fmt: skip
    steps.append(
        Step(
            "apply the serving objects", [*k.apply, "-f", str(manifests_dir / SERVING_FILE)], StepKind.SERVING
        )
    )
    for kind in OPTIONAL_SERVING_KINDS:
        if f"{kind}/{WORKLOAD}" not in rendered:  # rendered by an earlier, other configuration, maybe
            steps.append(
                Step(f"remove {kind}/{WORKLOAD} if an earlier render made it",
                     k.in_ns("delete", f"{kind.lower()}/{WORKLOAD}", "--ignore-not-found"), StepKind.PRUNE,
                     timeout_s=180, tolerate=UNSERVED_KIND)
            )  # fmt: skip
    if plan.upload is not None:
        steps.append(
            Step("restart the pods onto the uploaded build (only where the apply left their template as it was)",
                 _restart(k, plan), StepKind.RESTART)
        )  # fmt: skip
    return steps


def _smoke_steps(k: Kubectl, manifests_dir: Path, timeout_s: int) -> list[Step]:
    """The smoke Job run afresh, awaited (failing fast on its Failed condition), and its answer shown."""
    job, limit = f"job/{SMOKE_JOB}", f"--timeout={timeout_s}s"
    return [
        Step("remove the previous smoke Job", k.in_ns("delete", "job", SMOKE_JOB, "--ignore-not-found", "--wait=true"),
             StepKind.SMOKE_CLEAN),
        Step("start the smoke Job (one real generate request)", [*k.apply, "-f", str(manifests_dir / SMOKE_FILE)],
             StepKind.SMOKE_START),
        Step("wait for the smoke Job", k.in_ns("wait", "--for=condition=complete", job, limit), StepKind.SMOKE_WAIT,
             timeout_s=timeout_s + 60, fails_if=k.in_ns("wait", "--for=condition=failed", job, limit)),
        Step("show the smoke answer", k.in_ns("logs", job, "--tail=50"), StepKind.SMOKE_LOGS, show_output=True),
    ]  # fmt: skip


def _objects(path: Path) -> list[dict[str, Any]]:
    """The objects of a rendered file (its digest was checked by `read_summary`, unless --allow-edited)."""
    try:
        return [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
    except yaml.YAMLError as e:
        raise DgpipeError(
            f"{path}: not valid YAML ({str(e).splitlines()[0]})", "render the manifests again"
        ) from e


def secret_refs(objects: list[dict[str, Any]]) -> dict[str, str]:
    """name -> key of every Secret the objects' containers read (`secretKeyRef`), in order of appearance."""
    found: dict[str, str] = {}

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            ref = x.get("secretKeyRef")
            if isinstance(ref, dict) and isinstance(ref.get("name"), str):
                found.setdefault(ref["name"], str(ref.get("key", "")))
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(objects)
    return found


def rollout_budget_s(serving: list[dict[str, Any]]) -> int:
    """How long a rollout may take: the Deployment's progress deadline (an engine build and a load, which
    Kubernetes counts afresh for each pod that becomes available) for every replica or group replaced one
    after another (maxSurge 0), plus slack. A Deployment counts as many replicas as the fleet may hold (the
    HPA's maxReplicas): `kubectl rollout status` fails sooner when one pod overruns its deadline. A
    LeaderWorkerSet's wait has no deadline of its own, so it counts the groups it starts with (the HPA's
    minReplicas, else its replicas)."""
    by_kind = {d.get("kind"): d.get("spec") or {} for d in serving}
    deployment = by_kind.get("Deployment") or _objects(k8s_dir() / "base" / "deployment.yaml")[0]["spec"]
    deadline = int(deployment.get("progressDeadlineSeconds", 600))  # 600: the API's default
    hpa = by_kind.get("HorizontalPodAutoscaler", {})
    if "Deployment" in by_kind:
        replicas = hpa.get("maxReplicas") or by_kind["Deployment"].get("replicas") or 1
    else:
        replicas = hpa.get("minReplicas") or by_kind.get("LeaderWorkerSet", {}).get("replicas") or 1
    return deadline * int(replicas) + ROLLOUT_SLACK_S


def _restart(k: Kubectl, plan: Plan) -> list[str]:
    """Roll the workload's pods with their template otherwise unchanged (they reload the model)."""
    if plan.workload_kind.has_rollout_history:
        return k.in_ns("rollout", "restart", plan.workload)
    import time

    stamp = {"metadata": {"annotations": {RESTARTED_AT: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}}
    patch = {"spec": {"leaderWorkerTemplate": {"leaderTemplate": stamp, "workerTemplate": stamp}}}
    return k.in_ns("patch", plan.workload, "--type=merge", "-p", json.dumps(patch))


def _wait_rollout(k: Kubectl, plan: Plan, timeout: int) -> list[str]:
    if plan.workload_kind.has_rollout_history:
        return k.in_ns("rollout", "status", plan.workload, f"--timeout={timeout}s")
    # kubectl rollout does not know LeaderWorkerSets; their Available condition means all groups ready
    return k.in_ns("wait", "--for=condition=Available", plan.workload, f"--timeout={timeout}s")


def _send_build_dir(step: Step, build_dir: Path) -> subprocess.CompletedProcess:
    """Run the step with the build dir as a tar stream on its stdin, written as it is read: the build dir
    (tens of GB for a 26B model) is never held in memory. The stream ends with the `UPLOAD_COMPLETE` marker,
    without which the loader installs nothing: past the step's timeout kubectl is killed, and a file that
    cannot be read stops the stream (and kubectl) short of it."""
    import tempfile
    import threading

    failed: bytes | None = None  # why this side stopped the stream short
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(step.argv, stdin=subprocess.PIPE, stdout=out, stderr=err)
        expired = threading.Event()
        timer = threading.Timer(step.timeout_s, lambda: (expired.set(), proc.kill()))
        timer.start()
        try:
            with tarfile.open(fileobj=proc.stdin, mode="w|") as tar:
                for item in UPLOAD_ITEMS:
                    if (build_dir / item).exists():
                        tar.add(build_dir / item, arcname=item)
                tar.addfile(tarfile.TarInfo(UPLOAD_COMPLETE), io.BytesIO(b""))  # last: the stream is whole
        except (BrokenPipeError, ConnectionResetError):  # kubectl stopped reading: its stderr says why
            pass
        except OSError as e:  # a file of the build dir could not be read
            proc.kill()
            failed = f"{e.filename or build_dir}: {e.strerror or e}".encode()
        except BaseException:
            proc.kill()
            raise
        finally:
            with contextlib.suppress(OSError):  # a broken pipe's last flush
                proc.stdin.close()  # type: ignore[union-attr]
            code = proc.wait()
            timer.cancel()
            timed_out = expired.is_set() and code == -signal.SIGKILL  # not a run that ended as it fired
        out.seek(0)
        err.seek(0)
        if failed is not None:
            return subprocess.CompletedProcess(step.argv, 1, out.read(), failed)
        stderr = f"timed out after {step.timeout_s:.0f} s".encode() if timed_out else err.read()
        return subprocess.CompletedProcess(step.argv, 124 if timed_out else code, out.read(), stderr)


def _race(step: Step) -> subprocess.CompletedProcess:
    """Wait for success and for failure at once (kubectl wait takes one condition): whichever comes first."""
    import time

    # own process groups, so the loser is stopped with everything it started
    ok = subprocess.Popen(
        step.argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    bad = subprocess.Popen(
        step.fails_if or [],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + step.timeout_s
    try:
        while time.monotonic() < deadline:
            if ok.poll() is not None:
                out, err = ok.communicate()
                return subprocess.CompletedProcess(step.argv, ok.returncode, out, err)
            if bad.poll() == 0:
                return subprocess.CompletedProcess(step.argv, 1, b"", b"the Job reached condition Failed")
            time.sleep(0.5)
        return subprocess.CompletedProcess(
            step.argv, 124, b"", f"timed out after {step.timeout_s:.0f} s".encode()
        )
    finally:
        for proc in (ok, bad):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _run(step: Step, upload: Path | None = None, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    if step.fails_if:
        return _race(step)
    if step.sends_upload and upload is not None:
        proc = _send_build_dir(step, upload)
    else:
        feed = {"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}
        try:
            proc = subprocess.run(step.argv, capture_output=True, timeout=step.timeout_s, **feed)
        except subprocess.TimeoutExpired as e:
            return subprocess.CompletedProcess(
                step.argv, 124, e.stdout or b"", f"timed out after {step.timeout_s:.0f} s".encode()
            )
    if proc.returncode != 0 and step.tolerate and step.tolerate in _text(proc.stderr):
        return subprocess.CompletedProcess(step.argv, 0, proc.stdout, proc.stderr)
    return proc


def _text(b: bytes | str | None) -> str:
    return (b.decode(errors="replace") if isinstance(b, bytes) else b or "").strip()


def _diagnose(k: Kubectl) -> list[str]:
    """What an operator looks at first: pod states, recent events, the smoke Job's log."""
    probes = [
        ["get", "pods", "-l", "app.kubernetes.io/name=dgpipe", "-o", "wide"],
        ["get", "events", "--sort-by=.lastTimestamp", "--field-selector", "type=Warning"],
        ["logs", f"job/{SMOKE_JOB}", "--tail=20"],
    ]
    out = []
    for args in probes:
        proc = _run(Step("diagnose", k.in_ns(*args), timeout_s=60))
        text = _text(proc.stdout) or _text(proc.stderr)
        if text:
            out.append(f"$ kubectl {' '.join(args)}\n" + "\n".join(text.splitlines()[-15:]))
    return out


def _pod_template(k: Kubectl, plan: Plan) -> str | None:
    """The workload's pod template(s) as the API server holds them, None where the workload does not exist:
    compared before and after the apply, it tells whether the apply made a new revision (a replica count
    or other spec change does not)."""
    path = "{.spec.template}" if plan.workload_kind.has_rollout_history else "{.spec.leaderWorkerTemplate}"
    probe = Step("probe", k.in_ns("get", plan.workload, "-o", f"jsonpath={path}"), timeout_s=60)
    proc = _run(probe)
    return _text(proc.stdout) if proc.returncode == 0 else None


def _live_replicas(k: Kubectl, plan: Plan) -> bytes | None:
    """The workload's live replica count as an object to apply (only the count), or None without one."""
    probe = Step("probe", k.in_ns("get", plan.workload, "-o", "jsonpath={.spec.replicas}"), timeout_s=60)
    proc = _run(probe)
    count = _text(proc.stdout)
    if proc.returncode != 0 or not count.isdigit():
        return None
    kind = plan.workload_kind
    obj = {
        "apiVersion": kind.api_version,
        "kind": kind.value,
        "metadata": {"name": plan.summary["workload"]["name"], "namespace": plan.namespace},
        "spec": {"replicas": int(count)},
    }
    return json.dumps(obj).encode()


def _roll_back(
    plan: Plan, done: set[StepKind | None], existed: bool, changed: bool, log: Callable
) -> str | None:
    """After a failure past the serving apply: `kubectl rollout undo` where it restores what ran before;
    otherwise the hint that says why not."""
    if not existed:
        log(f"<- {plan.workload} is new (no previous revision to roll back to); left for inspection")
        return "nothing to roll back to"
    if StepKind.UPLOAD in done:
        return (
            "not rolled back: the PVC holds the uploaded build, which rolled-back pods would load as well; "
            "fix the failure and deploy again, or --upload the build dir that served before"
        )
    if not changed:
        return "not rolled back: the apply changed no pod template, so the previous revision is what runs"
    if not plan.workload_kind.has_rollout_history:
        return f"not rolled back: kubectl rollout does not know {plan.workload_kind.value}s"
    undo = _run(Step("rollback", plan.k.in_ns("rollout", "undo", plan.workload), timeout_s=120))
    log(f"<- rollout undo {plan.workload}: {'ok' if undo.returncode == 0 else _text(undo.stderr)}")
    return "rolled back to the previous revision" if undo.returncode == 0 else None


def execute(plan: Plan, log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Run the plan; on a failed rollout or smoke test, roll the workload back and say what failed."""
    kubectl_binary()  # a clear error when kubectl is missing, before anything runs
    k = plan.k
    before = _pod_template(k, plan)
    changed = False  # whether the serving apply (or the restart) made a new revision
    done: list[Step] = []
    for step in plan.steps:
        if step.kind is StepKind.RESTART and changed:
            log("-- the apply changed the pod template: the pods roll onto the uploaded build anyway")
            continue
        stdin = None
        if step.kind is StepKind.HANDOVER:
            stdin = _live_replicas(k, plan) if before is not None else None
            if stdin is None:
                continue  # a new workload, or one without a count: nothing to keep
        log(f"-> {step.what}")
        proc = _run(step, plan.upload, stdin)
        # the step's hint is for what it checks (a CRD the cluster lacks); kubectl failing to reach the
        # cluster at all (an unknown --context, no credentials) has its own fix
        unreachable = proc.returncode != 0 and step.kind is StepKind.CHECK_CRD
        if proc.returncode == 0 and step.expect_output and step.expect_output not in _text(proc.stdout):
            proc = subprocess.CompletedProcess(step.argv, 1, b"", f"{step.expect_output} not found".encode())
        if proc.returncode == 0:
            done.append(step)
            if step.kind is StepKind.SERVING:
                changed = _pod_template(k, plan) != before
            changed = changed or step.kind is StepKind.RESTART
            if step.show_output:
                log(_text(proc.stdout))
            continue
        reason = _text(proc.stderr).splitlines()[-1:] or [f"exit code {proc.returncode}"]
        failure = f"{step.what} failed: {reason[0]}"
        kinds_done = {d.kind for d in done}
        hint = step.hint
        if StepKind.SERVING in kinds_done:
            details = _diagnose(k)
            hint = _roll_back(plan, kinds_done, before is not None, changed, log) or hint
            for d in details:
                log(d)
        if StepKind.LOADER_START in kinds_done and StepKind.LOADER_DELETE not in kinds_done:
            _run(Step("cleanup", k.in_ns("delete", "pod", LOADER_POD, "--ignore-not-found", "--wait=false")))
        if unreachable:
            hint = f"kubectl could not ask the cluster: check the context and credentials ({shlex.join([*k.kc, 'cluster-info'])})"
        raise DgpipeError(failure, hint)
    return {"deployed": plan.workload, "namespace": plan.namespace, "steps": [d.what for d in done]}
