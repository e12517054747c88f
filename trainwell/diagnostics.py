"""Training diagnostics: findings, the rules that produce them, and the gradient probe.

`trainwell.callbacks.TrainingDoctor` is the callback that runs these during `fit`.
This module holds the parts that do not need a running `fit`:

- `Finding`, the record of one diagnosed problem (a code, a severity, the evidence
  in numbers, likely causes and concrete fixes).
- `LossTracker`, the per-step loss history the loss rules read (recovered from the
  epoch's running mean that Keras passes to batch callbacks).
- The rules, pure functions of numbers (`check_divergence`, `check_oscillation`,
  `check_slow_convergence`, `check_gradients`, `check_dead_units`,
  `check_overfitting`, `check_input_bound`, `check_amp`): each returns a
  `Finding` or `None`, so each can be tested on constructed numbers.
- `GradientProbe`, a compiled function that computes gradient and activation
  statistics of a model on a fixed batch without touching its `train_step`, its
  weights, its metrics or its random state, and names the first layer that
  produced a non-finite value (forward or backward).

The thresholds are in `DEFAULT_THRESHOLDS`, each with the reason for its value.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from typing import Any, Iterable, Sequence

#: The finding codes, in the order a summary lists them.
CODES = (
    "divergence",
    "exploding_gradients",
    "amp_instability",
    "oscillation",
    "vanishing_gradients",
    "dead_units",
    "slow_convergence",
    "overfitting",
    "input_bound",
)

SEVERITIES = ("info", "warning", "error")

#: Default thresholds of the rules. Override any of them with
#: `TrainingDoctor(thresholds={...})`.
DEFAULT_THRESHOLDS: dict[str, float] = {
    # divergence: the recent median loss above `diverge_factor` x its best (fastai's
    # LR finder stops at 4x the best smoothed loss), above the initial loss, and a
    # new high (twice any earlier level), so that an oscillation that comes back
    # down is not called a divergence.
    "diverge_factor": 4.0,
    # oscillation: on 5-step medians, a swing counts when it moves by at least
    # `oscillation_swing` x the initial loss and by a factor `oscillation_ratio`;
    # `oscillation_peaks` peaks (a rise then a fall) within the window. Minibatch
    # noise near a low loss swings by factors of 2-4 but rarely by 0.4 x the
    # initial loss (at most 2 such peaks in 200 steps, measured on small MLPs with
    # batch 8-32 and SGD/Adam); momentum 0.99 sends the loss back up to about its
    # initial value again and again (4-6 such peaks in 200 steps).
    # A swing must also stand out of the minibatch noise: at least
    # `oscillation_noise_z` x the noise of a 5-step median (`chunk_noise`). Measured by
    # replaying the rule on the per-step losses of the runs of bench/doctor_zoo.py:
    # single noise swings of healthy runs with batch 2-4 reach 4.7-4.8 x (at x4 such a
    # run counts at most one peak, at x0 two), the swings of the heavy-momentum runs
    # 4.2-28 x (3-10 peaks).
    "oscillation_swing": 0.4,
    "oscillation_ratio": 1.5,
    "oscillation_peaks": 3,
    "oscillation_noise_z": 4.0,
    # The probe batch's loss (no sampling noise) confirms an oscillation where the
    # probes sample it at least twice per period: one probe loss `oscillation_probe_rise`
    # x the one before.
    "oscillation_probe_rise": 1.5,
    # slow convergence: after `window` steps the loss is less than
    # `slow_progress` below its initial value; a plateau: over the last two windows
    # less than `plateau_progress` improvement while above `plateau_level` x the
    # initial loss. Neither below `slow_level` x the null-model loss (the loss of
    # predicting the batch-mean output): that model has learned already.
    "slow_progress": 0.05,
    "plateau_progress": 0.01,
    "plateau_level": 0.5,
    "slow_level": 0.5,
    # update-to-weight ratio per step below this is "LR too low" evidence
    # (about 1e-3 is the usual healthy value; Karpathy, CS231n notes).
    "update_ratio_low": 1e-5,
    # vanishing: per-parameter RMS gradient of the first weighted layer below
    # `vanish_ratio` x that of the last one.
    "vanish_ratio": 1e-4,
    # exploding: a layer whose gradient norm exceeds `explode_ratio` x its weight
    # norm (one SGD step at LR 0.01 would change it by more than the weights
    # themselves), or a global gradient norm `explode_growth` x its first value.
    "explode_ratio": 100.0,
    "explode_growth": 100.0,
    # dead units: a ReLU layer (>= 8 units) with more than this fraction of its
    # units zero for every example of the probe batch, at two probes in a row.
    "dead_fraction": 0.6,
    # overfitting: validation loss `overfit_rise` above its best (on average over
    # the last `overfit_patience` epochs, at least that many epochs after the best)
    # while the training loss kept falling and is `overfit_gap` x below the
    # validation loss (epoch-to-epoch noise of a well-fit model moves the
    # validation loss by 10-20% with no gap).
    "overfit_rise": 0.1,
    "overfit_patience": 2,
    "overfit_gap": 0.2,
    # input bound: the median step spends this fraction waiting for data, and
    # at least `input_wait_ms` per step (tiny models have ~1 ms of Python
    # overhead per step that is not data waiting).
    "input_wait_fraction": 0.4,
    "input_wait_ms": 3.0,
    # amp: the loss scale backed off on more than this fraction of the last
    # `window` steps (at least `amp_min_backoffs` times), or fell below
    # `amp_min_scale` (float16 then cannot hold the gradients). A LossScaleOptimizer
    # starts at 2**15 and halves on overflow until it finds its level (a few
    # back-offs at the start are normal), then doubles after 2000 good steps and
    # backs off about once per 2000 steps.
    "amp_overflow_rate": 0.05,
    "amp_min_backoffs": 8,
    "amp_min_scale": 1.0,
}


# --------------------------------------------------------------------------- Finding
@dataclasses.dataclass
class Finding:
    """One diagnosed training problem.

    Args:
        code: One of `CODES`, e.g. `"divergence"`.
        severity: `"info"`, `"warning"` or `"error"`.
        evidence: The numbers behind the diagnosis (a layer name where one is
            named), e.g. `{"loss": 812.0, "best_loss": 0.41}`.
        fixes: Concrete changes to try, most likely first.
        step: The training step (batches since the run began) at diagnosis.
        causes: Likely causes, most likely first. Defaults to `[]`.
        summary: One line that says what was seen. Defaults to `""`.

    Example:
    >>> f = Finding("divergence", "error", {"loss": float("nan")}, ["lower the LR"], 12)
    >>> Finding.from_dict(f.to_dict()).code
    'divergence'
    """

    code: str
    severity: str
    evidence: dict[str, Any]
    fixes: list[str]
    step: int
    causes: list[str] = dataclasses.field(default_factory=list)
    summary: str = ""

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ValueError(f"Invalid value for argument `code`. Expected one of {CODES}. Received: code={self.code!r}")
        if self.severity not in SEVERITIES:
            raise ValueError(
                f"Invalid value for argument `severity`. Expected one of {SEVERITIES}. "
                f"Received: severity={self.severity!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (non-finite numbers become strings)."""
        return {
            "code": self.code,
            "severity": self.severity,
            "evidence": {k: _jsonable(v) for k, v in self.evidence.items()},
            "fixes": list(self.fixes),
            "step": int(self.step),
            "causes": list(self.causes),
            "summary": self.summary,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Finding":
        """Inverse of `to_dict`."""
        return cls(
            code=d["code"],
            severity=d["severity"],
            evidence={k: _unjson(v) for k, v in dict(d.get("evidence") or {}).items()},
            fixes=list(d.get("fixes") or []),
            step=int(d.get("step", 0)),
            causes=list(d.get("causes") or []),
            summary=str(d.get("summary") or ""),
        )

    def line(self) -> str:
        """One printable line: severity, code, step, what was seen, the first fix."""
        fix = f" Fix: {self.fixes[0]}" if self.fixes else ""
        return f"[{self.severity}] {self.code} at step {self.step}: {self.summary}{fix}"


def _jsonable(v: Any) -> Any:
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, (int,)) and not isinstance(v, bool):
        return int(v)
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    if math.isfinite(f):
        return f
    return "nan" if math.isnan(f) else ("inf" if f > 0 else "-inf")


