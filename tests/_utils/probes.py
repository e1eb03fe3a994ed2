"""Load-time probes held to what they must reject: each wrong form of a kernel, installed in its place, fails
the probe with its DgpipeError."""

from __future__ import annotations

from collections.abc import Callable
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
