"""`dgpipe serve`: run a real Triton server on a model repository.

On any machine it runs the `tritonserver` binary shipped in the nvidia-pytriton wheel (CPU works); the
Python backend's stub is the one for this interpreter, and the stub imports dgpipe and torch from this
environment. On GPU hosts `--image` gives the NGC container command instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import endpoints
from pipeline.endpoints import MODEL_NAME
from pipeline.errors import DgpipeError
from pipeline.limits import DEFAULTS
from pipeline.serving.private_argv import PrivateArg, spawn

NGC_IMAGE = "nvcr.io/nvidia/tritonserver:25.10-py3"


def tritonserver_binary() -> Path | None:
    """The `tritonserver` of the nvidia-pytriton wheel (runs on CPU), else one on PATH."""
    spec = importlib.util.find_spec("pytriton")
    if spec and spec.submodule_search_locations:
        cand = Path(next(iter(spec.submodule_search_locations))) / "tritonserver" / "bin" / "tritonserver"
        if cand.is_file():
            return cand
    found = shutil.which("tritonserver")
    return Path(found) if found else None


def _pytriton_root() -> Path:
    binary = tritonserver_binary()
    if binary is None:
        raise DgpipeError(
            "tritonserver not found", "pip install 'dgpipe[serve]' (nvidia-pytriton ships the binary)"
        )
    return binary.parent.parent  # .../pytriton/tritonserver


def backend_dir(cache: Path) -> Path:
    """A --backend-directory whose python/ holds the backend library and the stub for this Python."""
    root = _pytriton_root()
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.is_file():
        raise DgpipeError(
            f"the pytriton wheel has no Python backend stub for Python {ver}", "use Python 3.8-3.13"
        )
    out = cache / "backends" / "python"
    out.mkdir(parents=True, exist_ok=True)
    for src in (
        root / "backends" / "python" / "libtriton_python.so",
        root / "backends" / "python" / "triton_python_backend_utils.py",
        stub,
    ):
        dst = out / src.name
        if (
            not dst.exists() or dst.stat().st_size != src.stat().st_size
        ):  # a running stub cannot be overwritten
            shutil.copy2(src, dst)
    return out.parent


def server_env() -> dict[str, str]:
    """The stub embeds libpython: point it at this interpreter's home and at the packages it needs."""
    import pipeline

    libs = [str(Path(sys.base_prefix) / "lib")]
    wheel_libs = _pytriton_root().parent.parent / "nvidia_pytriton.libs"
    if wheel_libs.is_dir():
        libs.append(str(wheel_libs))
    paths = [
        str(Path(pipeline.__file__).resolve().parent.parent),
        *[p for p in sys.path if p.endswith("site-packages")],
    ]
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    env["PYTHONHOME"] = sys.base_prefix
    env["PYTHONPATH"] = os.pathsep.join(paths)
    # the stub's interpreter finds its packages like an activated virtual environment would: through
    # VIRTUAL_ENV and this interpreter's bin/ first on PATH (PYTHONPATH alone is not enough)
    if sys.prefix != sys.base_prefix:
        env["VIRTUAL_ENV"] = sys.prefix
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


# Triton's control endpoints (HTTP API / gRPC protocol names): change logging or tracing, load and unload
# models, register shared memory, read per-model statistics. Inference, health, metadata and model config
# stay open; these need the header ADMIN_HEADER (gRPC: GRPC_ADMIN_HEADER) with the admin key (`dgpipe serve
# --admin-key` or $DGPIPE_ADMIN_KEY, the Secret dgpipe-admin-key in Kubernetes). Without a key `dgpipe serve`
# makes up one nobody knows.
RESTRICTED_APIS = ("logging", "trace", "model-repository", "shared-memory", "statistics")
ADMIN_HEADER = "triton-admin-key"
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"  # the metadata key Triton checks over gRPC
HIDDEN_KEY = "<hidden>"  # what tritonserver's command line shows in place of the admin key


