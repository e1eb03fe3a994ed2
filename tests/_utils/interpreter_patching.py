"""Triton's interpreter without two of its per-program overheads, neither of which changes what a kernel computes.

Without a GPU the kernel tests run dgpipe's Triton kernels in Triton's interpreter (tests/conftest.py), which
runs every program of a grid in Python; two pieces of its bookkeeping (Triton 3.6-3.9,
`triton/runtime/interpreter.py`) cost about a third of that time:

- It patches `triton.language` when a kernel is launched (`GridExecutor.__call__`: `_patch_lang`, undone when
  the launch ends) and again, in full, at every call of a `@triton.jit` helper inside the kernel
  (`InterpretedFunction.__call__`), for every program. That second patching finds every builtin already
  replaced by the launch's (it replaces the members that are still builtins) and so changes nothing, at the
  cost of five `inspect.getmembers` walks. Here a helper's call skips it where the running launch has
  patched every language module the helper's globals name; a helper that names another is patched as before.
- `_get_np_dtype` (the numpy dtype of a Triton dtype, on every cast and load) builds a 20-entry dict on every
  call; here its answer is kept per dtype name (a block type's is its element type's, a pointer's uint64,
  as there).

Measured in CPU seconds on a 2-core box, the gated GeLU's NVFP4 kernel (33 x 2,112) and the norm to NVFP4
(2 x 16, a 128-row tile): 2.6 and 3.5 s as Triton runs them, 1.6 and 2.1 s with both removed, the same bytes
out. Under another Triton (or where its internals are not as described) nothing is changed."""

from __future__ import annotations

import inspect
import threading


def remove_interpreter_overheads() -> None:
    try:
        import numpy as np
        import triton
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    if not (3, 6) <= tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 10):
        return  # the interpreter read for these versions only: re-read it before widening the range
    executor = getattr(interpreter, "GridExecutor", None)
    patch, np_dtype = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_get_np_dtype", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    if None in (executor, patch, np_dtype, scope) or getattr(patch, "_dgpipe", False):
        return
    launch, state, langs_of, dtypes = executor.__call__, threading.local(), {}, {}

    def langs(fn) -> frozenset[int]:
        if fn not in langs_of:  # (the function held: an id could be reused by another one)
            langs_of[fn] = frozenset(
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)
            )
        return langs_of[fn]

    def patch_lang(fn):
        stack = getattr(state, "stack", None)
        names = langs(fn)
        if stack and names <= stack[-1]:  # a helper inside a launch that patched its languages already
            return scope()
        patched = patch(fn)
        if stack:
            stack[-1] |= names
        return patched

    def call(self, *args, **kwargs):
        if getattr(state, "stack", None) is None:
            state.stack = []
        state.stack.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            state.stack.pop()

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return np.dtype(np.uint64)
        name = tt_dtype.name
        if name not in dtypes:
            dtypes[name] = np_dtype(tt_dtype)
        return dtypes[name]

    patch_lang._dgpipe = True
    interpreter._patch_lang, interpreter._get_np_dtype, executor.__call__ = patch_lang, get_np_dtype, call
