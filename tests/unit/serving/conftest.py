"""Fixtures shared by the serving tests."""

from __future__ import annotations

import pytest

from tests._utils.triton_stub import triton_model


@pytest.fixture
def model(monkeypatch):
    """The Triton model as tritonserver loads it, over the stand-in stub (tests/_utils/triton_stub.py)."""
    return triton_model(monkeypatch)
