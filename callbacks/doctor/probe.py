"""The doctor's gradient probe: gradient and activation statistics on a fixed batch (TensorFlow and JAX).

`GradientProbe` compiles a function that computes gradient and activation
statistics of a model on a fixed batch without touching its `train_step`, its
weights, its metrics or its random state (`trainwell.compat.snapshot.function_on_state`),
and names the first layer that produced a non-finite value (forward or
backward). The rules (`loss_rules`, `step_rules`) read the dict it returns. The
gradients come from `trainwell.compat.gradients.loss_and_gradients`; the
statistics are `keras.ops`, the same on both backends.
"""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np
from keras import ops

from trainwell.callbacks.doctor.findings import median
from trainwell.compat.backend import StateReader, backend_tensor
from trainwell.compat.gradients import loss_and_gradients
from trainwell.compat.snapshot import Snapshot, function_on_state

#: The activations whose output can die (ReLU) or saturate (sigmoid, tanh), by kind.
_ACT_KINDS = {"relu": "relu", "relu6": "relu", "sigmoid": "sigmoid", "hard_sigmoid": "sigmoid", "tanh": "tanh"}


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
    act = getattr(layer, "activation", None)  # a name, a function, or None
    return _ACT_KINDS.get(act if isinstance(act, str) else getattr(act, "__name__", None))


