"""TensorRT's real `tensorrt.plugin` package over a minimal stand-in for the native `tensorrt` module.

The `tensorrt-cu13-bindings` wheel (test extra) ships `tensorrt_bindings/plugin/*.py`: the pure-Python
code TensorRT itself runs to register Python plugins and to validate the decorated functions
(`_validate.py`: argument kinds, annotations, attribute types, the aot_impl return schema ...) and to drive
them as IPluginV3 objects (`_plugin_class.py`: output types, symbolic output shapes, AOT launch
parameters, kernel lookup). Only its package `__init__` needs the C extension (`tensorrt.so`, which
loads libnvinfer: absent here). `real_plugin_package()` therefore imports the real `plugin` package as `tensorrt.plugin`
under a `tensorrt` module that holds only the native objects that package touches, listed below and
nothing else: an attribute it does not define raises AttributeError, so a new use of the native API shows
up as a failing test instead of a silently faked behaviour.

The stand-ins mirror the pybind11 objects' behaviour that the Python layer depends on: enum members,
plugin field containers, the creator registry, and `IDimensionExpr` / `IExprBuilder` (constant folding;
a dimension without a constant value stays symbolic, as a dynamic dimension does in the builder).
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def bindings_dir() -> Path | None:
    """The installed `tensorrt_bindings` package folder (found without importing it), or None."""
    spec = importlib.util.find_spec("tensorrt_bindings")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)))
    return path if (path / "plugin" / "_validate.py").is_file() else None


class DataType(enum.Enum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8
    INT4 = 9
    FP4 = 10


class TensorFormat(enum.Enum):
    LINEAR = 0


class PluginFieldType(enum.Enum):
    FLOAT16 = 0
    FLOAT32 = 1
    FLOAT64 = 2
    INT8 = 3
    INT16 = 4
    INT32 = 5
    CHAR = 6
    DIMS = 7
    UNKNOWN = 8
    BF16 = 9
    INT64 = 10
    FP8 = 11
    INT4 = 12
    FP4 = 13


class TensorRTPhase(enum.Enum):
    BUILD = 0
    RUNTIME = 1


class QuickPluginCreationRequest(enum.Enum):  # its presence is how tensorrt.plugin detects AOT support
    UNKNOWN = 0
    PREFER_JIT = 1
    PREFER_AOT = 2
    STRICT_JIT = 3
    STRICT_AOT = 4


class PluginArgType(enum.Enum):
    INT = 0


class PluginArgDataType(enum.Enum):
    INT8 = 0
    INT16 = 1
    INT32 = 2


class DimensionOperation(enum.Enum):
    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    SUB = 4
    EQUAL = 5
    LESS = 6
    FLOOR_DIV = 7
    CEIL_DIV = 8


_FOLD = {
    DimensionOperation.SUM: lambda a, b: a + b,
    DimensionOperation.PROD: lambda a, b: a * b,
    DimensionOperation.MAX: max,
    DimensionOperation.MIN: min,
    DimensionOperation.SUB: lambda a, b: a - b,
    DimensionOperation.EQUAL: lambda a, b: int(a == b),
    DimensionOperation.LESS: lambda a, b: int(a < b),
    DimensionOperation.FLOOR_DIV: lambda a, b: a // b,
    DimensionOperation.CEIL_DIV: lambda a, b: -(-a // b),
}


class IDimensionExpr:
    """A dimension expression: a build-time constant, or symbolic (value None) like a dynamic dim."""

    def __init__(self, value: int | None) -> None:
        self.value = value

    def is_constant(self) -> bool:
        return self.value is not None

    def get_constant_value(self) -> int:
        assert self.value is not None, "get_constant_value on a non-constant IDimensionExpr"
        return self.value

    def is_size_tensor(self) -> bool:
        return False


class IExprBuilder:
    def constant(self, value: int) -> IDimensionExpr:
        return IDimensionExpr(value)

    def operation(self, op: DimensionOperation, a: IDimensionExpr, b: IDimensionExpr) -> IDimensionExpr:
        if a.value is None or b.value is None:
            return IDimensionExpr(None)
        return IDimensionExpr(_FOLD[op](a.value, b.value))


class Dims(tuple):
    MAX_DIMS = 8

    def __new__(cls, shape: int | tuple = ()) -> Dims:
        return super().__new__(cls, (-1,) * shape if isinstance(shape, int) else shape)


class DimsExprs(list):
    def __init__(self, n: int) -> None:
        super().__init__([None] * n)


class PluginTensorDesc:
    def __init__(self, dims: tuple = (), type: DataType = DataType.FLOAT) -> None:
        self.dims, self.type, self.format, self.scale = Dims(dims), type, TensorFormat.LINEAR, 1.0


class DynamicPluginTensorDesc:
    def __init__(self, desc: PluginTensorDesc) -> None:
        self.desc, self.min, self.opt, self.max = desc, desc.dims, desc.dims, desc.dims


class PluginField:
    def __init__(self, name: str, data: Any = None, type: PluginFieldType = PluginFieldType.UNKNOWN):
        self.name, self.data, self.type = name, data, type


class PluginFieldCollection(list):
    pass


class _Interface:  # the pybind11 trampolines' Python side: subclassed and __init__-ed, nothing more
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class IPluginV3(_Interface): ...


class IPluginV3QuickCore(_Interface): ...


class IPluginV3QuickBuild(_Interface): ...


class IPluginV3QuickRuntime(_Interface): ...


class IPluginV3QuickAOTBuild(_Interface): ...


class IPluginCreatorV3Quick(_Interface): ...


class ISymExpr(_Interface): ...


class ITensor: ...


class Logger:
    WARNING = "WARNING"

    def log(self, severity: str, message: str) -> None:
        pass


class PluginRegistry:
    def __init__(self) -> None:
        self.creators: dict[tuple[str, str, str], Any] = {}

    def register_creator(self, creator: Any, namespace: str) -> bool:
        key = (creator.name, creator.plugin_version, namespace)
        if key in self.creators:  # TensorRT refuses a second creator under one name/version/namespace
            return False
        self.creators[key] = creator
        return True

    def get_creator(self, name: str, version: str, namespace: str = "") -> Any:
        return self.creators.get((name, version, namespace))


def _native_module(package_dir: Path) -> types.ModuleType:
    trt = types.ModuleType("tensorrt")
    trt.__path__ = [str(package_dir)]  # `import tensorrt.plugin` finds the wheel's real plugin/ package
    trt.__version__ = "stand-in"
    for obj in (
        DataType, TensorFormat, PluginFieldType, TensorRTPhase, QuickPluginCreationRequest, PluginArgType,
        PluginArgDataType, DimensionOperation, IDimensionExpr, IExprBuilder, Dims, DimsExprs,
        PluginTensorDesc, DynamicPluginTensorDesc, PluginField, PluginFieldCollection, IPluginV3,
        IPluginV3QuickCore, IPluginV3QuickBuild, IPluginV3QuickRuntime, IPluginV3QuickAOTBuild,
        IPluginCreatorV3Quick, ISymExpr, ITensor, Logger,
    ):  # fmt: skip
        setattr(trt, obj.__name__, obj)
    aliases = {"float32": "FLOAT", "float16": "HALF", "bfloat16": "BF16", "int8": "INT8", "int32": "INT32",
               "int64": "INT64", "bool": "BOOL", "uint8": "UINT8", "fp8": "FP8", "int4": "INT4", "fp4": "FP4"}  # fmt: skip
    for alias, member in aliases.items():
        setattr(trt, alias, DataType[member])
    registry = PluginRegistry()
    trt.get_plugin_registry = lambda: registry
    return trt


@contextmanager
def real_plugin_package() -> Iterator[tuple[types.ModuleType, types.ModuleType]]:
    """(tensorrt stand-in, the wheel's real tensorrt.plugin) installed in sys.modules for the duration,
    fresh each time (the package keeps its registry in module globals); the previous modules come back
    afterwards."""
    package_dir = bindings_dir()
    if package_dir is None:
        raise ModuleNotFoundError("tensorrt_bindings (pip install 'tensorrt-cu13-bindings', the test extra)")
    saved = {k: v for k, v in sys.modules.items() if k == "tensorrt" or k.startswith("tensorrt.")}
    for k in saved:
        del sys.modules[k]
    trt = _native_module(package_dir)
    sys.modules["tensorrt"] = trt
    # _utils._is_npt_ndarray reads np.typing without importing it (in a TensorRT install another import
    # has loaded it by then); create_plugin on a plugin with attributes needs it
    importlib.import_module("numpy.typing")
    try:
        trtp = importlib.import_module("tensorrt.plugin")
        trt.plugin = trtp
        yield trt, trtp
    finally:
        for k in [k for k in sys.modules if k == "tensorrt" or k.startswith("tensorrt.")]:
            del sys.modules[k]
        sys.modules.update(saved)


class _LaunchParams:  # the native launch-parameter struct get_launch_params fills in
    grid_x = grid_y = grid_z = block_x = block_y = block_z = shared_mem = None


class _SymExprSetter(dict):  # the native extra-argument setter: nbSymExprs, then one expression per index
    nbSymExprs = 0


def _value(sym: Any) -> int | None:
    """A SymExprImpl's folded value (None: symbolic, i.e. known at run time only)."""
    return sym.expr.value if sym.expr is not None else None


def build_time_call(
    trt: types.ModuleType,
    plugin_id: str,
    inputs: list[tuple[tuple[int | None, ...], Any]],
    attrs: dict[str, Any] | None = None,
    tactic: int = 0,
) -> dict[str, Any]:
    """Walk a registered AOT plugin through the calls TensorRT's builder makes, in its order, on the wheel's
    own plugin classes: creator lookup, create_plugin (STRICT_AOT) from plugin fields, output data types,
    symbolic output shapes, format combinations, tactic, launch parameters and extra arguments, kernel.

    `inputs`: (dims, DataType) per input; a None dim is dynamic (symbolic). Returns what TensorRT would
    receive: output dtypes and dims (None where symbolic), kernel name, PTX, launch geometry, extras."""
    import numpy as np

    ns, name = plugin_id.split("::")
    creator = trt.get_plugin_registry().get_creator(name, "1", ns)
    assert creator is not None, f"{plugin_id} is not in the plugin registry"
    fields = []
    for key, value in (attrs or {}).items():
        kind = {int: PluginFieldType.INT64, float: PluginFieldType.FLOAT64, bool: PluginFieldType.INT8}
        fields.append(PluginField(key, np.array([value]), kind[type(value)]))
    plugin = creator.create_plugin(
        name, ns, PluginFieldCollection(fields), TensorRTPhase.BUILD, QuickPluginCreationRequest.STRICT_AOT
    )
    out_types = plugin.get_output_data_types([t for _, t in inputs], [len(d) for d, _ in inputs])
    builder = IExprBuilder()
    in_exprs = [[IDimensionExpr(v) for v in dims] for dims, _ in inputs]
    out_exprs = plugin.get_output_shapes(in_exprs, [], builder)
    out_dims = [tuple(e.value for e in exprs) for exprs in out_exprs]
    concrete = lambda dims: tuple(-1 if v is None else v for v in dims)
    in_out = [DynamicPluginTensorDesc(PluginTensorDesc(concrete(d), t)) for d, t in inputs]
    in_out += [DynamicPluginTensorDesc(PluginTensorDesc(concrete(d), t)) for d, t in zip(out_dims, out_types)]
    combos = plugin.get_supported_format_combinations(in_out, len(inputs))
    plugin.configure_plugin(in_out[: len(inputs)], in_out[len(inputs) :])
    plugin.set_tactic(tactic)
    launch, extras = _LaunchParams(), _SymExprSetter()
    plugin.get_launch_params(in_exprs, in_out, len(inputs), launch, extras, builder)
    kernel, ptx = plugin.get_kernel(
        [d.desc for d in in_out[: len(inputs)]], [d.desc for d in in_out[len(inputs) :]]
    )
    geometry = {
        k: _value(getattr(launch, k))
        for k in ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared_mem")
    }
    return {
        "plugin": plugin,
        "output_types": list(out_types),
        "output_dims": out_dims,
        "combinations": [(c.type, c.format) for c in combos],
        "kernel": kernel,
        "ptx": ptx,
        "launch": geometry,
        "extras": [_value(extras[i]) for i in range(extras.nbSymExprs)],
    }
