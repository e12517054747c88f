"""trainwell.losses: Keras's CategoricalCrossentropy with the label smoothing in a variable.

Keras's own tests for the class run against it in tests/conformance/; here: bit-for-bit
equality with Keras's loss (values and gradients, several dtypes), a new value taking effect
in an already traced train step without a new trace, the config, bad input, and the JAX
backend (a plain float there, as in Keras).
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainwell.losses import CategoricalCrossentropy


def _batch(n=32, classes=10, seed=0):
    rng = np.random.default_rng(seed)
    return np.eye(classes, dtype="float32")[rng.integers(0, classes, n)], (3 * rng.normal(size=(n, classes))).astype("float32")


@pytest.mark.parametrize("dtype", [None, "float16", "bfloat16"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.15933, 1 / 3, 1.0])
def test_values_and_gradients_are_keras_bit_for_bit(smoothing, dtype):
    y, logits = _batch()
    for from_logits in (True, False):
        pred = logits if from_logits else tf.nn.softmax(logits).numpy()
        results = []
        for cls in (CategoricalCrossentropy, keras.losses.CategoricalCrossentropy):
            loss = cls(from_logits=from_logits, label_smoothing=smoothing, dtype=dtype)
            x = tf.constant(pred)
            with tf.GradientTape() as tape:
                tape.watch(x)
                value = loss(y, x)
            results.append((value.numpy().tobytes(), tape.gradient(value, x).numpy().tobytes()))
        assert results[0] == results[1], (smoothing, dtype, from_logits)


def test_a_new_smoothing_takes_effect_in_the_traced_train_step_without_a_new_trace():
    y, x = _batch(64)
    models = []
    for cls in (CategoricalCrossentropy, keras.losses.CategoricalCrossentropy):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=cls(from_logits=True, label_smoothing=0.2))
        models.append(model)
    ours, theirs = models
    ours.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    traced = ours.train_function
    ours.loss.label_smoothing = 0.05
    history = ours.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history
    assert ours.train_function is traced and ours.loss.uses_variable  # the same traced step, no new trace
    # Keras's loss at the same values, in a model compiled anew for the second value: the same weights
    theirs.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    theirs.compile(optimizer=theirs.optimizer, loss=keras.losses.CategoricalCrossentropy(from_logits=True,
                                                                                         label_smoothing=0.05))
    expected = theirs.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history
    # Not bit for bit in a traced step: TensorFlow's graph optimizer folds Keras's constants
    # (y * 0.8 + 0.02) where this reads variables, and rounds differently (about 1e-8 here).
    assert history["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert all(np.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(ours.get_weights(), theirs.get_weights()))
    # ... and far from training on at the old value
    keras.utils.set_random_seed(0)
    stale = keras.Sequential([keras.Input((10,)), keras.layers.Dense(10)])
    stale.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.CategoricalCrossentropy(
        from_logits=True, label_smoothing=0.2))
    stale.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert not np.allclose(ours.get_weights()[0], stale.get_weights()[0], rtol=0, atol=1e-3)


def test_config_serialization_and_the_received_idiom():
    loss = CategoricalCrossentropy(from_logits=True, label_smoothing=0.1, axis=-1, name="cce")
    loss.label_smoothing = 0.05
    config = loss.get_config()
    assert config == {**keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.05,
                                                             name="cce").get_config()}
    revived = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(loss))
    assert type(revived) is CategoricalCrossentropy and revived.label_smoothing == 0.05
    for bad in (-0.1, 1.5, "0.1", True, None):
        with pytest.raises(ValueError, match=rf"Received: label_smoothing={bad!r}"):
            CategoricalCrossentropy(label_smoothing=bad)
    with pytest.raises(ValueError, match="Received: label_smoothing=2"):
        loss.label_smoothing = 2
    assert loss.label_smoothing == 0.05  # a refused value changes nothing


def test_on_jax_the_smoothing_is_a_plain_float_as_in_keras(python_subprocess):
    pytest.importorskip("jax", reason="JAX is not installed; the JAX backend is not tested")
    r = python_subprocess("""
    import json, numpy as np, keras
    from trainwell.losses import CategoricalCrossentropy
    from trainwell.tuning.tuners import _without_variables
    y = np.eye(3, dtype="float32")[[0, 1, 2, 0]]
    x = np.random.default_rng(0).normal(size=(4, 3)).astype("float32")
    ours = CategoricalCrossentropy(from_logits=True, label_smoothing=0.1)
    theirs = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1)
    masked = _without_variables(keras.saving.serialize_keras_object(ours))["config"]["label_smoothing"]
    print(json.dumps({"backend": keras.backend.backend(), "variable": ours.uses_variable, "masked": masked,
                      "equal": np.asarray(ours(y, x)).tobytes() == np.asarray(theirs(y, x)).tobytes()}))
    """, env={"KERAS_BACKEND": "jax"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"backend": "jax", "variable": False, "masked": 0.1,
                                                        "equal": True}
