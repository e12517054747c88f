"""`TRAINWELL_QUICK`: smoke-test a config end to end in seconds.

Like Lightning's `fast_dev_run`: with `TRAINWELL_QUICK=1` in the environment every
recipe run (Python, `trainwell train`, a search's trials) trains one batch in one
epoch and validates and tests on one batch; every search runs one trial (Hyperband
and PBT: at most 2 epochs per model, PBT a population of 2, so exploit and explore run); `lr_find` / `trainwell lr-find` ramp and
probe for at most 10 steps. `TRAINWELL_QUICK=N` allows N batches (and 10 x N LR-finder
steps). Everything else runs as usual: data loading, model building, compiling,
callbacks, checkpoints, plots, the run directory. The figures such a run prints are
meaningless; it only shows that the config runs.

`caps()` is the one place that reads the variable; the helpers below apply it
where a recipe run, a search and the LR finder fix their lengths.

Example:
>>> import os
>>> os.environ["TRAINWELL_QUICK"] = "1"
>>> caps()
QuickCaps(batches=1, trials=1, epochs=2, population_size=2, lr_steps=10)
>>> del os.environ["TRAINWELL_QUICK"]
>>> caps() is None
True
"""

from __future__ import annotations

import dataclasses
import os
import sys

import keras

from trainwell.config import ConfigError
from trainwell.validation import invalid_argument, is_int

#: The environment variable.
ENV = "TRAINWELL_QUICK"
_OFF = ("", "0", "false", "no", "off")
_ON = ("true", "yes", "on")
_announced: set[str] = set()


@dataclasses.dataclass(frozen=True)
class QuickCaps:
    """The limits `TRAINWELL_QUICK=N` sets.

    Attributes:
        batches: Training batches of a run (in one epoch), and validation and test batches.
        trials: Trials of a search (random, Bayesian).
        epochs: Epochs per model of Hyperband and PBT.
        population_size: PBT population.
        lr_steps: Steps of the LR finder's range test and of each probe.
    """

    batches: int
    trials: int = 1
    epochs: int = 2
    population_size: int = 2
    lr_steps: int = 10


def caps() -> QuickCaps | None:
    """The caps `TRAINWELL_QUICK` asks for, or `None` when it is unset, empty or `0`.

    `TRAINWELL_QUICK=N` (a positive integer) allows N training, validation and test
    batches per run and 10 x N LR-finder steps; `true`/`yes`/`on` mean 1.

    Raises:
        trainwell.config.ConfigError: The value is neither off, on nor a positive integer.

    Example:
    >>> os.environ["TRAINWELL_QUICK"] = "3"
    >>> caps().batches, caps().lr_steps
    (3, 30)
    >>> del os.environ["TRAINWELL_QUICK"]
    """
    raw = os.environ.get(ENV, "").strip().lower()
    if raw in _OFF:
        return None
    n = 1 if raw in _ON else int(raw) if raw.isdigit() else 0
    if n < 1:
        raise invalid_argument(ENV, "expected 0 (off), 1 (on) or a number of batches", os.environ[ENV],
                               what="environment variable", error=ConfigError)
    return QuickCaps(batches=n, lr_steps=10 * n)


def _announce(what: str, line: str) -> None:
    """One line per kind of capped work and process, so a forgotten variable shows."""
    if what not in _announced:
        _announced.add(what)
        print(f"{ENV}={os.environ.get(ENV)}: {line}", file=sys.stderr, flush=True)


def run_callbacks() -> list:
    """`[QuickRun]` under `TRAINWELL_QUICK`, else `[]`: the recipes' harness adds it to every run.

    Example:
    >>> run_callbacks()
    []
    """
    c = caps()
    if c is None:
        return []
    _announce("run", f"quick smoke test: each run stops after {c.batches} training batch(es) in its first "
                     f"epoch and evaluates {c.batches} batch(es); its figures mean nothing.")
    return [QuickRun(c.batches)]


