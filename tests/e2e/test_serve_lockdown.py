"""A real `dgpipe serve`: Triton's control endpoints refuse changes without the admin
key over HTTP and gRPC, accept them with it, inference keeps working, the ports listen on loopback
only by default, and the key is in no command line of the serve tree (readable by every local user)."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pipeline.demo import sudoku
from pipeline.limits import Limits
from pipeline.serving.lifecycle import STUB_NAME
from pipeline.serving.server import ADMIN_HEADER, GRPC_ADMIN_HEADER, HIDDEN_KEY
from tests._utils.availability import needs_tritonserver
from tests._utils.serve import README_PUZZLE, processes, start_serve

pytestmark = needs_tritonserver
KEY = "test-admin-key-0123456789"


def _request(url: str, body: dict | None = None, key: str | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", **({ADMIN_HEADER: key} if key else {})}
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _outside_address() -> str | None:
    """This machine's address on its default route, when it has one (not loopback)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent: it only picks the source address
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`dgpipe serve` as a user starts it (default address), with the admin key from the environment."""
    from pipeline.runtime.session import default_model_path
    from pipeline.serving.repository import package

    work = tmp_path_factory.mktemp("lockdown")
    repo = package(default_model_path(), work / "repo", limits=Limits(max_batch=2, max_tokens=128))
    srv = start_serve(repo, work, {"DGPIPE_ADMIN_KEY": KEY}, address=None, openai=False)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v2/logging", {"log_verbose_level": 1}),
        ("/v2/trace/setting", {"trace_level": ["TIMESTAMPS"], "trace_rate": "1"}),
        ("/v2/repository/index", {}),
        ("/v2/repository/models/dgpipe/unload", {}),
        ("/v2/systemsharedmemory/region/x/register", {"key": "/x", "offset": 0, "byte_size": 8}),
        ("/v2/models/stats", None),
    ],
)
def test_control_apis_refuse_without_the_key(served, path, body):
    status, text = _request(served.http + path, body)
    assert status == 403 and ADMIN_HEADER in text, (status, text)
    status, _ = _request(served.http + path, body, key="wrong-key")
    assert status == 403


def test_control_apis_accept_the_key_and_inference_still_works(served):
    status, text = _request(served.http + "/v2/logging", {"log_verbose_level": 0}, key=KEY)
    assert status == 200 and json.loads(text)["log_verbose_level"] == 0
    status, text = _request(served.http + "/v2/trace/setting", key=KEY)
    assert status == 200 and "trace_level" in json.loads(text)
    assert _request(served.http + "/v2/health/ready")[0] == 200
    assert _request(served.http + "/v2/models/dgpipe/config")[0] == 200  # model config stays open
    puzzle = README_PUZZLE
    body = {"text_input": puzzle, "max_tokens": 82, "exclude_input_in_output": True}
    status, text = _request(served.http + "/v2/models/dgpipe/generate", body)
    assert status == 200 and sudoku.is_valid_solution(puzzle, json.loads(text)["text_output"]), text


def test_grpc_control_protocols_refuse_without_the_key(served):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(served.grpc.removeprefix("grpc://"))
    with pytest.raises(InferenceServerException, match=GRPC_ADMIN_HEADER):
        client.update_log_settings({"log_verbose_level": 1})
    with pytest.raises(InferenceServerException, match=GRPC_ADMIN_HEADER):
        client.get_model_repository_index()
    with pytest.raises(InferenceServerException, match=GRPC_ADMIN_HEADER):
        client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})
    assert client.update_log_settings({"log_verbose_level": 0}, headers={GRPC_ADMIN_HEADER: KEY})
    assert client.is_model_ready("dgpipe")


def test_default_address_is_loopback_only(served):
    ip = _outside_address()
    if ip is None:
        pytest.skip("this machine has no non-loopback address to probe")
    for port in served.ports:
        with socket.socket() as s, pytest.raises(OSError):
            s.settimeout(2)
            s.connect((ip, port))


def _descendants(root: int) -> dict[int, str]:
    """pid -> name of `root` and every process under it."""
    table = processes()
    children: dict[int, list[int]] = {}
    for pid, (_, ppid) in table.items():
        children.setdefault(ppid, []).append(pid)
    names = {pid: name for pid, (name, _) in table.items()}
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        tree[pid] = names.get(pid, "?")
        todo += children.get(pid, [])
    return tree


def test_the_admin_key_is_in_no_command_line_of_the_serve_tree(served):
    """`ps` shows every user each process's arguments: the key must not be in any of the supervisor's,
    tritonserver's or its Python stubs' (tritonserver's shows the placeholder where the key goes)."""
    tree = _descendants(served.proc.pid)
    assert "tritonserver" in tree.values() and any(STUB_NAME.startswith(n) for n in tree.values()), tree
    for pid, name in tree.items():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert KEY not in cmdline, (pid, name)
        if name == "tritonserver":
            assert f"{ADMIN_HEADER}={HIDDEN_KEY}" in cmdline, cmdline
