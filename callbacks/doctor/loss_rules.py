"""The doctor's rules on the loss: divergence, oscillation, slow convergence, overfitting.

Pure functions of numbers (a `LossTracker`, epoch losses, the learning rate):
each returns a `Finding` or `None`, so each is tested on constructed numbers.
Backend-free.

Example:
>>> round(step_noise([1.0, 1.2] * 20), 3)
0.21
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

from trainwell.callbacks.doctor.findings import DEFAULT_THRESHOLDS, Finding, LossTracker, fmt, known, lr_text, median

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
    ev: dict[str, Any] = {"loss": last, "initial_loss": initial, "best_loss": tracker.best_median, **known(lr=lr)}
    reason = None
    if not weights_finite:
        reason = "the weights hold NaN/Inf"
        ev["weights_finite"] = 0
    elif tracker.losses and not math.isfinite(last):
        reason = f"the loss became {last}"
    elif len(tracker.losses) >= 3 and tracker.first and (
        (now := median(tracker.recent(3))) > 1e3 * max(abs(tracker.first[0]), 1e-12)
    ):
        ev["recent_loss"] = now
        reason = f"the loss rose from {fmt(tracker.first[0])} to {fmt(now)} within {tracker.steps} steps"
    elif len(tracker.losses) >= 10 and math.isfinite(initial):
        now = tracker.recent_median(10)
        best = tracker.best_median
        ev["recent_loss"] = now
        big = now > th["diverge_factor"] * max(best, 1e-12) and now > initial
        new_high = not math.isfinite(tracker.high_water) or now > 2.0 * tracker.high_water
        if big and new_high:
            reason = f"the loss rose from {fmt(best)} to {fmt(now)} (x{fmt(now / max(best, 1e-12))})"
    if reason is None:
        return None
    lower = f"lower the learning rate 10x{lr_text(lr)}" + (f", to {lr / 10:.3g}" if lr else "")
    return Finding.of("divergence", step, ev, f"training diverged: {reason}.", severity="error", fixes=[lower])


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
        elif direction * (x - ext_v) > 0:  # further on the way up (down)
            ext_i, ext_v = i, x
        elif big(ext_v, x):  # a turn: the extreme reached is a peak (trough)
            pts.append((ext_i, ext_v, "peak" if direction == 1 else "trough"))
            direction, ext_i, ext_v = -direction, i, x
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


def check_oscillation(  # one piece: the two signs, their evidence and text share a dozen values
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
    """Oscillation: the loss (5-step medians) swings up and down by large amounts, or above where it started.

    Two signs of a step too large for the curvature, either one enough (thresholds:
    `DEFAULT_THRESHOLDS`). Swings: `oscillation_peaks` peaks within the window,
    each swing moving the 5-step median by `oscillation_swing` x the loss scale, by
    a factor `oscillation_ratio` and by `oscillation_noise_z` x the noise of a
    5-step median (`chunk_noise`). Above the start: `oscillation_above` 5-step
    medians above the loss scale by `oscillation_rise` of it and by
    `oscillation_rise_z` x that noise; steps small enough for the curvature lower
    the loss, so a model worse than the mean prediction again and again is thrown
    around by its steps (the units they kill are a `dead_units` consequence).

    The loss scale is the larger of the initial loss and `reference`: a model
    that starts already trained (a second `fit`, fine-tuning) has an initial loss
    so low that its ordinary SGD noise would otherwise look like large swings.

    Args:
        tracker: The run's `LossTracker`.
        step: The current step.
        lr: The current learning rate, for the fixes. Defaults to `None`.
        momentum: The optimizer's momentum (or `beta_1`). Defaults to `None`.
        probe_losses: The losses on the fixed probe batch within the window (no
            sampling noise). Where the probes are at most half a period of the
            peaks apart, they must confirm the swings (one of them
            `oscillation_probe_rise` x the one before; fewer than 3: wait);
            probes further apart sample the swings at random phases and are not
            read. `None` (no probe) skips the confirmation; the loss above the
            start, a level, needs none. Defaults to `None`.
        probe_every: Steps between probes. Defaults to `None`.
        reference: The probe's `null_loss`, the loss of predicting the batch
            mean. Defaults to `None`.
        thresholds: Overrides of `DEFAULT_THRESHOLDS`. Defaults to `None`.

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
    gaps = [b[0] - a[0] for a, b in zip(peaks, peaks[1:])]  # in chunks, between consecutive peaks
    period = tracker.chunk * statistics.mean(gaps) if gaps else math.nan
    swings = len(peaks) >= int(th["oscillation_peaks"])
    rise = None
    resolved = probe_every is None or (math.isfinite(period) and 2 * probe_every <= period)
    if swings and probe_losses is not None and resolved:
        swings, rise = _probe_rise(probe_losses, th["oscillation_probe_rise"])
    bar = scale + max(th["oscillation_rise"] * scale, th["oscillation_rise_z"] * noise)
    above = [c for c in chunks if c > bar] if initial > 0 else []
    if not swings and len(above) < int(th["oscillation_above"]):
        return None
    troughs = [p[1] for p in pts if p[2] == "trough"]
    top = statistics.mean(p[1] for p in peaks) if peaks else max(chunks)  # the mean peak, or the highest median
    amp = top - (statistics.mean(troughs) if peaks and troughs else min(chunks))  # the mean trough, or the lowest
    ev: dict[str, Any] = {
        "peaks": len(peaks),
        "swing": amp,
        "swing_over_initial_loss": amp / abs(initial),
        "loss_scale_reference": scale,
        "swing_over_noise": amp / noise if noise > 0 else math.inf,
        "period_steps": period,
        "window_steps": tracker.chunk * len(chunks),
        "medians_above_start": len(above),
        "max_over_start": max(chunks) / scale,
    }
    if rise is not None:
        ev["probe_loss_rise"] = rise
    elif swings and probe_losses is not None:
        ev["probe_every_steps"] = probe_every  # too far apart to confirm (see above)
    ev.update(known(lr=lr, momentum=momentum))
    if swings:
        summary = (f"the loss swings up and down: {len(peaks)} peaks of {fmt(amp)} "
                   f"({fmt(100 * amp / abs(initial))}% of the initial loss) in the last {ev['window_steps']} "
                   "steps.")
    else:
        summary = (f"the loss swings above where it started: {len(above)} of the last {len(chunks)} "
                   f"{tracker.chunk}-step medians above {fmt(scale)} (the larger of the initial and the "
                   f"null-model loss), up to {fmt(max(chunks))} (+{fmt(100 * (max(chunks) / scale - 1))}%): "
                   "the steps make the model worse.")
    heavy = momentum is not None and momentum >= 0.95  # a heavy momentum goes before the LR
    causes = [f"momentum too high ({momentum:g}): the heavy ball overshoots the valley"] if heavy else []
    fixes = [f"lower the momentum from {momentum:g} to 0.9 (or beta_1=0.9 for Adam)"] if heavy else []
    return Finding.of("oscillation", step, ev, summary, causes=causes, fixes=fixes, lr=lr)


