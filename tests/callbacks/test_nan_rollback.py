"""Tests of `trainwell.callbacks.nan_rollback.NaNRollback`.

Deterministic NaN injection: a `tf.data` pipeline whose batches are numbered
globally (`enumerate`, across epochs) poisons the chosen batches. The problem is
tiny and linearly separable with a margin, so a clean run reaches 100 % training
accuracy in 64 steps.

Whether a NaN in the weights reaches the loss depends on the CPU's ReLU kernel:
oneDNN's maps NaN to 0 on some x86 CPUs (the loss stays finite), not on others.
So each test pins the path it tests, never the kernel:
- the loss path: a non-finite `value` goes into the batch's sample weights
  (`into="loss"`, the default for `inf`/`nan`), so that step's loss is
  non-finite by arithmetic alone, on every CPU;
- the hidden-weights path: `into="inputs"` on a model built with
  `hide_nan=True`, whose activation maps NaN to 0 explicitly, so the weights
  turn NaN behind a finite loss on every CPU.
`make test` runs this file under both `TF_ENABLE_ONEDNN_OPTS=0` and `=1`.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from trainwell.callbacks.nan_rollback import (  # noqa: E402
    SPIKE_MIN_HISTORY,
    NaNRollback,
    TrainingDivergedError,
    _all_finite,
    spike_threshold,
)

STEPS = 8  # batches per epoch (256 examples / 32)
EPOCHS = 8
REPO = Path(__file__).resolve().parents[2]


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 8)).astype("float32")
    x = x[np.abs(x[:, 0] + x[:, 1]) > 0.5][:256]  # separable with a margin
    y = (x[:, 0] + x[:, 1] > 0).astype("int32")
    return x, y


X, Y = _data()


def poisoned(bad=(), value=np.inf, start=0, into=None):
    """Batches of (X, Y) repeated forever; the global batch indices in `bad` are poisoned with `value`.

    `into="loss"` (the default for a non-finite `value`): every batch carries sample weights, 1.0
    except `value` in the poisoned ones, so their loss is `value * loss`, non-finite on any CPU.
    `into="inputs"` (the default for a finite `value`: a spike, a float16 overflow): the poisoned
    batches' inputs are `value`.
    """
    if into is None:
        into = "inputs" if np.isfinite(value) else "loss"
    if into not in ("loss", "inputs"):
        raise ValueError(f"into must be 'loss' or 'inputs'. Received: into={into!r}")
    bad_t = tf.constant(sorted(bad) or [-1], tf.int64)

    def poison(i, batch):
        xb, yb = batch
        hit = tf.reduce_any(tf.equal(i, bad_t))
        if into == "loss":
            weights = tf.fill(tf.shape(yb), tf.where(hit, tf.constant(value, tf.float32), 1.0))
            return xb, yb, weights
        return tf.where(hit, tf.fill(tf.shape(xb), tf.constant(value, tf.float32)), xb), yb

    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(32).repeat()
    return ds.enumerate(start=start).map(poison)


def relu_hiding_nan(x):
    """ReLU that maps NaN to 0, as oneDNN's kernel does on some CPUs (`max(x, 0)`)."""
    return keras.ops.where(keras.ops.isnan(x), 0.0, keras.ops.relu(x))


@functools.lru_cache(maxsize=None)
def relu_kernel_hides_nan() -> bool:
    """Whether this machine's ReLU, compiled as `fit` compiles it, maps NaN to 0 (a tiny probe)."""
    layer = keras.layers.Dense(4, activation="relu")
    layer.build((None, 8))
    layer.kernel.assign(np.full((8, 4), np.nan, "float32"))
    return bool(np.all(tf.function(layer)(tf.ones((2, 8))).numpy() == 0.0))


def build(policy="float32", steps_per_execution=1, lr=0.1, with_input=True, hide_nan=False):
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    layers = [keras.Input((8,))] if with_input else []
    layers += [
        keras.layers.Dense(16, activation=relu_hiding_nan if hide_nan else "relu"),
        keras.layers.Dense(2),
        keras.layers.Activation("linear", dtype="float32"),
    ]
    model = keras.Sequential(layers)
    model.compile(
        keras.optimizers.SGD(lr, momentum=0.9),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
    )
    return model


def fit(model, bad=(), value=np.inf, callbacks=(), epochs=EPOCHS, initial_epoch=0, start=0, into=None):
    return model.fit(
        poisoned(bad, value, start, into),
        steps_per_epoch=STEPS,
        epochs=epochs,
        initial_epoch=initial_epoch,
        callbacks=list(callbacks),
        shuffle=False,
        verbose=0,
    )


