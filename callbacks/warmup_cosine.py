"""`WarmupCosine`: warmup + cosine (or linear) decay sized from the `fit` call itself."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import keras
import numpy as np
from keras import ops

from trainwell import runtime
from trainwell.callbacks.base import constructor_config
from trainwell.callbacks.schedules import (
    WarmupCosineDecay,
    WarmupLinearDecay,
    _check_restarts,
    _check_warmup_start,
    is_trainwell_schedule,
)
from trainwell.compat.backend import compile_function, strategy_scope
from trainwell.compat.learning_rate import current_lr, inner_optimizer, install_schedule, raw_learning_rate
from trainwell.io import new_figure, save_figure
from trainwell.validation import invalid_argument, is_number

_DECAYS = ("cosine", "linear")


def _schedule_value(schedule, iterations, step, multiplier):
    """`schedule(iterations)` at the given values of `iterations` and of the schedule's multiplier.

    What `optimizer.learning_rate` reads, as one compiled call (`WarmupCosine._current_lr`): Keras
    evaluates a schedule eagerly, one dispatch per op (timings: bench/README.md, callback_overhead).
    The variables' values are arguments because a compiled JAX function keeps the values it was
    traced with.
    """
    with keras.StatelessScope(state_mapping=[(iterations, step), (schedule.multiplier, multiplier)]):
        return schedule(iterations)


class WarmupCosine(keras.callbacks.Callback):
    """Installs a warmup + cosine/linear decay schedule whose length comes from `fit`.

    At `on_train_begin` it works out the total number of steps from the fit
    call (`epochs * steps_per_epoch`, from `self.params`), so nobody computes
    `decay_steps` by hand, and puts a `WarmupCosineDecay` (or, with
    `decay="linear"`, a `WarmupLinearDecay`) on the optimizer. The schedule is a
    graph-side function of `optimizer.iterations`: no Python work per batch, and
    a fit resumed with `initial_epoch` (and the restored optimizer) continues
    the same curve, since `initial_epoch` does not change the total.

    At each epoch end it writes the current learning rate (the one the next
    step will use) into the epoch logs as `learning_rate`, the name Keras's
    own LR callbacks use, so `CSVLogger`, `TensorBoard` and `History` record
    it (TensorBoard as `epoch_learning_rate`, the scalar it writes anyway): put
    it *before* those callbacks in the list. With `run_dir`, it writes
    `lr_schedule.png`, the whole schedule (chief only).

    Why not a Keras built-in: `LearningRateScheduler` sets a Python float once
    per epoch (no per-step warmup, and it fails on an optimizer built with a
    schedule); `CosineDecay` needs `decay_steps` computed by the user and cannot
    be lowered after a NaN rollback. This callback sizes a trainwell schedule
    (which has an LR multiplier for rollbacks) instead.

    Notes: the optimizer's original learning-rate variable stays tracked (unused)
    so the optimizer's variable list, and thus checkpoints, keep one layout
    whether or not the schedule is installed. When the fit's traced train
    function was built for another learning rate (a second `fit`), it is
    rebuilt. Under `mixed_float16` the schedule goes on the `LossScaleOptimizer`'s
    `inner_optimizer`. With a dataset of unknown length, prefer `fit(...,
    steps_per_epoch=N)` on a repeated dataset to `total_steps`: Keras 3.15 then
    advances `optimizer.iterations` one extra step each time an epoch runs out
    of data, which shifts the curve by one step per epoch.

    Args:
        peak_lr: LR at the end of warmup; `None` means the optimizer's current
            learning rate (or the `peak_lr` of a trainwell schedule already on
            it). Defaults to `None`.
        warmup_epochs: Warmup length in epochs (may be fractional). Defaults to `0`.
        warmup_steps: Warmup length in steps (an int, or a float as Keras's
            `CosineDecay` takes); overrides `warmup_epochs`. Defaults to `None`.
        min_lr: Final LR. Defaults to `0.0`.
        warmup_start: LR at step 0 when there is a warmup; above the peak, the
            warmup goes down. Defaults to `0.0`.
        decay: `"cosine"` or `"linear"`. Defaults to `"cosine"`.
        restart_epochs: Length in epochs of the first SGDR cycle after warmup
            (cosine only); `None` means no restarts. Defaults to `None`.
        t_mul: SGDR cycle length multiplier. Defaults to `1.0`.
        m_mul: SGDR cycle height multiplier. Defaults to `1.0`.
        total_steps: Total number of training steps; `None` means
            `epochs * steps_per_epoch` of the fit call. Required when the
            dataset's length is unknown and `steps_per_epoch` is not given.
            Defaults to `None`.
        run_dir: Directory where `lr_schedule.png` is written; `None` writes
            nothing. Defaults to `None`.

    Example:
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(keras.optimizers.SGD(0.1), "mse")
    >>> x, y = np.zeros((64, 4)), np.zeros((64, 1))
    >>> h = model.fit(x, y, batch_size=16, epochs=3, verbose=0,
    ...               callbacks=[WarmupCosine(warmup_epochs=1)])
    >>> round(h.history["learning_rate"][0], 4)   # end of warmup (4 steps): the peak
    0.1
    """

    def __init__(
        self,
        peak_lr: float | None = None,
        warmup_epochs: float = 0,
        warmup_steps: int | None = None,
        min_lr: float = 0.0,
        warmup_start: float = 0.0,
        decay: str = "cosine",
        restart_epochs: float | None = None,
        t_mul: float = 1.0,
        m_mul: float = 1.0,
        total_steps: int | None = None,
        run_dir: str | os.PathLike | None = None,
    ) -> None:
        super().__init__()
        if peak_lr is not None and (not is_number(peak_lr) or peak_lr <= 0):
            raise invalid_argument("peak_lr", "None or a float > 0", peak_lr)
        if not is_number(warmup_epochs) or warmup_epochs < 0:
            raise invalid_argument("warmup_epochs", "a number >= 0", warmup_epochs)
        if warmup_steps is not None and (not is_number(warmup_steps) or warmup_steps < 0):
            raise invalid_argument("warmup_steps", "None or a number >= 0", warmup_steps)
        if not is_number(min_lr) or min_lr < 0 or (peak_lr is not None and min_lr > peak_lr):
            raise invalid_argument("min_lr", "a float in [0, peak_lr]", min_lr)
        _check_warmup_start(warmup_start)
        if decay not in _DECAYS:
            raise invalid_argument("decay", "one of " + ", ".join(repr(d) for d in _DECAYS), decay)
        if restart_epochs is not None and (not is_number(restart_epochs) or restart_epochs <= 0):
            raise invalid_argument("restart_epochs", "None or a number > 0", restart_epochs)
        if restart_epochs is not None and decay != "cosine":
            raise ValueError(
                "Warm restarts need `decay='cosine'`. "
                f"Received: decay={decay!r}, restart_epochs={restart_epochs!r}"
            )
        _check_restarts("restart_epochs", restart_epochs, t_mul, m_mul)
        if total_steps is not None and (not is_number(total_steps) or total_steps <= 0):
            raise invalid_argument("total_steps", "None or a number > 0", total_steps)
        self.peak_lr = peak_lr
        self.warmup_epochs = warmup_epochs
        self.warmup_steps = warmup_steps
        self.min_lr = min_lr
        self.warmup_start = warmup_start
        self.decay = decay
        self.restart_epochs = restart_epochs
        self.t_mul = t_mul
        self.m_mul = m_mul
        self.total_steps = total_steps
        self.run_dir = None if run_dir is None else os.fspath(run_dir)
        #: The schedule installed by the last `on_train_begin`.
        self.schedule: WarmupCosineDecay | WarmupLinearDecay | None = None
        self._lr_now = None  # (schedule, optimizer, compiled `_schedule_value`)

    # ---------------------------------------------------------------- config
    def get_config(self) -> dict[str, Any]:
        """Returns the constructor arguments."""
        return constructor_config(self)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "WarmupCosine":
        return cls(**config)

    # ---------------------------------------------------------------- sizing
    def _steps_per_epoch(self, what: str) -> int:
        steps = (self.params or {}).get("steps")
        if steps is None:
            raise ValueError(
                f"WarmupCosine cannot work out {what}: the number of steps per epoch is unknown "
                "(a dataset of unknown cardinality). Pass `steps_per_epoch=` to `fit()`, or "
                "`total_steps=` (and `warmup_steps=` instead of `warmup_epochs=`) to WarmupCosine."
            )
        return int(steps)

    def _build_schedule(self, peak_lr: float):
        # Step counts as given: the schedule keeps an int an int and a float a float.
        total, warmup = self.total_steps, self.warmup_steps
        if total is None:
            total = int((self.params or {}).get("epochs")) * self._steps_per_epoch("the total number of steps")
        if warmup is None and self.warmup_epochs:
            warmup = int(round(self.warmup_epochs * self._steps_per_epoch("`warmup_steps` from `warmup_epochs`")))
        common = dict(peak_lr=peak_lr, total_steps=total, warmup_steps=0 if warmup is None else warmup,
                      min_lr=float(self.min_lr), warmup_start=float(self.warmup_start))
        if self.decay == "linear":
            return WarmupLinearDecay(**common)
        restart = None
        if self.restart_epochs is not None:
            restart = max(int(round(self.restart_epochs * self._steps_per_epoch("`restart_steps` from `restart_epochs`"))), 1)
        return WarmupCosineDecay(**common, restart_steps=restart, t_mul=float(self.t_mul), m_mul=float(self.m_mul))

    def _resolve_peak(self, current) -> float:
        if self.peak_lr is not None:
            return float(self.peak_lr)
        if is_trainwell_schedule(current):
            return float(current.peak_lr)
        if isinstance(current, keras.Variable):
            # The variable is float32: take the shortest decimal (0.1, not 0.10000000149).
            return float(str(np.float32(current.numpy())))
        raise ValueError(
            "WarmupCosine(peak_lr=None) takes the peak from the optimizer's learning rate, but it is a "
            f"`{type(current).__name__}`. Pass `peak_lr=` explicitly. Received: learning_rate={current!r}"
        )

    # ---------------------------------------------------------------- hooks
    def on_train_begin(self, logs=None) -> None:
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None:
            raise ValueError("WarmupCosine needs a compiled model with an optimizer. Received: optimizer=None")
        current = raw_learning_rate(optimizer)
        peak = self._resolve_peak(current)
        with strategy_scope(self.model):
            schedule = self._build_schedule(peak)
        if (
            is_trainwell_schedule(current)
            and type(current) is type(schedule)
            and current.get_config() == schedule.get_config()
        ):
            self.schedule = current  # same curve: keep it (and its multiplier); no retrace
        else:
            # Keeps the multiplier in force (a NaN rollback's, or a restored one) and the
            # optimizer's variable list (checkpoint layout): see `install_schedule`.
            install_schedule(optimizer, schedule)
            self.schedule = schedule
            # A traced train function has the old learning rate baked in.
            if getattr(self.model, "train_function", None) is not None:
                self.model.make_train_function(force=True)
        if self.run_dir is not None:
            if runtime.is_chief(getattr(self.model, "distribute_strategy", None)):
                self.plot(Path(self.run_dir) / "lr_schedule.png")

    def on_epoch_end(self, epoch, logs=None) -> None:
        # Keras's own name (`ReduceLROnPlateau`, `LearningRateScheduler` and
        # `TensorBoard` write `learning_rate`; `fit` itself writes none).
        if logs is not None:
            logs["learning_rate"] = self._current_lr()

    def _current_lr(self) -> float:
        """`current_lr(optimizer)`; one compiled call while our schedule is in place."""
        optimizer, schedule = self.model.optimizer, self.schedule
        if schedule is None or raw_learning_rate(optimizer) is not schedule:
            return current_lr(optimizer)  # someone else's LR
        iterations = inner_optimizer(optimizer).iterations
        if self._lr_now is None or self._lr_now[0] is not schedule or self._lr_now[1] is not optimizer:
            fn = compile_function(functools.partial(_schedule_value, schedule, iterations))
            self._lr_now = (schedule, optimizer, fn)
        return float(self._lr_now[2](iterations.value, schedule.multiplier.value))

    # ---------------------------------------------------------------- plot
    def plot(self, path: str | os.PathLike) -> Path:
        """Writes a PNG of the installed schedule over all its steps (atomically).

        Args:
            path: Target file. Required.

        Returns:
            The path written.

        Example:
        >>> cb.plot("lr_schedule.png")  # doctest: +SKIP
        """
        if self.schedule is None:
            raise ValueError("WarmupCosine.plot() needs an installed schedule: call it after `fit` has begun.")
        s = self.schedule
        total = int(s.total_steps)
        steps = np.unique(np.linspace(0, total, num=min(total + 1, 2001)).round().astype(np.int64))
        values = np.asarray(ops.convert_to_numpy(s(steps)), dtype=np.float64)
        fig, axes = new_figure(figsize=(6, 3.5))
        ax = axes[0, 0]
        ax.plot(steps, values, lw=1.5)
        if s.warmup_steps:
            ax.axvline(s.warmup_steps, color="grey", ls=":", lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("learning rate")
        ax.set_title(f"{type(s).__name__}: peak {s.peak_lr:g}, {total} steps")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        return save_figure(fig, path)


