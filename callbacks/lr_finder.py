"""The LR range test (Smith 2017; fastai's `lr_find`): `LRFinder`, its suggesters, `lr_find`.

Why one module: the callback and the `lr_find` driver that runs the ramp and the
probes are one algorithm; what its curve says (the suggestion rules, the noise
judgement, `LRFindResult`) reads numbers only and is `trainwell.callbacks.lr_curve`,
whose public names this module re-exports; the command line's part
(`trainwell lr-find`, writing the config) is in `trainwell.cli`.

An exponential learning-rate ramp, from `start_lr` to `end_lr` over `steps`
steps, is run on the model itself; the (smoothed) loss against the LR shows where
training is fastest and where it diverges. Afterwards the model's weights (and
other variables: BatchNorm statistics, dropout seeds) and its optimizer state
(slots, `iterations`, the loss scale) are restored, so the test leaves no trace.
The curve's suggestions are fastai's: "valley" (half-way, in log LR, down the
longest descending stretch of the curve; fastai's default), "steep" (the steepest
descent) and "minimum" (a tenth of the LR at the minimum loss, fastai v1's and
Smith's "an order of magnitude below where the loss stops falling"); and
trainwell's "peak" (half the LR at the minimum loss), for the peak of a warmup +
decay schedule.

None of these is reliable across optimizers: the best constant LR lies far below
the LR at the test's loss minimum with Adam and near it with plain SGD, so no
fixed fraction of it fits all (`bench/lr_finder_quality.py`; figures in
bench/README.md).

Hence `lr_find`'s default, "probe": after the curve, short runs (`probe_steps`,
by default as many as the ramp) from the model's state at the curve's loss-minimum
LR times 3, 1, 1/3, 1/9, ... (high to low, stopping once two runs in a row end
worse than the best), and the LR whose run ended with the lowest training loss.
It costs 3 to 8 probe runs more than the curve alone. `trainwell lr-find` probes
with the recipes' warmup + cosine schedule and writes the best peak LR.
`LRFinder` (the callback, inside one `fit`) gives the curve's suggestions only.

Noise is not a suggestion: when the curve (or, with "probe", the best probe) did
not fall clearly below the starting loss (by `MIN_GAIN` of it and `NOISE_Z`
standard errors), or the probes cannot be told apart from each other,
`result.reliable` is `False` with the reason, `lr_find` warns, and `trainwell
lr-find` writes nothing and exits 1.

References: L. N. Smith, "Cyclical Learning Rates for Training Neural Networks",
WACV 2017; fastai `Learner.lr_find` and `valley`/`steep`/`minimum`
(fastai/callback/schedule.py).
"""

from __future__ import annotations

import contextlib
import math
import sys
import warnings
from typing import Any

import keras
import numpy as np

from trainwell import quick
from trainwell.callbacks.base import constructor_config
from trainwell.callbacks.lr_curve import (  # the public names re-exported: lr_finder is where users find them
    MIN_GAIN,
    NOISE_Z,
    SUGGESTERS,
    LRFindResult,
    _at_loss_minimum,
    _cut,
    _judge_curve,
    _mean_and_error,
    judge_probes,
    minimum,
    peak,
    steep,
    suggest,
    valley,
)
from trainwell.compat import (
    build_before_fit,
    inner_optimizer,
    keras_fixes,
    raw_learning_rate,
    set_raw_learning_rate,
    strategy_scope,
)
from trainwell.compat.learning_rate import live_schedule_variables
from trainwell.validation import invalid_argument, is_int, is_number

__all__ = ["LRFinder", "LRFindResult", "lr_find", "suggest", "valley", "steep", "minimum", "peak",
           "judge_probes", "METHODS", "PROBE_SCHEDULES", "MIN_GAIN", "NOISE_Z"]

# --------------------------------------------------------------------------- the probes
#: `lr_find`'s methods: the curve's suggestions, and "probe" (short runs around the
#: curve's loss minimum; see `lr_find`).
METHODS = (*SUGGESTERS, "probe")

#: The LR of a probe: constant, or the peak of a 10% warmup then cosine to 0.
PROBE_SCHEDULES = ("constant", "warmup_cosine")

#: Probes are `PROBE_FACTOR` apart, so the best lies within sqrt(3) of one of them.
PROBE_FACTOR = 3.0


