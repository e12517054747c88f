"""What the LR range test's curve says: the suggestion rules, the noise judgement, `LRFindResult`.

The half of `trainwell.callbacks.lr_finder` that reads numbers only (no model,
no `fit`): fastai's suggestion rules "valley", "steep" and "minimum" and
trainwell's "peak" (see `lr_finder`'s docstring for what each means), the rule
that tells a suggestion from noise (`MIN_GAIN`, `NOISE_Z`, `judge_probes`) and the
result `lr_find` returns. `trainwell.callbacks.lr_finder` re-exports the public names.

Example:
>>> minimum([1e-3, 1e-2, 1e-1], [2.0, 1.0, 5.0])
(0.001, 1)
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from trainwell.callbacks.doctor import step_noise
from trainwell.io import new_figure, save_figure

__all__ = ["LRFindResult", "suggest", "valley", "steep", "minimum", "peak", "judge_probes", "SUGGESTERS",
           "MIN_GAIN", "NOISE_Z"]


# --------------------------------------------------------------------------- suggestions
def valley(lrs: Sequence[float], losses: Sequence[float]) -> tuple[float, int]:
    """fastai's "valley": 2/3 of the way down the longest descending stretch.

    Finds the longest (not necessarily contiguous) decreasing subsequence of the
    losses, and returns the LR at `start + int(len/3) + int(len/6)` of its span.

    Args:
        lrs: Learning rates, increasing.
        losses: Smoothed losses at those LRs.

    Returns:
        `(lr, index)`.

    Example:
    >>> valley([1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0], [2.0, 2.0, 1.9, 1.2, 0.8, 0.7, 3.0])
    (0.0001, 1)
    """
    n = len(losses)
    if n == 0:
        raise ValueError("valley() needs at least one loss.")
    max_start, max_end = 0, 0
    lds = [1] * n
    for i in range(1, n):
        for j in range(0, i):
            if losses[i] < losses[j] and lds[i] < lds[j] + 1:
                lds[i] = lds[j] + 1
            if lds[max_end] < lds[i]:
                max_end = i
                max_start = max_end - lds[max_end]
    sections = (max_end - max_start) / 3
    idx = min(max(max_start + int(sections) + int(sections / 2), 0), n - 1)
    return float(lrs[idx]), idx


def steep(lrs: Sequence[float], losses: Sequence[float]) -> tuple[float, int]:
    """fastai's "steep": the LR where the loss falls fastest against log(LR).

    Example:
    >>> steep([1e-3, 1e-2, 1e-1, 1.0], [2.0, 1.9, 1.0, 0.9])
    (0.01, 1)
    """
    lr = np.asarray(lrs, dtype=np.float64)
    lo = np.asarray(losses, dtype=np.float64)
    if len(lo) < 2:
        return float(lr[0]), 0
    grads = (lo[1:] - lo[:-1]) / (np.log(lr[1:]) - np.log(lr[:-1]))
    i = int(np.nanargmin(grads))
    return float(lr[i]), i


def _at_loss_minimum(lrs: Sequence[float], losses: Sequence[float], divisor: float) -> tuple[float, int]:
    """The LR at the lowest loss divided by `divisor`, and that step's index."""
    i = int(np.nanargmin(np.asarray(losses, dtype=np.float64)))
    return float(lrs[i]) / divisor, i


def minimum(lrs: Sequence[float], losses: Sequence[float]) -> tuple[float, int]:
    """fastai's "minimum": a tenth of the LR at the minimum loss.

    Example:
    >>> minimum([1e-3, 1e-2, 1e-1], [2.0, 1.0, 5.0])
    (0.001, 1)
    """
    return _at_loss_minimum(lrs, losses, 10.0)


def peak(lrs: Sequence[float], losses: Sequence[float]) -> tuple[float, int]:
    """Half the LR at the minimum loss: a peak LR for a warmup + decay schedule.

    Not one of fastai's. Smith's 1cycle policy (Smith 2018, "A disciplined
    approach to neural network hyper-parameters") takes its maximum LR from the
    range test near where the loss stops falling, because the warmup and the decay
    let a schedule peak higher than a constant LR can stay; the factor 1/2 (instead
    of "minimum"'s constant-LR 1/10) was chosen on the six calibration problems of
    `bench/lr_finder_quality.py` with warmup + cosine runs and checked on six
    held-out problems.

    Example:
    >>> peak([1e-3, 1e-2, 1e-1], [2.0, 1.0, 5.0])
    (0.005, 1)
    """
    return _at_loss_minimum(lrs, losses, 2.0)


