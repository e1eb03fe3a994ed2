"""pipeline/serving/private_argv.py with /bin/sh as the child: the program parses the real argument while
its command line (what `ps` and /proc/<pid>/cmdline show any local user) keeps the placeholder; the child
has its own session and process group, and dies with its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.serving.private_argv import PrivateArg, spawn
from pipeline.serving.server import processes_in_group

SECRET = "s3cret-admin-key-0123"
SCRIPT = 'printf "%s\\n" "$1"; tr "\\0" " " < /proc/$$/cmdline; echo; cut -d" " -f5,6 /proc/$$/stat; echo $$'


def test_the_program_parses_the_real_argument_and_its_command_line_shows_the_placeholder(tmp_path):
    out = tmp_path / "out"
    with open(out, "wb") as fh:
        proc = spawn(
            ["/bin/sh", "-c", SCRIPT, "sh", "--key=<hidden>"],
            [PrivateArg("--key=<hidden>", f"--key={SECRET}")],
            env={"PATH": os.environ["PATH"]},
            stdout=fh,
        )
    assert proc.wait(10) == 0
    parsed, cmdline, groups, pid = out.read_text().splitlines()
    assert parsed == f"--key={SECRET}"
    assert "--key=<hidden>" in cmdline and SECRET not in cmdline
    # its own session and process group: the terminal's Ctrl-C (sent to the parent's group) misses it
    assert groups.split() == [pid, pid] and int(pid) != os.getpgrp()


def test_a_placeholder_missing_from_argv_is_refused():
    with pytest.raises(ValueError, match="exactly once"):
        spawn(["/bin/true"], [PrivateArg("--key=<hidden>", "--key=x")], env={}, stdout=subprocess.DEVNULL)


def test_the_child_dies_with_its_parent_and_its_group_is_found(tmp_path):
    """A parent that spawns `sh` (which starts its own child) and is then SIGKILLed: the parent-death
    signal ends sh; killing the group ends the grandchild, which processes_in_group then no longer lists."""
    pid_file = tmp_path / "pid"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys, time\n"
            "from pipeline.serving.private_argv import spawn\n"
            "p = spawn(['/bin/sh', '-c', 'sleep 60 & wait'], [], env={}, stdout=subprocess.DEVNULL)\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
            "time.sleep(60)\n",
        ],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
    )
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline and parent.poll() is None
        time.sleep(0.05)
    sh = int(pid_file.read_text())
    wait_until = time.monotonic() + 10
    while len(processes_in_group(sh)) < 2:  # sh and its sleep
        assert time.monotonic() < wait_until
        time.sleep(0.05)
    parent.kill()
    parent.wait()
    wait_until = time.monotonic() + 10
    while sh in processes_in_group(sh):
        assert time.monotonic() < wait_until, "sh outlived its parent"
        time.sleep(0.05)
    (sleeper,) = processes_in_group(sh)  # sh's own child: not ours to signal, only its group
    os.killpg(sh, signal.SIGKILL)
    wait_until = time.monotonic() + 10
    while processes_in_group(sh):
        assert time.monotonic() < wait_until, f"{sleeper} still alive"
        time.sleep(0.05)
