"""`TrainingDoctor`: says what is wrong with a training run, shows the evidence, says what to change.

The callback gathers the numbers during `fit` (per-step losses, step and compute
times, the loss scale, the gradient probe's statistics) and hands them to the
rules (`loss_rules`, `step_rules`), which decide: one class whose hooks share
that gathered state, the judging elsewhere.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

import keras
import numpy as np

from trainwell import runtime
from trainwell.callbacks.base import StatefulCallback, constructor_config
from trainwell.callbacks.doctor.findings import CODES, DEFAULT_THRESHOLDS, Finding, LossTracker, jsonable, median, unjson
from trainwell.callbacks.doctor.loss_rules import (
    check_divergence,
    check_oscillation,
    check_overfitting,
    check_slow_convergence,
)
from trainwell.callbacks.doctor.probe import GradientProbe, current_loss_scale
from trainwell.callbacks.doctor.step_rules import (
    check_amp,
    check_dead_units,
    check_gradients,
    check_input_bound,
    explain_dead_units,
    run_queue_delays,
)
from trainwell.compat.backend import callback_model
from trainwell.compat.keras_internals import adapter_sample_source, fit_epoch_iterator
from trainwell.compat.learning_rate import current_lr, inner_optimizer
from trainwell.io import atomic_write_json
from trainwell.validation import invalid_argument, is_int

__all__ = ["TrainingDoctor", "Finding"]

_DIAGNOSTICS_FILE = "diagnostics.json"
_MAX_SCALE_HISTORY = 500
_MAX_BACKOFFS = 1000
#: Examples in a probe batch taken from the fit's data (its cost: bench/README.md, doctor_overhead).
_AUTO_PROBE_SIZE = 32
#: A run shorter than this gets no verdicts at its end: the loss rules need a few
#: 5-step medians and the input-bound check a few timed steps.
_MIN_STEPS_TO_JUDGE = 30
_CONSEQUENCES_OF_DIVERGENCE = ("dead_units", "vanishing_gradients", "oscillation", "slow_convergence")
#: Attributes saved as they are by `get_state` (JSON numbers, lists and dicts).
_STATE = ("step", "probes", "epoch_losses", "epoch_val_losses", "scale_history", "backoff_steps",
          "first_global_norm", "prev_dead", "probe_losses", "null_loss")


def _current_lr(optimizer) -> float | None:
    try:
        return float(current_lr(optimizer))
    except Exception:
        return None


def _momentum(optimizer) -> float | None:
    """The optimizer's `momentum` (SGD, RMSprop) or `beta_1` (Adam and kin), if one is > 0."""
    inner = inner_optimizer(optimizer)
    for attr in ("momentum", "beta_1"):
        try:
            v = float(keras.ops.convert_to_numpy(getattr(inner, attr)))
        except (AttributeError, TypeError, ValueError):  # none, or not a number
            continue
        if v > 0:
            return v
    return None


def _batch_from_iterator(epoch_iterator):
    """`(batch, train_batch_size)` from a `fit` call's data, without consuming it.

    Arrays: a random (seeded, not the global RNG) sample of one batch size.
    `tf.data.Dataset`: its first batch from a fresh iterator. `PyDataset`: item
    0. Python generators are never touched (reading one would consume it).
    `(None, None)` without an iterator (`epoch_iterator` is `None`).
    """
    adapter = getattr(epoch_iterator, "data_adapter", None)
    if adapter is None:
        return None, None
    try:
        train_bs = adapter.batch_size
    except Exception:
        train_bs = None
    kind, source = adapter_sample_source(adapter)
    if kind == "arrays":
        inputs, n, bs = source
        if n <= 0 or bs <= 0:
            return None, train_bs
        idx = np.sort(np.random.default_rng(0).choice(n, size=min(bs, n, _AUTO_PROBE_SIZE), replace=False))

        def take(a):
            if a is None:
                return None
            if hasattr(a, "numpy") and not isinstance(a, np.ndarray):
                import tensorflow as tf  # lazy: only a TensorFlow tensor input gets here, none imported otherwise

                return tf.gather(a, idx)
            return np.asarray(a)[idx]

        return keras.tree.map_structure(take, inputs), bs
    if kind not in ("dataset", "pydataset"):
        return None, train_bs
    batch = next(iter(source.take(1))) if kind == "dataset" else source[0]
    batch = tuple(batch) if isinstance(batch, list) else batch
    head = keras.tree.map_structure(lambda t: None if t is None else t[:_AUTO_PROBE_SIZE], batch)
    return head, train_bs or _batch_len(batch)