#: The curve's suggestion rules by name.
SUGGESTERS = {"valley": valley, "steep": steep, "minimum": minimum, "peak": peak}

#: A suggestion is acted on only if the loss it rests on fell at least this fraction of
#: the starting loss below it (where a probe that learned nothing ends and where real
#: gains start: bench/README.md, `lr_finder_quality.py`)...
MIN_GAIN = 0.05
#: ...and by more than this many standard errors of the two losses compared (the
#: starting loss: the mean of the ramp's first steps; a probe's: the mean of its last
#: quarter). Probes are told apart from each other by the same bound.
NOISE_Z = 3.0


# --------------------------------------------------------------------------- result
@dataclasses.dataclass
class LRFindResult:
    """What the LR range test found.

    Attributes:
        lrs: The learning rate of each recorded step.
        losses: The smoothed (bias-corrected exponential moving average) loss.
        raw_losses: The loss of each step, unsmoothed.
        suggestion: The suggested (peak) learning rate: `suggestions[method]`.
        suggestions: `{"valley": lr, "steep": lr, "minimum": lr, "peak": lr}`.
        stopped: `"diverged"` (the smoothed loss passed `diverge_factor` x its
            best, or was non-finite), `"steps"` or `"data"` (the data ran out).
        method: Which suggestion is `suggestion`. Defaults to `"minimum"`.
        probes: With `method="probe"`: `{lr: mean loss over the last quarter of a
            short run at that LR}` (`inf` where it diverged). Defaults to `{}`.
        probe_steps: Steps of each probe. Defaults to `None`.
        probe_schedule: `"constant"` or `"warmup_cosine"`. Defaults to `None`.
        probe_noise: With `method="probe"`: `{lr: standard error of that probe's
            final loss}`. Defaults to `{}`.
        start_loss: The loss before training: the mean of the ramp's first tenth
            (at least 5 steps), where the LR is too low to move the weights.
            Defaults to `None`.
        start_noise: Its standard error. Defaults to `None`.
        reliable: `False` when the loss the suggestion rests on cannot be told
            apart from the starting loss (it fell by less than `MIN_GAIN` of it
            or within `NOISE_Z` standard errors), or the probes not from each
            other: `suggestion` is then the best measured, but noise picked it.
            `lr_find` warns, and `trainwell lr-find` writes nothing. Defaults to
            `True`.
        reason: Why it is not reliable, with the numbers; `None` when it is.
            Defaults to `None`.

    Example:
    >>> r = LRFindResult([1e-3, 1e-2], [1.0, 0.5], [1.0, 0.4], 1e-3, {"minimum": 1e-3}, "steps")
    >>> r.suggestion, r.reliable
    (0.001, True)
    """

    lrs: list[float]
    losses: list[float]
    raw_losses: list[float]
    suggestion: float | None
    suggestions: dict[str, float]
    stopped: str
    method: str = "minimum"
    probes: dict[float, float] = dataclasses.field(default_factory=dict)
    probe_steps: int | None = None
    probe_schedule: str | None = None
    probe_noise: dict[float, float] = dataclasses.field(default_factory=dict)
    start_loss: float | None = None
    start_noise: float | None = None
    reliable: bool = True
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        clean = lambda xs: [float(x) if math.isfinite(x) else None for x in xs]  # noqa: E731
        return {
            "suggestion": self.suggestion,
            "reliable": self.reliable,
            "reason": self.reason,
            "start_loss": self.start_loss,
            "start_noise": self.start_noise,
            "method": self.method,
            "suggestions": dict(self.suggestions),
            "stopped": self.stopped,
            "probes": [[float(lr), float(v) if math.isfinite(v) else None, self.probe_noise.get(lr)]
                       for lr, v in sorted(self.probes.items())],
            "probe_steps": self.probe_steps,
            "probe_schedule": self.probe_schedule,
            "lrs": clean(self.lrs),
            "losses": clean(self.losses),
            "raw_losses": clean(self.raw_losses),
        }

    def plot(self, path: str | os.PathLike) -> Path:
        """Writes the loss-vs-LR curve (log scale) with the suggestions as a PNG.

        Args:
            path: Target file (written atomically). Required.

        Returns:
            The path written.

        Example:
        >>> result.plot("lr_find.png")  # doctest: +SKIP
        """
        fig, axes = new_figure(figsize=(6, 4))
        ax = axes[0, 0]
        lrs = np.asarray(self.lrs, dtype=np.float64)
        raw = np.asarray(self.raw_losses, dtype=np.float64)
        sm = np.asarray(self.losses, dtype=np.float64)
        finite = np.isfinite(sm)
        if len(lrs):
            ax.plot(lrs, np.where(np.isfinite(raw), raw, np.nan), color="0.75", lw=0.8, label="loss")
            ax.plot(lrs, np.where(finite, sm, np.nan), color="C0", lw=1.8, label="smoothed loss")
            if finite.any():
                shown = np.concatenate([sm[finite], [v for v in self.probes.values() if math.isfinite(v)]])
                lo, hi = np.nanmin(shown), np.nanmax(sm[finite])
                first = sm[finite][0]
                top = min(hi, first + 2.0 * max(first - lo, 1e-12)) if hi > first else hi
                ax.set_ylim(lo - 0.05 * max(top - lo, 1e-12), top + 0.05 * max(top - lo, 1e-12))
        if self.probes:
            pl = sorted(self.probes)
            pv = [self.probes[k] if math.isfinite(self.probes[k]) else np.nan for k in pl]
            ax.plot(pl, pv, "x", color="C4", ms=8, mew=2,
                    label=f"probes: loss after {self.probe_steps} steps ({self.probe_schedule})")
        colors = {"valley": "C3", "steep": "C2", "minimum": "C1", "probe": "C4"}
        for name, lr in self.suggestions.items():
            star = " (suggestion)" if name == self.method else ""
            ax.axvline(lr, color=colors.get(name, "k"), ls="--", lw=2 if star else 1, label=f"{name}: {lr:.2g}{star}")
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("loss")
        ax.set_title(f"LR range test ({len(lrs)} steps, stopped: {self.stopped})")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        fig.tight_layout()
        return save_figure(fig, path)


