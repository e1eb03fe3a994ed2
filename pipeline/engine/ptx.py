"""Per-target PTX of the plugin kernels, as the TensorRT AOT plugins embed it: `plugins/<target>/`.

One translation unit (pipeline/engine/kernels/csrc/dg_plugins.cu) holds the sampler kernels and the routed
experts' kernels, so one PTX file (still named dg_sampler.ptx, which build dirs and manifests already
reference) and one hash identify every kernel an engine embeds.

An AOT plugin hands TensorRT PTX text, which the engine stores and the runtime loads, so the PTX is part of
the engine's identity: `plugin.json` beside it records the architecture, the entry points and the sha256
that the engine manifest copies (a plan built from other kernels is stale). Compiling needs only nvcc, so
a CPU machine prepares this for every target and the GPU node only builds the engine.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from pathlib import Path

from pydantic import BaseModel

from pipeline.engine import moe_spec
from pipeline.engine.kernels import CSRC as ENGINE_CSRC
from pipeline.engine.kernels import PLUGINS_SOURCE
from pipeline.engine.plugin_spec import ACCEPT_KERNEL, rows_kernel
from pipeline.errors import DgpipeError
from pipeline.sampler.kernels import build
from pipeline.targets import target as get_target

PTX_NAME = "dg_sampler.ptx"
INFO_NAME = "plugin.json"
# every entry point an AOT plugin may pick (rows_kernel for both dtypes and vector widths, and kernel B)
SAMPLER_ENTRY_POINTS = tuple(
    sorted({rows_kernel(d, v) for d in ("float32", "bfloat16") for v in (None, 8)} | {ACCEPT_KERNEL})
)
ENTRY_POINTS = tuple(sorted((*SAMPLER_ENTRY_POINTS, *moe_spec.ENTRY_POINTS)))


class PluginPtx(BaseModel):
    """What `plugin.json` records about one target's PTX."""

    target: str  # e.g. sm90
    arch: str  # the PTX .target, e.g. sm_90a
    file: str = PTX_NAME
    sha256: str
    entry_points: list[str]
    nvcc_flags: list[str]
    source_sha256: str = ""  # the kernel sources it was compiled from: an unchanged source is not recompiled

    def path(self, plugin_dir: Path) -> Path:
        return plugin_dir / self.file


def ptx_entries(text: str) -> list[str]:
    return re.findall(r"^\s*\.(?:visible\s+)?\.entry\s+(\w+)\s*\(", text, re.MULTILINE)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def source_sha256() -> str:
    """The kernel sources and flags the PTX depends on."""
    h = hashlib.sha256(" ".join(build.NVCC_FLAGS).encode())
    for f in sorted([*build.CSRC.glob("*.cu*"), *ENGINE_CSRC.glob("*.cu*")]):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def build_plugin_ptx(plugins_root: Path | str, target_name: str) -> PluginPtx:
    """Compile the sampler to PTX for `target_name` into `plugins_root/<target>/` (replaced atomically);
    kept as is when it was compiled from the same sources (re-running a build stage is then instant)."""
    t = get_target(target_name)
    existing = Path(plugins_root) / t.name
    if (existing / INFO_NAME).is_file():
        try:
            info, _ = load_plugin_ptx(existing, t.name)
            if info.source_sha256 == source_sha256():
                return info
        except DgpipeError:
            pass  # damaged or stale: recompile
    nvcc = build.find_nvcc()
    if nvcc is None:
        raise DgpipeError(
            f"nvcc not found: cannot compile the sampler plugin's PTX for {t.name} ({t.arch})",
            hint="install the CUDA toolkit (>= 12.8 for sm_100a/sm_120a) or put nvcc on PATH",
        )
    root = Path(plugins_root)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{t.name}.", dir=root) as tmp:
        compiled = build.compile_arch(t.arch, tmp, "ptx", source=PLUGINS_SOURCE, nvcc=nvcc)
        text = compiled.read_text()
        found = ptx_entries(text)
        missing = [e for e in ENTRY_POINTS if e not in found]
        if missing:
            raise DgpipeError(f"the {t.arch} PTX lacks the plugin entry points {missing}")
        if build.ptx_target(compiled) != t.arch:
            raise DgpipeError(f"the PTX targets {build.ptx_target(compiled)}, not {t.arch}")
        info = PluginPtx(
            target=t.name,
            arch=t.arch,
            sha256=sha256_bytes(text.encode()),
            entry_points=sorted(found),
            nvcc_flags=[*build.NVCC_FLAGS, f"-arch=compute_{t.arch[3:]}", "-ptx"],
            source_sha256=source_sha256(),
        )
        stage = Path(tmp) / "out"
        stage.mkdir()
        compiled.rename(stage / PTX_NAME)
        (stage / INFO_NAME).write_text(info.model_dump_json(indent=2) + "\n")
        dest = root / t.name
        old = root / f".{t.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        if dest.exists():
            dest.rename(old)
        stage.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
    return info


def load_plugin_ptx(plugin_dir: Path | str, target_name: str | None = None) -> tuple[PluginPtx, bytes]:
    """Read and verify one target's PTX: present, hash as recorded, for the expected target."""
    d = Path(plugin_dir)
    info_file = d / INFO_NAME
    if not info_file.is_file():
        raise DgpipeError(
            f"{d}: no sampler plugin PTX ({INFO_NAME} missing)",
            hint="run `dgpipe build` or `python -m pipeline.engine.ptx --target <t> --out plugins` first",
        )
    info = PluginPtx.model_validate(json.loads(info_file.read_text()))
    if target_name is not None and info.target != get_target(target_name).name:
        raise DgpipeError(f"{d}: the plugin PTX is for {info.target}, not {target_name}")
    data = info.path(d).read_bytes()
    if sha256_bytes(data) != info.sha256:
        raise DgpipeError(
            f"{info.path(d)}: sha256 differs from {INFO_NAME}: the PTX was modified or truncated"
        )
    return info, data


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(description="Compile the sampler plugin PTX for GPU targets.")
    parser.add_argument("--target", action="append", required=True, help="sm90, sm100, sm120 (repeatable)")
    parser.add_argument("--out", type=Path, required=True, help="plugins directory")
    args = parser.parse_args(argv)
    try:
        for t in args.target:
            info = build_plugin_ptx(args.out, t)
            print(f"{info.target:>6} {info.arch:<8} {info.sha256[:16]}  {args.out / info.target / info.file}")
    except DgpipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
