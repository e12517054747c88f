"""The LR range test: the ramp, the smoothing, the stop, the suggestions, the restore, the CLI."""

import dataclasses
import math
import types

import keras
import numpy as np
import pytest
import tensorflow as tf
import yaml

import trainwell
from trainwell.callbacks import LRFinder
from trainwell.callbacks import lr_finder
from trainwell.callbacks.lr_finder import LRFindResult, minimum, peak, steep, suggest, valley
from trainwell.cli import lr_find_main as cli_main
from trainwell.cli import write_config_value
from trainwell.config import BaseConfig, ConfigError

RNG = np.random.default_rng(0)
XR = RNG.normal(size=(512, 8)).astype("float32")
W_TRUE = RNG.normal(size=(8, 1)).astype("float32")
YR = XR @ W_TRUE + 0.1 * RNG.normal(size=(512, 1)).astype("float32")


def regression(optimizer=None, bn=False):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((8,)), keras.layers.Dense(16, activation="relu")]
    if bn:
        layers += [keras.layers.BatchNormalization(), keras.layers.Dropout(0.2)]
    model = keras.Sequential(layers + [keras.layers.Dense(1)])
    model.compile(optimizer or keras.optimizers.Adam(1e-3), "mse")
    return model


def one_weight_model(lr):
    """One weight, loss = w (gradient exactly 1): plain SGD moves w by the LR it used."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    model.compile(keras.optimizers.SGD(lr), lambda y, p: keras.ops.mean(p))
    return model


class UsedLR(keras.callbacks.Callback):
    """Records the LR each step used on a `one_weight_model`: how far the weight moved."""

    def __init__(self):
        super().__init__()
        self.used = []

    def on_train_batch_begin(self, batch, logs=None):
        self.w = float(self.model.trainable_weights[0].numpy().ravel()[0])

    def on_train_batch_end(self, batch, logs=None):
        self.used.append(self.w - float(self.model.trainable_weights[0].numpy().ravel()[0]))


def test_ramp_is_exponential_and_is_the_lr_really_used():
    """One weight, loss = w (gradient exactly 1): plain SGD moves w by the LR it used."""
    model = one_weight_model(0.5)

    used = UsedLR()
    finder = LRFinder(start_lr=1e-3, end_lr=1.0, steps=10, diverge_factor=None)
    model.fit(np.ones((320, 1), "float32"), np.zeros((320, 1)), batch_size=8, epochs=1, verbose=0, callbacks=[finder, used])
    r = finder.result
    expected = 1e-3 * 1000.0 ** (np.arange(10) / 9)
    assert r.stopped == "steps" and len(r.lrs) == 10
    assert np.allclose(r.lrs, expected, rtol=1e-6)
    assert np.allclose(used.used, expected, rtol=1e-4)
    assert float(model.optimizer.learning_rate) == pytest.approx(0.5)  # restored


def test_lr_find_traces_one_step_for_the_range_test_and_every_probe():
    """On TensorFlow `lr_find`'s phases share one schedule of variables (`_PhaseLR`): `fit`'s step
    is traced once, where a schedule per phase retraced it (with XLA: compiled) for every probe.
    Each phase still trains at its own LRs, and the model's own LR is back afterwards."""
    from trainwell.callbacks.schedules import WarmupCosineDecay

    model = one_weight_model(0.5)
    traces = []
    train_step = model.train_step
    model.train_step = lambda data: (traces.append(1), train_step(data))[1]
    x, y = np.ones((320, 1), "float32"), np.zeros((320, 1))
    cosine = WarmupCosineDecay(0.2, total_steps=10, warmup_steps=1)
    phases = [
        (LRFinder(start_lr=1e-3, end_lr=1.0, steps=10, diverge_factor=None), 1e-3 * 1000.0 ** (np.arange(10) / 9)),
        (lr_finder._LRProbe(0.2, steps=10, shape="constant", smooth=0.98, diverge_factor=None), np.full(10, 0.2)),
        (lr_finder._LRProbe(0.2, steps=10, shape="warmup_cosine", smooth=0.98, diverge_factor=None),
         np.array([float(cosine(i)) for i in range(10)])),
    ]
    with lr_finder._one_trace(model) as shared:
        assert shared is not None
        for callback, expected in phases:
            callback._shared_lr = shared
            used = UsedLR()
            model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback, used])
            assert np.allclose(used.used, expected, rtol=1e-4, atol=1e-7), type(callback).__name__
    assert len(traces) == 1
    used = UsedLR()
    model.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0, callbacks=[used])
    assert used.used == pytest.approx([0.5]) and float(model.optimizer.learning_rate) == pytest.approx(0.5)


