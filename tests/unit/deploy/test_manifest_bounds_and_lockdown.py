"""`dgpipe manifests` / `dgpipe deploy` input hygiene: replicas and group sizes bounded
by the deploy target, system namespaces refused, and manifests edited after rendering refused by deploy
(with `--allow-edited` as the reviewed way out)."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from pipeline.errors import DgpipeError
from tests._utils.k8s import IMAGE, K8S, container, dgpipe, kustomize, needs_kubectl, one, pod_specs


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"replicas": 1_000_000}, "--replicas 1000000: deploy target dgx-b200 allows 1 to 8"),
        ({"replicas": 9}, "allows 1 to 8"),
        ({"replicas": 0}, "allows 1 to 8"),
        ({"lws_size": 1000}, "--lws-size 1000: a multi-node group on dgx-b200 has 2 to 32 pods"),
        ({"lws_size": 1}, "has 2 to 32 pods"),
        ({"namespace": "kube-system"}, "a system or shared namespace"),
        ({"namespace": "kube-public"}, "a system or shared namespace"),
        ({"namespace": "kube-node-lease"}, "a system or shared namespace"),
        ({"namespace": "kube-flannel"}, "a system or shared namespace"),
        ({"namespace": "default"}, "a system or shared namespace"),
    ],
)
def test_manifests_bounds_and_namespaces(kwargs, message):
    from pipeline.deploy import render as mf

    with pytest.raises(DgpipeError) as e:
        mf.resolve("dgx-b200", IMAGE, **kwargs)
    assert message in str(e.value) and e.value.hint


def test_bounds_come_from_each_target():
    from pipeline.deploy import render as mf
    from pipeline.deploy.targets import deploy_target

    gb = deploy_target("gb200")
    assert mf.resolve("gb200", IMAGE, replicas=gb.max_replicas, lws_size=gb.max_group_size).lws_size == 18
    with pytest.raises(DgpipeError, match="has 2 to 18 pods"):
        mf.resolve("gb200", IMAGE, lws_size=19)
    with pytest.raises(DgpipeError, match="allows 1 to 1"):
        mf.resolve("rtx-pro", IMAGE, replicas=2)


@needs_kubectl
def test_manifests_cli_refuses_before_writing(tmp_path):
    out = tmp_path / "k8s"
    for args in (["--replicas", "1000000"], ["--lws-size", "1000"], ["--namespace", "kube-system"]):
        proc = dgpipe("manifests", "--target", "dgx-b200", "--image", IMAGE, "--output", str(out), *args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1
        assert not out.exists()


@pytest.fixture
def rendered(tmp_path):
    from pipeline.deploy import render as mf

    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (with built-in kustomize) not installed")
    values = mf.resolve("dgx-h200", IMAGE, namespace="serving")
    mf.write(tmp_path / "k8s", values, mf.render(values))
    return tmp_path / "k8s"


def test_render_records_a_digest_per_file(rendered):
    import hashlib

    from pipeline.deploy.render import DIGESTS, RENDER_SUMMARY

    digests = json.loads((rendered / RENDER_SUMMARY).read_text())[DIGESTS]
    files = sorted(p.name for p in rendered.iterdir() if p.name != RENDER_SUMMARY)
    assert sorted(digests) == files
    for name, want in digests.items():
        assert hashlib.sha256((rendered / name).read_bytes()).hexdigest() == want


def _add_privileged(f):
    docs = list(yaml.safe_load_all(f.read_text()))
    for d in docs:
        if d["kind"] == "Deployment":
            d["spec"]["template"]["spec"]["containers"][0]["securityContext"]["privileged"] = True
    f.write_text(yaml.safe_dump_all(docs, sort_keys=False))


def test_deploy_refuses_edited_manifests(rendered):
    from pipeline.deploy.render import SERVING_FILE

    assert dgpipe("deploy", "--manifests", str(rendered), "--dry-run").returncode == 0
    _add_privileged(rendered / SERVING_FILE)
    proc = dgpipe("deploy", "--manifests", str(rendered), "--dry-run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{SERVING_FILE} changed after `dgpipe manifests` rendered it" in proc.stderr
    assert "--allow-edited" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    # the reviewed way out: applied as edited, with a warning
    proc = dgpipe("deploy", "--manifests", str(rendered), "--dry-run", "--allow-edited")
    assert proc.returncode == 0 and f"warning: applying edited manifests: {SERVING_FILE}" in proc.stderr


def test_deploy_refuses_a_render_without_digests(rendered):
    from pipeline.deploy import rollout as dp
    from pipeline.deploy.render import DIGESTS, RENDER_SUMMARY

    info = json.loads((rendered / RENDER_SUMMARY).read_text())
    del info[DIGESTS]
    (rendered / RENDER_SUMMARY).write_text(json.dumps(info))
    with pytest.raises(DgpipeError, match="no digests recorded"):
        dp.make_plan(rendered)


# ---- lock-down: Triton's control APIs need the admin key; ingress limited by a NetworkPolicy ----------
@needs_kubectl
def test_triton_args_restrict_control_apis_with_the_admin_secret():
    from pipeline.deploy import render as mf
    from pipeline.serving.server import restricted_api_args

    lws = mf.render(mf.resolve("gb200", IMAGE, lws_size=2))
    docs = [*kustomize(K8S / "overlays" / "dgx-b200"), *(d for ds in lws.values() for d in ds)]
    specs = pod_specs([d for d in docs if d["kind"] in ("Deployment", "LeaderWorkerSet")])
    assert len(specs) == 3
    for _, spec in specs:
        triton = container(spec, "triton")
        args = triton["args"]
        assert [a for a in args if "restricted" in a] == restricted_api_args("$(DGPIPE_ADMIN_KEY)")
        (env,) = [e for e in triton["env"] if e["name"] == "DGPIPE_ADMIN_KEY"]
        assert env["valueFrom"]["secretKeyRef"] == {"name": "dgpipe-admin-key", "key": "admin-key"}


@needs_kubectl
def test_network_policy_admits_namespace_gateway_and_prometheus_only():
    from pipeline.deploy import render as mf

    lws = [d for ds in mf.render(mf.resolve("gb200", IMAGE, lws_size=2)).values() for d in ds]
    for docs in (kustomize(K8S / "overlays" / "dgx-h200"), lws):
        pol = one(docs, "NetworkPolicy")
        spec = pol["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        # it selects every serving pod (Deployment or LWS leader/workers)
        templates = []
        for d in docs:
            if d["kind"] == "Deployment":
                templates.append(d["spec"]["template"]["metadata"]["labels"])
            elif d["kind"] == "LeaderWorkerSet":
                lwt = d["spec"]["leaderWorkerTemplate"]
                templates += [
                    lwt["leaderTemplate"]["metadata"]["labels"],
                    lwt["workerTemplate"]["metadata"]["labels"],
                ]
        assert templates
        for labels in templates:
            assert spec["podSelector"]["matchLabels"].items() <= labels.items()
        same_ns, gateway, prometheus = spec["ingress"]
        assert same_ns == {"from": [{"podSelector": {}}]}
        assert gateway["from"] == [{"namespaceSelector": {"matchLabels": {"dgpipe.dev/gateway": "allowed"}}}]
        assert [p["port"] for p in gateway["ports"]] == ["http", "grpc", "openai"]
        assert prometheus["from"] == [
            {
                "namespaceSelector": {},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
            }
        ]
        assert [p["port"] for p in prometheus["ports"]] == ["metrics"]
        # the named ports exist on the serving container(s)
        names = {
            p["name"]
            for _, pod in pod_specs([d for d in docs if d["kind"] in ("Deployment", "LeaderWorkerSet")])
            for c in pod["containers"]
            for p in c.get("ports", [])
        }
        assert {"http", "grpc", "openai", "metrics"} <= names


def test_local_serve_binds_loopback_and_closes_control_apis(tmp_path):
    from pipeline.serving.server import (
        HIDDEN_KEY,
        Ports,
        TritonServer,
        docker_command,
        restricted_api_args,
        restricted_api_private_args,
    )

    assert Ports().address == "127.0.0.1"
    repo = tmp_path / "repo"
    (repo / "m").mkdir(parents=True)
    (repo / "m" / "config.pbtxt").write_text('name: "m"\n')
    a, b = TritonServer(repo, Ports(), tmp_path), TritonServer(repo, Ports(), tmp_path)
    assert a.admin_key != b.admin_key and len(a.admin_key) >= 32  # made up per start: nobody knows it
    cmd = TritonServer(repo, Ports(), tmp_path, admin_key="k").command()
    assert "--http-address=127.0.0.1" in cmd and restricted_api_args(HIDDEN_KEY) == cmd[-2:]  # as ps shows it
    assert [p.real for p in restricted_api_private_args("k")] == restricted_api_args(
        "k"
    )  # what Triton parses
    docker = docker_command(repo, Ports(), "img:1")
    assert "127.0.0.1:8000:8000" in docker and "${DGPIPE_ADMIN_KEY:?" in docker[-1]
