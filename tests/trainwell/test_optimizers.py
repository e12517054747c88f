"""LARS against a hand-written numpy reference of TF Model Garden's update rule."""

import keras
import numpy as np
import pytest

from trainwell.optimizers import LARS, NORM_AND_BIAS_PATTERNS, LayerwiseAdamW, exclude_norm_and_bias


def numpy_lars(w, grads, lr, momentum, wd, eta, eps, nesterov, classic, decay, adapt):
    """Model Garden's `_resource_apply_dense`, step by step, in float64."""
    w = np.array(w, np.float64)
    v = np.zeros_like(w)
    for g in grads:
        g = np.array(g, np.float64)
        if decay:
            g = g + wd * w
        if classic:
            trust = 1.0
            if adapt:
                wn, gn = np.linalg.norm(w), np.linalg.norm(g)
                trust = eta * wn / (gn + eps) if (wn > 0 and gn > 0) else 1.0
            v = momentum * v + lr * trust * g
            update = momentum * v + lr * trust * g if nesterov else v
            w = w - update
        else:
            v = momentum * v + g
            update = momentum * v + g if nesterov else v
            trust = 1.0
            if adapt:
                wn, un = np.linalg.norm(w), np.linalg.norm(update)
                trust = eta * wn / (un + eps) if (wn > 0 and un > 0) else 1.0
            w = w - lr * trust * update
    return w


def _run(opt, w0, grads):
    var = keras.Variable(np.array(w0, np.float32), name="kernel")
    for g in grads:
        opt.apply_gradients([(keras.ops.convert_to_tensor(np.array(g, np.float32)), var)])
    return keras.ops.convert_to_numpy(var)


RNG = np.random.default_rng(0)
W0 = RNG.normal(size=(3, 4))
GRADS = [RNG.normal(size=(3, 4)) for _ in range(3)]


@pytest.mark.parametrize(
    "nesterov,classic,eps",
    [(False, True, 0.0), (True, True, 0.0), (False, False, 1e-3), (True, False, 0.0)],
)
def test_matches_numpy_reference_three_steps(nesterov, classic, eps):
    kw = dict(lr=0.5, momentum=0.9, wd=0.01, eta=0.02, eps=eps, nesterov=nesterov, classic=classic)
    opt = LARS(
        learning_rate=kw["lr"], momentum=kw["momentum"], weight_decay=kw["wd"],
        trust_coefficient=kw["eta"], epsilon=eps, nesterov=nesterov, classic_momentum=classic,
    )
    got = _run(opt, W0, GRADS)
    want = numpy_lars(W0, GRADS, decay=True, adapt=True, **kw)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-6)
    # The trust ratio matters: plain momentum SGD with L2 lands elsewhere.
    assert not np.allclose(got, numpy_lars(W0, GRADS, decay=True, adapt=False, **kw), atol=1e-3)


def test_decay_applied_once_not_decoupled():
    kw = dict(lr=0.5, momentum=0.9, wd=0.3, eta=0.02, eps=0.0, nesterov=False, classic=True)
    got = _run(LARS(0.5, momentum=0.9, weight_decay=0.3, trust_coefficient=0.02), W0, GRADS)
    assert np.allclose(got, numpy_lars(W0, GRADS, decay=True, adapt=True, **kw), rtol=1e-5, atol=1e-6)
    # If Keras's decoupled decay also ran, w would shrink by (1 - lr * wd) per step on top.
    double = numpy_lars(W0, GRADS, decay=True, adapt=True, **kw) * (1 - 0.5 * 0.3) ** 3
    assert not np.allclose(got, double, atol=1e-3)


def test_exclusion_by_name_pattern():
    kw = dict(lr=0.5, momentum=0.9, wd=0.01, eta=0.02, eps=0.0, nesterov=False, classic=True)
    opt = LARS(0.5, momentum=0.9, weight_decay=0.01, trust_coefficient=0.02,
               exclude_from_weight_decay=list(NORM_AND_BIAS_PATTERNS))
    kernel = keras.Variable(np.array(W0, np.float32), name="kernel")
    gamma = keras.Variable(np.array(W0, np.float32), name="gamma")
    for g in GRADS:
        t = keras.ops.convert_to_tensor(np.array(g, np.float32))
        opt.apply_gradients([(t, kernel), (t, gamma)])
    assert np.allclose(keras.ops.convert_to_numpy(kernel), numpy_lars(W0, GRADS, decay=True, adapt=True, **kw),
                       rtol=1e-5, atol=1e-6)
    # gamma: no decay and (adaptation defaults to the same list) trust ratio 1.
    assert np.allclose(keras.ops.convert_to_numpy(gamma), numpy_lars(W0, GRADS, decay=False, adapt=False, **kw),
                       rtol=1e-5, atol=1e-6)