def test_steps() -> int | None:
    """The `steps` of a recipe's final `evaluate` on its test split (`None`: all of it).

    Example:
    >>> test_steps() is None
    True
    """
    c = caps()
    return None if c is None else c.batches


def search_lengths(max_trials: int, max_epochs: int | None, population_size: int, ready_interval: int):
    """`(max_trials, max_epochs, population_size, ready_interval)` of a search, capped under `TRAINWELL_QUICK`.

    Args:
        max_trials: `trainwell.tuning.search`'s argument. Required.
        max_epochs: Its argument (`None`: the config's epochs, capped to the quick epochs). Required.
        population_size: Its argument. Required.
        ready_interval: Its argument (never above the capped epochs). Required.

    Example:
    >>> search_lengths(10, None, 4, 1)
    (10, None, 4, 1)
    """
    c = caps()
    if c is None:
        return max_trials, max_epochs, population_size, ready_interval
    _announce("search", f"quick search: at most {c.trials} trial(s), {c.epochs} epochs per model (Hyperband, PBT), "
                        f"a PBT population of {c.population_size}.")
    epochs = c.epochs if max_epochs is None else min(max_epochs, c.epochs)
    return (min(max_trials, c.trials), epochs, min(population_size, c.population_size),
            min(ready_interval, epochs))


def lr_find_steps(steps: int, probe_steps: int | None):
    """`(steps, probe_steps)` of `lr_find`, capped under `TRAINWELL_QUICK`.

    Args:
        steps: `lr_find`'s range-test steps. Required.
        probe_steps: Its steps per probe (`None`: `steps`). Required.

    Example:
    >>> lr_find_steps(100, None)
    (100, None)
    """
    c = caps()
    if c is None:
        return steps, probe_steps
    _announce("lr_find", f"quick LR finder: at most {c.lr_steps} range-test steps and {c.lr_steps} steps per probe.")
    def cap(n):  # a bad value is left to `lr_find`'s own check
        return min(n, c.lr_steps) if is_int(n) else n

    return cap(steps), cap(probe_steps)


class QuickRun(keras.callbacks.Callback):
    """Stops `fit` after `batches` training batches and each evaluation after `batches` batches.

    Keras's `fit` has `steps_per_epoch` and `validation_steps`, but a recipe sets
    them from its data; this callback caps them from the outside, through Keras's
    own `model.stop_training` and `model.stop_evaluating` flags, so the recipes'
    code stays the same with or without `TRAINWELL_QUICK`. The epoch it stops in
    still ends normally (validation, loggers, checkpoint): Keras hands every
    callback of a `fit` the same `params` dict, and this callback, listed first,
    lowers its `"steps"` to `batches` at train begin, so callbacks that check
    whether an epoch is complete (`Checkpoint` commits only complete epochs) see
    a complete, short epoch, and the run can be resumed or exported like any other.

    Args:
        batches: Training batches before `fit` stops (one execution counts once
            with `steps_per_execution` > 1), and batches of each evaluation. Defaults to `1`.

    Example:
    >>> model.fit(x, y, epochs=90, callbacks=[QuickRun(2)])  # doctest: +SKIP
    """

    def __init__(self, batches: int = 1) -> None:
        super().__init__()
        if not (is_int(batches) and batches >= 1):
            raise invalid_argument("batches", "an integer >= 1", batches)
        self.batches = batches
        self._trained = 0
        self._evaluated = 0

    def get_config(self) -> dict:
        return {"batches": self.batches}

    def on_train_begin(self, logs=None) -> None:
        self._trained = 0
        if self.params and self.params.get("steps"):
            self.params["steps"] = min(int(self.params["steps"]), self.batches)

    def on_train_batch_end(self, batch, logs=None) -> None:
        self._trained += 1
        if self._trained >= self.batches:
            self.model.stop_training = True

    def on_test_begin(self, logs=None) -> None:
        self._evaluated = 0

    def on_test_batch_end(self, batch, logs=None) -> None:
        self._evaluated += 1
        if self._evaluated >= self.batches:
            self.model.stop_evaluating = True