def _batch_len(batch) -> int | None:
    try:
        x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
        first = next(iter(keras.tree.flatten(x)))
        return int(first.shape[0])
    except Exception:
        return None


class TrainingDoctor(StatefulCallback):
    """Diagnoses a training run: what is wrong, the evidence, what to change.

    Watches the losses and metrics every step and, every `every_n_steps` steps
    (and at the first step, and at the end of a run of at least 30 steps, so a
    run shorter than `every_n_steps` gets verdicts too), runs a
    `trainwell.callbacks.doctor.probe.GradientProbe` on a
    fixed probe batch: per-layer gradient norms, update-to-weight ratios,
    activation saturation and dead-ReLU fractions, computed by a separate
    compiled function (the model's `train_step` is untouched, and the probe
    restores every non-trainable and metric variable it touched, so training is
    unchanged). It diagnoses, as `Finding`s in `self.findings`:

    - `divergence`: a non-finite loss or weights (NaN weights can hide behind a
      finite loss), or a loss that rose `diverge_factor` x above its best, above
      its initial value, to a new high.
    - `oscillation`: large repeated swings of the loss (5-step medians), each
      well beyond the minibatch noise, or swings that stand above where the loss
      started and above the null-model loss again and again (the steps make the
      model worse than predicting the mean).
    - `slow_convergence`: the loss barely moved after `window` steps (with the
      update-to-weight ratio telling a too-low LR from a plateau), or stalled.
    - `vanishing_gradients` / `exploding_gradients`: from the probe's per-layer
      gradients (first vs last layer; gradient vs weight norm; growth).
    - `dead_units`: ReLU layers whose units are zero for the whole probe batch
      (with an oscillation, named as its consequence and listed after it, also
      when a probe saw them first).
    - `amp_instability`: under `mixed_float16`, the loss scale backing off again
      and again (the overflow rate), and the first layer whose forward or
      backward pass produced NaN/Inf, with the fix of keeping it in float32.
    - `overfitting`: validation loss rising above its best while the training
      loss falls.
    - `input_bound`: steps that take much longer than their compute (timed on
      the probe batch) and than the time the run's threads waited for a CPU
      (on Linux; a machine shared with busy processes slows steps without any
      data wait), i.e. the run waits for data.

    Each code is reported once per run: one printed line when found, the
    finding in `self.findings` and in `run_dir/diagnostics.json` (rewritten
    atomically), and a summary at the end. A healthy run reports nothing. The
    loss-scale history is kept (and written to the epoch logs as `loss_scale`, so
    `CSVLogger`/`History` record it: list this callback before them). With
    `run_dir`, probe statistics go to TensorBoard under
    `run_dir/tensorboard/doctor`. Only the chief writes files.

    The probe batch: `probe_batch`, else up to 32 examples taken from the `fit`
    call's own data at `on_train_begin` (arrays: a seeded random sample; a
    `tf.data.Dataset`: the head of its first batch; a `PyDataset`: of item 0).
    Python generators are never read (that would consume them): pass
    `probe_batch` then, or the gradient, activation and input-bound checks are
    skipped. Reading a `tf.data.Dataset` makes one iterator of it, which moves a
    seeded `shuffle(..., reshuffle_each_iteration=True)` on by one epoch: the run
    then sees another (equally valid) order than the same run without the
    doctor, and a resumed run stays exact (the doctor reads it at every start).
    Pass `probe_batch` for a run that matches one without the doctor. For the input-bound check the probe's compute time is scaled
    linearly to the training batch size (an over-estimate on accelerators,
    which only makes the check more conservative).

    Cost: one probe (a forward and backward pass of 32 examples) every
    `every_n_steps` steps and one at the end of the run (two more in a run with
    fewer than three timed probes whose steps look slow, to time the compute
    again), plus some Python per step (`bench/doctor_overhead.py`). The doctor
    implements `on_train_batch_end`, so Keras converts the logs to Python
    numbers after every step (as for any batch-level callback); on an
    accelerator that is one device sync per step.

    Extends no Keras built-in: `TensorBoard(histogram_freq=...)` logs weights,
    not gradients, and nothing in Keras diagnoses. A `StatefulCallback`: the
    findings, counters and loss windows survive a restart through trainwell's
    `Checkpoint`, so a resumed run does not report the same problem again.

    Args:
        every_n_steps: Steps between probes (and the loss-rule checks).
            Defaults to `100`.
        probe_batch: `(x, y)` or `(x, y, sample_weight)`, ideally one training
            batch; `None` takes one from the fit's data (see above).
            Defaults to `None`.
        run_dir: Directory for `diagnostics.json` and
            `tensorboard/doctor`; `None` writes nothing. Defaults to `None`.
        verbose: `0` silent, `1` one line per new finding and a summary.
            Defaults to `1`.
        window: Steps in the loss windows (slow-convergence horizon,
            oscillation window, overflow-rate window). Defaults to `200`.
        checks: The codes to check (a subset of `trainwell.callbacks.doctor.CODES`);
            `None` checks all. Defaults to `None`.
        thresholds: Overrides of `trainwell.callbacks.doctor.DEFAULT_THRESHOLDS`.
            Defaults to `None`.
        track_updates: Measure update-to-weight ratios (keeps one device-side
            copy of the trainable weights). Defaults to `True`.

    Example:
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
    ...                           keras.layers.Dense(1)])
    >>> model.compile(keras.optimizers.SGD(0.05), "mse")
    >>> x = np.random.default_rng(0).normal(size=(256, 4)).astype("float32")
    >>> doctor = TrainingDoctor(every_n_steps=20, verbose=0)
    >>> _ = model.fit(x, x[:, :1], batch_size=32, epochs=2, verbose=0, callbacks=[doctor])
    >>> doctor.findings
    []
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        probe_batch=None,
        run_dir: str | os.PathLike | None = None,
        verbose: int = 1,
        window: int = 200,
        checks: list[str] | tuple[str, ...] | None = None,
        thresholds: dict[str, float] | None = None,
        track_updates: bool = True,
    ) -> None:
        if not is_int(every_n_steps) or every_n_steps < 1:
            raise invalid_argument("every_n_steps", "an integer >= 1", every_n_steps)
        if probe_batch is not None and not isinstance(probe_batch, (tuple, list)):
            raise invalid_argument("probe_batch", "None or a tuple `(x, y)` / `(x, y, sample_weight)`", type(probe_batch).__name__)
        if probe_batch is not None and not 1 <= len(probe_batch) <= 3:
            raise invalid_argument("probe_batch", "a tuple of 1 to 3 items `(x, y, sample_weight)`", f"<{len(probe_batch)} items>")
        if verbose not in (0, 1, 2):
            raise invalid_argument("verbose", "0, 1 or 2", verbose)
        if not is_int(window) or window < 20:
            raise invalid_argument("window", "an integer >= 20", window)
        if checks is not None and (isinstance(checks, str) or any(c not in CODES for c in checks)):
            raise invalid_argument("checks", f"None or a list of codes from {CODES}", checks)
        if thresholds is not None and (
            not isinstance(thresholds, dict) or any(k not in DEFAULT_THRESHOLDS for k in thresholds)
        ):
            raise invalid_argument("thresholds", f"None or a dict with keys from {sorted(DEFAULT_THRESHOLDS)}", thresholds)
        if not isinstance(track_updates, bool):
            raise invalid_argument("track_updates", "a bool", track_updates)
        self.every_n_steps = int(every_n_steps)
        self.probe_batch = probe_batch
        self.run_dir = None if run_dir is None else os.fspath(run_dir)
        self.verbose = verbose
        self.window = int(window)
        self.checks = None if checks is None else list(checks)
        self.thresholds = None if thresholds is None else dict(thresholds)
        self.track_updates = track_updates
        self._probe = None
        self._writer = None
        super().__init__()

    # ---------------------------------------------------------------- config / state
    def get_config(self) -> dict[str, Any]:
        """Returns the constructor arguments (`probe_batch` as given: data, not JSON)."""
        return constructor_config(self)

    def reset_state(self) -> None:
        """Fresh-run state: no findings, empty windows."""
        self.findings: list[Finding] = []
        self.step = 0
        self._begin_batch = 0  # the batch index of the last `on_train_batch_begin`
        self.probes = 0
        self.tracker = LossTracker(window=self.window)
        self.epoch_losses: list[float] = []
        self.epoch_val_losses: list[float] = []
        self.scale_history: list[list[float]] = []   # [step, scale] at each change
        self.backoff_steps: list[int] = []
        self.first_global_norm: float | None = None
        self.prev_dead: dict[str, float] | None = None
        self.probe_losses: list[list[float]] = []  # [step, loss on the probe batch]
        self.null_loss: float | None = None  # the probe's null-model loss at the first probe
        self.step_times: deque[float] = deque(maxlen=100)
        self.compute_times: deque[float] = deque(maxlen=10)
        self.last_probe: dict[str, Any] = {}
        self._located = False
        self._trained = False
        self._last_scale: float | None = None
        self._nonfinite: dict | None = None
        self._amp_checked_at = 0
        self._last_locate = -(10**9)

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable state: findings, counters, loss windows, loss-scale history."""
        state = {k: jsonable(getattr(self, k)) for k in _STATE}
        findings = [f.to_dict() for f in self.findings]
        # "begin_batch": a mid-epoch resume mutes the resumed step's begin hook (it ran before the checkpoint);
        # without it that step counted every batch skipped before it
        return {**state, "findings": findings, "tracker": self.tracker.get_state(), "located": self._located,
                "begin_batch": int(self._begin_batch)}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores `get_state()`'s output."""
        super().set_state(state)
        self.reset_state()
        for k in _STATE:
            if k in state:
                setattr(self, k, unjson(state[k]))
        self.findings = [Finding.from_dict(d) for d in state.get("findings", [])]
        self.tracker.set_state(state.get("tracker", {}))
        self._located = bool(state.get("located", False))
        self._begin_batch = int(state.get("begin_batch", 0))
        if self.scale_history:
            self._last_scale = self.scale_history[-1][1]

    # ---------------------------------------------------------------- helpers
    def _enabled(self, code: str) -> bool:
        return self.checks is None or code in self.checks

    def _open(self, code: str) -> bool:
        """Whether `code` is checked and not found yet (each code is reported once per run)."""
        return self._enabled(code) and code not in self.codes

    @property
    def codes(self) -> list[str]:
        """Codes of the findings so far, in the order found (a cause found after its consequence goes before it)."""
        return [f.code for f in self.findings]

    def _report(self, finding: Finding | None) -> None:
        if finding is None or not self._open(finding.code):
            return
        if finding.code in _CONSEQUENCES_OF_DIVERGENCE and "divergence" in self.codes:
            return  # after a divergence these describe the wreck, not the cause
        self.findings.append(finding)
        dead = next((f for f in self.findings if f.code == "dead_units"), None)
        if dead is not None and finding.code in ("oscillation", "divergence"):
            # Units its large steps killed may have been seen first (a probe every few steps
            # sees them before the loss has swung often enough): the cause goes before them.
            self.findings = [f for f in self.findings if f is not dead] + [explain_dead_units(dead, finding.code)]
        if self.verbose:
            print(f"\nTrainingDoctor: {finding.line()}", flush=True)
        self._write_json()

    def _is_lso(self) -> bool:
        # each step: no JAX state sync (`callback_model`)
        return isinstance(getattr(callback_model(self), "optimizer", None), keras.optimizers.LossScaleOptimizer)

    def _chief(self) -> bool:
        return runtime.is_chief(getattr(self.model, "distribute_strategy", None))

    # ---------------------------------------------------------------- hooks
    def on_train_begin(self, logs=None) -> None:
        super().on_train_begin(logs)
        self._th = {**DEFAULT_THRESHOLDS, **(self.thresholds or {})}
        self._t_begin = None
        self._last_check = None
        self._epoch_begin_step = self.step
        self._trained = False  # whether this fit trained a step (a rerun of a finished run trains none)
        self._run_queue: deque[tuple[int, dict]] = deque(maxlen=16)  # (step, run_queue_delays()) at checks
        self._probe = None
        self._probe_error = None
        self._train_bs = None
        self._last_scale = self.scale_history[-1][1] if self.scale_history else None
        if self._last_scale is None and self._is_lso():
            opt = self.model.optimizer
            self._last_scale = current_loss_scale(self.model) if opt.built else float(opt.initial_scale)
            self.scale_history.append([self.step, self._last_scale])
        batch = self.probe_batch
        try:
            auto, self._train_bs = _batch_from_iterator(fit_epoch_iterator(self.model))
            batch = auto if batch is None else batch
        except Exception as e:  # never let the doctor break training
            self._probe_error = f"could not take a probe batch from the data: {e}"
        if batch is not None:
            try:
                self._probe = GradientProbe(self.model, batch, track_updates=self.track_updates)
            except Exception as e:
                self._probe_error = f"probe disabled: {type(e).__name__}: {e}"
        elif self._probe_error is None:
            self._probe_error = "no probe batch (pass probe_batch=(x, y)): gradient, activation and input-bound checks skipped"
        if self._probe_error and self.verbose:
            print(f"TrainingDoctor: {self._probe_error}", flush=True)
        self._writer = None
        if self.run_dir is not None and self._chief():
            import tensorflow as tf  # lazy: TensorFlow's summaries, only for a run directory

            try:
                self._writer = tf.summary.create_file_writer(str(Path(self.run_dir) / "tensorboard" / "doctor"))
            except Exception:  # an unwritable run directory must not stop training
                self._writer = None

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self.tracker.new_epoch()
        self._epoch_begin_step = self.step

    def _probe_due(self, before: int, after: int) -> bool:
        """Whether the steps from `before` to `after` reach a probe's step (every `every_n_steps`, and the first)."""
        return after // self.every_n_steps > before // self.every_n_steps or before == 0

    def on_train_batch_begin(self, batch, logs=None) -> None:
        self._begin_batch = int(batch)
        if self._probe is not None and self.track_updates:
            spe = int(getattr(callback_model(self), "steps_per_execution", 1) or 1)  # each step: no JAX state sync
            if self._probe_due(self.step, self.step + spe):
                with contextlib.suppress(Exception):  # without it the probe's update ratios are masked
                    self._probe.snapshot()
        self._t_begin = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None) -> None:
        t_end = time.perf_counter()
        n = max(int(batch) - self._begin_batch + 1, 1)
        before = self.step
        self.step += n
        self._trained = True
        if self._t_begin is not None and self._begin_batch > 0:
            # The first step of an epoch also starts the epoch's data iterator.
            self.step_times.append((t_end - self._t_begin) / n)
        logs = logs or {}
        loss = logs.get("loss")
        if loss is not None:
            self.tracker.update_from_running_mean(int(batch), float(loss))
        lso = self._is_lso()
        if lso:
            self._track_loss_scale()
        step_loss = self.tracker.losses[-1] if self.tracker.losses else math.nan
        if not math.isfinite(step_loss) and self._probe is not None:
            if lso:  # overflow may be transient: locate again at most once per probe interval
                if "amp_instability" not in self.codes and self.step - self._last_locate >= self.every_n_steps:
                    self._last_locate = self.step
                    self._run_probe(locate_only=True)
            elif not self._located:
                self._run_probe(locate_only=True)
        # Under a LossScaleOptimizer a non-finite loss is a skipped step, not a divergence.
        judge = not (lso and not math.isfinite(step_loss)) and self._open("divergence")
        if judge and check_divergence(self.tracker, self.step, thresholds=self._th):
            self._report(self._with_lr(check_divergence, self.tracker))  # the same verdict, with the LR read now
        if lso and self._open("amp_instability") and len(self.backoff_steps) != self._amp_checked_at:
            self._amp_checked_at = len(self.backoff_steps)
            self._check_amp()
        if self._probe_due(before, self.step):
            self._check()

    def _with_lr(self, rule, *args) -> Finding | None:
        return rule(*args, self.step, lr=_current_lr(self.model.optimizer), thresholds=self._th)

    def _track_loss_scale(self) -> None:
        model = callback_model(self)  # each step: no JAX state sync; the scale is read from the live state
        if not getattr(model.optimizer, "built", False):
            return
        scale = current_loss_scale(model)
        if self._last_scale is not None and scale < self._last_scale:
            k = int(round(math.log2(self._last_scale / scale))) if scale > 0 else 1
            self.backoff_steps.extend([self.step] * max(k, 1))
            del self.backoff_steps[:-_MAX_BACKOFFS]
        if self._last_scale is None or scale != self._last_scale:
            self.scale_history.append([self.step, scale])
            del self.scale_history[:-_MAX_SCALE_HISTORY]
            self._last_scale = scale

    def _check_amp(self, nonfinite: dict | None = None) -> None:
        scales = [s for _, s in self.scale_history]
        amp = functools.partial(check_amp, scales, self.backoff_steps, self.step, window=self.window,
                                thresholds=self._th)
        f = amp(nonfinite=nonfinite)
        if f is not None and nonfinite is None and self._probe is not None:
            # Unstable: name the layer that overflows now (one extra probe, once).
            self._nonfinite = None
            self._run_probe(locate_only=True)
            if self._nonfinite is not None:
                f = amp(nonfinite=self._nonfinite)
        self._report(f)

    def _check(self) -> None:
        """The interval's verdicts: a probe, then the rules, causes before consequences.

        Oscillation goes before the probe's rules (dead units are often its work) and
        slow convergence after them (dead units or vanishing gradients explain it).
        """
        self._last_check = self.step
        stats = self._run_probe() if self._probe is not None else None
        lr = _current_lr(self.model.optimizer)
        if self._open("oscillation"):
            since = self.step - max(self.window, 3 * self.every_n_steps)
            probe = None if self._probe is None else [l for s, l in self.probe_losses if s > since]
            self._report(check_oscillation(
                self.tracker, self.step, lr=lr, momentum=_momentum(self.model.optimizer), probe_losses=probe,
                probe_every=self.every_n_steps, reference=self.null_loss, thresholds=self._th,
            ))
        if stats is not None:
            self._probe_rules(stats, lr)
        if self._open("slow_convergence") and not {"oscillation", "divergence"} & set(self.codes):
            causes = [c for c in self.codes if c in ("vanishing_gradients", "dead_units", "exploding_gradients")]
            self._report(check_slow_convergence(
                self.tracker, self.step, lr=lr, update_ratio=self.last_probe.get("update_ratio"), thresholds=self._th,
                explained_by=causes, reference=self.null_loss,
            ))

    def _run_probe(self, locate_only: bool = False) -> dict[str, Any] | None:
        """Runs the probe and records its statistics; returns them (`None` if it failed or `locate_only`)."""
        try:
            t0 = time.perf_counter()
            stats = self._probe.run()
            dt = time.perf_counter() - t0
        except Exception as e:
            self._probe_error = f"probe failed and was disabled: {type(e).__name__}: {e}"
            if self.verbose:
                print(f"TrainingDoctor: {self._probe_error}", flush=True)
            self._probe = None
            return None
        lso = self._is_lso()
        nonfinite = stats.get("nonfinite")
        if nonfinite is not None and lso:
            # Under a LossScaleOptimizer overflow in float16 layers is the loss scale's
            # business unless it keeps happening (the rate rule) or is in the forward pass.
            self._nonfinite = nonfinite
            if nonfinite.get("pass") == "forward" and "amp_instability" not in self.codes:
                self._check_amp(nonfinite)
        elif nonfinite is not None and not self._located:
            self._located = True
            if self._enabled("divergence"):
                f = self._with_lr(check_divergence, self.tracker)
                if f is None and not stats["weights_finite"]:
                    f = check_divergence(self.tracker, self.step, weights_finite=False, thresholds=self._th)
                if f is not None:
                    f.evidence["first_nonfinite_layer"] = nonfinite["layer"]
                    f.evidence["first_nonfinite_pass"] = nonfinite["pass"]
                    f.summary += f' First NaN/Inf: layer "{nonfinite["layer"]}" ({nonfinite["pass"]} pass).'
                self._report(f)
        if locate_only:
            return None
        self.probes += 1
        if self.probes > 1:  # the first call traces the function
            self._record_compute(dt)
        self.probe_losses.append([self.step, stats["loss"]])
        if self.null_loss is None and math.isfinite(stats.get("null_loss", math.nan)):
            self.null_loss = stats["null_loss"]
        del self.probe_losses[:-50]
        kept = ("loss", "global_norm", "update_ratio", "loss_scale")
        self.last_probe = {"step": self.step, **{k: stats[k] for k in kept}}
        if not stats["weights_finite"] and self._enabled("divergence"):
            self._report(check_divergence(self.tracker, self.step, weights_finite=False, thresholds=self._th))
        if self.first_global_norm is None and math.isfinite(stats["global_norm"]) and stats["global_norm"] > 0:
            self.first_global_norm = stats["global_norm"]
        self._write_tensorboard(stats)
        return stats

    def _record_compute(self, seconds: float) -> None:
        """Records one timing of the probe as the compute time of a training batch."""
        pb = self._probe.batch_size
        self.compute_times.append(seconds * (self._train_bs / pb if self._train_bs and pb else 1.0))

    def _cpu_wait_per_step(self) -> float | None:
        """CPU wait per step since the check about `len(step_times)` steps ago.

        The largest run-queue delay any thread gathered, per step (see
        `check_input_bound`); `None` at the first check (whose span would hold the
        tracing) and where the statistics are not available.
        """
        now = run_queue_delays()
        if now is None:
            return None
        since = self.step - len(self.step_times)
        then = next(((s, d) for s, d in self._run_queue if s >= since), self._run_queue[-1] if self._run_queue else None)
        self._run_queue.append((self.step, now))
        if then is None or self.step <= then[0]:
            return None
        return max(d - then[1].get(tid, 0.0) for tid, d in now.items()) / (self.step - then[0])

    def _check_input_bound(self) -> None:
        cpu_wait = self._cpu_wait_per_step()
        if 0 < len(self.compute_times) < 3 and len(self.step_times) >= 5 and (
            1e3 * median(self.step_times) > self._th["input_wait_ms"]
        ):
            # A short run has timed its compute once or twice; one timing slowed down by
            # other work would hide the wait, so time the probe again (at most twice a run).
            for _ in range(3 - len(self.compute_times)):
                t0 = time.perf_counter()
                self._probe.run()
                self._record_compute(time.perf_counter() - t0)
        self._report(check_input_bound(list(self.step_times), list(self.compute_times), self.step,
                                          cpu_wait=cpu_wait, thresholds=self._th))

    def _probe_rules(self, stats: dict[str, Any], lr: float | None) -> None:
        """The rules that read a probe's statistics: gradients, dead units, input bound."""
        lso = self._is_lso()
        grad_stats = {**stats, "grads_finite": True} if lso else stats  # float16 overflow: the loss scale's business
        # Exploding gradients after a divergence are its consequence; a non-finite norm is the loss scale's business.
        consequence = "divergence" in self.codes or (lso and not math.isfinite(stats["global_norm"]))
        if stats["weights_finite"] and (self._enabled("vanishing_gradients") or self._enabled("exploding_gradients")):
            for f in check_gradients(grad_stats, self.step, first_global_norm=self.first_global_norm, lr=lr, thresholds=self._th):
                if not (f.code == "exploding_gradients" and consequence):
                    self._report(f)
        if self._enabled("dead_units"):
            self._report(check_dead_units(
                stats["dead"], self.prev_dead, self.step, lr=lr, thresholds=self._th,
                explained_by=[c for c in self.codes if c == "oscillation"],
            ))
            self.prev_dead = dict(stats["dead"])
        if self._open("input_bound"):
            self._check_input_bound()

    def on_epoch_end(self, epoch, logs=None) -> None:
        logs = logs if logs is not None else {}
        if self._is_lso() and self._last_scale is not None:
            logs["loss_scale"] = float(self._last_scale)
        if self.step == self._epoch_begin_step:
            return  # no batch trained (the data ran out): Keras logs a loss of 0.0, which is no epoch
        loss, val = logs.get("loss"), logs.get("val_loss")
        if loss is not None:
            self.epoch_losses.append(float(loss))
            self.epoch_val_losses.append(float(val) if val is not None else math.nan)
            if val is not None and self._open("overfitting"):
                self._report(check_overfitting(self.epoch_losses, self.epoch_val_losses, self.step, thresholds=self._th))
        self._write_json()
        if self._writer is not None:
            self._writer.flush()

    def on_train_end(self, logs=None) -> None:
        # A fit that trained no step (a finished run run again) has nothing new to judge or report:
        # its diagnostics.json and summary stay those of the steps that were trained.
        if self._trained:
            if self.step >= _MIN_STEPS_TO_JUDGE and self._last_check != self.step:
                self._check()  # a run shorter than `every_n_steps`, or the steps since the last check
            self._write_json()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self.verbose and self._trained:
            print(self.summary(), flush=True)
        super().on_train_end(logs)

    # ---------------------------------------------------------------- output
    def summary(self) -> str:
        """A few lines: the findings with their evidence and first fixes, or "no problems".

        Example:
        >>> TrainingDoctor(verbose=0).summary()
        'TrainingDoctor: no problems found in 0 steps (0 probes).'
        """
        if not self.findings:
            return f"TrainingDoctor: no problems found in {self.step} steps ({self.probes} probes)."
        lines = [f"TrainingDoctor: {len(self.findings)} finding(s) in {self.step} steps:"]
        for f in self.findings:
            lines.append(f"  {f.line()}")
            lines.extend(f"      also: {fix}" for fix in f.fixes[1:3])
        return "\n".join(lines)

    def report(self) -> dict[str, Any]:
        """What `diagnostics.json` holds: findings, steps, probes, loss-scale history, last probe."""
        cfg = {k: v for k, v in self.get_config().items() if k != "probe_batch"}
        return {
            "findings": [f.to_dict() for f in self.findings],
            "steps": self.step,
            "probes": self.probes,
            "loss_scale_history": [[int(s), jsonable(v)] for s, v in self.scale_history],
            "loss_scale_backoffs": len(self.backoff_steps),
            "last_probe": {k: jsonable(v) for k, v in self.last_probe.items()},
            "probe": self._probe_error or "ok",
            "config": cfg,
        }

    def _write_json(self) -> None:
        if self.run_dir is None or not self._chief():
            return
        try:
            atomic_write_json(Path(self.run_dir) / _DIAGNOSTICS_FILE, self.report())
        except OSError as e:  # pragma: no cover - a full disk must not stop training
            if self.verbose:
                print(f"TrainingDoctor: could not write {_DIAGNOSTICS_FILE}: {e}", flush=True)

    def _write_tensorboard(self, stats: dict[str, Any]) -> None:
        """Writes the probe's statistics as TensorBoard scalars (a failure turns the writing off, never training)."""
        if self._writer is None:
            return
        values = {
            "doctor/probe_loss": stats["loss"],
            "doctor/global_grad_norm": stats["global_norm"],
            "doctor/update_ratio": stats["update_ratio"],
            "doctor/loss_scale": stats["loss_scale"] if self._is_lso() else None,
            "doctor/step_ms": 1e3 * median(self.step_times) if self.step_times else None,
        }
        for l in stats["layers"]:
            values[f"doctor/grad_norm/{l['name']}"] = l["grad_norm"]
            values[f"doctor/update_ratio/{l['name']}"] = l.get("update_ratio")
        values.update({f"doctor/dead_fraction/{k}": v for k, v in stats["dead"].items()})
        values.update({f"doctor/saturation/{k}": v for k, v in stats["saturation"].items()})
        try:
            import tensorflow as tf  # lazy: TensorFlow's summaries, only for a run directory
            from tensorflow.core.framework import summary_pb2  # lazy: as above

            # `tf.summary.write` with the scalars plugin's metadata is what
            # `tf.summary.scalar` does, without needing the tensorboard package.
            plugin = summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
            meta = summary_pb2.SummaryMetadata(plugin_data=plugin).SerializeToString()
            with self._writer.as_default():
                for name, value in values.items():
                    if value is not None and math.isfinite(float(value)):
                        tf.summary.write(name, tf.constant(float(value), tf.float32), step=self.step, metadata=meta)
        except Exception as e:  # never let logging break training
            if self.verbose:
                print(f"TrainingDoctor: TensorBoard logging disabled: {type(e).__name__}: {e}", flush=True)
            self._writer = None
