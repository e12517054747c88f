"""Gradients of a model's loss on a fixed batch, on TensorFlow and on JAX, without a train step.

Keras has no backend-neutral "gradients of this loss" (its trainers take them
inside `train_step`: `tf.GradientTape` on TensorFlow, `jax.value_and_grad` over
`stateless_call` on JAX). `loss_and_gradients` is that one function for the
doctor's probe: the loss as `fit` computes it (`training=True`), the gradients
with respect to the trainable weights, and those with respect to the outputs of
chosen layers (where a NaN first appears in the backward pass).

- TensorFlow: a `tf.GradientTape` over the model's variables; the caller keeps
  the non-trainable and metric variables it touches (the probe restores them).
- JAX: `jax.value_and_grad` over `stateless_call` and `stateless_compute_loss`
  on the values of the training state, which it leaves untouched. A layer's
  output gradient is the gradient of a zero "tap" added to that output while the
  function is traced (JAX has no `tape.watch` on an intermediate value).

Call it inside a compiled function (`trainwell.compat.backend.compile_function`).

Example:
>>> import keras, numpy as np
>>> m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]); m.compile("sgd", "mse")
>>> out = loss_and_gradients(m, np.ones((4, 2), "float32"), np.zeros((4, 1), "float32"),
...                          state=state_values(m))
>>> [tuple(g.shape) for g in out.grads]
[(2, 1), (1,)]
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

from trainwell.compat.backend import StateReader, is_jax
from trainwell.compat.keras_internals import call_has_training_arg, compute_loss
from trainwell.validation import invalid_argument

__all__ = ["Gradients", "loss_and_gradients", "state_values"]


class Gradients(NamedTuple):
    """What `loss_and_gradients` returns.

    Attributes:
        loss: The unscaled loss (float32 scalar).
        y_pred: The model's predictions.
        grads: One per trainable variable, in `model.trainable_variables` order
            (`None` where the loss does not depend on it; TensorFlow may give
            `tf.IndexedSlices`).
        tap_grads: One per tapped layer: the gradient of the (scaled) loss with
            respect to its output (`None` on TensorFlow where the loss does not
            depend on it; zeros on JAX for a layer whose call returns several
            tensors, which is not tapped).
        acts: The tapped layers' outputs (from `forward`; empty without it).
    """

    loss: Any
    y_pred: Any
    grads: list
    tap_grads: list
    acts: list


def state_values(model) -> tuple[list, list, list]:
    """`(trainable, non_trainable, metrics)` values of `model`'s training state, inside or outside `fit`.

    What `loss_and_gradients(..., state=...)` takes on JAX (read without a sync:
    `trainwell.compat.backend.StateReader`); on TensorFlow the variables' values.

    Args:
        model: A built Keras model. Required.

    Example:
    >>> import keras
    >>> [len(v) for v in state_values(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))]
    [2, 0, 0]
    """
    groups = (model.trainable_variables, model.non_trainable_variables, model.metrics_variables)
    return tuple(StateReader(model, list(g))() for g in groups)


def loss_and_gradients(model, x, y=None, sample_weight=None, *, forward=None, taps=(), loss_scale=1.0,
                       state=None) -> Gradients:
    """The loss of `model` on `(x, y, sample_weight)` with `training=True`, and its gradients.

    The gradients are those of `loss * loss_scale` (as under a
    `LossScaleOptimizer`, so a float16 overflow shows); the loss returned is
    unscaled. Activity-regularization losses are counted on TensorFlow only.

    Args:
        model: A compiled Keras model. Required.
        x: The inputs. Required.
        y: The targets. Defaults to `None`.
        sample_weight: The sample weights. Defaults to `None`.
        forward: A functional model over `model`'s layers whose outputs are
            `{"y": predictions, "acts": [outputs of taps]}`, or `None` to call
            `model` (then `taps` must be empty). Defaults to `None`.
        taps: Layers of `forward` whose output gradients to return, in the
            order of `forward`'s `"acts"`. Defaults to `()`.
        loss_scale: Multiplies the loss before differentiation. Defaults to `1.0`.
        state: JAX: `state_values(model)` (the values to differentiate at);
            ignored on TensorFlow, which reads the variables. Defaults to `None`.

    Returns:
        A `Gradients`.

    Example:
    >>> import keras, numpy as np
    >>> m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]); m.compile("sgd", "mse")
    >>> float(loss_and_gradients(m, np.ones((1, 2), "float32"), np.ones((1, 1), "float32"),
    ...                          state=state_values(m)).loss) >= 0
    True
    """
    if taps and forward is None:
        raise invalid_argument("taps", "no taps without `forward`", list(taps))
    if is_jax():
        if state is None:
            state = state_values(model)
        return _jax_loss_and_gradients(model, x, y, sample_weight, forward, list(taps), loss_scale, state)
    return _tf_loss_and_gradients(model, x, y, sample_weight, forward, loss_scale)


def _predict(model, forward, x, call):
    """`(y_pred, acts)` from `call(layer_or_model, x, **kwargs)`."""
    if forward is not None:
        out = call(forward, x, training=True)
        return out["y"], list(out["acts"])
    kwargs = {"training": True} if call_has_training_arg(model) else {}
    return call(model, x, **kwargs), []


def _tf_loss_and_gradients(model, x, y, sample_weight, forward, loss_scale) -> Gradients:
    import tensorflow as tf  # here: the TensorFlow backend only

    with tf.GradientTape() as tape:
        y_pred, acts = _predict(model, forward, x, lambda m, *a, **k: m(*a, **k))
        for a in acts:
            tape.watch(a)
        loss = tf.cast(compute_loss(model, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True),
                       tf.float32)
        scaled = loss * loss_scale
    trainable = list(model.trainable_variables)
    grads = tape.gradient(scaled, trainable + acts, unconnected_gradients=tf.UnconnectedGradients.NONE)
    return Gradients(loss, y_pred, grads[: len(trainable)], grads[len(trainable):], acts)


@contextlib.contextmanager
def _tapped(layers, taps):
    """While tracing: each layer's output (a single tensor) gets `+ tap`; the tap's gradient is the output's."""
    patched = []
    try:
        for layer, tap in zip(layers, taps):
            call = layer.call  # the bound method; the instance attribute below shadows it

            def tapped_call(*args, _call=call, _tap=tap, **kwargs):
                out = _call(*args, **kwargs)
                return out + _tap if hasattr(out, "shape") and tuple(out.shape) == tuple(_tap.shape) else out

            patched.append((layer, layer.__dict__.get("call")))
            layer.call = tapped_call
        yield
    finally:
        for layer, own in patched:
            if own is None:
                del layer.call  # back to the class's method
            else:
                layer.call = own


