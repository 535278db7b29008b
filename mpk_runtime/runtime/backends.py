"""Imports the modules that register runner backends (`make_runner` imports this module first).

The reference backend always exists. The others are written in parallel and may be missing from a checkout
(or fail to import where their dependencies are absent); a missing module just means its backend is not
registered, and `make_runner` then lists the backends that are.
"""
from __future__ import annotations

import importlib

from . import reference_runner  # noqa: F401  ("reference": the pure-torch oracle, world_size 1)

# name of module -> why it might be absent (kept for `import_errors()` so a user can see what failed)
_OPTIONAL = ("pyvm_runner", "torch_runner", "megakernel_runner")
_IMPORT_ERRORS: dict[str, str] = {}

for _mod in _OPTIONAL:
    try:
        importlib.import_module(f"{__package__}.{_mod}")
    except ImportError as e:  # not written yet, or a dependency (CUDA, nvshmem) is missing here
        _IMPORT_ERRORS[_mod] = f"{type(e).__name__}: {e}"


def import_errors() -> dict[str, str]:
    """Optional backend modules that did not import, with the reason (for error messages and `--help`)."""
    return dict(_IMPORT_ERRORS)
