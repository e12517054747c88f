"""`Checkpoint.data_positioned` (#35.4): a resumed epoch whose data already starts at the checkpoint's position."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainwell.callbacks.checkpoint import Checkpoint
from trainwell.callbacks.checkpoint.resume import batches_to_skip

rs = np.random.RandomState(0)
X = rs.randn(40, 4).astype("float32")
Y = (X @ rs.randn(4, 1)).astype("float32")


def _model():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dropout(0.2),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.05), loss="mse")
    return model


def _data(skip_epoch=None, skip_examples=0):
    """10 batches of 4 an epoch; in epoch `skip_epoch` the first `skip_examples` are dropped (as the
    recipes' image pipeline drops them before decoding), set by the returned callback."""
    start = tf.Variable(0, dtype=tf.int64)

    def kept(i, xy):
        return i >= start

    def drop_index(i, xy):
        return xy

    ds = tf.data.Dataset.from_tensor_slices((X, Y)).enumerate().filter(kept).map(drop_index).batch(4)
    ds = ds.apply(tf.data.experimental.assert_cardinality(10))  # a new iterator each epoch
    set_start = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs=None: start.assign(skip_examples if epoch == skip_epoch else 0))
    return ds, set_start


class _Stop(keras.callbacks.Callback):
    def __init__(self, at):
        super().__init__()
        self.at, self.seen = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.at:
            raise KeyboardInterrupt("stopped")


def test_a_positioned_resume_takes_no_batch_and_matches_the_uninterrupted_fit(tmp_path):
    ref = _model()
    ds, cb = _data()
    ref.fit(ds, epochs=3, verbose=0, shuffle=False, callbacks=[cb])

    d = tmp_path / "ck"
    ds, cb = _data()
    with pytest.raises(KeyboardInterrupt):
        _model().fit(ds, epochs=3, verbose=0, shuffle=False, callbacks=[cb, Checkpoint(d, save_every=7), _Stop(9)])
    # The checkpoint at step 7 (epoch 1 of 3, 7 steps trained in it): the data starts 7 batches in.
    ds, cb = _data(skip_epoch=0, skip_examples=7 * 4)
    seen = []
    log = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs=None: seen.append(batch))
    ckpt = Checkpoint(d, save_every=7)
    ckpt.data_positioned(7)
    model = _model()
    model.fit(ds, epochs=3, verbose=0, shuffle=False, callbacks=[cb, ckpt, log])
    assert seen == [7, 8, 9] + list(range(10)) * 2  # no callback saw a batch it did not train
    assert int(model.optimizer.iterations.numpy()) == 30
    for a, b in zip(ref.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_position_other_than_the_checkpoints_is_refused(tmp_path):
    d = tmp_path / "ck"
    ds, cb = _data()
    with pytest.raises(KeyboardInterrupt):
        _model().fit(ds, epochs=2, verbose=0, shuffle=False, callbacks=[cb, Checkpoint(d, save_every=3), _Stop(4)])
    ckpt = Checkpoint(d, save_every=3)
    ckpt.data_positioned(2)
    with pytest.raises(RuntimeError, match="starts 2 batches into epoch 1, the checkpoint resumes after 3"):
        _model().fit(_data(0, 8)[0], epochs=2, verbose=0, shuffle=False, callbacks=[ckpt])
    assert batches_to_skip({"step_in_epoch": 3, "data_position": 3, "hooks_done": True}) == 3
    assert batches_to_skip({"step_in_epoch": 3, "data_position": 5, "hooks_done": False}) == 5