def _jax_loss_and_gradients(model, x, y, sample_weight, forward, taps, loss_scale, state) -> Gradients:
    import jax  # here: the JAX backend only
    import jax.numpy as jnp

    tv, ntv, mv = (list(s) for s in state)
    if forward is not None:
        # `forward` shares `model`'s variables; its own lists may be in another order.
        by_id = {id(v): a for v, a in zip(list(model.trainable_variables) + list(model.non_trainable_variables),
                                          tv + ntv)}
        f_tv_of = lambda t: [t[i] for i in _positions(forward.trainable_variables, model.trainable_variables)]  # noqa: E731
        f_ntv = [by_id[id(v)] for v in forward.non_trainable_variables]

        def call(m, inputs, training):
            return m.stateless_call(f_tv_of(cur["tv"]), f_ntv, inputs, training=training)[0]
    else:

        def call(m, inputs, **kwargs):
            return m.stateless_call(cur["tv"], ntv, inputs, **kwargs)[0]

    cur = {"tv": tv}
    # Output shapes of the tapped layers (abstract evaluation, no compute). A layer whose
    # call returns several tensors is not tapped: its output gradient comes back as zeros.
    shapes = jax.eval_shape(lambda: _predict(model, forward, x, call)[1]) if taps else []
    zeros = [jnp.zeros(s.shape, s.dtype) for s in shapes]

    def objective(params, tap_values):
        cur["tv"] = params
        with _tapped(taps, tap_values):
            y_pred, acts = _predict(model, forward, x, call)
        loss, _ = model.stateless_compute_loss(params, ntv, mv, x=x, y=y, y_pred=y_pred,
                                               sample_weight=sample_weight, training=True)
        loss = jnp.asarray(loss, jnp.float32)
        return loss * loss_scale, (loss, y_pred, acts)

    (_, (loss, y_pred, acts)), (grads, tap_grads) = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(
        tv, zeros
    )
    cur["tv"] = tv
    return Gradients(loss, y_pred, list(grads), list(tap_grads), list(acts))


def _positions(subset, variables) -> list[int]:
    index = {id(v): i for i, v in enumerate(variables)}
    return [index[id(v)] for v in subset]
