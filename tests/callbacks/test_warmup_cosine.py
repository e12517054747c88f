import csv
import inspect
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainwell.callbacks.schedules import WarmupCosineDecay, WarmupLinearDecay, set_lr_multiplier
from trainwell.callbacks.warmup_cosine import WarmupCosine

STEPS = 8  # 64 examples, batch 8


def ref_cosine(step, peak, total, warmup=0, min_lr=0.0, start=0.0):
    """Independent reference: linear warmup, then half cosine to min_lr, then held."""
    out = []
    for s in np.atleast_1d(step):
        if s < warmup:
            out.append(start + (peak - start) * s / warmup)
        elif s >= total:
            out.append(min_lr)
        else:
            out.append(min_lr + (peak - min_lr) * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup))))
    return np.array(out)


def ref_linear(step, peak, total, warmup=0, min_lr=0.0):
    s = np.atleast_1d(step).astype(float)
    decay = peak - (peak - min_lr) * np.clip((s - warmup) / (total - warmup), 0, 1)
    return np.where(s < warmup, peak * s / max(warmup, 1), decay)


class UsedLR(keras.callbacks.Callback):
    """Reads the LR each step really used from the weight update.

    The model is one weight w with input 1 and loss mean(y_pred) = w, so the
    gradient is exactly 1 and plain SGD makes w -= lr: the LR inside the traced
    train function, not the one Python would compute.
    """

    def __init__(self):
        super().__init__()
        self.used = []

    def on_train_batch_begin(self, batch, logs=None):
        self._w = float(self.model.trainable_weights[0].numpy().ravel()[0])

    def on_train_batch_end(self, batch, logs=None):
        self.used.append(self._w - float(self.model.trainable_weights[0].numpy().ravel()[0]))


class StopAfter(keras.callbacks.Callback):
    def __init__(self, epochs):
        super().__init__()
        self.epochs = epochs

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 >= self.epochs:
            self.model.stop_training = True


