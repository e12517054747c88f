"""`TRAINWELL_QUICK`: the switch that shrinks every run, search and LR-finder run to a smoke test."""

import numpy as np
import pytest

from trainwell import quick
from trainwell.config import ConfigError


@pytest.mark.parametrize("value,batches", [("", None), ("0", None), ("off", None), ("False", None),
                                           ("1", 1), ("true", 1), ("yes", 1), ("4", 4)])
def test_caps_reads_the_variable(monkeypatch, value, batches):
    monkeypatch.setenv(quick.ENV, value)
    c = quick.caps()
    assert (c and c.batches) == batches
    if c:
        assert c.lr_steps == 10 * batches


@pytest.mark.parametrize("value", ["-1", "abc", "1.5"])
def test_a_bad_value_is_one_config_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(quick.ENV, value)
    with pytest.raises(ConfigError, match=rf"`TRAINWELL_QUICK`.*Received: TRAINWELL_QUICK='{value}'"):
        quick.caps()


def test_search_and_lr_find_lengths_are_capped_only_when_on(monkeypatch):
    monkeypatch.delenv(quick.ENV, raising=False)
    assert quick.search_lengths(10, None, 4, 3) == (10, None, 4, 3)
    assert quick.lr_find_steps(100, 50) == (100, 50)
    assert quick.run_callbacks() == [] and quick.test_steps() is None
    monkeypatch.setenv(quick.ENV, "1")
    assert quick.search_lengths(10, None, 4, 3) == (1, 2, 2, 2)
    assert quick.search_lengths(1, 1, 2, 1) == (1, 1, 2, 1)  # never raised
    assert quick.lr_find_steps(100, None) == (10, None)
    assert quick.lr_find_steps(5, 50) == (5, 10)
    assert quick.test_steps() == 1


def test_quick_run_stops_fit_and_each_evaluation_after_its_batches():
    import keras

    class Count(keras.callbacks.Callback):
        val = 0

        def on_test_batch_end(self, batch, logs=None):
            Count.val += 1

    x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    hist = model.fit(x, x.sum(1), validation_data=(x, x.sum(1)), batch_size=8, epochs=5, verbose=0,
                     callbacks=[quick.QuickRun(2), Count()])
    assert int(model.optimizer.iterations) == 2  # of 40
    assert len(hist.history["loss"]) == 1 and "val_loss" in hist.history
    assert Count.val == 2  # of 8
    with pytest.raises(ValueError, match="Received: batches=0"):
        quick.QuickRun(0)


@pytest.mark.slow
def test_a_recipe_run_and_lr_find_under_the_switch_are_short(monkeypatch, tmp_path):
    import keras

    from trainwell import lr_find
    from trainwell.recipes import resnet_imagenet

    evaluate, steps = keras.Model.evaluate, []

    def spy(self, *args, **kwargs):  # the recipe's final evaluation on the test split
        steps.append(kwargs.get("steps"))
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(keras.Model, "evaluate", spy)
    monkeypatch.setenv(quick.ENV, "1")
    run = resnet_imagenet.train(dataset="digits", epochs=3, model="resnet18", width=4, batch_size=64,
                                doctor=False, jit_compile=False, verbose=0, run_dir=str(tmp_path / "run"))
    assert int(run.model.optimizer.iterations) == 1  # of 3 epochs x 19 batches
    assert len(run.history["loss"]) == 1 and "test_accuracy" in run.metrics
    assert steps[-1] == 1 and (tmp_path / "run" / "metrics.json").is_file()
    # The short epoch is complete: it is checkpointed, so a search can export the trial's model.
    assert list((tmp_path / "run" / "checkpoints").glob("ckpt-*"))

    x = np.random.default_rng(0).normal(size=(256, 4)).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(), "mse")
    result = lr_find(model, (x, x.sum(1)), start_lr=1e-4, steps=100, method="minimum")
    assert len(result.lrs) <= 10


def test_a_search_under_the_switch_runs_one_trial(monkeypatch, tmp_path):
    import importlib.util
    import sys
    from pathlib import Path

    from trainwell import tuning

    name = "trainwell_test_tuning_recipe"  # the tiny MLP recipe of test_tuning.py, as a module of its own
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / "tuning" / "test_tuning.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    monkeypatch.setenv(quick.ENV, "1")
    result = tuning.search(sys.modules[name].tiny_hypermodel(epochs=2), "random", max_trials=3, directory=tmp_path,
                           verbose=0, export=False)
    assert len(result.tuner.oracle.trials) == 1
