"""trainwell: Keras 3 / TensorFlow training recipes built from restart-safe callbacks.

This module is the package's public facade and imports nothing heavy: submodules and
`lr_find` load on first use (`trainwell.runtime`, `trainwell.lr_find`), so
`import trainwell` does not import TensorFlow. No module of the package imports a
name from here (see docs/architecture.md).

Example:
>>> from trainwell import runtime
>>> runtime.resolve_precision("float32")
'float32'
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the same name for editors and static analysis, which never run `__getattr__`
    from trainwell.callbacks.lr_finder import lr_find

# TensorFlow's C++ INFO lines (oneDNN, CUDA stubs) drown Keras's progress bars; a
# user who wants them sets TF_CPP_MIN_LOG_LEVEL=0 before importing trainwell.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

__version__ = "0.1.0"

_SUBMODULES = (
    "config", "io", "runtime", "rundir", "validation", "data", "models", "optimizers", "losses", "compat", "quick",  # floor 0
    "callbacks", "recipes",  # floors 1 and 2
    "tuning", "launch", "cli",  # floor 3
)
_LAZY_FUNCS = {"lr_find": "trainwell.callbacks.lr_finder"}

__all__ = [*_SUBMODULES, *_LAZY_FUNCS]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"trainwell.{name}")
    if name in _LAZY_FUNCS:
        return getattr(importlib.import_module(_LAZY_FUNCS[name]), name)
    raise AttributeError(f"module 'trainwell' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
