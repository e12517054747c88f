"""The doctor's records: finding codes, thresholds, `Finding`, and the loss history the rules read.

- `Finding`, the record of one diagnosed problem (a code, a severity, the evidence
  in numbers, likely causes and concrete fixes).
- `LossTracker`, the per-step loss history the loss rules read (recovered from the
  epoch's running mean that Keras passes to batch callbacks).
- `DEFAULT_THRESHOLDS`, each with the reason for its value.

Backend-free: plain Python numbers, no Keras or TensorFlow.

Example:
>>> f = Finding("divergence", "error", {"loss": 1e9}, ["lower the learning rate 10x"], step=120)
>>> Finding.from_dict(f.to_dict()) == f
True
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import statistics
from collections import deque
from typing import Any, Iterable

from trainwell.validation import invalid_argument

#: Per finding code, in the order a summary lists them: its likely causes and the fixes to
#: try, most likely first (a rule puts those its evidence points at before them; `{lr}` in a
#: fix is `lr_text` of the learning rate, other fields the rule's own).
ADVICE: dict[str, tuple[list[str], list[str]]] = {
    "divergence": (
        ["learning rate too high", "no warmup", "unclipped gradient spikes", "bad input (NaN/Inf in the data)"],
        [
            "add a warmup (trainwell.callbacks.WarmupCosine(warmup_epochs=1))",
            "clip gradients (optimizer `global_clipnorm=1.0`)",
            "pick the LR with the LR range test (`trainwell.lr_find(model, data)`)",
            "guard the run with trainwell.callbacks.NaNRollback",
        ],
    ),
    "exploding_gradients": (
        ["initial weights too large", "no normalisation in a deep network", "learning rate too high"],
        [
            "clip gradients: optimizer `global_clipnorm=1.0`",
            "use He (ReLU) / Glorot (tanh) initialisation scaled to the fan-in, not large weights",
            "add BatchNormalization/LayerNormalization (and residual connections in deep stacks)",
            "lower the learning rate{lr} and add a warmup",
        ],
    ),
    "amp_instability": (
        ["activations or gradients overflow float16", "learning rate too high"],
        [
            "keep the final softmax/logits and any normalisation statistics in float32",
            "clip gradients (optimizer `global_clipnorm=1.0`) and lower the learning rate",
            "use mixed_bfloat16 where the hardware supports it (same range as float32)",
        ],
    ),
    "oscillation": (
        ["learning rate too high for the curvature", "noisy gradients (small batch)"],
        [
            "lower the learning rate 3x{lr}",
            "add a warmup (trainwell.callbacks.WarmupCosine(warmup_epochs=1)) and a decaying schedule",
            "use a larger batch (or `gradient_accumulation_steps`) to reduce gradient noise",
            "clip gradients (optimizer `global_clipnorm=1.0`)",
        ],
    ),
    "vanishing_gradients": (
        ["saturating activations (sigmoid/tanh)", "initial weights too small",
         "a deep stack without normalisation or skip connections"],
        [
            "use ReLU/GELU activations instead of sigmoid/tanh in hidden layers",
            "use He (ReLU) or Glorot (tanh) initialisation instead of tiny weights",
            "add BatchNormalization/LayerNormalization between layers",
            "add skip (residual) connections",
        ],
    ),
    "dead_units": (
        ["learning rate too high", "large negative biases", "poor initialisation"],
        [
            "use LeakyReLU/GELU/ELU instead of ReLU",
            "lower the learning rate{lr} (a large step can push biases so negative a unit never fires again)",
            "use He initialisation with zero biases; add BatchNormalization before the activation",
        ],
    ),
    "slow_convergence": ([], ["train longer only if the loss is still falling steadily"]),
    "overfitting": (
        ["model capacity too large for the data", "too little regularisation", "training too long"],
        [
            "stop at the best epoch: EarlyStopping(monitor='val_loss', patience={patience}, "
            "restore_best_weights=True) (best was epoch {best_epoch})",
            "add regularisation: decoupled weight decay (AdamW weight_decay=1e-4..1e-2) or Dropout(0.1-0.5)",
            "augment the data (keras.layers.RandAugment / MixUp / CutMix) or get more data",
            "use a smaller model",
        ],
    ),
    "input_bound": (
        ["slow data pipeline (decoding, augmentation, Python generator) without prefetch or parallelism"],
        [
            "prefetch: `dataset.prefetch(tf.data.AUTOTUNE)` as the last step of the pipeline",
            "measure it per stage: `trainwell input-report RECIPE --config FILE --target N` (images/s and "
            "images per CPU-second of each stage, the slowest one, the cores N images/s take); when decode is "
            "the slowest, `trainwell prepare-images SRC DST --max-side 256` and train on `tfrecord:DST`",
            "parallelise preprocessing: `dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE)`",
            "cache decoded data: `dataset.cache()` (in memory or to a file) before augmentation",
            "move augmentation onto the accelerator (Keras preprocessing layers inside the model)",
            "for Python generators use keras.utils.PyDataset(workers=N, use_multiprocessing=True)",
        ],
    ),
}

#: The finding codes, in the order a summary lists them.
CODES = tuple(ADVICE)

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
    # initial loss; heavy momentum sends the loss back up to about its initial value
    # again and again. A swing must also stand out of the minibatch noise: at least
    # `oscillation_noise_z` x the noise of a 5-step median (`chunk_noise`).
    "oscillation_swing": 0.4,
    "oscillation_ratio": 1.5,
    "oscillation_peaks": 3,
    "oscillation_noise_z": 4.0,
    # Or the loss swings above where it started: `oscillation_above` 5-step medians of
    # the window stand above the larger of the initial loss and the null-model loss (the
    # loss of predicting the batch mean) by `oscillation_rise` of it and by
    # `oscillation_rise_z` x the noise of a 5-step median. A step small enough for the
    # curvature lowers the loss, so a model worse than the mean prediction again and
    # again is thrown around by its steps. (How these values were measured:
    # bench/README.md, doctor_zoo.)
    "oscillation_rise": 0.05,
    "oscillation_rise_z": 2.0,
    "oscillation_above": 3,
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
            raise invalid_argument("code", f"one of {CODES}", self.code)
        if self.severity not in SEVERITIES:
            raise invalid_argument("severity", f"one of {SEVERITIES}", self.severity)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (non-finite numbers become strings)."""
        return jsonable(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Finding":
        """Inverse of `to_dict`."""
        return cls(**unjson(d))

    @classmethod
    def of(cls, code: str, step: int, evidence: dict[str, Any], summary: str, *, severity: str = "warning",
           causes: Iterable[str] = (), fixes: Iterable[str] = (), lr: float | None = None,
           **fields: Any) -> "Finding":
        """A finding of `code` with its `ADVICE` after the case's own `causes` and `fixes`.

        The advice's fixes are formatted with `lr` (as `lr_text` writes it) and `fields`.

        Example:
        >>> f = Finding.of("dead_units", 40, {"layer": "d"}, "units died.", lr=0.1)
        >>> f.fixes[1].startswith("lower the learning rate (now 0.1)"), f.severity
        (True, 'warning')
        """
        advice_causes, advice_fixes = ADVICE[code]
        advice_fixes = [fix.format(lr=lr_text(lr), **fields) for fix in advice_fixes]
        return cls(code, severity, evidence, [*fixes, *advice_fixes], step, [*causes, *advice_causes], summary)

    def line(self) -> str:
        """One printable line: severity, code, step, what was seen, the first fix."""
        fix = f" Fix: {self.fixes[0]}" if self.fixes else ""
        return f"[{self.severity}] {self.code} at step {self.step}: {self.summary}{fix}"


def jsonable(v: Any) -> Any:
    """`v` for JSON: numbers as Python numbers (NaN and infinities as strings), lists and dicts inside too."""
    if isinstance(v, dict):
        return {k: jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, deque)):
        return [jsonable(x) for x in v]
    if isinstance(v, (bool, str)) or v is None:
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return f if math.isfinite(f) else str(f)


