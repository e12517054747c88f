"""What the backend's compiled steps and kernels can do, asked by name (trainwell's models and losses).

Two differences between Keras's TensorFlow and JAX backends shape trainwell's
layers, losses and PBT's model cache; each is one question here, so no module
outside `trainwell.compat` asks which backend it runs on:

- `train_step_reads_outside_variables()`: whether a compiled train step reads a
  `keras.Variable` that is not part of the model's state (a loss's own variable)
  at every step. TensorFlow's `tf.function` captures such a variable by
  reference: an assignment reaches the next step of the traced function. Keras's
  JAX train step passes only the model's state in; another variable becomes a
  constant of the compiled function (an assignment is not seen until a retrace).
- `has_fused_batch_norm_kernel()`: whether the backend has one fused
  batch-normalisation kernel (`FusedBatchNormV3`, oneDNN on CPUs, cuDNN on
  GPUs) that `fused_batch_norm` runs. Only TensorFlow does; on JAX, XLA fuses
  Keras's separate ops itself.

Example:
>>> import keras
>>> train_step_reads_outside_variables() == (keras.backend.backend() == "tensorflow")
True
"""

from __future__ import annotations

import keras

__all__ = ["train_step_reads_outside_variables", "has_fused_batch_norm_kernel", "fused_batch_norm"]


def train_step_reads_outside_variables() -> bool:
    """Whether a compiled train step reads a variable outside the model's state at every step.

    True on TensorFlow (a `tf.function` captures the variable by reference), False
    on JAX (the jitted step takes only the model's state; another variable's value
    is baked in at trace time). A hyperparameter held in such a variable can change
    without a new trace only where this is True.

    Example:
    >>> isinstance(train_step_reads_outside_variables(), bool)
    True
    """
    return keras.backend.backend() == "tensorflow"


def has_fused_batch_norm_kernel() -> bool:
    """Whether the backend has a fused batch-normalisation kernel (`fused_batch_norm` runs it).

    True on TensorFlow only.

    Example:
    >>> isinstance(has_fused_batch_norm_kernel(), bool)
    True
    """
    return keras.backend.backend() == "tensorflow"


def fused_batch_norm(x, gamma, beta, epsilon: float, mean=None, variance=None):
    """TensorFlow's fused batch normalisation of an NHWC tensor (`has_fused_batch_norm_kernel()` only).

    Training (no `mean`/`variance` given) normalises with the batch moments and
    returns them; inference normalises with the given moving moments. The kernel
    computes in float32 for float16/bfloat16 inputs; other dtypes are cast to
    float32 first. The variance returned is the biased one (as Keras's
    `ops.moments`), not the kernel's Bessel-corrected one.

    Args:
        x: A 4-D channels-last tensor.
        gamma: Scale per channel, float32.
        beta: Offset per channel, float32.
        epsilon: Added to the variance.
        mean: Moving mean for inference, or `None` to train.
        variance: Moving variance for inference, or `None` to train.

    Returns:
        `(y, batch_mean, batch_variance)`; the moments are `None` at inference.

    Example:
    >>> import numpy as np
    >>> if has_fused_batch_norm_kernel():
    ...     y, m, v = fused_batch_norm(np.ones((2, 2, 2, 3), "float32"), np.ones(3, "float32"),
    ...                                np.zeros(3, "float32"), 1e-3)
    ...     print(tuple(y.shape), float(v[0]))
    ... else:
    ...     print((2, 2, 2, 3), 0.0)
    (2, 2, 2, 3) 0.0
    """
    # lazy: TensorFlow loads on first use, not with this module (JAX runs never load it)
    import tensorflow as tf

    if x.dtype not in (tf.float16, tf.bfloat16, tf.float32):
        x = tf.cast(x, tf.float32)
    if mean is None:
        y, mean, variance = tf.compat.v1.nn.fused_batch_norm(
            x, gamma, beta, epsilon=epsilon, data_format="NHWC", is_training=True)
        # The kernel returns the Bessel-corrected variance; Keras's moving variance
        # averages the biased one (ops.moments), so undo the correction.
        n = tf.cast(tf.size(x) // x.shape[-1], tf.float32)
        return y, mean, variance * (n - 1.0) / tf.maximum(n, 1.0)
    y, _, _ = tf.compat.v1.nn.fused_batch_norm(
        x, gamma, beta, mean=mean, variance=variance, epsilon=epsilon, data_format="NHWC", is_training=False)
    return y, None, None
