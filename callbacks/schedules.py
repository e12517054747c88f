"""Learning-rate schedules with warmup, and helpers that lower any optimizer's LR.

The schedules are `keras.optimizers.schedules.LearningRateSchedule` subclasses:
pure, graph-safe functions of the optimizer step written with `keras.ops`, whose
`get_config()` equals their constructor arguments. Each one multiplies its value
by `schedule.multiplier`, a non-trainable float32 `keras.Variable` (initially
1.0, not part of the config): Keras refuses a new learning rate on an optimizer
built with a schedule, so lowering the LR after a NaN rollback goes through that
variable (`scale_learning_rate`, `set_lr_multiplier`: `trainwell.compat`'s one
LR get/set, re-exported here).

Why not Keras's own `CosineDecay(warmup_target=..., warmup_steps=...)` and
`CosineDecayRestarts`: they have no multiplier (an optimizer built with them can
never have its LR lowered), `CosineDecayRestarts` has no warmup, and neither
offers the BERT-style linear decay or the Goyal et al. step decay with warmup.

The LR helpers (`current_lr`, `get_lr_multiplier`, `set_lr_multiplier`,
`scale_learning_rate`, `inner_optimizer`) live in `trainwell.compat.learning_rate`
and see through `keras.optimizers.LossScaleOptimizer` (the wrapper that
`mixed_float16` puts around the optimizer).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import keras
from keras import ops

from trainwell.callbacks.base import constructor_config
from trainwell.compat.learning_rate import (
    current_lr,
    get_lr_multiplier,
    inner_optimizer,
    scale_learning_rate,
    set_lr_multiplier,
)
from trainwell.config import scaled_lr  # re-exported: keras-free, so configs compute it without Keras
from trainwell.validation import invalid_argument, is_int, is_number

__all__ = [
    "WarmupCosineDecay",
    "WarmupLinearDecay",
    "WarmupStepDecay",
    "scaled_lr",
    "get_lr_multiplier",
    "set_lr_multiplier",
    "scale_learning_rate",
    "current_lr",
    "is_trainwell_schedule",
    "inner_optimizer",
]


# ---------------------------------------------------------------- validation
def _check_peak(peak_lr: Any) -> float:
    if not is_number(peak_lr) or peak_lr <= 0:
        raise invalid_argument("peak_lr", "a float > 0", peak_lr)
    return float(peak_lr)


def _check_warmup(warmup_steps: Any, upper: float, upper_name: str) -> int | float:
    if not is_number(warmup_steps) or not 0 <= warmup_steps <= upper:
        raise invalid_argument("warmup_steps", f"a number >= 0 and <= {upper_name} ({upper})", warmup_steps)
    return _step_count(warmup_steps)


def _step_count(x: Any) -> int | float:
    """A step count as given: an int stays an int, a float (as `CosineDecay` takes) a float."""
    return int(x) if is_int(x) else float(x)


def _check_warmup_start(warmup_start: Any) -> float:
    # Above `peak_lr` is a warmup that goes down, which `CosineDecay` allows too.
    if not is_number(warmup_start) or warmup_start < 0:
        raise invalid_argument("warmup_start", "a float >= 0", warmup_start)
    return float(warmup_start)


def _check_restarts(restart_name: str, restart: Any, t_mul: Any, m_mul: Any) -> None:
    """The SGDR multipliers, which only a schedule with restarts (`restart` not None) takes."""
    if not is_number(t_mul) or t_mul < 1:
        raise invalid_argument("t_mul", "a float >= 1", t_mul)
    if not is_number(m_mul) or not 0 < m_mul <= 1:
        raise invalid_argument("m_mul", "a float in (0, 1]", m_mul)
    if restart is None and (t_mul != 1 or m_mul != 1):
        raise ValueError(
            f"Arguments `t_mul` and `m_mul` only apply to warm restarts: pass `{restart_name}` too. "
            f"Received: {restart_name}=None, t_mul={t_mul}, m_mul={m_mul}"
        )


# ---------------------------------------------------------------- base class
class _WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Shared plumbing: the multiplier variable and the linear warmup."""

    def __init__(self, peak_lr: float, warmup_steps: int, warmup_start: float) -> None:
        self.peak_lr = peak_lr
        self.warmup_steps = warmup_steps
        self.warmup_start = warmup_start
        # float32 and never autocast: under mixed_float16 the LR stays float32.
        self.multiplier = keras.Variable(
            1.0, dtype="float32", trainable=False, autocast=False, name="lr_multiplier"
        )

    def _base(self, step):  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, step):
        step = ops.cast(step, "float32")
        value = self._base(step)
        if self.warmup_steps > 0:
            warmup = self.warmup_start + (self.peak_lr - self.warmup_start) * (step / float(self.warmup_steps))
            value = ops.where(step < float(self.warmup_steps), warmup, value)
        return ops.cast(value, "float32") * ops.cast(self.multiplier, "float32")

    def get_config(self) -> dict[str, Any]:
        return constructor_config(self)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


