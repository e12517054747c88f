"""The one "is this value better" rule: `metric_direction`, `monitored_value`, `is_improvement`.

`Checkpoint` (which checkpoint is best), `EarlyStopping` (patience) and the
tuners (which trial is best) all ask whether a logged value improves on another.
They ask here, and the answer is Keras's own (`MonitorCallback._set_monitor_op`
and `_is_improvement` in `keras/src/callbacks/monitor_callback.py`):

- `mode="min"`/`"max"` is taken as given;
- `"auto"`: `loss` (and `val_loss`) is minimized; otherwise the direction of the
  compiled metric of that name (Keras metrics carry `_direction`, `"up"` or
  `"down"`), which needs the model;
- a value may be a number or an array of one element (a binary
  `keras.metrics.F1Score` logs shape `(1,)`); Keras compares those with
  `ops.greater`/`ops.less`, so they count here too.

Without a model (before `fit`, or a tuner ranking trials from their logs) Keras
cannot tell and raises; here the name decides as KerasTuner's
`infer_metric_direction` does for losses (`loss`, `crossentropy`, `ce`: min) and
by the names of Keras's maximized metrics (`accuracy`/`acc`, `auc`,
`precision`, `recall`, `f1`, `iou`, `top_k`: max); any other name gives `None`
and the caller decides (`EarlyStopping` raises Keras's error, `Checkpoint`
minimizes).

Example:
>>> metric_direction("val_loss"), metric_direction("val_accuracy"), metric_direction("val_mae", "max")
('min', 'max', 'max')
>>> metric_direction("val_custom") is None
True
>>> is_improvement(0.5, 0.6, "min"), is_improvement([0.9], 0.8, "max", min_delta=0.2)
(True, False)
"""

from __future__ import annotations

import math

import numpy as np

from trainwell.compat.versions import gate
from trainwell.validation import invalid_argument

__all__ = ["metric_direction", "monitored_value", "is_improvement", "finite_value"]

MODES = ("auto", "min", "max")
#: Names KerasTuner's `infer_metric_direction` treats as losses.
_LOSS_NAMES = ("loss", "crossentropy", "ce")
#: Parts of the names of Keras's maximized metrics (`_direction == "up"`).
_MAX_NAME_PARTS = ("acc", "auc", "precision", "recall", "f1", "iou", "top_k")


def _compiled_metrics(model) -> list:
    """The metrics `model.metrics` reports, with Keras's metric containers opened."""
    out = []
    for m in getattr(model, "metrics", None) or []:
        out.extend(getattr(m, "metrics", None) or [m])
    return out


def _keras_direction(metric) -> str | None:
    """"max"/"min" from a Keras metric's private `_direction` ("up"/"down"), or None."""
    gate("Metric._direction")
    direction = getattr(metric, "_direction", None)
    if direction == "up":
        return "max"
    if direction == "down":
        return "min"
    return None


def metric_direction(monitor: str, mode: str = "auto", model=None) -> str | None:
    """`"min"` or `"max"`: which way `monitor` improves; `None` when that cannot be told.

    Args:
        monitor: A logged name, e.g. `"val_loss"` or `"val_accuracy"`. Required.
        mode: `"auto"`, `"min"` or `"max"`. Defaults to `"auto"`.
        model: A compiled Keras model whose metrics say their direction (Keras's
            rule). Without it, or when it has no metric of that name, the name
            decides (see the module docstring). Defaults to `None`.

    Example:
    >>> metric_direction("val_f1_score"), metric_direction("loss", "max")
    ('max', 'max')
    """
    if mode not in MODES:
        raise invalid_argument("mode", f"one of {MODES}", mode)
    if mode != "auto":
        return mode
    name = monitor.removeprefix("val_")
    if name == "loss":
        return "min"
    if model is not None:
        for m in _compiled_metrics(model):
            if getattr(m, "name", None) == name:
                found = _keras_direction(m)
                if found is not None:
                    return found
        return None  # Keras's rule: the model does not say
    bare = name.removeprefix("weighted_")
    if bare in _LOSS_NAMES or bare.endswith("_loss"):
        return "min"
    if any(part in bare for part in _MAX_NAME_PARTS):
        return "max"
    return None


def monitored_value(value, name: str = "value", caller: str = "trainwell") -> float:
    """A logged value as a float: a number, or an array or tensor of one element.

    Args:
        value: The logged value. Required.
        name: Its name, for the error. Defaults to `"value"`.
        caller: Who asks, for the error (e.g. `"EarlyStopping"`). Defaults to `"trainwell"`.

    Raises:
        ValueError: `value` has more than one element (no single best value).

    Example:
    >>> monitored_value(np.array([0.25]))
    0.25
    """
    if hasattr(value, "numpy"):
        value = value.numpy()
    arr = np.asarray(value)
    if arr.size != 1:
        raise ValueError(
            f"{caller} cannot monitor `{name}`: its value has shape {arr.shape}, expected a scalar "
            "(e.g. `F1Score(average='macro')` rather than one score per class). "
            f"Received: {name}={arr.tolist()}"
        )
    return float(arr.reshape(-1)[0])


def finite_value(value) -> float | None:
    """`monitored_value(value)` when it is finite, else `None` (also for non-numbers).

    Example:
    >>> finite_value(float("nan")) is None, finite_value([2.0])
    (True, 2.0)
    """
    try:
        x = monitored_value(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def is_improvement(current, reference, direction: str, min_delta: float = 0.0) -> bool:
    """Keras's `_is_improvement`: `current` beats `reference` by more than `min_delta`.

    Args:
        current: The new value (a number or a 1-element array). Required.
        reference: The value to beat, or `None` (anything beats it). Required.
        direction: `"min"` or `"max"`. Required.
        min_delta: The margin, >= 0 (its sign is ignored, as Keras's
            `abs(min_delta)`). Defaults to `0.0`.

    Example:
    >>> is_improvement(0.59, 0.6, "min", min_delta=0.05)
    False
    """
    if reference is None:
        return True
    c, r, d = monitored_value(current), monitored_value(reference), abs(float(min_delta))
    return c - d > r if direction == "max" else c + d < r