def restricted_api_args(key: str) -> list[str]:
    """tritonserver flags (`--http-restricted-api=<apis>:<header>=<value>`, the gRPC one alike)."""
    setting = f"{','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={key}"
    return [f"--http-restricted-api={setting}", f"--grpc-restricted-protocol={setting}"]


def restricted_api_private_args(key: str) -> list[PrivateArg]:
    """The same flags, the key kept off the command line: tritonserver accepts it nowhere else (no option
    file, no environment variable), and a command line is readable by every local user, so its argv shows
    HIDDEN_KEY and the real flags reach it through pipeline/serving/private_argv.py."""
    return [
        PrivateArg(shown, real)
        for shown, real in zip(restricted_api_args(HIDDEN_KEY), restricted_api_args(key))
    ]


@dataclass
class Ports:
    http: int = endpoints.HTTP_PORT
    grpc: int = endpoints.GRPC_PORT
    metrics: int = endpoints.METRICS_PORT
    address: str = "127.0.0.1"  # this machine only; `dgpipe serve --address 0.0.0.0` opens it up

    @property
    def host(self) -> str:
        return "127.0.0.1" if self.address in ("0.0.0.0", "") else self.address

    def check_free(self) -> None:
        """Refuse ports another process listens on, before tritonserver starts: its readiness is probed by
        URL, so a server already on the HTTP port would answer for it (and requests would reach that
        server) until this one failed to bind. SO_REUSEADDR as a server sets it: a port a stopped server
        left in TIME_WAIT is free, one being listened on is not."""
        for name, port in (
            ("--http-port", self.http),
            ("--grpc-port", self.grpc),
            ("--metrics-port", self.metrics),
        ):
            try:
                family, kind, _, _, where = socket.getaddrinfo(
                    self.address or "0.0.0.0", port, type=socket.SOCK_STREAM
                )[0]
            except socket.gaierror as e:
                raise DgpipeError(
                    f"--address {self.address}: {e.strerror}", "pass an IP address or a host name"
                ) from e
            with socket.socket(family, kind) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(where)
                except OSError as e:
                    raise DgpipeError(
                        f"port {port} ({name}) on {self.address} is taken: {e.strerror}",
                        f"stop what listens there, or pass another {name}",
                    ) from e


_GLOG_ERROR = re.compile(r"^\s*[EF]\d{4} ")  # glog severity + MMDD: E1203 12:00:00.000 ...


def log_errors(lines: list[str]) -> list[str]:
    """tritonserver's error and fatal lines (glog `E`/`F` prefix), plus any that say "error"."""
    return [ln for ln in lines if _GLOG_ERROR.match(ln) or "error" in ln.lower()]


