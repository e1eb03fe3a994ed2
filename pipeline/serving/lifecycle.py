"""The serving lifecycle around a tritonserver: honest health, graceful drain, clean exit.

Triton's own `/v2/health/ready` stays 200 when the Python backend's stub process is gone (every request then
gets "Stub process ... is not healthy" and nothing restarts it) and never says "busy". So health here is a
real round trip through the model: a request with the `health_check` parameter, answered by the model's
runtime loop between denoise steps (model_repo/dgpipe_model.py). It tells three states apart: ok, draining
(alive, refusing new work: ready no, live yes) and down (stub gone, loop wedged, server unreachable).

Draining: the model refuses new requests once the drain file (env DGPIPE_DRAIN_FILE, passed to
tritonserver) is touched; in-flight requests finish; `dgpipe_active_requests` on the metrics port counts
them down to 0. `dgpipe serve` does this on SIGTERM/SIGINT, a pod's preStop hook with `dgpipe drain`.

The drain timeout and the pod's terminationGracePeriodSeconds come from the constants below (k8s/base is
checked against them by tests/unit/serving/test_lifecycle.py). Light on purpose (stdlib at import): the CLI
reads the defaults from here, and the pod's probes run `dgpipe health` every few seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.endpoints import MODEL_NAME

TERMINATION_GRACE_S = 120  # the pod's terminationGracePeriodSeconds (k8s/base/deployment.yaml)
DRAIN_MARGIN_S = 15  # after the drain: answering what is left (ABORT_WAIT_S), tritonserver's exit (unload)
DRAIN_TIMEOUT_S = TERMINATION_GRACE_S - DRAIN_MARGIN_S  # in-flight requests get this long to finish
ABORT_WAIT_S = 3  # after a drain timeout: how long the model gets to answer what is left as unavailable
# tritonserver --exit-timeout-secs: after a drain nothing is left in flight, and unloading the model takes
# well under a second; a longer wait only delays a stop whose unload is stuck (supervisor.unload_timed_out)
EXIT_TIMEOUT_S = 3
PING_TIMEOUT_S = 5.0  # a ping unanswered within this: the runtime loop is busy or wedged (a step is < 1 s)
# how long the runtime loop may answer no ping before the server counts it wedged and stops: a loop in one
# long step (a kernel compiled on first use) looks the same until then. The pod's liveness probe gives it
# as long (periodSeconds x failureThreshold, k8s/base/deployment.yaml); readiness turns 503 at the first
WEDGED_AFTER_S = 60.0
STUB_NAME = "triton_python_backend_stub"
SHM_PREFIX = "triton_python_backend_shm_region_"


@dataclass(frozen=True)
class Health:
    state: str  # "ok", "draining" or "down"
    detail: str = ""
    answered: bool = True  # False: no answer came (refused, reset, timed out): busy or wedged, not refusing

    @property
    def ready(self) -> bool:
        """Send traffic here (readiness)."""
        return self.state == "ok"

    @property
    def live(self) -> bool:
        """Keep the process (liveness): a draining server is finishing work, not broken."""
        return self.state != "down"


def _classify(message: str) -> Health:
    return Health("draining" if "draining" in message else "down", message)


def ping(url: str, model: str = MODEL_NAME, timeout: float = PING_TIMEOUT_S) -> Health:
    """One health round trip through the model at http://HOST:PORT (Triton's generate endpoint) or
    grpc://HOST:PORT (streaming, as the OpenAI frontend talks to Triton)."""
    from pipeline.serving.schema import HEALTH_PARAMETER

    if url.startswith("grpc://"):
        return _ping_grpc(url, model, timeout)
    req = urllib.request.Request(
        f"{url.rstrip('/')}/v2/models/{model}/generate",
        data=json.dumps({HEALTH_PARAMETER: True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return Health("ok")
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace")
        with contextlib.suppress(json.JSONDecodeError, AttributeError):
            body = json.loads(body).get("error", body)
        return _classify(f"HTTP {e.code}: {body}")
    except (OSError, TimeoutError) as e:  # refused, reset, timed out: nothing answers
        return Health("down", f"{url}: {getattr(e, 'reason', e)}", answered=False)


def _ping_grpc(url: str, model: str, timeout: float) -> Health:
    import queue

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from pipeline.serving.schema import HEALTH_PARAMETER

    results: queue.Queue = queue.Queue()
    try:
        client = grpcclient.InferenceServerClient(url.removeprefix("grpc://"))
    except InferenceServerException as e:
        return Health("down", f"{url}: {e.message()}", answered=False)
    try:
        client.start_stream(callback=lambda result, error: results.put(error))
        client.async_stream_infer(model, [], parameters={HEALTH_PARAMETER: True})
        error = results.get(timeout=timeout)
    except queue.Empty:
        return Health(
            "down",
            f"{url}: no answer within {timeout:g} s (the model's runtime loop is wedged)",
            answered=False,
        )
    except InferenceServerException as e:
        return Health("down", f"{url}: {e.message()}", answered=False)
    finally:
        try:
            client.stop_stream(cancel_requests=True)
        finally:
            client.close()
    if error is None:
        return Health("ok")
    message = error.message() if hasattr(error, "message") else str(error)
    return _classify(message)


def active_requests(metrics_url: str, timeout: float = 5.0) -> float | None:
    """The model's `dgpipe_active_requests` gauge (accepted, not yet answered), summed over its series (one
    per model instance); None when unreadable or absent."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout) as r:
            text = r.read().decode(errors="replace")
    except OSError:
        return None
    name, values = "dgpipe_active_requests", []
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")):
            sample = line[len(name) :]
            if sample.startswith("{"):
                sample = sample[sample.index("}") + 1 :]
            values.append(float(sample.split()[0]))  # the value; an optional timestamp follows
    return sum(values) if values else None


def touch_drain_file(path: Path) -> None:
    """Ask the model to refuse new requests (its mtime must be newer than the model's load). The file is
    written empty, by a rename: a previous drain that timed out left `ABORT` in it (the file outlives a
    container restart in the pod's /tmp), which would end this drain's requests at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"")
    os.replace(tmp, path)


def abort_in_flight(path: Path, metrics_url: str, wait_s: float = ABORT_WAIT_S) -> float | None:
    """After a drain timed out: ask the model to answer every request still in flight as unavailable
    (the drain file's content becomes `ABORT`, written whole by a rename), and wait up to `wait_s` for it
    to have done so. Returns what is still in flight then (None: no metrics)."""
    from pipeline.serving.core.drain import ABORT

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(ABORT)
    os.replace(tmp, path)
    wait_drained(metrics_url, wait_s)
    return active_requests(metrics_url)


def wait_drained(metrics_url: str, timeout: float, busy=lambda: 0, poll: float = 0.2) -> bool:
    """Wait until nothing is in flight in the model (and `busy()`, e.g. open frontend streams, is 0),
    up to `timeout` seconds. True when drained; an unreadable metrics port counts as drained (the server
    is gone, so nothing is in flight there)."""
    deadline = time.monotonic() + timeout
    while True:
        active = active_requests(metrics_url)
        if (active is None or active == 0) and busy() == 0:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)


@dataclass
class Stub:
    pid: int
    shm_region: str  # its shared-memory region under /dev/shm (the stub's second argument)


def stubs_of(server_pid: int) -> list[Stub]:
    """The Python backend stub processes tritonserver `server_pid` started (from /proc; Linux)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != server_pid:
                continue
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        if args and Path(args[0].decode(errors="replace")).name == STUB_NAME and len(args) > 2:
            found.append(Stub(int(entry.name), args[2].decode(errors="replace")))
    return found


def remove_shm_leftovers(regions: set[str], shm: Path = Path("/dev/shm")) -> list[str]:
    """Unlink the named Python-backend regions still present after tritonserver exited (a stub that
    crashed, or was killed, leaves its region behind). Only regions of our own stubs, never others'."""
    removed = []
    for name in sorted(regions):
        if not name.startswith(SHM_PREFIX) or "/" in name:
            continue
        try:
            (shm / name).unlink()
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


@dataclass
class Watchdog:
    """Pings the model every `period` seconds in a thread; `health` is the latest answer. `down_after`
    consecutive "down" pings set `failed` where the model refused them (a lost GPU) or its stubs are gone,
    and where no answer came (a long step, or a wedged loop), once that has lasted `wedged_after_s`:
    the model cannot recover in this process (Triton does not restart a dead stub of a decoupled model), so
    the supervisor should restart it."""

    url: str
    server_pid: int
    model: str = MODEL_NAME  # the served model's name, as its repository names it
    period: float = 2.0
    down_after: int = 3
    wedged_after_s: float = WEDGED_AFTER_S
    health: Health = field(default_factory=lambda: Health("ok"))
    failed: str | None = None
    regions: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dgpipe-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self.regions |= {s.shm_region for s in stubs_of(self.server_pid)}
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.period + PING_TIMEOUT_S + 1)

    def ready(self) -> bool:
        return self.health.ready and self.failed is None

    def _run(self) -> None:
        downs, down_since = 0, 0.0
        while not self._stop.wait(self.period):
            stubs = stubs_of(self.server_pid)
            self.regions |= {s.shm_region for s in stubs}
            self.health = (
                ping(self.url, self.model) if stubs else Health("down", f"no {STUB_NAME} process is running")
            )
            if self.health.state != "down":
                downs = 0
                continue
            downs, down_since = downs + 1, down_since if downs else time.monotonic()
            # a refusal and stubs that are gone are final; a loop that answers nothing may be in one long step
            wedged = time.monotonic() - down_since >= self.wedged_after_s
            if downs >= self.down_after and (not stubs or self.health.answered or wedged):
                self.failed = self.health.detail
                return
