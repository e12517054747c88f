"""trainwell's `TensorBoard`: Keras's, without per-batch summary calls that record nothing.

Keras's own `TensorBoard` tests run against it in `tests/conformance/`.
"""

from __future__ import annotations

import collections
import glob
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainwell.callbacks import TensorBoard


class _CountingSummary:
    """`tf.summary`, counting `scalar` calls by tag."""

    def __init__(self):
        self.calls = collections.Counter()

    def scalar(self, name, *args, **kwargs):
        self.calls[name] += 1
        return tf.summary.scalar(name, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(tf.summary, name)


def _fit(cls, log_dir, **kwargs):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse", metrics=["mae"])
    counting = _CountingSummary()

    class Counted(cls):
        summary = property(lambda self: counting)  # Keras's TensorBoard writes through `self.summary`

    tb = Counted(log_dir=str(log_dir), **kwargs)
    model.fit(np.ones((32, 3)), np.ones((32, 2)), batch_size=4, epochs=2, callbacks=[tb], verbose=0)
    return counting.calls


def _tags(log_dir):
    """`(subdirectory, tag, step)` of every summary recorded under `log_dir`."""
    tags = set()
    for path in glob.glob(os.path.join(str(log_dir), "**", "events.out.tfevents.*"), recursive=True):
        where = os.path.relpath(os.path.dirname(path), str(log_dir))
        for event in tf.compat.v1.train.summary_iterator(path):
            tags.update((where, v.tag, event.step) for v in event.summary.value)
    return tags


def test_no_batch_summary_calls_when_no_writer_records_them(tmp_path):
    keras_calls = _fit(keras.callbacks.TensorBoard, tmp_path / "keras")
    # The premise (Keras 3.15): at update_freq="epoch" Keras calls summary.scalar for each
    # value of each batch's logs (2 values x 8 batches x 2 epochs), though nothing records them.
    # If this fails, Keras no longer does, and trainwell's subclass can go.
    assert keras_calls["batch_loss"] == 16 and keras_calls["batch_mae"] == 16
    ours = _fit(TensorBoard, tmp_path / "ours")
    assert ours["batch_loss"] == ours["batch_mae"] == 0
    # Everything else is written as Keras writes it.
    assert {k: v for k, v in ours.items()} == {k: v for k, v in keras_calls.items() if not k.startswith("batch_")}
    assert _tags(tmp_path / "ours") == _tags(tmp_path / "keras")  # the same summaries at the same steps


@pytest.mark.parametrize("update_freq", ["epoch", 2])
def test_batch_summaries_are_recorded_as_keras_records_them(tmp_path, update_freq):
    """With a default writer around `fit`, and at update_freq=N (Keras's writer, every N-th batch): as Keras.

    The same summaries (directory, tag, step) are recorded; trainwell's makes only
    the calls that record (at update_freq=2, Keras also calls for the odd batches,
    which its `record_if` drops).
    """
    recorded, calls = {}, {}
    for name, cls in (("keras", keras.callbacks.TensorBoard), ("ours", TensorBoard)):
        user_dir = tmp_path / name / "user"
        writer = tf.summary.create_file_writer(str(user_dir))
        with writer.as_default(step=0):
            calls[name] = _fit(cls, tmp_path / name / "tb", update_freq=update_freq)
        writer.flush()
        recorded[name] = (_tags(user_dir), _tags(tmp_path / name / "tb"))
    assert recorded["ours"] == recorded["keras"]
    batch_steps = {step for _, tag, step in recorded["ours"][0] | recorded["ours"][1] if tag == "batch_loss"}
    assert len(batch_steps) == (16 if update_freq == "epoch" else 8)
    assert calls["ours"]["batch_loss"] == len(batch_steps) and calls["keras"]["batch_loss"] == 16
