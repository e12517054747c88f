"""`pad_partial_batches`: even batches for JAX data parallelism, with the loss and weighted metrics unchanged."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainwell.data.batches import pad_partial_batches


def test_padded_evaluation_equals_the_unpadded_one():
    # 11 examples in batches of 4 (4, 4, 3), padded for 2 replicas: every batch 4, the padding weighs 0, and
    # Keras reports the same loss (incl. a regularizer) and weighted accuracy as without the padding.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(11, 3)).astype("float32"), rng.integers(0, 2, 11)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_regularizer="l2")])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True), weighted_metrics=["accuracy"])
    plain = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    with pytest.warns(UserWarning, match="padded 1 examples of weight 0 .* compile them as `weighted_metrics=`"):
        padded = pad_partial_batches(plain, 2)
    batches = list(padded)
    assert [b[0].shape[0] for b in batches] == [4, 4, 4] and padded.element_spec[0].shape[0] == 4
    w = np.concatenate([b[2].numpy() for b in batches])
    assert np.allclose(w, [12 / 11] * 11 + [0.0])  # slots / examples, then the padding
    assert np.allclose(np.concatenate([b[0].numpy() for b in batches])[:11], x)
    want, got = (model.evaluate(d, verbose=0, return_dict=True) for d in (plain, padded))
    assert got.keys() == want.keys() and all(np.isclose(got[k], want[k], rtol=1e-6) for k in want), (got, want)
    # The user's own sample weights are kept (times the same factor); the padding repeats the batch's first example.
    sw = tf.data.Dataset.from_tensor_slices((np.array(["a", "b", "c"]), [1, 2, 3], [0.5, 1.0, 2.0])).batch(2)
    with pytest.warns(UserWarning):
        (x0, _, w0), (x1, y1, w1) = list(pad_partial_batches(sw, 2))
    assert x1.numpy().tolist() == [b"c", b"c"] and y1.numpy().tolist() == [3, 3]
    assert np.allclose(np.concatenate([w0, w1]), [0.5 * 4 / 3, 4 / 3, 2 * 4 / 3, 0.0])


def test_datasets_that_split_evenly_or_cannot_be_weighted_are_unchanged():
    full = tf.data.Dataset.from_tensor_slices((np.zeros((8, 2)), np.zeros(8))).batch(4)
    assert pad_partial_batches(full, 2) is full  # every batch full and even: no weights added
    no_targets = tf.data.Dataset.from_tensor_slices(np.zeros((5, 2))).batch(2)
    assert pad_partial_batches(no_targets, 2) is no_targets
    assert pad_partial_batches([1, 2], 2) == [1, 2]
    # Unknown or infinite length: never read (a generator could be endless).
    endless = tf.data.Dataset.from_generator(lambda: iter([(np.zeros((3, 2)), np.zeros(3))] * 2),
                                             output_signature=(tf.TensorSpec((None, 2)), tf.TensorSpec((None,))))
    repeated = full.repeat()
    assert pad_partial_batches(endless, 2) is endless and pad_partial_batches(repeated, 3) is repeated
    # Batches of 3 for 2 replicas: each padded to 4.
    odd = tf.data.Dataset.from_tensor_slices((np.zeros((6, 2)), np.zeros(6))).batch(3)
    with pytest.warns(UserWarning, match="padded 2 examples"):
        assert [b[0].shape[0] for b in pad_partial_batches(odd, 2)] == [4, 4]
    with pytest.raises(ValueError, match="Received: multiple_of=0"):
        pad_partial_batches(full, 0)


def test_a_dataset_of_unknown_length_is_padded_as_it_comes():
    # A `filter` (as image folders and TFRecords have) leaves the length unknown: no count ahead,
    # each short batch padded to the dataset's batch size; weighted accuracy exact, the loss
    # counts the padded slot (lower than the unpadded loss).
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(12, 3)).astype("float32"), rng.integers(0, 2, 12)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True), weighted_metrics=["accuracy"])
    keep = np.arange(12) != 5
    plain = tf.data.Dataset.from_tensor_slices((x[keep], y[keep])).batch(4)
    filtered = (tf.data.Dataset.from_tensor_slices((x, y, keep)).filter(lambda a, b, k: k)
                .map(lambda a, b, k: (a, b)).batch(4))
    assert int(filtered.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    with pytest.warns(UserWarning, match="unknown length: each short batch is padded to 4"):
        padded = pad_partial_batches(filtered, 2)
    batches = list(padded)
    assert [b[0].shape[0] for b in batches] == [4, 4, 4]
    assert np.concatenate([b[2].numpy() for b in batches]).tolist() == [1.0] * 11 + [0.0]
    want, got = (model.evaluate(d, verbose=0, return_dict=True) for d in (plain, padded))
    assert np.isclose(got["accuracy"], want["accuracy"], rtol=1e-6)
    assert 0 < got["loss"] < want["loss"]


def test_empty_batches_are_padded_with_zero_weight():
    # A split of known length whose last batch is empty (e.g. padded to a fixed number of batches):
    # that batch becomes zeros of weight 0, and the loss and weighted accuracy still equal those of
    # the real examples alone (the real weight counts every batch, the empty one included).
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(5, 3)).astype("float32"), rng.integers(0, 2, 5)
    real = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    empty = tf.data.Dataset.from_tensors((tf.zeros([0, 3]), tf.zeros([0], tf.int64)))
    with_empty = real.concatenate(empty.repeat()).take(3)  # batches of 4, 1 and 0
    assert with_empty.cardinality() == 3
    with pytest.warns(UserWarning, match="padded 7 examples of weight 0"):
        padded = pad_partial_batches(with_empty, 2)
    batches = list(padded)
    assert [b[0].shape[0] for b in batches] == [4, 4, 4]
    w = np.concatenate([b[2].numpy() for b in batches])
    assert np.allclose(w, [12 / 5] * 5 + [0.0] * 7) and np.all(batches[2][0].numpy() == 0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True), weighted_metrics=["accuracy"])
    want, got = (model.evaluate(d, verbose=0, return_dict=True) for d in (real, padded))
    assert all(np.isclose(got[k], want[k], rtol=1e-6) for k in want), (got, want)
