"""Progressive resizing: the side of the training images per epoch (FFCV, fastai, Composer).

A run trains its first epochs on smaller images (cheaper steps, cheaper resizes in the
input pipeline) and its last ones on larger images; evaluation stays at the run's final
`image_size`. A schedule is a list of `[fraction, size]` entries: `size` applies from the
first epoch that starts at or after `fraction` of the run (epoch `ceil(fraction x
epochs)`, 0-based), until the next entry's epoch. Entries that land on the same epoch
(a short run): the last one applies; an entry that lands at or after the last epoch is
never used.

How the input pipeline follows it: `EpochImageSize` holds the side in a `tf.Variable`
that the training pipeline reads as it makes each image (`trainwell.data.images`,
`train_size`), and its `callback()` sets the variable in `on_epoch_begin`. Keras makes
a new iterator of the training dataset at the start of each epoch, after the callbacks'
`on_epoch_begin`, and an epoch's iterator yields exactly that epoch's batches, so all of
an epoch's images have that epoch's side. The size is a function of the epoch number
alone: a resumed run (`Checkpoint` sets the epoch fit starts at) trains each epoch at
the size the uninterrupted run did, and no callback has state to save. The number of
steps per epoch and the batch size stay fixed (the batch size is not scaled with the
image area), so the learning-rate schedule, which counts steps, is the same as without
resizing.

Example:
>>> epoch_sizes([[0, 160], [0.75, 192]], epochs=8)
[160, 160, 160, 160, 160, 160, 192, 192]
>>> check_size_schedule([[0.5, 160]], min_size=32)
Traceback (most recent call last):
...
ValueError: Invalid value for argument `image_size_schedule`. Expected a list of [fraction, size] pairs, the first at fraction 0. Received: image_size_schedule=[[0.5, 160]]
"""

from __future__ import annotations

import math
from typing import Any

from trainwell.validation import invalid_argument, is_int, is_number

__all__ = ["EpochImageSize", "check_size_schedule", "epoch_sizes"]


def check_size_schedule(schedule: Any, min_size: int = 1, *, name: str = "image_size_schedule",
                        what: str = "argument", error: type[Exception] = ValueError) -> list[tuple[float, int]]:
    """Checks a progressive-resizing schedule; returns it as `[(fraction, size), ...]`.

    The fractions must increase strictly from 0 and stay below 1; each size is an int
    of at least `min_size` (a network's total stride: a smaller image is down to 1 px
    before its last stage).

    Args:
        schedule: A list of `[fraction, size]` pairs, e.g. `[[0, 160], [0.75, 192]]`.
        min_size: The smallest side allowed. Defaults to `1`.
        name: The name in the error message. Defaults to `"image_size_schedule"`.
        what: `trainwell.validation.invalid_argument`'s `what` (`""` for a config
            field). Defaults to `"argument"`.
        error: The exception class raised. Defaults to `ValueError`.

    Returns:
        The schedule as a list of `(float, int)` tuples.

    Raises:
        ValueError (or `error`): A one-line message ending in "Received: ...".

    Example:
    >>> check_size_schedule([[0, 160], [0.75, 192]], min_size=32)
    [(0.0, 160), (0.75, 192)]
    """
    def refuse(expected: str):
        expected = expected if what == "argument" else f"expected {expected}"
        raise invalid_argument(name, expected, _plain(schedule), what=what, error=error)

    pairs = "a list of [fraction, size] pairs"
    if not isinstance(schedule, (list, tuple)) or not schedule:
        refuse(f"{pairs}, e.g. [[0, 160], [0.75, 192]]")
    if not all(isinstance(e, (list, tuple)) and len(e) == 2 for e in schedule):
        refuse(f"{pairs}, e.g. [[0, 160], [0.75, 192]]")
    fractions = [e[0] for e in schedule]
    sizes = [e[1] for e in schedule]
    if not all(is_number(f) and 0 <= f < 1 for f in fractions):
        refuse(f"{pairs} with fractions of the run in [0, 1)")
    if fractions[0] != 0:
        refuse(f"{pairs}, the first at fraction 0")
    if any(b <= a for a, b in zip(fractions, fractions[1:])):
        refuse(f"{pairs} with strictly increasing fractions")
    if not all(is_int(s) and s >= min_size for s in sizes):
        refuse(f"{pairs} with int sizes of at least {min_size} px (the network's total stride)")
    return [(float(f), int(s)) for f, s in schedule]


def _plain(value: Any) -> Any:
    """`value` with tuples as lists (the message shows what a config file or `--set` holds)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def epoch_sizes(schedule, epochs: int) -> list[int]:
    """The training image side of each epoch `0 .. epochs - 1` of a checked schedule.

    Args:
        schedule: `[[fraction, size], ...]` (`check_size_schedule`'s rules).
        epochs: Epochs of the run, >= 1.

    Returns:
        One size per epoch.

    Example:
    >>> epoch_sizes([[0, 16], [0.5, 24]], epochs=3)
    [16, 16, 24]
    """
    if not is_int(epochs) or epochs < 1:
        raise invalid_argument("epochs", "an int >= 1", epochs)
    pairs = check_size_schedule(schedule)
    # A float product a hair above an integer (0.1 x 30 = 3.0000000000000004) is that integer.
    starts = [max(0, math.ceil(f * epochs - 1e-9)) for f, _ in pairs]
    out = []
    for e in range(epochs):
        out.append([s for start, (_, s) in zip(starts, pairs) if start <= e][-1])
    return out


class EpochImageSize:
    """The side of the training images of each epoch, in a variable the input pipeline reads.

    Give `variable` to `trainwell.data.images.build_image_datasets(train_size=...)` and
    `callback()` to `fit`: the callback sets the variable to the epoch's side in
    `on_epoch_begin`, before Keras makes that epoch's iterator (see the module
    docstring). The batch size and the steps per epoch do not change with the size.

    Args:
        schedule: `[[fraction, size], ...]` (`check_size_schedule`'s rules).
        epochs: Epochs of the run, >= 1.

    Attributes:
        sizes: The side of each epoch.
        variable: A scalar int32 `tf.Variable` on the CPU, holding the side of epoch 0
            until the callback sets it.

    Example:
    >>> sched = EpochImageSize([[0, 16], [0.5, 24]], epochs=4)
    >>> sched.sizes, int(sched.variable.numpy())
    ([16, 16, 24, 24], 16)
    >>> sched.set_epoch(3); int(sched.variable.numpy())
    24
    """

    def __init__(self, schedule, epochs: int) -> None:
        import tensorflow as tf  # lazy: the schedule's checks above run without TensorFlow (config validation)

        self.sizes = epoch_sizes(schedule, epochs)
        with tf.device("/cpu:0"):  # read by tf.data on the host, never mirrored by a strategy
            self.variable = tf.Variable(self.sizes[0], dtype=tf.int32, trainable=False, name="train_image_size")

    def size_at(self, epoch: int) -> int:
        """The side of epoch `epoch` (the last epoch's beyond the run)."""
        return self.sizes[min(int(epoch), len(self.sizes) - 1)]

    def set_epoch(self, epoch: int) -> None:
        """Sets the variable to the side of epoch `epoch`."""
        self.variable.assign(self.size_at(epoch))

    def callback(self):
        """A Keras callback that calls `set_epoch` at the start of each epoch (put it first).

        Example:
        >>> cb = EpochImageSize([[0, 16]], epochs=2).callback()
        """
        import keras  # lazy: Keras loads when a run starts, not with the schedule's checks

        return keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs=None: self.set_epoch(epoch))
