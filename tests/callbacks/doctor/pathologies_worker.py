"""Two of test_training_doctor.py's pathologies and a hand-computed gradient, on the environment's Keras backend.

Run by test_diagnostics.py::test_gradient_findings_on_jax with KERAS_BACKEND=jax: the findings that need the
gradient probe (vanishing gradients, dead units) must be those the TensorFlow tests assert, and the gradients
with respect to the weights and to a layer's output (the "taps" that locate a NaN in the backward pass) must
match a hand computation. Prints one line of JSON.
"""

import json
import random

import keras
import numpy as np

from trainwell.callbacks import TrainingDoctor
from trainwell.callbacks.doctor.probe import GradientProbe
from trainwell.compat.gradients import loss_and_gradients

D = keras.layers.Dense


def blobs(n=512, d=10, k=3, seed=0):  # test_training_doctor.blobs
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    w = rng.normal(size=(d, k))
    return x, np.argmax(x @ w + 0.5 * rng.normal(size=(n, k)), 1)


XA, YA = blobs(2048)
X, Y = XA[:512], YA[:512]  # test_training_doctor.X, Y


def seed():
    """`keras.utils.set_random_seed(0)` without its `tf.random.set_seed` (importing TensorFlow costs seconds here):
    the layers' initializers draw their seeds from Python's `random`."""
    random.seed(0)
    np.random.seed(0)


def fit(layers, lr, epochs):
    seed()
    model = keras.Sequential([keras.Input((X.shape[1],))] + layers)
    model.compile(keras.optimizers.SGD(lr), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    doctor = TrainingDoctor(every_n_steps=10, verbose=0)
    model.fit(X, Y, batch_size=32, epochs=epochs, verbose=0, callbacks=[doctor])
    return {"findings": [f.to_dict() for f in doctor.findings], "probes": doctor.probes,
            "probe": doctor.report()["probe"], "update_ratio": doctor.last_probe.get("update_ratio")}


def hand_gradients():
    """x -> Dense "a" -> Dense "b" (no biases), MSE: the gradients against numpy's."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(6, 3)).astype("float32"), rng.normal(size=(6, 1)).astype("float32")
    wa, wb = rng.normal(size=(3, 2)).astype("float32"), rng.normal(size=(2, 1)).astype("float32")
    model = keras.Sequential([keras.Input((3,)), D(2, use_bias=False, name="a"), D(1, use_bias=False, name="b")])
    model.compile("sgd", "mse")
    model.set_weights([wa, wb])
    probe = GradientProbe(model, (x, y))
    g = loss_and_gradients(model, probe.x, probe.y, forward=probe.aux, taps=probe.act_layers)
    d_b = 2 * (x @ wa @ wb - y) / len(x)  # dL/d(output of b)
    d_a = d_b @ wb.T
    want = {"loss": np.mean((x @ wa @ wb - y) ** 2), "w_a": x.T @ d_a, "w_b": (x @ wa).T @ d_b, "out_a": d_a, "out_b": d_b}
    got = {"loss": g.loss, "w_a": g.grads[0], "w_b": g.grads[1], "out_a": g.tap_grads[0], "out_b": g.tap_grads[1]}
    return {"layers": [l.name for l in probe.act_layers],
            "max_error": {k: float(np.max(np.abs(np.asarray(got[k]) - want[k]))) for k in want}}


def main():
    out = {"backend": keras.backend.backend(), "hand": hand_gradients()}
    tiny = keras.initializers.RandomNormal(stddev=0.01)
    seed()
    out["vanishing"] = fit([D(32, activation="sigmoid", kernel_initializer=tiny, name=f"h{i}") for i in range(8)]
                           + [D(3, name="out")], 0.1, 1)
    seed()
    out["dead"] = fit([D(32, activation="relu", bias_initializer=keras.initializers.Constant(-10.0), name="dead"),
                       D(3)], 0.1, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