def test_smoothing_is_fastais_debiased_ema():
    model = regression()
    r = trainwell.lr_find(model, (XR, YR), start_lr=1e-4, end_lr=1e-2, steps=20, smooth=0.9, method="minimum")
    avg, expect = 0.0, []
    for i, loss in enumerate(r.raw_losses):
        avg = 0.9 * avg + 0.1 * loss
        expect.append(avg / (1 - 0.9 ** (i + 1)))
    assert np.allclose(r.losses, expect)
    # The raw losses are the per-step losses (recovered from Keras's running mean).
    assert np.isclose(r.raw_losses[0], r.losses[0]) and len(set(np.round(r.raw_losses, 6))) > 10


def test_stops_on_divergence_and_restores_everything():
    model = regression(keras.optimizers.Adam(1e-3), bn=True)
    model.fit(XR, YR, epochs=1, verbose=0)  # built optimizer with non-trivial state
    before = [v.numpy().copy() for v in model.variables]
    opt_before = [v.numpy().copy() for v in model.optimizer.variables]
    r = trainwell.lr_find(model, (XR, YR), steps=100, method="minimum")
    assert r.stopped == "diverged" and len(r.lrs) < 100
    assert r.losses[-1] > 4 * min(r.losses) or not math.isfinite(r.losses[-1])
    assert all(np.array_equal(a, b) for a, b in zip(before, [v.numpy() for v in model.variables]))
    assert all(np.array_equal(a, b) for a, b in zip(opt_before, [v.numpy() for v in model.optimizer.variables]))
    assert float(model.optimizer.learning_rate) == pytest.approx(1e-3)
    # And the model trains exactly as one that never ran the test.
    twin = regression(keras.optimizers.Adam(1e-3), bn=True)
    twin.fit(XR, YR, epochs=1, verbose=0)
    for m in (model, twin):
        keras.utils.set_random_seed(1)
        m.fit(XR, YR, epochs=1, verbose=0, shuffle=False)
    assert all(np.allclose(a.numpy(), b.numpy()) for a, b in zip(model.variables, twin.variables))


def test_unbuilt_optimizer_and_schedule_are_restored():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.01, 100, 0.5)
    model = regression(keras.optimizers.SGD(schedule, momentum=0.9))
    w0 = [v.numpy().copy() for v in model.trainable_variables]
    ds = tf.data.Dataset.from_tensor_slices((XR, YR)).batch(32)
    r = trainwell.lr_find(model, ds, start_lr=1e-5, end_lr=1.0, steps=30, method="minimum")
    assert len(r.lrs) >= 20
    assert model.optimizer._learning_rate is schedule and int(model.optimizer.iterations.numpy()) == 0
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(w0, model.trainable_variables))
    assert all(np.all(v.numpy() == 0) for v in model.optimizer.variables if "momentum" in v.path)