def suggest(lrs: Sequence[float], losses: Sequence[float], steps: int) -> dict[str, float]:
    """fastai's suggestions from a recorded curve.

    As fastai: the first `steps // 10` and the last 5 records are dropped (the
    start is flat, the end is diverging), and the curve is cut at the first NaN.
    Falls back to the whole curve when that leaves fewer than 3 points.

    Example:
    >>> lrs = list(np.geomspace(1e-5, 1.0, 30))
    >>> losses = [2.0] * 10 + list(np.linspace(2.0, 0.5, 15)) + [1.0, 2.0, 4.0, 8.0, 16.0]
    >>> round(suggest(lrs, losses, 30)["valley"], 5)
    0.00574
    """
    cut_l, cut_x = _cut(lrs, losses, steps)
    if not cut_x:
        return {}
    return {name: fn(cut_l, cut_x)[0] for name, fn in SUGGESTERS.items()}


def _cut(lrs: Sequence[float], losses: Sequence[float], steps: int) -> tuple[list[float], list[float]]:
    """The part of the curve the suggestions read (see `suggest`)."""
    lrs = [float(x) for x in lrs]
    losses = [float(x) for x in losses]
    lo, hi = steps // 10, len(losses) - 5
    cut_l, cut_x = lrs[lo:hi], losses[lo:hi]
    bad = [i for i, x in enumerate(cut_x) if not math.isfinite(x)]
    if bad:
        cut_l, cut_x = cut_l[: bad[0]], cut_x[: bad[0]]
    if len(cut_x) < 3:
        good = [i for i, x in enumerate(losses) if math.isfinite(x)]
        cut_l, cut_x = [lrs[i] for i in good], [losses[i] for i in good]
    return cut_l, cut_x


