"""Tests of trainwell.callbacks.early_stopping.EarlyStopping."""

from __future__ import annotations

import inspect
import json
import logging
import math

import keras
import numpy as np
import pytest

from trainwell.callbacks.checkpoint import Checkpoint, list_checkpoints
from trainwell.callbacks.early_stopping import EarlyStopping

RS = np.random.RandomState(0)
X = RS.randn(16, 3).astype("float32")
Y = (X @ RS.randn(3, 1)).astype("float32")


def _model(seed=1):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05), loss="mse")
    return model


class Score(keras.callbacks.Callback):
    """Puts a scripted `score` into the epoch logs (must come before the callbacks reading it)."""

    def __init__(self, scores):
        super().__init__()
        self.scores = scores

    def on_epoch_end(self, epoch, logs=None):
        logs["score"] = self.scores[epoch]




class WeightsAt(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.by_epoch = {}

    def on_epoch_end(self, epoch, logs=None):
        self.by_epoch[epoch] = self.model.get_weights()


def _fit(model, callbacks, epochs, batch_size=8):
    return model.fit(X, Y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)


def _close(a, b):
    return all(np.allclose(p, q, rtol=0, atol=1e-7) for p, q in zip(a, b))


WORSENING = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]


@pytest.mark.parametrize(
    "kwargs, stopped",
    [
        ({}, 1),
        ({"warmup_epochs": 3}, 4),  # epochs 0-2 not counted: best at 3, stop at 4
        ({"start_from_epoch": 2}, 3),  # Keras's argument still works
        ({"start_from_epoch": 2, "warmup_epochs": 5}, 6),  # the later of the two wins
    ],
)
def test_warmup_epochs_not_counted(kwargs, stopped):
    es = EarlyStopping(monitor="score", mode="min", patience=1, **kwargs)
    hist = _fit(_model(), [Score(WORSENING), es], epochs=8)
    assert es.stopped_epoch == stopped and len(hist.history["loss"]) == stopped + 1
    assert es.stop_reason == "patience"
    assert es.best_epoch == max(kwargs.get("warmup_epochs", 0), kwargs.get("start_from_epoch", 0))


@pytest.mark.parametrize(
    "scores, kwargs, stopped, reason",
    [
        ([3.0, 2.0, math.nan, 1.0], {}, 2, "non_finite"),
        ([3.0, math.inf, 1.0], {"warmup_epochs": 5}, 1, "non_finite"),  # safety stops ignore the warmup
        ([3.0, 2.0, 50.0, 1.0], {"divergence_threshold": 10.0}, 2, "divergence"),
        ([0.5, 0.6, 0.05, 0.9], {"mode": "max", "divergence_threshold": 0.1}, 2, "divergence"),
        ([3.0, 2.0, 2.5, 2.6, 2.7], {"patience": 2}, 3, "patience"),
    ],
)
def test_stop_reasons(scores, kwargs, stopped, reason, caplog):
    args = {"monitor": "score", "mode": "min", "patience": 10, **kwargs}
    es = EarlyStopping(**args)
    with caplog.at_level(logging.INFO, logger="trainwell.early_stopping"):
        hist = _fit(_model(), [Score(scores), es], epochs=len(scores))
    assert (es.stopped_epoch, es.stop_reason) == (stopped, reason)
    assert len(hist.history["loss"]) == stopped + 1
    assert es.get_state()["stop_reason"] == reason
    assert f"early stopping ({reason})" in caplog.text


def test_no_stop_keeps_reason_none():
    es = EarlyStopping(monitor="score", mode="min", patience=3)
    _fit(_model(), [Score([5.0, 4.0, 3.0, 2.0]), es], epochs=4)
    assert es.stop_reason is None and es.stopped_epoch == 0 and es.best == 2.0 and es.best_epoch == 3


# Uninterrupted: best 1.5 at epoch 3, then 3 epochs without improvement: stops at epoch 6.
PLATEAU = [3.0, 2.0, 2.5, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0, 2.1]


def _es(**kw):
    return EarlyStopping(monitor="score", mode="min", patience=3, restore_best_weights=True, **kw)


def _ckpt(d, **kw):
    return Checkpoint(d, save_every="epoch", keep_last=3, keep_best=1, monitor="score", mode="min", **kw)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("es_ref")
    model, es, seen = _model(), _es(), WeightsAt()
    hist = _fit(model, [Score(PLATEAU), seen, _ckpt(d), es], epochs=10)
    return {"model": model, "es": es, "weights": seen.by_epoch, "epochs": len(hist.history["loss"]), "dir": d}


