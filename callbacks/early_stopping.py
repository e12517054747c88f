"""Early stopping whose patience survives restarts and that says why it stopped.

Example:
>>> es = EarlyStopping(monitor="val_loss", patience=3, warmup_epochs=2)
>>> es.get_state()["wait"]
0
"""

from __future__ import annotations

import logging
import math
import numbers
import warnings
from typing import Any

import keras
import numpy as np

from trainwell.callbacks.base import StatefulCallback, constructor_config, stateful_callbacks
from trainwell.callbacks.checkpoint import Checkpoint, load_checkpoint
from trainwell.compat.metrics import is_improvement, metric_direction, monitored_value
from trainwell.compat.sharded import weights_copy
from trainwell.validation import invalid_argument, is_int, is_number

logger = logging.getLogger("trainwell.early_stopping")

STOP_REASONS = ("patience", "non_finite", "divergence")


def _python(x):
    """A NumPy scalar as the Python number it holds (JSON-safe configs); anything else unchanged."""
    return x.item() if isinstance(x, np.generic) else x


def _is_flag(x) -> bool:
    """A bool, or an integer 0/1 (Keras tests `restore_best_weights` for truth only)."""
    return isinstance(x, (bool, np.bool_)) or (isinstance(x, numbers.Integral) and x in (0, 1))