def _mean_and_error(xs: Sequence[float]) -> tuple[float, float]:
    """The mean of the finite step losses and its standard error, the steps' noise
    (`step_noise`: from their differences, so a trend is not taken for noise) over
    sqrt(n); `nan` error with fewer than 3."""
    xs = [x for x in xs if math.isfinite(x)]
    mean = float(np.mean(xs)) if xs else math.nan
    return mean, step_noise(xs) / math.sqrt(len(xs)) if xs else math.nan


def _below(start: float, start_se: float, best: float, best_se: float) -> str | None:
    """`None` if `best` lies clearly below `start` (by `MIN_GAIN` of it and `NOISE_Z`
    standard errors), else a description of the shortfall."""
    noise = math.hypot(start_se, best_se)
    gain = start - best
    if not (math.isfinite(gain) and math.isfinite(noise)):
        return f"its noise could not be measured (start {start:.4g}, best {best:.4g})"
    if gain >= MIN_GAIN * abs(start) and gain > NOISE_Z * noise:
        return None
    return (f"{best:.4g} at best against {start:.4g} at the start ({100 * gain / abs(start):.2g}% lower, "
            f"noise +-{noise:.2g}; needs {100 * MIN_GAIN:g}% and {NOISE_Z:g} standard errors)")


def judge_probes(start: float, start_se: float, probes: dict[float, float],
                 noise: dict[float, float]) -> str | None:
    """Why the probes' best LR is not to be trusted, or `None` if it is.

    Untrustworthy when the best probe's final loss is not clearly below the
    starting loss (the probes did not learn) or not clearly below every other
    probe's (the LR made no difference that the noise does not explain); "clearly":
    by `MIN_GAIN` of the starting loss and `NOISE_Z` standard errors.

    Args:
        start: The starting loss. Required.
        start_se: Its standard error. Required.
        probes: `{lr: final loss}` (`inf` where a probe diverged). Required.
        noise: `{lr: standard error of that final loss}`. Required.

    Example:
    >>> judge_probes(2.30, 0.001, {0.1: 2.29, 0.03: 2.30}, {0.1: 0.01, 0.03: 0.01})[:24]
    'the probes did not learn'
    >>> judge_probes(2.30, 0.001, {0.1: 0.9, 0.03: 1.4}, {0.1: 0.01, 0.03: 0.01}) is None
    True
    """
    finite = {lr: v for lr, v in probes.items() if math.isfinite(v)}
    if not finite:
        return f"every probe diverged ({len(probes)} short runs at {min(probes):.3g} to {max(probes):.3g})"
    best = min(finite, key=finite.get)
    short = _below(start, start_se, finite[best], noise.get(best, math.nan))
    if short is not None:
        return f"the probes did not learn: the best probe (LR {best:.3g}) ended at {short}"
    apart = [lr for lr, v in finite.items() if lr != best and v - finite[best] > NOISE_Z * math.hypot(
        noise.get(lr, math.nan), noise.get(best, math.nan))]
    if apart:
        return None
    if len(finite) == 1:
        return f"only one probe (LR {best:.3g}) ended finite: the others diverged, so nothing tells it from its neighbours"
    lo, hi = min(finite.values()), max(finite.values())
    return (f"the probes could not be told apart: the {len(finite)} that ended finite ended at {lo:.4g} to "
            f"{hi:.4g}, within {NOISE_Z:g} standard errors of the best (LR {best:.3g})")


def _judge_curve(raw: Sequence[float], smoothed: Sequence[float], start: float, start_se: float,
                 smooth: float) -> str | None:
    """Why the range test's curve is not to be trusted (it never fell clearly below its
    start), or `None`. The smoothed minimum's noise: the raw losses' around it
    (`step_noise`), times what the moving average keeps of it,
    sqrt((1 - smooth) / (1 + smooth))."""
    sm = np.asarray(smoothed, dtype=np.float64)
    if not np.isfinite(sm).any():
        return "the range test recorded no finite loss"
    i = int(np.nanargmin(sm))
    se = step_noise(raw[max(i - 10, 0): i + 11]) * math.sqrt((1 - smooth) / (1 + smooth))
    short = _below(start, start_se, float(sm[i]), se)
    return None if short is None else f"the range test's loss never fell clearly below its start: {short}"
