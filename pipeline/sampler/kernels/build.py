"""Build the fused sampler kernels (csrc/dg_sampler.cu) two ways from one source.

* Ahead of time, per architecture: `.cubin` (SASS) and `.ptx` for sm_90a (Hopper), sm_100a (Blackwell
  data centre) and sm_120a (RTX Blackwell), plus a generic compute_90 PTX the driver can JIT on anything
  newer. TensorRT's AOT plugins embed PTX in the engine, and engines are per compute capability
  (docs/model.md, "TensorRT plugins"), so each target gets its own. `python -m pipeline.sampler.kernels.build --out DIR` writes all.
* Just in time, as a PyTorch extension (`load_torch_extension`), for the PyTorch runtime on a GPU.

`cuobjdump_archs` and `read_cubin` say which SASS a binary holds, so a CPU-only machine can still prove
that every architecture compiled.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import os
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Literal

from pipeline.errors import DgpipeError

CSRC = Path(__file__).resolve().parent / "csrc"
SAMPLER_SOURCE = CSRC / "dg_sampler.cu"
TORCH_BINDING = CSRC / "torch_binding.cpp"
ARCHS = ("sm_90a", "sm_100a", "sm_120a")  # SASS + arch-specific PTX for each
GENERIC_PTX = "compute_90"  # forward-compatible PTX (JIT by the driver on newer GPUs)
NVCC_FLAGS = ("-O3", "-std=c++17")

Kind = Literal["cubin", "ptx", "fatbin"]
_ARCH_RE = re.compile(r"^(sm|compute)_(\d+)([af]?)$")


def _cuda_home_bins() -> list[Path]:
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    return [Path(h) / "bin" for h in homes if h]


def find_nvcc() -> str | None:
    """nvcc from PATH, else from CUDA_HOME / CUDA_PATH / /usr/local/cuda."""
    found = shutil.which("nvcc")
    if found:
        return found
    return next((str(b / "nvcc") for b in _cuda_home_bins() if (b / "nvcc").is_file()), None)


def find_cuobjdump() -> str | None:
    """cuobjdump from $DGPIPE_CUOBJDUMP, PATH, the CUDA toolkit, or the `nvidia-cuda-cuobjdump` wheel."""
    candidates = [os.environ.get("DGPIPE_CUOBJDUMP"), shutil.which("cuobjdump")]
    candidates += [str(b / "cuobjdump") for b in _cuda_home_bins()]
    for entry in sys.path:  # pip wheel layout: site-packages/nvidia/cu13/bin/cuobjdump
        candidates += [str(p) for p in sorted(Path(entry or ".").glob("nvidia/cu*/bin/cuobjdump"))]
    return next((c for c in candidates if c and Path(c).is_file() and os.access(c, os.X_OK)), None)


def _split_arch(arch: str) -> tuple[str, str, str]:
    m = _ARCH_RE.match(arch)
    if not m:
        raise DgpipeError(f"unknown CUDA architecture {arch!r}", hint="use e.g. sm_90a, sm_100a, compute_90")
    return m.group(1), m.group(2), m.group(3)


def compile_arch(
    arch: str,
    out_dir: Path | str,
    kind: Kind = "cubin",
    *,
    source: Path = SAMPLER_SOURCE,
    nvcc: str | None = None,
) -> Path:
    """Compile `source` for one architecture; returns `out_dir/<stem>.<arch>.<kind>`.

    kind "cubin" needs a real arch (sm_XX[a]); "ptx" accepts sm_XX[a] (its PTX, `.target sm_XXa`) or
    compute_XX; "fatbin" holds the SASS and the PTX of one arch."""
    family, number, suffix = _split_arch(arch)
    virtual = f"compute_{number}{suffix}"
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise DgpipeError("nvcc not found", hint="install the CUDA toolkit or put nvcc on PATH")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{source.stem}.{arch}.{kind}"
    if kind == "ptx":
        target = ["-ptx", f"-arch={virtual}"]
    elif family != "sm":
        raise DgpipeError(f"a {kind} needs a real architecture (sm_XX), not {arch}")
    elif kind == "cubin":
        target = ["-cubin", f"-arch={arch}"]
    elif kind == "fatbin":
        target = ["-fatbin", f"-gencode=arch={virtual},code=[{arch},{virtual}]"]
    else:
        raise DgpipeError(f"unknown output kind {kind!r}", hint="cubin, ptx or fatbin")
    cmd = [nvcc, *NVCC_FLAGS, f"-I{CSRC}", *target, "-o", str(out), str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise DgpipeError(f"nvcc failed for {arch} ({kind}): {tail}", hint=" ".join(cmd))
    return out


def build_all(out_dir: Path | str, *, nvcc: str | None = None) -> dict[str, Path]:
    """Everything the TensorRT plugin embeds: a cubin and a PTX per arch, and the generic PTX."""
    outputs = {f"{a}.cubin": compile_arch(a, out_dir, "cubin", nvcc=nvcc) for a in ARCHS}
    outputs |= {f"{a}.ptx": compile_arch(a, out_dir, "ptx", nvcc=nvcc) for a in (*ARCHS, GENERIC_PTX)}
    return outputs


def ptx_target(path: Path | str) -> str:
    """The `.target` of a PTX file (e.g. "sm_90a"; "sm_90" for compute_90)."""
    m = re.search(r"^\s*\.target\s+([\w,\s]+?)\s*$", Path(path).read_text(), re.MULTILINE)
    if not m:
        raise DgpipeError(f"{path} has no .target line: not PTX?")
    return m.group(1).split(",")[0].strip()


def cuobjdump_archs(path: Path | str, *, cuobjdump: str | None = None) -> set[str]:
    """SASS architectures in a cubin or fatbin, as cuobjdump lists them.

    cuobjdump 13 prints one line per ELF for `--list-elf`, naming it `<name>.<arch>.cubin`, e.g.
    `ELF file    1: dg_sampler.1.sm_90a.cubin`; `--dump-sass` (needs nvdisasm) prints `code for sm_90a`."""
    tool = cuobjdump or find_cuobjdump()
    if tool is None:
        raise DgpipeError(
            "cuobjdump not found", hint="install the CUDA toolkit or `pip install nvidia-cuda-cuobjdump`"
        )
    proc = subprocess.run([tool, "--list-elf", str(path)], capture_output=True, text=True)
    archs = set(re.findall(r"\.(sm_\d+[af]?)\.cubin\s*$", proc.stdout, re.MULTILINE))
    if not archs:
        sass = subprocess.run([tool, "--dump-sass", str(path)], capture_output=True, text=True)
        archs = set(re.findall(r"code for (sm_\d+[af]?)", sass.stdout))
        if not archs and (proc.returncode or sass.returncode):
            raise DgpipeError(f"cuobjdump could not read {path}: {(proc.stderr or sass.stderr).strip()}")
    return archs


@dataclass
class CubinInfo:
    arch: str  # e.g. "sm_90a"
    kernels: list[str]  # mangled names of the functions with SASS (.text.<name> sections)
    static_shared: dict[str, int]  # each kernel's static shared memory in bytes (its .nv.shared.<name>)


EM_CUDA = 190


def read_cubin(path: Path | str) -> CubinInfo:
    """Read a cubin's architecture and kernels with no CUDA tool, from the ELF itself.

    The SM number is in e_flags (bits 8-15 since ELF ABI version 8, bits 0-7 before); whether it is
    the arch-specific variant ("a"/"f") is only in the ptxas options recorded in `.note.nv.tkinfo`."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or struct.unpack_from("<H", data, 18)[0] != EM_CUDA:
        raise DgpipeError(f"{path} is not a 64-bit CUDA ELF (cubin)")
    flags = struct.unpack_from("<I", data, 48)[0]
    number = (flags >> 8) & 0xFF if data[8] >= 8 else flags & 0xFF
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    str_off = sections[shstrndx][4]

    def name(sec: tuple[int, ...]) -> str:
        start = str_off + sec[0]
        return data[start : data.index(b"\0", start)].decode()

    arch = f"sm_{number}"
    kernels: list[str] = []
    static_shared: dict[str, int] = {}
    for sec in sections:
        sec_name = name(sec)
        if sec_name.startswith(".text.") and sec[5] > 0:
            kernels.append(sec_name[len(".text.") :])
        elif sec_name.startswith(".nv.shared."):
            static_shared[sec_name[len(".nv.shared.") :]] = sec[5]
        elif sec_name == ".note.nv.tkinfo":
            m = re.search(rb"-arch (sm_(\d+)[af]?)", data[sec[4] : sec[4] + sec[5]])
            if m and int(m.group(2)) == number:
                arch = m.group(1).decode()
    return CubinInfo(arch=arch, kernels=kernels, static_shared=static_shared)