def _probe_rise(probe_losses: Sequence[float], bar: float) -> tuple[bool, float | None]:
    """Whether the probe losses confirm an oscillation (one of them `bar` x the one before), and their largest rise.

    Fewer than 3 finite probe losses confirm nothing yet (the rule waits).
    """
    pl = [x for x in probe_losses if math.isfinite(x)]
    if len(pl) < 3:
        return False, None
    rise = max(b / max(a, 1e-12) for a, b in zip(pl, pl[1:]))
    return rise >= bar, rise


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
    if reference is not None and math.isfinite(reference) and now < th["slow_level"] * reference:
        return None  # below the null-model loss: it has learned
    progress = (initial - now) / abs(initial)
    window_start = median(list(tracker.losses)[:10])
    window_progress = (window_start - now) / abs(window_start) if window_start else math.nan
    ev: dict[str, Any] = {
        "initial_loss": initial,
        "loss": now,
        "progress": progress,
        "window_progress": window_progress,
        "steps": tracker.steps,
        **known(lr=lr, update_ratio=update_ratio),
    }
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
    too_low = (update_ratio is not None and update_ratio < th["update_ratio_low"]) or (
        crawl and lr is not None and lr < 1e-4
    )
    causes, fixes = _slow_causes_and_fixes(explained_by, too_low, lr)
    kind = "rose" if progress < -th["slow_progress"] else "crawls" if crawl else "has plateaued"
    ratio = f", update/weight ratio {fmt(update_ratio)} per step" if update_ratio is not None else ""
    summary = (f"the loss {kind}: {fmt(initial)} -> {fmt(now)} "
               f"({-100 * progress:+.3g}% in {tracker.steps} steps){ratio}.")
    severity = "warning" if crawl else "info"
    return Finding.of("slow_convergence", step, ev, summary, severity=severity, causes=causes, fixes=fixes)


def _slow_causes_and_fixes(explained_by: Sequence[str], too_low: bool, lr: float | None) -> tuple[list, list]:
    """A slow convergence's causes and fixes: the findings that explain it, a too-low LR, or a plateau."""
    if explained_by:
        causes = [f"{', '.join(explained_by)}: the gradient does not reach (all) the weights"]
        fixes = [f"fix the {explained_by[0]} finding first (see its fixes)"]
    elif too_low:
        causes = ["learning rate too low: the weights barely move"]
        fixes = [
            f"raise the learning rate 10-100x{lr_text(lr)}" + (f", e.g. to {lr * 30:.3g}" if lr else ""),
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
    return causes, fixes


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
    summary = (f"validation loss rose {fmt(100 * rise)}% above its best (epoch {best_epoch + 1}: "
               f"{fmt(va[best_epoch])}) to {fmt(va[-1])} while the training loss fell to {fmt(tr[-1])}.")
    return Finding.of("overfitting", step, ev, summary, patience=patience, best_epoch=best_epoch + 1)