def finite(model) -> bool:
    return all(np.isfinite(w.numpy()).all() for w in model.weights)


def accuracy(model) -> float:
    return float(np.mean(np.argmax(model.predict(X, verbose=0), axis=1) == Y))


def lr_of(model) -> float:
    opt = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    return float(keras.ops.convert_to_numpy(opt.learning_rate))


@pytest.fixture(autouse=True)
def _float32_policy():
    yield
    keras.mixed_precision.set_global_policy("float32")


_clean = {}


def clean_accuracy(policy="float32", spe=1) -> float:
    if (policy, spe) not in _clean:
        model = build(policy, spe)
        fit(model)
        assert finite(model)
        _clean[(policy, spe)] = accuracy(model)
    return _clean[(policy, spe)]


# --------------------------------------------------------------------------- recovery
@pytest.mark.parametrize("value, spe", [(np.inf, 1), (np.nan, 3)])
def test_poisoned_batches_roll_back_and_match_clean_run(value, spe):
    clean = clean_accuracy("float32", spe)
    assert clean >= 0.99
    model = build(steps_per_execution=spe)
    cb = NaNRollback(snapshot_every=4)
    probes = []  # the check runs inside the train step: no separate compiled call per step
    cb._probe_call = functools.partial(lambda probe, weights: probes.append(weights) or probe(weights), cb._probe_call)
    hist = fit(model, bad=[5, 30], value=value, callbacks=[cb])
    assert probes.count(False) == EPOCHS  # the loss tracker read once an epoch, before its first step
    if spe == 1:  # the weights: before each of the 16 snapshots due (every 4 steps), after the 2 NaN losses
        assert probes.count(True) == STEPS * EPOCHS // 4 + 2
    assert sorted(hist.history) == ["accuracy", "loss", "nan_rollbacks"]  # the check's values are not metrics
    assert finite(model)
    assert abs(accuracy(model) - clean) <= 0.01
    assert np.all(np.isfinite(hist.history["loss"]))
    ev = cb.get_state()["events"]
    assert [e["action"] for e in ev] == ["rollback", "rollback"]
    # The poisoned loss (sample weight inf/nan) is non-finite on every CPU, and its update made the weights so.
    assert all(e["causes"] == ["nonfinite_loss", "nonfinite_weights"] for e in ev)
    if spe == 1:  # detected right after batch 5; last snapshot at step 4
        assert (ev[0]["step"], ev[0]["restored_step"], ev[0]["batches_skipped"]) == (6, 4, 2)
        assert (ev[1]["step"], ev[1]["restored_step"]) == (31, 28)
    else:  # callbacks every 3 steps: detected at step 6; snapshots at 0, 6, 9, ...
        assert (ev[0]["step"], ev[0]["restored_step"], ev[0]["batches_skipped"]) == (6, 0, 6)
        assert ev[1]["step"] == 33
    # `iterations` goes back with the rest of the optimizer state.
    assert ev[0]["iterations_after"] == ev[0]["restored_step"]
    assert ev[0]["iterations_before"] == ev[0]["step"]
    assert np.allclose([ev[0]["lr_before"], ev[0]["lr_after"], ev[1]["lr_after"]], [0.1, 0.05, 0.025])
    assert np.isclose(lr_of(model), 0.025)


