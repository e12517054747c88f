"""Constant-time mid-epoch resume: where the resumed epoch's iterator of a training pipeline starts.

`trainwell.data.images.build_image_datasets(start_at=...)` drops the first `start_at`
examples of each iteration of the training dataset before decoding them. `EpochStart`
holds that number in a variable and its `callback()` sets it at the start of each epoch:
the resumed epoch's position for the resumed epoch, 0 for every other, so only the
resumed epoch's iterator (Keras makes one per epoch, after `on_epoch_begin`) starts
late. The recipe tells `Checkpoint` (`data_positioned`) that the batches are skipped
already, so it takes none from the iterator: the time to the first trained step does
not grow with the position in the epoch (bench/README.md).

Example:
>>> start = EpochStart(epoch=2, examples=96)
>>> start.set_epoch(2); int(start.variable.numpy())
96
>>> start.set_epoch(3); int(start.variable.numpy())
0
"""

from __future__ import annotations

from trainwell.validation import invalid_argument, is_int

__all__ = ["EpochStart"]


class EpochStart:
    """The examples the training dataset's iterator drops before decoding, per epoch.

    Args:
        epoch: The epoch a run resumes in (0-based).
        examples: Examples of that epoch already trained (its batches x the batch size).

    Attributes:
        variable: A scalar int64 `tf.Variable` on the CPU: `examples` until the callback
            sets the value of another epoch.

    Example:
    >>> EpochStart(epoch=0, examples=0).callback() is not None
    True
    """

    def __init__(self, epoch: int, examples: int) -> None:
        import tensorflow as tf  # lazy: TensorFlow loads when a pipeline is built, not with this module

        for name, value in (("epoch", epoch), ("examples", examples)):
            if not is_int(value) or value < 0:
                raise invalid_argument(name, "an int >= 0", value)
        self.epoch, self.examples = int(epoch), int(examples)
        with tf.device("/cpu:0"):  # read by tf.data on the host, never mirrored by a strategy
            self.variable = tf.Variable(self.examples, dtype=tf.int64, trainable=False, name="epoch_start")

    def set_epoch(self, epoch: int) -> None:
        """Sets the variable for epoch `epoch`: `examples` in the resumed epoch, else 0."""
        self.variable.assign(self.examples if int(epoch) == self.epoch else 0)

    def callback(self):
        """A Keras callback that calls `set_epoch` at the start of each epoch (put it first)."""
        import keras  # lazy: Keras loads when a run starts

        return keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs=None: self.set_epoch(epoch))
