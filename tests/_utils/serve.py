"""Servers for e2e tests, on free ports: `dgpipe serve` as a user starts it (the CLI in its own process
group), a bare tritonserver through the library, and their Prometheus metrics."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline.resources import PACKAGE_DIR

ROOT = PACKAGE_DIR.parent
START_ATTEMPTS = 5
# The README's puzzle: the embedded model solves it, so a served answer can be checked as a solution.
README_PUZZLE = "14...9..56925.31.8835.1.927..1732.5.259.6.7.437694.28....6.4.935.3.914..92....816"


def free_port() -> int:
    """A port nothing listens on now (bind-then-close: another process may take it before we bind)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes() -> dict[int, tuple[str, int]]:
    """pid -> (name, parent pid) of every process, from /proc (processes gone meanwhile are left out)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            name, rest = stat.split("(", 1)[1].rsplit(")", 1)
            table[int(entry.name)] = (name, int(rest.split()[1]))
    return table


@dataclass
class Serve:
    proc: subprocess.Popen
    http: str  # http://127.0.0.1:PORT (Triton)
    grpc: str  # grpc://127.0.0.1:PORT
    metrics: str  # http://127.0.0.1:PORT/metrics
    openai: str | None  # http://127.0.0.1:PORT/v1; None when started without the OpenAI frontend
    stdout: Path
    stderr: Path

    @property
    def health(self) -> str:
        assert self.openai is not None, "started without the OpenAI frontend"
        return self.openai.removesuffix("/v1") + "/health"

    @property
    def ports(self) -> tuple[int, ...]:
        """The ports it listens on: HTTP, gRPC, metrics (and OpenAI when started)."""
        urls = [self.http, self.grpc, self.metrics, *([self.openai] if self.openai else [])]
        return tuple(int(u.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[1]) for u in urls)

    def tritonserver_pid(self) -> int:
        """The tritonserver child of this `dgpipe serve`."""
        for pid, (name, ppid) in processes().items():
            if name == "tritonserver" and ppid == self.proc.pid:
                return pid
        raise AssertionError("no tritonserver child")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _start(
    repo: Path,
    work: Path,
    attempt: int,
    env: dict[str, str],
    address: str | None,
    openai: bool,
    options: list[str],
) -> Serve | None:
    cache = work / f"cache{attempt}"
    ports = [free_port() for _ in range(4 if openai else 3)] + ([] if openai else [0])
    out, err = work / f"serve{attempt}.out", work / f"serve{attempt}.err"
    args = [sys.executable, "-m", "pipeline.cli", "serve", "--repo", str(repo)]
    args += ["--address", address] if address else []
    args += [f"--{n}-port={p}" for n, p in zip(("http", "grpc", "metrics", "openai"), ports)] + options
    full_env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DGPIPE_CACHE": str(cache),
        "OMP_NUM_THREADS": "1",
        **env,
    }
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(args, stdout=o, stderr=e, env=full_env, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        lines = out.read_text(errors="replace").splitlines()
        urls = {ln.split()[1]: ln.split() for ln in lines if ln.startswith("ready  ")}
        if "OpenAI" in urls or ("HTTP" in urls and not openai):
            h = urls["HTTP"]
            return Serve(proc, h[2], h[4], h[6], urls["OpenAI"][2] if openai else None, out, err)
        if proc.poll() is not None:
            logs = err.read_text(errors="replace") + "".join(
                p.read_text(errors="replace") for p in cache.glob("serve/*.log")
            )
            if "already in use" in logs:
                return None
            raise AssertionError(f"dgpipe serve exited {proc.returncode}: {logs[-2000:]}")
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError("dgpipe serve not ready after 240 s")


def start_serve(
    repo: Path,
    work: Path,
    env: dict[str, str] | None = None,
    *,
    address: str | None = "127.0.0.1",
    openai: bool = True,
    options: list[str] | None = None,
) -> Serve:
    """`dgpipe serve --repo REPO` on free ports, ready to answer; `env` adds to the environment (keys),
    `address=None` keeps serve's default address, `openai=False` starts no OpenAI frontend, `options` are
    more of serve's options.
    Ports are picked by bind-then-close, so another process can take one first: then start again."""
    for attempt in range(START_ATTEMPTS):
        srv = _start(repo, work, attempt, env or {}, address, openai, options or [])
        if srv is not None:
            return srv
    raise AssertionError("no free ports after retries")


def start_tritonserver(repo: Path, work: Path, pick=free_port):
    """A bare tritonserver on REPO through the library (pipeline.serving.server), returned started.

    tritonserver takes fixed ports (no port 0 with read-back), so ports are picked by bind-then-close
    and another process can take one before tritonserver binds it: the start refuses a port taken before it
    spawns tritonserver, which exits with "... already in use" in its log for one taken after. Either way:
    pick fresh ports and start again. Any other failure is raised at once."""
    from pipeline.errors import DgpipeError
    from pipeline.serving.server import Ports, TritonServer

    for attempt in range(START_ATTEMPTS):
        ports = Ports(pick(), pick(), pick(), "127.0.0.1")
        log = work / f"tritonserver.{attempt}.log"
        srv = TritonServer(repo, ports, work, log=log)
        try:
            return srv.start()
        except DgpipeError as e:
            # the log too, not the message alone: the message's error lines can miss the bind failure
            said = str(e) + (log.read_text(errors="replace") if log.is_file() else "")
            if "already in use" not in said or attempt == START_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def scrape(metrics_url: str) -> dict[str, float]:
    """Every sample on a Prometheus metrics endpoint, by name with labels (`x_bucket{le="1"}`)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    samples = (ln.rsplit(maxsplit=1) for ln in text.splitlines() if ln and not ln.startswith("#"))
    return {name: float(value) for name, value in samples}


