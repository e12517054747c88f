"""trainwell.callbacks: reusable callbacks that work in anyone's `model.fit`.

Names are imported lazily so `import trainwell.callbacks` stays cheap and one
missing optional piece never breaks the others. The `TYPE_CHECKING` block names
the same definitions for editors and static analysis (jedi, type checkers),
which never run `__getattr__`; `tests/test_packaging.py` checks the two agree.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from trainwell.callbacks.base import StatefulCallback, stateful_callbacks

if TYPE_CHECKING:
    from trainwell.callbacks.checkpoint import (
        Checkpoint,
        latest_checkpoint,
        list_checkpoints,
        load_checkpoint,
        read_checkpoint,
        resume_checkpoint,
    )
    from trainwell.callbacks.doctor import TrainingDoctor
    from trainwell.callbacks.early_stopping import EarlyStopping, StopAtStep
    from trainwell.callbacks.lr_finder import LRFinder
    from trainwell.callbacks.nan_rollback import NaNRollback
    from trainwell.callbacks.schedules import (
        WarmupCosineDecay,
        WarmupLinearDecay,
        WarmupStepDecay,
        current_lr,
        scale_learning_rate,
        scaled_lr,
    )
    from trainwell.callbacks.tensorboard import TensorBoard
    from trainwell.callbacks.warmup_cosine import WarmupCosine

_MODULES = {
    "schedules": (
        "WarmupCosineDecay", "WarmupLinearDecay", "WarmupStepDecay", "scaled_lr", "scale_learning_rate", "current_lr",
    ),
    "warmup_cosine": ("WarmupCosine",),
    "nan_rollback": ("NaNRollback",),
    "checkpoint": (
        "Checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints", "read_checkpoint", "resume_checkpoint",
    ),
    "early_stopping": ("EarlyStopping", "StopAtStep"),
    "doctor": ("TrainingDoctor",),
    "lr_finder": ("LRFinder",),
    "tensorboard": ("TensorBoard",),
}
#: Each lazy name and the module that defines it.
_LAZY = {name: module for module, names in _MODULES.items() for name in names}

__all__ = ["StatefulCallback", "stateful_callbacks", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(f"trainwell.callbacks.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'trainwell.callbacks' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
