"""`NaNRollback`: detect a diverging step, restore the last good state, lower the LR.

Keras's `TerminateOnNaN` only stops, and only reads the epoch's running mean of
the loss; `BackupAndRestore` restores whole epochs from files. `NaNRollback`
does what large runs do by hand (PaLM, Chowdhery et al. 2022, sec. 5.1): keep a
device-side copy of the training state (`trainwell.compat.snapshot`), and on a
non-finite loss, non-finite weights, a collapsed loss scale or a loss spike,
restore it, skip ahead and lower the learning rate.

Read top to bottom: the spike rule, the check's values, the callback's
arguments and state, its compiled functions (`_build_machinery`), the checks
(`on_train_batch_end`), then the rollback (`_diverged`) and its records.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections import deque
from pathlib import Path
from typing import Any

import keras
import numpy as np

from trainwell import runtime
from trainwell.callbacks.base import StatefulCallback, constructor_config
from trainwell.compat.backend import add_step_output, kept_on_model, strategy_scope, sync_variables
from trainwell.compat.keras_internals import loss_tracker
from trainwell.compat.learning_rate import current_lr, learning_rate_variables, scale_learning_rate
from trainwell.compat.snapshot import (
    Snapshot,
    assign_function,
    in_one_call,
    initialized,
    outside_trace,
    read_function,
    state_function,
)
from trainwell.validation import invalid_argument, is_int, is_number

_EVENTS_FILE = "nan_rollback.jsonl"

#: Batches of kept losses before spike detection starts (see `NaNRollback`).
SPIKE_MIN_HISTORY = 3

#: Causes, in the order they are reported.
CAUSES = ("nonfinite_loss", "nonfinite_weights", "loss_scale_collapse", "loss_spike")

#: The attribute of a model that keeps NaNRollback's compiled functions between fits.
_FNS_ATTR = "_trainwell_nan_rollback_fns"


def spike_threshold(
    recent_losses, loss_high: float | None, spike_factor: float, steps_per_check: int = 1
) -> float | None:
    """The batch loss above which `NaNRollback` sees a loss spike.

    `spike_factor` times the largest of `recent_losses`, and at least
    `loss_high` (the highest loss of the run so far); `None` (no detection)
    while the losses cover fewer than `SPIKE_MIN_HISTORY` batches. When each
    loss is the mean of `n = steps_per_check` batches, one batch at
    `spike_factor` x shows as `(spike_factor + n - 1) / n` x in the mean, and
    that is the factor used.

    Args:
        recent_losses: The recent losses (those kept, not spikes), one per check.
        loss_high: The highest kept loss of the run, or `None`.
        spike_factor: The factor (> 1).
        steps_per_check: Batches per loss (`steps_per_execution`: each loss is
            the mean of that many batches). Defaults to `1`.

    Returns:
        The threshold, or `None`.

    Example:
    >>> spike_threshold([0.02, 0.05, 0.01], 2.3, 5.0)  # near zero, the run's start rules
    2.3
    >>> spike_threshold([2.1, 2.4, 1.9], 2.5, 5.0)
    12.0
    >>> spike_threshold([2.4], 2.5, 5.0, steps_per_check=4)  # (5 + 3) / 4 = 2 x
    4.8
    """
    n = steps_per_check
    if len(recent_losses) * n < SPIKE_MIN_HISTORY:
        return None
    factor = (spike_factor + n - 1) / n
    return max(factor * max(recent_losses), -math.inf if loss_high is None else loss_high)


class TrainingDivergedError(RuntimeError):
    """Raised by `NaNRollback` when rolling back no longer helps.

    The message says what happened (steps, causes, learning rates); the events
    are also in the `events` attribute (a list of dicts, as in the callback state).

    Example:
    >>> err = TrainingDivergedError("diverged", events=[{"step": 3}])
    >>> err.events[0]["step"]
    3
    """

    def __init__(self, message: str, events: list[dict] | None = None) -> None:
        super().__init__(message)
        self.events = list(events or [])


def _json_float(x: float | None):
    if x is None:
        return None
    return float(x) if math.isfinite(x) else str(float(x))


def _check_int(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    if not (optional and value is None) and (not is_int(value) or value < minimum):
        raise invalid_argument(name, f"an int >= {minimum}", value)


def _all_finite(tensors: list):
    """Whether every element of `tensors` is finite, as one boolean scalar, in one pass over each.

    A sum is NaN or infinite when an element is, so one reduction per tensor
    replaces `all(isfinite(w))` and its boolean temporary. Sums are taken in at
    least float32: a float16 sum of finite weights overflows at 65504.
    """
    ops = keras.ops
    sums = []
    for t in tensors:
        if keras.backend.standardize_dtype(t.dtype) not in ("float32", "float64"):
            t = ops.cast(t, "float32")
        sums.append(ops.cast(ops.sum(t), "float32"))
    return ops.all(ops.isfinite(ops.stack(sums)))


def _checked_variables(model) -> tuple[list, tuple[bool, int, bool]]:
    """The variables a check reads (loss tracker sums, float weights, loss scale), and their layout."""
    tracker, opt = loss_tracker(model), model.optimizer
    sums = [tracker.total, tracker.count] if tracker is not None else []
    floats = [w for w in model.weights if keras.backend.is_float_dtype(w.dtype)]
    lso = isinstance(opt, keras.optimizers.LossScaleOptimizer) and getattr(opt, "built", False)
    scale = [opt.dynamic_scale] if lso else []
    return sums + floats + scale, (bool(sums), len(floats), bool(scale))


def _check_values(values: list, layout: tuple[bool, int, bool], check_weights: bool) -> list:
    """`[loss total, loss count, weights finite, loss scale]` (float32) from the values of `_checked_variables`.

    The weights' verdict is 1.0 (all finite) or 0.0, and -1.0 when not checked;
    the sums and the scale are -1.0 when there is no tracker or no
    LossScaleOptimizer. float32 is the dtype of the sums and the scale.
    """
    ops, f = keras.ops, "float32"
    has_sums, n_floats, has_scale = layout
    none = -ops.ones((), f)
    out = [ops.cast(values[0], f), ops.cast(values[1], f)] if has_sums else [none, none]
    floats = values[2 * has_sums : 2 * has_sums + n_floats]
    out.append(ops.cast(_all_finite(floats), f) if check_weights and floats else none)
    out.append(ops.cast(values[-1], f) if has_scale else none)
    return out


def _probe_vector(values: list, layout: tuple[bool, int, bool], check_weights: bool):
    """`_check_values` as one vector, for a compiled check of its own (one host read)."""
    return keras.ops.stack(_check_values(values, layout, check_weights))


class _SnapshotBeforeApply:
    """`optimizer.apply`, preceded by `NaNRollback`'s first snapshot (see `_hook_first_apply`)."""

    def __init__(self, callback: "NaNRollback", apply) -> None:
        self.callback, self.apply = callback, apply

    def __call__(self, *args, **kwargs):
        self.callback._snapshot_before_first_update()
        return self.apply(*args, **kwargs)


