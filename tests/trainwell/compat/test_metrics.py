"""trainwell.compat.metrics: the one "is this better" rule is Keras's own."""

import itertools

import keras
import numpy as np
import pytest

from trainwell.compat import is_improvement, metric_direction, monitored_value


def test_direction_from_the_models_compiled_metrics_as_keras_says():
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    m.compile("sgd", "mse", metrics=["accuracy", "mae"])
    m.fit(np.ones((4, 3)), np.zeros((4, 2)), epochs=1, verbose=0)  # builds the compiled metrics
    for monitor, mode in itertools.product(["val_loss", "accuracy", "val_mae", "unknown"], ["auto", "min", "max"]):
        keras_cb = keras.callbacks.EarlyStopping(monitor=monitor, mode=mode)
        keras_cb.set_model(m)
        try:
            keras_cb._set_monitor_op()
            expected = "max" if keras_cb.monitor_op == keras.ops.greater else "min"
        except ValueError:
            expected = None
        assert metric_direction(monitor, mode, m) == expected, (monitor, mode)


def test_direction_by_name_without_a_model():
    assert [metric_direction(n) for n in ["val_loss", "val_accuracy", "auc", "val_top_k_categorical_accuracy",
                                          "val_crossentropy", "val_mae", "custom"]] == [
        "min", "max", "max", "max", "min", None, None]
    with pytest.raises(ValueError, match="Received: mode='up'"):
        metric_direction("loss", "up")


@pytest.mark.parametrize("mode", ["min", "max"])
def test_is_improvement_matches_keras_incl_min_delta_and_size1_arrays(mode):
    # Binary fractions: Keras compares in float32, these are exact there too (ties included).
    keras_cb = keras.callbacks.EarlyStopping(monitor="loss", mode=mode, min_delta=0.25)
    keras_cb._set_monitor_op()
    for c, r in itertools.product([0.0, 0.25, 0.5, 0.75, 1.0], [0.0, 0.5, 1.0]):
        expected = bool(keras_cb._is_improvement(np.array([c]), r))
        assert is_improvement(np.array([c]), r, mode, min_delta=0.25) == expected, (c, r)
    assert is_improvement(1.0, None, mode)


def test_monitored_value_takes_one_element_only():
    assert monitored_value(np.array([[0.5]])) == 0.5
    with pytest.raises(ValueError, match=r"EarlyStopping cannot monitor `f1`: its value has shape \(2,\)"):
        monitored_value(np.array([0.1, 0.2]), "f1", "EarlyStopping")