def test_suggestion_on_linear_regression_is_below_the_stability_limit():
    """MSE on x ~ N(0, I): the Hessian is 2I, plain SGD diverges above LR = 2 / 2 = 1."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    r = trainwell.lr_find(model, (XR, YR), start_lr=1e-5, end_lr=10.0, steps=100, batch_size=64, method="minimum")
    assert r.stopped == "diverged"
    assert r.method == "minimum" and r.suggestion == r.suggestions["minimum"]
    assert 1e-2 < r.suggestion < 1.0
    assert r.suggestions["valley"] < r.suggestion
    # A short run at the suggested LR actually learns.
    keras.utils.set_random_seed(0)
    fresh = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    fresh.compile(keras.optimizers.SGD(r.suggestion), "mse")
    h = fresh.fit(XR, YR, batch_size=64, epochs=3, verbose=0)
    assert h.history["loss"][-1] < 0.1 * h.history["loss"][0]


def test_suggesters_match_fastai_definitions():
    lrs = list(np.geomspace(1e-5, 1.0, 30))
    drops = [0.05, 0.1, 0.1, 0.2, 0.5, 0.2, 0.1, 0.1, 0.05, 0.05, 0.02, 0.01, 0.01, 0.01]  # steepest at 4
    losses = [2.0] * 11 + list(2.0 - np.cumsum(drops)) + [1.0, 2.0, 4.0, 8.0, 16.0]
    # Trim as fastai: drop the first 30 // 10 = 3 and the last 5. The longest decreasing
    # run is 15 long (2.0 at index 10, then 14 drops) ending at index 24: start
    # 24 - 3 - 15 = 6 in the trimmed list, 6 + int(15/3) + int(5/2) = 13 -> lrs[3 + 13].
    s = suggest(lrs, losses, 30)
    assert np.isclose(s["valley"], lrs[16])
    assert np.isclose(s["steep"], lrs[14])  # the 0.5 drop, from index 14 to 15
    assert np.isclose(s["minimum"], lrs[24] / 10)
    assert np.isclose(s["peak"], lrs[24] / 2)  # trainwell's, for a schedule's peak
    # fastai's start index is end - length (one before the run): kept as fastai has it.
    assert valley([1, 2, 3, 4, 5, 6, 7], [9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 8.0]) == (3.0, 2)
    assert steep([1, 10, 100], [1.0, 0.5, 0.4]) == (1.0, 0)
    assert minimum([1, 10, 100], [1.0, 0.5, 0.9]) == (1.0, 1)
    assert peak([1, 10, 100], [1.0, 0.5, 0.9]) == (5.0, 1)
    # A NaN cuts the curve.
    s = suggest(list(range(1, 21)), [5.0] * 3 + list(np.linspace(5, 1, 10)) + [math.nan] * 7, 20)
    assert s["minimum"] <= 1.3


def test_plot_and_result_json(tmp_path):
    model = regression()
    r = trainwell.lr_find(model, (XR, YR), start_lr=1e-4, end_lr=1.0, steps=30, method="minimum")
    p = r.plot(tmp_path / "lr.png")
    data = p.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    d = r.to_dict()
    assert d["suggestion"] == r.suggestion and len(d["lrs"]) == len(r.lrs)


def test_validation():
    for kwargs in (
        {"start_lr": 0},
        {"end_lr": 1e-8},
        {"steps": 1},
        {"smooth": 1.0},
        {"diverge_factor": 1.0},
        {"restore": "yes"},
    ):
        with pytest.raises(ValueError, match="Received:"):
            LRFinder(**kwargs)
    with pytest.raises(ValueError, match="Received: method='best'"):
        LRFinder(method="best")
    cfg = LRFinder(start_lr=1e-6, steps=50, method="valley").get_config()
    assert LRFinder.from_config(cfg).get_config() == cfg
    model = regression()
    for kwargs, text in (
        ({"method": "best"}, "Received: method='best'"),
        ({"probe_schedule": "cosine"}, "Received: probe_schedule='cosine'"),
        ({"probe_steps": 1}, "Received: probe_steps=1"),
        ({"restore": False, "method": "probe"}, "Received: restore=False"),  # probes start from the restored state
        ({"method": "probe", "data": (b for b in [(XR[:32], YR[:32])] * 20)}, "Received: data=<generator"),
    ):
        data = kwargs.pop("data", (XR, YR))
        with pytest.raises(ValueError, match=text):
            trainwell.lr_find(model, data, steps=10, **kwargs)
    # Where probing cannot work, the default is the curve's "minimum".
    assert trainwell.lr_find(model, (XR, YR), steps=10, restore=False).method == "minimum"
    gen = ((XR[i:i + 32], YR[i:i + 32]) for i in range(0, 512, 32))  # a generator: one pass only
    r = trainwell.lr_find(model, gen, steps=10)
    assert r.method == "minimum" and not r.probes and len(r.lrs) == 10


# ----------------------------------------------------------------------------- probes
def test_probes_search_down_from_the_loss_minimum_and_restore_everything():
    model = regression(keras.optimizers.Adam(1e-3), bn=True)  # BatchNorm statistics and dropout too
    model.fit(XR, YR, batch_size=64, epochs=1, verbose=0)  # a trained state with optimizer slots
    before = [v.numpy() for v in model.variables]
    opt_before = [v.numpy() for v in model.optimizer.variables]
    r = trainwell.lr_find(model, (XR, YR), start_lr=1e-4, end_lr=10.0, steps=30, batch_size=64, probe_steps=12)
    assert r.method == "probe" and r.probe_steps == 12 and r.probe_schedule == "constant"  # the default
    # Probes at the curve's loss-minimum LR x 3, 1, 1/3, ... from high to low.
    cut_l, cut_x = lr_finder._cut(r.lrs, r.losses, 30)
    center = cut_l[int(np.nanargmin(cut_x))]
    tried = list(r.probes)  # insertion order = the order run
    assert tried[0] == pytest.approx(3 * center) and 3 <= len(tried) <= 8
    assert np.allclose(np.array(tried[:-1]) / np.array(tried[1:]), 3.0)
    finite = {lr: v for lr, v in r.probes.items() if math.isfinite(v)}
    assert r.suggestion == r.suggestions["probe"] == min(finite, key=finite.get)
    # It stopped after two runs in a row ended above the best (or ran out of candidates).
    i = tried.index(r.suggestion)
    assert len(tried) == min(i + 3, 8)
    assert all(r.probes[lr] > r.probes[r.suggestion] for lr in tried[i + 1:])
    # Everything is put back.
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.variables))
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(opt_before, model.optimizer.variables))
    assert float(model.optimizer.learning_rate) == pytest.approx(1e-3)
    d = r.to_dict()
    assert len(d["probes"]) == len(tried) and d["probe_steps"] == 12 and d["method"] == "probe"


def test_probes_on_arrays_see_the_same_batches_in_the_same_order(monkeypatch):
    """Common random numbers: two probes differ by their LR, not by a reshuffle of the data."""
    fits = []  # per `fit`: the row ids of each batch, in order

    class RowIds(keras.layers.Layer):
        def call(self, x, training=False):
            if training:
                fits[-1].append(tuple(np.asarray(x[:, 0]).astype(int)))
            return x[:, 1:]

    fit_steps = lr_finder._fit_steps

    def recording_fit_steps(*args, **kwargs):
        fits.append([])
        return fit_steps(*args, **kwargs)

    monkeypatch.setattr(lr_finder, "_fit_steps", recording_fit_steps)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((9,)), RowIds(), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse", run_eagerly=True)
    # Keras's array shuffle repeats itself from `fit` to `fit` under a global seed
    # (`keras.utils.set_random_seed`); this stands for a user who never set one.
    tf.random.set_seed(None)
    x = np.concatenate([np.arange(512, dtype="float32")[:, None], XR], axis=1)
    try:
        r = trainwell.lr_find(model, (x, YR), start_lr=1e-4, end_lr=1.0, steps=20, batch_size=32, probe_steps=20)
    finally:
        keras.utils.set_random_seed(0)  # the seeded state the other tests start from
    probes = fits[1:]
    assert len(probes) == len(r.probes) >= 3
    n = min(len(f) for f in probes)
    assert n >= 10 and all(f[:n] == probes[0][:n] for f in probes)
    assert sorted(sum(probes[0][:16], ())) == list(range(512))  # a permutation of the rows, not their order
    assert probes[0][:16] != [tuple(range(i, i + 32)) for i in range(0, 512, 32)]


def test_probes_follow_the_lr_shape_the_model_is_compiled_with():
    from trainwell.callbacks.schedules import WarmupCosineDecay

    plain = regression(keras.optimizers.SGD(0.01))
    scheduled = regression(keras.optimizers.SGD(WarmupCosineDecay(0.01, total_steps=100, warmup_steps=10)))
    scaled = regression(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(keras.optimizers.schedules.CosineDecay(0.01, 100))))
    assert [lr_finder.compiled_schedule_shape(m) for m in (plain, scheduled, scaled)] == [
        "constant", "warmup_cosine", "warmup_cosine"]
    with pytest.raises(ValueError, match="Received: model="):
        lr_finder.compiled_schedule_shape(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
    kw = dict(start_lr=1e-4, end_lr=1.0, steps=10, batch_size=64, probe_steps=4)
    assert trainwell.lr_find(plain, (XR, YR), **kw).probe_schedule == "constant"
    assert trainwell.lr_find(scheduled, (XR, YR), **kw).probe_schedule == "warmup_cosine"
    assert trainwell.lr_find(scheduled, (XR, YR), probe_schedule="constant", **kw).probe_schedule == "constant"


def test_probe_score_is_the_mean_final_loss_and_inf_when_diverged():
    p = lr_finder._LRProbe(0.1, steps=40, shape="constant", smooth=0.98, diverge_factor=4.0)
    p._raw, p._stopped = list(np.arange(40.0)), "steps"
    assert p.score() == pytest.approx(np.mean(np.arange(30.0, 40.0)))  # the last quarter (10 steps)
    p._stopped = "diverged"
    assert p.score() == math.inf


@pytest.mark.parametrize("shape", ["constant", "warmup_cosine"])
def test_a_probe_trains_with_the_lr_shape_asked_for(shape):
    """One weight, loss = w (gradient exactly 1): plain SGD moves w by the LR it used."""
    from trainwell.callbacks.schedules import WarmupCosineDecay

    model = one_weight_model(0.5)
    model.fit(np.ones((24, 1), "float32"), np.zeros((24, 1)), batch_size=8, epochs=1, verbose=0)  # iterations = 3
    w0 = float(model.trainable_weights[0].numpy().ravel()[0])

    used = UsedLR()
    probe = lr_finder._LRProbe(0.2, steps=10, shape=shape, smooth=0.98, diverge_factor=None)
    model.fit(np.ones((160, 1), "float32"), np.zeros((160, 1)), batch_size=8, epochs=1, verbose=0,
              callbacks=[probe, used])
    if shape == "constant":
        expected = np.full(10, 0.2)
    else:  # the recipes' shape, counted from the probe's first step
        sched = WarmupCosineDecay(0.2, total_steps=10, warmup_steps=1)
        expected = np.array([float(sched(i)) for i in range(10)])
    assert np.allclose(used.used, expected, atol=1e-6)
    assert float(model.trainable_weights[0].numpy().ravel()[0]) == w0  # restored
    assert int(model.optimizer.iterations.numpy()) == 3 and float(model.optimizer.learning_rate) == pytest.approx(0.5)


def test_fit_after_the_probes_uses_the_models_own_lr():
    """The probes' schedules are traced into `fit`'s step; it is rebuilt once they are done."""
    model = one_weight_model(0.5)  # gradient 1: w moves by the LR
    x, y = np.ones((64, 1), "float32"), np.zeros((64, 1))
    r = trainwell.lr_find(model, (x, y), start_lr=1e-3, end_lr=1.0, steps=10, batch_size=8, probe_steps=3)
    # The loss (= w) goes below 0 and keeps falling: no divergence (once a false one at the 2nd step).
    assert r.stopped == "steps" and min(r.losses) < 0
    assert r.method == "probe" and len(r.probes) >= 3 and 0.5 not in r.probes
    model.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)
    assert float(model.trainable_weights[0].numpy().ravel()[0]) == pytest.approx(-0.5)


def test_probe_warmup_cosine_values_by_hand():
    """25 steps: warmup over 2 (10%), then a half cosine to 0 at 25; counted from `offset`."""
    from trainwell.callbacks.schedules import WarmupCosineDecay

    sched = lr_finder._PhaseLR("warmup_cosine", 0.4, steps=25, offset=7)
    got = [float(sched(7 + t)) for t in range(27)]
    assert got[0] == 0.0 and got[1] == pytest.approx(0.2) and got[2] == pytest.approx(0.4)
    assert got[14] < 0.2 < got[13]  # half-way down the cosine: 2 + 23 / 2 = 13.5 steps
    assert got[13] == pytest.approx(0.2 * (1 + math.cos(math.pi * 11 / 23)), rel=1e-5)
    assert got[25] == pytest.approx(0.0, abs=1e-7) and got[26] == pytest.approx(0.0, abs=1e-7)
    ref = WarmupCosineDecay(0.4, total_steps=25, warmup_steps=2)  # the recipes' schedule
    assert np.allclose(got, [float(ref(t)) for t in range(27)], atol=1e-6)
    assert float(lr_finder._PhaseLR("constant", 0.4, steps=25, offset=7)(3)) == pytest.approx(0.4)


def test_an_error_during_the_probes_leaves_the_model_as_it_was():
    """`fit` skips `on_train_end` when it raises; the model must be put back all the same."""

    class Failing(keras.utils.PyDataset):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __len__(self):
            return 16

        def __getitem__(self, i):
            self.calls += 1
            if self.calls > 20:  # the range test reads at most its epoch of 16 batches: this is in a probe
                raise RuntimeError("disk gone")
            return XR[i * 32:(i + 1) * 32], YR[i * 32:(i + 1) * 32]

    model = regression(keras.optimizers.SGD(0.01))
    before = [v.numpy() for v in model.variables]
    with pytest.raises(Exception, match="disk gone"):  # RuntimeError, or tf.data's UnknownError around it
        trainwell.lr_find(model, Failing(), start_lr=1e-4, end_lr=1.0, steps=10, probe_steps=8)
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.variables))
    assert int(model.optimizer.iterations.numpy()) == 0 and float(model.optimizer.learning_rate) == pytest.approx(0.01)
    assert not isinstance(model.optimizer._learning_rate, keras.optimizers.schedules.LearningRateSchedule)
    # The next fit trains with the model's own LR, not a probe's.
    one = one_weight_model(0.5)
    x1, y1 = np.ones((64, 1), "float32"), np.zeros((64, 1))

    class FailingOnes(Failing):
        def __getitem__(self, i):
            self.calls += 1
            if self.calls > 20:
                raise RuntimeError("disk gone")
            return x1[:8], y1[:8]

    with pytest.raises(Exception, match="disk gone"):  # RuntimeError, or tf.data's UnknownError around it
        trainwell.lr_find(one, FailingOnes(), start_lr=1e-3, end_lr=1.0, steps=10, probe_steps=8)
    one.fit(x1[:8], y1[:8], batch_size=8, epochs=1, verbose=0)
    assert float(one.trainable_weights[0].numpy().ravel()[0]) == pytest.approx(-0.5)


def test_a_loss_that_starts_near_zero_does_not_stop_the_test():
    """CosineSimilarity starts near 0 and goes down to -1: noise around 0 is no divergence."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, 16)).astype("float32")
    y = x @ rng.normal(size=(16, 8)).astype("float32")
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(8)])
    model.compile(keras.optimizers.SGD(0.01), keras.losses.CosineSimilarity())
    r = trainwell.lr_find(model, (x, y), steps=60, batch_size=32, method="minimum")
    assert r.raw_losses[0] > -0.1 and max(r.raw_losses[:5]) > 0  # starts near 0, noisy around it
    assert r.stopped == "steps" and len(r.lrs) == 60 and min(r.losses) < -0.15


