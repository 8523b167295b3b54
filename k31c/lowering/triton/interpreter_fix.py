"""Triton 3.6's interpreter under NumPy >= 2.4: a scalar Triton value used as a Python integer
(`range(lo, hi)` over loaded bounds, an index) is a one-element array, and its `__index__` does
`int(array)`, which NumPy 2.4 refuses for arrays that are not 0-d. Triton 3.7 squeezes the
array first; `install` gives 3.6's interpreter the same `__index__` (torch 2.11 pins Triton
3.6, and `TRITON_INTERPRET=1` runs a GPU target's program on CPU tensors). Other versions are
left alone."""
from __future__ import annotations

import triton


def install() -> bool:
    """Patch Triton 3.6's interpreter once; True when patched (now or before)."""
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) != (3, 6):
        return False
    from triton.runtime import interpreter as ti
    patch_tensor = getattr(ti, "_patch_lang_tensor", None)
    if patch_tensor is None:
        return False
    if getattr(patch_tensor, "_k31c_index_fix", False):
        return True

    def patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor._k31c_index_fix = True
    ti._patch_lang_tensor = patch_lang_tensor     # `_patch_lang` looks it up at every launch
    return True
