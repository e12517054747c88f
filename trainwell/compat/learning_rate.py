"""The one way trainwell reads and changes an optimizer's learning rate.

Keras keeps an optimizer's learning rate in the private attribute
`_learning_rate`: a float `keras.Variable`, a `LearningRateSchedule`, or a
callable. Its public `learning_rate` property reads the value at the current
step, and its setter refuses a new value once a schedule is set and, given a
schedule, untracks the old variable (which changes the optimizer's variable list,
and so a checkpoint's layout). trainwell needs more than that, so every access
to `_learning_rate` is here:

- `inner_optimizer`: the optimizer that owns the LR, through any
  `LossScaleOptimizer` (what `mixed_float16` wraps around it);
- `raw_learning_rate` / `set_raw_learning_rate`: what the optimizer holds, and
  replacing it without Keras's setter (the LR range test, `WarmupCosine`);
- `learning_rate_variables`: the LR variables (a NaN rollback does not restore them);
- `current_lr`: the value for the next step;
- the LR multiplier: a schedule with a float32 `keras.Variable` attribute
  `multiplier` (trainwell's schedules in `trainwell.callbacks.schedules`) can be
  lowered after the optimizer is built: `get_lr_multiplier`,
  `set_lr_multiplier`, `scale_learning_rate`, `install_schedule`.

Example:
>>> import keras
>>> opt = keras.optimizers.SGD(learning_rate=0.1)
>>> [round(x, 6) for x in scale_learning_rate(opt, 0.5)]
[0.1, 0.05]
>>> round(current_lr(keras.optimizers.LossScaleOptimizer(opt)), 6)
0.05
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import keras
import numpy as np

from trainwell.compat.backend import backend_name
from trainwell.compat.versions import gate, upstream_changed
from trainwell.validation import invalid_argument

_LR_ATTR = "_learning_rate"
# Attribute on an optimizer without a multiplier schedule that holds a multiplier
# restored before `WarmupCosine` installed its schedule (restore order must not
# matter); `install_schedule` hands it to the schedule.
_PENDING_ATTR = "_trainwell_lr_multiplier"


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise invalid_argument(name, "a float > 0", value)
    return float(value)


def live_schedule_variables() -> bool:
    """Whether a traced train step reads a schedule's `keras.Variable`s each time it runs.

    Then assigning them changes the learning rate without a new trace (TensorFlow:
    a `tf.function` reads variables when it runs). On JAX a jitted step takes a
    variable that is not part of the model's or the optimizer's state as a
    constant, so a new learning rate needs a new schedule (and a new trace).

    Example:
    >>> live_schedule_variables() in (True, False)
    True
    """
    return backend_name() == "tensorflow"


def _to_float(x) -> float:
    """A scalar tensor or `keras.Variable` as a Python float."""
    if isinstance(x, keras.Variable):
        x = x.numpy()
    return float(np.asarray(keras.ops.convert_to_numpy(x)))


def inner_optimizer(optimizer):
    """The optimizer that owns the learning rate: unwraps `LossScaleOptimizer`s.

    Args:
        optimizer: A Keras optimizer (or anything: returned as is). Required.

    Example:
    >>> opt = keras.optimizers.SGD(0.1)
    >>> inner_optimizer(keras.optimizers.LossScaleOptimizer(opt)) is opt
    True
    """
    seen = 0
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and seen < 8:
        optimizer = optimizer.inner_optimizer
        seen += 1
    return optimizer


def _inner(optimizer):
    """`inner_optimizer`, checking that there is an optimizer at all."""
    optimizer = inner_optimizer(optimizer)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"Expected a `keras.optimizers.Optimizer`. Received: optimizer={optimizer!r} "
            "(compile the model with an optimizer first)"
        )
    return optimizer


def raw_learning_rate(optimizer):
    """What the (inner) optimizer holds as its LR: a variable, a schedule or a callable.

    Args:
        optimizer: A Keras optimizer, possibly a `LossScaleOptimizer`. Required.

    Example:
    >>> s = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    >>> raw_learning_rate(keras.optimizers.SGD(s)) is s
    True
    """
    inner = _inner(optimizer)
    gate("Optimizer._learning_rate")
    if not hasattr(inner, _LR_ATTR):
        raise upstream_changed("Optimizer._learning_rate")
    return getattr(inner, _LR_ATTR)


def set_raw_learning_rate(optimizer, learning_rate):
    """Puts `learning_rate` in place of the (inner) optimizer's LR; returns the previous one.

    Not Keras's `learning_rate` setter: that one refuses a new value once a
    schedule is set, and replacing the LR variable by a schedule through it
    untracks the variable (the optimizer's variable list, and so a checkpoint's
    layout, would change). A `fit` whose train function is already traced keeps
    the old LR until `model.make_train_function(force=True)`.

    Args:
        optimizer: A Keras optimizer, possibly a `LossScaleOptimizer`. Required.
        learning_rate: A `LearningRateSchedule`, a float `keras.Variable`, or
            what `raw_learning_rate` returned before. Required.

    Returns:
        The previous value of `raw_learning_rate(optimizer)`.

    Example:
    >>> opt = keras.optimizers.SGD(0.1)
    >>> old = set_raw_learning_rate(opt, keras.optimizers.schedules.ExponentialDecay(0.2, 10, 0.5))
    >>> round(current_lr(opt), 6)
    0.2
    >>> _ = set_raw_learning_rate(opt, old); round(current_lr(opt), 6)
    0.1
    """
    previous = raw_learning_rate(optimizer)
    setattr(_inner(optimizer), _LR_ATTR, learning_rate)
    return previous


def learning_rate_variables(optimizer) -> list:
    """The LR `keras.Variable`s of `optimizer` and of its inner optimizers (none under a schedule).

    Example:
    >>> len(learning_rate_variables(keras.optimizers.SGD(0.1)))
    1
    """
    out, seen = [], set()
    o = optimizer
    for _ in range(8):
        if not isinstance(o, keras.optimizers.Optimizer):
            break
        gate("Optimizer._learning_rate")
        lr = getattr(o, _LR_ATTR, None)
        if isinstance(lr, keras.Variable) and id(lr) not in seen:
            seen.add(id(lr))
            out.append(lr)
        o = getattr(o, "inner_optimizer", None)
    return out


def current_lr(optimizer) -> float:
    """The learning rate `optimizer` uses for its next step (at its `iterations`).

    Args:
        optimizer: A Keras optimizer, possibly a `LossScaleOptimizer`. Required.

    Returns:
        The learning rate (float).

    Example:
    >>> current_lr(keras.optimizers.SGD(0.25))
    0.25
    """
    return _to_float(_inner(optimizer).learning_rate)


def has_multiplier(learning_rate) -> bool:
    """Whether `learning_rate` is a schedule with an LR multiplier (a `keras.Variable` `multiplier`).

    Example:
    >>> has_multiplier(0.1), has_multiplier(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5))
    (False, False)
    """
    return isinstance(learning_rate, keras.optimizers.schedules.LearningRateSchedule) and isinstance(
        getattr(learning_rate, "multiplier", None), keras.Variable
    )


def get_lr_multiplier(optimizer) -> float:
    """The LR multiplier of `optimizer`'s schedule.

    For an optimizer without a multiplier schedule this is 1.0, or the value a
    `set_lr_multiplier` left waiting for the schedule `install_schedule` puts in.

    Args:
        optimizer: A Keras optimizer, possibly a `LossScaleOptimizer`. Required.

    Returns:
        The multiplier (float).

    Example:
    >>> get_lr_multiplier(keras.optimizers.SGD(0.1))
    1.0
    """
    lr = raw_learning_rate(optimizer)
    if has_multiplier(lr):
        return _to_float(lr.multiplier)
    return float(getattr(_inner(optimizer), _PENDING_ATTR, 1.0))


def set_lr_multiplier(optimizer, value: float) -> None:
    """Sets the LR multiplier of `optimizer`'s schedule (checkpoint restore).

    On an optimizer that has no multiplier schedule yet, the value is kept on the
    optimizer and handed to the schedule `install_schedule` puts in (what
    `WarmupCosine` does at `on_train_begin`), so a checkpoint may restore it
    before or after that callback runs; until then the optimizer's learning rate
    is unchanged (lower a plain learning rate with `scale_learning_rate`).

    Args:
        optimizer: A Keras optimizer, possibly a `LossScaleOptimizer`. Required.
        value: The multiplier, a float > 0. Required.

    Example:
    >>> opt = keras.optimizers.SGD(0.5)
    >>> set_lr_multiplier(opt, 0.25); get_lr_multiplier(opt), current_lr(opt)
    (0.25, 0.5)
    """
    value = _positive("value", value)
    lr = raw_learning_rate(optimizer)
    if has_multiplier(lr):
        lr.multiplier.assign(value)
    else:
        setattr(_inner(optimizer), _PENDING_ATTR, value)


def install_schedule(optimizer, schedule) -> None:
    """Makes multiplier schedule `schedule` the LR of `optimizer`, keeping the multiplier.

    The multiplier in force (of the schedule replaced, or left by
    `set_lr_multiplier`) carries over to `schedule`. See
    `set_raw_learning_rate` for why Keras's setter is not used and for the
    train function.

    Args:
        optimizer: A Keras optimizer, possibly a `LossScaleOptimizer`. Required.
        schedule: A `LearningRateSchedule` with a `multiplier` variable. Required.

    Example:
    >>> from trainwell.callbacks.schedules import WarmupCosineDecay
    >>> opt = keras.optimizers.SGD(0.1)
    >>> set_lr_multiplier(opt, 0.5)
    >>> install_schedule(opt, WarmupCosineDecay(0.1, 100)); round(current_lr(opt), 6)
    0.05
    """
    if not has_multiplier(schedule):
        raise invalid_argument(
            "schedule", "a LearningRateSchedule with a `multiplier` variable (e.g. trainwell's WarmupCosineDecay)",
            schedule)
    schedule.multiplier.assign(get_lr_multiplier(optimizer))
    inner = _inner(optimizer)
    if hasattr(inner, _PENDING_ATTR):
        delattr(inner, _PENDING_ATTR)
    set_raw_learning_rate(inner, schedule)


def scale_learning_rate(optimizer, factor: float) -> tuple[float, float]:
    """Multiplies the current learning rate of `optimizer` by `factor`.

    A multiplier schedule gets its multiplier scaled (the schedule keeps its
    shape, lowered); a plain float/variable learning rate is assigned. Any other
    `LearningRateSchedule` cannot be lowered once the optimizer is built, so it
    raises a `ValueError` asking for a trainwell schedule.

    Args:
        optimizer: A Keras optimizer, possibly a `LossScaleOptimizer`. Required.
        factor: The factor, a float > 0 (e.g. 0.5 after a NaN rollback). Required.

    Returns:
        `(old_lr, new_lr)`: the current learning rate before and after.

    Example:
    >>> opt = keras.optimizers.SGD(learning_rate=0.1)
    >>> [round(x, 6) for x in scale_learning_rate(opt, 0.5)]
    [0.1, 0.05]
    """
    factor = _positive("factor", factor)
    inner = _inner(optimizer)
    lr = raw_learning_rate(inner)
    old = current_lr(inner)
    if has_multiplier(lr):
        lr.multiplier.assign(_to_float(lr.multiplier) * factor)
    elif isinstance(lr, keras.Variable):
        lr.assign(old * factor)
    else:
        kind = type(lr).__name__
        raise ValueError(
            f"Cannot scale the learning rate of optimizer `{inner.name}`: it is a `{kind}`, which Keras "
            "does not let you change once set. Use a trainwell schedule instead (`WarmupCosineDecay`, "
            "`WarmupLinearDecay`, `WarmupStepDecay` from `trainwell.callbacks`, or the `WarmupCosine` "
            f"callback), whose LR multiplier can be lowered. Received: learning_rate={lr!r}"
        )
    return old, current_lr(inner)