class _DecaySchedule(_WarmupSchedule):
    """A warmup, then a decay from `peak_lr` to `min_lr` at `total_steps`: the arguments both decays share.

    Step counts may be floats, as in Keras's `CosineDecay(decay_steps=1000.0)`.
    """

    def __init__(
        self,
        peak_lr: float,
        total_steps: int | float,
        warmup_steps: int | float = 0,
        min_lr: float = 0.0,
        warmup_start: float = 0.0,
    ) -> None:
        peak_lr = _check_peak(peak_lr)
        if not is_number(total_steps) or total_steps <= 0:
            raise invalid_argument("total_steps", "a number > 0", total_steps)
        total_steps = _step_count(total_steps)
        warmup_steps = _check_warmup(warmup_steps, total_steps, "total_steps")
        if not is_number(min_lr) or min_lr < 0 or min_lr > peak_lr:
            raise invalid_argument("min_lr", f"a float in [0, peak_lr] = [0, {peak_lr}]", min_lr)
        super().__init__(peak_lr, warmup_steps, _check_warmup_start(warmup_start))
        self.total_steps = total_steps
        self.min_lr = float(min_lr)


# ---------------------------------------------------------------- schedules
@keras.saving.register_keras_serializable(package="trainwell")
class WarmupCosineDecay(_DecaySchedule):
    """Linear warmup, then cosine decay, with optional SGDR warm restarts.

    From `warmup_start` the LR rises linearly to `peak_lr` at `warmup_steps`
    (Goyal et al., 2017), then follows a half cosine down to `min_lr` at
    `total_steps` (Loshchilov & Hutter, 2017) and stays at `min_lr` afterwards.

    With `restart_steps`, the decay after warmup is split into SGDR cycles: the
    first is `restart_steps` long, each next one `t_mul` times longer, and the
    height above `min_lr` of each cycle is `m_mul` times that of the previous one
    (cycle `i` starts at `min_lr + (peak_lr - min_lr) * m_mul**i`; so with
    `min_lr > 0` the curve never drops below `min_lr`). The last cycle that fits
    before `total_steps` is stretched to end there, so the curve always reaches
    `min_lr` exactly at `total_steps` and never ends in a stub of a cycle.

    Extends `keras.optimizers.schedules.LearningRateSchedule` rather than
    `CosineDecay`/`CosineDecayRestarts`: those have no LR multiplier (see the
    module docstring), and `CosineDecayRestarts` has no warmup.

    Keras's `CosineDecay(initial_learning_rate=a, decay_steps=d, alpha=r,
    warmup_target=t, warmup_steps=w)` is `WarmupCosineDecay(peak_lr=t,
    total_steps=w + d, warmup_steps=w, min_lr=r * t, warmup_start=a)`; without
    `warmup_target` it is `WarmupCosineDecay(peak_lr=a, total_steps=d,
    min_lr=r * a)`. Keras's own `CosineDecay` tests run against this class that
    way (`tests/conformance/`).

    The value is multiplied by `self.multiplier` (a float32 `keras.Variable`,
    initially 1.0, not in `get_config()`).

    Args:
        peak_lr: LR at the end of warmup. Required.
        total_steps: Step at which the LR reaches `min_lr` (an int, or a float
            as `CosineDecay` takes). Required.
        warmup_steps: Length of the linear warmup, in steps. Defaults to `0`.
        min_lr: Final LR. Defaults to `0.0`.
        warmup_start: LR at step 0 when `warmup_steps > 0`; above `peak_lr`, the
            warmup goes down (as `CosineDecay` allows). Defaults to `0.0`.
        restart_steps: Length in steps of the first SGDR cycle after warmup;
            `None` means a single cosine. Defaults to `None`.
        t_mul: Each cycle is `t_mul` times longer than the previous one.
            Defaults to `1.0`.
        m_mul: Each cycle's height above `min_lr` is `m_mul` times the previous
            one's. Defaults to `1.0`.

    Example:
    >>> s = WarmupCosineDecay(peak_lr=0.1, total_steps=100, warmup_steps=10)
    >>> round(float(s(0)), 4), round(float(s(10)), 4), round(float(s(100)), 4)
    (0.0, 0.1, 0.0)
    >>> opt = keras.optimizers.SGD(learning_rate=s)
    """

    def __init__(
        self,
        peak_lr: float,
        total_steps: int | float,
        warmup_steps: int | float = 0,
        min_lr: float = 0.0,
        warmup_start: float = 0.0,
        restart_steps: int | None = None,
        t_mul: float = 1.0,
        m_mul: float = 1.0,
    ) -> None:
        super().__init__(peak_lr, total_steps, warmup_steps, min_lr, warmup_start)
        if restart_steps is not None and (not is_int(restart_steps) or restart_steps < 1):
            raise invalid_argument("restart_steps", "None or an integer >= 1", restart_steps)
        _check_restarts("restart_steps", restart_steps, t_mul, m_mul)
        self.restart_steps = None if restart_steps is None else int(restart_steps)
        self.t_mul = float(t_mul)
        self.m_mul = float(m_mul)
        self._decay_steps = float(self.total_steps - self.warmup_steps)
        self._last_cycle = self._count_last_cycle()

    # Cycle k spans [S(k), S(k+1)) after warmup, S(k) = sum_{j<k} R * t_mul**j.
    def _cycle_start(self, k):
        r = float(self.restart_steps)
        if self.t_mul == 1.0:
            return r * k
        power = self.t_mul**k if isinstance(k, numbers.Real) else ops.power(self.t_mul, k)
        return r * (1.0 - power) / (1.0 - self.t_mul)

    def _count_last_cycle(self) -> int:
        """Index of the last cycle: the last one that fits entirely, or 0."""
        if self.restart_steps is None:
            return 0
        d = self._decay_steps
        if self.t_mul == 1.0:
            return max(int(d // self.restart_steps) - 1, 0)
        k = 0
        while self._cycle_start(k + 2) <= d:
            k += 1
        return k

    def cycle_starts(self) -> list[int]:
        """Steps (absolute) at which each cosine cycle starts, warmup end first.

        Example:
        >>> WarmupCosineDecay(1.0, 150, 10, restart_steps=20, t_mul=2.0).cycle_starts()
        [10, 30, 70]
        """
        if self.restart_steps is None:
            return [self.warmup_steps]
        return [self.warmup_steps + int(round(self._cycle_start(k))) for k in range(self._last_cycle + 1)]

    def _base(self, step):
        d = self._decay_steps
        t = ops.maximum(step - float(self.warmup_steps), 0.0)
        amp = self.peak_lr - self.min_lr
        if self.restart_steps is None:
            frac = ops.clip(t / (d if d > 0 else 1.0), 0.0, 1.0)
            height = amp
        else:
            r = float(self.restart_steps)
            if self.t_mul == 1.0:
                i = ops.floor(t / r)
            else:
                i = ops.floor(ops.log(1.0 - t / r * (1.0 - self.t_mul)) / math.log(self.t_mul))
            # Guard the float rounding of the closed form at cycle boundaries.
            i = ops.where(self._cycle_start(i) > t, i - 1.0, i)
            i = ops.where(self._cycle_start(i + 1.0) <= t, i + 1.0, i)
            i = ops.clip(i, 0.0, float(self._last_cycle))
            start = self._cycle_start(i)
            length = ops.where(
                i >= float(self._last_cycle), d - start, r * ops.power(self.t_mul, i)
            )
            frac = ops.clip((t - start) / ops.maximum(length, 1.0), 0.0, 1.0)
            height = amp * ops.power(self.m_mul, i)
        value = self.min_lr + height * 0.5 * (1.0 + ops.cos(math.pi * frac))
        return ops.where(step >= float(self.total_steps), self.min_lr, value)


@keras.saving.register_keras_serializable(package="trainwell")
class WarmupLinearDecay(_DecaySchedule):
    """Linear warmup, then linear decay to `min_lr` at `total_steps` (BERT style).

    The schedule of BERT (Devlin et al., 2019) and most transformer fine-tuning:
    from `warmup_start` up to `peak_lr` over `warmup_steps`, then a straight line
    down to `min_lr` at `total_steps`, held afterwards. Keras's `PolynomialDecay`
    (power 1) has neither warmup nor an LR multiplier, hence a new schedule.

    The value is multiplied by `self.multiplier` (a float32 `keras.Variable`,
    initially 1.0, not in `get_config()`).

    Args:
        peak_lr: LR at the end of warmup. Required.
        total_steps: Step at which the LR reaches `min_lr` (an int, or a float
            as `CosineDecay` takes). Required.
        warmup_steps: Length of the linear warmup, in steps. Defaults to `0`.
        min_lr: Final LR. Defaults to `0.0`.
        warmup_start: LR at step 0 when `warmup_steps > 0`; above `peak_lr`, the
            warmup goes down (as `CosineDecay` allows). Defaults to `0.0`.

    Example:
    >>> s = WarmupLinearDecay(peak_lr=2e-5, total_steps=1000, warmup_steps=100)
    >>> round(float(s(550)) / 2e-5, 4)
    0.5
    """

    def _base(self, step):
        d = float(self.total_steps - self.warmup_steps) or 1.0
        frac = ops.clip((step - float(self.warmup_steps)) / d, 0.0, 1.0)
        value = self.peak_lr - (self.peak_lr - self.min_lr) * frac
        return ops.where(step >= float(self.total_steps), self.min_lr, value)


@keras.saving.register_keras_serializable(package="trainwell")
class WarmupStepDecay(_WarmupSchedule):
    """Linear warmup, then the LR multiplied by `decay_rate` at each boundary.

    The ImageNet-in-an-hour recipe (Goyal et al., 2017): 5 epochs of warmup to
    the linearly scaled LR (`scaled_lr`), then x0.1 at epochs 30, 60 and 80, i.e.
    `boundaries=[30 * steps_per_epoch, 60 * steps_per_epoch, 80 * steps_per_epoch]`.
    Keras's `PiecewiseConstantDecay` takes explicit values, has no warmup and no
    LR multiplier, hence a new schedule.

    The value is multiplied by `self.multiplier` (a float32 `keras.Variable`,
    initially 1.0, not in `get_config()`).

    Args:
        peak_lr: LR at the end of warmup, until the first boundary. Required.
        boundaries: Increasing steps (absolute, >= `warmup_steps`) at which the
            LR is multiplied by `decay_rate`. Required.
        decay_rate: Factor applied at each boundary, in (0, 1]. Defaults to `0.1`.
        warmup_steps: Length of the linear warmup, in steps. Defaults to `0`.
        warmup_start: LR at step 0 when `warmup_steps > 0`; above `peak_lr`, the
            warmup goes down (as `CosineDecay` allows). Defaults to `0.0`.

    Example:
    >>> s = WarmupStepDecay(peak_lr=0.4, boundaries=[300, 600, 800], warmup_steps=50)
    >>> round(float(s(650)), 6)
    0.004
    """

    def __init__(
        self,
        peak_lr: float,
        boundaries: list[int],
        decay_rate: float = 0.1,
        warmup_steps: int | float = 0,
        warmup_start: float = 0.0,
    ) -> None:
        peak_lr = _check_peak(peak_lr)
        if (
            not isinstance(boundaries, (list, tuple))
            or not boundaries
            or not all(is_int(b) and b >= 1 for b in boundaries)
            or any(b2 <= b1 for b1, b2 in zip(boundaries, boundaries[1:]))
        ):
            raise invalid_argument("boundaries", "a non-empty, strictly increasing list of integer steps >= 1", boundaries)
        boundaries = [int(b) for b in boundaries]
        if not is_number(decay_rate) or not 0 < decay_rate <= 1:
            raise invalid_argument("decay_rate", "a float in (0, 1]", decay_rate)
        warmup_steps = _check_warmup(warmup_steps, boundaries[0], "the first boundary")
        warmup_start = _check_warmup_start(warmup_start)
        super().__init__(peak_lr, warmup_steps, warmup_start)
        self.boundaries = boundaries
        self.decay_rate = float(decay_rate)

    def _base(self, step):
        n = ops.zeros_like(step)
        for b in self.boundaries:
            n = n + ops.cast(step >= float(b), "float32")
        return self.peak_lr * ops.power(self.decay_rate, n)


# ---------------------------------------------------------------- helpers
def is_trainwell_schedule(obj: Any) -> bool:
    """Whether `obj` is one of this module's schedules (it has a multiplier).

    Example:
    >>> is_trainwell_schedule(WarmupLinearDecay(0.1, 10)), is_trainwell_schedule(0.1)
    (True, False)
    """
    return isinstance(obj, _WarmupSchedule)
