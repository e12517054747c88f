"""ResNet v1.5 (He et al. 2016; the "v1.5" of TF Model Garden / torchvision) in the Keras functional API.

Why not `keras.applications.ResNet50`: it is ResNet v1 (stride 2 on the first 1x1 conv
of the bottleneck), its convolutions carry biases before BatchNorm (25,636,712
parameters instead of 25,557,032), BatchNorm uses epsilon 1.001e-5 and Keras's default
momentum 0.99, it has no basic-block depths (18/34), no zero-initialised residual
gamma, no small-image stem, and a float16 softmax unless the caller adds one. This
module builds the model the large-batch ImageNet papers (Goyal et al. 2017, You et
al. 2017) and TF Model Garden's `resnet` train:

- stride 2 on the 3x3 convolution of the bottleneck (v1.5), on the first 3x3 of the
  basic block; projection shortcut (1x1 conv, stride s, BatchNorm) when the shape
  changes;
- convolutions without bias, each followed by BatchNorm (momentum 0.9, epsilon 1e-5,
  as TF Model Garden and PyTorch);
- He-normal initialisation of the convolutions:
  `VarianceScaling(2.0, "fan_out", "untruncated_normal")`, i.e. PyTorch's
  `kaiming_normal_(mode="fan_out", nonlinearity="relu")` that torchvision uses. He et
  al. 2015 (sec. 2.2) show fan-in and fan-out both keep the signal's variance (forward
  resp. backward); fan-out is what the reference implementation the 25,557,032 count
  and the published accuracies come from uses, and an untruncated normal has
  exactly the variance 2/fan (Keras's `he_normal` truncates at 2 sigma and rescales);
- the classifier kernel is drawn from N(0, 0.01^2), bias zero (Goyal et al. 2017,
  TF Model Garden);
- the last BatchNorm gamma of each residual branch starts at zero
  (`zero_init_residual`, Goyal et al. 2017 sec. 5.1), so every block starts as the
  identity;
- explicit symmetric zero padding before every strided convolution (PyTorch's
  `padding=k//2`), rather than TensorFlow's asymmetric `"same"` at stride 2.

Inputs are float images already normalised by the input pipeline
(`trainwell.data.images`); the model does no rescaling.

The model ends in a float32 `Dense` (logits) and a float32 softmax `Activation`: it
outputs **probabilities**, so the standard
`keras.losses.CategoricalCrossentropy(label_smoothing=0.1)` (from_logits=False) works
and stays numerically safe under `mixed_float16`. The logits are available as
`model.get_layer("logits").output` for a from_logits loss.
"""

from __future__ import annotations

import re

import keras

from trainwell.compat.kernels import has_fused_batch_norm_kernel
from trainwell.models.layers import FusedBatchNormalization
from trainwell.models.specs import RESNET_DEPTHS
from trainwell.validation import invalid_argument

# TF Model Garden `resnet` / PyTorch defaults (PyTorch momentum 0.1 == Keras 0.9).
BN_MOMENTUM = 0.9
BN_EPSILON = 1e-5
SMALL_STEM_MAX_SIZE = 64


def _conv_init():
    return keras.initializers.VarianceScaling(scale=2.0, mode="fan_out", distribution="untruncated_normal")