def test_separate_layer_adaptation_exclusion():
    kw = dict(lr=0.5, momentum=0.9, wd=0.01, eta=0.02, eps=0.0, nesterov=False, classic=True)
    opt = LARS(0.5, momentum=0.9, weight_decay=0.01, trust_coefficient=0.02,
               exclude_from_weight_decay=["bias"], exclude_from_layer_adaptation=["kernel"])
    got = _run(opt, W0, GRADS)  # decayed, not adapted
    assert np.allclose(got, numpy_lars(W0, GRADS, decay=True, adapt=False, **kw), rtol=1e-5, atol=1e-6)


def test_zero_weights_use_trust_one():
    zeros = np.zeros((3, 4))
    kw = dict(lr=0.5, momentum=0.9, wd=0.01, eta=0.02, eps=0.0, nesterov=False, classic=True)
    got = _run(LARS(0.5, momentum=0.9, weight_decay=0.01, trust_coefficient=0.02), zeros, GRADS[:1])
    assert np.allclose(got, -0.5 * GRADS[0], atol=1e-6)  # trust 1 at step 1
    assert np.allclose(got, numpy_lars(zeros, GRADS[:1], decay=True, adapt=True, **kw), atol=1e-6)


def test_get_config_round_trip():
    opt = LARS(0.2, momentum=0.8, weight_decay=5e-5, trust_coefficient=0.002, epsilon=1e-9, nesterov=True,
               exclude_from_weight_decay=list(NORM_AND_BIAS_PATTERNS), exclude_from_layer_adaptation=["bias"])
    cfg = opt.get_config()
    assert cfg["weight_decay"] == 5e-5 and cfg["trust_coefficient"] == 0.002 and cfg["nesterov"] is True
    assert cfg["exclude_from_weight_decay"] == list(NORM_AND_BIAS_PATTERNS)
    clone = LARS.from_config(cfg)
    assert clone.get_config() == cfg
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(restored, LARS) and restored.get_config() == cfg
    # Same config, same updates.
    assert np.allclose(_run(opt, W0, GRADS), _run(restored, W0, GRADS))


def test_fit_with_model_excludes_batchnorm_and_bias():
    keras.utils.set_random_seed(0)
    # explicit names: auto-generated ones depend on what else ran in the process
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="dense"),
                              keras.layers.BatchNormalization(name="batch_normalization"),
                              keras.layers.Dense(2, name="dense_1")], name="sequential")
    opt = LARS(0.1, weight_decay=1e-2, exclude_from_weight_decay=list(NORM_AND_BIAS_PATTERNS))
    model.compile(optimizer=opt, loss="mse")
    x = np.random.default_rng(1).normal(size=(32, 4)).astype("float32")
    y = np.random.default_rng(2).normal(size=(32, 2)).astype("float32")
    before = [w.numpy().copy() for w in model.trainable_weights]
    hist = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert np.isfinite(hist.history["loss"]).all()
    flags = dict(zip([v.path for v in model.trainable_weights], opt._decay_flags))
    assert flags == {"sequential/dense/kernel": True, "sequential/dense/bias": False,
                     "sequential/batch_normalization/gamma": False, "sequential/batch_normalization/beta": False,
                     "sequential/dense_1/kernel": True, "sequential/dense_1/bias": False}
    assert any(not np.allclose(b, w.numpy()) for b, w in zip(before, model.trainable_weights))


def test_exclude_norm_and_bias_helper_on_adamw():
    # Zero gradients: Adam's own step is 0, so only the decoupled decay moves w.
    opt = exclude_norm_and_bias(keras.optimizers.AdamW(learning_rate=0.1, weight_decay=0.5))
    kernel = keras.Variable(np.ones((2, 2), np.float32), name="kernel")
    bias = keras.Variable(np.ones((2,), np.float32), name="bias")
    opt.apply_gradients([(np.zeros((2, 2), np.float32), kernel), (np.zeros((2,), np.float32), bias)])
    assert np.allclose(kernel.numpy(), 1 - 0.1 * 0.5)  # decayed
    assert np.allclose(bias.numpy(), 1.0)  # excluded


@pytest.mark.parametrize(
    "kwargs",
    [{"momentum": 1.0}, {"momentum": -0.1}, {"weight_decay": -1.0}, {"trust_coefficient": 0.0},
     {"epsilon": -1e-3}, {"weight_decay": float("inf")}, {"exclude_from_weight_decay": "bias"},
     {"exclude_from_layer_adaptation": ["("]}],
)
def test_invalid_arguments(kwargs):
    with pytest.raises(ValueError, match="Received: "):
        LARS(**kwargs)


