"""tests/conftest.py imports this for every test (it matters under TRITON_INTERPRET=1): triton 3.6's interpreter
converts a scalar argument to an int with int() of a one-element array, which numpy >= 2.4 refuses (a loop bound
passed at run time then fails); this makes it take the element. Only the interpreter is touched."""
from __future__ import annotations

import os

try:
    import triton.runtime.interpreter as _ti
except ImportError:   # no Triton: nothing to patch
    _ti = None

if _ti is not None and os.environ.get("TRITON_INTERPRET") == "1" and not getattr(_ti, "_mpk_index_patch", False):
    _orig = _ti._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _ti._patch_lang_tensor = _patch_lang_tensor
    _ti._mpk_index_patch = True
