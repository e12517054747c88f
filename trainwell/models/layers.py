"""Layers the recipes' models need and Keras 3 lacks: a fused BatchNormalization.

Keras 3's `keras.layers.BatchNormalization` computes the batch moments and the
normalisation with separate ops on every backend (keras-team/keras-core#225), where
tf.keras and TF Model Garden ran one `FusedBatchNormV3` kernel per layer (oneDNN on
CPUs, cuDNN on GPUs). On the TensorFlow backend without XLA the separate ops make
ResNet-50 training measurably slower (figures: bench/README.md, `resnet_throughput.py`).
The kernel itself is reached through `trainwell.compat.kernels`.

`FusedBatchNormalization` extends Keras's layer instead of replacing it: same
arguments, variables (`gamma`, `beta`, `moving_mean`, `moving_variance`), config,
weight files and numbers (the moving variance uses the biased batch variance, as
Keras does); only the kernel differs, and only where the fused kernel applies
(a backend with the fused kernel, i.e. TensorFlow; a 4-D input normalised over its
last axis, no mask, no renormalisation, not synchronized). Everywhere else it is Keras's layer.

The ResNet builds this class on every backend (`fused=False` where the fused
kernel is not wanted): a checkpoint names a layer by its class
(`layers/fused_batch_normalization_3/...`, as Keras's own `.weights.h5` does), so
one class keeps a run's checkpoint loadable when it moves between backends.
"""

from __future__ import annotations

import keras
from keras import ops

from trainwell.compat.kernels import fused_batch_norm, has_fused_batch_norm_kernel
from trainwell.validation import invalid_argument

__all__ = ["FusedBatchNormalization"]


@keras.saving.register_keras_serializable(package="trainwell")
class FusedBatchNormalization(keras.layers.BatchNormalization):
    """`keras.layers.BatchNormalization` on TensorFlow's fused kernel where it applies.

    Extends Keras's `BatchNormalization` (all of its arguments; see the module
    docstring for why): on the TensorFlow backend, for a 4-D channels-last input
    without mask, renorm or synchronisation, training and inference run
    `tf.compat.v1.nn.fused_batch_norm` (one kernel, float32 statistics also for
    float16/bfloat16 inputs). Otherwise it calls Keras's implementation unchanged.

    Args:
        fused: Use the fused kernel where it applies. `False` is Keras's layer
            under this class's name (a checkpoint's names stay the same).
            Defaults to `True`.
        **kwargs: `keras.layers.BatchNormalization` arguments (`axis`, `momentum`,
            `epsilon`, `center`, `scale`, initializers, ...).

    Example:
    >>> import numpy as np
    >>> bn = FusedBatchNormalization(momentum=0.9)
    >>> y = bn(np.random.rand(8, 4, 4, 3).astype("float32"), training=True)
    >>> tuple(y.shape)
    (8, 4, 4, 3)
    """

    def __init__(self, fused: bool = True, **kwargs):
        if not isinstance(fused, bool):
            raise invalid_argument("fused", "a bool", fused)
        super().__init__(**kwargs)
        self.fused = fused

    def get_config(self) -> dict:
        return {**super().get_config(), "fused": self.fused}

    def _fused_applies(self, inputs, mask) -> bool:
        if not self.fused or not has_fused_batch_norm_kernel() or mask is not None:
            return False
        if self.renorm or getattr(self, "synchronized", False):
            return False
        rank = len(inputs.shape)
        return rank == 4 and self.axis in (-1, 3)

    def call(self, inputs, training=None, mask=None):
        if not self._fused_applies(inputs, mask):
            return super().call(inputs, training=training, mask=mask)
        channels = inputs.shape[-1]
        gamma = ops.cast(self.gamma, "float32") if self.scale else ops.ones((channels,), "float32")
        beta = ops.cast(self.beta, "float32") if self.center else ops.zeros((channels,), "float32")
        if training and self.trainable:
            y, mean, variance = fused_batch_norm(inputs, gamma, beta, self.epsilon)
            m = self.momentum
            self.moving_mean.assign(ops.cast(self.moving_mean, "float32") * m + mean * (1.0 - m))
            self.moving_variance.assign(ops.cast(self.moving_variance, "float32") * m + variance * (1.0 - m))
        else:
            y, _, _ = fused_batch_norm(inputs, gamma, beta, self.epsilon,
                                       mean=ops.cast(self.moving_mean, "float32"),
                                       variance=ops.cast(self.moving_variance, "float32"))
        return ops.cast(y, self.compute_dtype)
