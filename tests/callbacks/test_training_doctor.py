"""TrainingDoctor on constructed pathologies: each must be diagnosed with the right finding and a fix.

Every case is a tiny model on 512 synthetic examples (a few hundred steps at
most), deterministic with `keras.utils.set_random_seed`.
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainwell.callbacks import TrainingDoctor
from trainwell.callbacks.doctor import CODES, Finding

D = keras.layers.Dense
CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def blobs(n=512, d=10, k=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    w = rng.normal(size=(d, k))
    y = np.argmax(x @ w + 0.5 * rng.normal(size=(n, k)), 1)
    return x, y


XA, YA = blobs(2048)
X, Y = XA[:512], YA[:512]  # training data of the pathologies
XH, YH = XA[:1536], YA[:1536]  # training data of the healthy runs (enough not to overfit)
XV, YV = XA[1792:], YA[1792:]  # validation data, same distribution


@pytest.fixture(autouse=True)
def seeded():
    """Seeds before each test's body: its layers draw their initializers' seeds when built,
    before `fit` below seeds again, so without this they would depend on the tests before."""
    keras.utils.set_random_seed(0)


def fit(layers, optimizer, epochs=5, batch_size=32, x=X, y=Y, loss=CE, doctor=None, **kw):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((x.shape[1],))] + layers)
    model.compile(optimizer, loss)
    doctor = doctor or TrainingDoctor(every_n_steps=10, verbose=0)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0, callbacks=[doctor], **kw)
    return model, doctor


def only(doctor, code) -> Finding:
    matches = [f for f in doctor.findings if f.code == code]
    assert matches, f"expected a {code!r} finding, got {doctor.codes}"
    return matches[0]


# ----------------------------------------------------------------------------- healthy
def test_healthy_run_reports_nothing_and_writes_outputs(tmp_path):
    doctor = TrainingDoctor(every_n_steps=10, run_dir=tmp_path, verbose=0)
    model, doctor = fit(
        [D(32, activation="relu"), D(32, activation="relu"), D(3)],
        keras.optimizers.SGD(0.1, momentum=0.9),
        epochs=5,
        x=XH,
        y=YH,
        doctor=doctor,
        validation_data=(XV, YV),
    )
    assert doctor.findings == []
    assert doctor.step == 240 and doctor.probes == 25  # step 1, then every 10 steps
    assert len(doctor.epoch_val_losses) == 5  # the overfitting rule saw the validation losses
    # The probe measured sane numbers: a healthy update/weight ratio (~1e-3).
    assert 1e-4 < doctor.last_probe["update_ratio"] < 1e-1
    assert np.isfinite(doctor.last_probe["global_norm"]) and doctor.last_probe["global_norm"] > 0
    report = json.loads((tmp_path / "diagnostics.json").read_text())
    assert report["findings"] == [] and report["steps"] == 240 and report["probe"] == "ok"
    events = list((tmp_path / "tensorboard" / "doctor").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_healthy_adam_deeper_net_reports_nothing():
    _, doctor = fit(
        [D(64, activation="relu") for _ in range(4)] + [D(3)], keras.optimizers.Adam(1e-3), epochs=5, x=XH, y=YH,
        validation_data=(XV, YV),
    )
    assert doctor.findings == []


def test_second_fit_on_a_trained_model_reports_nothing():
    """A fresh doctor on a trained model: its initial loss is low, its minibatch noise large by comparison."""
    model, first = fit([D(64, activation="relu"), D(64, activation="relu"), D(3)], keras.optimizers.SGD(0.05, momentum=0.9), epochs=5, x=XH, y=YH)
    doctor = TrainingDoctor(every_n_steps=10, verbose=0)
    model.fit(XH, YH, batch_size=32, epochs=5, verbose=0, callbacks=[doctor])
    assert first.findings == [] and doctor.findings == []
    assert doctor.tracker.initial < 0.5 * first.tracker.initial


# ----------------------------------------------------------------------------- pathologies
def test_lr_far_too_high_diverges(capsys):
    doctor = TrainingDoctor(every_n_steps=10, verbose=1)
    _, doctor = fit([D(32, activation="relu"), D(3)], keras.optimizers.SGD(50.0), epochs=3, doctor=doctor)
    f = doctor.findings[0]
    assert f.code == "divergence" and f.severity == "error"
    assert f.step <= 5
    assert np.isclose(f.evidence["lr"], 50.0)
    assert "lower the learning rate 10x" in f.fixes[0] and "to 5" in f.fixes[0]
    # One line per new finding, even though the loss stays NaN for 40 more steps.
    printed = [l for l in capsys.readouterr().out.splitlines() if l.startswith("TrainingDoctor: [")]
    assert len(printed) == len(doctor.findings)


def test_lr_far_too_low_crawls():
    _, doctor = fit([D(32, activation="relu"), D(3)], keras.optimizers.SGD(1e-5), epochs=15)
    f = only(doctor, "slow_convergence")
    assert doctor.codes == ["slow_convergence"]
    assert f.evidence["progress"] < 0.05 and f.evidence["update_ratio"] < 1e-5
    assert f.fixes[0].startswith("raise the learning rate 10-100x")


def test_deep_sigmoid_net_with_tiny_weights_has_vanishing_gradients():
    tiny = keras.initializers.RandomNormal(stddev=0.01)
    layers = [D(32, activation="sigmoid", kernel_initializer=tiny, name=f"h{i}") for i in range(8)] + [D(3, name="out")]
    _, doctor = fit(layers, keras.optimizers.SGD(0.1), epochs=2)
    f = doctor.findings[0]
    assert f.code == "vanishing_gradients" and f.step == 1
    assert f.evidence["first_layer"] == "h0" and f.evidence["last_layer"] == "out"
    assert f.evidence["ratio"] < 1e-10
    assert any("ReLU" in fix for fix in f.fixes) and any("initialisation" in fix for fix in f.fixes)


def test_deep_net_with_large_weights_and_no_normalisation_has_exploding_gradients():
    big = keras.initializers.RandomNormal(stddev=1.0)
    layers = [D(64, activation="relu", kernel_initializer=big) for _ in range(8)] + [D(3, kernel_initializer=big)]
    _, doctor = fit(layers, keras.optimizers.SGD(0.01), epochs=1)
    f = doctor.findings[0]
    assert f.code == "exploding_gradients" and f.step == 1
    assert f.evidence["grad_over_weight"] > 100
    assert "global_clipnorm" in f.fixes[0]
    assert any("initialisation" in fix for fix in f.fixes) and any("Normalization" in fix for fix in f.fixes)


def test_momentum_too_high_oscillates():
    _, doctor = fit([D(32, activation="relu"), D(3)], keras.optimizers.SGD(0.1, momentum=0.99), epochs=15)
    f = only(doctor, "oscillation")
    assert "divergence" not in doctor.codes
    assert f.evidence["peaks"] >= 3 and f.evidence["swing_over_initial_loss"] > 0.4
    assert f.evidence["probe_loss_rise"] > 1.5  # the loss on the fixed probe batch swings too
    assert np.isclose(f.evidence["momentum"], 0.99)
    assert f.fixes[0].startswith("lower the momentum from 0.99 to 0.9")


@pytest.mark.parametrize("lr, momentum", [(0.3, 0.995), (0.05, 0.9)], ids=["momentum0.995", "healthy_momentum0.9"])
def test_heavy_momentum_oscillates_at_the_default_probe_interval(lr, momentum):
    """5 epochs of 64 steps, the doctor at its defaults: a probe every 100 steps cannot see a 20-step period.

    The swings kill the second ReLU layer (all its units output zero for every
    example from about step 70): `dead_units` is true, and reported as the
    oscillation's consequence; the loss, back above its start, is no slow convergence.
    At step 100 two swings have counted as peaks, and five 5-step medians stood above
    where the loss started (up to 1.77 x): the second sign names it (the first did at
    step 200).
    """
    layers = [D(32, activation="relu"), D(32, activation="relu"), D(3)]
    _, doctor = fit(layers, keras.optimizers.SGD(lr, momentum=momentum), x=XA, y=YA, doctor=TrainingDoctor(verbose=0))
    assert doctor.step == 320
    if momentum == 0.9:
        assert doctor.findings == []
        return
    f = doctor.findings[0]
    assert f.code == "oscillation" and f.step == 100 and "slow_convergence" not in doctor.codes
    assert f.evidence["medians_above_start"] >= 3 and f.evidence["max_over_start"] > 1.5
    assert f.evidence["swing_over_noise"] > 4 and "probe_every_steps" not in f.evidence  # the probes confirm no level
    assert f.fixes[0].startswith("lower the momentum from 0.995 to 0.9")
    dead = only(doctor, "dead_units")
    assert dead.evidence["explained_by"] == "oscillation" and dead.fixes[0].startswith("fix the oscillation finding")


X5, Y5 = blobs(2048, d=32, k=5)  # 5 classes: the initial loss is about the null loss, ln 5


@pytest.mark.parametrize("every", [100, 10], ids=["default_interval", "every_10"])
def test_heavy_momentum_on_five_classes_is_an_oscillation_first(every):
    """#31.5: 3 x 64 ReLU units, 32 inputs, 5 classes, `SGD(0.3, momentum=0.995)`, 5 epochs.

    The loss goes up from about the null loss and swings above where it started, by
    less than 0.4 x the initial loss (no peak of the swing rule counts), and the swings
    kill the hidden layers. Was `dead_units` + `slow_convergence`. A probe every 10
    steps sees the dead units (step 40) before the loss has swung often enough (step 50):
    the oscillation is still listed first, the dead units as its consequence.
    """
    layers = [D(64, activation="relu") for _ in range(3)] + [D(5)]
    doctor = TrainingDoctor(every_n_steps=every, verbose=0)
    _, doctor = fit(layers, keras.optimizers.SGD(0.3, momentum=0.995), x=X5, y=Y5, doctor=doctor)
    assert doctor.step == 320
    f = doctor.findings[0]
    assert f.code == "oscillation" and f.evidence["peaks"] < 3 and f.evidence["medians_above_start"] >= 3
    assert f.summary.startswith("the loss swings above where it started")
    assert f.fixes[0].startswith("lower the momentum from 0.995 to 0.9") and "lower the learning rate 3x" in f.fixes[1]
    dead = only(doctor, "dead_units")
    assert dead.evidence["explained_by"] == "oscillation" and dead.fixes[0].startswith("fix the oscillation finding")
    assert "slow_convergence" not in doctor.codes
    if every == 10:
        assert dead.step < f.step  # found first, listed second


@pytest.mark.parametrize("cause", ["oscillation", "divergence"])
def test_a_cause_found_after_the_dead_units_is_listed_before_them(cause):
    doctor = TrainingDoctor(verbose=0)
    dead = Finding("dead_units", "warning", {"layer": "d", "dead_fraction": 1.0}, ["use LeakyReLU"], 40,
                   ["learning rate too high"], 'all units of layer "d" output zero.')
    doctor._report(dead)
    doctor._report(Finding(cause, "warning", {}, ["lower the learning rate"], 50))
    assert doctor.codes == [cause, "dead_units"]
    assert dead.evidence["explained_by"] == cause and dead.fixes[0].startswith(f"fix the {cause} finding first")
    assert dead.summary.endswith(f", after the {cause}.") and dead.step == 40


def test_tiny_data_and_large_model_overfits():
    x = X[:32]
    y = np.random.default_rng(3).integers(0, 3, 32)  # random labels: nothing to generalise
    _, doctor = fit(
        [D(512, activation="relu"), D(512, activation="relu"), D(3)],
        keras.optimizers.Adam(1e-3),
        epochs=12,
        x=x,
        y=y,
        validation_data=(XV, YV),
    )
    f = only(doctor, "overfitting")
    assert f.evidence["val_loss"] > 1.1 * f.evidence["best_val_loss"]
    assert f.evidence["loss"] < f.evidence["val_loss"]
    assert "EarlyStopping" in f.fixes[0] and "restore_best_weights=True" in f.fixes[0]


def pipeline_fit(delay, steps, epochs=1, doctor=None):
    """A tiny MLP behind a `tf.data` map that sleeps `delay` s per batch of 32 in Python."""

    def slow(a, b):
        time.sleep(delay)
        return a, b

    x = XA[: 32 * steps]
    ds = tf.data.Dataset.from_tensor_slices((x, x[:, :1] * 0.5)).batch(32)
    if delay:
        ds = ds.map(lambda a, b: tf.numpy_function(slow, [a, b], [tf.float32, tf.float32]))
        ds = ds.map(lambda a, b: (tf.ensure_shape(a, [None, 10]), tf.ensure_shape(b, [None, 1])))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((10,)), D(16, activation="relu"), D(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    doctor = doctor or TrainingDoctor(every_n_steps=5, verbose=0)
    model.fit(ds, epochs=epochs, verbose=0, callbacks=[doctor])
    return doctor


def test_slow_pipeline_is_input_bound():
    doctor = pipeline_fit(0.02, steps=10, epochs=3)
    f = only(doctor, "input_bound")
    assert f.evidence["wait_fraction"] > 0.5 and f.evidence["step_ms"] > 15
    assert "prefetch" in f.fixes[0]
    assert any("trainwell input-report" in fix for fix in f.fixes)  # the per-stage measurement (#35)


def test_same_model_without_the_delay_is_not_input_bound():
    doctor = pipeline_fit(0.0, steps=10, epochs=3)
    assert "input_bound" not in doctor.codes
    assert len(doctor.compute_times) >= 3


@pytest.mark.parametrize("delay", [0.03, 0.0], ids=["slow_pipeline", "healthy_fast_pipeline"])
def test_a_run_shorter_than_the_probe_interval_gets_verdicts_at_its_end(delay):
    """40 steps with a probe every 100: the probe at step 1 traces, the one at the end times the compute."""
    doctor = pipeline_fit(delay, steps=40, doctor=TrainingDoctor(verbose=0))
    assert doctor.step == 40 and doctor.probes == 2
    if delay:
        f = only(doctor, "input_bound")
        assert f.step == 40 and f.evidence["step_ms"] > 25 and f.evidence["wait_fraction"] > 0.5
    else:
        assert doctor.findings == []


def test_dead_relu_units():
    layers = [D(32, activation="relu", bias_initializer=keras.initializers.Constant(-10.0), name="dead"), D(3)]
    _, doctor = fit(layers, keras.optimizers.SGD(0.1), epochs=2)
    f = only(doctor, "dead_units")
    assert f.evidence["layer"] == "dead" and f.evidence["dead_fraction"] == 1.0
    assert any("LeakyReLU" in fix for fix in f.fixes)


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def test_float16_layer_that_overflows_is_named(mixed_float16, tmp_path):
    keras.utils.set_random_seed(0)
    inp = keras.Input((10,))
    h = D(16, activation="relu", name="ok")(inp)
    h = D(16, name="boom", kernel_initializer=keras.initializers.Constant(5000.0))(h)
    out = D(1, name="head", dtype="float32")(h)
    model = keras.Model(inp, out)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    doctor = TrainingDoctor(every_n_steps=10, run_dir=tmp_path, verbose=0)
    hist = model.fit(X, X[:, :1], batch_size=32, epochs=2, verbose=0, callbacks=[doctor])
    f = doctor.findings[0]
    assert f.code == "amp_instability" and f.severity == "error"
    assert f.evidence["layer"] == "boom" and f.evidence["layer_compute_dtype"] == "float16"
    assert f.evidence["recent_backoffs"] >= 8
    assert 'keep layer "boom" in float32' in f.fixes[0] and 'dtype="float32"' in f.fixes[0]
    # The loss-scale history is logged: epoch logs, state, diagnostics.json.
    assert hist.history["loss_scale"][0] < 2.0**15 and hist.history["loss_scale"][1] < hist.history["loss_scale"][0]
    report = json.loads((tmp_path / "diagnostics.json").read_text())
    assert report["loss_scale_history"][0] == [0, 32768.0] and report["loss_scale_backoffs"] >= 16


def test_healthy_mixed_float16_run_reports_nothing(mixed_float16):
    inp = keras.Input((10,))
    layers = [D(32, activation="relu"), D(32, activation="relu"), D(1, dtype="float32")]
    _, doctor = fit(layers, keras.optimizers.Adam(1e-3), epochs=5, y=X[:, :1] * 0.5, loss="mse")
    assert doctor.findings == []
    assert doctor.scale_history and doctor.scale_history[-1][1] == 32768.0


# ----------------------------------------------------------------------------- contract
def test_probe_leaves_training_unchanged():
    """Same seed, with and without the doctor (probing every step): identical weights.

    BatchNormalization (moving statistics) and Dropout (seed state) are what a
    careless probe would disturb.
    """

    def run(with_doctor):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((10,)), D(32, activation="relu"), keras.layers.BatchNormalization(), keras.layers.Dropout(0.3), D(3)]
        )
        model.compile(keras.optimizers.Adam(1e-2), CE, metrics=["accuracy"])
        cbs = [TrainingDoctor(every_n_steps=1, verbose=0)] if with_doctor else []
        h = model.fit(X[:128], Y[:128], batch_size=32, epochs=2, verbose=0, callbacks=cbs, shuffle=False)
        return [v.numpy() for v in model.variables], h.history

    w0, h0 = run(False)
    w1, h1 = run(True)
    assert all(np.array_equal(a, b) for a, b in zip(w0, w1))
    assert np.allclose(h0["loss"], h1["loss"], rtol=0, atol=0) and h0["accuracy"] == h1["accuracy"]


def test_state_round_trip_and_resume_does_not_repeat_findings(capsys):
    _, doctor = fit([D(32, activation="relu"), D(3)], keras.optimizers.SGD(50.0), epochs=1)
    state = json.loads(json.dumps(doctor.get_state()))  # JSON-serialisable
    resumed = TrainingDoctor(every_n_steps=10, verbose=1)
    resumed.set_state(state)
    assert resumed.get_state() == state
    assert resumed.codes == doctor.codes == ["divergence"]
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((10,)), D(32, activation="relu"), D(3)])
    model.compile(keras.optimizers.SGD(50.0), CE)
    capsys.readouterr()
    model.fit(X, Y, epochs=1, verbose=0, callbacks=[resumed])
    assert resumed.codes == ["divergence"] and resumed.step == doctor.step * 2
    assert "TrainingDoctor: [" not in capsys.readouterr().out


def test_a_fit_that_trains_nothing_neither_reports_nor_rewrites_its_diagnostics(tmp_path, capsys):
    """A finished run run again: its fit trains no step (the checkpoint says so). The doctor restored
    from it printed "no problems found" again, probed once more and rewrote diagnostics.json."""
    _, doctor = fit([D(16, activation="relu"), D(3)], keras.optimizers.SGD(0.1), epochs=2,
                    doctor=TrainingDoctor(every_n_steps=10, verbose=0, run_dir=str(tmp_path)))
    written = (tmp_path / "diagnostics.json").read_bytes()
    rerun = TrainingDoctor(every_n_steps=10, verbose=1, run_dir=str(tmp_path))
    rerun.set_state(json.loads(json.dumps(doctor.get_state())))
    model = keras.Sequential([keras.Input((10,)), D(16, activation="relu"), D(3)])
    model.compile(keras.optimizers.SGD(0.1), CE)
    capsys.readouterr()
    model.fit(X, Y, epochs=2, initial_epoch=2, verbose=0, callbacks=[rerun])  # every epoch done
    assert "TrainingDoctor" not in capsys.readouterr().out
    assert (tmp_path / "diagnostics.json").read_bytes() == written
    assert rerun.probes == doctor.probes and rerun.step == doctor.step


def test_config_and_validation():
    doctor = TrainingDoctor(every_n_steps=50, window=100, checks=["divergence"], thresholds={"diverge_factor": 8.0})
    cfg = doctor.get_config()
    assert cfg == {
        "every_n_steps": 50, "probe_batch": None, "run_dir": None, "verbose": 1, "window": 100,
        "checks": ["divergence"], "thresholds": {"diverge_factor": 8.0}, "track_updates": True,
    }
    assert TrainingDoctor.from_config(cfg).get_config() == cfg
    for kwargs in (
        {"every_n_steps": 0},
        {"probe_batch": np.zeros(3)},
        {"window": 5},
        {"checks": ["nan"]},
        {"thresholds": {"nope": 1.0}},
        {"verbose": 3},
    ):
        with pytest.raises(ValueError, match="Received:"):
            TrainingDoctor(**kwargs)


def test_checks_subset_and_explicit_probe_batch():
    doctor = TrainingDoctor(every_n_steps=10, probe_batch=(X[:16], Y[:16]), checks=["oscillation"], verbose=0)
    _, doctor = fit([D(32, activation="relu"), D(3)], keras.optimizers.SGD(50.0), epochs=1, doctor=doctor)
    assert doctor.findings == []  # divergence not checked
    assert doctor._probe.batch_size == 16


def test_generator_data_without_probe_batch_still_checks_losses(capsys):
    def gen():
        for i in range(0, 512, 32):
            yield X[i : i + 32], Y[i : i + 32]

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((10,)), D(32, activation="relu"), D(3)])
    model.compile(keras.optimizers.SGD(50.0), CE)
    doctor = TrainingDoctor(every_n_steps=10, verbose=1)
    model.fit(gen(), epochs=1, verbose=0, callbacks=[doctor])
    assert doctor.codes[0] == "divergence" and doctor.probes == 0
    assert "pass probe_batch" in capsys.readouterr().out


def test_an_epoch_without_a_step_is_no_epoch():
    """The data ran out (a generator, `steps_per_epoch` more than it holds): Keras ends the
    epoch with no batch trained and logs a loss of 0.0, which the epoch rules must not read."""

    def gen():
        for i in range(0, 128, 32):
            yield X[i : i + 32], Y[i : i + 32]

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((10,)), D(8, activation="relu"), D(3)])
    model.compile(keras.optimizers.SGD(0.1), CE)
    doctor = TrainingDoctor(every_n_steps=10, verbose=0, probe_batch=(X[:32], Y[:32]))
    with pytest.warns(UserWarning, match="ran out of data"):
        hist = model.fit(gen(), steps_per_epoch=4, epochs=2, verbose=0, callbacks=[doctor])
    assert hist.history["loss"][1] == 0.0  # what Keras logs for the empty epoch
    assert doctor.step == 4 and len(doctor.epoch_losses) == 1 and 0.0 not in doctor.epoch_losses


def test_several_models_in_one_process_print_no_retracing_warning():
    """#31.8: a notebook fits model after model. Each probe's compiled function is traced once,
    for its own model; TensorFlow, which counts traces per Python code object, must not count
    them as one function retracing. A fresh interpreter: it warns at most twice per function."""
    code = textwrap.dedent(
        """
        import json, logging
        import keras, numpy as np, tensorflow as tf
        from trainwell.callbacks import TrainingDoctor
        seen = []
        class Catch(logging.Handler):
            def emit(self, record):
                seen.append(record.getMessage())
        tf.get_logger().addHandler(Catch())
        x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
        probes = []
        for _ in range(6):
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
            model.compile(keras.optimizers.SGD(0.01), "mse")
            doctor = TrainingDoctor(every_n_steps=2, verbose=0)
            model.fit(x, x[:, :1], batch_size=16, epochs=1, verbose=0, callbacks=[doctor])
            probes.append(doctor.probes)
        print(json.dumps({"probes": probes, "retracing": [m for m in seen if "retracing" in m]}))
        """
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["probes"] == [3] * 6  # steps 1, 2, 4: each probe ran (traced once, then called)
    assert out["retracing"] == [] and "retracing" not in proc.stderr


def test_codes_are_the_documented_ones():
    assert set(CODES) == {
        "divergence", "oscillation", "slow_convergence", "vanishing_gradients", "exploding_gradients",
        "dead_units", "amp_instability", "overfitting", "input_bound",
    }