class SeesLR(keras.callbacks.Callback):
    """A callback placed after WarmupCosine: records logs['learning_rate'] it sees."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(logs["learning_rate"])


def make_model(lr=0.1):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=lr), loss=lambda y_true, y_pred: keras.ops.mean(y_pred))
    return model


X = np.ones((64, 1), "float32")
Y = np.zeros((64, 1), "float32")
TOL = dict(rtol=1e-4, atol=1e-6)


def _tensorboard_epoch_scalars(log_dir):
    """{tag: [values]} of the epoch scalars a `keras.callbacks.TensorBoard` wrote for training."""
    out = {}
    for path in sorted((log_dir / "train").glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.tag.startswith("epoch_"):
                    out.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
    return out


def test_fit_follows_curve_with_total_steps_inferred(tmp_path):
    model = make_model(lr=0.1)
    used, sees = UsedLR(), SeesLR()
    cb = WarmupCosine(warmup_epochs=1, min_lr=0.01)  # peak_lr None: the optimizer's 0.1
    csv_path = tmp_path / "history.csv"
    tensorboard = keras.callbacks.TensorBoard(log_dir=str(tmp_path / "tb"), write_graph=False)
    hist = model.fit(X, Y, batch_size=8, epochs=4, shuffle=False, verbose=0,
                     callbacks=[cb, used, sees, keras.callbacks.CSVLogger(str(csv_path)), tensorboard])
    expected = ref_cosine(np.arange(4 * STEPS), peak=0.1, total=4 * STEPS, warmup=STEPS, min_lr=0.01)
    assert isinstance(cb.schedule, WarmupCosineDecay)
    assert cb.schedule.total_steps == 32 and cb.schedule.warmup_steps == 8 and cb.schedule.peak_lr == 0.1
    assert np.allclose(used.used, expected, **TOL)
    # The LR in the epoch logs, under Keras's name: the LR of the next step, at iterations 8, 16, 24, 32
    epoch_lrs = ref_cosine([8, 16, 24, 32], peak=0.1, total=32, warmup=8, min_lr=0.01)
    assert np.allclose(hist.history["learning_rate"], epoch_lrs, **TOL) and "lr" not in hist.history
    assert np.allclose(sees.seen, epoch_lrs, **TOL)
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert np.allclose([float(r["learning_rate"]) for r in rows], epoch_lrs, **TOL) and "lr" not in rows[0]
    # TensorBoard writes `epoch_learning_rate` itself: one LR scalar, the same values
    scalars = _tensorboard_epoch_scalars(tmp_path / "tb")
    assert "epoch_lr" not in scalars and np.allclose(scalars["epoch_learning_rate"], epoch_lrs, **TOL)


def test_two_consecutive_fits_retrace():
    model = make_model()
    used = UsedLR()
    model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[WarmupCosine(peak_lr=0.1, warmup_steps=4), used])
    assert np.allclose(used.used, ref_cosine(np.arange(16), 0.1, 16, warmup=4), **TOL)
    # second fit, other schedule: the traced train function must follow it
    used2 = UsedLR()
    cb2 = WarmupCosine(peak_lr=0.05, decay="linear", total_steps=32)
    model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[cb2, used2])
    assert isinstance(cb2.schedule, WarmupLinearDecay)
    assert np.allclose(used2.used, ref_linear(np.arange(16, 32), 0.05, 32), **TOL)
    # third fit with the same callback and curve: the installed schedule is kept
    installed = model.optimizer._learning_rate
    used3 = UsedLR()
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[cb2, used3, keras.callbacks.LambdaCallback()])
    assert model.optimizer._learning_rate is installed
    assert np.allclose(used3.used, 0.0, atol=1e-7)  # past total_steps: min_lr = 0


def test_epoch_end_lr_is_one_compiled_call_and_equals_keras_reading(monkeypatch):
    """The logged LR: Keras's eager evaluation of the schedule (a dozen dispatches, 2-3 ms an epoch
    on 2 cores) is one compiled call, traced once, reading the step and the multiplier when called."""
    import trainwell.callbacks.warmup_cosine as wc
    from trainwell.compat.learning_rate import current_lr, set_raw_learning_rate

    calls = []
    monkeypatch.setattr(wc, "current_lr", lambda opt: calls.append(opt) or current_lr(opt))
    model = make_model(lr=0.1)
    cb = WarmupCosine(warmup_epochs=1, restart_epochs=1, t_mul=2.0, m_mul=0.5)
    hist = model.fit(X, Y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[cb])
    assert calls == []  # Keras's eager reading is not used while the schedule is WarmupCosine's
    fn = cb._lr_now[2]
    assert fn.experimental_get_tracing_count() == 1
    assert np.allclose(hist.history["learning_rate"], [cb.schedule(s) for s in (8, 16, 24)], **TOL)
    for step, multiplier in [(0, 1.0), (5, 1.0), (13, 0.37), (20, 0.37), (40, 0.5)]:
        model.optimizer.iterations.assign(step)
        set_lr_multiplier(model.optimizer, multiplier)
        assert cb._current_lr() == current_lr(model.optimizer), (step, multiplier)  # bit for bit
    assert fn.experimental_get_tracing_count() == 1
    # Another LR put in place after the fit: Keras's reading again.
    set_raw_learning_rate(model.optimizer, keras.optimizers.schedules.ExponentialDecay(0.2, 10, 0.5))
    assert np.isclose(cb._current_lr(), current_lr(model.optimizer)) and len(calls) == 1


def test_initial_epoch_resume_continues_the_curve():
    kwargs = dict(peak_lr=0.1, warmup_epochs=1, min_lr=0.001)
    full, used_full = make_model(), UsedLR()
    full.fit(X, Y, batch_size=8, epochs=4, shuffle=False, verbose=0, callbacks=[WarmupCosine(**kwargs), used_full])

    first, used_first = make_model(), UsedLR()
    first.fit(X, Y, batch_size=8, epochs=4, shuffle=False, verbose=0,
              callbacks=[WarmupCosine(**kwargs), used_first, StopAfter(2)])
    set_lr_multiplier(first.optimizer, 0.5)  # e.g. lowered by a NaN rollback
    # "restart": a fresh model gets the weights, optimizer variables and multiplier
    resumed, used_resumed = make_model(), UsedLR()
    resumed.optimizer.build(resumed.trainable_variables)
    assert len(resumed.optimizer.variables) == len(first.optimizer.variables)  # same layout
    for dst, src in zip(resumed.optimizer.variables, first.optimizer.variables):
        dst.assign(src)
    resumed.set_weights(first.get_weights())
    set_lr_multiplier(resumed.optimizer, 0.5)  # restored before WarmupCosine installs its schedule
    resumed.fit(X, Y, batch_size=8, epochs=4, initial_epoch=2, shuffle=False, verbose=0,
                callbacks=[WarmupCosine(**kwargs), used_resumed])

    expected = ref_cosine(np.arange(32), 0.1, 32, warmup=8, min_lr=0.001)
    assert np.allclose(used_full.used, expected, **TOL)
    assert np.allclose(used_first.used, expected[:16], **TOL)
    assert np.allclose(used_resumed.used, 0.5 * expected[16:], **TOL)
    w_full = float(full.get_weights()[0].ravel()[0])
    w_resumed = float(resumed.get_weights()[0].ravel()[0])
    assert np.allclose(w_full, 1.0 - expected.sum(), **TOL)
    assert np.allclose(w_resumed, 1.0 - expected[:16].sum() - 0.5 * expected[16:].sum(), **TOL)


def test_png_written_and_restarts_sized_in_epochs(tmp_path):
    model, used = make_model(), UsedLR()
    cb = WarmupCosine(peak_lr=0.2, restart_epochs=1, t_mul=2.0, run_dir=tmp_path / "run")
    model.fit(X, Y, batch_size=8, epochs=4, shuffle=False, verbose=0, callbacks=[cb, used])
    png = tmp_path / "run" / "lr_schedule.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 2000
    assert not [p for p in png.parent.iterdir() if p.name.endswith(".tmp")]
    # cycles of 8 then 16 steps; a 32-step third cycle does not fit, so the second runs to 32
    assert cb.schedule.restart_steps == 8 and cb.schedule.cycle_starts() == [0, 8]
    expected = np.concatenate([ref_cosine(np.arange(8), 0.2, 8), ref_cosine(np.arange(24), 0.2, 24)])
    assert np.allclose(used.used, expected, **TOL)


def test_mixed_float16_loss_scale_optimizer():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model, used = make_model(), UsedLR()
        cb = WarmupCosine(warmup_steps=4)
        hist = model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[cb, used])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert model.optimizer.inner_optimizer._learning_rate is cb.schedule
    assert np.allclose(used.used, ref_cosine(np.arange(16), 0.1, 16, warmup=4), rtol=1e-3, atol=1e-5)
    assert np.allclose(hist.history["learning_rate"], ref_cosine([8, 16], 0.1, 16, warmup=4), **TOL)


def test_warmup_going_down_and_float_steps_follow_keras_cosine_decay():
    # What Keras's CosineDecay accepts; a WarmupCosineDecay config may hold it, and the
    # recipes hand that config to WarmupCosine.
    model, used = make_model(), UsedLR()
    cb = WarmupCosine(peak_lr=0.1, warmup_steps=4.0, warmup_start=0.4, total_steps=16.0)
    model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[cb, used])
    keras_lr = keras.optimizers.schedules.CosineDecay(0.4, 12.0, warmup_target=0.1, warmup_steps=4.0)
    assert np.allclose(used.used, [float(keras_lr(step)) for step in range(16)], **TOL)
    assert used.used[0] > used.used[3] > used.used[4]  # down through the warmup, then the decay


@pytest.mark.filterwarnings("ignore:.*shuffle=True:UserWarning", "ignore:Your input ran out of data:UserWarning")
def test_unknown_steps_per_epoch():
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).filter(lambda x, y: True).batch(8)
    assert int(ds.cardinality()) == int(tf.data.UNKNOWN_CARDINALITY)
    with pytest.raises(ValueError, match="steps_per_epoch=.*total_steps="):
        make_model().fit(ds, epochs=2, verbose=0, callbacks=[WarmupCosine()])
    with pytest.raises(ValueError, match="steps_per_epoch=.*total_steps="):  # warmup in epochs needs it too
        make_model().fit(ds, epochs=2, verbose=0, callbacks=[WarmupCosine(warmup_epochs=1, total_steps=16)])
    # steps_per_epoch given to fit: the curve is exact
    model, used = make_model(), UsedLR()
    model.fit(ds.repeat(), epochs=2, steps_per_epoch=8, verbose=0, callbacks=[WarmupCosine(warmup_epochs=0.25), used])
    assert np.allclose(used.used, ref_cosine(np.arange(16), 0.1, 16, warmup=2), **TOL)
    # total_steps given to the callback. (Keras 3.15 advances `iterations` one extra step
    # when an epoch of unknown length runs out of data, so only epoch 1 is compared.)
    model, used = make_model(), UsedLR()
    cb = WarmupCosine(warmup_steps=2, total_steps=16)
    model.fit(ds, epochs=2, verbose=0, callbacks=[cb, used])
    assert cb.schedule.total_steps == 16 and cb.schedule.warmup_steps == 2
    assert len(used.used) == 16
    assert np.allclose(used.used[:8], ref_cosine(np.arange(8), 0.1, 16, warmup=2), **TOL)


def test_get_config_round_trip(tmp_path):
    cb = WarmupCosine(peak_lr=0.4, warmup_epochs=0.5, warmup_steps=None, min_lr=1e-4, warmup_start=0.01,
                      decay="cosine", restart_epochs=2, t_mul=2.0, m_mul=0.5, total_steps=None,
                      run_dir=str(tmp_path))
    config = cb.get_config()
    assert list(config) == list(inspect.signature(WarmupCosine.__init__).parameters)[1:]
    assert config["restart_epochs"] == 2 and config["run_dir"] == str(tmp_path)
    assert WarmupCosine.from_config(config).get_config() == config


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(peak_lr=0.0), "Received: peak_lr=0.0"),
        (dict(warmup_epochs=-1), "Received: warmup_epochs=-1"),
        (dict(warmup_steps=-1.5), "Received: warmup_steps=-1.5"),
        (dict(warmup_start=-0.1), "Received: warmup_start=-0.1"),
        (dict(peak_lr=0.1, min_lr=0.2), "Received: min_lr=0.2"),
        (dict(decay="step"), "Received: decay='step'"),
        (dict(decay="linear", restart_epochs=1), "decay='cosine'"),
        (dict(restart_epochs=1, m_mul=2.0), "Received: m_mul=2.0"),
        (dict(t_mul=2.0), "pass `restart_epochs`"),
        (dict(total_steps=0), "Received: total_steps=0"),
    ],
)
def test_argument_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WarmupCosine(**kwargs)
