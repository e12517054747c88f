"""`NaNRollback`: detect a diverging step, restore the last good state, lower the LR.

Keras ships `TerminateOnNaN`, which only stops, and only looks at `logs["loss"]`,
the epoch's *running mean* of the loss; it misses NaN weights whose loss stays
finite (on some CPUs oneDNN's ReLU maps NaN to 0) and it cannot bring the run back.
`BackupAndRestore` restores whole epochs from files, which is too slow and too
coarse to run every few dozen steps. `NaNRollback` implements what large runs do
by hand (PaLM, Chowdhery et al. 2022, sec. 5.1, restarted from a checkpoint about
100 steps before a loss spike and skipped about 200-500 data batches): keep
a device-side copy of the training state every `snapshot_every` steps, and on a
non-finite loss, non-finite weights, a collapsed loss scale or a loss spike,
restore it, skip ahead and lower the learning rate.

One module of about 950 lines: the detection (its values computed inside the
train step), the snapshot machinery (compiled copy/restore/probe functions,
shared with the first-step hook) and the
rollback act on one state per `fit`; about a third of it is the class docstring
and argument checks.
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from pathlib import Path
from typing import Any

import keras
import numpy as np

from trainwell import runtime
from trainwell.callbacks.base import StatefulCallback
from trainwell.compat.backend import (
    StateReader,
    add_step_output,
    backend_name,
    compile_function,
    compiled_read,
    copy_arrays,
    kept_on_model,
    sync_variables,
)
from trainwell.compat.keras_internals import loss_tracker
from trainwell.compat.learning_rate import current_lr, learning_rate_variables, scale_learning_rate
from trainwell.validation import invalid_argument, is_int, is_number

_EVENTS_FILE = "nan_rollback.jsonl"

#: Batches of kept losses before spike detection starts (see `NaNRollback`).
SPIKE_MIN_HISTORY = 3

#: Causes, in the order they are reported.
CAUSES = ("nonfinite_loss", "nonfinite_weights", "loss_scale_collapse", "loss_spike")


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


# --------------------------------------------------------------------------- small utils
def _tf():
    import tensorflow as tf  # here: the snapshot machinery is TensorFlow's; built only inside a fit

    return tf


def _raw(v):
    """The backend (tf) variable under a Keras variable."""
    return getattr(v, "value", v) if isinstance(v, keras.Variable) else v


def _is_lso(optimizer) -> bool:
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def _json_float(x: float | None):
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else str(x)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not is_int(value) or value < minimum:
        raise invalid_argument(name, f"an int >= {minimum}", value)


def _all_finite(tensors: list):
    """Whether every element of `tensors` is finite, as one boolean scalar, in one pass over each.

    The sum of a tensor is NaN or infinite when an element is (NaN propagates;
    an infinity stays infinite or meets the opposite one and makes NaN), so one
    reduction per tensor replaces `all(isfinite(w))`, whose boolean temporary
    is a second pass over the weights in every step. Sums are taken in at least
    float32 (a float16 sum of finite weights overflows at 65504); a float32
    sum of finite weights overflows only beyond 3.4e38, weights that have
    diverged anyway, and then reads as non-finite.
    """
    ops = keras.ops
    sums = []
    for t in tensors:
        if keras.backend.standardize_dtype(t.dtype) not in ("float32", "float64"):
            t = ops.cast(t, "float32")
        sums.append(ops.cast(ops.sum(t), "float32"))
    return ops.all(ops.isfinite(ops.stack(sums)))


class _Assign:
    """`variables[i].assign(values[i])` for all i; wrapped in one `tf.function` (one dispatch).

    Puts back a snapshot read by `compat.backend.compiled_read`. A callable
    object rather than a closure, so that TensorFlow's retracing detector
    (keyed on a function's code) does not warn when another model makes its own.
    """

    def __init__(self, variables: list) -> None:
        self.variables = variables

    def __call__(self, values) -> None:
        for v, x in zip(self.variables, values):
            v.assign(x)


#: The attribute of a model that keeps NaNRollback's compiled functions between fits.
_FNS_ATTR = "_trainwell_nan_rollback_fns"


class _Probe:
    """Returns `[loss total, loss count, all weights finite, loss scale]` as one float64 vector.

    One compiled function and one device-to-host transfer per check: the
    finiteness of every weight is reduced on the device.
    """

    def __init__(self, tracker_vars, floats: list, scale_var, check_weights: bool) -> None:
        self.tracker_vars, self.floats, self.scale_var = tracker_vars, floats, scale_var
        self.check_weights = check_weights

    def __call__(self):
        tf = _tf()
        f64 = tf.float64
        if self.tracker_vars is not None:
            vals = [tf.cast(self.tracker_vars[0], f64), tf.cast(self.tracker_vars[1], f64)]
        else:
            vals = [tf.constant(0.0, f64), tf.constant(0.0, f64)]
        if self.check_weights and self.floats:
            vals.append(tf.cast(_all_finite(self.floats), f64))  # the same verdict as the in-step check
        else:
            vals.append(tf.constant(1.0, f64))
        vals.append(tf.cast(self.scale_var, f64) if self.scale_var is not None else tf.constant(-1.0, f64))
        return tf.stack(vals)


class _ReadAndProbe:
    """A snapshot's read and the full `_Probe`, for one `tf.function` (one dispatch instead of two).

    Returns `(values, probe)`: the state's values as tensors (`read`, the
    `compat.backend.compiled_read` of the snapshot) and the vector of `probe`
    (the compiled `_Probe` with the weight check), which says whether the
    values may become the snapshot. Both are called inside this function's
    trace, which reuses theirs.
    """

    def __init__(self, read, probe: _Probe) -> None:
        self.read, self.probe = read, probe

    def __call__(self):
        return self.read(), self.probe()


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
    callback keeps a *device-side* copy of the training state (its values as
    tensors, read in one compiled function; TensorFlow's copy-on-write keeps
    them as they were) every `snapshot_every` steps and checks every step for:

    - `"nonfinite_loss"`: a non-finite *batch* loss. `logs["loss"]` is the
      epoch's running mean, so the batch value is recovered exactly from the loss
      tracker's `total`/`count` variables (the mean of the batches since the last
      callback: with `steps_per_execution=N`, of the last N batches).
    - `"nonfinite_weights"`: a NaN/Inf in the model's weights, checked by one
      reduction over all of them before every snapshot, at the end of every
      epoch (before a `Checkpoint` listed after this callback saves them),
      after every non-finite loss, and every `check_weights_every` steps if
      set. Needed because on some x86 CPUs oneDNN's ReLU maps NaN to 0: after
      a batch of `inf` inputs the weights are NaN while the loss stays finite
      (on others, and with XLA, the loss turns NaN too). By default such
      weights are found at the next snapshot or epoch end, and the rollback
      lands on the snapshot before them, so no snapshot and no checkpoint ever
      holds them; `check_weights_every=1` finds them at the step they appear.
    - `"loss_scale_collapse"` (mixed_float16): the `LossScaleOptimizer`'s scale
      fell to `loss_scale_floor` or below. The optimizer's own skipped steps
      (non-finite loss, scale halved, weights unchanged) are *not* divergence;
      they are counted in the state as `loss_scale_skips`.
    - `"loss_spike"`: a finite batch loss above `spike_threshold`: more than
      `spike_factor` times the largest of the last `spike_window` losses, and
      higher than any loss of the run before it (a batch with a huge gradient,
      e.g. badly scaled inputs, wrecks a run without ever producing a NaN).
      Detection starts after `SPIKE_MIN_HISTORY` (3) batches. The reference is
      the recent *maximum*, not the median, and the run's highest loss is a
      floor, because near the end of a run the loss is close to 0 and healthy
      batches reached 25 x the median and 5.8 x the maximum of the last 50
      (`bench/spike_rollback.py`), but never the run's early highs. A spike
      whose update the `LossScaleOptimizer` skipped (its scaled gradient
      overflowed: the scale halved at that step) is not rolled back; it counts
      in `loss_scale_skips`. Spikes never join the history; after a rollback
      the history is the one the snapshot was taken with.

    On divergence it restores the model weights and all optimizer variables
    (slots, `iterations`, the loss scale and its counter, EMA and gradient
    accumulators) from the snapshot, then multiplies the learning rate by
    `lr_factor` (via `trainwell.callbacks.schedules.scale_learning_rate`, so LR
    schedules work too), and takes a fresh snapshot of that state.

    What a rollback means for the data and the schedule:

    - Data: the input pipeline is not rewound. The batches since the snapshot
      are skipped and training continues with the *following* batches, as in
      PaLM (a bad batch is not replayed).
    - `iterations` is restored with the rest of the optimizer state, so the
      optimizer stays self-consistent (Adam's bias correction matches its
      moments, gradient accumulation and loss-scale counters line up). LR
      schedules are functions of `iterations`, so the schedule position goes
      back with it: the schedule counts applied updates, not batches read, and
      a run that rolled back `k` batches ends `k` updates short of the
      schedule's end (the events record the batches skipped).
    - The learning-rate variable itself is not in the snapshot, so a rollback
      never undoes an LR change made by another callback; only `lr_factor`
      is applied.
    - Batches whose loss was non-finite are taken out of the epoch's running
      loss (the tracker is reset to its value before them, and `logs["loss"]`
      is updated for the callbacks that follow), so `logs["loss"]` stays
      meaningful and a `TerminateOnNaN` listed after this callback does not
      stop a recovered run.

    After `max_rollbacks` rollbacks within `window_steps` steps, the next
    divergence restores the last good state once more (so `model` holds good
    weights) and raises `TrainingDivergedError`.

    Each event (step, causes, batch loss, spike threshold, LR before and after,
    batches skipped, `iterations` before and after) is printed as one line, kept in
    `get_state()["events"]` (so it survives a restart through trainwell's
    `Checkpoint`), appended to `run_dir/nan_rollback.jsonl` (by the chief only)
    and counted in the epoch logs as `logs["nan_rollbacks"]` (cumulative).

    Cost, measured with `bench/nan_rollback_snapshot.py` (2 shared CPU cores,
    TF 2.21, an MLP with 4.2 M parameters and Adam: 12.6 M floats of state;
    medians of 30; 2026-12-02, a slow period of the VM): a snapshot is one
    compiled call of 0.7 ms, and 8.4 ms once the copy that TensorFlow's
    copy-on-write variables defer to the next update is counted; a restore
    9.7 ms. Writing / reading the same state with `tf.train.Checkpoint` files
    took 98 / 54 ms in the same run. (The shadow variables this snapshot
    replaced measured 9.2 ms and 7.5 ms there; on a quieter day 5.2 / 4.9 ms
    against 54 / 25 ms.) One weight check took 2.2 ms. A snapshot holds one
    copy of the model weights and the optimizer state, on the device that
    holds them.

    When the checks run, and what they cost: the loss tracker's sums and the
    loss scale (and the weight check with `check_weights_every=1`) are
    computed *inside the compiled train step*, after its update (`trainwell.compat.backend.add_step_output`: the
    model's `train_step` is wrapped once, and its train function traced again
    if it was made without them), and carried outside the logs, so they never
    show as metrics. Reading them in `on_train_batch_end` costs no compiled
    call of its own and waits for the step that Keras's logs wait for; before
    this (trainwell 2026-12-01) the check was a separate compiled call plus a
    host read every step, 1.24x the CPU time of a bare 4 ms step. The weight
    check is not in the step by default: on a 4 ms step (a 784-256-256-10
    MLP) it cost 2.5-3 % (`bench/README.md`). A separate compiled call
    remains once an epoch (the loss tracker's starting sums), for the weight
    checks (before a snapshot, at the end of an epoch, after a non-finite
    loss, every `check_weights_every > 1` steps), and for steps the
    train function ran without the check (a Checkpoint's replay of a resumed
    epoch, a custom trainer that bypasses `train_step`). With
    `steps_per_execution=N` the values are those after the N-th step: the loss
    is the mean of the N batches (from the tracker's sums) and a NaN weight
    of any of them is still NaN then (an update of a NaN weight is NaN).

    Works under `tf.distribute.MirroredStrategy` (the snapshot holds the
    primary replica's values; a restore writes every replica) and with
    `steps_per_execution > 1` (checks then run every N steps, when Keras calls
    batch callbacks; steps are counted in batches).

    Under `MultiWorkerMirroredStrategy` every worker runs this callback on its
    own copy of the state, and a worker that rolled back alone would leave the
    others with different weights. So the verdict of each check (is the loss
    finite, and which causes fired) is OR-reduced across the workers with one
    all-reduce of a 5-element int32 vector (`trainwell.runtime.any_across_workers`)
    before anything is acted on: when any worker sees a divergence, every worker
    rolls back at the same step, to the same snapshot, with the same LR, and
    `max_rollbacks` runs out on all of them together. The reduction is a
    collective, so it runs every check on every worker. (The values computed in
    the train step are already means over every replica of every worker, as
    Keras reduces a step's outputs, so a NaN weight on any replica shows on
    all; the verdict's reduction also covers the checks made outside the
    step.) (The class attribute
    `sync_across_workers`, `None` = on exactly when the strategy spans more
    than one worker, exists so a test can switch it off and show the workers
    parting without it; leave it alone.)

    Args:
        snapshot_every: Steps (batches) between snapshots. A rollback lands at
            most this many steps back; PaLM restarted about 100 steps before a
            spike. Defaults to `100`.
        lr_factor: Factor in (0, 1] applied to the learning rate after each
            rollback; `1.0` keeps the LR (PaLM's choice: skip the batches only).
            Halving is a moderate cut; the OPT-175B team likewise lowered the LR
            when restarting from an earlier checkpoint after a divergence
            (Zhang et al. 2022). Defaults to `0.5`.
        max_rollbacks: Rollbacks allowed within `window_steps` steps; the next
            divergence raises `TrainingDivergedError`. `0` raises at the first
            divergence. With the defaults, the LR is at most cut to 1/8 before
            giving up: past that, a bug or bad data is likelier than a transient.
            Defaults to `3`.
        window_steps: Length in steps of the window in which rollbacks are
            counted; `None` counts the whole run. Defaults to `None`.
        spike_factor: Roll back when a batch loss exceeds this factor (> 1)
            times the largest of the last `spike_window` losses (and every
            earlier loss of the run); `None` disables spike detection. Chosen
            with `bench/spike_rollback.py` (figures in `bench/README.md`): over
            18 healthy runs with noisy losses (16,106 steps: small batches, high
            LR, label noise, Adam without warmup, losses near 0, mixed
            precision, `steps_per_execution` 4 and 8, the demo recipe, a MiniLM
            fine-tune), a loss that was a new high of its run was at most 1.84 x
            the recent maximum, while every single-batch spike (inputs x1e2 to
            x1e5) that moved the final accuracy by more than 0.02 was at least
            7.6 x it, also at step 6; 5 sits between, and rolled back all 33 of
            them (the rule before, 10 x the median, raised 17 false rollbacks
            on the healthy runs). Four x30 spikes moved the accuracy by
            0.02-0.04 unseen: their losses were 2.3-3.4 x the recent maximum,
            below what a loss rule can tell from noise. With
            `steps_per_execution=N` a check sees the mean of N batches, where
            one batch at `spike_factor` x shows as `(spike_factor + N - 1) / N`
            x: that is the factor applied. Defaults to `5.0`.
        spike_window: Number of recent kept batch losses whose maximum is the
            reference. Windows of 10 to 100 measured alike (at most 2.65 x on
            the healthy runs at a new high); shorter ones follow a falling loss
            sooner. Defaults to `50`.
        check_weights_every: Steps between weight checks besides the ones
            always made (before every snapshot, at every epoch end, after a
            non-finite loss); `None` adds none. At `1` the check is part of the
            train step (one reduction over the weights, no call of its own):
            NaN weights behind a finite loss are found at the step they
            appear, and the rollback skips only the batches since the
            snapshot, at 2.5-3 % of a 4 ms step. Above 1 each check is a
            separate compiled call and host read. Defaults to `None`: such
            weights are found at the next snapshot or epoch end (at most
            `snapshot_every` steps later, and rolled back to the snapshot
            before them), which costs nothing per step.
        loss_scale_floor: Under a `LossScaleOptimizer`, a loss scale at or
            below this value is a divergence. Keras starts at 2**15 and halves
            the scale at each overflow, so `1.0` means 15 more overflows than
            growths: the unscaled float16 gradients themselves overflow.
            Defaults to `1.0`.
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
            raise ValueError(
                "Invalid value for argument `lr_factor`. Expected a float in (0, 1]. "
                f"Received: lr_factor={lr_factor!r}"
            )
        _check_int("max_rollbacks", max_rollbacks, 0)
        if window_steps is not None:
            _check_int("window_steps", window_steps, 1)
        if spike_factor is not None and (
            not is_number(spike_factor, finite=False) or not float(spike_factor) > 1.0 or not math.isfinite(spike_factor)
        ):
            raise ValueError(
                "Invalid value for argument `spike_factor`. Expected None or a finite float > 1. "
                f"Received: spike_factor={spike_factor!r}"
            )
        _check_int("spike_window", spike_window, 2)
        if check_weights_every is not None:
            _check_int("check_weights_every", check_weights_every, 1)
        if not is_number(loss_scale_floor, finite=False) or not 0.0 <= float(loss_scale_floor) < math.inf:
            raise ValueError(
                "Invalid value for argument `loss_scale_floor`. Expected a finite float >= 0. "
                f"Received: loss_scale_floor={loss_scale_floor!r}"
            )
        if run_dir is not None and not isinstance(run_dir, (str, os.PathLike)):
            raise ValueError(
                "Invalid value for argument `run_dir`. Expected None or a path. "
                f"Received: run_dir={run_dir!r}"
            )
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
        self._machinery = None

    # ------------------------------------------------------------------ config/state
    def get_config(self) -> dict[str, Any]:
        return {
            "snapshot_every": self.snapshot_every,
            "lr_factor": self.lr_factor,
            "max_rollbacks": self.max_rollbacks,
            "window_steps": self.window_steps,
            "spike_factor": self.spike_factor,
            "spike_window": self.spike_window,
            "check_weights_every": self.check_weights_every,
            "loss_scale_floor": self.loss_scale_floor,
            "run_dir": self.run_dir,
        }

    def reset_state(self) -> None:
        self.step = 0  # batches consumed in this run (not optimizer iterations)
        self.events: list[dict] = []
        self.recent_losses: deque = deque(maxlen=self.spike_window)
        self.loss_high: float | None = None  # the highest loss kept in the history in this run
        self.loss_scale_skips = 0
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
        }

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        self.step = int(state.get("step", 0))
        self.events = json.loads(json.dumps(list(state.get("events", []))))
        self.recent_losses = deque((float(x) for x in state.get("recent_losses", [])), maxlen=self.spike_window)
        high = state.get("loss_high", max(self.recent_losses, default=None))
        self.loss_high = None if high is None else float(high)
        self.loss_scale_skips = int(state.get("loss_scale_skips", 0))
        self.snapshot_step = None  # the device copy is not part of the state; retaken at train begin

    # ------------------------------------------------------------------ machinery
    def _model_weights(self) -> list:
        return list(self.model.weights)

    def _state_variables(self) -> list:
        """Model weights + optimizer variables, minus the learning-rate variable(s)."""
        opt = self.model.optimizer
        skip = {id(v) for v in learning_rate_variables(opt)}
        out, seen = [], set()
        for v in self._model_weights() + list(opt.variables if opt is not None else []):
            if id(v) in seen or id(v) in skip:
                continue
            seen.add(id(v))
            out.append(v)
        return out

    def _build_machinery(self) -> None:
        """The compiled snapshot/restore/probe functions, and a place for the snapshot.

        The snapshot is the state's values as tensors (`compiled_read`, one
        compiled call together with the weight check that lets them in:
        `_ReadAndProbe`; copy-on-write keeps them as they were), put back by
        `_Assign`.
        The compiled functions hold only the model's variables, so they are
        kept with the model (`kept_on_model`) while its variables stay the same: a
        later `fit` of the same model (a PBT member's kept model, a notebook's
        second `fit`) does not trace them again. The snapshot itself lives
        with this callback's machinery and is freed at the end of `fit`.
        """
        if backend_name() != "tensorflow":
            self._build_array_machinery()
            return
        tf = _tf()
        model = self.model
        variables = self._state_variables()
        raws = [_raw(v) for v in variables]
        floats = [_raw(w) for w in self._model_weights() if keras.backend.is_float_dtype(w.dtype)]
        tracker = loss_tracker(model)
        tracker_vars = None
        if tracker is not None:
            tracker_vars = (_raw(tracker.total), _raw(tracker.count))
        opt = model.optimizer
        scale_var = _raw(opt.dynamic_scale) if _is_lso(opt) and getattr(opt, "built", False) else None
        key = tuple(id(v) for v in raws + floats + list(tracker_vars or ()) + [scale_var])

        def make() -> dict:
            read = compiled_read(raws)
            probe_full = tf.function(_Probe(tracker_vars, floats, scale_var, True), autograph=False)
            return {
                "read": read,
                "assign": tf.function(_Assign(raws), autograph=False),
                "probe_full": probe_full,
                "probe_loss": tf.function(_Probe(tracker_vars, floats, scale_var, False), autograph=False),
                # Calls the two above inside its own trace: each is traced once, whichever runs first.
                "read_probe": tf.function(_ReadAndProbe(read, probe_full), autograph=False),
            }

        fns = kept_on_model(model, _FNS_ATTR, key, make)
        shadow: list = []

        def snapshot(values=None) -> None:
            shadow[:] = fns["read"]() if values is None else values

        def restore() -> None:
            fns["assign"](list(shadow))  # the snapshot stays valid for the next rollback

        self._machinery = {
            "n_vars": len(variables),
            "snapshot": snapshot,
            "restore": restore,
            "probe_full": fns["probe_full"],
            "probe_loss": fns["probe_loss"],
            "read_probe": fns["read_probe"],
            "has_tracker": tracker_vars is not None,
        }

    def _build_array_machinery(self) -> None:
        """The machinery on JAX: device copies of the live state, read without a sync.

        Keras's JAX step is stateless and deletes the arrays it is given, so the
        snapshot is one compiled copy of the state's arrays (`compat.backend`);
        a restore writes copies of it into the variables after
        `sync_variables`, and the next step starts from them. The probe reads
        the loss tracker, the weights and the loss scale from the live state in
        one compiled function (float32: JAX runs without float64 by default).
        """
        model = self.model
        variables = self._state_variables()
        reader = StateReader(model, variables)
        shadow: list = []
        floats = [w for w in self._model_weights() if keras.backend.is_float_dtype(w.dtype)]
        tracker = loss_tracker(model)
        tracker_vars = [tracker.total, tracker.count] if tracker is not None else []
        opt = model.optimizer
        scale_vars = [opt.dynamic_scale] if _is_lso(opt) and getattr(opt, "built", False) else []
        probe_reader = StateReader(model, tracker_vars + floats + scale_vars)

        def probe_fn(check_weights: bool):
            ops, f32 = keras.ops, "float32"

            def probe(values):
                zero = ops.zeros((), f32)
                vals = [ops.cast(values[0], f32), ops.cast(values[1], f32)] if tracker_vars else [zero, zero]
                weights = values[len(tracker_vars) : len(tracker_vars) + len(floats)]
                ok = _all_finite(weights) if check_weights and weights else None
                vals.append(ops.cast(ok, f32) if ok is not None else ops.ones((), f32))
                vals.append(ops.cast(values[-1], f32) if scale_vars else -ops.ones((), f32))
                return ops.stack(vals)

            fn = compile_function(probe)
            return lambda: fn(probe_reader())

        def snapshot(values=None) -> None:
            shadow[:] = copy_arrays(reader()) if values is None else values

        def restore() -> None:
            sync_variables(model)
            for v, a in zip(variables, copy_arrays(shadow)):  # the shadow stays valid for the next rollback
                v.assign(a)

        self._machinery = {
            "n_vars": len(variables),
            "snapshot": snapshot,
            "restore": restore,
            "probe_full": probe_fn(True),
            "probe_loss": probe_fn(False),
            "has_tracker": bool(tracker_vars),
        }

    def _ready(self) -> bool:
        """Builds the machinery once the model and its optimizer have variables."""
        model = self.model
        opt = model.optimizer
        if not model.built or opt is None:
            return False
        if not getattr(opt, "built", False):
            if not model.trainable_variables:
                return False
            with model.distribute_strategy.scope():
                opt.build(model.trainable_variables)
        if self._machinery is None or self._machinery["n_vars"] != len(self._state_variables()):
            self._build_machinery()
        return True

    def _iterations(self) -> int | None:
        opt = self.model.optimizer
        return None if opt is None else int(keras.ops.convert_to_numpy(opt.iterations))

    def _take_snapshot(self, values=None) -> None:
        """Takes the snapshot: the state now, or `values` (read with the check that allowed them)."""
        if self._machinery["n_vars"] != len(self._state_variables()):
            self._build_machinery()  # e.g. a layer or optimizer variable added since
            values = None  # read for the old list of variables
        self._machinery["snapshot"](values)
        self.snapshot_step = self.step
        self._losses_at_snapshot = (list(self.recent_losses), self.loss_high)  # the loss history that led to it

    # ------------------------------------------------------------------ the check inside the train step
    def set_model(self, model) -> None:
        super().set_model(model)
        # Before `fit` makes its train function: the check's values are computed in the step.
        self._out = add_step_output(model, self.key, self._step_values) if hasattr(model, "train_step") else None

    def _step_values(self, read):
        """Inside the compiled train step, after its update: the check's device values.

        `[loss total, loss count, weights non-finite, loss scale]`: the loss
        tracker's sums, 1.0 when a weight is NaN/Inf (0.0 when all are finite;
        -1.0 unless `check_weights_every` is 1: other checks are separate calls),
        and the `LossScaleOptimizer`'s scale (-1.0 without one).
        """
        ops, model = keras.ops, self.model
        # float32, the dtype of the tracker's sums and the loss scale: their casts are no-ops
        # (float64 added one op per value in every step and no precision).
        f = "float32"
        none = -ops.ones((), f)
        tracker = loss_tracker(model)
        vals = [ops.cast(x, f) for x in read([tracker.total, tracker.count])] if tracker is not None else [none, none]
        floats = [w for w in model.weights if keras.backend.is_float_dtype(w.dtype)]
        if self.check_weights_every == 1 and floats:
            vals.append(1.0 - ops.cast(_all_finite(read(floats)), f))
        else:
            vals.append(none)
        opt = model.optimizer
        scale = _is_lso(opt) and getattr(opt, "built", False)
        vals.append(ops.cast(read([opt.dynamic_scale])[0], f) if scale else none)
        # One output tensor (each output costs Python in every call), except across workers,
        # where Keras reduces a step's outputs along axis 0: scalars keep their meaning there.
        return tuple(vals) if runtime.num_workers(getattr(model, "distribute_strategy", None)) > 1 else ops.stack(vals)

    def _probe(self, check_weights: bool, snapshot: bool = False) -> list[float]:
        """`[loss total, loss count, weights finite, loss scale]` of the last step, as `_Probe` gives them.

        Read from the train step's own outputs (no call of their own; the host
        read waits for the step Keras's logs wait for); the separate probe when
        the step did not compute them (Checkpoint's replay of a resumed epoch
        trains nothing) or the weights are due and the step left them out.
        With `snapshot` (one is due), that weight check reads the state too
        (see `_probe_call`).
        """
        self._pending = None
        self._read_state = snapshot
        try:
            return self._step_probe(check_weights)
        finally:
            self._read_state = False

    def _step_probe(self, check_weights: bool) -> list[float]:
        out = self._out.take() if self._out is not None else None
        if out is None:
            return self._probe_call(check_weights).tolist()
        # Python floats: cheaper than NumPy scalars for the few operations of a check.
        total, count, weights, scale = np.asarray(out, dtype=np.float64).tolist()
        if self._replicas != 1:  # under tf.distribute the step's outputs are means over the replicas: sums again
            total, count = total * self._replicas, count * self._replicas
        if weights >= 0:
            weights = 0.0 if weights > 0 else 1.0  # a mean over replicas: any of them non-finite
        elif check_weights:
            weights = float(self._probe_call(True)[2])
        else:
            weights = 1.0
        return [total, count, weights, scale]

    # ------------------------------------------------------------------ Keras hooks
    def on_train_begin(self, logs=None) -> None:
        super().on_train_begin(logs)
        self._machinery = None
        self.snapshot_step = None
        self._epoch = 0
        self._prev_total = 0.0
        self._prev_count = 0.0
        self._epoch_batches = 0
        self._prev_mean = None
        self._last_scale = None
        self._weights_checked = None
        self._pending = None
        self._strategy = getattr(self.model, "distribute_strategy", None)
        self._replicas = runtime.num_replicas(self._strategy) if backend_name() == "tensorflow" else 1
        self._lso = _is_lso(self.model.optimizer)
        sync = self.sync_across_workers
        self._sync = runtime.num_workers(self._strategy) > 1 if sync is None else sync
        if not self._ready():  # builds the machinery; the first snapshot waits for the first batch
            self._hook_first_apply()

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self._epoch = int(epoch)
        self._prev_total = 0.0  # fit resets the metrics before on_epoch_begin
        self._prev_count = 0.0
        self._epoch_batches = 0
        self._prev_mean = None
        self._sync_tracker = True

    def on_train_batch_begin(self, batch, logs=None) -> None:
        self._begin = int(batch)
        if self._machinery is None:
            return
        if getattr(self, "_sync_tracker", False):
            self._read_tracker()
        if self.snapshot_step is None:
            # Taken here rather than in `on_train_begin`, so that it holds what a
            # checkpoint restored in another callback's `on_train_begin`.
            self._take_snapshot()

    def on_train_batch_end(self, batch, logs=None) -> None:
        logs = logs if logs is not None else {}
        # Keras runs `steps_per_execution` steps per call and reports them as
        # `begin..end`; count what it reports.
        n = max(1, int(batch) - getattr(self, "_begin", int(batch)) + 1)
        self.step += n
        self._epoch_batches += n
        self._batch = int(batch)
        if self._machinery is None and not self._ready():
            return

        step, snapshot_step = self.step, self.snapshot_step
        snapshot_due = snapshot_step is None or step // self.snapshot_every > snapshot_step // self.snapshot_every
        every = self.check_weights_every
        check = snapshot_due or (every is not None and step // every > (step - n) // every)
        vals = self._probe(check, snapshot=snapshot_due)
        loss = self._batch_loss(vals, logs)
        loss_finite = loss is None or math.isfinite(loss)
        if not loss_finite and not check:
            vals = self._probe_call(True)  # a non-finite loss: always look at the weights
        weights_finite = bool(vals[2] > 0.5)
        if check or not loss_finite or every == 1:
            self._weights_checked = step  # the step's own check with `check_weights_every=1`
        scale = float(vals[3]) if vals[3] >= 0 else None

        causes = []
        lso = self._lso
        # The LossScaleOptimizer halves its scale when it skips a step.
        skipped = scale is not None and self._last_scale is not None and scale < self._last_scale
        self._last_scale = scale
        if not loss_finite:
            if lso and weights_finite:
                self.loss_scale_skips += 1  # the LossScaleOptimizer skipped it: not divergence
            else:
                causes.append("nonfinite_loss")
        if not weights_finite:
            causes.append("nonfinite_weights")
        if scale is not None and scale <= self.loss_scale_floor:
            causes.append("loss_scale_collapse")
        exceeded = None  # the spike threshold, when the loss is above it
        if self.spike_factor is not None and loss is not None and loss_finite:
            threshold = spike_threshold(self.recent_losses, self.loss_high, self.spike_factor, n)
            exceeded = threshold if threshold is not None and loss > threshold else None
        if exceeded is not None:
            if lso and weights_finite and skipped:
                self.loss_scale_skips += 1  # its gradient overflowed: the update was not applied
            else:
                causes.append("loss_spike")

        if getattr(self, "_sync", False):
            loss_finite, causes = self._agree(loss_finite, causes)

        if not loss_finite or causes or exceeded is not None:
            self._drop_from_tracker(logs)
        else:
            self._keep_in_tracker()
            if loss is not None:
                self.recent_losses.append(float(loss))
                self.loss_high = float(loss) if self.loss_high is None else max(self.loss_high, float(loss))

        if causes:
            self._diverged(causes, loss, scale, exceeded if "loss_spike" in causes else None)
        elif snapshot_due and loss_finite and self.snapshot_step != self.step:
            # Never snapshot right after a step the LossScaleOptimizer skipped: a
            # falling loss scale is not a good state. The snapshot waits for a
            # batch with a finite loss.
            self._take_snapshot(self._pending)
        self._pending = None  # values not taken: released before the next step (no copy-on-write)

    def on_epoch_end(self, epoch, logs=None) -> None:
        # The weights at the end of an epoch are what a Checkpoint listed after this callback saves.
        # (`step` is the same on every worker: all of them check, and agree, or none does.)
        if self._machinery is not None and self._weights_checked != self.step:
            self._weights_checked = self.step
            causes = [] if self._probe_call(True)[2] > 0.5 else ["nonfinite_weights"]
            if getattr(self, "_sync", False):
                _, causes = self._agree(True, causes)
            if causes:
                self._diverged(causes, None, None, None)
        if logs is not None:
            logs["nan_rollbacks"] = self.rollbacks

    def on_train_end(self, logs=None) -> None:
        super().on_train_end(logs)
        if getattr(self, "_out", None) is not None:
            self._out.active = False  # a train function traced later (after a compile) leaves the check out
        self._unhook_first_apply()
        self._machinery = None  # frees the snapshot (the compiled functions stay with the model)

    # ------------------------------------------------------------------ a model built at its first step
    def _hook_first_apply(self) -> None:
        """Arranges the first snapshot of a model that `fit` builds in its first step.

        Keras's TensorFlow trainer without a distribution strategy builds an
        unbuilt model (no `keras.Input`) while it traces the train function, and
        the same call applies the first update, so no callback hook sees the
        state in between. The optimizer's `apply` (what `apply_gradients` and
        Keras's `train_step` call) is wrapped until then: while the train
        function is traced, it snapshots the freshly built state (eagerly), then
        adds the update to the graph. tf.function traces twice when its first
        trace creates variables; the snapshot waits for the second trace, in
        which every variable holds its initial value.
        """
        opt = self.model.optimizer
        if opt is None:
            return
        if isinstance(vars(opt).get("apply"), _SnapshotBeforeApply):
            del opt.apply  # left by a fit that raised before its first update
        if "apply" not in vars(opt):
            opt.apply = _SnapshotBeforeApply(self, opt.apply)

    def _unhook_first_apply(self) -> None:
        opt = getattr(self.model, "optimizer", None)
        if opt is not None and isinstance(vars(opt).get("apply"), _SnapshotBeforeApply):
            del opt.apply

    def _snapshot_before_first_update(self) -> None:
        """Called while the train function is traced, before the first update exists."""
        tf = _tf()
        with tf.init_scope():  # run eagerly, outside the graph being traced
            # tf.function traces twice when its first trace creates variables:
            # in the first the model's are not yet initialised; the snapshot
            # is taken in the second.
            if self.snapshot_step is None and self._ready():
                if not all(bool(_raw(v).is_initialized()) for v in self._state_variables()):
                    return
                self._take_snapshot()
                self._read_tracker()
            self._unhook_first_apply()

    def _read_tracker(self) -> None:
        """Takes the loss tracker's sums as the epoch's starting point.

        Needed once per epoch before its first check: a checkpoint resumed
        mid-epoch may have restored the loss accumulators.
        """
        vals = self._probe_call(False)  # the tracker now, not a step's values
        self._prev_total, self._prev_count = float(vals[0]), float(vals[1])
        self._sync_tracker = False

    # ------------------------------------------------------------------ internals
    def _agree(self, loss_finite: bool, causes: list[str]) -> tuple[bool, list[str]]:
        """The check's verdict OR-reduced over every worker (the same on all of them)."""
        flags = runtime.any_across_workers(self._strategy, [not loss_finite] + [c in causes for c in CAUSES])
        return not flags[0], [c for c, f in zip(CAUSES, flags[1:]) if f]

    def _probe_call(self, check_weights: bool) -> np.ndarray:
        """The check's values from a compiled call of their own (`_Probe`) and a host read.

        When a snapshot is due (`_read_state`, set by `_probe`), the weight
        check and the read of the state are one compiled call on TensorFlow
        (`_ReadAndProbe`): the values wait in `_pending` for `_take_snapshot`,
        which takes them if the check lets it, and are dropped at the end of the
        batch otherwise.
        """
        machinery = self._machinery
        if check_weights and getattr(self, "_read_state", False) and "read_probe" in machinery:
            self._pending, vals = machinery["read_probe"]()
            return np.asarray(vals)
        fn = machinery["probe_full" if check_weights else "probe_loss"]
        return np.asarray(fn())

    def _batch_loss(self, vals: np.ndarray, logs: dict) -> float | None:
        """Mean loss of the batches since the last callback, or None if unknown.

        Exact: from the loss tracker's `total`/`count` (sums weighted by batch
        size, summed over replicas). Without a tracker (a custom `train_step`),
        from the running mean in `logs["loss"]`: `(m_k * k - m_j * j) / (k - j)`
        over batch counts, exact for equal batch sizes.
        """
        total, count = float(vals[0]), float(vals[1])
        self._cur = self._cur_mean = None
        if self._machinery["has_tracker"] and count > self._prev_count:
            self._cur = (total, count)
            return (total - self._prev_total) / (count - self._prev_count)
        mean = logs.get("loss")
        if mean is None:
            return None
        mean, k = float(mean), self._epoch_batches
        pm, pk = self._prev_mean or (0.0, 0)
        self._cur_mean = (mean, k)
        if not math.isfinite(pm) or k <= pk:
            return math.nan if not math.isfinite(pm) else None
        return (mean * k - pm * pk) / (k - pk)

    def _keep_in_tracker(self) -> None:
        if self._cur is not None:
            self._prev_total, self._prev_count = self._cur
        elif self._cur_mean is not None:
            self._prev_mean = self._cur_mean

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

    def _window_rollbacks(self) -> list[dict]:
        lo = -math.inf if self.window_steps is None else self.step - self.window_steps
        return [e for e in self.events if e.get("action") == "rollback" and e["step"] > lo]

    def _diverged(self, causes: list[str], loss: float | None, scale: float | None, threshold: float | None) -> None:
        sync_variables(self.model)  # on JAX inside fit: read the LR and iterations, and restore, through the variables
        opt = self.model.optimizer
        it_before = self._iterations()
        lr_before = float(current_lr(opt))
        recent = self._window_rollbacks()
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
            "iterations_before": it_before,
            "lr_before": lr_before,
        }
        if self.snapshot_step is not None:
            self._machinery["restore"]()  # also before stopping: `model` keeps the last good state
            # The reference of spike detection goes back too: the losses after the
            # snapshot belong to a path that no longer exists.
            losses, self.loss_high = self._losses_at_snapshot
            self.recent_losses = deque(losses, maxlen=self.spike_window)
            self._last_scale = None  # read again at the next check
        event["iterations_after"] = self._iterations()
        if stop:
            event.update(action="stop", lr_after=lr_before)
        else:
            old, new = scale_learning_rate(opt, self.lr_factor)
            event.update(action="rollback", lr_before=float(old), lr_after=float(new))
            self._take_snapshot()  # the restored state with the lower LR
        self.events.append(event)
        self._write_event(event)
        print(self._event_line(event), flush=True)
        if stop:
            raise TrainingDivergedError(self._stop_message(event, recent), events=self.events)

    @staticmethod
    def _event_line(e: dict) -> str:
        what = ", ".join(e["causes"])
        if e.get("spike_threshold") is not None:
            what += f" (loss {e['loss']:.4g} > {e['spike_threshold']:.4g})"
        if e["action"] == "rollback":
            return (
                f"NaNRollback: step {e['step']}: {what}; restored step {e['restored_step']} "
                f"({e['batches_skipped']} batches skipped, iterations {e['iterations_before']} -> "
                f"{e['iterations_after']}), LR {e['lr_before']:.4g} -> {e['lr_after']:.4g}."
            )
        return f"NaNRollback: step {e['step']}: {what}; stopping (LR {e['lr_before']:.4g})."

    def _stop_message(self, event: dict, recent: list[dict]) -> str:
        where = "the whole run" if self.window_steps is None else f"the last {self.window_steps} steps"
        if self.snapshot_step is None and not recent and self.max_rollbacks > 0:
            head = (
                f"Training diverged at step {event['step']} ({', '.join(event['causes'])}) before any "
                "good snapshot existed; nothing to roll back to."
            )
        else:
            head = (
                f"Training diverged at step {event['step']} ({', '.join(event['causes'])}) and "
                f"{len(recent)} rollback(s) within {where} already reached max_rollbacks={self.max_rollbacks}."
            )
        history = "; ".join(
            f"step {e['step']}: {', '.join(e['causes'])}, LR {e['lr_before']:.4g} -> {e['lr_after']:.4g}, "
            f"{e['batches_skipped']} batches skipped"
            for e in recent
        )
        tail = f" Rollbacks: {history}." if history else ""
        if "nonfinite_loss" in event["causes"]:
            # Keras's TerminateOnNaN words, so logs and handlers written for it match.
            tail += f" NaN or Inf loss encountered at batch {event['batch']}. Loss value: {event['loss']}."
        if event["restored_step"] is not None:
            tail += f" The model holds the last good state (step {event['restored_step']}, LR {event['lr_before']:.4g})."
        return head + tail + " Lower the learning rate, clip gradients (`global_clipnorm`), or check the input data."

    def _write_event(self, event: dict) -> None:
        if self.run_dir is None:
            return
        strategy = getattr(self.model, "distribute_strategy", None)
        if not runtime.is_chief(strategy):
            return
        path = Path(self.run_dir) / _EVENTS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(event, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
