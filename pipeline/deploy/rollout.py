"""`dgpipe deploy`: apply rendered manifests with kubectl, wait, smoke-test, roll back on failure.

The plan is a list of kubectl commands built from the `dgpipe manifests` output alone, so `--dry-run`
prints exactly what would run and needs no cluster. The live path shells out to kubectl (server-side
apply with field manager `dgpipe`), because kubectl already owns kubeconfig, contexts, auth plugins
and apply semantics; dgpipe adds the order, the waiting, the smoke request and the rollback.

Filling the PVC (`--upload BUILD_DIR`): a short-lived loader pod mounts the model PVC and the build
directory is streamed into it as a tar over `kubectl exec` (what `kubectl cp` does, minus its
directory-nesting surprises), unpacked beside the old copy and swapped in with `mv`.
"""

from __future__ import annotations

import io
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

from pipeline.builddir import ENGINES_DIR, LAYOUT, MANIFEST_NAME
from pipeline.deploy.kubectl import kubectl_binary, kubectl_name
from pipeline.deploy.render import (
    LOADER_FILE,
    PVC_BUILD_DIR,
    SERVING_FILE,
    SMOKE_FILE,
    STORAGE_FILE,
    WorkloadKind,
    edited_files,
    load_summary,
)
from pipeline.errors import DgpipeError
from pipeline.onnx.contract import MODEL_FILE as ONNX_FILE

FIELD_MANAGER = "dgpipe"
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
SMOKE_JOB = "dgpipe-smoke"
LOADER_POD = "dgpipe-pvc-loader"
# What the pods read from the build directory; engines are never uploaded: they are built on the node.
UPLOAD_ITEMS = (MANIFEST_NAME, LAYOUT["onnx"], LAYOUT["plugins"], LAYOUT["model_repository"])
# Unpack next to the live copy, carry over the plans the nodes built (`dgpipe engine build` keeps a plan
# only while it is current for the new ONNX, precision and plugins, and rebuilds it otherwise), then swap.
SWAP_SCRIPT = (
    'set -eu; root={root}; eng={engines}; new="$root.upload"; old="$root.old"; '
    'rm -rf "$new" "$old"; mkdir -p "$new"; tar -xf - -C "$new"; '
    'if [ -d "$root/$eng" ] && [ ! -e "$new/$eng" ]; then '
    'mkdir -p "$(dirname "$new/$eng")"; mv "$root/$eng" "$new/$eng"; fi; '
    'if [ -d "$root" ]; then mv "$root" "$old"; fi; mv "$new" "$root"; rm -rf "$old"'
)


