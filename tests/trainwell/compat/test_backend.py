"""trainwell.compat.backend: `build_before_fit` on the TensorFlow backend (JAX: tests/callbacks/crash_worker.py).

Keras's TensorFlow `fit` without a distribution strategy builds the compiled metrics
(and an unbuilt optimizer) inside the first trace of the train function, and
`tf.function` then traces the train step a second time. `build_before_fit` builds
first: one trace. The counts below fail without it, and fail when Keras changes
how often it traces (then the docstring's reason is out of date).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainwell.compat import build_before_fit


def _count_traces(model):
    """Wraps the model's train and test steps: each Python call of one is a trace."""
    model.traces = {"train": 0, "test": 0}
    for kind in ("train", "test"):
        step = getattr(model, f"{kind}_step")

        def counted(data, kind=kind, step=step):
            model.traces[kind] += 1
            return step(data)

        setattr(model, f"{kind}_step", counted)
    return model


def _data():
    rs = np.random.RandomState(0)
    x, y = rs.randn(64, 4).astype("float32"), rs.randint(0, 3, 64)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16)


def _model(with_input=True):
    keras.utils.set_random_seed(0)
    layers = ([keras.Input((4,))] if with_input else []) + [keras.layers.Dense(8, activation="relu"),
                                                            keras.layers.Dense(3)]
    m = _count_traces(keras.Sequential(layers))
    m.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
    return m


@pytest.mark.parametrize("with_input", [True, False], ids=["input", "no_input"])
def test_one_trace_of_the_train_step_and_the_same_training(with_input):
    ds = _data()
    plain = _model(with_input)
    h_plain = plain.fit(ds, validation_data=ds, epochs=2, verbose=0)
    assert plain.traces == {"train": 2, "test": 1}  # Keras alone: the train step traced twice

    built = _model(with_input)
    build_before_fit(built, ds)
    assert built.built and built.optimizer.built
    h_built = built.fit(ds, validation_data=ds, epochs=2, verbose=0)
    assert built.traces == {"train": 1, "test": 1}
    for key in h_plain.history:
        np.testing.assert_allclose(h_built.history[key], h_plain.history[key], rtol=1e-6, err_msg=key)
    for a, b in zip(built.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_variables_of_the_models_strategy():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        m = _model()
    build_before_fit(m, _data())
    assert all(isinstance(v.value, tf.distribute.DistributedValues) for v in m.optimizer.variables)
    assert all(isinstance(v.value, tf.distribute.DistributedValues) for v in m.metrics_variables)


def test_an_unbuilt_model_is_not_built_from_a_guessed_length():
    # A length-1 guess fails in Conv1D (kernel 3); a Sequential model tried with a shape
    # stays configured to it, and Keras's own build from the first batch would then fail.
    m = keras.Sequential([keras.layers.Embedding(10, 4), keras.layers.Conv1D(2, 3),
                          keras.layers.GlobalMaxPooling1D(), keras.layers.Dense(1)])
    m.compile("sgd", "mse")
    x = np.random.RandomState(0).randint(0, 10, (8, 5))
    ds = tf.data.Dataset.from_tensor_slices((x, np.ones((8, 1), "float32"))).batch(4)
    ds = ds.padded_batch(1, padded_shapes=([None, None], [None, None])).unbatch()  # hides the length
    assert ds.element_spec[0].shape.as_list() == [None, None]
    build_before_fit(m, ds)
    assert not m.built  # left to Keras
    m.fit(ds, epochs=1, verbose=0)
    assert m.built


def test_reseeding_keeps_compiled_functions_unless_a_traced_function_holds_random_state(python_subprocess):
    # A fresh interpreter: a function with a stateful random op that an earlier test left in this
    # process's context (Keras's terminate_on_nan_test leaves one, and it cannot be removed) turns it off.
    r = python_subprocess("""
    import keras, tensorflow as tf
    from trainwell.compat.backend import reseeding_keeps_compiled_functions

    with reseeding_keeps_compiled_functions() as kept:
        keras.utils.set_random_seed(0)
    assert kept is True, kept

    @tf.function(autograph=False)
    def draws(x):
        return x + tf.random.uniform([2])  # its stream restarts only with a new kernel: the caches must go

    draws(tf.constant(0.0))
    with reseeding_keeps_compiled_functions() as kept:
        keras.utils.set_random_seed(0)
        first = draws(tf.constant(0.0)).numpy()
    keras.utils.set_random_seed(0)
    assert kept is False and (draws(tf.constant(0.0)).numpy() == first).all()  # restarted, as without the block
    print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_callback_model_reads_the_attribute_keras_set_model_sets():
    # `compat.backend.callback_model` reads `Callback._model` on JAX (the property syncs the state):
    # this fails when Keras keeps a callback's model under another name.
    cb = keras.callbacks.Callback()
    model = keras.Sequential()
    cb.set_model(model)
    assert cb._model is model