def ninja_on_path() -> None:
    """Put the `ninja` package's binary on PATH where it is installed but not there: torch's `cpp_extension`
    runs `ninja` from PATH, and a virtual environment's bin directory is on it only when activated."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR


def missing_build_tools() -> DgpipeError | None:
    """What `load_torch_extension` lacks on this machine to build the extension (torch's `cpp_extension`
    builds with nvcc under CUDA_HOME and with ninja), as the error it raises, or None."""
    import torch
    from torch.utils import cpp_extension

    ninja_on_path()

    if torch.version.cuda is None:
        return DgpipeError(
            f"the CUDA sampler needs a CUDA build of torch; this torch ({torch.__version__}) has no CUDA",
            hint="run on a GPU machine with a CUDA wheel of torch, or use pipeline.sampler.reference.sample_step",
        )
    if cpp_extension.CUDA_HOME is None or find_nvcc() is None:
        return DgpipeError("the CUDA sampler extension needs nvcc (CUDA toolkit)", hint="set CUDA_HOME")
    if not cpp_extension.is_ninja_available():
        return DgpipeError("building the CUDA sampler extension needs ninja", hint="pip install ninja")
    return None


EXTENSION = "dgpipe_sampler"  # the torch extension's name: its build directory under torch's extensions root


@contextlib.contextmanager
def exclusive_build() -> Iterator[Path]:
    """The extension's build directory, held by this process alone: dgpipe's processes load the extension
    one at a time under an flock(2) there, which the kernel drops when its holder dies. torch's
    `cpp_extension` marks a build with a lock file that names no owner and waits for it to go with no
    timeout, so a build killed mid-way (a container killed while loading, a check past its budget) left a
    lock that hung every later load, across container restarts where the directory is a volume. Holding
    the flock, a lock file found is a dead build's, and is removed."""
    from torch.utils import cpp_extension

    build_dir = Path(cpp_extension._get_build_directory(EXTENSION, False))
    with open(build_dir / "dgpipe.flock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released on close, or by the kernel when this process dies
        (build_dir / "lock").unlink(missing_ok=True)
        yield build_dir


@functools.lru_cache(maxsize=1)
def load_torch_extension(verbose: bool = False) -> ModuleType:
    """Build (once, cached by torch under ~/.cache/torch_extensions) and import the torch binding, once per
    process: the sampler calls it every step it runs outside a CUDA graph, and torch's `load` itself runs
    ninja, hashes the sources and takes the build directory's lock, milliseconds a call, and the tools check
    spawns `ninja --version`. A failed load raises and is not remembered: the next call tries again."""
    from torch.utils import cpp_extension

    missing = missing_build_tools()
    if missing is not None:
        raise missing
    with exclusive_build():
        return cpp_extension.load(
            name=EXTENSION,
            sources=[str(TORCH_BINDING), str(SAMPLER_SOURCE)],
            extra_include_paths=[str(CSRC)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=list(NVCC_FLAGS),
            verbose=verbose,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compile the sampler kernels (cubin + PTX per arch).")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    args = parser.parse_args(argv)
    try:
        outputs = build_all(args.out)
    except DgpipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for label, path in outputs.items():
        print(f"{label:>18}  {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