def test_uninterrupted_reference(uninterrupted):
    es = uninterrupted["es"]
    assert (es.stopped_epoch, es.best_epoch, es.stop_reason, uninterrupted["epochs"]) == (6, 3, "patience", 7)
    assert _close(uninterrupted["model"].get_weights(), uninterrupted["weights"][3])


def test_state_survives_restart_and_stops_at_same_epoch(tmp_path, uninterrupted, crash_at):
    d = tmp_path / "ck"
    with pytest.raises(crash_at.error):  # 2 steps per epoch: dies in epoch 5, after epoch 4's checkpoint
        _fit(_model(), [Score(PLATEAU), _ckpt(d), _es(), crash_at(11)], epochs=10)
    saved = json.loads((d / list_checkpoints(d)[-1]["name"] / "state.json").read_text())
    assert saved["callbacks"]["early_stopping"] == {
        "wait": 1, "best": 1.5, "best_epoch": 3, "stopped_epoch": 0, "stop_reason": None,
    }
    model, es = _model(seed=7), _es()
    hist = _fit(model, [Score(PLATEAU), _ckpt(d), es], epochs=10)
    assert len(hist.history["loss"]) == 2  # epochs 5 and 6
    assert (es.stopped_epoch, es.best_epoch, es.stop_reason) == (6, 3, "patience")
    assert es.get_state() == uninterrupted["es"].get_state()
    # The best epoch (3) ran before the restart, so its weights came from its checkpoint.
    assert es.best_weights is None and es.restored_from.endswith("ckpt-8")
    assert _close(model.get_weights(), uninterrupted["weights"][3])
    # A rerun after the early stop does not train again.
    model2 = _model(seed=8)
    hist2 = _fit(model2, [Score(PLATEAU), _ckpt(d), _es()], epochs=10)
    assert hist2.history == {} and int(model2.optimizer.iterations.numpy()) == 14


def test_without_checkpoint_restart_loses_patience():
    # The contrast that makes the test above meaningful: fresh state => a later stop.
    es = _es()
    _fit(_model(), [Score(PLATEAU[5:]), es], epochs=5)
    assert es.stopped_epoch == 3  # would be epoch 8 of the original run, not 6


def test_best_weights_from_memory_without_checkpoint():
    model, es, seen = _model(), _es(), WeightsAt()
    _fit(model, [Score(PLATEAU), seen, es], epochs=10)
    assert es.restored_from == "memory"
    assert _close(model.get_weights(), seen.by_epoch[3])


def test_best_weights_of_a_model_split_between_processes_are_kept_as_tensors(monkeypatch):
    # No process can read such weights into NumPy (get_weights): the tensors are kept instead.
    from trainwell.compat import sharded

    monkeypatch.setattr(sharded, "spans_processes", lambda model: True)
    model, es, seen = _model(), _es(), WeightsAt()
    _fit(model, [Score(PLATEAU), seen, es], epochs=10)
    assert not any(isinstance(w, np.ndarray) for w in es.best_weights)
    assert es.restored_from == "memory" and _close(model.get_weights(), seen.by_epoch[3])


def test_best_weights_fall_back_to_best_checkpoint(tmp_path, crash_at):
    # The checkpoint of the best epoch was pruned; in-memory weights are gone after the restart;
    # the Checkpoint's best by the same monitor is used.
    d = tmp_path / "ck"
    seen = WeightsAt()
    with pytest.raises(crash_at.error):
        _fit(_model(), [Score(PLATEAU), seen, _ckpt(d), _es(), crash_at(11)], epochs=10)
    model, es = _model(seed=3), _es()
    # Drop the epoch-3 checkpoint from disk and from the index to simulate its pruning.
    import shutil

    entry = next(e for e in list_checkpoints(d) if e["completed_epoch"] == 3)
    index = json.loads((d / "checkpoint.json").read_text())
    index["checkpoints"] = [e for e in index["checkpoints"] if e["name"] != entry["name"]]
    (d / "checkpoint.json").write_text(json.dumps(index))
    shutil.rmtree(entry["path"])
    _fit(model, [Score(PLATEAU), _ckpt(d), es], epochs=10)
    best = min(list_checkpoints(d), key=lambda e: e["value"])
    assert best["completed_epoch"] == 4 and es.restored_from == best["path"]
    assert _close(model.get_weights(), seen.by_epoch[4])


