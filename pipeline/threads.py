"""How many CPU threads dgpipe's compute uses: one policy for PyTorch and ONNX Runtime alike.

The budget is, first match wins:
  1. `DGPIPE_THREADS` (a positive integer);
  2. `OMP_NUM_THREADS` when the user set it (the usual knob; torch reads it too);
  3. the physical cores this process may run on: its CPU affinity, one thread per core (SMT siblings
     are counted once), capped by a cgroup CPU quota (a container's `cpu.max`).
A server divides the budget among its model instances (`instances`), at least one thread each.

`apply_thread_policy()` is called once per process by the entry points (the CLI at start, the Triton
model at initialize); the library itself never changes thread settings, so a program that imports dgpipe
and calls `torch.set_num_threads` keeps its choice. `OnnxRuntimeBackend` sizes its session from
`thread_count()`. Importing this module does not import torch.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from pipeline.errors import DgpipeError

ENV = "DGPIPE_THREADS"
SYS_CPU = Path("/sys/devices/system/cpu")
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def _parse(name: str, value: str) -> int:
    try:
        n = int(value.strip())
    except ValueError:
        n = 0
    if n < 1:
        raise DgpipeError(
            f"{name}={value!r}: expected a positive integer (threads per process)",
            f"unset {name} to use one thread per physical core",
        )
    return n


def available_cpus() -> set[int]:
    """Logical CPUs this process may run on (its affinity mask; every CPU where that is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def physical_cores(cpus: set[int], sys_cpu: Path = SYS_CPU) -> int:
    """Distinct (package, core) pairs among `cpus`; a CPU whose topology is unreadable counts as one core."""
    cores: set[tuple[str, ...]] = set()
    for cpu in cpus:
        topo = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            package = (topo / "physical_package_id").read_text().strip()
            cores.add((package, (topo / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def cgroup_cpu_limit(cpu_max: Path = CGROUP_CPU_MAX) -> int | None:
    """CPUs granted by a cgroup v2 quota ("200000 100000" -> 2), None when unlimited or unknown."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None


def default_threads() -> int:
    """Physical cores available to this process (affinity, SMT and cgroup quota aware)."""
    n = physical_cores(available_cpus())
    limit = cgroup_cpu_limit()
    return min(n, limit) if limit else n


def thread_count(instances: int = 1, env: dict[str, str] | None = None) -> int:
    """Threads for one compute process: the budget (see the module docstring) split among `instances`."""
    env = os.environ if env is None else env
    if instances < 1:
        raise DgpipeError(f"model instances must be >= 1 (got {instances})")
    if env.get(ENV, "").strip():
        total = _parse(ENV, env[ENV])
    elif env.get("OMP_NUM_THREADS", "").strip():
        total = _parse("OMP_NUM_THREADS", env["OMP_NUM_THREADS"])
    else:
        total = default_threads()
    return max(1, total // instances)


def apply_thread_policy(instances: int = 1) -> int:
    """Set this process's compute threads from the policy, once, at start; returns the count.

    With torch already imported this is `torch.set_num_threads`; before that it exports
    `OMP_NUM_THREADS`, which torch (and OpenMP/MKL) read when they start, so a command that never
    imports torch does not pay for importing it here. Child processes inherit the same budget.
    """
    n = thread_count(instances)
    os.environ["OMP_NUM_THREADS"] = str(n)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)
    return n