class GradientProbe:
    """Gradient and activation statistics of a model on a fixed batch, compiled once.

    One call runs the forward and backward pass of `model` on the batch with
    `training=True` (as `train_step` does) in a compiled function of its own
    (`tf.function` on TensorFlow, `jax.jit` on JAX): the model's `train_step` is
    untouched, no optimizer update is applied, and the model's non-trainable
    variables (BatchNorm statistics, dropout seed state) and metric variables
    keep their values (TensorFlow: restored after the call; JAX: the call is
    stateless, on the values of the live training state), so a probe leaves
    training bit-for-bit unchanged. Under a `LossScaleOptimizer` the loss is
    scaled by the current loss scale before the backward pass, as in training,
    so float16 gradient overflow shows up; statistics are unscaled.

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
        conv = lambda t: None if t is None else keras.tree.map_structure(backend_tensor, t)  # noqa: E731
        self.x, self.y, self.sw = conv(x), conv(y), conv(sw)
        first = next(iter(keras.tree.flatten(self.x)))
        self.batch_size = int(first.shape[0]) if len(first.shape) else 1
        self.trainable = list(model.trainable_variables)
        self._groups = self._group_variables()
        self.act_layers: list = []
        self.act_kinds: list[str | None] = []
        self.aux = None
        if activations:
            self._build_aux()
        self._shadow = Snapshot.of(model, self.trainable) if track_updates else None  # the weights before a step
        self._has_snapshot = False
        # Without AutoGraph: the probe's loops are over Python lists, and Keras 3 does not
        # convert layer or model code in `fit` either, so a model that trains traces here.
        self._fn = function_on_state(model, self._run_on)

    # ------------------------------------------------------------ structure
    def _group_variables(self):
        """`(name, indices, kernel indices)` of the trainable variables per owning layer.

        The owner is a variable's path less its last part, named without the model's
        name; its kernels are its variables of 2 or more dimensions, embeddings aside.
        """
        groups: dict[str, list[int]] = {}
        for i, v in enumerate(self.trainable):
            groups.setdefault((getattr(v, "path", None) or v.name).rsplit("/", 1)[0], []).append(i)
        out = []
        for owner, idx in groups.items():
            kernel = [i for i in idx if len(self.trainable[i].shape) >= 2
                      and "embedding" not in (getattr(self.trainable[i], "path", "") or "")]
            out.append((owner.removeprefix(f"{self.model.name}/"), idx, kernel))
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
        except Exception:  # no auxiliary model (`self.aux` stays None): gradient statistics only
            return
        self.act_layers = layers
        self.act_kinds = [activation_kind(l) for l in layers]

    # ------------------------------------------------------------ compiled pieces
    def snapshot(self) -> None:
        """Copies the trainable weights (call before the step whose update to measure)."""
        if self._shadow is not None:
            self._shadow.take()
            self._has_snapshot = True

    def _run_on(self, state, shadows, loss_scale, use_shadow):
        """The statistics of a forward and backward pass on `state`'s values (`function_on_state`).

        The loss of the "null" model, which predicts the batch mean of the
        predictions for every example, is a scale for the loss that does not
        depend on training.
        """
        g = loss_and_gradients(
            self.model, self.x, self.y, self.sw, forward=self.aux, taps=self.act_layers if self.aux else (),
            loss_scale=loss_scale, state=state,
        )
        null_pred = keras.tree.map_structure(
            lambda t: ops.broadcast_to(ops.mean(t, axis=0, keepdims=True), ops.shape(t)), g.y_pred
        )
        null, _ = self.model.stateless_compute_loss(
            *state, x=self.x, y=self.y, y_pred=null_pred, sample_weight=self.sw, training=False
        )
        grads = [getattr(gr, "values", gr) for gr in g.grads]  # a sparse gradient (`tf.IndexedSlices`): its rows
        return self._statistics(g, ops.cast(null, "float32"), grads, state[0], shadows, loss_scale, use_shadow)

    def _statistics(self, g, null, grads, weights, shadows, loss_scale, use_shadow):
        """The probe's per-variable and per-layer statistics, in `keras.ops`."""
        f32 = "float32"
        weights = [ops.cast(w, f32) for w in weights]
        wn, wfin = _safe_norms(weights)
        # A variable without a gradient counts as a zero one (norm 0, finite).
        gn, gfin = _safe_norms([ops.zeros((), f32) if gr is None else ops.cast(gr, f32) for gr in grads])
        gn = gn / loss_scale
        un = None
        if shadows is not None:
            un, _ = _safe_norms([w - ops.cast(s, f32) for w, s in zip(weights, shadows)])
            un = ops.where(use_shadow, un, -1.0)
        afin, agfin, adead, asat, amax = [], [], [], [], []
        for a, ga, kind in zip(g.acts, g.tap_grads, self.act_kinds):
            a32 = ops.cast(a, f32)
            afin.append(ops.all(ops.isfinite(a)))
            amax.append(ops.max(ops.where(ops.isfinite(a32), ops.abs(a32), 0.0)))
            agfin.append(ops.convert_to_tensor(True) if ga is None else ops.all(ops.isfinite(ga)))
            if kind == "relu" and len(a.shape) >= 2:
                alive = ops.max(a32, axis=tuple(range(len(a.shape) - 1))) > 0.0
                adead.append(1.0 - ops.mean(ops.cast(alive, f32)))
            else:
                adead.append(ops.convert_to_tensor(-1.0, f32))
            if kind == "sigmoid":
                asat.append(ops.mean(ops.cast((a32 < 0.01) | (a32 > 0.99), f32)))
            elif kind == "tanh":
                asat.append(ops.mean(ops.cast(ops.abs(a32) > 0.99, f32)))
            else:
                asat.append(ops.convert_to_tensor(-1.0, f32))
        stack = lambda xs, dt=f32: ops.stack(xs) if xs else ops.zeros((0,), dt)  # noqa: E731
        return {
            "loss": g.loss,
            "null_loss": null,
            "gn": gn,
            "wn": wn,
            "gfin": gfin,
            "wfin": wfin,
            "un": ops.zeros((0,), f32) if un is None else un,
            "afin": stack(afin, "bool"),
            "agfin": stack(agfin, "bool"),
            "adead": stack(adead),
            "asat": stack(asat),
            "amax": stack(amax),
        }

    # ------------------------------------------------------------ public
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
        scale = current_loss_scale(self.model)
        if self._shadow is not None and self._shadow.values is None:
            self._shadow.take()  # stands in before the first snapshot (one compiled shape; the ratios are masked)
        shadows = None if self._shadow is None else self._shadow.values
        raw = self._fn(shadows, ops.convert_to_tensor(scale, "float32"), ops.convert_to_tensor(self._has_snapshot))
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

        def blame(i: int, where: str = "backward") -> dict[str, Any]:
            layer = self.act_layers[i]
            return {"layer": layer.name, "index": i, "pass": where, "compute_dtype": _compute_dtype(layer)}

        for i, ok in enumerate(r["afin"]):
            if not ok:
                out = blame(i, "forward")
                if i > 0:
                    out["max_abs"] = float(r["amax"][i - 1])
                return out
        bad = [l for l in layers if not l["grads_finite"]]
        bad_owners = {l["name"].split("/")[0] for l in bad}  # top-level layers with a non-finite weight gradient
        n = len(names)
        for i in range(n - 1, -1, -1):
            out_ok = bool(r["agfin"][i])
            if out_ok and names[i] not in bad_owners:
                continue
            # Its own weight gradients are non-finite (its backward pass), or its output
            # gradient is: made by the next layer's backward pass (or the loss, after the
            # last layer), unless it overflowed where it was cast into this layer's 16-bit
            # output (a float32 consumer): then this layer's dtype is the cause.
            if out_ok or i + 1 >= n:
                return blame(i)
            dtypes = _compute_dtype(self.act_layers[i]), _compute_dtype(self.act_layers[i + 1])
            return blame(i if "16" in dtypes[0] and "16" not in dtypes[1] else i + 1)
        if bad:
            return {"layer": bad[-1]["name"], "index": -1, "pass": "backward", "compute_dtype": ""}
        if not math.isfinite(float(r["loss"])):
            return {"layer": "loss", "index": -1, "pass": "forward", "compute_dtype": "float32"}
        return None