class TritonServer:
    """A tritonserver child process: start, wait until ready, stop.

    It runs in its own session and process group, with its Python backend stubs (its children): the
    terminal's Ctrl-C reaches only `dgpipe serve`, which drains before stopping it, and stopping it ends
    the whole group, so no stub survives a tritonserver that died (a stub left alone lives on, parent 1).
    A parent-death signal (SIGTERM) stops it should `dgpipe serve` itself be killed."""

    def __init__(
        self,
        repo: Path,
        ports: Ports,
        workdir: Path,
        log: Path | None = None,
        env: dict[str, str] | None = None,
        exit_timeout: int | None = None,
        admin_key: str | None = None,
    ) -> None:
        if not (repo.is_dir() and any(repo.glob("*/config.pbtxt"))):
            raise DgpipeError(
                f"{repo}: not a model repository (no */config.pbtxt)", "create one with dgpipe package"
            )
        self.repo, self.ports, self.workdir = repo, ports, workdir
        self.admin_key = admin_key or secrets.token_urlsafe(32)  # no key given: control APIs closed
        self.log = log or workdir / "tritonserver.log"
        self.env = env or {}  # added to server_env(): e.g. the model's drain file
        self.exit_timeout = exit_timeout  # --exit-timeout-secs (None: Triton's default, 30 s)
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        """Its command line as `ps` shows it: the admin key appears as HIDDEN_KEY."""
        p = self.ports
        return [
            str(tritonserver_binary()),
            f"--model-repository={self.repo}",
            f"--backend-directory={backend_dir(self.workdir)}",
            f"--http-port={p.http}",
            f"--grpc-port={p.grpc}",
            f"--metrics-port={p.metrics}",
            f"--http-address={p.address}",
            f"--grpc-address={p.address}",
            f"--metrics-address={p.address}",
            "--log-verbose=0",
            *([f"--exit-timeout-secs={self.exit_timeout}"] if self.exit_timeout is not None else []),
            *restricted_api_args(HIDDEN_KEY),
        ]

    def start(self, timeout: float = 180.0) -> TritonServer:
        self.ports.check_free()
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as fh:
            self.proc = spawn(
                self.command(),
                restricted_api_private_args(self.admin_key),
                env={**server_env(), **self.env},
                stdout=fh,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DgpipeError(f"tritonserver exited with code {self.proc.returncode}: {self.tail()}")
            if self.ready():
                return self
            time.sleep(0.5)
        self.stop()
        raise DgpipeError(f"tritonserver not ready after {timeout:.0f} s: {self.tail()}")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def tail(self, lines: int = 5) -> str:
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join((log_errors(text) or text)[-lines:])

    @property
    def http_url(self) -> str:
        return f"http://{self.ports.host}:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"grpc://{self.ports.host}:{self.ports.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.ports.host}:{self.ports.metrics}/metrics"

    def stop(self, timeout: float | None = None) -> None:
        """SIGINT: Triton waits up to its exit timeout for requests in flight, unloads the model and exits;
        killed only when it has not exited `timeout` s (default: its exit timeout + 20 s) later. Then
        whatever is left of its process group (a stub of a tritonserver that died) is killed."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            if timeout is None:
                timeout = (30 if self.exit_timeout is None else self.exit_timeout) + 20.0
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reap_group()

    def kill(self) -> None:
        """At once: SIGKILL to tritonserver and its stubs."""
        if self.proc is not None:
            self.reap_group()

    def group(self) -> list[int]:
        """The live processes of tritonserver's process group (itself, its stubs), zombies left out."""
        return [] if self.proc is None else processes_in_group(self.proc.pid)

    def reap_group(self, timeout: float = 5.0) -> None:
        """SIGKILL to the process group, then wait (up to `timeout` s) until none of it is alive."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):  # nothing left in the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        deadline = time.monotonic() + timeout
        while self.group() and time.monotonic() < deadline:
            time.sleep(0.05)

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def processes_in_group(pgid: int, proc: Path = Path("/proc")) -> list[int]:
    """The pids of process group `pgid` that are alive (zombies are dead: only their exit status is left)."""
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, _ppid, group = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(group) == pgid and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def docker_command(repo: Path, ports: Ports, image: str) -> list[str]:
    """The NGC container command for a GPU host (the serving image adds dgpipe to NGC tritonserver)."""
    bind = "" if ports.address in ("0.0.0.0", "") else f"{ports.address}:"
    return [
        "docker",
        "run",
        "--rm",
        "--gpus",
        "all",
        "--shm-size=2g",
        "-p",
        f"{bind}{ports.http}:{endpoints.HTTP_PORT}",
        "-p",
        f"{bind}{ports.grpc}:{endpoints.GRPC_PORT}",
        "-p",
        f"{bind}{ports.metrics}:{endpoints.METRICS_PORT}",
        "-v",
        f"{repo.resolve()}:/models:ro",
        image,
        "tritonserver",
        "--model-repository=/models",
        # the shell expands the key when the line is run (and stops if it is unset): never printed here
        *restricted_api_args("${DGPIPE_ADMIN_KEY:?set DGPIPE_ADMIN_KEY}"),
    ]


class OpenAIFrontend:
    """The OpenAI-compatible frontend (pipeline/serving/openai_api.py) under uvicorn, in a thread of this
    process, talking to tritonserver over gRPC.

    A thread, not a subprocess: the frontend only waits on sockets (requests and Triton's gRPC stream), so it
    needs no CPU of its own, and sharing the `dgpipe serve` process means it cannot outlive it (Ctrl-C,
    SIGTERM or a crash stop both) and starts without a second interpreter. The socket is bound here, before
    the thread starts, so a taken port fails at once in the caller, and port 0 picks a free one (`port`
    then reads back the one bound)."""

    def __init__(
        self,
        grpc_url: str,
        port: int = endpoints.OPENAI_PORT,
        address: str = "0.0.0.0",
        api_key: str | None = None,
        model: str | None = MODEL_NAME,
        ready=None,
        drain_timeout: float = 5.0,
        max_prompt_bytes: int = DEFAULTS.max_prompt_bytes,
        guide_limits: tuple[int, int] = (DEFAULTS.max_guide_bytes, DEFAULTS.max_regex_positions),
    ) -> None:
        self.grpc_url, self.address, self.api_key, self.model, self.ready = (
            grpc_url,
            address,
            api_key,
            model,
            ready,
        )
        self.max_prompt_bytes = max_prompt_bytes  # the served repository's prompt cap
        self.guide_limits = guide_limits  # and its guide size caps (max_guide_bytes, max_regex_positions)
        self.port = port
        self.drain_timeout = drain_timeout  # how long stop() lets open streams finish
        self._server = None
        self._thread = None
        self.admission = None
        self.app = None

    def serve_model(self, served: Any) -> None:
        """Serve `served` (a ServedModel) from now on: its name and its repository's limits (the sidecar's
        frontend starts before Triton has loaded the model, and learns both from Triton)."""
        limits = served.limits
        self.model, self.max_prompt_bytes = served.name, limits.max_prompt_bytes
        self.guide_limits = (limits.max_guide_bytes, limits.max_regex_positions)
        if self.app is not None:
            self.app.state.openai.serve(served.name, self.max_prompt_bytes, *self.guide_limits)

    def start(self, timeout: float = 30.0) -> OpenAIFrontend:
        import socket
        import threading

        try:
            import uvicorn

            from pipeline.serving.openai_api import Admission, create_app, triton_stream
        except ImportError as e:
            raise DgpipeError(
                f"the OpenAI frontend needs {e.name}", "pip install 'dgpipe[serve]' (or --openai-port 0)"
            ) from e
        self.admission = Admission()
        app = create_app(
            triton_stream(self.grpc_url),
            self.model,
            self.api_key,
            self.ready,
            self.admission,
            max_prompt_bytes=self.max_prompt_bytes,
            guide_limits=self.guide_limits,
        )
        self.app = app
        sock = socket.socket(socket.AF_INET6 if ":" in self.address else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.address, self.port))
        except OSError as e:
            sock.close()
            raise DgpipeError(
                f"OpenAI frontend: cannot bind {self.address}:{self.port} ({e.strerror})",
                "pick another --openai-port (0 disables the frontend)",
            ) from e
        sock.listen(2048)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=max(1, round(self.drain_timeout)),
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="openai-frontend", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise DgpipeError(f"OpenAI frontend did not start on {self.url}")
            time.sleep(0.05)
        return self

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.address in ("0.0.0.0", "") else self.address
        return f"http://{host}:{self.port}/v1"

    def drain(self) -> None:
        """Refuse new /v1 requests (503, /health 503); those in flight go on."""
        if self.admission is not None:
            self.admission.drain()

    def inflight(self) -> int:
        return 0 if self.admission is None else self.admission.inflight

    def stop(self, timeout: float | None = None) -> None:
        """uvicorn's graceful shutdown: no new connections, open responses get up to drain_timeout."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(self.drain_timeout + 5 if timeout is None else timeout)

    def __enter__(self) -> OpenAIFrontend:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
