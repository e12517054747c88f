import json
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainwell.callbacks.schedules import (
    WarmupCosineDecay,
    WarmupLinearDecay,
    WarmupStepDecay,
    current_lr,
    get_lr_multiplier,
    scale_learning_rate,
    scaled_lr,
    set_lr_multiplier,
)

# Each case: the schedule, its warmup start/length and peak, the steps where an
# SGDR cycle restarts, where it ends (and at which value), and hand-computed points.
CASES = {
    "cosine_no_warmup": dict(
        make=lambda: WarmupCosineDecay(peak_lr=0.1, total_steps=100),
        start=0.1, warmup=0, peak=0.1, restarts=[], end=100, end_value=0.0,
        points={50: 0.05, 25: 0.05 * (1 + math.cos(math.pi / 4))},
    ),
    "cosine_warmup": dict(
        make=lambda: WarmupCosineDecay(0.1, 100, warmup_steps=10, min_lr=0.01, warmup_start=0.001),
        start=0.001, warmup=10, peak=0.1, restarts=[], end=100, end_value=0.01,
        points={5: 0.0505, 55: 0.055},
    ),
    "sgdr_t_mul2_m_mul_half": dict(
        make=lambda: WarmupCosineDecay(1.0, 150, warmup_steps=10, min_lr=0.1, restart_steps=20, t_mul=2.0, m_mul=0.5),
        start=0.0, warmup=10, peak=1.0, restarts=[30, 70], end=150, end_value=0.1,
        # cycle heights 0.9, 0.45, 0.225 above min_lr; mid-cycle = min + height / 2
        points={20: 0.55, 30: 0.55, 50: 0.325, 70: 0.325, 110: 0.2125},
    ),
    "sgdr_last_cycle_absorbs_remainder": dict(
        # cycles 20, 40, then 80 + 25 left over (a 160-step cycle does not fit)
        make=lambda: WarmupCosineDecay(1.0, 175, warmup_steps=10, restart_steps=20, t_mul=2.0),
        start=0.0, warmup=10, peak=1.0, restarts=[30, 70], end=175, end_value=0.0,
        points={70: 1.0, 20: 0.5, 50: 0.5, 70 + 105 // 2: 0.5 * (1 + math.cos(math.pi * 52 / 105))},
    ),
    "sgdr_t_mul1_no_warmup": dict(
        make=lambda: WarmupCosineDecay(0.5, 100, restart_steps=25, m_mul=0.8),
        start=0.5, warmup=0, peak=0.5, restarts=[25, 50, 75], end=100, end_value=0.0,
        points={25: 0.4, 50: 0.32, 75: 0.256, 87: 0.128 * (1 + math.cos(math.pi * 12 / 25))},
    ),
    "linear_warmup": dict(
        make=lambda: WarmupLinearDecay(0.2, 100, warmup_steps=10, min_lr=0.02),
        start=0.0, warmup=10, peak=0.2, restarts=[], end=100, end_value=0.02,
        points={55: 0.11, 3: 0.06},
    ),
    "linear_no_warmup": dict(
        make=lambda: WarmupLinearDecay(2e-5, 40),
        start=2e-5, warmup=0, peak=2e-5, restarts=[], end=40, end_value=0.0,
        points={10: 1.5e-5},
    ),
    "step_goyal": dict(
        make=lambda: WarmupStepDecay(0.4, boundaries=[30, 60, 80], decay_rate=0.1, warmup_steps=5, warmup_start=0.04),
        start=0.04, warmup=5, peak=0.4, restarts=[], end=80, end_value=0.0004,
        points={29: 0.4, 30: 0.04, 59: 0.04, 60: 0.004, 79: 0.004},
    ),
}


def _values(schedule, steps):
    return np.asarray(keras.ops.convert_to_numpy(schedule(np.asarray(steps))), dtype=np.float64)


@pytest.mark.parametrize("name", sorted(CASES))
def test_schedule_invariants(name):
    case = CASES[name]
    s = case["make"]()
    w, peak, end = case["warmup"], case["peak"], case["end"]
    n = end + 30
    v = _values(s, np.arange(n))
    tol = dict(rtol=1e-5, atol=1e-8 * peak)

    # value at 0 and the linear warmup
    assert np.allclose(v[0], case["start"], **tol)
    if w:
        assert np.allclose(v[: w + 1], np.linspace(case["start"], peak, w + 1), **tol)
        # continuity at the warmup boundary: no jump bigger than one warmup step
        assert abs(v[w] - v[w - 1]) <= (peak - case["start"]) / w * (1 + 1e-5)
    assert abs(v[w + 1] - v[w]) <= 0.05 * peak
    # the peak: reached at the end of warmup, never exceeded
    assert np.allclose(v[w], peak, **tol)
    assert np.allclose(v.max(), peak, **tol) and int(np.argmax(v >= peak * (1 - 1e-6))) == w
    # the endpoint, held afterwards
    assert np.allclose(v[end:], case["end_value"], **tol)
    assert v[end - 1] > case["end_value"]  # reached exactly at `end`, not before
    # monotone decay between restarts, and a jump up at each restart
    bounds = [w, *case["restarts"], n]
    for a, b in zip(bounds, bounds[1:]):
        assert np.all(np.diff(v[a:b]) <= 1e-7 * peak), (a, b)
    for r in case["restarts"]:
        assert v[r] > v[r - 1] + 0.1 * peak
    # hand-computed points
    for step, expected in case["points"].items():
        assert np.allclose(v[step], expected, **tol), (step, v[step], expected)
    # resume: a fresh schedule from the config, evaluated from the resumed step on
    for r in sorted({w, (w + end) // 2, *case["restarts"], end - 1}):
        fresh = type(s).from_config(json.loads(json.dumps(s.get_config())))
        assert np.allclose(_values(fresh, np.arange(r, n)), v[r:], **tol)
    # graph-safe: the same values inside a tf.function on an int64 step variable
    step_var = tf.Variable(0, dtype=tf.int64)
    fn = tf.function(lambda: s(step_var))
    for step in (0, w, (w + end) // 2, end, n - 1):
        step_var.assign(step)
        assert np.allclose(float(fn()), v[step], **tol)


@pytest.mark.parametrize("name", sorted(CASES))
def test_serialization_round_trip(name):
    s = CASES[name]["make"]()
    payload = json.loads(json.dumps(keras.saving.serialize_keras_object(s)))
    assert payload["registered_name"] == f"trainwell>{type(s).__name__}"
    restored = keras.saving.deserialize_keras_object(payload)
    assert type(restored) is type(s)
    assert restored.get_config() == s.get_config()
    steps = np.arange(CASES[name]["end"] + 5)
    assert np.allclose(_values(restored, steps), _values(s, steps))
    # inside an optimizer's config, too (what model.save stores)
    opt = keras.optimizers.SGD.from_config(keras.optimizers.SGD(learning_rate=s).get_config())
    assert type(opt.learning_rate) is not type(s)  # the property evaluates the schedule
    assert type(opt._learning_rate) is type(s) and opt._learning_rate.get_config() == s.get_config()


def test_get_config_equals_constructor_kwargs():
    kwargs = dict(peak_lr=1.0, total_steps=150, warmup_steps=10, min_lr=0.1, warmup_start=0.01,
                  restart_steps=20, t_mul=2.0, m_mul=0.5)
    assert WarmupCosineDecay(**kwargs).get_config() == kwargs
    kwargs = dict(peak_lr=0.2, total_steps=100, warmup_steps=10, min_lr=0.02, warmup_start=0.0)
    assert WarmupLinearDecay(**kwargs).get_config() == kwargs
    kwargs = dict(peak_lr=0.4, boundaries=[30, 60], decay_rate=0.5, warmup_steps=5, warmup_start=0.0)
    assert WarmupStepDecay(**kwargs).get_config() == kwargs
    assert WarmupCosineDecay(1.0, 150, 10, restart_steps=20, t_mul=2.0).cycle_starts() == [10, 30, 70]


def _built_sgd(lr):
    var = keras.Variable(np.zeros((1,), "float32"))
    opt = keras.optimizers.SGD(learning_rate=lr)
    opt.build([var])
    return opt, var


def test_multiplier_helpers_on_trainwell_schedule():
    s = WarmupCosineDecay(0.1, 100, warmup_steps=10)
    opt, var = _built_sgd(s)
    with pytest.raises(TypeError, match="not settable"):  # why the multiplier exists
        opt.learning_rate = 0.01
    opt.iterations.assign(40)
    lr40 = 0.05 * (1 + math.cos(math.pi * 30 / 90))
    assert np.allclose(current_lr(opt), lr40)
    assert get_lr_multiplier(opt) == 1.0
    old, new = scale_learning_rate(opt, 0.5)
    assert np.allclose([old, new], [lr40, lr40 / 2])
    assert np.allclose(get_lr_multiplier(opt), 0.5)
    # the optimizer really steps with the lowered LR (gradient 1 -> delta = -lr)
    opt.apply([keras.ops.ones((1,))], [var])
    assert np.allclose(var.numpy(), [-lr40 / 2])
    # a checkpoint saves and restores the multiplier; the schedule keeps its shape
    saved = get_lr_multiplier(opt)
    set_lr_multiplier(opt, 1.0)
    assert np.allclose(current_lr(opt), _values(s, [41])[0])
    set_lr_multiplier(opt, saved)
    assert np.allclose(current_lr(opt), 0.5 * 0.05 * (1 + math.cos(math.pi * 31 / 90)))


def test_multiplier_helpers_on_plain_and_foreign_lr():
    opt, _ = _built_sgd(0.1)
    assert np.allclose(scale_learning_rate(opt, 0.25), [0.1, 0.025])
    assert np.allclose(current_lr(opt), 0.025)
    assert get_lr_multiplier(opt) == 1.0
    # a multiplier restored before WarmupCosine installs its schedule waits on the optimizer
    set_lr_multiplier(opt, 0.5)
    assert get_lr_multiplier(opt) == 0.5 and np.allclose(current_lr(opt), 0.025)

    foreign, _ = _built_sgd(keras.optimizers.schedules.CosineDecay(0.1, 100))
    with pytest.raises(ValueError, match="Use a trainwell schedule"):
        scale_learning_rate(foreign, 0.5)
    with pytest.raises(ValueError, match="Received: factor=0"):
        scale_learning_rate(opt, 0)
    with pytest.raises(TypeError, match="keras.optimizers.Optimizer"):
        current_lr("sgd")


def test_multiplier_helpers_through_loss_scale_optimizer():
    s = WarmupLinearDecay(0.2, 100, warmup_steps=10)
    var = keras.Variable(np.zeros((1,), "float32"))
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=s))
    opt.build([var])
    opt.inner_optimizer.iterations.assign(55)
    assert np.allclose(current_lr(opt), 0.1)
    assert np.allclose(scale_learning_rate(opt, 0.5), [0.1, 0.05])
    assert np.allclose(s.multiplier.numpy(), 0.5)
    assert np.allclose(get_lr_multiplier(opt), 0.5)
    set_lr_multiplier(opt, 0.25)
    assert np.allclose(s.multiplier.numpy(), 0.25)
    assert np.allclose(current_lr(opt), 0.025)
    plain = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.1))
    plain.build([var])
    assert np.allclose(scale_learning_rate(plain, 0.1), [0.1, 0.01])