# --------------------------------------------------------------------------- callback
def _ramp_lr(t, start, log_ratio, span):
    """The range test's LR at step `t` of the test: `start * exp(clip(t / span) * log_ratio)`."""
    return start * keras.ops.exp(keras.ops.clip(t / span, 0.0, 1.0) * log_ratio)


def _probe_lr(t, lr, warmup, steps):
    """A probe's warmup + cosine LR at step `t`: `lr` reached after `warmup` steps, 0 at `steps`."""
    ops = keras.ops
    rise = lr * ops.clip(t / warmup, 0.0, 1.0)
    fall = 0.5 * lr * (1.0 + ops.cos(math.pi * ops.clip((t - warmup) / (steps - warmup), 0.0, 1.0)))
    return ops.where(t < warmup, rise, fall)


class _PhaseLR(keras.optimizers.schedules.LearningRateSchedule):
    """The LR of one phase of the range test or a probe, counted from optimizer step `offset`.

    `kind` `"ramp"`: `start * (end / start) ** (t / (steps - 1))`, capped at `end`;
    `"constant"`: `start`; `"warmup_cosine"`: `start` as the peak of a linear
    warmup from 0 over `max(1, steps // 10)` steps then a half cosine to 0 at
    `steps`, the values of `WarmupCosineDecay(start, total_steps=steps,
    warmup_steps=...)` (the recipes' shape), in closed form: no `keras.Variable`
    created inside `fit`.

    With `model` the parameters are `keras.Variable`s (made in the model's
    distribution strategy scope, outside `fit`) and `set` changes them: where the
    traced train step reads them when it runs (`live_schedule_variables()`), the
    step traced for the range test serves every probe, where a schedule per phase
    cost one trace, and with XLA one compile, per probe. Without `model` they are
    constants, one schedule per phase.
    """

    _KINDS = ("ramp", "constant", "warmup_cosine")

    def __init__(self, kind: str = "ramp", start: float = 1.0, end: float = 1.0, steps: int = 2, offset: int = 0,
                 model=None) -> None:
        self._config = dict(kind=kind, start=start, end=end, steps=steps, offset=offset)
        values = self._values(**self._config)
        if model is None:
            vars(self).update(values)
            return
        with strategy_scope(model):
            for name, value in values.items():
                dtype = {"kind": "int32", "offset": "int64"}.get(name, "float32")
                setattr(self, name, keras.Variable(value, dtype=dtype, trainable=False))

    @classmethod
    def _values(cls, kind, start, end, steps, offset) -> dict[str, Any]:
        ramp = kind == "ramp"
        return dict(kind=cls._KINDS.index(kind), offset=int(offset), start=float(start),
                    log_ratio=math.log(end / start) if ramp else 0.0, span=float(max(steps - 1, 1)),
                    warmup=float(max(1, steps // 10)), steps=float(steps))

    def set(self, kind: str, start: float, end: float = 1.0, steps: int = 2, offset: int = 0) -> None:
        """Gives the variables the values of `_PhaseLR(kind, start, end, steps, offset)`."""
        for name, value in self._values(kind, start, end, steps, offset).items():
            getattr(self, name).assign(value)

    def __call__(self, step):
        ops = keras.ops
        step = ops.convert_to_tensor(step)
        t = ops.cast(step - ops.cast(self.offset, step.dtype), "float32")  # subtract in integers: exact past 2**24
        ramp = _ramp_lr(t, self.start, self.log_ratio, self.span)
        probe = ops.where(ops.equal(self.kind, 1), self.start * ops.ones_like(t),
                          _probe_lr(t, self.start, self.warmup, self.steps))
        return ops.cast(ops.where(ops.equal(self.kind, 0), ramp, probe), "float32")

    def get_config(self) -> dict[str, Any]:
        return dict(self._config)


class LRFinder(keras.callbacks.Callback):
    """Runs the LR range test inside a `fit` call, then puts the model back.

    At `on_train_begin` it snapshots every model variable (weights, BatchNorm
    statistics, seed state) and every optimizer variable (slots, `iterations`,
    loss scale; the optimizer is built first if it was not), and swaps the
    optimizer's learning rate for an exponential ramp from `start_lr` to `end_lr`
    over `steps` steps (a schedule on `iterations`, so no Python work per step).
    After each step it records the step's LR and loss, and a bias-corrected
    exponential moving average of the loss (`smooth`, fastai's 0.98). It stops
    the fit after `steps` steps, or when the smoothed loss is non-finite or above
    `diverge_factor` x its best. At `on_train_end` it restores the learning rate,
    the variables and the optimizer state, rebuilds the train function, and
    leaves the result in `self.result` (an `LRFindResult`; `result.reliable` is
    `False` when the curve never fell clearly below its start, beyond its noise).

    Why not a Keras built-in: `LearningRateScheduler` sets the LR once per epoch,
    and nothing in Keras records the loss per step against the LR or restores
    the model afterwards. Not a `StatefulCallback`: the test is not resumable and
    leaves no state to checkpoint.

    Args:
        start_lr: First learning rate. Defaults to `1e-7`.
        end_lr: Last learning rate. Defaults to `10.0`.
        steps: Number of steps of the ramp. Defaults to `100`.
        smooth: Smoothing factor of the loss's moving average, in [0, 1).
            Defaults to `0.98`.
        diverge_factor: Stop when the smoothed loss exceeds this factor times
            its best; `None` never stops early. Defaults to `4.0`.
        restore: Restore weights and optimizer state at the end. Defaults to `True`.
        method: The suggestion that becomes `result.suggestion`: `"minimum"`,
            `"steep"`, `"valley"` or `"peak"` (see the module docstring).
            Defaults to `"minimum"`.

    Example:
    >>> keras.utils.set_random_seed(0)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(keras.optimizers.SGD(), "mse")
    >>> x = np.random.default_rng(0).normal(size=(640, 4)).astype("float32")
    >>> finder = LRFinder(start_lr=1e-4, end_lr=10.0, steps=20)
    >>> _ = model.fit(x, x.sum(1), batch_size=32, epochs=1, verbose=0, callbacks=[finder])
    >>> # "minimum": a tenth of the LR at the smoothed loss's minimum, so within [start_lr, end_lr] / 10
    >>> 1e-5 <= finder.result.suggestion <= 1.0
    True
    """

    #: Set by `lr_find` where one traced step serves every phase: the schedule all its phases
    #: share (see `_PhaseLR`); `None`: this callback installs its own schedule and puts the model's back.
    _shared_lr: "_PhaseLR | None" = None

    def __init__(
        self,
        start_lr: float = 1e-7,
        end_lr: float = 10.0,
        steps: int = 100,
        smooth: float = 0.98,
        diverge_factor: float | None = 4.0,
        restore: bool = True,
        method: str = "minimum",
    ) -> None:
        super().__init__()
        if not is_number(start_lr) or start_lr <= 0:
            raise invalid_argument("start_lr", "a float > 0", start_lr)
        if not is_number(end_lr) or end_lr <= start_lr:
            raise invalid_argument("end_lr", f"a float > start_lr ({start_lr})", end_lr)
        if not is_int(steps) or steps < 2:
            raise invalid_argument("steps", "an integer >= 2", steps)
        if not is_number(smooth) or not 0.0 <= smooth < 1.0:
            raise invalid_argument("smooth", "a float in [0, 1)", smooth)
        if diverge_factor is not None and (not is_number(diverge_factor) or diverge_factor <= 1.0):
            raise invalid_argument("diverge_factor", "None or a float > 1", diverge_factor)
        if not isinstance(restore, bool):
            raise invalid_argument("restore", "a bool", restore)
        if method not in SUGGESTERS:
            raise invalid_argument("method", f"one of {tuple(SUGGESTERS)}", method)
        self.start_lr = float(start_lr)
        self.end_lr = float(end_lr)
        self.steps = int(steps)
        self.smooth = float(smooth)
        self.diverge_factor = None if diverge_factor is None else float(diverge_factor)
        self.restore = restore
        self.method = method
        self.result: LRFindResult | None = None

    def get_config(self) -> dict[str, Any]:
        """Returns the constructor arguments."""
        return constructor_config(self)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "LRFinder":
        return cls(**config)

    def lr_at(self, i: int) -> float:
        """The LR of ramp step `i` (0-based).

        Example:
        >>> round(LRFinder(start_lr=1e-3, end_lr=1e-1, steps=3).lr_at(1), 6)
        0.01
        """
        t = min(max(i / max(self.steps - 1, 1), 0.0), 1.0)
        return self.start_lr * math.exp(t * math.log(self.end_lr / self.start_lr))

    def _phase(self, offset: int) -> dict[str, Any]:
        """The LR during the test from optimizer step `offset`: the arguments of a `_PhaseLR`."""
        return dict(kind="ramp", start=self.start_lr, end=self.end_lr, steps=self.steps, offset=offset)

    # ---------------------------------------------------------------- hooks
    def on_train_begin(self, logs=None) -> None:
        model = self.model
        opt = getattr(model, "optimizer", None)
        if opt is None:
            raise ValueError("LRFinder needs a compiled model with an optimizer. Received: optimizer=None")
        inner = inner_optimizer(opt)
        if not getattr(opt, "built", False):
            opt.build(model.trainable_variables)
        self._vars = list(model.variables) + list(opt.variables)
        self._saved = [v.numpy() for v in self._vars] if self.restore else None
        self._inner = inner
        phase = self._phase(int(inner.iterations.numpy()))
        if self._shared_lr is not None:
            self._shared_lr.set(**phase)
        else:
            self._orig_lr = set_raw_learning_rate(inner, _PhaseLR(**phase))
            _retrace(model)
        self._lrs: list[float] = []
        self._raw: list[float] = []
        self._smoothed: list[float] = []
        self._avg, self._best, self._worst = 0.0, math.inf, -math.inf
        self._prev_mean, self._prev_batch = None, -1
        self._stopped = "data"

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self._prev_mean, self._prev_batch = None, -1

    def on_train_batch_end(self, batch, logs=None) -> None:
        mean = float((logs or {}).get("loss", math.nan))
        if self._prev_mean is None or batch <= self._prev_batch:
            loss = mean
        else:
            loss = ((batch + 1) * mean - (self._prev_batch + 1) * self._prev_mean) / max(batch - self._prev_batch, 1)
        self._prev_mean, self._prev_batch = mean, int(batch)
        i = len(self._raw)
        self._lrs.append(self.lr_at(i))
        self._raw.append(loss)
        if math.isfinite(loss):
            self._avg = self.smooth * self._avg + (1.0 - self.smooth) * loss
            sm = self._avg / (1.0 - self.smooth ** (i + 1))
        else:
            sm = math.nan
        self._smoothed.append(sm)
        if math.isfinite(sm):
            self._best, self._worst = min(self._best, sm), max(self._worst, sm)
        if not math.isfinite(sm) or (self.diverge_factor is not None and self._rose_too_far(sm)):
            self._stopped = "diverged"
        elif len(self._raw) >= self.steps:
            self._stopped = "steps"
        if self._stopped != "data":
            self.model.stop_training = True

    def _rose_too_far(self, sm: float) -> bool:
        """fastai's `sm > diverge_factor * best`, for losses above 0. Where the best is
        at or below 0 (Keras's CosineSimilarity, log-likelihoods) `factor * best` is no
        bound, so the rise allowed is `diverge_factor - 1` times the larger of `|best|`
        and the curve's range so far: no stop on the noise of a loss that starts near 0."""
        if self._best > 0:
            return sm > self.diverge_factor * self._best
        scale = max(abs(self._best), self._worst - self._best)
        return sm - self._best > (self.diverge_factor - 1.0) * scale

    def _put_back(self) -> None:
        """Restores the learning rate and, with `restore`, every variable; rebuilds `fit`'s
        step (it was traced with the test's schedule). Idempotent: a second call does nothing."""
        if getattr(self, "_inner", None) is None:
            return
        if self.restore:
            for v, value in zip(self._vars, self._saved):
                v.assign(value)
        if self._shared_lr is None:  # else `lr_find` puts its schedule back itself
            set_raw_learning_rate(self._inner, self._orig_lr)
            _retrace(self.model)
        self._inner = self._saved = None

    def on_train_end(self, logs=None) -> None:
        self._put_back()
        sugg = suggest(self._lrs, self._smoothed, self.steps)
        start, start_se = _mean_and_error(self._raw[: max(5, self.steps // 10)])
        reason = _judge_curve(self._raw, self._smoothed, start, start_se, self.smooth) if sugg else None
        self.result = LRFindResult(
            lrs=list(self._lrs),
            losses=list(self._smoothed),
            raw_losses=list(self._raw),
            suggestion=sugg.get(self.method),
            suggestions=sugg,
            stopped=self._stopped,
            method=self.method,
            start_loss=start if math.isfinite(start) else None,
            start_noise=start_se if math.isfinite(start_se) else None,
            reliable=reason is None,
            reason=reason,
        )


class _LRProbe(LRFinder):
    """One short run at one LR from the model's current state, which is restored
    afterwards (`LRFinder`'s snapshot); `score()` is its final training loss."""

    def __init__(self, lr: float, steps: int, shape: str, smooth: float, diverge_factor: float | None) -> None:
        super().__init__(start_lr=lr, end_lr=2.0 * lr, steps=steps, smooth=smooth, diverge_factor=diverge_factor)
        self.lr, self.shape = float(lr), shape

    def _phase(self, offset: int) -> dict[str, Any]:
        return dict(kind=self.shape, start=self.lr, steps=self.steps, offset=offset)

    def lr_at(self, i: int) -> float:
        return self.lr  # the probe's nominal (peak) LR

    def on_train_end(self, logs=None) -> None:
        self._put_back()

    def _tail(self) -> list[float] | None:
        """The losses of the last quarter of the steps (at least 10); `None` if it diverged."""
        raw = self._raw
        if self._stopped == "diverged" or not raw:
            return None
        tail = raw[-min(len(raw), max(10, self.steps // 4)):]
        return tail if all(math.isfinite(x) for x in tail) else None

    def score(self) -> float:
        """Mean loss over the last quarter of the steps (at least 10); inf if it diverged."""
        tail = self._tail()
        return math.inf if tail is None else float(np.mean(tail))

    def noise(self) -> float:
        """The standard error of `score()` (`nan` if it diverged)."""
        tail = self._tail()
        return math.nan if tail is None else _mean_and_error(tail)[1]


def compiled_schedule_shape(model) -> str:
    """The probe schedule matching how `model` is compiled: `"warmup_cosine"` or `"constant"`.

    `"warmup_cosine"` when the optimizer's (inner, under loss scaling) learning
    rate is a `keras.optimizers.schedules.LearningRateSchedule`, `"constant"` for a
    plain float. `lr_find`'s default `probe_schedule`.

    Example:
    >>> m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> m.compile(keras.optimizers.SGD(keras.optimizers.schedules.CosineDecay(0.1, 100)), "mse")
    >>> compiled_schedule_shape(m)
    'warmup_cosine'
    """
    opt = getattr(model, "optimizer", None)
    if opt is None:
        raise invalid_argument("model", "a compiled model (call `model.compile` first)", model)
    lr = raw_learning_rate(opt)
    return "warmup_cosine" if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule) else "constant"


def _is_dataset(data) -> bool:
    tf = sys.modules.get("tensorflow")  # a tf.data.Dataset exists only once TensorFlow is loaded: never load it here
    return tf is not None and isinstance(data, tf.data.Dataset)


def _is_one_shot(data) -> bool:
    """A generator or other iterator: what the range test reads is gone for the probes."""
    if _is_dataset(data) or isinstance(data, (tuple, list, dict, keras.utils.PyDataset)):
        return False
    try:
        return iter(data) is data
    except TypeError:
        return False


def _in_fixed_order(data, seed: int = 0):
    """Arrays `(x, y[, sample_weight])` permuted once, for the probes; other data as it is.

    With `fit(..., shuffle=False)` on the permuted copy every probe sees the same
    batches in the same order, so two probes differ by their LR and not by their
    shuffle (common random numbers). Returns `(data, fixed)`; `fixed` is whether
    the order is fixed. A `tf.data.Dataset` or `PyDataset` keeps its own order.
    """
    if isinstance(data, (tuple, list)) and 2 <= len(data) <= 3:
        n = len(keras.tree.flatten(data[0])[0])
        perm = np.random.default_rng(seed).permutation(n)
        take = lambda a: None if a is None else np.asarray(a)[perm]  # noqa: E731
        return tuple(keras.tree.map_structure(take, part) for part in data), True
    return data, False


class _Progress(keras.callbacks.Callback):
    """Progress of a range test or a probe: a title line, then a `keras.utils.Progbar`
    over its own steps (not `fit`'s epochs) with the smoothed loss and the LR.
    `verbose=1` a bar, `verbose=2` one line at its end (as Keras's `fit`)."""

    def __init__(self, finder: "LRFinder", title: str, verbose: int) -> None:
        super().__init__()
        self.finder, self.title, self.verbose = finder, title, verbose

    def on_train_begin(self, logs=None) -> None:
        print(self.title, flush=True)
        self.bar = keras.utils.Progbar(self.finder.steps, verbose=self.verbose, stateful_metrics=("loss", "lr"))

    def _values(self) -> list[tuple[str, float]]:
        f = self.finder
        return [("loss", f._smoothed[-1]), ("lr", f._lrs[-1])] if f._raw else []

    def on_train_batch_end(self, batch, logs=None) -> None:
        self.bar.update(len(self.finder._raw), self._values())

    def on_train_end(self, logs=None) -> None:
        if len(self.finder._raw) < self.finder.steps:  # stopped early (diverged): close the bar where it is
            self.bar.update(len(self.finder._raw), self._values(), finalize=True)


def _fit_steps(model, data, callback, steps: int, batch_size, verbose, shuffle: bool = True,
               title: str | None = None) -> None:
    """`fit` for about `steps` steps with `callback` (which stops it); with `verbose`,
    `title` and a progress bar over those steps."""
    callbacks = [callback] + ([_Progress(callback, title or "", verbose)] if verbose else [])
    fit_kw: dict[str, Any] = {"callbacks": callbacks, "verbose": 0}
    if _is_dataset(data):  # `fit` ignores `shuffle` for a dataset, and warns unless it is False
        build_before_fit(model, data)  # TensorFlow: one trace of the train step, not two
        model.fit(data.repeat(), epochs=1, steps_per_epoch=steps, shuffle=False, **fit_kw)
    elif isinstance(data, (tuple, list)) and 2 <= len(data) <= 3:
        x, y = data[0], data[1]
        sw = data[2] if len(data) == 3 else None
        n = len(keras.tree.flatten(x)[0])
        bs = batch_size or 32
        per_epoch = max(math.ceil(n / bs), 1)
        model.fit(x, y, sample_weight=sw, batch_size=bs, epochs=math.ceil(steps / per_epoch), shuffle=shuffle,
                  **fit_kw)
    else:
        try:
            per_epoch = len(data)
        except TypeError:
            per_epoch = None
        if per_epoch:
            model.fit(data, epochs=math.ceil(steps / per_epoch), **fit_kw)
        else:
            model.fit(data, epochs=1, steps_per_epoch=steps, **fit_kw)


# --------------------------------------------------------------------------- function
#: What to try when the suggestion is not reliable (`lr_find` warns with it).
ADVICE = ("Try longer probes (`probe_steps`), a lower start LR, or check the data and labels "
          "(a model must be able to fit one batch).")


def lr_find(  # one piece: its docstring is most of it; the body checks, runs the range test, then the probes
    model,
    data,
    start_lr: float = 1e-7,
    end_lr: float = 10.0,
    steps: int = 100,
    smooth: float = 0.98,
    diverge_factor: float | None = 4.0,
    batch_size: int | None = None,
    restore: bool = True,
    verbose: int = 0,
    method: str | None = None,
    probe_steps: int | None = None,
    probe_schedule: str | None = None,
) -> LRFindResult:
    """Runs the LR range test on a compiled model and returns the curve and suggestions.

    The model's weights and optimizer state are restored afterwards (see
    `LRFinder`), so it can be trained straight after with the suggested LR.

    `method="probe"` goes one step further than the curve. The LR at the curve's
    loss minimum is where a ramp of `steps` steps stops gaining, which is not where
    a run at that LR does best: the best LR of a short run lies below it by a
    factor that depends on the optimizer (Adam far below, plain SGD near it;
    `bench/lr_finder_quality.py`). So "probe" then makes short runs (`probe_steps`
    each, from the model's state, restored after each) at that LR times
    3, 1, 1/3, 1/9, ... (down to 1/729), from high to low, stops after two runs in
    a row end above the best, and suggests the LR whose run ended with the lowest
    training loss (the mean over its last quarter). It costs `steps` plus 3 to 8
    times `probe_steps` steps. The best LR of a short run need not be the best of
    a long one, so make `probe_steps` as long as you can afford; with `probe_schedule=
    "warmup_cosine"` each probe runs the recipes' schedule (10% warmup, cosine to
    0) with the LR as its peak. With array data every probe sees the same batches
    in the same order (a permuted copy of the arrays, made once), so probes differ
    by their LR only; a `tf.data.Dataset` or `PyDataset` keeps its own order.
    On TensorFlow the range test and every probe run one traced (with XLA,
    compiled) step: their LRs come from one schedule of variables (`_PhaseLR`),
    where a schedule per phase cost a trace per probe. On JAX each phase traces its own.

    Args:
        model: A compiled Keras model. Required.
        data: A `tf.data.Dataset` of batches (repeated as needed), a tuple
            `(x, y)` / `(x, y, sample_weight)` of arrays, or anything else
            `fit` accepts (a `PyDataset`, a generator). Required.
        start_lr: First learning rate. Defaults to `1e-7`.
        end_lr: Last learning rate. Defaults to `10.0`.
        steps: Steps of the exponential ramp. Defaults to `100`.
        smooth: Smoothing of the loss curve. Defaults to `0.98`.
        diverge_factor: Stop when the smoothed loss exceeds this factor times its
            best. Defaults to `4.0`.
        batch_size: Batch size for array data. Defaults to `None` (Keras's 32).
        restore: Restore the weights and optimizer state. Defaults to `True`.
        verbose: `0` silent, `1` a progress bar over the range test's steps and
            then over each probe's (with a title line each), `2` one line per
            phase at its end. Defaults to `0`.
        method: Which suggestion is `result.suggestion`: `"minimum"`,
            `"steep"`, `"valley"` (fastai's), `"peak"` (for a schedule's peak) or
            `"probe"` (short runs, above). Defaults to `None`: `"probe"`, or
            `"minimum"` where probing cannot work (`restore=False`, or `data` a
            one-shot iterator such as a generator, which the range test uses up).
        probe_steps: Steps of each probe. Defaults to `None` (`steps`).
        probe_schedule: The LR during a probe: `"constant"` or `"warmup_cosine"`
            (the LR as the peak). Defaults to `None`: the shape the model is
            compiled with, `"warmup_cosine"` when its optimizer's learning rate is
            a `LearningRateSchedule` (the suggestion is then a peak LR), else
            `"constant"`.

    Returns:
        An `LRFindResult`: `.suggestion`, `.suggestions`, `.lrs`, `.losses`,
        `.probes`, `.plot(path)`, and `.reliable`/`.reason`. When the loss the
        suggestion rests on cannot be told apart from the starting loss (the
        probes, or with a curve method the curve, did not learn beyond their
        noise), or the probes not from each other, `.reliable` is `False`,
        `.reason` says why with the numbers, and a `UserWarning` says what to
        try; `.suggestion` is still the best measured (like fastai's, which always
        returns a number), so check `.reliable` before using it.

    Example:
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(keras.optimizers.SGD(), "mse")
    >>> x = np.random.default_rng(0).normal(size=(512, 4)).astype("float32")
    >>> result = lr_find(model, (x, x.sum(1)), start_lr=1e-4, steps=30)
    >>> result.stopped in ("diverged", "steps")
    True
    """
    one_shot = _is_one_shot(data)
    if method is None:
        method = "probe" if restore and not one_shot else "minimum"
    if method not in METHODS:
        raise invalid_argument("method", f"one of {METHODS}", method)
    if probe_schedule is not None and probe_schedule not in PROBE_SCHEDULES:
        raise invalid_argument("probe_schedule", f"None or one of {PROBE_SCHEDULES}", probe_schedule)
    if probe_steps is not None and (not is_int(probe_steps) or probe_steps < 2):
        raise invalid_argument("probe_steps", "None or an integer >= 2", probe_steps)
    if method == "probe" and not restore:
        raise invalid_argument("restore", "True with method='probe' (each probe starts from the model's state)", restore)
    if method == "probe" and one_shot:
        raise invalid_argument("data", "data that can be iterated again with method='probe' (a tf.data.Dataset, arrays, "
                       "a PyDataset), or method='minimum'", data)
    steps, probe_steps = quick.lr_find_steps(steps, probe_steps)  # TRAINWELL_QUICK: a short range test and probes
    if method == "probe" and getattr(model, "optimizer", None) is not None:
        probe_schedule = probe_schedule or compiled_schedule_shape(model)  # before `_one_trace` swaps the LR
    finder = LRFinder(start_lr, end_lr, steps, smooth, diverge_factor, restore, "minimum" if method == "probe" else method)
    # Up to 9 `fit`s of one model: under a strategy, Keras's TensorFlow trainer would draw and
    # drop a batch at the start of each, which TensorFlow sometimes answers with a segfault.
    keras_fixes.apply_for_backend("symbolic_build")
    with _one_trace(model) as shared_lr:
        finder._shared_lr = shared_lr
        try:
            _fit_steps(model, data, finder, steps, batch_size, verbose,
                       title=f"LR range test: {steps} steps, LR {start_lr:.3g} to {end_lr:.3g}")
        finally:  # `fit` skips `on_train_end` when it raises: put the model back all the same
            finder._put_back()
        result = finder.result
        if method == "probe" and result is not None:
            _run_probes(result, model, data, steps, probe_steps, probe_schedule, batch_size, smooth, diverge_factor,
                        verbose, shared_lr)
    if result is not None and not result.reliable:
        warnings.warn(f"No reliable learning rate: {result.reason}. {ADVICE}", stacklevel=2)
    return result


@contextlib.contextmanager
def _one_trace(model):
    """Installs a `_PhaseLR` of variables for all of `lr_find`'s phases and yields it where
    a traced step reads them as it runs (`live_schedule_variables()`; else `None`: each phase
    installs its own schedule); puts the model's own learning rate back at the end, and
    drops the train function traced with the test's one."""
    opt = getattr(model, "optimizer", None)
    if not live_schedule_variables() or opt is None or not model.built:
        yield None
        return
    if not getattr(opt, "built", False):
        opt.build(model.trainable_variables)
    inner = inner_optimizer(opt)
    shared = _PhaseLR(model=model)
    orig = set_raw_learning_rate(inner, shared)
    _retrace(model)
    try:
        yield shared
    finally:
        set_raw_learning_rate(inner, orig)
        _retrace(model)


def _retrace(model) -> None:
    """Drops `fit`'s traced train step, which holds the learning-rate schedule it was traced with."""
    if getattr(model, "train_function", None) is not None:
        model.make_train_function(force=True)


def _run_probes(result: LRFindResult, model, data, steps, probe_steps, probe_schedule, batch_size, smooth,
                diverge_factor, verbose, shared_lr: _PhaseLR | None = None) -> None:
    """`lr_find`'s probes after the range test; fills `result` in place.

    Short runs at the curve's loss-minimum LR times `PROBE_FACTOR ** k`, k = 1, 0,
    ..., -6, from high to low; stops after two runs in a row that end above the best.
    """
    cut_l, cut_x = _cut(result.lrs, result.losses, steps)
    if not cut_x:
        return
    center, _ = _at_loss_minimum(cut_l, cut_x, 1.0)
    n = int(probe_steps or steps)
    probes: dict[float, float] = {}
    noise: dict[float, float] = {}
    best, worse = None, 0
    data, fixed = _in_fixed_order(data)
    powers = range(1, -7, -1)
    for i, k in enumerate(powers):
        lr = center * PROBE_FACTOR**k
        probe = _LRProbe(lr, n, probe_schedule, smooth, diverge_factor)
        probe._shared_lr = shared_lr
        title = f"Probe {i + 1} (of at most {len(powers)}): LR {lr:.3g}, {n} steps, {probe_schedule}"
        try:
            _fit_steps(model, data, probe, n, batch_size, verbose, shuffle=not fixed, title=title)
        finally:  # `fit` skips `on_train_end` when it raises: put the model back all the same
            probe._put_back()
        probes[lr], noise[lr] = probe.score(), probe.noise()
        if math.isfinite(probes[lr]) and (best is None or probes[lr] < probes[best]):
            best, worse = lr, 0
        elif best is not None:
            worse += 1
            if worse >= 2:
                break
    result.probes, result.probe_noise = probes, noise
    result.probe_steps, result.probe_schedule = n, probe_schedule
    nan_if_none = lambda v: math.nan if v is None else v  # noqa: E731
    result.reason = judge_probes(nan_if_none(result.start_loss), nan_if_none(result.start_noise), probes, noise)
    result.reliable = result.reason is None
    if best is None:
        result.reason += "; falling back to the range test's 'minimum' suggestion"
        return
    if best == min(probes) and len(probes) == len(powers):
        warnings.warn(f"The best probe was the lowest LR tried ({best:.3g}, 1/729 of the range test's loss "
                      "minimum): the best LR may be lower still.", stacklevel=3)
    result.suggestions["probe"] = best
    result.suggestion, result.method = best, "probe"
