"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def real_trtp(monkeypatch: pytest.MonkeyPatch):
    """plugin.py registered through the `tensorrt-cu13-bindings` wheel's real `tensorrt.plugin` package
    (validation in its _validate.py, IPluginV3 behaviour in its _plugin_class.py); only the native module is
    a stand-in (tests/_utils/trt_native.py). Yields (tensorrt stand-in, tensorrt.plugin)."""
    from pipeline.engine import plugin
    from tests._utils.trt_native import real_plugin_package

    with real_plugin_package() as (trt, trtp):
        monkeypatch.setitem(plugin._STATE, "registered", False)
        plugin.register(b"// ptx", "sm_90a")
        yield trt, trtp
