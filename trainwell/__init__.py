"""trainwell: Keras 3 / TensorFlow training recipes built from restart-safe callbacks.

Example:
>>> from trainwell import runtime
>>> runtime.resolve_precision("float32")
'float32'
"""

from __future__ import annotations

import importlib
import os

# TensorFlow's C++ INFO lines (oneDNN, CUDA stubs) drown Keras's progress bars; a
# user who wants them sets TF_CPP_MIN_LOG_LEVEL=0 before importing trainwell.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

__version__ = "0.1.0"

_SUBMODULES = ("runtime", "config", "data", "models", "optimizers", "io", "recipe", "tuning", "cli", "diagnostics", "keras_fixes")
_LAZY_FUNCS = {"lr_find": "trainwell.callbacks.lr_finder"}


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"trainwell.{name}")
    if name in _LAZY_FUNCS:
        return getattr(importlib.import_module(_LAZY_FUNCS[name]), name)
    raise AttributeError(f"module 'trainwell' has no attribute {name!r}")