class _Builder:
    """Holds the per-model settings so the block functions stay short."""

    def __init__(self, weight_decay, zero_init_residual, fused_batchnorm=False):
        # weight_decay is the coefficient of the gradient term wd * w (PyTorch SGD's
        # `weight_decay`, Model Garden's `l2_weight_decay`): L2(wd / 2) has that gradient.
        self.regularizer = keras.regularizers.L2(weight_decay / 2.0) if weight_decay else None
        self.zero_init_residual = zero_init_residual
        self.fused_batchnorm = fused_batchnorm

    def conv(self, x, filters, kernel_size, strides, name):
        if strides > 1 and kernel_size > 1:
            x = keras.layers.ZeroPadding2D(padding=kernel_size // 2, name=f"{name}_pad")(x)
            padding = "valid"
        else:
            padding = "same"
        return keras.layers.Conv2D(
            filters,
            kernel_size,
            strides=strides,
            padding=padding,
            use_bias=False,
            kernel_initializer=_conv_init(),
            kernel_regularizer=self.regularizer,
            name=name,
        )(x)

    def bn(self, x, name, zero_gamma=False):
        # One class on every backend and setting: a checkpoint names the layer by its class.
        return FusedBatchNormalization(
            fused=self.fused_batchnorm,
            axis=-1,
            momentum=BN_MOMENTUM,
            epsilon=BN_EPSILON,
            gamma_initializer="zeros" if zero_gamma else "ones",
            name=name,
        )(x)

    def shortcut(self, x, filters, strides, name):
        if strides == 1 and x.shape[-1] == filters:
            return x
        s = self.conv(x, filters, 1, strides, f"{name}_0_conv")
        return self.bn(s, f"{name}_0_bn")

    def basic_block(self, x, filters, strides, name):
        shortcut = self.shortcut(x, filters, strides, name)
        y = self.conv(x, filters, 3, strides, f"{name}_1_conv")
        y = self.bn(y, f"{name}_1_bn")
        y = keras.layers.Activation("relu", name=f"{name}_1_relu")(y)
        y = self.conv(y, filters, 3, 1, f"{name}_2_conv")
        y = self.bn(y, f"{name}_2_bn", zero_gamma=self.zero_init_residual)
        y = keras.layers.Add(name=f"{name}_add")([shortcut, y])
        return keras.layers.Activation("relu", name=f"{name}_out")(y)

    def bottleneck_block(self, x, filters, strides, name):
        shortcut = self.shortcut(x, 4 * filters, strides, name)
        y = self.conv(x, filters, 1, 1, f"{name}_1_conv")
        y = self.bn(y, f"{name}_1_bn")
        y = keras.layers.Activation("relu", name=f"{name}_1_relu")(y)
        y = self.conv(y, filters, 3, strides, f"{name}_2_conv")  # v1.5: stride on the 3x3
        y = self.bn(y, f"{name}_2_bn")
        y = keras.layers.Activation("relu", name=f"{name}_2_relu")(y)
        y = self.conv(y, 4 * filters, 1, 1, f"{name}_3_conv")
        y = self.bn(y, f"{name}_3_bn", zero_gamma=self.zero_init_residual)
        y = keras.layers.Add(name=f"{name}_add")([shortcut, y])
        return keras.layers.Activation("relu", name=f"{name}_out")(y)


def build_resnet(
    depth: int,
    num_classes: int,
    input_shape: tuple[int, int, int],
    small_stem: bool = False,
    dropout: float = 0.0,
    zero_init_residual: bool = True,
    weight_decay: float | None = None,
    name: str | None = None,
    width: int = 64,
    fused_batchnorm: bool | None = None,
) -> keras.Model:
    # one piece: a 45-line docstring; the body checks the arguments, then builds stem, stages and head in order
    """Builds a ResNet v1.5 classifier (18, 34: basic blocks; 50, 101, 152: bottleneck).

    Extends nothing in Keras: `keras.applications.ResNet*` are v1 with conv biases,
    Keras BatchNorm defaults, no basic-block depths and no zero-gamma init (see the
    module docstring). ResNet-50 at 224 px with 1000 classes has exactly 25,557,032
    trainable parameters, as torchvision's.

    Args:
        depth: One of 18, 34, 50, 101, 152.
        num_classes: Number of output classes, >= 1.
        input_shape: `(height, width, channels)` of the (normalised, float) input
            images; height and width may be `None`.
        small_stem: Use the small-image stem (3x3 conv stride 1, no max-pool) for inputs
            of 64 px or less (CIFAR, digits) instead of ImageNet's 7x7 stride-2 conv and
            3x3 stride-2 max-pool. Defaults to `False`.
        dropout: Dropout rate before the classifier, in [0, 1). Defaults to `0.0`.
        zero_init_residual: Initialise the last BatchNorm gamma of every residual
            branch to zero (Goyal et al. 2017). Defaults to `True`.
        weight_decay: If set, L2 penalty on convolution and classifier kernels (not on
            BatchNorm or biases) whose gradient is `weight_decay * w`, i.e. PyTorch SGD's
            `weight_decay` (implemented as `keras.regularizers.L2(weight_decay / 2)`).
            Leave `None` when the optimizer decays the weights (AdamW, LARS).
            Defaults to `None`.
        name: Model name. Defaults to `None` (`f"resnet{depth}"`).
        width: Filters of the first stage (doubled at each later stage; the
            bottleneck's expansion of 4 applies on top). 64 is the published
            ResNet; smaller widths make CPU-sized models for small data (the
            `make demo` run uses 16). Defaults to `64`.
        fused_batchnorm: Run the BatchNorm layers on TensorFlow's fused kernel
            (`trainwell.models.layers.FusedBatchNormalization`, as tf.keras and
            Model Garden; same variables and numbers, faster without XLA). The
            layers are that class either way (`fused=False` is Keras's
            computation), so a checkpoint's names do not depend on the backend
            or on this setting. Defaults to `None`: on where the backend has the
            kernel (`trainwell.compat.kernels.has_fused_batch_norm_kernel`).

    Returns:
        A `keras.Model` mapping images to class probabilities (float32 softmax output,
        layer `"predictions"`; logits in layer `"logits"`).

    Example:
    >>> model = build_resnet(18, num_classes=10, input_shape=(32, 32, 3), small_stem=True)
    >>> model.output_shape
    (None, 10)
    """
    if depth not in RESNET_DEPTHS:
        raise invalid_argument("depth", f"one of {sorted(RESNET_DEPTHS)}", depth)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise invalid_argument("num_classes", "an int >= 1", num_classes)
    if not isinstance(input_shape, (tuple, list)) or len(input_shape) != 3 or input_shape[-1] is None:
        raise invalid_argument("input_shape", "(height, width, channels) with known channels", input_shape)
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise invalid_argument("dropout", "a float in [0, 1)", dropout)
    if weight_decay is not None and (not isinstance(weight_decay, (int, float)) or weight_decay < 0):
        raise invalid_argument("weight_decay", "None or a float >= 0", weight_decay)
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise invalid_argument("width", "an int >= 1", width)
    if fused_batchnorm is not None and not isinstance(fused_batchnorm, bool):
        raise invalid_argument("fused_batchnorm", "None, True or False", fused_batchnorm)
    if fused_batchnorm is None:
        fused_batchnorm = has_fused_batch_norm_kernel()
    kind, stages = RESNET_DEPTHS[depth]
    b = _Builder(weight_decay, zero_init_residual, fused_batchnorm)
    block = b.basic_block if kind == "basic" else b.bottleneck_block

    inputs = keras.Input(shape=tuple(input_shape), name="images")
    if small_stem:
        x = b.conv(inputs, width, 3, 1, "stem_conv")
        x = b.bn(x, "stem_bn")
        x = keras.layers.Activation("relu", name="stem_relu")(x)
    else:
        x = b.conv(inputs, width, 7, 2, "stem_conv")
        x = b.bn(x, "stem_bn")
        x = keras.layers.Activation("relu", name="stem_relu")(x)
        x = keras.layers.ZeroPadding2D(padding=1, name="stem_pool_pad")(x)
        x = keras.layers.MaxPooling2D(3, strides=2, name="stem_pool")(x)

    for stage, num_blocks in enumerate(stages):
        filters = width * 2**stage
        for i in range(num_blocks):
            strides = 2 if (i == 0 and stage > 0) else 1
            x = block(x, filters, strides, f"stage{stage + 1}_block{i + 1}")

    x = keras.layers.GlobalAveragePooling2D(name="avg_pool")(x)
    if dropout > 0:
        x = keras.layers.Dropout(dropout, name="dropout")(x)
    # float32 logits and softmax: under mixed_float16 a float16 softmax/log underflows.
    x = keras.layers.Dense(
        num_classes,
        kernel_initializer=keras.initializers.RandomNormal(stddev=0.01),
        bias_initializer="zeros",
        kernel_regularizer=b.regularizer,
        dtype="float32",
        name="logits",
    )(x)
    outputs = keras.layers.Activation("softmax", dtype="float32", name="predictions")(x)
    return keras.Model(inputs, outputs, name=name or f"resnet{depth}")


_NAME_RE = re.compile(r"^resnet[-_]?(\d+)$")


def build_resnet_from_name(model_name: str, num_classes: int, input_shape: tuple[int, int, int], **kwargs) -> keras.Model:
    """Builds a ResNet from a name such as `"resnet50"` (also `"resnet-50"`, `"ResNet_50"`).

    Args:
        model_name: `"resnet18"`, `"resnet34"`, `"resnet50"`, `"resnet101"` or `"resnet152"`.
        num_classes: Number of output classes.
        input_shape: `(height, width, channels)`.
        **kwargs: Passed to `build_resnet` (`small_stem`, `dropout`, ...).

    Returns:
        The `keras.Model`, named `model_name` unless `name` is given.

    Example:
    >>> build_resnet_from_name("resnet18", 10, (32, 32, 3), small_stem=True).name
    'resnet18'
    """
    m = _NAME_RE.match(str(model_name).strip().lower())
    if not m or int(m.group(1)) not in RESNET_DEPTHS:
        names = ", ".join(f"'resnet{d}'" for d in RESNET_DEPTHS)
        raise invalid_argument("model_name", f"one of {names}", model_name)
    kwargs.setdefault("name", f"resnet{m.group(1)}")
    return build_resnet(int(m.group(1)), num_classes, input_shape, **kwargs)


__all__ = ["RESNET_DEPTHS", "build_resnet", "build_resnet_from_name"]