def test_probes_that_all_diverge_fall_back_to_minimum(monkeypatch):
    monkeypatch.setattr(lr_finder._LRProbe, "score", lambda self: math.inf)
    model = regression()
    with pytest.warns(UserWarning, match="every probe diverged"):
        r = trainwell.lr_find(model, (XR, YR), start_lr=1e-4, end_lr=1.0, steps=20, probe_steps=3)
    assert r.method == "minimum" and r.suggestion == r.suggestions["minimum"] and "probe" not in r.suggestions
    assert not r.reliable and "falling back to the range test's 'minimum'" in r.reason
    assert len(r.probes) == 8  # every candidate, x3 down to /729


def test_probes_that_cannot_learn_give_no_reliable_suggestion(capsys):
    """Labels independent of the inputs: every probe ends at chance level, ranked by noise alone."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(512, 8)).astype("float32"), rng.integers(0, 10, 512)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)])
    model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.warns(UserWarning, match="No reliable learning rate: the probes did not learn.*Try longer probes"):
        r = trainwell.lr_find(model, (x, y), start_lr=1e-4, end_lr=10.0, steps=30, probe_steps=20)
    assert not r.reliable and r.reason.startswith("the probes did not learn")
    assert capsys.readouterr().out == ""  # verbose=0, the default: silent
    assert r.suggestion == r.suggestions["probe"]  # still the best measured, flagged
    assert abs(r.start_loss - math.log(10)) < 0.2 and min(r.probes.values()) > 0.95 * r.start_loss
    d = r.to_dict()
    assert d["reliable"] is False and d["reason"] == r.reason and all(len(p) == 3 for p in d["probes"])


def test_judge_probes_tells_learning_from_noise():
    se = {0.3: 0.01, 0.1: 0.01, 0.03: 0.01}
    assert lr_finder.judge_probes(2.30, 0.002, {0.3: 1.2, 0.1: 0.8, 0.03: 1.1}, se) is None
    # Below the start by less than MIN_GAIN (5%), or within the noise.
    assert lr_finder.judge_probes(2.30, 0.002, {0.3: 2.26, 0.1: 2.25, 0.03: 2.29}, se).startswith("the probes did not")
    assert lr_finder.judge_probes(2.30, 0.002, {0.3: 2.0, 0.1: 1.9, 0.03: 2.1}, {k: 0.2 for k in se}).startswith(
        "the probes did not learn")
    # Learned, but every LR the same within the noise: nothing to choose by.
    assert lr_finder.judge_probes(2.30, 0.002, {0.3: 0.81, 0.1: 0.8, 0.03: 0.82}, se).startswith(
        "the probes could not be told apart")
    assert "only one probe" in lr_finder.judge_probes(2.30, 0.002, {0.3: math.inf, 0.1: 0.8}, se)
    assert lr_finder.judge_probes(2.30, 0.002, {0.3: math.inf, 0.1: math.inf}, se).startswith("every probe diverged")


def test_a_flat_range_test_curve_is_not_reliable():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(512, 8)).astype("float32"), rng.integers(0, 10, 512)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(10)])
    model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    finder = LRFinder(start_lr=1e-6, end_lr=1e-3, steps=30)  # too low to move: the curve stays at its start
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[finder])
    assert not finder.result.reliable and finder.result.reason.startswith("the range test's loss never fell")
    r = trainwell.lr_find(regression(), (XR, YR), start_lr=1e-4, end_lr=10.0, steps=60, method="minimum")
    assert r.reliable and r.reason is None and r.start_loss > 1.5 * min(r.losses)


@pytest.mark.parametrize("verbose", [1, 2])
def test_progress_has_the_range_tests_and_each_probes_totals(verbose, capsys):
    """Arrays of 16 batches: `fit` would count its own epochs; the bars count the test's steps."""
    trainwell.lr_find(regression(), (XR, YR), start_lr=1e-4, end_lr=1.0, steps=20, probe_steps=12, verbose=verbose)
    out = capsys.readouterr().out
    assert "LR range test: 20 steps, LR 0.0001 to 1\n" in out and out.count("20/20") == 1
    probes = [l for l in out.splitlines() if l.startswith("Probe ")]
    assert probes[0].startswith("Probe 1 (of at most 8): LR ") and probes[0].endswith(", 12 steps, constant")
    assert out.count("12/12") == len(probes) >= 3
    assert "/16" not in out and "Epoch" not in out
    if verbose == 2:  # one line per phase
        assert len(out.splitlines()) == 2 * (1 + len(probes))


