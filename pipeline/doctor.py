"""`dgpipe doctor`: what this machine has for each stage, and how to get what it lacks."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    hint: str = ""
    needed_for: str = ""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout + out.stderr).strip() if out.returncode == 0 else None


def check_python() -> Check:
    ok = sys.version_info >= (3, 10)
    return Check(
        "python", ok, platform.python_version(), "" if ok else "install Python >= 3.10", "everything"
    )


def check_torch() -> list[Check]:
    v = _version("torch")
    if v is None:
        return [
            Check(
                "torch", False, "not installed", "pip install torch==2.13.0 (CPU) or a CUDA build", "runtime"
            )
        ]
    import torch

    checks = [Check("torch", True, f"{v} (CUDA build {torch.version.cuda or 'none'})", needed_for="runtime")]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            checks.append(
                Check(
                    f"cuda:{i}",
                    True,
                    f"{p.name}, sm{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB",
                    needed_for="GPU runtime, engines",
                )
            )
    else:
        checks.append(
            Check(
                "cuda devices",
                False,
                "none visible",
                "GPU runtime and local engine builds need an NVIDIA GPU + driver",
                "GPU runtime, engines",
            )
        )
    return checks


def check_nvcc() -> Check:
    path = shutil.which("nvcc")
    out = _run([path, "--version"]) if path else None
    if not out:
        return Check(
            "nvcc",
            False,
            "not found",
            "install the CUDA toolkit (>= 12.8 for sm_100a/sm_120a)",
            "CUDA kernels",
        )
    release = next(
        (ln.split("release")[-1].strip() for ln in out.splitlines() if "release" in ln), out.splitlines()[-1]
    )
    return Check("nvcc", True, f"{path} ({release})", needed_for="CUDA kernels")


def check_ninja() -> Check:
    """ninja as torch's `cpp_extension` finds it (on PATH, the `ninja` package's binary included)."""
    from torch.utils import cpp_extension

    from pipeline.sampler.kernels.build import ninja_on_path

    ninja_on_path()
    if not cpp_extension.is_ninja_available():
        return Check(
            "ninja", False, "not found", "pip install ninja", "the fused CUDA sampler (built on first use)"
        )
    return Check("ninja", True, shutil.which("ninja") or "on PATH", needed_for="the fused CUDA sampler")


def check_module(name: str, dist: str, hint: str, needed_for: str) -> Check:
    v = _version(dist)
    if v is None or importlib.util.find_spec(name) is None:
        return Check(dist, False, "not installed", hint, needed_for)
    return Check(dist, True, v, needed_for=needed_for)


def check_tritonserver() -> Check:
    from pipeline.serving.server import tritonserver_binary

    b = tritonserver_binary()
    if b is None:
        return Check(
            "tritonserver",
            False,
            "not found",
            "pip install 'dgpipe[serve]' (nvidia-pytriton ships the binary)",
            "serve",
        )
    return Check("tritonserver", True, str(b), needed_for="serve")


def check_kubectl() -> Check:
    from pipeline.deploy.kubectl import find_kubectl

    path = find_kubectl()
    out = _run([path, "version", "--client", "-o", "yaml"]) if path else None
    if not out:
        return Check(
            "kubectl",
            False,
            "not found",
            "install kubectl >= 1.27 (kustomize is built in)",
            "manifests, deploy",
        )
    ver = next((ln.split(":")[-1].strip() for ln in out.splitlines() if "gitVersion" in ln), "?")
    return Check("kubectl", True, f"{path} ({ver})", needed_for="manifests, deploy")


def check_engine_build() -> list[Check]:
    """What a local TensorRT engine build needs: TensorRT >= 10.9 (AOT plugins), a GPU and its compute
    capability (which target's engine it can build), nvcc for the sampler PTX. Without them the engine is
    built on the target node (`dgpipe engine build` in the serving image), which doctor says."""
    from pipeline.engine.build_engine import MIN_TENSORRT, missing_for_local_build
    from pipeline.engine.probe import gpu, tensorrt_version

    need = ".".join(map(str, MIN_TENSORRT))
    v = tensorrt_version()
    ok_version = v is not None and tuple(int(p) for p in v.split(".")[:2]) >= MIN_TENSORRT
    checks = [
        Check(
            "tensorrt",
            ok_version,
            v or "not installed",
            ""
            if ok_version
            else f"TensorRT >= {need} (pip install tensorrt on a GPU host, or the NGC image)",
            "engine build",
        )
    ]
    g = gpu()
    if g is not None:
        from pipeline.targets import target_for_compute_capability

        t = target_for_compute_capability(g[0])
        label = t.name if t is not None else "no dgpipe target"
        checks.append(
            Check("engine target", t is not None, f"{g[1]}: cc {g[0]} -> {label}", "", "engine build")
        )
    missing = missing_for_local_build()
    checks.append(
        Check(
            "local engine build",
            not missing,
            "possible" if not missing else "; ".join(missing),
            ""
            if not missing
            else "engines will be built on the target node (`dgpipe engine build` in the serving image)",
            "engine build",
        )
    )
    return checks


def check_tensor_cores() -> list[Check]:
    """The dispatch rows (`pipeline.runtime.dispatch`) for the local GPU: which kernel runs each weight
    format's linears and experts, or the named fallback. The kernels themselves are probed at load."""
    import torch

    from pipeline.model.network import GROUPED_MM_KERNEL_MAJORS
    from pipeline.runtime.dispatch import FORMATS, NO_GROUPED_KERNEL, arch_of, dispatch

    if not torch.cuda.is_available():
        return [
            Check(
                "tensor cores",
                False,
                "no CUDA",
                "FP8/NVFP4 weights run on tensor cores only on an NVIDIA GPU (sm89+); here they are dequantized",
                "GPU runtime",
            )
        ]
    major, minor = torch.cuda.get_device_capability(0)
    arch = arch_of(major, minor)
    if arch is None:
        return [
            Check("tensor cores", False, f"sm{major}{minor}: no dispatch row", "sm89+ GPU", "GPU runtime")
        ]
    checks = []
    for fmt in FORMATS:
        row = dispatch(fmt, arch)
        detail = f"{arch}: linears {row.linears}; experts {row.experts}"
        if row.experts_fallback:  # what a load takes where the experts' kernel fails its probe
            detail += f"; where it fails its probe: {row.experts_fallback}"
        hint = "" if row.native else f"fallback {row.fallback}: {row.note}"
        checks.append(Check(f"{fmt} dispatch", row.native, detail, hint, "GPU runtime"))
    if major not in GROUPED_MM_KERNEL_MAJORS and arch not in NO_GROUPED_KERNEL:  # Thor: sm100's row
        checks.append(
            Check(
                "torch grouped GEMMs",
                False,
                f"compute capability {major}.{minor} takes {arch}'s rows, but torch's grouped GEMMs run on 9.x "
                "and 10.x alone",
                "float experts take dgpipe's Triton MoE GEMM and NVFP4 experts their second path, where probed "
                "(the load reports each)",
                "GPU runtime",
            )
        )
    gpu = torch.cuda.get_device_name(0)
    return [check_gpu_spec(gpu), *checks, *check_moe_tiles(gpu), *check_kernel_probe(torch.device("cuda", 0))]


def check_gpu_spec(gpu: str) -> Check:
    """The configs/targets entry of the GPU the driver names (`targets.gpu_named`): its datasheet bandwidth
    and tensor-core rates set `dgpipe bench gpu`'s floors."""
    from pipeline.targets import gpu_named

    spec = gpu_named(gpu)
    if spec is None:
        return Check("gpu spec", False, f"{gpu}: not in configs/targets",
                     "add its datasheet figures (device_names, memory, bandwidth, dense TFLOPS) to "
                     "configs/targets/<arch>.yaml; `dgpipe bench gpu` sets it against the copy bandwidth it measures",
                     "GPU runtime")  # fmt: skip
    detail = f"{gpu}: {spec.product}, {spec.memory_gib:g} GiB, {spec.bandwidth_tb_s:g} TB/s"
    return Check("gpu spec", True, detail, "", "GPU runtime")


def check_moe_tiles(gpu: str) -> list[Check]:
    """Which tile table the Triton MoE GEMM reads on this GPU model, per operand type
    (`pipeline.runtime.kernels.moe_tiles`), or that it keeps its default tiles."""
    from pipeline.errors import DgpipeError
    from pipeline.runtime.kernels import moe_tiles

    checks = []
    for operand in ("fp8", "bf16"):
        name, hint = (
            f"moe tiles {operand}",
            f"`dgpipe bench moe-tiles --operand {operand}` tunes them for {gpu}",
        )
        try:
            found = moe_tiles.find_table(gpu, operand)
        except DgpipeError as e:
            checks.append(Check(name, False, str(e), hint, "GPU runtime"))
            continue
        detail = (
            f"measured: {found[1]} (torch {found[0].torch}, Triton {found[0].triton})"
            if found
            else "default tiles"
        )
        checks.append(Check(name, True, detail, hint, "GPU runtime"))
    return checks


def check_kernel_probe(device) -> list[Check]:
    """The load-time probe run here (`pipeline.runtime.probe`): whether each kernel the rows name runs on
    this GPU, driver, torch and Triton, or the error that sends its format to the row's fallback at load."""
    from pipeline.errors import error_line
    from pipeline.runtime.probe import probe

    hint = "loads take the row's fallback for it; report the GPU, driver, torch and Triton versions"
    try:
        probed = probe(device)
    except Exception as e:  # the probe itself could not run: say so, the other checks still print
        return [Check("kernel probe", False, error_line(e), hint, "GPU runtime")]
    return [
        Check(
            f"kernel {name}", err is None, "ran on tiny operands" if err is None else err, hint, "GPU runtime"
        )
        for name, err in probed.results.items()
    ]


def run_checks() -> list[Check]:
    return [
        check_python(),
        *check_torch(),
        *check_tensor_cores(),
        check_nvcc(),
        check_ninja(),
        *check_engine_build(),
        check_module("modelopt", "nvidia-modelopt", "pip install 'dgpipe[quantize]'", "quantize"),
        check_module("onnx", "onnx", "pip install 'dgpipe[engine]'", "ONNX export"),
        check_module("onnxruntime", "onnxruntime", "pip install 'dgpipe[engine]'", "ONNX verification"),
        check_module("tritonclient", "tritonclient", "pip install 'dgpipe[serve]'", "clients, bench serve"),
        check_tritonserver(),
        check_kubectl(),
    ]


def as_json(checks: list[Check]) -> list[dict]:
    return [asdict(c) for c in checks]