def _unjson(v: Any) -> Any:
    if v in ("nan", "inf", "-inf"):
        return float(v)
    return v


def _fmt(x: float) -> str:
    if x is None:
        return "n/a"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.3g}"


def _median(xs: Iterable[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return statistics.median(xs) if xs else math.nan


# --------------------------------------------------------------------------- loss history
class LossTracker:
    """Per-step losses recovered from Keras's running epoch mean, with summaries.

    Keras passes batch callbacks `logs["loss"]`, the mean over the epoch so far
    (sample-weighted by batch size). With equal batches the loss of batch `b`
    (0-based in the epoch) is `(b + 1) * m_b - (b_prev + 1) * m_prev`, divided by
    the number of batches in between (`steps_per_execution > 1`).

    Args:
        window: Number of recent step losses kept. Defaults to `200`.
        chunk: Steps averaged into one point of the chunk series the
            oscillation rule reads. Defaults to `5`.

    Example:
    >>> t = LossTracker(window=10)
    >>> for b, m in enumerate([4.0, 3.0, 2.5]):   # running means of 4, 2, 1.5
    ...     _ = t.update_from_running_mean(b, m)
    >>> t.recent()
    [4.0, 2.0, 1.5]
    """

    def __init__(self, window: int = 200, chunk: int = 5) -> None:
        self.window = int(window)
        self.chunk = int(chunk)
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.first: list[float] = []           # first 10 finite step losses
        self.losses: deque[float] = deque(maxlen=self.window)
        self.chunks: deque[float] = deque(maxlen=max(4, self.window // self.chunk))
        self._chunk_buf: list[float] = []
        self.best_median = math.inf            # best median of 10 consecutive losses
        self.high_water = -math.inf            # highest 10-step median before the last 10
        self.nonfinite_steps = 0
        self._prev_mean: float | None = None
        self._prev_batch = -1
        self._history_medians: deque[float] = deque(maxlen=10)

    # ------------------------------------------------------------ updates
    def new_epoch(self) -> None:
        self._prev_mean = None
        self._prev_batch = -1

    def update_from_running_mean(self, batch: int, mean: float) -> float:
        """Records the running mean after `batch`; returns the recovered step loss."""
        mean = float(mean)
        n = batch - self._prev_batch
        if self._prev_mean is None or batch <= self._prev_batch:
            loss = mean
            n = batch + 1 if self._prev_mean is None else 1
        else:
            loss = ((batch + 1) * mean - (self._prev_batch + 1) * self._prev_mean) / max(n, 1)
        self._prev_mean, self._prev_batch = mean, batch
        if not math.isfinite(loss) and math.isfinite(mean):
            loss = mean
        self.add(loss, max(int(n), 1))
        return loss

    def add(self, loss: float, n: int = 1) -> None:
        """Records the loss of the last `n` steps (their mean)."""
        self.steps += n
        if not math.isfinite(loss):
            self.nonfinite_steps += n
        self.losses.append(loss)
        if math.isfinite(loss) and len(self.first) < 10:
            self.first.append(loss)
        self._chunk_buf.append(loss)
        if len(self._chunk_buf) >= self.chunk:
            self.chunks.append(_median(self._chunk_buf) if any(map(math.isfinite, self._chunk_buf)) else math.nan)
            self._chunk_buf = []
        if len(self.losses) >= 10:
            med = self.recent_median(10)
            if math.isfinite(med):
                self.best_median = min(self.best_median, med)
                self._history_medians.append(med)
                if len(self._history_medians) == self._history_medians.maxlen:
                    self.high_water = max(self.high_water, self._history_medians[0])

    # ------------------------------------------------------------ reads
    @property
    def initial(self) -> float:
        """Median of the first 10 finite step losses (nan before any)."""
        return _median(self.first)

    def recent(self, n: int | None = None) -> list[float]:
        xs = list(self.losses)
        return xs if n is None else xs[-n:]

    def recent_median(self, n: int = 10) -> float:
        return _median(self.recent(n))

    # ------------------------------------------------------------ state
    def get_state(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "first": [_jsonable(x) for x in self.first],
            "losses": [_jsonable(x) for x in self.losses],
            "chunks": [_jsonable(x) for x in self.chunks],
            "chunk_buf": [_jsonable(x) for x in self._chunk_buf],
            "best_median": _jsonable(self.best_median),
            "high_water": _jsonable(self.high_water),
            "nonfinite_steps": self.nonfinite_steps,
            "history_medians": [_jsonable(x) for x in self._history_medians],
        }

    def set_state(self, s: dict[str, Any]) -> None:
        self.reset()
        f = lambda v: float(_unjson(v))  # noqa: E731
        self.steps = int(s.get("steps", 0))
        self.first = [f(x) for x in s.get("first", [])]
        self.losses.extend(f(x) for x in s.get("losses", []))
        self.chunks.extend(f(x) for x in s.get("chunks", []))
        self._chunk_buf = [f(x) for x in s.get("chunk_buf", [])]
        self.best_median = f(s.get("best_median", "inf"))
        self.high_water = f(s.get("high_water", "-inf"))
        self.nonfinite_steps = int(s.get("nonfinite_steps", 0))
        self._history_medians.extend(f(x) for x in s.get("history_medians", []))


# --------------------------------------------------------------------------- rules: losses
def _lr_text(lr: float | None) -> str:
    return f" (now {lr:.3g})" if lr is not None and math.isfinite(lr) else ""


def check_divergence(
    tracker: LossTracker,
    step: int,
    *,
    lr: float | None = None,
    weights_finite: bool = True,
    thresholds: dict | None = None,
) -> Finding | None:
    """Divergence: a non-finite loss or weights, or a loss that blew up and stays up.

    Args:
        tracker: The run's `LossTracker`.
        step: The current step.
        lr: The current learning rate, for the fixes. Defaults to `None`.
        weights_finite: False when the model's weights hold NaN/Inf (the loss can
            stay finite: oneDNN's ReLU maps NaN to 0). Defaults to `True`.
        thresholds: Overrides of `DEFAULT_THRESHOLDS`. Defaults to `None`.

    Returns:
        A `Finding` or `None`.

    Example:
    >>> t = LossTracker(); t.add(2.3); t.add(float("nan"))
    >>> check_divergence(t, 2).code
    'divergence'
    """
    th = {**DEFAULT_THRESHOLDS, **(thresholds or {})}
    last = tracker.losses[-1] if tracker.losses else math.nan
    initial = tracker.initial
    ev: dict[str, Any] = {"loss": last, "initial_loss": initial, "best_loss": tracker.best_median}
    if lr is not None:
        ev["lr"] = lr
    reason = None
    if not weights_finite:
        reason = "the weights hold NaN/Inf"
        ev["weights_finite"] = 0
    elif tracker.losses and not math.isfinite(last):
        reason = f"the loss became {last}"
    elif (
        len(tracker.losses) >= 3
        and tracker.first
        and _median(tracker.recent(3)) > 1e3 * max(abs(tracker.first[0]), 1e-12)
    ):
        now = _median(tracker.recent(3))
        ev["recent_loss"] = now
        reason = f"the loss rose from {_fmt(tracker.first[0])} to {_fmt(now)} within {tracker.steps} steps"
    elif len(tracker.losses) >= 10 and math.isfinite(initial):
        now = tracker.recent_median(10)
        best = tracker.best_median
        ev["recent_loss"] = now
        big = now > th["diverge_factor"] * max(best, 1e-12) and now > initial
        new_high = not math.isfinite(tracker.high_water) or now > 2.0 * tracker.high_water
        if big and new_high:
            reason = f"the loss rose from {_fmt(best)} to {_fmt(now)} (x{_fmt(now / max(best, 1e-12))})"
    if reason is None:
        return None
    lower = f"lower the learning rate 10x{_lr_text(lr)}" + (f", to {lr / 10:.3g}" if lr else "")
    return Finding(
        "divergence",
        "error",
        ev,
        [
            lower,
            "add a warmup (trainwell.callbacks.WarmupCosine(warmup_epochs=1))",
            "clip gradients (optimizer `global_clipnorm=1.0`)",
            "pick the LR with the LR range test (`trainwell.lr_find(model, data)`)",
            "guard the run with trainwell.callbacks.NaNRollback",
        ],
        step,
        ["learning rate too high", "no warmup", "unclipped gradient spikes", "bad input (NaN/Inf in the data)"],
        f"training diverged: {reason}.",
    )


def zigzag(series: Sequence[float], swing: float, ratio: float) -> list[tuple[int, float, str]]:
    """Turning points of `series` that move by at least `swing` and by a factor `ratio`.

    Returns `(index, value, "peak" | "trough")` for each confirmed turning point.

    Example:
    >>> [k for _, _, k in zigzag([1, 3, 1, 3, 1], swing=1.0, ratio=1.5)]
    ['peak', 'trough', 'peak']
    """
    pts: list[tuple[int, float, str]] = []
    xs = [x for x in series if math.isfinite(x)]
    if len(xs) < 3:
        return pts

    def big(a: float, b: float) -> bool:
        lo, hi = min(a, b), max(a, b)
        return hi - lo >= swing and hi >= ratio * max(lo, 1e-12)

    direction = 0  # +1 rising, -1 falling, 0 unknown
    ext_i, ext_v = 0, xs[0]
    lo_i, lo_v, hi_i, hi_v = 0, xs[0], 0, xs[0]
    for i, x in enumerate(xs[1:], start=1):
        if direction == 0:
            if x > hi_v:
                hi_i, hi_v = i, x
            if x < lo_v:
                lo_i, lo_v = i, x
            if big(lo_v, x) and x > lo_v and i == hi_i:
                direction, ext_i, ext_v = 1, i, x
            elif big(hi_v, x) and x < hi_v and i == lo_i:
                direction, ext_i, ext_v = -1, i, x
        elif direction == 1:
            if x > ext_v:
                ext_i, ext_v = i, x
            elif big(ext_v, x):
                pts.append((ext_i, ext_v, "peak"))
                direction, ext_i, ext_v = -1, i, x
        else:
            if x < ext_v:
                ext_i, ext_v = i, x
            elif big(ext_v, x):
                pts.append((ext_i, ext_v, "trough"))
                direction, ext_i, ext_v = 1, i, x
    return pts


def step_noise(losses: Sequence[float]) -> float:
    """The noise (standard deviation) of one step's loss, from the step-to-step differences.

    Robust, and blind to a smooth trend: for independent noise of standard
    deviation s the median absolute difference of two steps is 0.6745 x sqrt(2) x s.
    A fast trend or a slow oscillation adds to the differences, so this errs high.
    `nan` with fewer than 3 finite losses.

    Example:
    >>> round(step_noise([1.0, 1.2] * 20), 3)
    0.21
    """
    xs = [x for x in losses if math.isfinite(x)]
    if len(xs) < 3:
        return math.nan
    return statistics.median(abs(b - a) for a, b in zip(xs, xs[1:])) / (0.6745 * math.sqrt(2))


def chunk_noise(losses: Sequence[float], chunk: int = 5) -> float:
    """The noise (standard deviation) of a `chunk`-step median of `losses`.

    `step_noise` times sqrt(pi / 2) / sqrt(chunk), the standard deviation of the
    median of `chunk` independent values. `0.0` with fewer than 10 finite losses.

    Example:
    >>> round(chunk_noise([1.0, 1.2] * 20), 3)
    0.118
    """
    if sum(1 for x in losses if math.isfinite(x)) < 10:
        return 0.0
    return math.sqrt(math.pi / 2) * step_noise(losses) / math.sqrt(chunk)


def check_oscillation(
    tracker: LossTracker,
    step: int,
    *,
    lr: float | None = None,
    momentum: float | None = None,
    probe_losses: Sequence[float] | None = None,
    probe_every: int | None = None,
    reference: float | None = None,
    thresholds: dict | None = None,
) -> Finding | None:
    """Oscillation: the loss (5-step medians) swings up and down by large amounts.

    A swing counts when it moves the 5-step median of the loss by
    `oscillation_swing` x the loss scale, by a factor `oscillation_ratio`, and by
    `oscillation_noise_z` x the minibatch noise of a 5-step median (`chunk_noise`);
    `oscillation_peaks` peaks (a large rise then a large fall) within the tracker's
    window make an oscillation. The loss scale is the larger of the initial loss and
    `reference` (the probe's `null_loss`): a model that starts already trained (a
    second `fit`, fine-tuning) has an initial loss so low that its ordinary SGD noise
    would otherwise look like large swings.

    `probe_losses`, the losses on the fixed probe batch at the probes within the
    window (no minibatch sampling noise), confirm it where they can see it: when the
    probes are at most half a period apart (`probe_every` steps; the period is that
    of the peaks), one of them must exceed the one before by
    `oscillation_probe_rise` (x1.5), and with fewer than 3 probe losses the rule
    waits. Probes further apart sample an oscillation at random phases (the
    doctor's default, a probe every 100 steps, against the 15-50-step periods of
    heavy momentum), so they neither confirm nor refute it; the noise bound on
    every swing stands in for them. `None` (no probe) skips the confirmation.

    Example:
    >>> t = LossTracker(window=100)
    >>> for i in range(100): t.add(2.0 if (i // 10) % 2 else 0.4)
    >>> check_oscillation(t, 100).code
    'oscillation'
    """
    th = {**DEFAULT_THRESHOLDS, **(thresholds or {})}
    initial = tracker.initial
    chunks = [c for c in tracker.chunks if math.isfinite(c)]
    if not math.isfinite(initial) or len(chunks) < 6:
        return None
    scale = max(abs(initial), reference) if reference is not None and math.isfinite(reference) else abs(initial)
    noise = chunk_noise(tracker.losses, tracker.chunk)
    swing = max(th["oscillation_swing"] * scale, th["oscillation_noise_z"] * noise)
    pts = zigzag(chunks, swing=swing, ratio=th["oscillation_ratio"])
    peaks = [p for p in pts if p[2] == "peak"]
    if len(peaks) < int(th["oscillation_peaks"]):
        return None
    period = (
        tracker.chunk * statistics.mean(b[0] - a[0] for a, b in zip(peaks, peaks[1:])) if len(peaks) > 1 else math.nan
    )
    rise = None
    resolved = probe_every is None or (math.isfinite(period) and 2 * probe_every <= period)
    if probe_losses is not None and resolved:
        pl = [x for x in probe_losses if math.isfinite(x)]
        if len(pl) < 3:
            return None
        rise = max(b / max(a, 1e-12) for a, b in zip(pl, pl[1:]))
        if rise < th["oscillation_probe_rise"]:
            return None
    troughs = [p for p in pts if p[2] == "trough"]
    amp = statistics.mean(p[1] for p in peaks) - (statistics.mean(p[1] for p in troughs) if troughs else min(chunks))
    ev: dict[str, Any] = {
        "peaks": len(peaks),
        "swing": amp,
        "swing_over_initial_loss": amp / abs(initial),
        "loss_scale_reference": scale,
        "swing_over_noise": amp / noise if noise > 0 else math.inf,
        "period_steps": period,
        "window_steps": tracker.chunk * len(chunks),
    }
    if rise is not None:
        ev["probe_loss_rise"] = rise
    elif probe_losses is not None:
        ev["probe_every_steps"] = probe_every  # too far apart to confirm (see above)
    fixes = []
    causes = []
    if lr is not None:
        ev["lr"] = lr
    if momentum is not None:
        ev["momentum"] = momentum
        if momentum >= 0.95:
            fixes.append(f"lower the momentum from {momentum:g} to 0.9 (or beta_1=0.9 for Adam)")
            causes.append(f"momentum too high ({momentum:g}): the heavy ball overshoots the valley")
    fixes += [
        f"lower the learning rate 3x{_lr_text(lr)}",
        "add a warmup (trainwell.callbacks.WarmupCosine(warmup_epochs=1)) and a decaying schedule",
        "use a larger batch (or `gradient_accumulation_steps`) to reduce gradient noise",
        "clip gradients (optimizer `global_clipnorm=1.0`)",
    ]
    causes += ["learning rate too high for the curvature", "noisy gradients (small batch)"]
    return Finding(
        "oscillation",
        "warning",
        ev,
        fixes,
        step,
        causes,
        f"the loss swings up and down: {len(peaks)} peaks of {_fmt(amp)} "
        f"({_fmt(100 * amp / abs(initial))}% of the initial loss) in the last {ev['window_steps']} steps.",
    )


def check_slow_convergence(
    tracker: LossTracker,
    step: int,
    *,
    lr: float | None = None,
    update_ratio: float | None = None,
    thresholds: dict | None = None,
    explained_by: Sequence[str] = (),
    reference: float | None = None,
) -> Finding | None:
    """Slow convergence: the loss has barely moved after a window of steps, or stalls.

    Crawl: after `window` steps the loss is less than `slow_progress` below its
    initial value. Plateau: over the last `window` steps it improved by less than
    `plateau_progress` while still above `plateau_level` x the initial loss.
    The per-step update-to-weight ratio (when known) tells a too-low LR from a
    plateau. `explained_by` names findings already made that stop gradients
    reaching the weights (e.g. `["dead_units"]`); the fixes then point there.
    `reference` (the probe's `null_loss`, the loss of predicting the batch-mean
    output) tells "has not learned" from "already trained": neither a crawl nor a
    plateau is reported below `slow_level` x the reference.

    Example:
    >>> t = LossTracker(window=50)
    >>> for i in range(60): t.add(2.30 - 1e-4 * i)
    >>> check_slow_convergence(t, 60, lr=1e-6).code
    'slow_convergence'
    """
    th = {**DEFAULT_THRESHOLDS, **(thresholds or {})}
    initial = tracker.initial
    if tracker.steps < tracker.window or len(tracker.losses) < tracker.window or not math.isfinite(initial):
        return None
    now = tracker.recent_median(10)
    if not math.isfinite(now) or initial <= 0:
        return None
    progress = (initial - now) / abs(initial)
    window_start = _median(list(tracker.losses)[:10])
    window_progress = (window_start - now) / abs(window_start) if window_start else math.nan
    ev: dict[str, Any] = {
        "initial_loss": initial,
        "loss": now,
        "progress": progress,
        "window_progress": window_progress,
        "steps": tracker.steps,
    }
    if lr is not None:
        ev["lr"] = lr
    if update_ratio is not None:
        ev["update_ratio"] = update_ratio
    learned = reference is not None and math.isfinite(reference) and now < th["slow_level"] * reference
    if learned:
        return None
    crawl = progress < th["slow_progress"]
    plateau = (
        not crawl
        and tracker.steps >= 2 * tracker.window
        and math.isfinite(window_progress)
        and window_progress < th["plateau_progress"]
        and now > th["plateau_level"] * initial
    )
    if not (crawl or plateau):
        return None
    tiny_updates = update_ratio is not None and update_ratio < th["update_ratio_low"]
    if explained_by:
        causes = [f"{', '.join(explained_by)}: the gradient does not reach (all) the weights"]
        fixes = [f"fix the {explained_by[0]} finding first (see its fixes)"]
    elif tiny_updates or (crawl and lr is not None and lr < 1e-4):
        causes = ["learning rate too low: the weights barely move"]
        fixes = [
            f"raise the learning rate 10-100x{_lr_text(lr)}"
            + (f", e.g. to {lr * 30:.3g}" if lr else ""),
            "pick the LR with the LR range test (`trainwell.lr_find(model, data)`)",
        ]
    else:
        causes = ["a plateau: poor initialisation or normalisation", "data or label problems", "LR schedule"]
        fixes = [
            "check the labels and the input pipeline (a model must be able to overfit one batch)",
            "normalise the inputs; add BatchNormalization/LayerNormalization",
            "use He (ReLU) or Glorot (tanh) initialisation",
            "try a larger learning rate or a warmup then cosine schedule",
        ]
    fixes.append("train longer only if the loss is still falling steadily")
    kind = "rose" if progress < -th["slow_progress"] else "crawls" if crawl else "has plateaued"
    return Finding(
        "slow_convergence",
        "warning" if crawl else "info",
        ev,
        fixes,
        step,
        causes,
        f"the loss {kind}: {_fmt(initial)} -> {_fmt(now)} ({-100 * progress:+.3g}% in {tracker.steps} steps)"
        + (f", update/weight ratio {_fmt(update_ratio)} per step" if update_ratio is not None else "")
        + ".",
    )


def check_overfitting(
    losses: Sequence[float],
    val_losses: Sequence[float],
    step: int,
    *,
    thresholds: dict | None = None,
) -> Finding | None:
    """Overfitting: validation loss rising above its best while the training loss falls.

    Args:
        losses: Per-epoch training losses.
        val_losses: Per-epoch validation losses (same epochs).
        step: The current step.
        thresholds: Overrides of `DEFAULT_THRESHOLDS`. Defaults to `None`.

    Example:
    >>> check_overfitting([1, .5, .3, .2, .1], [1, .8, .9, 1.0, 1.2], 50).code
    'overfitting'
    """
    th = {**DEFAULT_THRESHOLDS, **(thresholds or {})}
    pairs = [(a, b) for a, b in zip(losses, val_losses) if math.isfinite(a) and math.isfinite(b)]
    patience = int(th["overfit_patience"])
    if len(pairs) < patience + 2:
        return None
    tr, va = [p[0] for p in pairs], [p[1] for p in pairs]
    best_epoch = min(range(len(va)), key=va.__getitem__)
    epochs_since = len(va) - 1 - best_epoch
    rise = (va[-1] - va[best_epoch]) / max(abs(va[best_epoch]), 1e-12)
    sustained = (statistics.mean(va[-patience:]) - va[best_epoch]) / max(abs(va[best_epoch]), 1e-12)
    gap = va[-1] - tr[-1]
    if (
        epochs_since < patience
        or min(rise, sustained) < th["overfit_rise"]
        or tr[-1] >= tr[best_epoch]
        or gap < th["overfit_gap"] * abs(va[-1])
    ):
        return None
    ev = {
        "best_epoch": best_epoch + 1,
        "best_val_loss": va[best_epoch],
        "val_loss": va[-1],
        "loss": tr[-1],
        "val_rise": rise,
        "generalisation_gap": gap,
        "epochs_since_best": epochs_since,
    }
    return Finding(
        "overfitting",
        "warning",
        ev,
        [
            f"stop at the best epoch: EarlyStopping(monitor='val_loss', patience={patience}, restore_best_weights=True)"
            f" (best was epoch {best_epoch + 1})",
            "add regularisation: decoupled weight decay (AdamW weight_decay=1e-4..1e-2) or Dropout(0.1-0.5)",
            "augment the data (keras.layers.RandAugment / MixUp / CutMix) or get more data",
            "use a smaller model",
        ],
        step,
        ["model capacity too large for the data", "too little regularisation", "training too long"],
        f"validation loss rose {_fmt(100 * rise)}% above its best (epoch {best_epoch + 1}: {_fmt(va[best_epoch])}) "
        f"to {_fmt(va[-1])} while the training loss fell to {_fmt(tr[-1])}.",
    )


def check_input_bound(
    step_times: Sequence[float],
    compute_times: Sequence[float],
    step: int,
    *,
    cpu_wait: float | None = None,
    thresholds: dict | None = None,
) -> Finding | None:
    """Input bound: steps take much longer than their compute, so they wait for data.

    The wait is the median step time less the compute time (the fastest of its
    timings: interference only ever slows one down) and less `cpu_wait`, the time
    per step the run's threads spent waiting for a CPU: on a machine shared with
    other busy processes the steps are slow because the process does not get the
    CPU, not because the data is late. (Measured on a 2-core machine at load 5-7,
    the largest run-queue delay of any thread per step: a small CNN's steps took
    150-200 ms with 70-160 ms of it; a tiny MLP's 2-3 ms with 0.5-2 ms; behind a
    pipeline that sleeps 30 ms per batch, 31 ms with 1-2 ms.)

    Args:
        step_times: Recent wall times of one training step, seconds (from
            `on_train_batch_begin` to `on_train_batch_end`: the data fetch is
            inside Keras's compiled train function).
        compute_times: Wall times of the same computation (forward + backward of
            one batch of the training batch size) on data already in memory.
        step: The current step.
        cpu_wait: Seconds per step the run waited for a CPU, over about the
            same steps (from `run_queue_delays`); `None` where unknown. Defaults
            to `None`.
        thresholds: Overrides of `DEFAULT_THRESHOLDS`. Defaults to `None`.

    Example:
    >>> check_input_bound([0.050] * 20, [0.004] * 3, 100).code
    'input_bound'
    >>> check_input_bound([0.050] * 20, [0.004] * 3, 100, cpu_wait=0.045) is None
    True
    """
    th = {**DEFAULT_THRESHOLDS, **(thresholds or {})}
    if len(step_times) < 5 or not compute_times:
        return None
    t_step, t_comp = _median(step_times), min(compute_times)
    if not (math.isfinite(t_step) and math.isfinite(t_comp)) or t_step <= 0:
        return None
    t_cpu = cpu_wait if cpu_wait is not None and math.isfinite(cpu_wait) else 0.0
    wait = max(t_step - t_comp - t_cpu, 0.0)
    frac = wait / max(t_step - t_cpu, 1e-9)  # of the step as it would take on an idle machine
    if frac < th["input_wait_fraction"] or 1e3 * wait < th["input_wait_ms"]:
        return None
    ev = {
        "step_ms": 1e3 * t_step,
        "compute_ms": 1e3 * t_comp,
        "cpu_wait_ms": 1e3 * t_cpu,
        "wait_ms": 1e3 * wait,
        "wait_fraction": frac,
        "possible_speedup": t_step / max(t_comp, 1e-9),
    }
    return Finding(
        "input_bound",
        "warning",
        ev,
        [
            "prefetch: `dataset.prefetch(tf.data.AUTOTUNE)` as the last step of the pipeline",
            "parallelise preprocessing: `dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE)`",
            "cache decoded data: `dataset.cache()` (in memory or to a file) before augmentation",
            "move augmentation onto the accelerator (Keras preprocessing layers inside the model)",
            "for Python generators use keras.utils.PyDataset(workers=N, use_multiprocessing=True)",
        ],
        step,
        ["slow data pipeline (decoding, augmentation, Python generator) without prefetch or parallelism"],
        f"steps wait for data {_fmt(100 * frac)}% of the time "
        f"({_fmt(1e3 * t_step)} ms per step, {_fmt(1e3 * t_comp)} ms of compute"
        + (f", {_fmt(1e3 * t_cpu)} ms waiting for a CPU" if t_cpu >= 5e-4 else "")
        + ").",
    )


def check_amp(
    scale_history: Sequence[float],
    backoff_steps: Sequence[int],
    step: int,
    *,
    window: int = 200,
    nonfinite: dict | None = None,
    thresholds: dict | None = None,
) -> Finding | None:
    """Mixed-precision instability: the loss scale backs off again and again.

    Args:
        scale_history: Recent loss-scale values (latest last).
        backoff_steps: Steps at which the scale was halved (one entry per halving).
        step: The current step.
        window: Steps over which the overflow rate is computed. Defaults to `200`.
        nonfinite: The probe's `nonfinite` result (the first layer that
            produced NaN/Inf). A forward-pass one is a finding by itself (loss
            scaling cannot help); a backward-pass one only names the layer of an
            unstable scale (backing off is the scale's normal job). Defaults to
            `None`.
        thresholds: Overrides of `DEFAULT_THRESHOLDS`. Defaults to `None`.

    Example:
    >>> check_amp([2.0 ** (15 - i) for i in range(20)], list(range(1, 21)), 20, window=100).code
    'amp_instability'
    """
    th = {**DEFAULT_THRESHOLDS, **(thresholds or {})}
    recent = [s for s in backoff_steps if s > step - window]
    span = max(int(window), 1)  # a fixed span: the first back-offs that find the scale's level are normal
    rate = len(recent) / span
    scale = scale_history[-1] if scale_history else math.nan
    unstable = (len(recent) >= th["amp_min_backoffs"] and rate > th["amp_overflow_rate"]) or (
        math.isfinite(scale) and scale < th["amp_min_scale"]
    )
    located = bool(nonfinite and nonfinite.get("layer"))
    forward = located and nonfinite.get("pass") == "forward"
    if not (unstable or forward):
        return None
    ev: dict[str, Any] = {
        "loss_scale": scale,
        "min_loss_scale": min(scale_history) if scale_history else math.nan,
        "backoffs": len(backoff_steps),
        "recent_backoffs": len(recent),
        "overflow_rate": rate,
        "window_steps": span,
    }
    fixes: list[str] = []
    causes: list[str] = []
    where = ""
    if located:
        layer = nonfinite["layer"]
        ev["layer"] = layer
        ev["layer_index"] = nonfinite.get("index", -1)
        ev["pass"] = nonfinite.get("pass", "")
        ev["layer_compute_dtype"] = nonfinite.get("compute_dtype", "")
        if "max_abs" in nonfinite:
            ev["max_abs_before"] = nonfinite["max_abs"]
        fixes.append(
            f'keep layer "{layer}" in float32: build it with `dtype="float32"` '
            f"(its {nonfinite.get('pass', 'forward')} pass overflows float16, max 65504)"
        )
        causes.append(f'layer "{layer}" produces values beyond float16\'s range in the {nonfinite.get("pass")} pass')
        where = f' First non-finite values: layer "{layer}" ({nonfinite.get("pass")} pass).'
    fixes += [
        "keep the final softmax/logits and any normalisation statistics in float32",
        "clip gradients (optimizer `global_clipnorm=1.0`) and lower the learning rate",
        "use mixed_bfloat16 where the hardware supports it (same range as float32)",
    ]
    causes += ["activations or gradients overflow float16", "learning rate too high"]
    return Finding(
        "amp_instability",
        "error" if (located or (math.isfinite(scale) and scale < th["amp_min_scale"])) else "warning",
        ev,
        fixes,
        step,
        causes,
        (
            f'mixed_float16: layer "{nonfinite["layer"]}" overflows float16 in the forward pass '
            f"(loss scale {_fmt(scale)}, {len(recent)} back-offs in {span} steps)."
            if forward
            else f"mixed_float16: the loss scale backed off {len(recent)} times in {span} steps "
            f"(overflow rate {_fmt(100 * rate)}%), now {_fmt(scale)}.{where}"
        ),
    )


# --------------------------------------------------------------------------- rules: probe
def check_gradients(
    stats: dict[str, Any],
    step: int,
    *,
    first_global_norm: float | None = None,
    lr: float | None = None,
    thresholds: dict | None = None,
) -> list[Finding]:
    """Vanishing and exploding gradients from one probe's statistics.

    Args:
        stats: A `GradientProbe.run()` result: `layers` (per weighted layer:
            `name`, `grad_norm`, `weight_norm`, `grad_rms`, `kernel`), `global_norm`,
            `grads_finite`, `loss_finite`, `saturation` (per activation layer).
        step: The current step.
        first_global_norm: The global gradient norm at the run's first probe.
            Defaults to `None`.
        lr: The current learning rate. Defaults to `None`.
        thresholds: Overrides of `DEFAULT_THRESHOLDS`. Defaults to `None`.

    Returns:
        A list of zero, one or two findings.

    Example:
    >>> layers = [dict(name="d1", grad_norm=1e-12, weight_norm=1.0, grad_rms=1e-13, kernel=True),
    ...           dict(name="d2", grad_norm=1e-2, weight_norm=1.0, grad_rms=1e-3, kernel=True)]
    >>> [f.code for f in check_gradients({"layers": layers, "global_norm": 1e-2}, 1)]
    ['vanishing_gradients']
    """
    th = {**DEFAULT_THRESHOLDS, **(thresholds or {})}
    out: list[Finding] = []
    layers = [l for l in stats.get("layers", []) if l.get("kernel")]
    gnorm = stats.get("global_norm", math.nan)
    if len(layers) >= 2:
        first, last = layers[0], layers[-1]
        ratio = first["grad_rms"] / max(last["grad_rms"], 1e-30)
        sat = stats.get("saturation") or {}
        if (
            math.isfinite(ratio)
            and ratio < th["vanish_ratio"]
            and math.isfinite(last["grad_rms"])
            and last["grad_rms"] > 0
        ):
            ev: dict[str, Any] = {
                "first_layer": first["name"],
                "last_layer": last["name"],
                "first_grad_rms": first["grad_rms"],
                "last_grad_rms": last["grad_rms"],
                "ratio": ratio,
                "weighted_layers": len(layers),
            }
            if sat:
                ev["max_saturation"] = max(sat.values())
            out.append(
                Finding(
                    "vanishing_gradients",
                    "warning",
                    ev,
                    [
                        "use ReLU/GELU activations instead of sigmoid/tanh in hidden layers",
                        "use He (ReLU) or Glorot (tanh) initialisation instead of tiny weights",
                        "add BatchNormalization/LayerNormalization between layers",
                        "add skip (residual) connections",
                    ],
                    step,
                    ["saturating activations (sigmoid/tanh)", "initial weights too small", "a deep stack without normalisation or skip connections"],
                    f'gradients shrink {_fmt(1 / max(ratio, 1e-300))}x from the last weighted layer ("{last["name"]}") '
                    f'to the first ("{first["name"]}") over {len(layers)} layers.',
                )
            )
    worst = None
    for l in layers:
        r = l["grad_norm"] / max(l["weight_norm"], 1e-12)
        if worst is None or not math.isfinite(r) or r > worst[1]:
            worst = (l, r)
            if not math.isfinite(r):
                break
    growth = (
        gnorm / first_global_norm
        if first_global_norm and math.isfinite(first_global_norm) and first_global_norm > 0
        else math.nan
    )
    nonfinite = not stats.get("grads_finite", True) and stats.get("loss_finite", True)
    big_ratio = worst is not None and (not math.isfinite(worst[1]) or worst[1] > th["explode_ratio"])
    grew = math.isfinite(growth) and growth > th["explode_growth"]
    if nonfinite or big_ratio or grew:
        ev = {"global_grad_norm": gnorm, "grads_finite": int(bool(stats.get("grads_finite", True)))}
        if worst is not None:
            ev.update({"layer": worst[0]["name"], "grad_norm": worst[0]["grad_norm"],
                       "weight_norm": worst[0]["weight_norm"], "grad_over_weight": worst[1]})
        if math.isfinite(growth):
            ev["growth_since_start"] = growth
        if lr is not None:
            ev["lr"] = lr
        what = (
            "gradients are non-finite while the loss is finite"
            if nonfinite
            else f'layer "{worst[0]["name"]}" has a gradient {_fmt(worst[1])}x its weight norm'
            if big_ratio
            else f"the gradient norm grew {_fmt(growth)}x since the start"
        )
        out.append(
            Finding(
                "exploding_gradients",
                "error" if nonfinite else "warning",
                ev,
                [
                    "clip gradients: optimizer `global_clipnorm=1.0`",
                    "use He (ReLU) / Glorot (tanh) initialisation scaled to the fan-in, not large weights",
                    "add BatchNormalization/LayerNormalization (and residual connections in deep stacks)",
                    f"lower the learning rate{_lr_text(lr)} and add a warmup",
                ],
                step,
                ["initial weights too large", "no normalisation in a deep network", "learning rate too high"],
                f"exploding gradients: {what} (global norm {_fmt(gnorm)}).",
            )
        )
    return out


def check_dead_units(
    dead: dict[str, float],
    previous: dict[str, float] | None,
    step: int,
    *,
    lr: float | None = None,
    thresholds: dict | None = None,
    explained_by: Sequence[str] = (),
) -> Finding | None:
    """Dead ReLU units: a layer whose units are zero for the whole probe batch.

    Args:
        dead: Fraction of dead units per ReLU layer at this probe.
        previous: The same at the previous probe (the finding needs two probes
            in a row), or `None`.
        step: The current step.
        lr: The current learning rate. Defaults to `None`.
        thresholds: Overrides of `DEFAULT_THRESHOLDS`. Defaults to `None`.
        explained_by: Findings already made that kill units, e.g.
            `["oscillation"]` (its large steps push the units' inputs below zero
            for good); the causes and the first fix then point there. Defaults to
            `()`.

    Example:
    >>> check_dead_units({"dense": 0.9}, {"dense": 0.8}, 200).code
    'dead_units'
    """
    th = {**DEFAULT_THRESHOLDS, **(thresholds or {})}
    if previous is None:
        return None
    bad = {
        k: v for k, v in dead.items()
        if v > th["dead_fraction"] and previous.get(k, 0.0) > th["dead_fraction"]
    }
    if not bad:
        return None
    worst = max(bad, key=bad.get)
    ev: dict[str, Any] = {"layer": worst, "dead_fraction": bad[worst], "layers_affected": len(bad)}
    ev.update({f"dead_fraction/{k}": v for k, v in bad.items()})
    if lr is not None:
        ev["lr"] = lr
    fixes = [
        "use LeakyReLU/GELU/ELU instead of ReLU",
        f"lower the learning rate{_lr_text(lr)} (a large step can push biases so negative a unit never fires again)",
        "use He initialisation with zero biases; add BatchNormalization before the activation",
    ]
    causes = ["learning rate too high", "large negative biases", "poor initialisation"]
    if explained_by:
        ev["explained_by"] = ", ".join(explained_by)
        fixes.insert(0, f"fix the {explained_by[0]} finding first (see its fixes), then train again from scratch")
        causes.insert(0, f"{explained_by[0]}: its large steps pushed the units' inputs below zero for every example")
    return Finding(
        "dead_units",
        "warning",
        ev,
        fixes,
        step,
        causes,
        f'{_fmt(100 * bad[worst])}% of the units of layer "{worst}" output zero for every example'
        + (f" ({len(bad)} layers affected)" if len(bad) > 1 else "")
        + (f", after the {explained_by[0]}" if explained_by else "")
        + ".",
    )


def run_queue_delays() -> dict[int, float] | None:
    """Seconds each thread of this process has spent runnable but waiting for a CPU.

    Linux's scheduler statistics (`/proc/self/task/<tid>/schedstat`, the second
    field), by thread id. A step waits for a CPU when a thread it waits on does
    (`fit`'s, or a compute or data thread), so `TrainingDoctor` takes the largest
    increase of any thread over a span as the CPU wait of that span. `None` where
    the statistics are not available (other systems, or a kernel without them).
    Reading them costs about 10 microseconds per thread.

    Example:
    >>> d = run_queue_delays()
    >>> d is None or all(v >= 0 for v in d.values())
    True
    """
    import os

    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[1]) / 1e9
        except (OSError, ValueError, IndexError):  # a thread that just ended, or no schedstats
            continue
    return out or None


# --------------------------------------------------------------------------- probe
_ACT_KINDS = {
    "relu": "relu",
    "relu6": "relu",
    "sigmoid": "sigmoid",
    "hard_sigmoid": "sigmoid",
    "tanh": "tanh",
}


def activation_kind(layer) -> str | None:
    """`"relu"`, `"sigmoid"`, `"tanh"` or `None`: the saturating/dying kind of `layer`'s output.

    Example:
    >>> import keras
    >>> activation_kind(keras.layers.Dense(3, activation="sigmoid"))
    'sigmoid'
    """
    import keras

    if isinstance(layer, keras.layers.ReLU):
        slope = float(getattr(layer, "negative_slope", 0.0) or 0.0)
        thr = float(getattr(layer, "threshold", 0.0) or 0.0)
        return "relu" if slope == 0.0 and thr == 0.0 else None
    act = getattr(layer, "activation", None)
    if act is None:
        return None
    name = act if isinstance(act, str) else getattr(act, "__name__", None)
    return _ACT_KINDS.get(name) if name else None


def _display_name(path: str, model_name: str) -> str:
    parts = path.split("/")
    if len(parts) > 1 and parts[0] == model_name:
        parts = parts[1:]
    return "/".join(parts)


class GradientProbe:
    """Gradient and activation statistics of a model on a fixed batch, compiled once.

    One call runs the forward and backward pass of `model` on the batch with
    `training=True` (as `train_step` does) inside a `tf.function` of its own: the
    model's `train_step` is untouched, no optimizer update is applied, and the
    model's non-trainable variables (BatchNorm statistics, dropout seed state)
    and metric variables are restored to their values before the call, so a
    probe leaves training bit-for-bit unchanged. Under a `LossScaleOptimizer` the
    loss is scaled by the current loss scale before the backward pass, as in
    training, so float16 gradient overflow shows up; statistics are unscaled.

    For functional and sequential models an auxiliary functional model over the
    same layers exposes every top-level layer's output, giving per-layer
    activation statistics (dead-ReLU fraction, sigmoid/tanh saturation) and the
    first layer whose output or output-gradient is non-finite. Subclassed models
    get gradient statistics only.

    Args:
        model: A built, compiled Keras model.
        batch: `(x, y)` or `(x, y, sample_weight)`, ideally one training batch.
        track_updates: Keep a shadow copy of the trainable weights so that
            `snapshot()` before a step and `run()` after it give each layer's
            update-to-weight ratio. Defaults to `True`.
        activations: Collect per-layer activation statistics. Defaults to `True`.

    Example:
    >>> probe = GradientProbe(model, (x[:32], y[:32]))  # doctest: +SKIP
    >>> stats = probe.run()                             # doctest: +SKIP
    >>> stats["global_norm"], stats["layers"][0]["grad_rms"]  # doctest: +SKIP
    """

    def __init__(self, model, batch, track_updates: bool = True, activations: bool = True) -> None:
        import keras
        import tensorflow as tf

        self.model = model
        x, y, sw = keras.utils.unpack_x_y_sample_weight(tuple(batch) if isinstance(batch, list) else batch)
        conv = lambda t: None if t is None else keras.tree.map_structure(tf.convert_to_tensor, t)  # noqa: E731
        self.x, self.y, self.sw = conv(x), conv(y), conv(sw)
        first = next(iter(keras.tree.flatten(self.x)))
        self.batch_size = int(first.shape[0]) if first.shape.rank else 1
        self.trainable = list(model.trainable_variables)
        self.state_vars = list(model.non_trainable_variables) + list(model.metrics_variables)
        self._groups = self._group_variables()
        self.act_layers: list = []
        self.act_kinds: list[str | None] = []
        self.aux = None
        if activations:
            self._build_aux()
        self.shadows = None
        if track_updates:
            self.shadows = [
                tf.Variable(tf.zeros(v.shape, dtype=v.dtype), trainable=False, name="probe_shadow")
                for v in self.trainable
            ]
            self._snapshot_fn = tf.function(self._snapshot_impl, autograph=False)
        self._has_snapshot = False
        # Without AutoGraph: the probe's loops are over Python lists, and Keras 3 does not
        # convert layer or model code in `fit` either (a Python `if` on a tensor fails
        # there), so a model that trains traces here. Building and first running the
        # probe of a ResNet-18 (width 8) took 4.0 s without AutoGraph, 4.5-5.7 s with it.
        self._fn = tf.function(self._run_impl, autograph=False)

    # ------------------------------------------------------------ structure
    def _group_variables(self):
        """Trainable variables grouped by owning layer (their path minus the last part)."""
        groups: dict[str, list[int]] = {}
        for i, v in enumerate(self.trainable):
            path = getattr(v, "path", None) or v.name
            owner = path.rsplit("/", 1)[0] if "/" in path else path
            groups.setdefault(owner, []).append(i)
        out = []
        for owner, idx in groups.items():
            kernel = [
                i for i in idx
                if len(self.trainable[i].shape) >= 2 and "embedding" not in (getattr(self.trainable[i], "path", "") or "")
            ]
            out.append((_display_name(owner, self.model.name), idx, kernel))
        return out

    def _build_aux(self) -> None:
        import keras

        model = self.model

        def symbolic(single: str, plural: str):
            try:
                return getattr(model, single)
            except Exception:  # Sequential: only `inputs`/`outputs`
                pass
            try:
                xs = getattr(model, plural)
            except Exception:
                return None
            if isinstance(xs, (list, tuple)) and len(xs) == 1:
                return xs[0]
            return xs or None

        inputs, outputs = symbolic("input", "inputs"), symbolic("output", "outputs")
        if inputs is None or outputs is None:  # subclassed, or not built symbolically
            return
        layers, tensors = [], []
        for layer in model.layers:
            if isinstance(layer, keras.layers.InputLayer):
                continue
            try:
                out = layer.output
            except Exception:  # shared layer (several outputs): skip it
                continue
            flat = [t for t in keras.tree.flatten(out) if t is not None]
            if not flat:
                continue
            layers.append(layer)
            tensors.append(flat[0])
        try:
            self.aux = keras.Model(inputs, {"y": outputs, "acts": tensors})
        except Exception:
            self.aux = None
            return
        self.act_layers = layers
        self.act_kinds = [activation_kind(l) for l in layers]

    # ------------------------------------------------------------ compiled pieces
    def _snapshot_impl(self):
        for s, v in zip(self.shadows, self.trainable):
            s.assign(v.value)
        return True

    def snapshot(self) -> None:
        """Copies the trainable weights (call before the step whose update to measure)."""
        if self.shadows is not None:
            self._snapshot_fn()
            self._has_snapshot = True

    def _loss_and_grads(self, loss_scale):
        import tensorflow as tf

        from trainwell.compat.keras_internals import call_has_training_arg, compute_loss

        model = self.model
        with tf.GradientTape() as tape:
            if self.aux is not None:
                out = self.aux(self.x, training=True)
                y_pred, acts = out["y"], list(out["acts"])
            else:
                y_pred = model(self.x, training=True) if call_has_training_arg(model) else model(self.x)
                acts = []
            for a in acts:
                tape.watch(a)
            loss = compute_loss(model, x=self.x, y=self.y, y_pred=y_pred, sample_weight=self.sw, training=True)
            loss = tf.cast(loss, tf.float32)
            scaled = loss * loss_scale
        targets = list(self.trainable) + acts
        grads = tape.gradient(scaled, targets, unconnected_gradients=tf.UnconnectedGradients.NONE)
        # The loss of a "null" model that predicts the batch mean of the predictions
        # for every example: a scale for the loss that does not depend on training.
        null_pred = tf.nest.map_structure(
            lambda t: tf.broadcast_to(tf.reduce_mean(t, axis=0, keepdims=True), tf.shape(t)), y_pred
        )
        null = tf.cast(
            compute_loss(model, x=self.x, y=self.y, y_pred=null_pred, sample_weight=self.sw, training=False), tf.float32
        )
        return loss, grads[: len(self.trainable)], grads[len(self.trainable):], acts, null

    def _run_impl(self, loss_scale, use_shadow):
        import tensorflow as tf

        f32 = tf.float32
        saved = [tf.identity(v.value) for v in self.state_vars]
        loss, grads, act_grads, acts, null = self._loss_and_grads(loss_scale)
        restores = [v.assign(s) for v, s in zip(self.state_vars, saved)]
        with tf.control_dependencies([tf.group(*restores)] if restores else []):
            gn, wn, gfin, un, wfin = [], [], [], [], []
            for v, g in zip(self.trainable, grads):
                w = tf.cast(v.value, f32)
                wn.append(_safe_norm(w))
                wfin.append(tf.reduce_all(tf.math.is_finite(w)))
                if g is None:
                    gn.append(tf.constant(0.0, f32))
                    gfin.append(tf.constant(True))
                    continue
                if isinstance(g, tf.IndexedSlices):
                    g = g.values
                gfin.append(tf.reduce_all(tf.math.is_finite(g)))
                gn.append(_safe_norm(tf.cast(g, f32)) / loss_scale)
            if self.shadows is not None:
                for v, s in zip(self.trainable, self.shadows):
                    d = tf.cast(v.value, f32) - tf.cast(s, f32)
                    un.append(tf.where(use_shadow, _safe_norm(d), -1.0))
            afin, agfin, adead, asat, amax = [], [], [], [], []
            for a, ga, kind in zip(acts, act_grads, self.act_kinds):
                a32 = tf.cast(a, f32)
                afin.append(tf.reduce_all(tf.math.is_finite(a)))
                amax.append(tf.reduce_max(tf.where(tf.math.is_finite(a32), tf.abs(a32), 0.0)))
                agfin.append(tf.constant(True) if ga is None else tf.reduce_all(tf.math.is_finite(ga)))
                if kind == "relu" and a.shape.rank and a.shape.rank >= 2:
                    axes = list(range(a.shape.rank - 1))
                    alive = tf.reduce_max(a32, axis=axes) > 0.0
                    adead.append(1.0 - tf.reduce_mean(tf.cast(alive, f32)))
                else:
                    adead.append(tf.constant(-1.0, f32))
                if kind == "sigmoid":
                    asat.append(tf.reduce_mean(tf.cast((a32 < 0.01) | (a32 > 0.99), f32)))
                elif kind == "tanh":
                    asat.append(tf.reduce_mean(tf.cast(tf.abs(a32) > 0.99, f32)))
                else:
                    asat.append(tf.constant(-1.0, f32))
            stack = lambda xs, dt=f32: tf.stack(xs) if xs else tf.zeros([0], dt)  # noqa: E731
            return {
                "loss": loss,
                "null_loss": null,
                "gn": stack(gn),
                "wn": stack(wn),
                "gfin": stack(gfin, tf.bool),
                "wfin": stack(wfin, tf.bool),
                "un": stack(un),
                "afin": stack(afin, tf.bool),
                "agfin": stack(agfin, tf.bool),
                "adead": stack(adead),
                "asat": stack(asat),
                "amax": stack(amax),
            }

    # ------------------------------------------------------------ public
    def loss_scale(self) -> float:
        """The current loss scale of the model's `LossScaleOptimizer` (1.0 without one)."""
        import keras

        opt = getattr(self.model, "optimizer", None)
        if isinstance(opt, keras.optimizers.LossScaleOptimizer) and getattr(opt, "built", False):
            return float(opt.dynamic_scale.numpy())
        return 1.0

    def run(self) -> dict[str, Any]:
        """Runs the probe and returns its statistics (plain Python numbers).

        Returns:
            A dict with `loss`, `null_loss` (the loss when every example gets
            the batch-mean prediction: a scale of the loss that does not depend
            on how trained the model is), `loss_finite`, `global_norm`, `grads_finite`,
            `weights_finite`, `loss_scale`, `layers` (per weighted layer: `name`,
            `grad_norm`, `weight_norm`, `grad_rms`, `update_ratio`, `kernel`,
            `grads_finite`), `dead` and `saturation` (per activation layer, by
            name), `update_ratio` (median over layers) and `nonfinite` (the first
            layer that produced NaN/Inf, or `None`).
        """
        import numpy as np
        import tensorflow as tf

        scale = self.loss_scale()
        raw = self._fn(tf.constant(scale, tf.float32), tf.constant(self._has_snapshot))
        r = {k: np.asarray(v) for k, v in raw.items()}
        self._has_snapshot = False
        loss = float(r["loss"])
        layers = []
        for name, idx, kernel in self._groups:
            gnorm = math.hypot(*(float(r["gn"][i]) for i in idx))
            wnorm = math.hypot(*(float(r["wn"][i]) for i in idx))
            n_k = sum(int(np.prod(self.trainable[i].shape)) for i in kernel)
            knorm = math.hypot(*(float(r["gn"][i]) for i in kernel))
            entry = {
                "name": name,
                "grad_norm": gnorm,
                "weight_norm": wnorm,
                "grad_rms": knorm / math.sqrt(n_k) if n_k else math.nan,
                "kernel": bool(kernel),
                "grads_finite": bool(all(r["gfin"][i] for i in idx)),
            }
            if len(r["un"]):
                un = [float(r["un"][i]) for i in idx]
                if min(un) >= 0:
                    entry["update_ratio"] = math.hypot(*un) / max(wnorm, 1e-12)
            layers.append(entry)
        total = math.hypot(*(float(g) for g in r["gn"]))
        ratios = [l["update_ratio"] for l in layers if "update_ratio" in l and l["kernel"]]
        names = [l.name for l in self.act_layers]
        stats: dict[str, Any] = {
            "loss": loss,
            "null_loss": float(r["null_loss"]),
            "loss_finite": math.isfinite(loss),
            "global_norm": total,
            "grads_finite": bool(np.all(r["gfin"])),
            "weights_finite": bool(np.all(r["wfin"])),
            "loss_scale": scale,
            "layers": layers,
            "update_ratio": _median(ratios) if ratios else None,
            "dead": {n: float(d) for n, d in zip(names, r["adead"]) if d >= 0},
            "saturation": {n: float(s) for n, s in zip(names, r["asat"]) if s >= 0},
        }
        stats["nonfinite"] = self._locate(r, layers) if not (
            stats["loss_finite"] and stats["grads_finite"] and bool(np.all(r["afin"])) and bool(np.all(r["agfin"]))
        ) else None
        return stats

    def _locate(self, r, layers) -> dict[str, Any] | None:
        """The first layer that produced NaN/Inf: forward order, then backward order."""
        names = [l.name for l in self.act_layers]
        for i, ok in enumerate(r["afin"]):
            if not ok:
                layer = self.act_layers[i]
                out = {"layer": layer.name, "index": i, "pass": "forward", "compute_dtype": _compute_dtype(layer)}
                if i > 0:
                    out["max_abs"] = float(r["amax"][i - 1])
                return out
        owner_ok: dict[str, bool] = {}
        for l in layers:
            top = l["name"].split("/")[0]
            owner_ok[top] = owner_ok.get(top, True) and l["grads_finite"]

        def blame(i: int) -> dict[str, Any]:
            layer = self.act_layers[i]
            return {"layer": layer.name, "index": i, "pass": "backward", "compute_dtype": _compute_dtype(layer)}

        n = len(names)
        for i in range(n - 1, -1, -1):
            out_ok, w_ok = bool(r["agfin"][i]), owner_ok.get(names[i], True)
            if out_ok and w_ok:
                continue
            if out_ok:  # its own weight gradients: its backward pass
                return blame(i)
            # Its output gradient is non-finite: made by the next layer's backward pass
            # (or the loss), unless it overflowed where it was cast into this layer's
            # 16-bit output (a float32 consumer): then this layer's dtype is the cause.
            if i + 1 >= n:
                return blame(i)
            if "16" in _compute_dtype(self.act_layers[i]) and "16" not in _compute_dtype(self.act_layers[i + 1]):
                return blame(i)
            return blame(i + 1)
        bad = [l for l in layers if not l["grads_finite"]]
        if bad:
            return {"layer": bad[-1]["name"], "index": -1, "pass": "backward", "compute_dtype": ""}
        if not math.isfinite(float(r["loss"])):
            return {"layer": "loss", "index": -1, "pass": "forward", "compute_dtype": "float32"}
        return None


def _safe_norm(t):
    """L2 norm that does not overflow float32 for large entries (inf/nan propagate)."""
    import tensorflow as tf

    m = tf.reduce_max(tf.abs(t)) if t.shape.num_elements() != 0 else tf.constant(0.0, t.dtype)
    ok = tf.math.is_finite(m) & (m > 0)
    safe = tf.where(ok, m, tf.ones_like(m))
    return tf.where(ok, m * tf.sqrt(tf.reduce_sum(tf.square(t / safe))), m)


def _compute_dtype(layer) -> str:
    dt = getattr(layer, "compute_dtype", None)
    return str(getattr(dt, "name", dt) or "")
