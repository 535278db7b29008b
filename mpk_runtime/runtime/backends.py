"""Imports the modules that register runner backends (`make_runner` imports this module first).

The reference, pyvm and torch backends are part of the package (a broken import of theirs fails loudly). The
megakernel backend's module imports where its dependencies (CUDA bindings) may be absent; if it fails, its backend is
not registered, `make_runner` lists the backends that are, and `import_errors()` says why.
"""
from __future__ import annotations

import importlib

from . import reference_runner  # noqa: F401  ("reference": the pure-torch oracle, world_size 1)

# name of module -> why it might be absent (kept for `import_errors()` so a user can see what failed)
_OPTIONAL = ("megakernel_runner",)
_IMPORT_ERRORS: dict[str, str] = {}

from . import pyvm_runner  # noqa: F401,E402  ("pyvm" and "torch": part of the package; a broken import must fail)

for _mod in _OPTIONAL:
    try:
        importlib.import_module(f"{__package__}.{_mod}")
    except ImportError as e:  # not written yet, or a dependency (CUDA, nvshmem) is missing here
        _IMPORT_ERRORS[_mod] = f"{type(e).__name__}: {e}"


def import_errors() -> dict[str, str]:
    """Optional backend modules that did not import, with the reason (for error messages and `--help`)."""
    return dict(_IMPORT_ERRORS)
