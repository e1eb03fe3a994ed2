"""Load-time probes held to what they must reject: each wrong form of a kernel, installed in its place, fails
the probe with its DgpipeError."""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from pipeline.errors import DgpipeError


def each_wrong_form_fails(
    monkeypatch: pytest.MonkeyPatch,
    module: ModuleType,
    name: str,
    wrong: dict[str, Callable],
    check: Callable[[], None],
    match: str,
) -> None:
    """`check` (a probe) raises a DgpipeError matching `match` with each of `wrong`'s forms as `module.name`."""
    for label, form in wrong.items():
        with monkeypatch.context() as mp:
            mp.setattr(module, name, form)
            with pytest.raises(DgpipeError, match=match):
                check()
                pytest.fail(f"passed: {label}")


def kernel_variant(module: ModuleType, replacements: list[tuple[str, str]], where: Path) -> ModuleType:
    """A copy of `module` (a file of Triton kernels) with each (old, new) text replaced, written under `where`
    and imported: a kernel wrong in one place, compiled by Triton as the real one is (its interpreter reads
    a kernel's source from its file). Each `old` must occur exactly once."""
    source = Path(inspect.getsourcefile(module)).read_text()
    for old, new in replacements:
        assert source.count(old) == 1, f"{old!r} occurs {source.count(old)} times in {module.__name__}"
        source = source.replace(old, new)
    path = where / f"wrong_{module.__name__.rsplit('.', 1)[-1]}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"{module.__name__}_wrong", path)
    variant = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(variant)
    return variant