def unjson(v: Any) -> Any:
    """Inverse of `jsonable` (lists come back as lists)."""
    if isinstance(v, dict):
        return {k: unjson(x) for k, x in v.items()}
    if isinstance(v, list):
        return [unjson(x) for x in v]
    return float(v) if v in ("nan", "inf", "-inf") else v


def fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"  # `.3g` writes nan and inf as str() does


def known(**values: Any) -> dict[str, Any]:
    """The evidence among `values` that is known (not `None`), in order."""
    return {k: v for k, v in values.items() if v is not None}


def median(xs: Iterable[float]) -> float:
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
        self.chunk_buf: list[float] = []
        self.best_median = math.inf            # best median of 10 consecutive losses
        self.high_water = -math.inf            # highest 10-step median before the last 10
        self.nonfinite_steps = 0
        self._prev_mean: float | None = None
        self._prev_batch = -1
        self.history_medians: deque[float] = deque(maxlen=10)

    # ------------------------------------------------------------ updates
    def new_epoch(self) -> None:
        self._prev_mean = None
        self._prev_batch = -1

    def update_from_running_mean(self, batch: int, mean: float) -> float:
        """Records the running mean after `batch`; returns the recovered step loss."""
        mean = float(mean)
        if self._prev_mean is None or batch <= self._prev_batch:
            loss, n = mean, (batch + 1 if self._prev_mean is None else 1)
        else:
            n = batch - self._prev_batch
            loss = ((batch + 1) * mean - (self._prev_batch + 1) * self._prev_mean) / n
        self._prev_mean, self._prev_batch = mean, batch
        if not math.isfinite(loss) and math.isfinite(mean):
            loss = mean
        self.add(loss, n)
        return loss

    def add(self, loss: float, n: int = 1) -> None:
        """Records the loss of the last `n` steps (their mean)."""
        self.steps += n
        if not math.isfinite(loss):
            self.nonfinite_steps += n
        self.losses.append(loss)
        if math.isfinite(loss) and len(self.first) < 10:
            self.first.append(loss)
        self.chunk_buf.append(loss)
        if len(self.chunk_buf) >= self.chunk:
            self.chunks.append(median(self.chunk_buf))
            self.chunk_buf = []
        if len(self.losses) >= 10:
            med = self.recent_median(10)
            if math.isfinite(med):
                self.best_median = min(self.best_median, med)
                self.history_medians.append(med)
                if len(self.history_medians) == self.history_medians.maxlen:
                    self.high_water = max(self.high_water, self.history_medians[0])

    # ------------------------------------------------------------ reads
    @property
    def initial(self) -> float:
        """Median of the first 10 finite step losses (nan before any)."""
        return median(self.first)

    def recent(self, n: int | None = None) -> list[float]:
        xs = list(self.losses)
        return xs if n is None else xs[-n:]

    def recent_median(self, n: int = 10) -> float:
        return median(self.recent(n))

    # ------------------------------------------------------------ state
    _STATE = ("steps", "first", "losses", "chunks", "chunk_buf", "best_median", "high_water", "nonfinite_steps",
              "history_medians")

    def get_state(self) -> dict[str, Any]:
        return {k: jsonable(getattr(self, k)) for k in self._STATE}

    def set_state(self, state: dict[str, Any]) -> None:
        self.reset()
        for k in self._STATE:
            if k in state:
                held, value = getattr(self, k), unjson(state[k])
                if isinstance(held, deque):
                    held.extend(value)
                else:
                    setattr(self, k, value)


def lr_text(lr: float | None) -> str:
    """The learning rate in a fix's text: `" (now 0.01)"`, `""` when unknown.

    An LR of 0 is no level to lower or raise: the step is a warmup's start or a
    schedule's end, so the text says so and points at the schedule's peak.

    Example:
    >>> lr_text(0.01), lr_text(None)
    (' (now 0.01)', '')
    """
    if lr is None or not math.isfinite(lr):
        return ""
    if lr == 0:
        return " (it is 0 at this step, a warmup's start or a schedule's end: change the schedule's peak)"
    return f" (now {lr:.3g})"


