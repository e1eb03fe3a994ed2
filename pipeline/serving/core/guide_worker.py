"""Guide compilation in a child process, bounded in time and memory, so a hostile guide costs a child.

Compiling a regex over a vocabulary (outlines-core builds a token DFA) or a grammar (llguidance) can take
seconds to minutes and gigabytes for a few bytes of input (`(1|2)*1(1|2){16}` is a 2^17-state DFA). In the
model's process that time is taken from every request and health ping behind it, and a runaway allocation
takes the whole Python backend down. Here it runs in one long-lived child (`python -m` this module), which
sets its own address-space limit (RLIMIT_AS) and lowers its priority; the parent waits at most the time
limit for an answer and kills the child past it (the next compile starts a fresh one).

The protocol is pickles over the child's stdin/stdout: first (vocab, vocab_size, end_ids), then one
(kind, guide) per compile, answered ("ok", guide) / ("refused", message). A regex guide comes back whole
(a TokenAutomaton is arrays); a grammar guide is checked here and compiled again by the caller (llguidance's
matcher does not cross processes, and once it compiled within the limits here it compiles the same there).
"""

from __future__ import annotations

import os
import pickle
import resource
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

from pipeline.errors import InputError

NICE = 19  # the lowest priority: on a busy host a compile takes only the CPU the denoise passes leave


class GuideLimitError(InputError):
    """A guide refused because compiling it ran past a limit (time or memory)."""


def python_executable() -> str:
    """A Python interpreter for the child: this one, or the virtual environment's where this process is an
    embedding binary (Triton's Python-backend stub is not a `python` that takes `-m`)."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    venv = os.environ.get("VIRTUAL_ENV")
    for candidate in ([Path(venv) / "bin" / "python"] if venv else []) + [
        Path(sys.base_prefix) / "bin" / "python3"
    ]:
        if candidate.exists():
            return str(candidate)
    return "python3"


class GuideWorker:
    """One compile child for one vocabulary; `compile` is serialised (one guide at a time)."""

    def __init__(
        self, vocab: dict[int, bytes], vocab_size: int, end_ids: tuple[int, ...], memory_mib: int
    ) -> None:
        self.init = (vocab, vocab_size, tuple(end_ids), int(memory_mib))
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            [python_executable(), "-m", "pipeline.serving.core.guide_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # a terminal's Ctrl-C is for the server, not this child
            preexec_fn=_die_with_parent,
        )
        assert proc.stdin is not None
        pickle.dump(self.init, proc.stdin)
        proc.stdin.flush()
        return proc

    def compile(self, kind: str, guide: str, seconds: float) -> Any:
        """The compiled guide (a regex kind) or None (a grammar kind: checked, compile it yourself);
        InputError with the compiler's refusal; GuideLimitError past the time or memory limit."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.proc = self._start()
            proc = self.proc
            assert proc.stdin is not None and proc.stdout is not None
            try:
                pickle.dump((kind, guide), proc.stdin)
                proc.stdin.flush()
                answer = _read(proc.stdout, seconds)
            except (BrokenPipeError, EOFError, pickle.UnpicklingError):
                answer = None
            except TimeoutError:
                self._kill()
                raise GuideLimitError(
                    f"compiling the {kind} guide took over {seconds:g} s (max_guide_seconds)",
                    "send a simpler guide (fewer alternatives or repetitions)",
                ) from None
            if answer is None:  # the child died: out of memory (allocation refused) or crashed
                self._kill()
                raise GuideLimitError(
                    f"compiling the {kind} guide needed more than {self.init[3]} MiB (max_guide_memory_mib)",
                    "send a simpler guide (fewer alternatives or repetitions)",
                )
            status, value = answer
            if status == "ok":
                return value
            if status == "memory":
                raise GuideLimitError(
                    f"compiling the {kind} guide needed more than {self.init[3]} MiB (max_guide_memory_mib)",
                    "send a simpler guide (fewer alternatives or repetitions)",
                )
            raise InputError(value)

    def _kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()
            self.proc = None

    def close(self) -> None:
        with self.lock:
            self._kill()


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the process that started it dies (Linux PR_SET_PDEATHSIG),
    so a model process killed mid-compile leaves no compile child behind."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _read(stream: IO[bytes], seconds: float) -> Any:
    """One pickle from the child within `seconds` (TimeoutError), None at end of stream."""
    ready, _, _ = select.select([stream], [], [], seconds)
    if not ready:
        raise TimeoutError
    return pickle.load(stream)


def _limit_memory(mib: int) -> None:
    """RLIMIT_AS at the address space used now (interpreter, imports) plus `mib`: the guide's budget."""
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = used + mib * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _serve(inp: IO[bytes], out: IO[bytes]) -> None:
    from pipeline.sampler.constraints import GRAMMAR_TYPES, GuideCompiler, GuideSpec

    vocab, vocab_size, end_ids, memory_mib = pickle.load(inp)
    compiler = GuideCompiler.from_vocab(vocab, vocab_size, end_ids)
    del vocab
    os.nice(NICE)
    _limit_memory(memory_mib)
    while True:
        try:
            kind, guide = pickle.load(inp)
        except EOFError:
            return
        try:
            compiled = compiler.build(GuideSpec(kind, guide))
            answer = ("ok", None if kind in GRAMMAR_TYPES else compiled)
        except MemoryError:
            answer = ("memory", "")
        except InputError as e:
            answer = ("refused", str(e))
        except Exception as e:  # a compiler's own failure on this guide: the request's problem
            answer = ("refused", f"{kind} guide cannot be compiled: {e}")
        pickle.dump(answer, out)
        out.flush()


def main() -> None:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints of the compilers go to stderr, never into the answers
    _serve(sys.stdin.buffer, out)


if __name__ == "__main__":
    main()