class EarlyStopping(keras.callbacks.EarlyStopping, StatefulCallback):
    """`keras.callbacks.EarlyStopping` with restart-safe state and stop reasons.

    Extends Keras's `EarlyStopping` (same arguments and the same patience rule:
    `wait` counts epochs since the last improvement by more than `min_delta`,
    training stops once `wait >= patience` after epoch 0) and combines it with
    the `StatefulCallback` protocol: its state (`wait`, `best`, `best_epoch`,
    `stopped_epoch`, `stop_reason`) is saved by `Checkpoint`, so patience
    survives a restart. Keras's `on_train_begin` resets that state
    unconditionally; here it is reset only when nothing was restored.

    Additions:

    - `warmup_epochs`: epochs `< max(start_from_epoch, warmup_epochs)` are not
      counted and cannot become the best epoch (a run whose LR warms up for N
      epochs passes `warmup_epochs=N`). Keras's `start_from_epoch` keeps working.
    - Stop reasons, in `stop_reason` (state) and in the log
      (`logging.getLogger("trainwell.early_stopping")`, and printed with
      `verbose > 0`): `"patience"`; `"non_finite"` when the monitored value is
      NaN/Inf; `"divergence"` when it is worse than `divergence_threshold`
      (above it in min mode, below it in max mode). The last two stop at once,
      warmup or not.
    - `restore_best_weights=True` loads the weights from the `Checkpoint` in the
      same `fit` that was taken right after the best epoch (or, if that one was
      pruned, its best checkpoint by the same monitor), so it works across
      restarts; without such a checkpoint it falls back to Keras's in-memory
      copy of the best weights. The weights are restored at `on_train_end`.

    A drop-in: Keras's arguments with Keras's defaults (`patience=0` included),
    and the values Keras accepts (NumPy scalars, `verbose=True`,
    `restore_best_weights=1`; an unknown `mode` warns and falls back to
    `"auto"`). The monitored value may be a number or a 1-element array (binary
    `keras.metrics.F1Score` reports shape `(1,)`), as in Keras. Keras's own
    `early_stopping_test.py` runs against this class in `tests/conformance/`.

    Args:
        monitor: Quantity to monitor. Defaults to `"val_loss"`.
        min_delta: Minimum change that counts as an improvement. Defaults to `0`.
        patience: Epochs without improvement before stopping (an int >= 0).
            Defaults to `0` (Keras's default: stop at the first epoch without
            improvement; pass your own patience).
        verbose: Verbosity, 0 or 1 (or a bool). Defaults to `0`.
        mode: `"auto"`, `"min"` or `"max"`. Defaults to `"auto"`.
        baseline: Value the monitored quantity must beat to reset `wait`.
            Defaults to `None`.
        restore_best_weights: Restore the best epoch's weights at the end of
            training. Defaults to `False`.
        start_from_epoch: Keras's: epochs to wait before monitoring. Defaults to `0`.
        warmup_epochs: Epochs not counted (see above). Defaults to `0`.
        divergence_threshold: Stop with reason `"divergence"` once the monitored
            value is worse than this. Defaults to `None` (off).

    Example:
    >>> es = EarlyStopping(patience=5, warmup_epochs=3, divergence_threshold=1e3)
    >>> model.fit(x, y, validation_split=0.1, epochs=100, callbacks=[es])  # doctest: +SKIP
    >>> es.stop_reason  # doctest: +SKIP
    'patience'
    """

    def __init__(
        self,
        monitor="val_loss",
        min_delta=0,
        patience=0,
        verbose=0,
        mode="auto",
        baseline=None,
        restore_best_weights=False,
        start_from_epoch=0,
        warmup_epochs=0,
        divergence_threshold=None,
    ):
        # Keras's own checks are few (it fails later, or never); these fail at
        # construction, but accept every value Keras works with: NumPy scalars,
        # `verbose=True`, `restore_best_weights=1`, and an unknown `mode` (a
        # warning, then "auto", as Keras does).
        if not isinstance(monitor, str) or not monitor:
            raise invalid_argument("monitor", "a metric name", monitor)
        if not is_number(min_delta):
            raise invalid_argument("min_delta", "a finite number", min_delta)
        if not (is_int(patience) and patience >= 0):
            raise invalid_argument("patience", "an int >= 0", patience)
        if not (is_int(verbose) or isinstance(verbose, (bool, np.bool_))):
            raise invalid_argument("verbose", "an int or a bool", verbose)
        if mode not in ("auto", "min", "max"):
            warnings.warn(f"{type(self).__name__} mode '{mode}' is unknown, fallback to auto mode.", stacklevel=2)
            mode = "auto"
        if baseline is not None and not is_number(baseline):
            raise invalid_argument("baseline", "a finite number or None", baseline)
        if not _is_flag(restore_best_weights):
            raise invalid_argument("restore_best_weights", "a bool", restore_best_weights)
        for name, value in (("start_from_epoch", start_from_epoch), ("warmup_epochs", warmup_epochs)):
            if not (is_int(value) and value >= 0):
                raise invalid_argument(name, "an int >= 0", value)
        if divergence_threshold is not None and not is_number(divergence_threshold):
            raise invalid_argument("divergence_threshold", "a finite number or None", divergence_threshold)
        self.warmup_epochs = int(warmup_epochs)
        self.divergence_threshold = _python(divergence_threshold)
        self._min_delta_arg = _python(min_delta)
        self.restored_from: str | None = None
        super().__init__(
            monitor=monitor,
            min_delta=_python(min_delta),
            patience=int(patience),
            verbose=int(verbose),
            mode=mode,
            baseline=_python(baseline),
            restore_best_weights=bool(restore_best_weights),
            start_from_epoch=int(start_from_epoch),
        )

    # ------------------------------------------------------------ config/state
    def get_config(self) -> dict[str, Any]:
        # Keras keeps `abs(min_delta)` (negated in "min" mode): the argument is kept as given.
        return {**constructor_config(self), "min_delta": self._min_delta_arg}

    def reset_state(self) -> None:
        self.wait = 0
        self.stopped_epoch = 0
        self.best = None
        self.best_weights = None
        self.best_epoch = 0
        self.stop_reason = None

    def get_state(self) -> dict[str, Any]:
        return {
            "wait": int(self.wait),
            "best": None if self.best is None else float(self.best),
            "best_epoch": int(self.best_epoch),
            "stopped_epoch": int(self.stopped_epoch),
            "stop_reason": self.stop_reason,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        StatefulCallback.set_state(self, state)
        self.wait = int(state.get("wait", 0))
        self.best = None if state.get("best") is None else float(state["best"])
        self.best_epoch = int(state.get("best_epoch", 0))
        self.stopped_epoch = int(state.get("stopped_epoch", 0))
        self.stop_reason = state.get("stop_reason")
        self.best_weights = None

    def continue_after_stop(self) -> None:
        """A stopped run trained longer (`fit` again with more epochs): patience starts again.

        The best value and epoch are kept: `restore_best_weights` still restores
        the best epoch of the whole run.
        """
        self.wait = 0
        self.stopped_epoch = 0
        self.stop_reason = None

    # ------------------------------------------------------------ hooks
    def on_train_begin(self, logs=None) -> None:
        # Not Keras's on_train_begin: it would reset a restored state.
        StatefulCallback.on_train_begin(self, logs)
        self.restored_from = None

    @property
    def first_counted_epoch(self) -> int:
        """The first epoch that counts towards patience and best."""
        return max(self.start_from_epoch, self.warmup_epochs)

    def _direction(self) -> str:
        """`"min"` or `"max"`; the first call sets `monitor_op` as Keras does (`trainwell.compat.metric_direction`)."""
        if self.monitor_op is None:
            direction = metric_direction(self.monitor, self.mode, self.model)
            if direction is None:  # Keras's own error, word for word
                raise ValueError(
                    f"{self.__class__.__name__} callback received monitor={self.monitor}, but Keras isn't able to "
                    "automatically determine whether that metric should be maximized or minimized. Pass "
                    "`mode='max'` in order to monitor based on the highest metric value, or pass `mode='min'` "
                    "in order to use the lowest value."
                )
            self.monitor_op = keras.ops.greater if direction == "max" else keras.ops.less
        return "max" if self.monitor_op is keras.ops.greater else "min"

    def _improves(self, current: float, reference) -> bool:
        return is_improvement(current, reference, self._direction(), self.min_delta)

    def on_epoch_end(self, epoch, logs=None) -> None:
        direction = self._direction()
        current = self.get_monitor_value(logs)
        if current is None:
            return
        current = monitored_value(current, self.monitor, type(self).__name__)
        if not math.isfinite(current):
            self._stop(epoch, "non_finite", current)
            return
        if self.divergence_threshold is not None:
            thr = float(self.divergence_threshold)
            if (current > thr) if direction == "min" else (current < thr):
                self._stop(epoch, "divergence", current)
                return
        if epoch < self.first_counted_epoch:
            return
        if self.restore_best_weights and self.best_weights is None and self.best is None:
            self.best_weights = weights_copy(self.model)
            self.best_epoch = epoch
        self.wait += 1
        if self._improves(current, self.best):
            self.best = current
            self.best_epoch = epoch
            if self.restore_best_weights:
                self.best_weights = weights_copy(self.model)
            if self.baseline is None or self._improves(current, self.baseline):
                self.wait = 0
            return
        if self.wait >= self.patience and epoch > 0:
            self._stop(epoch, "patience", current)

    def _stop(self, epoch: int, reason: str, current: float) -> None:
        self.stopped_epoch = int(epoch)
        self.stop_reason = reason
        self.model.stop_training = True
        if reason == "patience":
            self._say(
                f"Epoch {epoch + 1}: early stopping (patience): {self.monitor} did not improve on "
                f"{self.best} (epoch {self.best_epoch + 1}) for {self.wait} epochs."
            )
            return
        if reason == "non_finite":
            msg = f"Epoch {epoch + 1}: early stopping (non_finite): {self.monitor} is {current}."
        else:
            msg = (
                f"Epoch {epoch + 1}: early stopping (divergence): {self.monitor}={current} is worse than "
                f"divergence_threshold={self.divergence_threshold}."
            )
        self._say(msg, logging.WARNING)

    def on_train_end(self, logs=None) -> None:
        try:
            if self.restore_best_weights and self.best is not None:
                self._restore_best()
        finally:
            StatefulCallback.on_train_end(self, logs)

    # ------------------------------------------------------------ best weights
    def _checkpoint_callback(self):
        for cb in stateful_callbacks(self.model).values():
            if isinstance(cb, Checkpoint) and cb.model is self.model:
                return cb
        return None

    def _restore_best(self) -> None:
        ckpt = self._checkpoint_callback()
        if ckpt is not None:
            ckpt.flush()
            entry = ckpt.checkpoint_for_epoch(self.best_epoch)
            if entry is not None:
                self._load(entry["path"])
                self._say(f"Restored the weights of epoch {self.best_epoch + 1} from {entry['path']}.")
                return
        if self.best_weights is not None:
            self.model.set_weights(self.best_weights)
            self.restored_from = "memory"
            self._say(f"Restored the weights of epoch {self.best_epoch + 1} from memory.")
            return
        entry = ckpt.best_checkpoint() if ckpt is not None and ckpt.monitor == self.monitor else None
        if entry is not None:
            self._load(entry["path"])
            logger.warning(
                "No checkpoint of the best epoch %s is left; restored the best checkpoint by %s instead (%s).",
                self.best_epoch + 1, self.monitor, entry["path"],
            )
            return
        logger.warning(
            "restore_best_weights: the weights of epoch %s are not available (restarted run without a "
            "Checkpoint of that epoch); keeping the current weights.", self.best_epoch + 1,
        )

    def _load(self, path: str) -> None:
        load_checkpoint(path, self.model)
        self.restored_from = path

    def _say(self, msg: str, level: int = logging.INFO) -> None:
        logger.log(level, msg)
        if self.verbose > 0:
            print(msg)


class StopAtStep(keras.callbacks.Callback):
    """Stops `fit` once the optimizer has taken `max_steps` steps, mid-epoch if need be.

    Keras has no built-in for this: `fit` counts whole epochs and `steps_per_epoch`
    shortens every epoch alike, while a run capped at, say, 1.8 epochs (TF Model
    Garden's `trainer.train_steps`, Hugging Face's `max_steps`) must end inside its
    last epoch. After the batch whose end makes `optimizer.iterations >= max_steps`
    this sets `model.stop_training`; Keras then leaves the epoch's loop and still
    runs that epoch's validation and `on_epoch_end` (so `Checkpoint`, `EarlyStopping`
    and the loggers see the last, partial epoch). The count is the optimizer's, which
    `Checkpoint` restores, so a resumed run stops at the same step: this callback
    has no state of its own. With `steps_per_execution=k` the check runs every k
    steps, so a run may end up to k - 1 steps late. trainwell's `Checkpoint` saves
    at whole epochs (or every N steps), not when a run stops inside an epoch, so
    the last steps of a capped run may be in no checkpoint: a resumed run redoes
    them from the previous checkpoint, exactly, and stops at the same step.

    Args:
        max_steps: Optimizer steps after which training stops, an int >= 1.

    Example:
    >>> stop = StopAtStep(180)
    >>> model.fit(ds, epochs=2, steps_per_epoch=100, callbacks=[stop])  # doctest: +SKIP
    >>> int(model.optimizer.iterations)  # doctest: +SKIP
    180
    """

    def __init__(self, max_steps: int):
        super().__init__()
        if not is_int(max_steps) or max_steps < 1:
            raise invalid_argument("max_steps", "an int >= 1", max_steps)
        self.max_steps = max_steps

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations) >= self.max_steps:
            self.model.stop_training = True

    def get_config(self) -> dict[str, Any]:
        return {"max_steps": self.max_steps}
