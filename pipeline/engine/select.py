"""Which runtime the Triton model uses: the TensorRT plan for this GPU, or the PyTorch model.

A pure function of what the repository holds, the GPU's compute capability and the TensorRT version, so
it is tested without either. The repository may hold plans for several targets (engines/sm90, sm100,
...): the one whose manifest names this GPU's compute capability is taken, the way Triton's
`cc_model_filenames` maps plans per GPU for its TensorRT backend. A plan that exists but cannot be used
(other TensorRT, other GPU, no TensorRT in the image, optimization profiles smaller than what the server
admits) falls back to PyTorch with `loud=True`: the server still comes up, and the log says, as an error,
that the engine was skipped and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipeline.builddir import ENGINES_DIR
from pipeline.engine.plan_record import ENGINE_MANIFEST, PLAN_NAME, check_compatible, load_engine_manifest
from pipeline.errors import DgpipeError
from pipeline.limits import Limits, flag


@dataclass(frozen=True)
class BackendChoice:
    kind: Literal["tensorrt", "pytorch"]
    reason: str
    engine_dir: Path | None = None
    loud: bool = False  # an engine was there and was NOT used: log at error level


def engine_dirs(root: Path) -> list[Path]:
    """Directories under `root` (or `root/engines`) holding an engine manifest, sorted by name."""
    if (root / ENGINE_MANIFEST).is_file():
        return [root]
    base = root / ENGINES_DIR if (root / ENGINES_DIR).is_dir() else root
    if not base.is_dir():
        return []
    return sorted(d for d in base.iterdir() if d.is_dir() and (d / ENGINE_MANIFEST).is_file())


def find_engine_dir(root: Path, gpu_cc: str | None) -> Path:
    """The engine dir for this GPU (or the only one) under `root`; a clear error otherwise."""
    dirs = engine_dirs(Path(root))
    if not dirs:
        raise DgpipeError(f"{root}: no engine (engines/<target>/{ENGINE_MANIFEST})")
    if len(dirs) == 1:
        return dirs[0]
    for d in dirs:
        if load_engine_manifest(d).compute_capability == gpu_cc:
            return d
    ccs = ", ".join(f"{d.name}: {load_engine_manifest(d).compute_capability}" for d in dirs)
    raise DgpipeError(f"{root}: no engine for compute capability {gpu_cc} ({ccs})")


def choose_backend(
    version_dir: Path, gpu_cc: str | None, tensorrt_version: str | None, admits: dict[str, int] | None = None
) -> BackendChoice:
    """`admits`: the engine caps (Limits.ENGINE_FIELDS) the server will run passes for; a plan built for
    less would fail those requests mid-generation ("outside the optimization profile"), so it is skipped."""
    dirs = engine_dirs(Path(version_dir))
    if not dirs:
        return BackendChoice("pytorch", "the repository holds no TensorRT engine")
    if gpu_cc is None:
        return BackendChoice("pytorch", "TensorRT engines present but no GPU is visible", loud=True)
    manifests = {d: load_engine_manifest(d) for d in dirs}
    match = [d for d, m in manifests.items() if m.compute_capability == gpu_cc]
    if not match:
        have = ", ".join(f"{d.name} (cc {m.compute_capability})" for d, m in manifests.items())
        return BackendChoice(
            "pytorch",
            f"no engine for this GPU's compute capability {gpu_cc}; the repository has {have}",
            loud=True,
        )
    d = match[0]
    m = manifests[d]
    if not (d / m.plan).is_file():
        return BackendChoice("pytorch", f"{d / m.plan} is missing", loud=True)
    try:
        check_compatible(m, tensorrt_version, gpu_cc, where=str(d / PLAN_NAME))
    except DgpipeError as e:
        return BackendChoice("pytorch", f"engine skipped: {e}", loud=True)
    caps = Limits.from_record(m.limits, str(d / ENGINE_MANIFEST))
    over = [f"{flag(k)} {v} > {getattr(caps, k)}" for k, v in (admits or {}).items() if v > getattr(caps, k)]
    if over:
        return BackendChoice(
            "pytorch",
            f"engine skipped: {d / PLAN_NAME} was built for less than this server admits ({', '.join(over)}): "
            "rebuild it with these limits (dgpipe engine build), or lower them in config.pbtxt",
            loud=True,
        )
    return BackendChoice(
        "tensorrt",
        f"{d.name} plan (TensorRT {m.tensorrt_version}, cc {m.compute_capability}, {m.precision})",
        engine_dir=d,
    )