def current_loss_scale(model) -> float:
    """The loss scale of `model`'s built `LossScaleOptimizer` now, also inside a JAX `fit`; 1.0 without one.

    Example:
    >>> import keras
    >>> current_loss_scale(keras.Sequential())
    1.0
    """
    opt = getattr(model, "optimizer", None)
    if isinstance(opt, keras.optimizers.LossScaleOptimizer) and getattr(opt, "built", False):
        # Read through the training state: on JAX the variable is empty during an epoch.
        return float(np.asarray(StateReader(model, [opt.dynamic_scale])()[0]))
    return 1.0


def _safe_norms(ts: list) -> tuple:
    """Per float32 tensor of `ts`: its L2 norm without float32 overflow, and whether it is all finite.

    Each tensor is divided by its largest magnitude before squaring, so entries
    up to float32's maximum give a finite norm; a tensor with inf or NaN gets its
    largest magnitude (inf or NaN) as norm. Finiteness is read from the scaled sum
    of squares (finite exactly when every entry is), so it costs no extra pass, and
    the scalar steps run once on the stacked values rather than per tensor (a
    trace of about half the CPU time for a ResNet-50: bench/README.md).

    Returns:
        `(norms, finite)`: float32 and bool vectors of `len(ts)`.
    """
    if not ts:
        return ops.zeros((0,), "float32"), ops.zeros((0,), "bool")
    zero = ops.zeros((), "float32")
    m = ops.stack([ops.max(ops.abs(t)) if int(np.prod(t.shape)) else zero for t in ts])
    ok = ops.isfinite(m) & (m > 0)
    safe = ops.unstack(ops.where(ok, m, 1.0))
    sq = ops.stack([ops.sum(ops.square(t / d)) if int(np.prod(t.shape)) else zero for t, d in zip(ts, safe)])
    return ops.where(ok, m * ops.sqrt(sq), m), ops.isfinite(sq)


def _compute_dtype(layer) -> str:
    dt = getattr(layer, "compute_dtype", None)
    return str(getattr(dt, "name", dt) or "")