# ----------------------------------------------------------------------------- command line
@dataclasses.dataclass
class TinyConfig(BaseConfig):
    lr: float = 0.1  # the recipe's peak LR
    batch_size: int = 64


def tiny_recipe(**extra):
    def build_data(cfg):
        return {"train": tf.data.Dataset.from_tensor_slices((XR, YR)).batch(cfg.batch_size), "val": None}

    def build_model(cfg):
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(cfg.lr), "mse")
        return model

    return types.SimpleNamespace(__name__="tiny", Config=TinyConfig, build_data=build_data, build_model=build_model, **extra)


def test_cli_main_prints_and_writes_the_suggestion(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text("# my run\nepochs: 3  # short\nlr: 0.1  # peak LR\n")
    cfg = TinyConfig.load(config, [f"run_dir={tmp_path / 'run'}", "strategy=one_device", "precision=float32"])
    args = types.SimpleNamespace(write=True, config=str(config), dry_run=False)
    assert cli_main(tiny_recipe(), cfg, args) == 0
    out = capsys.readouterr().out
    # The CLI's default: warmup + cosine probes around the range test's loss minimum.
    assert "Suggested peak learning rate (probe):" in out and "probe runs of 100 steps (warmup_cosine)" in out
    written = yaml.safe_load(config.read_text())
    assert written["epochs"] == 3 and 1e-3 < written["lr"] < 1.0 and written["lr"] != 0.1
    # The old comment described the old value: the new one says what the value is.
    assert f"lr: {written['lr']!r}  # peak LR {written['lr']:.3g} from trainwell lr-find (probe); was 0.1\n" in (
        config.read_text())
    assert config.read_text().startswith("# my run\nepochs: 3  # short\nlr: ")
    assert (tmp_path / "run" / "lr_find.png").is_file() and (tmp_path / "run" / "lr_find.json").is_file()


def test_cli_main_refuses_to_write_a_suggestion_made_of_noise(tmp_path, capsys, monkeypatch):
    # What `trainwell lr-find` with 20-step probes measured on the demo config: every probe
    # at chance level, ranked by noise (the detection itself: the tests above).
    probes = {0.0274: 2.302, 0.0821: 2.289, 0.246: 2.261, 0.739: 2.308, 2.22: 2.431}
    noise = {lr: 0.01 for lr in probes}
    reason = lr_finder.judge_probes(2.303, 0.001, probes, noise)
    canned = LRFindResult([1e-3, 1e-2], [2.3, 2.3], [2.3, 2.3], 0.246, {"minimum": 0.0739, "probe": 0.246}, "steps",
                          method="probe", probes=probes, probe_noise=noise, probe_steps=20,
                          probe_schedule="warmup_cosine", start_loss=2.303, start_noise=0.001, reliable=False,
                          reason=reason)
    monkeypatch.setattr(lr_finder, "lr_find", lambda *a, **k: canned)
    config = tmp_path / "tiny.yaml"
    config.write_text("lr: 0.1  # peak LR\n")
    cfg = TinyConfig.load(config, [f"run_dir={tmp_path / 'run'}", "strategy=one_device", "precision=float32"])
    args = types.SimpleNamespace(write=True, config=str(config), dry_run=False, probe_steps=20)
    assert cli_main(tiny_recipe(), cfg, args) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("No reliable learning rate: the probes did not learn: the best probe (LR 0.246) ended "
                             "at 2.261 at best against 2.303 at the start (1.8% lower")
    assert out[-1] == ("Try longer probes (--probe-steps 80), or check the data and labels (the model must be able "
                       f"to fit them); nothing was written to {config}.")
    assert config.read_text() == "lr: 0.1  # peak LR\n"
    assert (tmp_path / "run" / "lr_find.json").is_file()  # the measurements are kept


def test_cli_main_method_option_picks_the_suggestion(tmp_path, capsys):
    cfg = TinyConfig.load(None, [f"run_dir={tmp_path / 'run'}", "strategy=one_device", "precision=float32"])
    args = types.SimpleNamespace(write=False, config=None, dry_run=False, method="minimum")
    assert cli_main(tiny_recipe(), cfg, args) == 0
    out = capsys.readouterr().out
    assert "Suggested peak learning rate (minimum):" in out and "peak: " in out


def test_cli_main_passes_probe_steps_on(tmp_path, capsys):
    cfg = TinyConfig(run_dir=str(tmp_path / "run"), strategy="one_device", precision="float32")
    assert cli_main(tiny_recipe(), cfg, types.SimpleNamespace(write=False, config=None, dry_run=False,
                                                              probe_steps=12)) == 0
    assert "probe runs of 12 steps (warmup_cosine)" in capsys.readouterr().out


def test_cli_main_checks_probe_steps_before_building_anything(tmp_path):
    cfg = TinyConfig(run_dir=str(tmp_path / "run"), strategy="one_device", precision="float32")
    for extra, text in (({"probe_steps": 1}, "Received: probe_steps=1"),
                        ({"probe_steps": 20, "method": "minimum"}, "Received: method='minimum', probe_steps=20")):
        args = types.SimpleNamespace(write=False, config=None, dry_run=True, **extra)
        with pytest.raises(ConfigError, match=text):
            cli_main(tiny_recipe(), cfg, args)


def test_cli_main_errors_and_protocol_hooks(tmp_path, capsys):
    cfg = TinyConfig(run_dir=str(tmp_path / "run"), strategy="one_device", precision="float32")
    with pytest.raises(ConfigError, match="needs `--config FILE`"):
        cli_main(tiny_recipe(), cfg, types.SimpleNamespace(write=True, config=None, dry_run=False))
    # lr_find_setup and lr_to_config take precedence.
    config = tmp_path / "c.yaml"
    config.write_text("lr: 0.5\n")
    calls = {}

    def lr_find_setup(c):
        calls["setup"] = True
        m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        m.compile(keras.optimizers.SGD(0.1), "mse")
        return m, (XR, YR)

    def lr_to_config(c, peak):
        return {"lr": peak / 2, "batch_size": 32}

    rec = tiny_recipe(lr_find_setup=lr_find_setup, lr_to_config=lr_to_config)
    # Short probes: this test is about the hooks (the default length is tested above).
    args = types.SimpleNamespace(write=True, config=str(config), dry_run=False, probe_steps=10)
    assert cli_main(rec, cfg, args) == 0
    written = yaml.safe_load(config.read_text())
    assert calls["setup"] and written["batch_size"] == 32 and written["lr"] < 0.5


def test_write_config_value_keeps_comments_and_handles_json(tmp_path):
    p = tmp_path / "a.yaml"
    p.write_text("lr: 0.1   # peak\nlr_floor: 0.0\n")
    write_config_value(p, "lr", 0.003)
    assert p.read_text() == "lr: 0.003   # peak\nlr_floor: 0.0\n"
    write_config_value(p, "peak_lr", 0.2)
    assert yaml.safe_load(p.read_text()) == {"lr": 0.003, "lr_floor": 0.0, "peak_lr": 0.2}
    j = tmp_path / "a.json"
    j.write_text('{"lr": 1}')
    write_config_value(j, "lr", 0.5)
    assert yaml.safe_load(j.read_text()) == {"lr": 0.5}


def _canned(suggestion: float) -> LRFindResult:
    return LRFindResult([1e-3, 1e-2], [2.3, 2.0], [2.3, 2.0], suggestion, {"peak": 0.1, "probe": suggestion}, "steps",
                        method="probe", probes={suggestion: 1.0}, probe_noise={suggestion: 0.01}, probe_steps=10,
                        probe_schedule="warmup_cosine", start_loss=2.3, start_noise=0.001, reliable=True)


def test_cli_main_prints_the_value_to_set_under_the_name_a_user_sets(tmp_path, capsys, monkeypatch):
    # The ResNet recipe's peak LR is derived (base_lr x batch_size / lr_base_batch): "Suggested peak
    # learning rate (probe): 0.205" mapped onto nothing a user can set, and `--set peak_lr=0.205` failed.
    from trainwell.recipes import resnet_imagenet

    monkeypatch.setattr(lr_finder, "lr_find", lambda *a, **k: _canned(0.205))
    recipe = types.SimpleNamespace(__name__="resnet", Config=resnet_imagenet.Config,
                                   lr_to_config=resnet_imagenet.lr_to_config,
                                   lr_find_setup=lambda cfg: (regression(), None))  # the range test is canned
    cfg = resnet_imagenet.Config(dataset="digits", batch_size=512, run_dir=str(tmp_path / "run"), strategy="one_device")
    assert cli_main(recipe, cfg, types.SimpleNamespace(write=False, config=None, dry_run=False)) == 0
    out = capsys.readouterr().out
    assert "To train with it: --set base_lr=0.1025  (a peak LR of 0.205 at batch_size=512)\n" in out, out
    assert resnet_imagenet.Config.load(overrides=["dataset=digits", "batch_size=512", "base_lr=0.1025"]).peak_lr == (
        pytest.approx(0.205))
    # A recipe whose field is the peak LR itself: the field and the value.
    cfg = TinyConfig(run_dir=str(tmp_path / "run2"), strategy="one_device", precision="float32")
    assert cli_main(tiny_recipe(), cfg, types.SimpleNamespace(write=False, config=None, dry_run=False)) == 0
    assert "To train with it: --set lr=0.205\n" in capsys.readouterr().out


def test_cli_main_removes_the_output_directory_it_made_when_the_run_fails(tmp_path):
    def lr_find_setup(cfg):
        raise RuntimeError("out of memory")

    for run_dir in (tmp_path / "new", tmp_path / "a" / "b"):
        cfg = TinyConfig(run_dir=str(run_dir), strategy="one_device", precision="float32")
        with pytest.raises(RuntimeError, match="out of memory"):
            cli_main(tiny_recipe(lr_find_setup=lr_find_setup), cfg,
                     types.SimpleNamespace(write=False, config=None, dry_run=False))
        assert not run_dir.exists()
    (tmp_path / "mine").mkdir()
    cfg = TinyConfig(run_dir=str(tmp_path / "mine"), strategy="one_device", precision="float32")
    with pytest.raises(RuntimeError):
        cli_main(tiny_recipe(lr_find_setup=lr_find_setup), cfg, types.SimpleNamespace(write=False, config=None,
                                                                                          dry_run=False))
    assert (tmp_path / "mine").is_dir()  # the user's directory stays
