"""Make Triton's CPU interpreter (TRITON_INTERPRET=1) usable with numpy >= 2.3: import this module
before launching a kernel under the interpreter.

Why: the interpreter holds every scalar as a 1-element numpy array and converts it for Python's
`range` with `int(array)`, which numpy 2.3+ refuses for arrays of ndim > 0 ("only 0-dimensional
arrays can be converted to Python scalars"), so any kernel loop with a runtime bound
(`for j0 in range(0, hi, BLOCK_N)`) fails (seen with triton 3.6 and numpy 2.4). The shim adds,
after the interpreter's own per-launch patch of `tl.tensor`, an `__index__` that takes the single
element with `.item()`; the interpreter's patch scope restores both on exit (last in, first out).
Changes nothing else and nothing outside the interpreter. Does not: touch compiled (GPU) runs.
"""

from __future__ import annotations

import triton.runtime.interpreter as _interp

_original = _interp._patch_lang_tensor


def _patch_lang_tensor(tensor, scope) -> None:
    _original(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


if getattr(_interp._patch_lang_tensor, "__module__", None) != __name__:
    _interp._patch_lang_tensor = _patch_lang_tensor
