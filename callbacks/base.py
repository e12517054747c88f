"""Base class of trainwell's stateful callbacks: config and state kept apart.

Modelled on KerasTuner's `Stateful` and Lightning's callback `state_dict`: the
constructor arguments are the config (`get_config`), the counters and best values
are the state (`get_state`/`set_state`, JSON-serialisable). `Checkpoint` saves the
state of every `StatefulCallback` attached to the same `fit` call and restores it
on resume, so patience, rollback counters and the like survive a restart.

How the pieces find each other: `set_model` (which Keras calls on every callback
when `fit` builds its `CallbackList`) registers the callback on the model under
its `state_key`; `Checkpoint` reads that registry (`stateful_callbacks(model)`).

Restore order: `set_state` marks the state as restored, and `on_train_begin`
calls `reset_state()` only when nothing was restored, so the callback order in
the `callbacks=[...]` list does not matter.
"""

from __future__ import annotations

import copy
import inspect
import re
from typing import Any

import keras

_REGISTRY_ATTR = "_trainwell_stateful_callbacks"


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class StatefulCallback(keras.callbacks.Callback):
    """A Keras callback whose state can be saved and restored.

    Subclasses implement `reset_state()` (fresh-run values), `get_state()` and
    `set_state()` (JSON-serialisable dicts), and `get_config()` (constructor
    arguments). If they override `on_train_begin` they must call
    `super().on_train_begin(logs)` first.

    Example:
    >>> class Counter(StatefulCallback):
    ...     def reset_state(self):
    ...         self.n = 0
    ...     def on_train_batch_end(self, batch, logs=None):
    ...         self.n += 1
    ...     def get_state(self):
    ...         return {"n": self.n}
    ...     def set_state(self, state):
    ...         super().set_state(state)
    ...         self.n = int(state["n"])
    >>> c = Counter()
    >>> c.set_state({"n": 3}); c.get_state()
    {'n': 3}
    """

    #: Key of this callback's state in a checkpoint. Unique per fit call.
    state_key: str | None = None

    def __init__(self) -> None:
        super().__init__()
        self._state_restored = False
        self.reset_state()

    # -------------------------------------------------------------- protocol
    def reset_state(self) -> None:
        """Sets the state of a fresh run."""

    def get_state(self) -> dict[str, Any]:
        """Returns the state as a JSON-serialisable dict."""
        return {}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores the state from `get_state()`'s output. Subclasses call super."""
        self._state_restored = True

    def continue_after_stop(self) -> None:
        """Called by `Checkpoint` after `set_state` when a run that stopped early is trained longer.

        The restored state is the one the run stopped with; a callback that stops
        runs clears here what made it stop (early stopping restarts its patience).
        """

    def get_config(self) -> dict[str, Any]:
        """Returns the constructor arguments."""
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]):
        return cls(**config)

    # -------------------------------------------------------------- plumbing
    @property
    def key(self) -> str:
        return self.state_key or _snake(type(self).__name__)

    def set_model(self, model) -> None:
        super().set_model(model)
        registry = getattr(model, _REGISTRY_ATTR, None)
        if registry is None:
            registry = {}
            object.__setattr__(model, _REGISTRY_ATTR, registry)  # not a tracked layer attribute
        registry[self.key] = self

    def on_train_begin(self, logs=None) -> None:
        if not self._state_restored:
            self.reset_state()

    def on_train_end(self, logs=None) -> None:
        self._state_restored = False


def stateful_callbacks(model) -> dict[str, StatefulCallback]:
    """The `StatefulCallback`s attached to `model` by the current (or last) fit.

    Example:
    >>> stateful_callbacks(keras.Sequential())
    {}
    """
    return dict(getattr(model, _REGISTRY_ATTR, None) or {})


def constructor_config(obj) -> dict[str, Any]:
    """`obj`'s constructor arguments, read back from its attributes of the same names.

    The `get_config` of a class that keeps each argument as it is, under its name.

    Example:
    >>> class Every:
    ...     def __init__(self, n=1, names=("a",)):
    ...         self.n, self.names = n, names
    >>> constructor_config(Every(5))
    {'n': 5, 'names': ('a',)}
    """
    params = inspect.signature(type(obj).__init__).parameters
    return {name: copy.copy(getattr(obj, name)) for name in params if name != "self"}