class StepKind(Enum):
    """What a step of the plan does: execution decides on these, never on the step's display text."""

    CHECK_CRD = auto()
    STORAGE = auto()
    LOADER_START = auto()
    LOADER_WAIT = auto()
    UPLOAD = auto()
    LOADER_DELETE = auto()
    SERVING = auto()
    ROLLOUT_WAIT = auto()
    SMOKE_CLEAN = auto()
    SMOKE_START = auto()
    SMOKE_WAIT = auto()
    SMOKE_LOGS = auto()


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
    hint: str | None = None  # how to fix it, when the failure has one obvious cause

    def shell(self) -> str:
        cmd = shlex.join(self.argv)
        if self.fails_if:
            cmd += f"   (fails fast on: {shlex.join(self.fails_if)})"
        return f"tar -C BUILD_DIR -cf - {' '.join(UPLOAD_ITEMS)} | {cmd}" if self.sends_upload else cmd


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
    """The kubectl commands of a deploy, in order; nothing here touches a cluster."""
    info = read_summary(manifests_dir, allow_edited)
    if upload is not None:
        _check_upload(upload)
    # the plan names kubectl as the user would type it, so --dry-run works where kubectl is not installed
    kc = [kubectl_name()] + (["--context", context] if context else [])
    ns = ["--namespace", info["namespace"]]
    apply = [*kc, "apply", "--server-side", f"--field-manager={FIELD_MANAGER}"]
    plan = Plan(summary=info, upload=upload, context=context, kubectl=kc[0])
    # deadline of the rollout: the Deployment's own progress deadline (engine build + load) plus slack
    rollout = rollout_timeout_s or 5400 + 600
    s = plan.steps
    served = {name.split("/")[0] for objs in info["files"].values() for name in objs}
    for kind in sorted(served & CRDS.keys()):
        group, plural, fix = CRDS[kind]
        s.append(
            Step(
                f"check that the cluster serves {kind} ({group})",
                [*kc, "api-resources", f"--api-group={group}", "-o", "name"],
                StepKind.CHECK_CRD,
                timeout_s=60,
                expect_output=f"{plural}.{group}",
                hint=fix,
            )
        )
    s.append(
        Step(
            "create namespace, service account and model PVC",
            [*apply, "-f", str(manifests_dir / STORAGE_FILE)],
            StepKind.STORAGE,
        )
    )
    if upload is not None:
        conf = info["config"]
        engines_rel = posixpath.join(
            posixpath.relpath(conf["DGPIPE_ENGINE_OUTPUT"], conf["DGPIPE_BUILD_DIR"]), ENGINES_DIR
        )
        s += [
            Step(
                "start the PVC loader pod",
                [*apply, "-f", str(manifests_dir / LOADER_FILE)],
                StepKind.LOADER_START,
            ),
            Step(
                "wait for the loader pod",
                [*kc, *ns, "wait", "--for=condition=Ready", f"pod/{LOADER_POD}", "--timeout=600s"],
                StepKind.LOADER_WAIT,
                timeout_s=660,
            ),
            Step(
                f"stream the build dir into {PVC_BUILD_DIR} on the PVC",
                [
                    *kc,
                    *ns,
                    "exec",
                    "-i",
                    LOADER_POD,
                    "-c",
                    "loader",
                    "--",
                    "sh",
                    "-c",
                    SWAP_SCRIPT.format(root=PVC_BUILD_DIR, engines=engines_rel),
                ],
                StepKind.UPLOAD,
                sends_upload=True,
                timeout_s=7200,
            ),
            Step(
                "delete the loader pod",
                [*kc, *ns, "delete", "pod", LOADER_POD, "--ignore-not-found", "--wait=false"],
                StepKind.LOADER_DELETE,
            ),
        ]
    s += [
        Step(
            "apply the serving objects", [*apply, "-f", str(manifests_dir / SERVING_FILE)], StepKind.SERVING
        ),
        Step(
            "wait for the rollout (engine build on the node + model load)",
            _wait_rollout(kc, ns, plan, rollout),
            StepKind.ROLLOUT_WAIT,
            timeout_s=rollout + 60,
        ),
        Step(
            "remove the previous smoke Job",
            [*kc, *ns, "delete", "job", SMOKE_JOB, "--ignore-not-found", "--wait=true"],
            StepKind.SMOKE_CLEAN,
        ),
        Step(
            "start the smoke Job (one real generate request)",
            [*apply, "-f", str(manifests_dir / SMOKE_FILE)],
            StepKind.SMOKE_START,
        ),
        Step(
            "wait for the smoke Job",
            [
                *kc,
                *ns,
                "wait",
                "--for=condition=complete",
                f"job/{SMOKE_JOB}",
                f"--timeout={smoke_timeout_s}s",
            ],
            StepKind.SMOKE_WAIT,
            timeout_s=smoke_timeout_s + 60,
            fails_if=[
                *kc,
                *ns,
                "wait",
                "--for=condition=failed",
                f"job/{SMOKE_JOB}",
                f"--timeout={smoke_timeout_s}s",
            ],
        ),
        Step(
            "show the smoke answer",
            [*kc, *ns, "logs", f"job/{SMOKE_JOB}", "--tail=50"],
            StepKind.SMOKE_LOGS,
            show_output=True,
        ),
    ]
    return plan


def _wait_rollout(kc: list[str], ns: list[str], plan: Plan, timeout: int) -> list[str]:
    if plan.workload_kind.has_rollout_history:
        return [*kc, *ns, "rollout", "status", plan.workload, f"--timeout={timeout}s"]
    # kubectl rollout does not know LeaderWorkerSets; their Available condition means all groups ready
    return [*kc, *ns, "wait", "--for=condition=Available", plan.workload, f"--timeout={timeout}s"]