def test_scaled_lr():
    assert np.allclose(scaled_lr(0.1, 8192), 3.2)
    assert np.allclose(scaled_lr(0.1, 256), 0.1)
    assert np.allclose(scaled_lr(1e-3, 64, base_batch=32), 2e-3)
    with pytest.raises(ValueError, match="Received: global_batch=0"):
        scaled_lr(0.1, 0)


# Keras's CosineDecay arguments, and the same curve as WarmupCosineDecay (the mapping in its docstring).
# The first two are what WarmupCosineDecay used to refuse: float steps, a warmup that goes down.
KERAS_COSINE = [
    dict(initial_learning_rate=0.1, decay_steps=1000.0, alpha=0.1),
    dict(initial_learning_rate=0.5, decay_steps=90, warmup_target=0.1, warmup_steps=10.0),
    dict(initial_learning_rate=0.0, decay_steps=90, alpha=0.2, warmup_target=0.3, warmup_steps=10),
]


@pytest.mark.parametrize("kw", KERAS_COSINE)
def test_accepts_what_keras_cosine_decay_accepts(kw):
    a, d, r, t, w = (kw["initial_learning_rate"], kw["decay_steps"], kw.get("alpha", 0.0),
                     kw.get("warmup_target"), kw.get("warmup_steps", 0))
    if t is None:
        ours = WarmupCosineDecay(peak_lr=a, total_steps=d, min_lr=r * a)
    else:
        ours = WarmupCosineDecay(peak_lr=t, total_steps=w + d, warmup_steps=w, min_lr=r * t, warmup_start=a)
    steps = np.unique(np.linspace(0, 1.2 * (w + d), 61).astype(int))
    expected = [float(keras.optimizers.schedules.CosineDecay(**kw)(int(step))) for step in steps]
    assert np.allclose(_values(ours, steps), expected, rtol=1e-5, atol=1e-7)
    assert WarmupCosineDecay.from_config(ours.get_config()).get_config() == ours.get_config()
    assert type(ours.get_config()["total_steps"]) is type(w + d)  # the float stays a float


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: WarmupCosineDecay(0.0, 100), "Received: peak_lr=0.0"),
        (lambda: WarmupCosineDecay(0.1, 0), "Received: total_steps=0"),
        (lambda: WarmupCosineDecay(0.1, 100, warmup_steps=101), "Received: warmup_steps=101"),
        (lambda: WarmupCosineDecay(0.1, 100, warmup_steps=-1), "Received: warmup_steps=-1"),
        (lambda: WarmupCosineDecay(0.1, 100, min_lr=0.2), "Received: min_lr=0.2"),
        (lambda: WarmupCosineDecay(0.1, 100, warmup_start=-0.1), "Received: warmup_start=-0.1"),
        (lambda: WarmupCosineDecay(0.1, 100, restart_steps=0), "Received: restart_steps=0"),
        (lambda: WarmupCosineDecay(0.1, 100, restart_steps=10, t_mul=0.5), "Received: t_mul=0.5"),
        (lambda: WarmupCosineDecay(0.1, 100, restart_steps=10, m_mul=0.0), "Received: m_mul=0.0"),
        (lambda: WarmupCosineDecay(0.1, 100, restart_steps=10, m_mul=1.5), "Received: m_mul=1.5"),
        (lambda: WarmupCosineDecay(0.1, 100, t_mul=2.0), "pass `restart_steps`"),
        (lambda: WarmupLinearDecay(0.1, 10, warmup_steps=11), "Received: warmup_steps=11"),
        (lambda: WarmupLinearDecay(0.1, math.inf), "Received: total_steps=inf"),
        (lambda: WarmupCosineDecay(0.1, "100"), "Received: total_steps='100'"),
        (lambda: WarmupStepDecay(0.1, [30, 30]), r"Received: boundaries=\[30, 30\]"),
        (lambda: WarmupStepDecay(0.1, []), r"Received: boundaries=\[\]"),
        (lambda: WarmupStepDecay(0.1, [30], decay_rate=0.0), "Received: decay_rate=0.0"),
        (lambda: WarmupStepDecay(0.1, [30], warmup_steps=40), "Received: warmup_steps=40"),
    ],
)
def test_argument_validation(make, match):
    with pytest.raises(ValueError, match=match):
        make()
