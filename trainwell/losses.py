"""Losses whose hyperparameters can change without a new trace of the train step.

Keras's `CategoricalCrossentropy(label_smoothing=0.1)` keeps the smoothing as a
Python float: it is a constant of the traced train step, so a new value means a
new model and a new trace (costly for a large model). Population-based training changes it at every exploit that
explores it. `CategoricalCrossentropy` here is Keras's, with the smoothing held
in a variable on TensorFlow: assigning `loss.label_smoothing` takes effect at the
next step of the already traced function, and PBT's model cache
(`trainwell.tuning.tuners.same_graph`) keeps a member's compiled model through
such an exploit, as it does for a plain learning rate.

The arithmetic is Keras's (`keras.losses.categorical_crossentropy`:
`y_true * (1 - s) + s / num_classes`, both factors rounded once from the Python
float to the loss's dtype, as Keras's constants are): values and gradients are
bit for bit Keras's when computed eagerly; in a traced train step TensorFlow's
graph optimizer folds Keras's constants where this reads variables, and the
results differ in the last bits. Keras's own tests for the class run against this one
(`tests/conformance/`). Where the compiled step does not read a variable outside
the model's state at each step (JAX: `trainwell.compat.kernels.train_step_reads_outside_variables`),
the smoothing stays a Python float (as in Keras) and changing it needs a new trace.
"""

from __future__ import annotations

import keras
from keras import ops

from trainwell.compat.kernels import train_step_reads_outside_variables
from trainwell.validation import invalid_argument, is_number

#: The config keys of each class here that live in a variable (on TensorFlow), by
#: registered name: `same_graph` leaves them out of a model's graph description.
VARIABLE_CONFIG_KEYS: dict[str, tuple[str, ...]] = {}


def _registered(cls):
    keras.saving.register_keras_serializable(package="trainwell")(cls)
    VARIABLE_CONFIG_KEYS[keras.saving.get_registered_name(cls)] = cls.variable_config_keys
    return cls


@_registered
class CategoricalCrossentropy(keras.losses.CategoricalCrossentropy):
    """Keras's `CategoricalCrossentropy`, with `label_smoothing` a variable: changing it does not retrace.

    Extends `keras.losses.CategoricalCrossentropy` (same arguments, values,
    config and serialization); see the module docstring for why. Assign
    `loss.label_smoothing = 0.05` between (or during) fits of a compiled model
    and the next step uses it. `get_config()["label_smoothing"]` is the current
    value. On backends other than TensorFlow it is a plain float, as in Keras.
    Registered as `trainwell>CategoricalCrossentropy`: import `trainwell.losses`
    before `keras.models.load_model` of a model compiled with it.

    Args:
        from_logits: Whether `y_pred` are logits. Defaults to `False`.
        label_smoothing: In [0, 1]: the labels become `y * (1 - s) + s / classes`.
            Defaults to `0.0`.
        axis: The class axis. Defaults to `-1`.
        reduction: As Keras's. Defaults to `"sum_over_batch_size"`.
        name: As Keras's. Defaults to `"categorical_crossentropy"`.
        dtype: As Keras's. Defaults to `None`.

    Example:
    >>> import numpy as np
    >>> loss = CategoricalCrossentropy(from_logits=True, label_smoothing=0.1)
    >>> y, logits = np.array([[1.0, 0.0, 0.0]]), np.array([[100.0, -100.0, -100.0]])
    >>> round(float(loss(y, logits)), 3)  # 400 * 0.1 / 3, as Keras's
    13.333
    >>> loss.label_smoothing = 0.0
    >>> float(loss(y, logits)) < 1e-3  # 0 up to rounding (some CPUs' kernels give -0.0)
    True
    """

    variable_config_keys = ("label_smoothing",)

    def __init__(self, from_logits=False, label_smoothing=0.0, axis=-1, reduction="sum_over_batch_size",
                 name="categorical_crossentropy", dtype=None):
        self._smoothing = None  # (s, 1 - s) as float64 variables on TensorFlow, made by the setter
        super().__init__(from_logits=from_logits, label_smoothing=label_smoothing, axis=axis,
                         reduction=reduction, name=name, dtype=dtype)
        if self._smoothing is not None:
            self.fn = _SmoothedCrossentropy(self._smoothing)  # what Keras's `LossFunctionWrapper.call` calls

    @property
    def label_smoothing(self) -> float:
        return self._value

    @label_smoothing.setter
    def label_smoothing(self, value):
        if isinstance(value, bool) or not is_number(value) or not 0.0 <= float(value) <= 1.0:
            raise invalid_argument("label_smoothing", "a number in [0, 1]", value)
        self._value = float(value)
        if getattr(self, "_fn_kwargs", None) is not None:
            self._fn_kwargs["label_smoothing"] = self._value  # what Keras's repr reads
        if not train_step_reads_outside_variables():
            return  # JAX: the compiled step would keep the value it was traced with
        if self._smoothing is None:
            # float64, cast once to the loss's dtype in the step, as Keras's Python-float constants are
            self._smoothing = tuple(keras.Variable(v, dtype="float64", trainable=False, autocast=False,
                                                   name=f"label_smoothing_{i}")
                                    for i, v in enumerate((self._value, 1.0 - self._value)))
        else:
            self._smoothing[0].assign(self._value)
            self._smoothing[1].assign(1.0 - self._value)

    @property
    def uses_variable(self) -> bool:
        """Whether the traced step reads `label_smoothing` from a variable (on TensorFlow)."""
        return self._smoothing is not None


class _SmoothedCrossentropy:
    """Keras's `losses.categorical_crossentropy`, its smoothing's two factors read from variables."""

    def __init__(self, smoothing):
        self.smoothing = smoothing  # (s, 1 - s), float64

    def __call__(self, y_true, y_pred, from_logits=False, label_smoothing=0.0, axis=-1):
        y_pred = ops.convert_to_tensor(y_pred)
        y_true = ops.cast(y_true, y_pred.dtype)
        smoothing, keep = (ops.cast(v, y_pred.dtype) for v in self.smoothing)
        num_classes = ops.cast(ops.shape(y_true)[-1], y_pred.dtype)
        y_true = y_true * keep + smoothing / num_classes
        return keras.losses.categorical_crossentropy(y_true, y_pred, from_logits=from_logits, axis=axis)

    def __repr__(self):
        return "categorical_crossentropy (label smoothing read from a variable)"
