"""Start a child whose command line carries a secret without the secret appearing in its command line.

tritonserver takes its admin key only as a command-line option (`--http-restricted-api=<apis>:<header>=<key>`,
`--grpc-restricted-protocol=...`): it reads no option file and no environment variable for it. A command
line is world-readable (`ps`, `/proc/<pid>/cmdline`, mode 0444 whatever the process does), while a
process's environment and memory are readable only by its own user. So the child is started with a
placeholder in argv (`...=<hidden>`) and the real option in its environment, stopped by the kernel right
after exec (`PTRACE_TRACEME`), before a single instruction of it runs; the parent then points the
placeholder's `argv[i]` at the real option's text in the child's environment block and lets it go. The
program parses the real option; the kernel, which shows the argv *text* region in `/proc/<pid>/cmdline`,
keeps showing the placeholder. The secret is never in any command line, not even for a moment.

The child also gets its own session (the terminal's Ctrl-C reaches only its parent, which decides how to
stop it) and a parent-death signal, so it does not outlive a parent killed without a chance to stop it.
The kernel sends that signal when the *thread* that started the child ends: start it from a thread that
lives as long as the child should (the main thread, in `dgpipe serve`).
Linux only (ptrace, /proc); the parent must be allowed to trace its own children (the default, also
under Yama ptrace_scope 1).
"""

from __future__ import annotations

import ctypes
import os
import signal
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import DgpipeError

PR_SET_PDEATHSIG = 1
PTRACE_TRACEME = 0
PTRACE_DETACH = 17
ENV_PREFIX = "DGPIPE_PRIVATE_ARG_"  # the real options, one variable each, in the child's environment
_PTR = struct.calcsize("P")


@dataclass(frozen=True)
class PrivateArg:
    """One command-line argument: `shown` is what argv (and `ps`) holds, `real` what the program parses."""

    shown: str
    real: str


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return libc


def spawn(
    argv: list[str],
    private: list[PrivateArg],
    env: dict[str, str],
    stdout,
    parent_death_signal: signal.Signals = signal.SIGTERM,
) -> subprocess.Popen:
    """`argv` (holding each `shown`) in a new session, stderr to stdout; each `shown` is swapped for its
    `real` text before the program starts. Raises DgpipeError when the swap cannot be made (the child is
    killed then: it never runs with a placeholder)."""
    for p in private:
        if argv.count(p.shown) != 1:
            raise ValueError(f"{p.shown!r} must appear exactly once in argv")
    libc = _libc()
    parent = os.getpid()

    def in_child() -> None:  # between fork and exec, in the child
        libc.prctl(PR_SET_PDEATHSIG, int(parent_death_signal), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the line above took effect
            os._exit(1)
        if private and libc.ptrace(PTRACE_TRACEME, 0, None, None) != 0:
            raise OSError(ctypes.get_errno(), "ptrace(PTRACE_TRACEME) refused")

    child_env = {**env, **{f"{ENV_PREFIX}{i}": p.real for i, p in enumerate(private)}}
    try:
        proc = subprocess.Popen(
            argv,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            env=child_env,
            start_new_session=True,
            preexec_fn=in_child,
        )
    except subprocess.SubprocessError as e:  # in_child raised
        raise DgpipeError(
            f"cannot start {Path(argv[0]).name} with its secrets kept off its command line ({e})",
            "run dgpipe serve where a process may trace its own children (ptrace; seccomp, Yama)",
        ) from e
    if not private:
        return proc
    try:
        _swap(proc.pid, argv, private)
    except BaseException:
        proc.kill()
        libc.ptrace(PTRACE_DETACH, proc.pid, None, None)
        proc.wait()
        raise
    libc.ptrace(PTRACE_DETACH, proc.pid, None, None)
    return proc


def _swap(pid: int, argv: list[str], private: list[PrivateArg]) -> None:
    """In the child stopped after exec: point argv[i] of each placeholder at its real text (environment)."""
    _, status = os.waitpid(pid, 0)
    if not (os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGTRAP):
        raise DgpipeError(f"{Path(argv[0]).name} did not stop after exec (wait status {status:#x})")
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # proc(5) numbers stat's fields from 1; the text after ")" starts at field 3
    start_stack, env_start, env_end = (int(fields[n - 3]) for n in (28, 50, 51))
    fd = os.open(f"/proc/{pid}/mem", os.O_RDWR)
    try:
        (argc,) = struct.unpack("P", os.pread(fd, _PTR, start_stack))
        if argc != len(argv):
            raise DgpipeError(
                f"{Path(argv[0]).name}: found {argc} arguments after exec, expected {len(argv)}"
            )
        slots = struct.unpack(f"{argc}P", os.pread(fd, _PTR * argc, start_stack + _PTR))
        environ = os.pread(fd, env_end - env_start, env_start)
        for i, p in enumerate(private):
            var = f"{ENV_PREFIX}{i}=".encode()
            if environ.startswith(var):
                at = 0
            elif (found := environ.find(b"\0" + var)) >= 0:
                at = found + 1
            else:
                raise DgpipeError(f"{var.decode()} missing from the child's environment")
            index = argv.index(p.shown)
            shown = os.pread(fd, len(p.shown.encode()) + 1, slots[index])
            if shown != p.shown.encode() + b"\0":
                raise DgpipeError(f"argument {index} after exec is not the one started with")
            os.pwrite(fd, struct.pack("P", env_start + at + len(var)), start_stack + _PTR * (1 + index))
    finally:
        os.close(fd)