def test_lr_schedule_goes_back_with_iterations_and_is_scaled():
    from trainwell.callbacks.schedules import WarmupCosineDecay, get_lr_multiplier

    schedule = WarmupCosineDecay(0.1, total_steps=STEPS * 4, warmup_steps=8)
    model = build()
    model.compile(
        keras.optimizers.SGD(schedule, momentum=0.9),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    cb = NaNRollback(snapshot_every=4)
    fit(model, bad=[13], callbacks=[cb], epochs=4)
    (ev,) = cb.events
    assert (ev["step"], ev["restored_step"], ev["iterations_after"]) == (14, 12, 12)
    # The cut applies at the restored schedule position (iterations 12), and the
    # multiplier is not part of the snapshot, so it stays lowered.
    # Cosine from step 8 to 32: at step 12, 0.1 * (1 + cos(pi * 4 / 24)) / 2.
    assert np.isclose(ev["lr_before"], 0.05 * (1 + np.cos(np.pi * 4 / 24)))
    assert np.isclose(ev["lr_after"], 0.5 * ev["lr_before"])
    assert np.isclose(get_lr_multiplier(model.optimizer), 0.5)
    assert int(model.optimizer.iterations.numpy()) == STEPS * 4 - 2  # 2 updates were undone
    assert finite(model)


@pytest.mark.parametrize("kernel", ["simulated", "this_cpu"])
def test_terminate_on_nan_alone_misses_nan_weights(kernel):
    """NaN weights behind a finite loss: TerminateOnNaN never fires, NaNRollback does."""
    if kernel == "this_cpu" and not relu_kernel_hides_nan():
        pytest.skip("this CPU's ReLU kernel passes NaN on (the loss turns NaN, so nothing hides); "
                    "the 'simulated' case covers the hidden NaN here")
    hide_nan = kernel == "simulated"
    model = build(hide_nan=hide_nan)
    hist = fit(model, bad=[5], into="inputs", callbacks=[keras.callbacks.TerminateOnNaN()])
    # The weights are NaN from batch 5 on, but the loss stays finite: the run
    # goes on to the end and is lost.
    assert not finite(model)
    assert accuracy(model) <= 0.6
    assert len(hist.history["loss"]) == EPOCHS and np.all(np.isfinite(hist.history["loss"]))

    model = build(hide_nan=hide_nan)
    cb = NaNRollback(snapshot_every=4)
    fit(model, bad=[5], into="inputs", callbacks=[cb], epochs=1)
    (ev,) = cb.events
    # Found by the weight check before the snapshot due at step 8; restored to the one before.
    assert ev["causes"] == ["nonfinite_weights"] and (ev["step"], ev["restored_step"]) == (8, 4)
    assert finite(model)


class _WeightsAtEpochEnd(keras.callbacks.Callback):
    """Records whether the weights are finite when a later callback (a Checkpoint) sees the epoch end."""

    def __init__(self):
        super().__init__()
        self.finite = []

    def on_epoch_end(self, epoch, logs=None):
        self.finite.append(finite(self.model))


@pytest.mark.parametrize("every, step", [(None, 8), (1, 3), (2, 4)])
def test_nan_weights_are_found_by_the_next_check_and_never_reach_an_epoch_end(every, step):
    model = build(hide_nan=True)  # NaN weights, finite loss from step 3: only a weight check finds them
    cb = NaNRollback(snapshot_every=16, check_weights_every=every)
    seen = _WeightsAtEpochEnd()
    fit(model, bad=[2], into="inputs", callbacks=[cb, seen], epochs=2)
    (ev,) = cb.events
    # By default at the end of the epoch (step 8; the next snapshot is due at 16), before the
    # callbacks listed after NaNRollback see it; every step with 1; at the next even step with 2.
    assert ev["causes"] == ["nonfinite_weights"]
    assert (ev["step"], ev["restored_step"], ev["batches_skipped"]) == (step, 0, step)
    assert seen.finite == [True, True] and finite(model)


def test_the_in_step_weight_check_is_exact_for_nan_and_inf_and_float16_sums():
    """One sum per tensor stands for `all(isfinite)`: NaN and +-Inf found, large float16 sums are not overflow."""

    def check(*arrays):
        return bool(keras.ops.convert_to_numpy(_all_finite([keras.ops.convert_to_tensor(a) for a in arrays])))

    ones16 = np.ones(100_000, "float16")  # sums to 1e5 > 65504, float16's largest finite value
    assert check(ones16, np.ones((3, 4), "float32"))
    for bad in (np.nan, np.inf, -np.inf):
        w = np.ones((3, 4), "float32")
        w[1, 2] = bad
        assert not check(ones16, w), bad
    both = np.zeros(4, "float32")
    both[0], both[1] = np.inf, -np.inf  # their sum is NaN, not 0
    assert not check(both)
    half = ones16.copy()
    half[7] = np.inf
    assert not check(half)


# --------------------------------------------------------------------------- mixed precision
def test_loss_scale_skip_is_not_divergence():
    clean = clean_accuracy("mixed_float16")
    model = build("mixed_float16")
    cb = NaNRollback(snapshot_every=4)
    hist = fit(model, bad=[5], value=1e6, callbacks=[cb])  # 1e6 overflows float16
    assert cb.events == [] and cb.loss_scale_skips == 1
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0**14  # halved once by the LSO
    assert np.all(np.isfinite(hist.history["loss"]))  # the skipped batch left the running mean
    assert finite(model) and abs(accuracy(model) - clean) <= 0.01

    # TerminateOnNaN alone stops this healthy run at the overflow: logs["loss"]
    # (the running mean) is NaN although the optimizer skipped the step.
    model = build("mixed_float16")
    hist = fit(model, bad=[5], value=1e6, callbacks=[keras.callbacks.TerminateOnNaN()])
    assert len(hist.history["loss"]) == 1 and np.isnan(hist.history["loss"][0])
    assert finite(model) and int(model.optimizer.iterations.numpy()) == 5


def test_loss_scale_collapse_rolls_back():
    clean = clean_accuracy("mixed_float16")
    model = build("mixed_float16")
    cb = NaNRollback(snapshot_every=4)
    fit(model, bad=range(5, 25), value=1e6, callbacks=[cb])
    (ev,) = cb.events
    # 2**15 halved 15 times reaches the floor 1.0 after batch 19 (step 20). The
    # snapshots due at steps 8..16 were deferred (no finite loss since step 5).
    assert ev["causes"] == ["loss_scale_collapse"] and ev["loss_scale"] == 1.0
    assert (ev["step"], ev["restored_step"], ev["iterations_after"]) == (20, 4, 4)
    assert np.allclose([ev["lr_before"], ev["lr_after"]], [0.1, 0.05])
    # Restored to 2**15, then halved by the 5 overflowing batches 20..24.
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0**10
    assert finite(model) and abs(accuracy(model) - clean) <= 0.01


# --------------------------------------------------------------------------- spike, limits
def test_loss_spike_is_rolled_back_by_default_from_the_first_steps():
    model = build()
    cb = NaNRollback(snapshot_every=4)  # spike detection at its defaults
    fit(model, bad=[3, 20], value=30.0, callbacks=[cb], epochs=4)  # finite, but huge losses
    # Detection starts after SPIKE_MIN_HISTORY (3) batches: batch 3 is step 4.
    assert [(e["step"], e["restored_step"], e["causes"]) for e in cb.events] == [
        (4, 0, ["loss_spike"]), (21, 20, ["loss_spike"])]
    for e in cb.events:
        assert e["loss"] > e["spike_threshold"] > 1.0
    assert finite(model) and accuracy(model) >= 0.99

    model = build()  # spike_factor=None turns it off: nothing happens
    cb = NaNRollback(snapshot_every=4, spike_factor=None)
    fit(model, bad=[20], value=30.0, callbacks=[cb], epochs=4)
    assert cb.events == []


def test_loss_spike_with_steps_per_execution():
    # Callbacks every 3 steps: one loss (the mean of 3 batches) is history
    # enough, and the spike at batch 4 is seen in the mean of batches 4-6.
    model = build(steps_per_execution=3)
    cb = NaNRollback(snapshot_every=4)
    fit(model, bad=[4], value=30.0, callbacks=[cb], epochs=1)
    assert [(e["step"], e["restored_step"], e["causes"]) for e in cb.events] == [(6, 0, ["loss_spike"])]


def test_spike_threshold_sees_past_noise_near_zero_loss():
    # Near the end of a run the loss is close to 0 and a healthy batch reached
    # 25x the median and 5.8x the max of the last 50 (bench/spike_rollback.py);
    # it stays below the run's own start, so it is not a spike.
    near_zero = [0.02, 0.05, 0.01, 0.004]
    assert spike_threshold(near_zero, 2.3, 5.0) == 2.3
    assert spike_threshold([2.1, 2.4, 1.9], 2.5, 5.0) == pytest.approx(12.0)
    assert spike_threshold([2.1, 2.4], 2.5, 5.0) is None  # too little history
    assert SPIKE_MIN_HISTORY == 3
    # With steps_per_execution=4 each loss is the mean of 4 batches: one is
    # history enough, and one batch at 5x shows as (5 + 3) / 4 = 2x in the mean.
    assert spike_threshold([2.4], 2.5, 5.0, steps_per_check=4) == pytest.approx(4.8)


def test_spike_the_loss_scale_optimizer_skipped_is_not_rolled_back():
    model = build("mixed_float16")
    cb = NaNRollback(snapshot_every=4)
    fit(model, bad=[20], value=30.0, callbacks=[cb], epochs=4)
    # A finite but huge loss whose scaled gradient overflowed float16: the
    # LossScaleOptimizer skipped the update itself; a rollback would only undo
    # good steps and halve the LR.
    assert cb.events == [] and cb.loss_scale_skips == 1
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0**14
    assert finite(model)


def test_rollback_takes_the_loss_history_back_to_the_snapshot():
    # The only snapshot is at step 0. Without taking the spike history back with
    # it, the restored (untrained) model's losses look like spikes next to the
    # low losses that followed, and each rollback triggers the next.
    model = build()
    cb = NaNRollback(snapshot_every=64, spike_window=8)
    fit(model, bad=[40], callbacks=[cb], epochs=8)
    assert [(e["step"], e["restored_step"]) for e in cb.events] == [(41, 0)]
    assert finite(model) and accuracy(model) >= 0.99


def test_recipes_roll_back_loss_spikes(tmp_path):
    from trainwell.recipes import resnet_imagenet, transformer_finetune

    for recipe in (resnet_imagenet, transformer_finetune):
        callbacks = recipe.build_callbacks(recipe.Config(), tmp_path / recipe.RECIPE)
        (cb,) = [c for c in callbacks if isinstance(c, NaNRollback)]
        assert cb.spike_factor is not None and cb.spike_factor == NaNRollback().spike_factor


@pytest.mark.parametrize("max_rollbacks", [0, 2])
def test_max_rollbacks_raises(max_rollbacks):
    model = build()
    cb = NaNRollback(snapshot_every=4, max_rollbacks=max_rollbacks)
    with pytest.raises(TrainingDivergedError) as info:
        fit(model, bad=[5, 13, 21, 29], callbacks=[cb])
    err = info.value
    stop_step = [6, 14, 22][max_rollbacks]
    msg = str(err)
    assert f"max_rollbacks={max_rollbacks}" in msg and f"step {stop_step}" in msg
    assert "nonfinite_weights" in msg
    if max_rollbacks:
        assert "LR 0.1 -> 0.05" in msg and "LR 0.05 -> 0.025" in msg
    assert [e["action"] for e in err.events] == ["rollback"] * max_rollbacks + ["stop"]
    assert cb.events == err.events
    assert finite(model)  # the last good state was restored before raising
    assert np.isclose(lr_of(model), 0.1 * 0.5**max_rollbacks)


def test_window_steps_forgets_old_rollbacks():
    model = build()
    cb = NaNRollback(snapshot_every=4, max_rollbacks=1, window_steps=5)
    fit(model, bad=[5, 13, 21, 29], callbacks=[cb], epochs=5)
    assert cb.rollbacks == 4 and np.isclose(lr_of(model), 0.1 * 0.5**4)
    assert finite(model)


def test_model_built_at_its_first_step_is_snapshotted_before_it():
    """Without `keras.Input`, fit builds the model while tracing its first step.

    The first snapshot is taken between that build and the first update, so a
    poisoned first batch rolls back exactly as it does with a built model.
    """

    class Stop(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            raise RuntimeError("stop")

    runs = []
    for with_input in (True, False):
        model = build(with_input=with_input)
        if not with_input:
            # A fit that stops before its first step leaves the optimizer
            # wrapped (`on_train_end` does not run); the next fit's NaNRollback
            # replaces the wrapper.
            with pytest.raises(RuntimeError, match="stop"):
                fit(model, callbacks=[NaNRollback(), Stop()], epochs=1)
        cb = NaNRollback(snapshot_every=4)
        fit(model, bad=[0], callbacks=[cb], epochs=1)
        runs.append(model)
        assert [(e["step"], e["restored_step"], e["iterations_after"]) for e in cb.events] == [(1, 0, 0)]
        assert finite(model)
        assert "apply" not in vars(model.optimizer)  # the optimizer is left as it was
    for a, b in zip(*(m.weights for m in runs)):
        np.testing.assert_allclose(a.numpy(), b.numpy())


# --------------------------------------------------------------------------- records, state
def test_events_in_logs_state_file_and_stdout(tmp_path, capsys):
    model = build()
    cb = NaNRollback(snapshot_every=4, run_dir=tmp_path)
    hist = fit(model, bad=[5, 30], callbacks=[cb], epochs=5)
    assert hist.history["nan_rollbacks"] == [1, 1, 1, 2, 2]
    events = cb.get_state()["events"]
    lines = (tmp_path / "nan_rollback.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == events
    for e in events:
        assert {"step", "epoch", "causes", "lr_before", "lr_after", "batches_skipped", "restored_step"} <= set(e)
    assert [e["epoch"] for e in events] == [0, 3]
    out = [line for line in capsys.readouterr().out.splitlines() if line.startswith("NaNRollback:")]
    assert len(out) == 2 and events[0]["causes"] == ["nonfinite_loss", "nonfinite_weights"]
    assert out[0] == (
        "NaNRollback: step 6: nonfinite_loss, nonfinite_weights; restored step 4 "
        "(2 batches skipped, iterations 6 -> 4), LR 0.1 -> 0.05."
    )


def test_state_round_trip_is_json():
    model = build()
    cb = NaNRollback(snapshot_every=4, spike_factor=10.0, spike_window=8)
    fit(model, bad=[5], callbacks=[cb], epochs=2)
    state = cb.get_state()
    assert state["step"] == 16 and state["rollbacks"] == 1 and len(state["recent_losses"]) == 8
    restored = NaNRollback(**cb.get_config())
    restored.set_state(json.loads(json.dumps(state)))
    assert restored.get_state() == state


def test_a_later_fit_of_the_same_model_keeps_the_compiled_functions():
    """A PBT member's kept model, a notebook's second fit: no new traces; a new optimizer: new functions."""
    model = build()
    fit(model, callbacks=[NaNRollback(snapshot_every=4)], epochs=1)
    _, fns = vars(model)["_trainwell_nan_rollback_fns"]
    assert fns["read"].experimental_get_tracing_count() == 1
    cb = NaNRollback(snapshot_every=4)
    fit(model, bad=[3], callbacks=[cb], epochs=1)  # a second fit, with a rollback
    assert vars(model)["_trainwell_nan_rollback_fns"][1] is fns
    assert [fns[k].experimental_get_tracing_count() for k in ("read", "assign", "probe_full", "probe_loss")] == [1] * 4
    assert [e["restored_step"] for e in cb.events] == [0] and finite(model)

    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    cb = NaNRollback(snapshot_every=4)
    fit(model, bad=[10], callbacks=[cb], epochs=2)  # the new optimizer's slots are in the snapshot and restored
    assert vars(model)["_trainwell_nan_rollback_fns"][1] is not fns
    assert len(cb.events) == 1 and finite(model)


def test_a_due_snapshot_is_read_with_its_weight_check_in_one_compiled_call():
    """Each snapshot due every `snapshot_every` steps: one dispatch (the weight check that lets it in and
    the read of the state), not two; a snapshot due at a diverged step is not taken."""
    model = build()
    fit(model, callbacks=[NaNRollback(snapshot_every=4)], epochs=1)  # makes and keeps the compiled functions
    _, fns = vars(model)["_trainwell_nan_rollback_fns"]
    counts = dict.fromkeys(fns, 0)
    for name, fn in list(fns.items()):
        fns[name] = lambda *args, _fn=fn, _name=name: counts.__setitem__(_name, counts[_name] + 1) or _fn(*args)
    cb = NaNRollback(snapshot_every=4)
    fit(model, callbacks=[cb], epochs=2)
    # The first snapshot (train begin) is a read alone; the 4 due at steps 4, 8, 12, 16 come with their
    # check (the epoch ends fall on snapshots: their weights are checked already).
    assert counts == {"read": 1, "read_probe": 4, "probe_full": 0, "probe_loss": 2, "assign": 0}, counts
    assert cb.snapshot_step == 16 and finite(model)

    counts.update(dict.fromkeys(counts, 0))
    cb = NaNRollback(snapshot_every=4)
    fit(model, bad=[3, 11], callbacks=[cb], epochs=2)  # poisoned batches at steps 4 and 12, where snapshots are due
    assert [(e["step"], e["restored_step"]) for e in cb.events] == [(4, 0), (12, 8)]
    assert counts["read_probe"] == 4 and counts["assign"] == 2 and finite(model)


def test_crash_and_compare():
    """Two fits joined by get_state/set_state on a fresh callback == one fit."""
    cfg = dict(snapshot_every=4, spike_factor=10.0, spike_window=8)
    bad = [5, 20, 27]
    ref_model = build()
    ref = NaNRollback(**cfg)
    fit(ref_model, bad=bad, callbacks=[ref], epochs=4)

    model = build()
    first = NaNRollback(**cfg)
    fit(model, bad=bad, callbacks=[first], epochs=2)
    traced = model.train_function
    second = NaNRollback(**cfg)  # "after the crash"
    second.set_state(json.loads(json.dumps(first.get_state())))
    # The data resumes where it was (global batch 16), as a checkpointed pipeline would.
    fit(model, bad=bad, callbacks=[second], epochs=4, initial_epoch=2, start=2 * STEPS)
    assert model.train_function is traced  # the check in the step: traced once, kept by later fits

    assert second.get_state() == ref.get_state()
    assert len(ref.events) == 3
    for a, b in zip(model.weights, ref_model.weights):
        assert np.allclose(a.numpy(), b.numpy())


def test_rollback_count_survives_restart():
    first_model = build()
    first = NaNRollback(snapshot_every=4, max_rollbacks=1)
    fit(first_model, bad=[5], callbacks=[first], epochs=1)
    state = first.get_state()
    assert state["rollbacks"] == 1

    restored = NaNRollback(snapshot_every=4, max_rollbacks=1)
    restored.set_state(state)
    with pytest.raises(TrainingDivergedError, match=r"1 rollback\(s\) within the whole run already reached max_rollbacks=1"):
        fit(build(), bad=[3], callbacks=[restored], epochs=1)

    fresh = NaNRollback(snapshot_every=4, max_rollbacks=1)  # without the state: one more rollback
    fit(build(), bad=[3], callbacks=[fresh], epochs=1)
    assert fresh.rollbacks == 1


# --------------------------------------------------------------------------- config, validation
def test_get_config_round_trip(tmp_path):
    cb = NaNRollback(50, 0.25, 5, 1000, 3.0, 20, 2, 2.0, tmp_path)
    config = cb.get_config()
    assert list(config) == list(inspect.signature(NaNRollback.__init__).parameters)[1:]
    assert config["run_dir"] == str(tmp_path) and json.loads(json.dumps(config)) == config
    assert NaNRollback.from_config(config).get_config() == config
    assert NaNRollback().get_config() == {
        "snapshot_every": 100,
        "lr_factor": 0.5,
        "max_rollbacks": 3,
        "window_steps": None,
        "spike_factor": 5.0,
        "spike_window": 50,
        "check_weights_every": None,
        "loss_scale_floor": 1.0,
        "run_dir": None,
    }


@pytest.mark.parametrize(
    "kwargs",
    [
        {"snapshot_every": 0},
        {"snapshot_every": 2.5},
        {"snapshot_every": True},
        {"lr_factor": 0.0},
        {"lr_factor": 1.5},
        {"lr_factor": "0.5"},
        {"max_rollbacks": -1},
        {"window_steps": 0},
        {"spike_factor": 1.0},
        {"spike_factor": float("inf")},
        {"spike_window": 1},
        {"check_weights_every": 0},
        {"check_weights_every": 1.5},
        {"loss_scale_floor": -1.0},
        {"run_dir": 3},
    ],
)
def test_argument_validation(kwargs):
    (name, value), = kwargs.items()
    with pytest.raises(ValueError, match=f"Invalid value for argument `{name}`.*Received: {name}="):
        NaNRollback(**kwargs)


# --------------------------------------------------------------------------- distribution
_MIRRORED = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from trainwell import runtime
    strategy = runtime.make_strategy("cpu:2")  # before any TF op
    import numpy as np, keras
    import test_nan_rollback as t
    from trainwell.callbacks.nan_rollback import NaNRollback

    def build(policy):
        keras.mixed_precision.set_global_policy(policy)
        with strategy.scope():
            return t.build(policy, steps_per_execution=2)

    out = {{}}
    for policy, bad, value in [("float32", [5], np.inf), ("mixed_float16", [5], 1e6)]:
        model = build(policy)
        cb = NaNRollback(snapshot_every=4)
        hist = t.fit(model, bad=bad, value=value, callbacks=[cb], epochs=4)
        kernel = model.weights[0].value
        replicas = [v.numpy() for v in strategy.experimental_local_results(kernel)]
        out[policy] = dict(
            replicas=len(replicas),
            replicas_equal=bool(np.allclose(replicas[0], replicas[1])),
            finite=t.finite(model),
            loss=hist.history["loss"],
            accuracy=t.accuracy(model),
            events=cb.events,
            loss_scale_skips=cb.loss_scale_skips,
        )
    print("RESULT " + json.dumps(out))
    """
)


@pytest.mark.slow
def test_mirrored_strategy_and_steps_per_execution():
    code = _MIRRORED.format(tests=str(Path(__file__).parent))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])

    f32 = out["float32"]
    assert f32["replicas"] == 2 and f32["replicas_equal"] and f32["finite"]
    (ev,) = f32["events"]
    # Callbacks every 2 steps: batch 5 is seen at step 6; snapshot at step 4.
    assert (ev["step"], ev["restored_step"], ev["iterations_after"]) == (6, 4, 4)
    assert "nonfinite_weights" in ev["causes"] and np.allclose(ev["lr_after"], 0.05)
    assert np.all(np.isfinite(f32["loss"])) and f32["accuracy"] >= 0.95

    f16 = out["mixed_float16"]
    assert f16["replicas_equal"] and f16["finite"] and f16["events"] == []
    assert f16["loss_scale_skips"] == 1 and np.all(np.isfinite(f16["loss"]))


# --------------------------------------------------------------------------- JAX backend
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed (pip install 'trainwell[jax]')")
def test_inf_batch_and_spike_roll_back_on_jax():
    """The two recovery tests above, with KERAS_BACKEND=jax: the same events at the same steps."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="jax")
    worker = Path(__file__).with_name("nan_rollback_worker.py")
    proc = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["backend"] == "jax"
    for case, expected in [("inf", [(6, 4), (31, 28)]), ("spike", [(4, 0), (21, 20)])]:
        r = out[case]
        assert [(e["step"], e["restored_step"]) for e in r["events"]] == expected, case
        assert r["finite"] and r["loss_finite"] and r["accuracy"] >= 0.99, case
        assert np.isclose(r["lr"], 0.025), case
        # Compiled calls of the check's own: the tracker's sums once an epoch, and the weight checks
        # before each of the 8 snapshots (steps 4, 8, ..., 32) and after the 2 non-finite losses;
        # every other check runs in the step.
        assert r["probe_calls"] - r["weight_checks"] == 4, case
        assert r["weight_checks"] == {"inf": 10, "spike": 8}[case], case
        assert r["history_keys"] == ["accuracy", "loss", "nan_rollbacks"], case
    inf, spike = out["inf"]["events"], out["spike"]["events"]
    assert all("nonfinite_weights" in e["causes"] for e in inf)
    assert all(e["causes"] == ["loss_spike"] for e in spike)
    # `iterations` goes back with the rest of the optimizer state (read and restored through the live JAX state).
    assert (inf[0]["iterations_before"], inf[0]["iterations_after"]) == (6, 4)


# --------------------------------------------------------------------------- what the lines say
def test_a_rollback_during_warmup_says_the_schedule_was_scaled_not_lr_0_to_0(capsys):
    """At the start of a warmup the LR is 0 before and after the cut: the line says what was cut."""
    from trainwell.callbacks.schedules import WarmupCosineDecay

    model = build()
    model.compile(keras.optimizers.SGD(WarmupCosineDecay(0.1, total_steps=STEPS * 2, warmup_steps=8), momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    cb = NaNRollback(snapshot_every=4)
    fit(model, bad=[0], callbacks=[cb], epochs=1)
    (ev,) = cb.events
    assert (ev["restored_step"], ev["lr_before"], ev["lr_after"], ev["lr_factor"]) == (0, 0.0, 0.0, 0.5)
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("NaNRollback:")]
    assert line.endswith("LR schedule scaled by 0.5 (LR 0 at this step).") and "LR 0 -> 0" not in line, line


@pytest.mark.parametrize("clip", [None, 1.0])
def test_the_stop_message_suggests_clipping_in_the_optimizers_terms(clip):
    model = build()
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=clip),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(TrainingDivergedError) as info:
        fit(model, bad=[5], callbacks=[NaNRollback(snapshot_every=4, max_rollbacks=0)], epochs=1)
    advice = "clip the gradients" if clip is None else "clip the gradients harder (the optimizer's `global_clipnorm` is 1)"
    assert str(info.value).endswith(f"Lower the learning rate, {advice}, or check the input data."), str(info.value)


def test_steps_after_a_mid_epoch_resume_are_counted_as_in_an_uninterrupted_run(tmp_path):
    """A mid-epoch resume mutes the resumed step's begin hook (it ran before the checkpoint): the
    step counters of NaNRollback and the doctor took every batch skipped before it as trained."""
    from trainwell.callbacks import Checkpoint, TrainingDoctor

    x = np.random.default_rng(0).normal(size=(160, 4)).astype("float32")

    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 6:
                raise KeyboardInterrupt

    def run(directory, stop):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        nan, doctor = NaNRollback(), TrainingDoctor(verbose=0)
        callbacks = [nan, doctor, Checkpoint(directory, save_every=3, verbose=0)] + ([Stop()] if stop else [])
        try:
            model.fit(x, x.sum(1), batch_size=16, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)
        except KeyboardInterrupt:
            pass
        return nan.step, doctor.step

    assert run(tmp_path / "a", False) == (20, 20)
    run(tmp_path / "b", True)  # stopped in the first epoch, after a mid-epoch checkpoint
    assert run(tmp_path / "b", False) == (20, 20)