def metric(metrics_url: str, name: str) -> float:
    """The value of metric NAME: its samples summed over labels. Raises when the endpoint has none."""
    values = [v for k, v in scrape(metrics_url).items() if k == name or k.startswith(name + "{")]
    if not values:
        raise AssertionError(f"{name} not on {metrics_url}")
    return sum(values)


@contextlib.contextmanager
def health_probed(srv: Serve, every: float = 0.1) -> Iterator[list[int]]:
    """`srv`'s /health probed every `every` s in a thread while the block runs; yields the statuses seen, 0 for
    a probe that got no answer (refused, reset, or none within 5 s: a frontend blocked by another request)."""
    statuses: list[int] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            try:
                with urllib.request.urlopen(srv.health, timeout=5) as r:
                    statuses.append(r.status)
            except urllib.error.HTTPError as e:
                statuses.append(e.code)
            except OSError:  # URLError, a timeout, a reset: no answer
                statuses.append(0)
            time.sleep(every)

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        yield statuses
    finally:
        stop.set()
        thread.join(10)


def frontend_only(triton_url: str, work: Path, *options: str) -> tuple[subprocess.Popen, str]:
    """`dgpipe serve --triton-url` (the Kubernetes sidecar): the OpenAI API alone, in front of a Triton."""
    out = work / f"frontend{free_port()}.out"
    args = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "serve",
        "--triton-url",
        triton_url,
        "--address",
        "127.0.0.1",
        *options,
    ]
    env = without_api_key() | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with open(out, "wb") as o:
        proc = subprocess.Popen(
            [*args, f"--openai-port={free_port()}"], stdout=o, stderr=subprocess.STDOUT, env=env, cwd=ROOT
        )
    for _ in range(120):
        lines = [ln for ln in out.read_text().splitlines() if ln.startswith("ready  OpenAI ")]
        if lines:
            return proc, lines[0].split()[2]
        assert proc.poll() is None, out.read_text()
        time.sleep(0.25)
    proc.kill()
    raise AssertionError("frontend not ready")


def without_api_key() -> dict[str, str]:
    """This environment less DGPIPE_API_KEY: a client that has not been given the key."""
    return {k: v for k, v in os.environ.items() if k != "DGPIPE_API_KEY"}
