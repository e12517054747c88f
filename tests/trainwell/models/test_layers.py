import numpy as np
import pytest
import tensorflow as tf

import keras

from trainwell.models.layers import FusedBatchNormalization


def _pair(dtype="float32", **kw):
    a = keras.layers.BatchNormalization(momentum=0.9, gamma_initializer="random_normal",
                                        beta_initializer="random_normal", dtype=dtype, **kw)
    b = FusedBatchNormalization(momentum=0.9, gamma_initializer="random_normal", dtype=dtype, **kw)
    return a, b


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("mixed_float16", 3e-3)])
@pytest.mark.parametrize("training", [True, False])
def test_same_outputs_gradients_and_moving_stats_as_keras(dtype, tol, training):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(2.0, 3.0, size=(8, 5, 5, 6)).astype("float32"))
    r = tf.constant(rng.normal(size=(8, 5, 5, 6)).astype("float32"))
    a, b = _pair(dtype)
    a.build(x.shape)
    b.build(x.shape)
    b.set_weights(a.get_weights())
    grads = []
    for layer in (a, b):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=training)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * r)
        grads.append((y, tape.gradient(loss, [x] + layer.trainable_variables)))
    (ya, ga), (yb, gb) = grads
    assert ya.dtype == yb.dtype
    np.testing.assert_allclose(np.asarray(yb, "float32"), np.asarray(ya, "float32"), atol=tol, rtol=tol)
    for g1, g2 in zip(ga, gb):
        np.testing.assert_allclose(np.asarray(g2), np.asarray(g1), atol=tol * 10, rtol=tol)
    for w1, w2 in zip(a.get_weights(), b.get_weights()):  # moving mean / variance (biased) updated alike
        np.testing.assert_allclose(w2, w1, atol=1e-6, rtol=1e-6)
    if training:
        assert not np.allclose(b.get_weights()[2], 0.0)  # the moving mean did move


def test_falls_back_to_keras_where_the_kernel_does_not_apply():
    x = np.random.default_rng(1).normal(size=(4, 7)).astype("float32")  # 2-D input
    a, b = _pair()
    a.build(x.shape)
    b.build(x.shape)
    b.set_weights(a.get_weights())
    np.testing.assert_allclose(b(x, training=True), a(x, training=True), atol=1e-6)
    assert not b._fused_applies(tf.zeros((2, 3, 3, 4)), mask=tf.ones((2, 3, 3), bool))
    assert not FusedBatchNormalization(axis=1)._fused_applies(tf.zeros((2, 3, 3, 4)), None)
    assert not FusedBatchNormalization(fused=False)._fused_applies(tf.zeros((2, 3, 3, 4)), None)
    with pytest.raises(ValueError, match="Received: fused='no'"):
        FusedBatchNormalization(fused="no")


def test_frozen_layer_uses_moving_statistics():
    x = np.random.default_rng(2).normal(1.0, 2.0, size=(4, 3, 3, 2)).astype("float32")
    b = FusedBatchNormalization()
    b.build(x.shape)
    b.trainable = False
    before = [w.copy() for w in b.get_weights()]
    np.testing.assert_allclose(b(x, training=True), b(x, training=False), atol=1e-6)
    for w0, w1 in zip(before, b.get_weights()):
        np.testing.assert_array_equal(w0, w1)


def test_config_and_saved_model_round_trip(tmp_path):
    inp = keras.Input((6, 6, 3))
    out = keras.layers.GlobalAveragePooling2D()(FusedBatchNormalization(momentum=0.8, epsilon=1e-5, fused=False)(inp))
    model = keras.Model(inp, out)
    model(np.ones((2, 6, 6, 3), "float32"), training=True)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    layer = loaded.layers[1]
    assert isinstance(layer, FusedBatchNormalization)
    assert (layer.momentum, layer.epsilon, layer.fused) == (0.8, 1e-5, False)
    x = np.random.default_rng(3).normal(size=(2, 6, 6, 3)).astype("float32")
    np.testing.assert_allclose(loaded(x), model(x), atol=1e-6)
