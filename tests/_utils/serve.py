"""`dgpipe serve` as a user starts it (the CLI in its own process group), on free ports, for e2e tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.resources import PACKAGE_DIR

ROOT = PACKAGE_DIR.parent
START_ATTEMPTS = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Serve:
    proc: subprocess.Popen
    http: str  # http://127.0.0.1:PORT (Triton)
    grpc: str  # grpc://127.0.0.1:PORT
    metrics: str  # http://127.0.0.1:PORT/metrics
    openai: str  # http://127.0.0.1:PORT/v1
    stdout: Path
    stderr: Path

    @property
    def health(self) -> str:
        return self.openai.removesuffix("/v1") + "/health"

    def tritonserver_pid(self) -> int:
        """The tritonserver child of this `dgpipe serve`."""
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                name, rest = stat.split("(", 1)[1].rsplit(")", 1)
                if name == "tritonserver" and int(rest.split()[1]) == self.proc.pid:
                    return int(entry.name)
        raise AssertionError("no tritonserver child")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _start(repo: Path, work: Path, attempt: int, env: dict[str, str]) -> Serve | None:
    cache = work / f"cache{attempt}"
    ports = [free_port() for _ in range(4)]
    out, err = work / f"serve{attempt}.out", work / f"serve{attempt}.err"
    args = [sys.executable, "-m", "pipeline.cli", "serve", "--repo", str(repo), "--address", "127.0.0.1"]
    args += [f"--{n}-port={p}" for n, p in zip(("http", "grpc", "metrics", "openai"), ports)]
    full_env = {**os.environ, "DGPIPE_CACHE": str(cache), "OMP_NUM_THREADS": "1", **env}
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(args, stdout=o, stderr=e, env=full_env, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        lines = out.read_text(errors="replace").splitlines()
        urls = {ln.split()[1]: ln.split() for ln in lines if ln.startswith("ready  ")}
        if "OpenAI" in urls:
            h = urls["HTTP"]
            return Serve(proc, h[2], h[4], h[6], urls["OpenAI"][2], out, err)
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


def start_serve(repo: Path, work: Path, env: dict[str, str] | None = None) -> Serve:
    """Ports are picked by bind-then-close, so another process can take one first: then start again."""
    for attempt in range(START_ATTEMPTS):
        srv = _start(repo, work, attempt, env or {})
        if srv is not None:
            return srv
    raise AssertionError("no free ports after retries")