def test_fit_under_mixed_float16_loss_scaling():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(2, dtype="float32")])
        opt = LARS(0.5, weight_decay=1e-3, exclude_from_weight_decay=list(NORM_AND_BIAS_PATTERNS))
        model.compile(optimizer=opt, loss="mse")
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        x = np.random.default_rng(1).normal(size=(64, 4)).astype("float32")
        y = x[:, :2] * 2.0
        hist = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
        assert np.isfinite(hist.history["loss"]).all()
        assert hist.history["loss"][-1] < hist.history["loss"][0]
        assert all(w.dtype == "float32" for w in model.trainable_weights)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _tiny_dense(seed=1):
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="gelu", name="body")(inputs)
    h = keras.layers.LayerNormalization(name="norm")(h)
    return keras.Model(inputs, keras.layers.Dense(2, name="logits")(h))


def _three_steps(opt, run_eagerly=True):
    """Three `train_on_batch` steps; eager by default (a traced train function costs ~4 s per model here)."""
    import keras

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 6)).astype("float32"), rng.integers(0, 2, 16)
    model = _tiny_dense()
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  run_eagerly=run_eagerly)
    before = {v.path: v.numpy().copy() for v in model.trainable_variables}
    for _ in range(3):
        model.train_on_batch(x, y)
    return model, before, {v.path: v.numpy() for v in model.trainable_variables}


def test_layerwise_adamw_matches_adamw_and_scales_or_freezes_variables():
    import keras

    LW = LayerwiseAdamW
    _, before, ref = _three_steps(keras.optimizers.AdamW(1e-2, weight_decay=0.1))
    _, _, ours = _three_steps(LW(learning_rate=1e-2, weight_decay=0.1))
    assert ref.keys() == ours.keys() and all(np.allclose(ref[k], ours[k], atol=1e-7) for k in ref)
    # a factor of 0: that variable never moves (no update, no decay); the others move as with AdamW
    _, _, zero = _three_steps(LW(learning_rate=1e-2, weight_decay=0.1, lr_scales={"body/kernel": 0.0}))
    assert np.array_equal(zero["body/kernel"], before["body/kernel"])
    assert not np.allclose(zero["logits/kernel"], before["logits/kernel"])
    # a factor of 0.5 with SGD-like first Adam steps: the move is about half AdamW's
    _, _, half = _three_steps(LW(learning_rate=1e-2, weight_decay=0.0, lr_scales={"logits/kernel": 0.5}))
    _, _, full = _three_steps(LW(learning_rate=1e-2, weight_decay=0.0))
    step_half = np.abs(half["logits/kernel"] - before["logits/kernel"]).mean()
    step_full = np.abs(full["logits/kernel"] - before["logits/kernel"]).mean()
    assert 0.4 < step_half / step_full < 0.6
    # freeze phase: the frozen variables stay put for `freeze_steps`, the rest trains at head_lr;
    # traced, as `fit` runs it (the factor and the LR are tensors of `iterations` here)
    frozen = ["body/kernel", "body/bias", "norm/gamma", "norm/beta"]
    model, before, after = _three_steps(
        LW(learning_rate=1e-9, weight_decay=0.1, frozen_variables=frozen, freeze_steps=3, head_lr=1e-2),
        run_eagerly=False)
    for p in before:
        assert np.array_equal(after[p], before[p]) == (p in frozen), p
    assert np.isclose(float(model.optimizer.learning_rate), 1e-9)  # after the phase: the schedule again
    config = LW(learning_rate=1e-3, weight_decay=0.1, lr_scales={"a": 0.5}, freeze_steps=2).get_config()
    assert (config["lr_scales"], config["freeze_steps"]) == ({"a": 0.5}, 2)
    with pytest.raises(ValueError, match="Received: freeze_steps=-1"):
        LW(learning_rate=1e-3, weight_decay=0.1, freeze_steps=-1)


def test_layerwise_adamw_head_phase_without_head_lr_runs_at_the_schedule_step_0_value():
    from trainwell.callbacks.schedules import WarmupCosineDecay

    sched = WarmupCosineDecay(0.1, total_steps=10)  # no warmup: 0.1 at step 0
    opt = LayerwiseAdamW(learning_rate=sched, weight_decay=0.0, freeze_steps=2)
    sched.multiplier.assign(0.5)  # what a NaN rollback does: the LR is halved, not quartered
    assert float(opt.learning_rate) == pytest.approx(0.05)
    opt.head_lr = 0.2  # with head_lr, the multiplier applies to it
    assert float(opt.learning_rate) == pytest.approx(0.1)


@pytest.mark.parametrize("kwargs,match", [
    ({"head_lr": True}, "Received: head_lr=True"),
    ({"lr_scales": {"a": -1.0}}, r"Expected factors >= 0 \('a' has -1.0\)"),
    ({"lr_scales": {"a": float("inf")}}, "Received: lr_scales="),
])
def test_layerwise_adamw_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LayerwiseAdamW(learning_rate=1e-3, **kwargs)
