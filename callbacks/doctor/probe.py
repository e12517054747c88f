"""The doctor's gradient probe (TensorFlow): gradient and activation statistics on a fixed batch.

`GradientProbe` compiles a function that computes gradient and activation
statistics of a model on a fixed batch without touching its `train_step`, its
weights, its metrics or its random state, and names the first layer that
produced a non-finite value (forward or backward). It is the TensorFlow-specific
part of the doctor: the rules (`loss_rules`, `step_rules`) read the dict it
returns, and `TrainingDoctor` imports this module only when it probes, so a
backend without it (JAX, issue 20) needs only its own probe.
"""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from trainwell.callbacks.doctor.findings import median
from trainwell.compat.keras_internals import call_has_training_arg, compute_loss

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
            "update_ratio": median(ratios) if ratios else None,
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

    m = tf.reduce_max(tf.abs(t)) if t.shape.num_elements() != 0 else tf.constant(0.0, t.dtype)
    ok = tf.math.is_finite(m) & (m > 0)
    safe = tf.where(ok, m, tf.ones_like(m))
    return tf.where(ok, m * tf.sqrt(tf.reduce_sum(tf.square(t / safe))), m)


def _compute_dtype(layer) -> str:
    dt = getattr(layer, "compute_dtype", None)
    return str(getattr(dt, "name", dt) or "")
