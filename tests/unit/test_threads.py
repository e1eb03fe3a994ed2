"""The thread policy (`pipeline.threads`): env precedence, the physical-core default, bounds, bad values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import threads
from pipeline.errors import DgpipeError


@pytest.fixture
def cores(monkeypatch):
    """Pretend this process may run on 8 physical cores (no quota)."""
    monkeypatch.setattr(threads, "default_threads", lambda: 8)


def test_dgpipe_threads_wins_over_omp_and_the_default(cores):
    assert threads.thread_count(env={"DGPIPE_THREADS": "3", "OMP_NUM_THREADS": "5"}) == 3
    assert threads.thread_count(env={"OMP_NUM_THREADS": "5"}) == 5
    assert threads.thread_count(env={}) == 8
    assert threads.thread_count(env={"DGPIPE_THREADS": " ", "OMP_NUM_THREADS": ""}) == 8  # blank = unset


def test_the_budget_is_split_among_server_instances_at_least_one_each(cores):
    assert threads.thread_count(instances=2, env={}) == 4
    assert threads.thread_count(instances=3, env={"DGPIPE_THREADS": "8"}) == 2
    assert threads.thread_count(instances=16, env={}) == 1
    with pytest.raises(DgpipeError, match="instances must be >= 1"):
        threads.thread_count(instances=0, env={})


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
@pytest.mark.parametrize("name", ["DGPIPE_THREADS", "OMP_NUM_THREADS"])
def test_bad_values_name_the_variable(cores, name, value):
    with pytest.raises(DgpipeError, match=f"{name}=.*expected a positive integer"):
        threads.thread_count(env={name: value})


def _topology(root: Path, cpu: int, package: int, core: int) -> None:
    d = root / f"cpu{cpu}" / "topology"
    d.mkdir(parents=True)
    (d / "physical_package_id").write_text(f"{package}\n")
    (d / "core_id").write_text(f"{core}\n")


def test_physical_cores_count_smt_siblings_once_and_only_allowed_cpus(tmp_path):
    for cpu in range(8):  # 2 packages x 2 cores x 2 hyperthreads: cpu n and n+4 are siblings
        _topology(tmp_path, cpu, package=(cpu % 4) // 2, core=cpu % 2)
    assert threads.physical_cores(set(range(8)), tmp_path) == 4
    assert threads.physical_cores({0, 4}, tmp_path) == 1  # two siblings: one core
    assert threads.physical_cores({0, 1, 2}, tmp_path) == 3
    assert threads.physical_cores({0, 99}, tmp_path) == 2  # unreadable topology: one core per CPU


def test_cgroup_quota(tmp_path):
    f = tmp_path / "cpu.max"
    f.write_text("max 100000\n")
    assert threads.cgroup_cpu_limit(f) is None
    f.write_text("250000 100000\n")
    assert threads.cgroup_cpu_limit(f) == 3
    assert threads.cgroup_cpu_limit(tmp_path / "missing") is None


def test_default_is_within_this_process_affinity():
    n = threads.default_threads()
    assert 1 <= n <= len(threads.available_cpus())


def test_apply_sets_torch_and_is_torch_free_before_torch(tmp_path):
    """Before torch is imported the policy travels through OMP_NUM_THREADS (nothing imports torch for
    it); after, it is torch.set_num_threads."""
    code = (
        "import os, sys\n"
        "from pipeline.threads import apply_thread_policy\n"
        "assert apply_thread_policy() == 1 and 'torch' not in sys.modules\n"
        "import torch\n"
        "assert torch.get_num_threads() == 1, torch.get_num_threads()\n"
        "os.environ['DGPIPE_THREADS'] = '2'\n"
        "assert apply_thread_policy() == 2 and torch.get_num_threads() == 2\n"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "DGPIPE_THREADS": "1",
        "PYTHONPATH": str(Path(threads.__file__).parents[1]),
    }
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
