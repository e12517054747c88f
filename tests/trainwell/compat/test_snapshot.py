"""trainwell.compat.snapshot on the TensorFlow backend (JAX: the NaNRollback, doctor and checkpoint JAX tests).

What the three callbacks rely on: a snapshot keeps its values while training
updates the variables (copy-on-write, no copy when taken) and can be put back
more than once; a function on the state leaves the variables a training-mode
forward pass updates as they were; the functions joined in one call are traced
once each; TensorFlow's global generator round-trips.
"""

import keras
import numpy as np
import tensorflow as tf

from trainwell.compat.snapshot import (
    Snapshot,
    function_on_state,
    in_one_call,
    read_function,
    set_tf_rng_state,
    state_function,
    tf_rng_state,
    to_host,
)


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.BatchNormalization(),
                              keras.layers.Dropout(0.5), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.1), "mse", metrics=["mae"])
    return model


def _train(model, steps=3):
    x = np.random.default_rng(1).normal(size=(8 * steps, 3)).astype("float32")
    model.fit(x, x[:, :1] * 2, batch_size=8, epochs=1, verbose=0)


def test_a_snapshot_outlives_training_and_restores_twice():
    model = _model()
    _train(model, 1)
    variables = list(model.weights) + list(model.optimizer.variables)
    snap = Snapshot.of(model, variables)
    snap.take()
    before = [v.numpy().copy() for v in variables]
    _train(model)
    assert not all(np.array_equal(a, v.numpy()) for a, v in zip(before, variables))
    assert all(np.array_equal(a, to_host(x)) for a, x in zip(before, snap.values))  # kept while training went on
    for _ in range(2):
        snap.restore()
        assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, variables))
        _train(model)


def test_a_function_on_the_state_leaves_it_as_it_was():
    model = _model()
    _train(model, 1)
    before = [v.numpy().copy() for v in model.variables + model.metrics_variables]
    x = tf.constant(np.full((8, 3), 5.0, "float32"))

    def forward(state, x):  # training mode, as the doctor's probe runs it: BatchNorm's statistics and the seed move
        return keras.ops.mean(model(x, training=True)) + keras.ops.sum(state[0][0])

    fn = function_on_state(model, forward)
    assert np.isfinite(float(fn(x)))
    after = [v.numpy() for v in model.variables + model.metrics_variables]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    model(x, training=True)  # what the function undid: the same call outside it changes them
    assert not all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.non_trainable_variables))


def test_functions_in_one_call_are_traced_once_each():
    model = _model()
    read = read_function(model, model.weights)
    total = state_function(model, model.weights, lambda vals: keras.ops.sum(vals[0]))
    both = in_one_call(read, total)
    values, s = both()
    both()
    read()
    total()
    assert [f.experimental_get_tracing_count() for f in (read, total, both)] == [1, 1, 1]
    assert np.isclose(float(s), float(np.sum(model.weights[0].numpy())))
    assert len(values) == len(model.weights)


def test_tf_rng_state_round_trip():
    tf.random.set_global_generator(tf.random.Generator.from_seed(3))
    saved = tf_rng_state()
    first = tf.random.get_global_generator().normal([3]).numpy()
    set_tf_rng_state(*saved)
    assert np.array_equal(tf.random.get_global_generator().normal([3]).numpy(), first)
