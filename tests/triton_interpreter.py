"""Two speed-ups of Triton's interpreter (TRITON_INTERPRET=1) for the test suite.

1. A @triton.jit helper called inside a kernel launch does not patch triton.language again.

Triton 3.6-3.8's interpreter patches the language modules once per launch (GridExecutor) and
again at every device-function call (InterpretedFunction.__call__), when they are already
patched; each re-patch walks tl, tl.tensor and tl.math with inspect.getmembers (~0.5 ms), and a
compiled tiny-model step makes tens of thousands of helper calls. The re-patch changes nothing
(the members it looks for are already replaced, and the launch's own patch is what gets
restored), so it is skipped when the helper's language modules are those the launch patched.
Anything that does not look like those versions' interpreter is left alone.

2. Integer adds, subtracts and multiplies are not checked for overflow (each check is four more
interpreted operations; about half of the KDA prep kernel's time). The compiled kernels do not
check either (no debug build), the CPU tests' shapes are far from the int32 range, and the GPU
tests run the real shapes. K31C_INTERPRETER_OVERFLOW_CHECKS=1 keeps the checks."""
import dataclasses
import inspect
import os
import threading


def install() -> bool:
    """Install once; True when the interpreter is patched."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    if getattr(ti, "_k31c_skip_repatch", False):
        return True
    patch_lang = getattr(ti, "_patch_lang", None)
    grid = getattr(ti, "GridExecutor", None)
    scope_type = getattr(ti, "_LangPatchScope", None)
    if patch_lang is None or grid is None or scope_type is None or not hasattr(scope_type(), "restore"):
        return False
    launch_call = grid.__call__
    state = threading.local()

    def langs(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values()
                         if inspect.ismodule(v) and (v is tl or v is tl.core))

    def patch_once(fn):
        patched = getattr(state, "patched", None)
        if patched is None:                       # not inside a launch
            return patch_lang(fn)
        mine = langs(fn)
        if mine and mine <= patched:
            return scope_type()                   # nothing to change, nothing to restore
        scope = patch_lang(fn)
        state.patched = patched | mine
        return scope

    def launch(self, *args, **kwargs):
        outer = getattr(state, "patched", None)
        state.patched = frozenset()               # the launch's own patch goes through
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            state.patched = outer

    ti._patch_lang = patch_once
    grid.__call__ = launch
    ti._k31c_skip_repatch = True
    builder = getattr(ti, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    checks = os.environ.get("K31C_INTERPRETER_OVERFLOW_CHECKS") == "1"
    if dataclasses.is_dataclass(options) and hasattr(options, "sanitize_overflow") and not checks:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True