def _tar_build_dir(build_dir: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for item in UPLOAD_ITEMS:
            if (build_dir / item).exists():
                tar.add(build_dir / item, arcname=item)
    return buf.getvalue()


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


def _run(step: Step, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    if step.fails_if:
        return _race(step)
    try:
        feed = {"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}
        return subprocess.run(step.argv, capture_output=True, timeout=step.timeout_s, **feed)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(
            step.argv, 124, e.stdout or b"", f"timed out after {step.timeout_s:.0f} s".encode()
        )


def _text(b: bytes | str | None) -> str:
    return (b.decode(errors="replace") if isinstance(b, bytes) else b or "").strip()


def _diagnose(plan: Plan, kc: list[str]) -> list[str]:
    """What an operator looks at first: pod states, recent events, the smoke Job's log."""
    ns = ["--namespace", plan.namespace]
    probes = [
        ["get", "pods", "-l", "app.kubernetes.io/name=dgpipe", "-o", "wide"],
        ["get", "events", "--sort-by=.lastTimestamp", "--field-selector", "type=Warning"],
        ["logs", f"job/{SMOKE_JOB}", "--tail=20"],
    ]
    out = []
    for args in probes:
        proc = _run(Step("diagnose", [*kc, *ns, *args], timeout_s=60))
        text = _text(proc.stdout) or _text(proc.stderr)
        if text:
            out.append(f"$ kubectl {' '.join(args)}\n" + "\n".join(text.splitlines()[-15:]))
    return out


def execute(plan: Plan, log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Run the plan; on a failed rollout or smoke test, roll the workload back and say what failed."""
    kubectl_binary()  # a clear error when kubectl is missing, before anything runs
    kc = [plan.kubectl] + (["--context", plan.context] if plan.context else [])
    ns = ["--namespace", plan.namespace]
    existed = (
        _run(Step("probe", [*kc, *ns, "get", plan.workload, "-o", "name"], timeout_s=60)).returncode == 0
    )
    done: list[Step] = []
    for step in plan.steps:
        log(f"-> {step.what}")
        stdin = _tar_build_dir(plan.upload) if step.sends_upload and plan.upload else None
        proc = _run(step, stdin)
        # the step's hint is for what it checks (a CRD the cluster lacks); kubectl failing to reach the
        # cluster at all (an unknown --context, no credentials) has its own fix
        unreachable = proc.returncode != 0 and step.kind is StepKind.CHECK_CRD
        if proc.returncode == 0 and step.expect_output and step.expect_output not in _text(proc.stdout):
            proc = subprocess.CompletedProcess(step.argv, 1, b"", f"{step.expect_output} not found".encode())
        if proc.returncode == 0:
            done.append(step)
            if step.show_output:
                log(_text(proc.stdout))
            continue
        reason = _text(proc.stderr).splitlines()[-1:] or [f"exit code {proc.returncode}"]
        failure = f"{step.what} failed: {reason[0]}"
        kinds_done = {d.kind for d in done}
        serving_applied = StepKind.SERVING in kinds_done
        details = _diagnose(plan, kc) if serving_applied else []
        rolled_back = None
        if serving_applied and plan.workload_kind.has_rollout_history:
            if existed:
                undo = _run(Step("rollback", [*kc, *ns, "rollout", "undo", plan.workload], timeout_s=120))
                rolled_back = undo.returncode == 0
                log(f"<- rollout undo {plan.workload}: {'ok' if rolled_back else _text(undo.stderr)}")
            else:
                log(f"<- {plan.workload} is new (no previous revision to roll back to); left for inspection")
        if StepKind.LOADER_START in kinds_done and StepKind.LOADER_DELETE not in kinds_done:
            _run(
                Step("cleanup", [*kc, *ns, "delete", "pod", LOADER_POD, "--ignore-not-found", "--wait=false"])
            )
        for d in details:
            log(d)
        hint = step.hint
        if unreachable:
            hint = f"kubectl could not ask the cluster: check the context and credentials ({shlex.join([*kc, 'cluster-info'])})"
        if rolled_back:
            hint = "rolled back to the previous revision"
        elif serving_applied and not existed:
            hint = "nothing to roll back to"
        raise DgpipeError(failure, hint)
    return {"deployed": plan.workload, "namespace": plan.namespace, "steps": [d.what for d in done]}
