"""The doctor's rules on per-step measurements: input-bound steps, mixed precision, gradients, dead units.

Pure functions of numbers (step and compute times, the loss-scale history, the
gradient probe's statistics): each returns a `Finding` or `None`. Backend-free;
the statistics come from `probe.GradientProbe` (TensorFlow and JAX), or any other probe
that reports the same dict.
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

from trainwell.callbacks.doctor.findings import DEFAULT_THRESHOLDS, Finding, fmt, known, median

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
    CPU, not because the data is late (measurements: bench/README.md, doctor_zoo).

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
    t_step, t_comp = median(step_times), min(compute_times)
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
    cpu = f", {fmt(1e3 * t_cpu)} ms waiting for a CPU" if t_cpu >= 5e-4 else ""
    summary = (f"steps wait for data {fmt(100 * frac)}% of the time ({fmt(1e3 * t_step)} ms per step, "
               f"{fmt(1e3 * t_comp)} ms of compute{cpu}).")
    return Finding.of("input_bound", step, ev, summary)


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
    too_low = math.isfinite(scale) and scale < th["amp_min_scale"]
    unstable = (len(recent) >= th["amp_min_backoffs"] and rate > th["amp_overflow_rate"]) or too_low
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
    fixes, causes, where = [], [], ""
    if located:
        layer = nonfinite["layer"]
        ev.update({"layer": layer, "layer_index": nonfinite.get("index", -1), "pass": nonfinite.get("pass", ""),
                   "layer_compute_dtype": nonfinite.get("compute_dtype", "")})
        if "max_abs" in nonfinite:
            ev["max_abs_before"] = nonfinite["max_abs"]
        fixes.append(
            f'keep layer "{layer}" in float32: build it with `dtype="float32"` '
            f"(its {nonfinite.get('pass', 'forward')} pass overflows float16, max 65504)"
        )
        causes.append(f'layer "{layer}" produces values beyond float16\'s range in the {nonfinite.get("pass")} pass')
        where = f' First non-finite values: layer "{layer}" ({nonfinite.get("pass")} pass).'
    if forward:
        summary = (f'mixed_float16: layer "{nonfinite["layer"]}" overflows float16 in the forward pass '
                   f"(loss scale {fmt(scale)}, {len(recent)} back-offs in {span} steps).")
    else:
        summary = (f"mixed_float16: the loss scale backed off {len(recent)} times in {span} steps "
                   f"(overflow rate {fmt(100 * rate)}%), now {fmt(scale)}.{where}")
    severity = "error" if located or too_low else "warning"
    return Finding.of("amp_instability", step, ev, summary, severity=severity, causes=causes, fixes=fixes)


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
    layers = [l for l in stats.get("layers", []) if l.get("kernel")]
    found = [_vanishing(layers, stats, step, th), _exploding(layers, stats, step, first_global_norm, lr, th)]
    return [f for f in found if f is not None]


def _vanishing(layers: list[dict], stats: dict[str, Any], step: int, th: dict) -> Finding | None:
    """Vanishing gradients: the first weighted layer's RMS gradient `vanish_ratio` x below the last one's."""
    if len(layers) < 2:
        return None
    first, last = layers[0], layers[-1]
    ratio = first["grad_rms"] / max(last["grad_rms"], 1e-30)
    if not (math.isfinite(ratio) and ratio < th["vanish_ratio"] and math.isfinite(last["grad_rms"])
            and last["grad_rms"] > 0):
        return None
    ev: dict[str, Any] = {
        "first_layer": first["name"],
        "last_layer": last["name"],
        "first_grad_rms": first["grad_rms"],
        "last_grad_rms": last["grad_rms"],
        "ratio": ratio,
        "weighted_layers": len(layers),
    }
    if stats.get("saturation"):
        ev["max_saturation"] = max(stats["saturation"].values())
    summary = (f'gradients shrink {fmt(1 / max(ratio, 1e-300))}x from the last weighted layer '
               f'("{last["name"]}") to the first ("{first["name"]}") over {len(layers)} layers.')
    return Finding.of("vanishing_gradients", step, ev, summary)


def _exploding(layers: list[dict], stats: dict[str, Any], step: int, first_global_norm: float | None,
               lr: float | None, th: dict) -> Finding | None:
    """Exploding gradients: non-finite ones behind a finite loss, a layer's gradient `explode_ratio` x its
    weight norm, or the global norm `explode_growth` x its first value."""
    gnorm = stats.get("global_norm", math.nan)
    ratios = [(l, l["grad_norm"] / max(l["weight_norm"], 1e-12)) for l in layers]
    # The first non-finite ratio, else the largest.
    worst = next((p for p in ratios if not math.isfinite(p[1])), None) or max(ratios, key=lambda p: p[1], default=None)
    growth = (
        gnorm / first_global_norm
        if first_global_norm and math.isfinite(first_global_norm) and first_global_norm > 0
        else math.nan
    )
    nonfinite = not stats.get("grads_finite", True) and stats.get("loss_finite", True)
    big_ratio = worst is not None and (not math.isfinite(worst[1]) or worst[1] > th["explode_ratio"])
    grew = math.isfinite(growth) and growth > th["explode_growth"]
    if not (nonfinite or big_ratio or grew):
        return None
    ev = {"global_grad_norm": gnorm, "grads_finite": int(bool(stats.get("grads_finite", True)))}
    if worst is not None:
        ev.update({"layer": worst[0]["name"], "grad_norm": worst[0]["grad_norm"],
                   "weight_norm": worst[0]["weight_norm"], "grad_over_weight": worst[1]})
    if math.isfinite(growth):
        ev["growth_since_start"] = growth
    ev.update(known(lr=lr))
    what = (
        "gradients are non-finite while the loss is finite"
        if nonfinite
        else f'layer "{worst[0]["name"]}" has a gradient {fmt(worst[1])}x its weight norm'
        if big_ratio
        else f"the gradient norm grew {fmt(growth)}x since the start"
    )
    summary = f"exploding gradients: {what} (global norm {fmt(gnorm)})."
    return Finding.of("exploding_gradients", step, ev, summary, severity="error" if nonfinite else "warning", lr=lr)


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
    ev.update({f"dead_fraction/{k}": v for k, v in bad.items()}, **known(lr=lr))
    affected = f" ({len(bad)} layers affected)" if len(bad) > 1 else ""
    summary = (f'{fmt(100 * bad[worst])}% of the units of layer "{worst}" output zero for every example'
               f"{affected}.")
    f = Finding.of("dead_units", step, ev, summary, lr=lr)
    return explain_dead_units(f, explained_by[0]) if explained_by else f


def explain_dead_units(finding: Finding, cause: str) -> Finding:
    """`finding` (a `dead_units` one) named as the consequence of the `cause` finding.

    Its causes and first fix point to the cause, and its summary says so. For a
    dead-units finding made before its cause was seen (`TrainingDoctor` then lists
    the cause first).

    Example:
    >>> f = check_dead_units({"d": 1.0}, {"d": 1.0}, 40)
    >>> explain_dead_units(f, "oscillation").fixes[0]
    'fix the oscillation finding first (see its fixes), then train again from scratch'
    """
    if "explained_by" in finding.evidence:
        return finding
    finding.evidence["explained_by"] = cause
    finding.fixes.insert(0, f"fix the {cause} finding first (see its fixes), then train again from scratch")
    finding.causes.insert(0, f"{cause}: its large steps pushed the units' inputs below zero for every example")
    finding.summary = finding.summary.removesuffix(".") + f", after the {cause}."
    return finding


def run_queue_delays() -> dict[int, float] | None:
    """Seconds each thread of this process has spent runnable but waiting for a CPU.

    Linux's scheduler statistics (`/proc/self/task/<tid>/schedstat`, the second
    field), by thread id. A step waits for a CPU when a thread it waits on does
    (`fit`'s, or a compute or data thread), so `TrainingDoctor` takes the largest
    increase of any thread over a span as the CPU wait of that span. `None` where
    the statistics are not available (other systems, or a kernel without them).

    Example:
    >>> d = run_queue_delays()
    >>> d is None or all(v >= 0 for v in d.values())
    True
    """
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