def test_on_train_begin_resets_only_without_restored_state():
    es = EarlyStopping(patience=2)
    es.set_model(_model())
    es.set_state({"wait": 2, "best": 0.5, "best_epoch": 4, "stopped_epoch": 0, "stop_reason": None})
    es.on_train_begin()
    assert (es.wait, es.best, es.best_epoch) == (2, 0.5, 4)
    es.on_train_end()
    es.on_train_begin()  # next fit, nothing restored: fresh
    assert (es.wait, es.best, es.best_epoch, es.stop_reason) == (0, None, 0, None)


def test_get_config_and_state_round_trip():
    cfg = {"monitor": "val_acc", "min_delta": 0.01, "patience": 4, "verbose": 0, "mode": "max", "baseline": 0.2,
           "restore_best_weights": True, "start_from_epoch": 1, "warmup_epochs": 2, "divergence_threshold": 0.05}
    es = EarlyStopping(**cfg)
    assert es.get_config() == cfg
    assert EarlyStopping.from_config(cfg).get_config() == cfg
    state = {"wait": 3, "best": 0.75, "best_epoch": 5, "stopped_epoch": 9, "stop_reason": "divergence"}
    es.set_state(state)
    assert es.get_state() == state and json.loads(json.dumps(es.get_state())) == state


def test_defaults_are_keras_defaults():
    # A drop-in: every argument Keras has, with Keras's default (patience=0 included).
    ours = inspect.signature(EarlyStopping.__init__).parameters
    theirs = inspect.signature(keras.callbacks.EarlyStopping.__init__).parameters
    shared = [n for n in theirs if n != "self"]
    assert {n: ours[n].default for n in shared} == {n: theirs[n].default for n in shared}
    assert list(ours)[: len(theirs)] == list(theirs)  # same order: positional calls mean the same


# Values Keras accepts; both classes see the same monitored values and must stop alike.
KERAS_ACCEPTS = [
    dict(patience=np.int64(2), baseline=np.float32(0.6)),
    dict(patience=np.int64(1), min_delta=np.float32(0.01), start_from_epoch=np.int64(2)),
    dict(patience=1, verbose=True, restore_best_weights=1),
]


@pytest.mark.parametrize("kwargs", KERAS_ACCEPTS)
def test_accepts_what_keras_accepts(kwargs, capsys):
    values = [0.5, 0.7, 0.705, 0.71, 0.69, 0.72, 0.7, 0.7, 0.7]
    runs = []
    for cls in (keras.callbacks.EarlyStopping, EarlyStopping):
        es = cls(monitor="score", mode="max", **kwargs)
        es.set_model(_model())
        es.on_train_begin()
        for epoch, v in enumerate(values):
            es.on_epoch_end(epoch, {"score": v})
            if es.model.stop_training:
                break
        es.on_train_end()
        runs.append((es.stopped_epoch, es.best_epoch, es.wait, float(es.best)))
    assert runs[0] == runs[1]
    assert runs[1][0] > 0  # it did stop, so the comparison covers the stop
    config = EarlyStopping(**kwargs).get_config()
    assert json.loads(json.dumps(config)) == config  # NumPy scalars become Python numbers


def test_unknown_mode_warns_and_falls_back_to_auto():
    with pytest.warns(UserWarning, match="mode 'unknown' is unknown, fallback to auto mode"):
        es = EarlyStopping(monitor="val_accuracy", mode="unknown")
    assert es.mode == "auto" and es.get_config()["mode"] == "auto"


def test_monitors_a_one_element_array():
    # Binary keras.metrics.F1Score reports shape (1,); Keras compares it fine, and so must we.
    f1 = keras.metrics.F1Score(threshold=0.5)
    f1.update_state(np.array([[1.0], [0.0], [1.0]]), np.array([[0.9], [0.2], [0.4]]))
    assert keras.ops.convert_to_numpy(f1.result()).shape == (1,)
    es = EarlyStopping(monitor="val_f1_score", mode="max", patience=1)
    es.set_model(_model())
    es.on_train_begin()
    for epoch, v in enumerate([f1.result(), np.array([0.9]), np.array([0.8], "float32"), np.array([0.95])]):
        es.on_epoch_end(epoch, {"val_f1_score": v})
        if es.model.stop_training:
            break
    assert (es.stopped_epoch, es.best_epoch, es.stop_reason) == (2, 1, "patience")
    assert es.get_state()["best"] == pytest.approx(0.9) and type(es.get_state()["best"]) is float