class NaNRollback(StatefulCallback):
    """Rolls training back to the last good state when it diverges, with a lower LR.

    Extends no Keras built-in: `TerminateOnNaN` only stops and only reads
    `logs["loss"]`; `BackupAndRestore` restores whole epochs from files. This
    callback keeps a *device-side* copy of the training state
    (`trainwell.compat.snapshot.Snapshot`: one compiled read, no copy on
    TensorFlow until the next update) every `snapshot_every` steps and checks
    every step for:

    - `"nonfinite_loss"`: a non-finite *batch* loss (recovered exactly from the
      loss tracker's `total`/`count`: `logs["loss"]` is the epoch's mean).
    - `"nonfinite_weights"`: a NaN/Inf in the model's weights, checked by one
      reduction over all of them before every snapshot, at the end of every
      epoch (before a `Checkpoint` listed after this callback saves them),
      after every non-finite loss, and every `check_weights_every` steps if
      set: on some x86 CPUs oneDNN's ReLU maps NaN to 0, and NaN weights then
      give a finite loss. The rollback lands on the snapshot before them, so
      no snapshot and no checkpoint ever holds them.
    - `"loss_scale_collapse"` (mixed_float16): the `LossScaleOptimizer`'s scale
      fell to `loss_scale_floor` or below. Its own skipped steps are *not*
      divergence; they are counted in the state as `loss_scale_skips`.
    - `"loss_spike"`: a finite batch loss above `spike_threshold`: more than
      `spike_factor` times the largest of the last `spike_window` losses, and
      higher than any loss of the run before it (a batch with a huge gradient
      wrecks a run without ever producing a NaN). The reference is the recent
      *maximum* and the run's highest loss a floor, because near the end of a
      run healthy batches reach many times the recent median, never the run's
      early highs (`bench/spike_rollback.py`). A spike whose update the
      `LossScaleOptimizer` skipped is not rolled back (it counts in
      `loss_scale_skips`); spikes never join the history.

    On divergence it restores the model weights and all optimizer variables
    (slots, `iterations`, the loss scale and its counter, EMA and gradient
    accumulators) from the snapshot, multiplies the learning rate by
    `lr_factor` (`trainwell.compat.learning_rate.scale_learning_rate`, so LR
    schedules work too), and takes a fresh snapshot of that state.

    The input pipeline is not rewound: the batches since the snapshot are
    skipped, as in PaLM. `iterations` goes back with the optimizer state, so an
    LR schedule goes back with it and a run that rolled back `k` batches ends
    `k` updates short of the schedule's end. The LR variable is not in the
    snapshot: a rollback never undoes another callback's LR change. Batches
    whose loss was non-finite are taken out of the epoch's running loss (and
    `logs["loss"]`), so a `TerminateOnNaN` listed after this callback does not
    stop a recovered run.

    After `max_rollbacks` rollbacks within `window_steps` steps, the next
    divergence restores the last good state once more (so `model` holds good
    weights) and raises `TrainingDivergedError`.

    Each event (step, causes, loss, LR before and after, batches skipped,
    `iterations` before and after) is printed as one line, kept in
    `get_state()["events"]` (it survives a restart through `Checkpoint`),
    appended to `run_dir/nan_rollback.jsonl` (by the chief) and counted in the
    epoch logs as `logs["nan_rollbacks"]`.

    The per-step check costs no compiled call of its own: its values are
    computed inside the compiled train step, after its update
    (`trainwell.compat.backend.add_step_output`), and read in
    `on_train_batch_end`, which waits for the step Keras's logs wait for.

    Works under `tf.distribute` strategies (a restore writes every replica),
    with `steps_per_execution > 1` (checks every N steps; steps are counted in
    batches) and on JAX. Under multi-worker training each check's verdict is
    OR-reduced across the workers (`trainwell.runtime.any_across_workers`), so
    every worker rolls back at the same step, to the same snapshot. (The class
    attribute `sync_across_workers`, `None` = on exactly when there are
    several workers, exists so a test can show the workers parting without it.)

    Args:
        snapshot_every: Steps (batches) between snapshots. A rollback lands at
            most this many steps back; PaLM restarted about 100 steps before a
            spike. Defaults to `100`.
        lr_factor: Factor in (0, 1] applied to the learning rate after each
            rollback; `1.0` keeps the LR (PaLM's choice: skip the batches only).
            Defaults to `0.5`.
        max_rollbacks: Rollbacks allowed within `window_steps` steps; the next
            divergence raises `TrainingDivergedError` (`0`: the first one). The
            LR is at most cut to 1/8 before giving up: past that, a bug or bad
            data is likelier than a transient. Defaults to `3`.
        window_steps: Length in steps of the window in which rollbacks are
            counted; `None` counts the whole run. Defaults to `None`.
        spike_factor: Roll back when a batch loss exceeds this factor (> 1)
            times the largest of the last `spike_window` losses (and every
            earlier loss of the run); `None` disables spike detection. 5 lies
            between healthy runs' new highs and the smallest spike that hurt
            accuracy (`bench/spike_rollback.py`). Defaults to `5.0`.
        spike_window: Number of recent kept batch losses whose maximum is the
            reference; shorter windows follow a falling loss sooner. Defaults
            to `50`.
        check_weights_every: Steps between weight checks besides the ones
            always made; `None` adds none. At `1` the check is part of the
            train step (no call of its own; a few % of a small model's step),
            and NaN weights behind a finite loss are found at the step they
            appear. Above 1 each check is a compiled call of its own. Defaults
            to `None`: such weights are found at the next snapshot or epoch end.
        loss_scale_floor: Under a `LossScaleOptimizer`, a loss scale at or
            below this value is a divergence. Keras starts at 2**15 and halves
            the scale at each overflow, so `1.0` means 15 more overflows than
            growths. Defaults to `1.0`.
        run_dir: Directory in which `nan_rollback.jsonl` is appended (one JSON
            object per event); `None` writes no file. Defaults to `None`.

    Example:
    >>> import keras, numpy as np
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(keras.optimizers.SGD(0.01), "mse")
    >>> cb = NaNRollback(snapshot_every=10, lr_factor=0.5, max_rollbacks=3)
    >>> x = np.ones((64, 4), "float32"); x[8:16] = np.inf  # batch 1 is poisoned
    >>> _ = model.fit(x, np.ones((64, 1)), batch_size=8, shuffle=False,
    ...               callbacks=[cb], verbose=0)  # doctest: +SKIP
    NaNRollback: step 2: nonfinite_loss, nonfinite_weights; restored step 0 ...
    >>> cb.get_state()["rollbacks"]  # doctest: +SKIP
    1
    """

    #: Reduce each check's verdict across the workers (`None`: when there are several).
    sync_across_workers: bool | None = None

    def __init__(
        self,
        snapshot_every: int = 100,
        lr_factor: float = 0.5,
        max_rollbacks: int = 3,
        window_steps: int | None = None,
        spike_factor: float | None = 5.0,
        spike_window: int = 50,
        check_weights_every: int | None = None,
        loss_scale_floor: float = 1.0,
        run_dir: str | os.PathLike | None = None,
    ) -> None:
        _check_int("snapshot_every", snapshot_every, 1)
        if not is_number(lr_factor, finite=False) or not 0.0 < float(lr_factor) <= 1.0:
            raise invalid_argument("lr_factor", "a float in (0, 1]", lr_factor)
        _check_int("max_rollbacks", max_rollbacks, 0)
        _check_int("window_steps", window_steps, 1, optional=True)
        if spike_factor is not None and not (is_number(spike_factor) and float(spike_factor) > 1.0):
            raise invalid_argument("spike_factor", "None or a finite float > 1", spike_factor)
        _check_int("spike_window", spike_window, 2)
        _check_int("check_weights_every", check_weights_every, 1, optional=True)
        if not is_number(loss_scale_floor) or float(loss_scale_floor) < 0.0:
            raise invalid_argument("loss_scale_floor", "a finite float >= 0", loss_scale_floor)
        if run_dir is not None and not isinstance(run_dir, (str, os.PathLike)):
            raise invalid_argument("run_dir", "None or a path", run_dir)
        self.snapshot_every = int(snapshot_every)
        self.lr_factor = float(lr_factor)
        self.max_rollbacks = int(max_rollbacks)
        self.window_steps = None if window_steps is None else int(window_steps)
        self.spike_factor = None if spike_factor is None else float(spike_factor)
        self.spike_window = int(spike_window)
        self.check_weights_every = None if check_weights_every is None else int(check_weights_every)
        self.loss_scale_floor = float(loss_scale_floor)
        self.run_dir = None if run_dir is None else os.fspath(run_dir)
        super().__init__()
        self._snapshot = None

    # ------------------------------------------------------------------ config and state
    def get_config(self) -> dict[str, Any]:
        return constructor_config(self)

    def reset_state(self) -> None:
        self.step = 0  # batches consumed in this run (not optimizer iterations)
        self.events: list[dict] = []
        self.recent_losses: deque = deque(maxlen=self.spike_window)
        self.loss_high: float | None = None  # the highest loss kept in the history in this run
        self.loss_scale_skips = 0
        self._begin = 0  # the batch index of the last `on_train_batch_begin`
        self.snapshot_step: int | None = None

    @property
    def rollbacks(self) -> int:
        """Number of rollbacks performed in this run."""
        return sum(1 for e in self.events if e.get("action") == "rollback")

    def get_state(self) -> dict[str, Any]:
        return {
            "step": int(self.step),
            "rollbacks": self.rollbacks,
            "events": json.loads(json.dumps(self.events)),
            "recent_losses": [float(x) for x in self.recent_losses],
            "loss_high": self.loss_high,
            "loss_scale_skips": int(self.loss_scale_skips),
            # the batch of the step whose begin hook ran: a mid-epoch resume mutes that hook (it ran before
            # the checkpoint), and without it the first resumed step counted every batch skipped before it
            "begin": int(self._begin),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        self.step = int(state.get("step", 0))
        self.events = json.loads(json.dumps(list(state.get("events", []))))
        self.recent_losses = deque((float(x) for x in state.get("recent_losses", [])), maxlen=self.spike_window)
        high = state.get("loss_high", max(self.recent_losses, default=None))
        self.loss_high = None if high is None else float(high)
        self.loss_scale_skips = int(state.get("loss_scale_skips", 0))
        self._begin = int(state.get("begin", 0))
        self.snapshot_step = None  # the device copy is not part of the state; retaken at train begin

    # ------------------------------------------------------------------ the compiled functions
    def _state_variables(self) -> list:
        """Model weights + optimizer variables, minus the learning-rate variable(s)."""
        opt = self.model.optimizer
        skip = {id(v) for v in learning_rate_variables(opt)}
        unique = {id(v): v for v in [*self.model.weights, *(opt.variables if opt is not None else [])]}  # first kept
        return [v for key, v in unique.items() if key not in skip]

    def _build_machinery(self) -> None:
        """The snapshot and the compiled checks, for the model's variables now.

        The compiled functions are kept with the model (`kept_on_model`) while
        its variables stay the same, so a later `fit` of it does not trace them
        again; the snapshot's values are this callback's, freed at the end of
        `fit`. `read_probe`: a due snapshot's read with its weight check.
        """
        model = self.model
        variables = self._state_variables()
        checked, layout = _checked_variables(model)
        key = tuple(id(v) for v in variables + checked)

        def make() -> dict:
            read = read_function(model, variables)
            probe = {w: state_function(model, checked, functools.partial(_probe_vector, layout=layout, check_weights=w))
                     for w in (True, False)}
            return {
                "read": read,
                "assign": assign_function(model, variables),
                "probe_full": probe[True],
                "probe_loss": probe[False],
                "read_probe": in_one_call(read, probe[True]),  # each traced once, whichever runs first
            }

        self._fns = kept_on_model(model, _FNS_ATTR, key, make)
        self._snapshot = Snapshot(self._fns["read"], self._fns["assign"])
        self._n_vars, self._has_sums = len(variables), layout[0]

    def _ready(self) -> bool:
        """Builds the machinery once the model and its optimizer have variables."""
        model = self.model
        opt = model.optimizer
        if not model.built or opt is None:
            return False
        if not getattr(opt, "built", False):
            if not model.trainable_variables:
                return False
            with strategy_scope(model):
                opt.build(model.trainable_variables)
        if self._snapshot is None or self._n_vars != len(self._state_variables()):
            self._build_machinery()
        return True

    def _take_snapshot(self, values=None) -> None:
        """Takes the snapshot: the state now, or `values` (read with the check that allowed them)."""
        if self._n_vars != len(self._state_variables()):
            self._build_machinery()  # e.g. a layer or optimizer variable added since
            values = None  # read for the old list of variables
        self._snapshot.take(values)
        self.snapshot_step = self.step
        self._losses_at_snapshot = (list(self.recent_losses), self.loss_high)  # the loss history that led to it

    # ------------------------------------------------------------------ the check
    def set_model(self, model) -> None:
        super().set_model(model)
        # Before `fit` makes its train function: the check's values are computed in the step.
        self._out = add_step_output(model, self.key, self._step_values) if hasattr(model, "train_step") else None

    def _step_values(self, read):
        """Inside the compiled train step, after its update: `_check_values` of the state it leaves.

        The weights are checked here only with `check_weights_every=1` (the
        other checks are separate calls).
        """
        checked, layout = _checked_variables(self.model)
        vals = _check_values(read(checked), layout, self.check_weights_every == 1)
        # One output tensor (each output costs Python in every call), except across workers,
        # where Keras reduces a step's outputs along axis 0: scalars keep their meaning there.
        multi_worker = runtime.num_workers(getattr(self.model, "distribute_strategy", None)) > 1
        return tuple(vals) if multi_worker else keras.ops.stack(vals)

    def _probe(self, check_weights: bool, snapshot: bool = False) -> list[float]:
        """`[loss total, loss count, weights finite (1.0 or 0.0), loss scale]` after the last step.

        From the train step's own outputs, else (the step did not run the check,
        or the weights are due and it left them out) from `_probe_call`, which
        reads the state too when a `snapshot` is due.
        """
        out = self._out.take() if self._out is not None else None
        if out is not None:
            total, count, weights, scale = np.asarray(out).tolist()  # Python floats: cheaper than NumPy's here
            if self._replicas != 1:  # under tf.distribute the step's outputs are means over the replicas
                total, count = total * self._replicas, count * self._replicas
            if weights >= 0 or not check_weights:
                return [total, count, 0.0 if 0 <= weights < 1 else 1.0, scale]  # a mean: any replica non-finite
        self._read_state = snapshot
        try:
            vals = self._probe_call(check_weights)
        finally:
            self._read_state = False
        return vals if out is None else [total, count, vals[2], scale]

    def _probe_call(self, check_weights: bool) -> list[float]:
        """The check's values from a compiled call of their own, as `_probe` gives them.

        When a snapshot is due (`_read_state`), one call reads the state too:
        the values wait in `_pending` for `_take_snapshot` (dropped at the end
        of the batch if the check does not let them in).
        """
        if check_weights and self._read_state:
            self._pending, vals = self._fns["read_probe"]()
        else:
            vals = self._fns["probe_full" if check_weights else "probe_loss"]()
        total, count, weights, scale = np.asarray(vals).tolist()
        return [total, count, 0.0 if weights == 0 else 1.0, scale]

    # ------------------------------------------------------------------ Keras hooks
    def on_train_begin(self, logs=None) -> None:
        super().on_train_begin(logs)
        self._snapshot = None
        self.snapshot_step = None
        self._epoch = 0  # `_begin`: from the last begin hook, or restored (see `get_state`)
        self._last_scale = self._weights_checked = self._pending = None
        self._read_state = False
        self._strategy = getattr(self.model, "distribute_strategy", None)
        self._replicas = runtime.num_replicas(self._strategy)
        self._lso = isinstance(self.model.optimizer, keras.optimizers.LossScaleOptimizer)
        sync = self.sync_across_workers
        self._sync = runtime.num_workers(self._strategy) > 1 if sync is None else sync
        self.on_epoch_begin(0)
        if not self._ready():  # builds the machinery; the first snapshot waits for the first batch
            self._hook_first_apply()

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self._epoch = int(epoch)
        self._prev_total = self._prev_count = 0.0  # fit resets the metrics before on_epoch_begin
        self._epoch_batches = 0
        self._prev_mean = None
        self._sync_tracker = True

    def on_train_batch_begin(self, batch, logs=None) -> None:
        self._begin = batch
        if self._snapshot is None:
            return
        if self._sync_tracker:
            self._read_tracker()
        if self.snapshot_step is None:
            # Taken here rather than in `on_train_begin`, so that it holds what a
            # checkpoint restored in another callback's `on_train_begin`.
            self._take_snapshot()

    def on_train_batch_end(self, batch, logs=None) -> None:
        logs = logs if logs is not None else {}
        # Keras runs `steps_per_execution` steps per call and reports them as `begin..end`.
        n = max(1, batch - self._begin + 1)
        step = self.step = self.step + n
        self._epoch_batches += n
        self._batch = batch
        if self._snapshot is None and not self._ready():
            return
        last = self.snapshot_step
        due = last is None or step // self.snapshot_every > last // self.snapshot_every
        every = self.check_weights_every
        check = due or (every is not None and step // every > (step - n) // every)
        _, _, weights, scale = vals = self._probe(check, snapshot=due)
        loss = self._batch_loss(vals, logs)
        loss_finite = loss is None or math.isfinite(loss)
        if not loss_finite and not check:
            weights = self._probe_call(True)[2]  # a non-finite loss: always look at the weights
        if check or not loss_finite or every == 1:
            self._weights_checked = step  # `every == 1`: the step's own check
        weights_finite = weights > 0.5
        scale = scale if scale >= 0 else None
        # The LossScaleOptimizer halves its scale when it skips a step: not divergence.
        skipped_by_lso = self._lso and weights_finite
        causes = []
        if not loss_finite:
            if skipped_by_lso:
                self.loss_scale_skips += 1
            else:
                causes.append("nonfinite_loss")
        if not weights_finite:
            causes.append("nonfinite_weights")
        if scale is not None and scale <= self.loss_scale_floor:
            causes.append("loss_scale_collapse")
        exceeded = None  # the spike threshold, when the loss is above it
        # A spike is above the run's highest loss: below it, the threshold need not be computed.
        high = self.loss_high
        if self.spike_factor is not None and loss is not None and high is not None and loss_finite and loss > high:
            threshold = spike_threshold(self.recent_losses, self.loss_high, self.spike_factor, n)
            exceeded = threshold if threshold is not None and loss > threshold else None
        if exceeded is not None:
            if skipped_by_lso and self._last_scale is not None and scale < self._last_scale:
                self.loss_scale_skips += 1  # its gradient overflowed: the update was not applied
            else:
                causes.append("loss_spike")
        self._last_scale = scale
        if self._sync:
            loss_finite, causes = self._agree(loss_finite, causes)

        if not loss_finite or causes or exceeded is not None:
            self._drop_from_tracker(logs)
        else:
            if self._cur is not None:
                self._prev_total, self._prev_count = self._cur
            elif self._cur_mean is not None:
                self._prev_mean = self._cur_mean
            if loss is not None:
                self.recent_losses.append(loss)
                if self.loss_high is None or loss > self.loss_high:
                    self.loss_high = loss
        if causes:
            self._diverged(causes, loss, scale, exceeded if "loss_spike" in causes else None)
        elif due and loss_finite and self.snapshot_step != step:
            # Never right after a step the LossScaleOptimizer skipped: a falling loss scale is not a good state.
            self._take_snapshot(self._pending)
        self._pending = None  # values not taken: released before the next step (no copy-on-write)

    def on_epoch_end(self, epoch, logs=None) -> None:
        # The weights at the end of an epoch are what a Checkpoint listed after this callback saves.
        # (`step` is the same on every worker: all of them check, and agree, or none does.)
        if self._snapshot is not None and self._weights_checked != self.step:
            self._weights_checked = self.step
            causes = [] if self._probe_call(True)[2] > 0.5 else ["nonfinite_weights"]
            if self._sync:
                _, causes = self._agree(True, causes)
            if causes:
                self._diverged(causes, None, None, None)
        if logs is not None:
            logs["nan_rollbacks"] = self.rollbacks

    def on_train_end(self, logs=None) -> None:
        super().on_train_end(logs)
        if self._out is not None:
            self._out.active = False  # a train function traced later (after a compile) leaves the check out
        self._unhook_first_apply()
        self._snapshot = None  # frees the snapshot (the compiled functions stay with the model)

    # ------------------------------------------------------------------ a model built at its first step
    def _hook_first_apply(self) -> None:
        """Arranges the first snapshot of a model that `fit` builds in its first step.

        Keras's TensorFlow trainer without a distribution strategy builds an
        unbuilt model (no `keras.Input`) while it traces the train function, and
        the same call applies the first update, so no callback hook sees the
        state in between. The optimizer's `apply` (what `apply_gradients` and
        Keras's `train_step` call) is wrapped until then: while the train
        function is traced, it snapshots the freshly built state (eagerly), then
        adds the update to the graph.
        """
        self._unhook_first_apply()  # one left by a fit that raised before its first update
        opt = self.model.optimizer
        if opt is not None and "apply" not in vars(opt):
            opt.apply = _SnapshotBeforeApply(self, opt.apply)

    def _unhook_first_apply(self) -> None:
        opt = getattr(self.model, "optimizer", None)
        if opt is not None and isinstance(vars(opt).get("apply"), _SnapshotBeforeApply):
            del opt.apply

    def _snapshot_before_first_update(self) -> None:
        """Called while the train function is traced, before the first update exists."""
        with outside_trace():
            # A function whose first trace creates variables is traced twice: in the first
            # the model's are not yet initialised; the snapshot is taken in the second.
            if self.snapshot_step is None and self._ready():
                if not initialized(self._state_variables()):
                    return
                self._take_snapshot()
                self._read_tracker()
            self._unhook_first_apply()

    # ------------------------------------------------------------------ the batch loss
    def _read_tracker(self) -> None:
        """Takes the loss tracker's sums as the epoch's starting point.

        Needed once per epoch before its first check: a checkpoint resumed
        mid-epoch may have restored the loss accumulators.
        """
        self._prev_total, self._prev_count = self._probe_call(False)[:2]  # the tracker now, not a step's values
        self._sync_tracker = False

    def _batch_loss(self, vals: list[float], logs: dict) -> float | None:
        """Mean loss of the batches since the last callback, or None if unknown.

        Exact: from the loss tracker's `total`/`count` (sums weighted by batch
        size, summed over replicas). Without a tracker (a custom `train_step`),
        from the running mean in `logs["loss"]`: `(m_k * k - m_j * j) / (k - j)`
        over batch counts, exact for equal batch sizes.
        """
        total, count = vals[0], vals[1]
        self._cur = self._cur_mean = None
        if self._has_sums and count > self._prev_count:
            self._cur = (total, count)
            return (total - self._prev_total) / (count - self._prev_count)
        mean = logs.get("loss")
        if mean is None:
            return None
        mean, k = float(mean), self._epoch_batches
        pm, pk = self._prev_mean or (0.0, 0)
        self._cur_mean = (mean, k)
        if not math.isfinite(pm):
            return math.nan
        return (mean * k - pm * pk) / (k - pk) if k > pk else None

    def _drop_from_tracker(self, logs: dict) -> None:
        """Takes the offending batches out of the epoch's running loss."""
        if self._cur is None:
            return
        tracker = loss_tracker(self.model)
        sync_variables(self.model)  # on JAX inside fit: the next step reads the tracker from its variables
        tracker.total.assign(self._prev_total)
        tracker.count.assign(self._prev_count)
        if "loss" in logs:  # what the tracker now reports (Keras's Mean: 0 when empty)
            logs["loss"] = self._prev_total / self._prev_count if self._prev_count > 0 else 0.0

    # ------------------------------------------------------------------ the rollback
    def _agree(self, loss_finite: bool, causes: list[str]) -> tuple[bool, list[str]]:
        """The check's verdict OR-reduced over every worker (the same on all of them)."""
        flags = runtime.any_across_workers(self._strategy, [not loss_finite] + [c in causes for c in CAUSES])
        return not flags[0], [c for c, f in zip(CAUSES, flags[1:]) if f]

    def _diverged(self, causes: list[str], loss: float | None, scale: float | None, threshold: float | None) -> None:
        sync_variables(self.model)  # on JAX inside fit: read the LR and iterations, and restore, through the variables
        opt = self.model.optimizer
        lo = -math.inf if self.window_steps is None else self.step - self.window_steps
        recent = [e for e in self.events if e.get("action") == "rollback" and e["step"] > lo]
        stop = self.snapshot_step is None or len(recent) >= self.max_rollbacks
        event = {
            "step": int(self.step),
            "epoch": int(self._epoch),
            "batch": getattr(self, "_batch", None),
            "causes": list(causes),
            "loss": _json_float(loss),
            "loss_scale": _json_float(scale),
            "spike_threshold": _json_float(threshold),
            "restored_step": self.snapshot_step,
            "batches_skipped": None if self.snapshot_step is None else int(self.step - self.snapshot_step),
            "iterations_before": int(keras.ops.convert_to_numpy(opt.iterations)),
            "lr_before": float(current_lr(opt)),
        }
        if self.snapshot_step is not None:
            self._snapshot.restore()  # also before stopping: `model` keeps the last good state
            # The reference of spike detection goes back too: the losses after the
            # snapshot belong to a path that no longer exists.
            losses, self.loss_high = self._losses_at_snapshot
            self.recent_losses = deque(losses, maxlen=self.spike_window)
            self._last_scale = None  # read again at the next check
        event["iterations_after"] = int(keras.ops.convert_to_numpy(opt.iterations))
        if stop:
            event.update(action="stop", lr_after=event["lr_before"])
        else:
            old, new = scale_learning_rate(opt, self.lr_factor)
            event.update(action="rollback", lr_before=float(old), lr_after=float(new), lr_factor=self.lr_factor)
            self._take_snapshot()  # the restored state with the lower LR
        self.events.append(event)
        self._write_event(event)
        print(self._event_line(event), flush=True)
        if stop:
            raise TrainingDivergedError(self._stop_message(event, recent), events=self.events)

    @staticmethod
    def _lr_change(e: dict) -> str:
        """What a rollback did to the LR, in words that stay true when the schedule is at 0 (its warmup)."""
        before, after, factor = e["lr_before"], e["lr_after"], e.get("lr_factor")
        if factor == 1.0:
            return f"LR kept ({after:.4g})"
        if before == after and factor is not None:  # a schedule at 0 now: its multiplier was scaled
            return f"LR schedule scaled by {factor:g} (LR {after:.4g} at this step)"
        return f"LR {before:.4g} -> {after:.4g}"

    def _event_line(self, e: dict) -> str:
        what = ", ".join(e["causes"])
        if e.get("spike_threshold") is not None:
            what += f" (loss {e['loss']:.4g} > {e['spike_threshold']:.4g})"
        if e["action"] == "rollback":
            return (
                f"NaNRollback: step {e['step']}: {what}; restored step {e['restored_step']} "
                f"({e['batches_skipped']} batches skipped, iterations {e['iterations_before']} -> "
                f"{e['iterations_after']}), {self._lr_change(e)}."
            )
        return f"NaNRollback: step {e['step']}: {what}; stopping (LR {e['lr_before']:.4g})."

    def _stop_message(self, event: dict, recent: list[dict]) -> str:
        where = "the whole run" if self.window_steps is None else f"the last {self.window_steps} steps"
        head = f"Training diverged at step {event['step']} ({', '.join(event['causes'])})"
        if self.snapshot_step is None and not recent and self.max_rollbacks > 0:
            head += " before any good snapshot existed; nothing to roll back to."
        else:
            head += f" and {len(recent)} rollback(s) within {where} already reached max_rollbacks={self.max_rollbacks}."
        history = "; ".join(
            f"step {e['step']}: {', '.join(e['causes'])}, {self._lr_change(e)}, {e['batches_skipped']} batches skipped"
            for e in recent
        )
        tail = f" Rollbacks: {history}." if history else ""
        if "nonfinite_loss" in event["causes"]:
            # Keras's TerminateOnNaN words, so logs and handlers written for it match.
            tail += f" NaN or Inf loss encountered at batch {event['batch']}. Loss value: {event['loss']}."
        if event["restored_step"] is not None:
            tail += f" The model holds the last good state (step {event['restored_step']}, LR {event['lr_before']:.4g})."
        return head + tail + f" Lower the learning rate, {self._clipping_advice()}, or check the input data."

    def _clipping_advice(self) -> str:
        """Gradient clipping, in the optimizer's terms when it clips already (a recipe may not offer the setting)."""
        opt = self.model.optimizer
        opt = getattr(opt, "inner_optimizer", opt)
        for name in ("global_clipnorm", "clipnorm", "clipvalue"):
            value = getattr(opt, name, None)
            if value is not None:
                return f"clip the gradients harder (the optimizer's `{name}` is {value:g})"
        return "clip the gradients"

    def _write_event(self, event: dict) -> None:
        if self.run_dir is None or not runtime.is_chief(self._strategy):
            return
        path = Path(self.run_dir) / _EVENTS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(event, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