def test_a_metric_with_several_values_is_a_clear_error():
    es = EarlyStopping(monitor="val_f1_score", mode="max")
    es.set_model(_model())
    es.on_train_begin()
    with pytest.raises(ValueError, match=r"cannot monitor `val_f1_score`: its value has shape \(3,\)"):
        es.on_epoch_end(0, {"val_f1_score": np.array([0.1, 0.5, 0.9])})


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"patience": -1}, "patience"),
        ({"patience": 1.5}, "patience"),
        ({"monitor": ""}, "monitor"),
        ({"min_delta": "x"}, "min_delta"),
        ({"baseline": "x"}, "baseline"),
        ({"baseline": math.nan}, "baseline"),
        ({"restore_best_weights": "yes"}, "restore_best_weights"),
        ({"restore_best_weights": 2}, "restore_best_weights"),
        ({"start_from_epoch": -1}, "start_from_epoch"),
        ({"warmup_epochs": 2.0}, "warmup_epochs"),
        ({"divergence_threshold": math.nan}, "divergence_threshold"),
        ({"verbose": "loud"}, "verbose"),
        ({"verbose": 1.5}, "verbose"),
    ],
)
def test_argument_validation(kwargs, name):
    with pytest.raises(ValueError, match=rf"Invalid value for argument `{name}`.*Received: {name}="):
        EarlyStopping(**kwargs)


def _stop_data():
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(4).repeat()  # 4 batches per pass


def test_stop_at_step_ends_inside_the_last_epoch_after_validation():
    from trainwell.callbacks import StopAtStep

    model, seen = _model(), []
    log = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: seen.append((e, sorted(logs))))
    hist = model.fit(_stop_data(), epochs=3, steps_per_epoch=10, validation_data=(X, Y),
                     callbacks=[StopAtStep(15), log], verbose=0)
    assert int(model.optimizer.iterations) == 15
    assert len(hist.history["loss"]) == 2  # epoch 2 cut after 5 of its 10 steps
    assert seen[-1][0] == 1 and "val_loss" in seen[-1][1]  # the partial epoch is still validated


def test_stop_at_step_counts_the_optimizers_steps_so_a_restart_stops_at_the_same_step():
    from trainwell.callbacks import StopAtStep

    model = _model()
    model.fit(_stop_data(), epochs=3, steps_per_epoch=10, callbacks=[StopAtStep(7)], verbose=0)  # "crash" at 7
    assert int(model.optimizer.iterations) == 7
    # The restarted fit (a fresh callback, the optimizer's count restored) ends at 25, not 7 + 25.
    model.fit(_stop_data(), epochs=3, steps_per_epoch=10, callbacks=[StopAtStep(25)], verbose=0)
    assert int(model.optimizer.iterations) == 25
    assert StopAtStep(25).get_config() == {"max_steps": 25}


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, None])
def test_stop_at_step_validates(bad):
    from trainwell.callbacks import StopAtStep

    with pytest.raises(ValueError, match=f"Received: max_steps={bad!r}"):
        StopAtStep(bad)


def test_an_early_stopped_run_trains_longer_with_more_epochs(tmp_path, capsys):
    # fit(epochs=10) stops early at epoch 7 (index 6). The same fit again trains nothing and says how to
    # train longer; that way (more epochs than the stopped fit had) trains on from the stop, patience
    # starting again, and the stop it reaches ends that fit in turn.
    scores = PLATEAU + [2.2 + i / 10 for i in range(40)]
    d = tmp_path / "ck"
    _fit(_model(), [Score(scores), _ckpt(d), _es()], epochs=10)
    capsys.readouterr()
    model = _model(seed=3)
    assert _fit(model, [Score(scores), _ckpt(d), _es()], epochs=10).history == {}
    out = capsys.readouterr().out
    assert "already complete (it stopped early after epoch 7 of 10, 14 steps; " in out
    assert "To train longer: run the same fit(epochs=N) again with Checkpoint(" in out and "with N > 10." in out
    es = _es()
    hist = _fit(model, [Score(scores), _ckpt(d), es], epochs=20)
    assert "it had stopped early after epoch 7 of 10: training on to epoch 20" in capsys.readouterr().out
    # Epochs 8-10 (indices 7-9): none beats epoch 4's 1.5, so patience (3, counted afresh) stops at 10.
    assert hist.epoch == [7, 8, 9] and int(model.optimizer.iterations.numpy()) == 20
    assert (es.stopped_epoch, es.stop_reason, es.best, es.best_epoch) == (9, "patience", 1.5, 3)
    assert _fit(_model(), [Score(scores), _ckpt(d), _es()], epochs=20).history == {}
    assert "stopped early after epoch 10 of 20" in capsys.readouterr().out
    hist = _fit(_model(), [Score(scores), _ckpt(d), _es()], epochs=50)
    assert hist.epoch == [10, 11, 12]
