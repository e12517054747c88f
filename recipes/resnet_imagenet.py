"""ResNet on ImageNet, the way Goyal et al. (2017), TF Model Garden and NVIDIA train it.

Reads top to bottom: the `Config` (every default is the published recipe, with its
source), then `build_data`, `build_model`, `build_optimizer`, `build_callbacks` and
`train`. The same recipe trains a ResNet-50 on ImageNet on a GPU cluster and a small
ResNet on the embedded MNIST digits on a laptop CPU (`make demo`).

Example:
>>> from trainwell.recipes import resnet_imagenet
>>> run = resnet_imagenet.train(dataset="mnist5k", epochs=1, model="resnet18",
...                             image_size=28, batch_size=128, width=16)  # doctest: +SKIP
>>> run.metrics["test_accuracy"]  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Literal, Optional

from trainwell.config import (
    BaseConfig,
    ConfigError,
    check_choice,
    check_dir_path,
    check_positive,
    check_range,
    check_reliability_fields,
    raise_invalid,
    scaled_lr,
)
from trainwell.data import embedded
from trainwell.data.resizing import check_size_schedule
from trainwell.data.service import check_target
from trainwell.data.sources import AUGMENTATIONS, check_image_source
from trainwell.models.specs import RESNET_DEPTHS

RECIPE = "resnet-imagenet"

# Defaults that follow the run and the data. The published recipe is 90 epochs of ImageNet at
# 224 px and batch 1024; where a field is left `None`, the same shares of a run of any length
# and sizes that fit the dataset are used (each field's comment says which).
#: [Goyal] sec. 2.2: 5 warmup epochs of 90.
WARMUP_FRACTION = 5 / 90
#: [Goyal] sec. 5.1 / [He] sec. 3.4: the LR x0.1 at epochs 30, 60 and 80 of 90.
STEP_FRACTIONS = (30 / 90, 60 / 90, 80 / 90)
#: The embedded image sets (`trainwell.data.embedded`): native side in px, examples in the file.
EMBEDDED_IMAGES = {"mnist5k": (28, 5000), "digits": (8, 1797)}
#: The held-out test share `build_image_datasets` carves from a source without a test split.
TEST_FRACTION = 0.2
#: The network's total stride (its input side per pixel of the last stage) with the small-image stem
#: (3x3 stride-1 conv; three stride-2 stages) and with ImageNet's (stride-2 conv and max-pool too): the
#: smallest `image_size` each can use.
SMALL_STEM_STRIDE, IMAGENET_STEM_STRIDE = 8, 32
#: Fields derived when left `None` (see `Config`).
DERIVED_FIELDS = ("image_size", "batch_size", "zero_init_residual", "warmup_epochs", "step_boundaries")


@dataclasses.dataclass
class Config(BaseConfig):
    """Hyperparameters of the ResNet recipe; defaults = the published ImageNet recipe.

    Sources: [Goyal] Goyal et al. 2017, "Accurate, Large Minibatch SGD";
    [He] He et al. 2016; [Bag of Tricks] He et al. 2019, "Bag of Tricks for Image
    Classification with CNNs"; [MG] TF Model Garden `resnet_imagenet` experiment config;
    [NV] NVIDIA DeepLearningExamples ResNet-50 v1.5; [Szegedy] Szegedy et al. 2016
    (label smoothing); [You] You et al. 2017 (LARS); [Loshchilov] Loshchilov & Hutter
    2017 (SGDR, cosine).

    Fields left `None` are derived from the dataset and the run length when the config is
    built (and again by `replace`); a value you set is kept as is:

    - `warmup_epochs`, `step_boundaries`: the published 5 warmup epochs and LR steps at
      30/60/80 of 90, as shares of any run (`--set epochs=3` warms up for 1/6 epoch).
    - `image_size`, `batch_size`: on the embedded sets their native size (28 px for
      `mnist5k`, 8 px for `digits`) and the batch He et al. train CIFAR-10's 32-px images
      with (128; 1024 is three steps an epoch of `mnist5k` and upsampling 28 px to 224
      grew a CPU run to 24 GB); elsewhere ImageNet's 224 px and 1024.
    - `zero_init_residual`: on from batch `lr_base_batch` (256) up, where [Goyal] train
      with it and [Bag of Tricks] sec. 3.1 lists it among the large-batch heuristics; off
      below, where it delays learning: the demo network on `mnist5k` at batch 64 reached a
      training accuracy of 0.19 in its first epoch with it and 0.53 without
      (bench/README.md, `recipe_vs_plain_keras.py --slow-start`).

    Example:
    >>> Config().peak_lr  # 0.1 x 1024 / 256
    0.4
    >>> c = Config(dataset="mnist5k", epochs=9)
    >>> c.image_size, c.batch_size, c.warmup_epochs, c.step_boundaries, c.zero_init_residual
    (28, 128, 0.5, (3.0, 6.0, 8.0), False)
    """

    dataset: str = "tfds:imagenet2012"  # [MG] ImageNet-1k; "mnist5k" for the CPU demo
    epochs: int = 90  # [Goyal] sec. 5.1, [MG], [NV]
    batch_size: Optional[int] = None  # global; None: 1024 [MG], [NV] 256 x 8 GPUs; embedded sets 128 [He] 4.2 (CIFAR)
    precision: str = "auto"  # mixed_float16 on GPUs >= 7.0 [NV], bfloat16 on TPU [MG]
    strategy: str = "auto"
    seed: int = 0
    run_dir: Optional[str] = None
    # -- model
    model: str = "resnet50"  # [He], v1.5 as [NV]/[MG]
    image_size: Optional[int] = None  # None: 224 [He]; the embedded sets' own 28 / 8 px (not upsampled)
    # progressive resizing [FFCV, fastai]: [[fraction of the run, training side], ...], e.g. [[0, 160], [0.75, 192]];
    # None: every epoch at image_size. Evaluation is at image_size; batch size and steps per epoch stay fixed
    image_size_schedule: Optional[list[Any]] = None
    width: int = 64  # filters of the first stage [He]; the CPU demo uses 16
    small_stem: Optional[bool] = None  # None: 3x3 stem without max-pool for images <= 64 px
    zero_init_residual: Optional[bool] = None  # last BN gamma = 0 [Goyal] 5.1; None: batch >= 256 [Bag of Tricks] 3.1
    fused_batchnorm: Optional[bool] = None  # None: TF's fused BN kernel on the TF backend (as tf.keras, [MG])
    dropout: float = 0.0  # [He] none
    # -- optimisation
    optimizer: Literal["auto", "sgd", "lars"] = "auto"  # auto: SGD up to 8k, LARS above [You]
    base_lr: float = 0.1  # per 256 images, linear scaling rule [Goyal] sec. 2.1
    lr_base_batch: int = 256  # [Goyal]
    momentum: float = 0.9  # [He], [Goyal]
    nesterov: bool = True  # [NV] / [MG] use Nesterov
    weight_decay: float = 5e-5  # [NV] 3.05e-5, [MG] 1e-4 (L2); decoupled, not on BN/bias
    warmup_epochs: Optional[float] = None  # None: 5/90 of the run ([Goyal] sec. 2.2: 5 of 90 epochs)
    schedule: Literal["cosine", "step"] = "cosine"  # [Loshchilov], [NV]; "step" = [Goyal]/[He]
    step_boundaries: Optional[tuple[float, ...]] = None  # epochs, x0.1 each; None: 30/60/80 of 90 [Goyal] as shares
    min_lr: float = 0.0  # cosine to zero [NV]
    label_smoothing: float = 0.1  # [Szegedy], [NV], [MG]
    use_ema: bool = False  # Keras built-in EMA of weights
    ema_momentum: float = 0.9999
    randaugment: bool = False  # keras.layers.RandAugment; off in the 90-epoch recipe
    mixup_alpha: float = 0.0  # keras.layers.MixUp; 0 = off ([NV] 0.2 for 250 epochs)
    cutmix_alpha: float = 0.0  # keras.layers.CutMix; 0 = off
    lars_threshold: int = 8192  # batch above which "auto" picks LARS [You]
    # -- data
    data_dir: Optional[str] = None  # TFDS data_dir / base of folder and TFRecord paths
    augment: Optional[str] = None  # None: inception crop (> 64 px), pad-crop for small images
    crop_padding: Optional[int] = None  # pad-crop shift in px; None: image_size/8 (He et al. CIFAR: 4 at 32)
    cache: bool = False
    val_fraction: float = 0.1  # carved from train when the source has no validation split
    # tf.data service dispatcher "grpc://HOST:PORT" (`trainwell data-service`): training examples are decoded and
    # augmented on its workers, each once per pass in an order that is not deterministic; None: in-process
    data_service: Optional[str] = None
    # -- performance
    jit_compile: Optional[bool] = None  # None: Keras's "auto"
    steps_per_execution: Optional[int] = None  # None: 8 on a GPU/TPU, 1 on CPUs (harness.steps_per_execution)
    # -- reliability
    checkpoint_every: str = "epoch"  # "epoch" or a number of steps
    keep_last: int = 3
    nan_rollback: bool = True
    snapshot_every: int = 100  # steps between NaN-rollback snapshots
    early_stopping_patience: Optional[int] = None  # None: off, the recipe runs all epochs
    doctor: bool = True  # TrainingDoctor at low overhead settings
    deterministic: bool = False  # op determinism (slower); needed for bit-exact resume
    verbose: Literal["auto", 0, 1, 2] = "auto"  # Keras fit verbosity

    def __post_init__(self) -> None:
        # The fields left None, derived in `validate` once the values are coerced.
        self._derived = tuple(k for k in DERIVED_FIELDS if getattr(self, k, None) is None)
        super().__post_init__()

    def replace(self, **changes):
        """A copy with `changes` applied; fields derived here are derived again for the copy."""
        return super().replace(**{**{k: None for k in self._derived}, **changes})

    def _derive(self) -> None:
        native = EMBEDDED_IMAGES.get(self.embedded_name)
        if self.image_size is None:
            self.image_size = native[0] if native else 224
        if self.batch_size is None:
            self.batch_size = 128 if native else 1024
        if self.zero_init_residual is None:
            self.zero_init_residual = self.batch_size >= self.lr_base_batch
        if self.warmup_epochs is None:
            self.warmup_epochs = round(WARMUP_FRACTION * self.epochs, 4)
        if self.step_boundaries is None:
            self.step_boundaries = tuple(round(f * self.epochs, 4) for f in STEP_FRACTIONS)

    def validate(self) -> None:
        super().validate()
        check_positive(self, "lr_base_batch")
        self._derive()

        names = [f"resnet{d}" for d in RESNET_DEPTHS]
        check_choice(self, "model", names)
        check_positive(self, "image_size")
        stride = SMALL_STEM_STRIDE if self.use_small_stem else IMAGENET_STEM_STRIDE
        if self.image_size < stride:
            stem = "the small-image stem" if self.use_small_stem else "ImageNet's stem (small_stem=false)"
            raise_invalid("image_size", self.image_size,
                          f"at least {stride} px, the network's total stride with {stem} (a smaller image is "
                          "down to 1 px before the last stage)")
        if self.image_size_schedule is not None:
            checked = check_size_schedule(self.image_size_schedule, stride, what="", error=ConfigError)
            self.image_size_schedule = [[f, s] for f, s in checked]  # lists: the config file's YAML
        check_positive(self, "width")
        check_range(self, "dropout", 0.0, 1.0, hi_open=True)
        check_positive(self, "base_lr")
        check_range(self, "momentum", 0.0, 1.0, hi_open=True)
        check_positive(self, "weight_decay", allow_zero=True)
        check_positive(self, "warmup_epochs", allow_zero=True)
        if self.warmup_epochs >= self.epochs:
            raise_invalid("warmup_epochs", self.warmup_epochs,
                  f"fewer than epochs={self.epochs} (or null: {WARMUP_FRACTION * 100:.1f}% of the run)")
        bounds = list(self.step_boundaries)
        if (not bounds or bounds != sorted(set(bounds)) or bounds[0] <= 0 or bounds[-1] >= self.epochs
                or (self.schedule == "step" and bounds[0] <= self.warmup_epochs)):
            raise_invalid("step_boundaries", bounds, f"increasing epochs after the warmup ({self.warmup_epochs}) and before "
                  f"epochs={self.epochs} (or null: 1/3, 2/3 and 8/9 of the run)")
        check_positive(self, "min_lr", allow_zero=True)
        if self.min_lr > self.peak_lr:
            raise_invalid("min_lr", self.min_lr, f"at most the peak LR {self.peak_lr:g} (base_lr x batch_size / lr_base_batch)")
        check_range(self, "label_smoothing", 0.0, 1.0, hi_open=True)
        check_range(self, "ema_momentum", 0.0, 1.0, lo_open=True, hi_open=True)
        check_positive(self, "mixup_alpha", allow_zero=True)
        check_positive(self, "cutmix_alpha", allow_zero=True)
        check_range(self, "val_fraction", 0.0, 1.0, hi_open=True)
        check_positive(self, "crop_padding", allow_zero=True)
        check_reliability_fields(self)
        if self.augment is not None:
            check_choice(self, "augment", AUGMENTATIONS)
        check_dir_path(self.data_dir, "data_dir")  # a file, or a directory this process cannot read
        if self.data_service is not None:
            try:
                check_target(self.data_service)
            except ValueError:
                raise_invalid("data_service", self.data_service, "a tf.data service dispatcher 'grpc://HOST:PORT', or null")
            if self.image_size_schedule is not None:  # the epoch's side is a variable of this process
                raise_invalid("data_service", self.data_service, "null with image_size_schedule (not supported together yet)")
        check_image_source(self.dataset, self.data_dir)  # names, paths, the folder's classes
        self._check_batch_fits()

    def _check_batch_fits(self) -> None:
        """A batch larger than an embedded set's training split would make no full batch."""
        if self.embedded_name is None:
            return  # known once the data are built (`train` checks it there)
        total = EMBEDDED_IMAGES[self.embedded_name][1]
        if self.batch_size <= total * (1 - self.val_fraction - TEST_FRACTION) - 10:  # 10 classes of rounding
            return
        n = self.train_examples()
        if self.batch_size > n:
            raise_invalid("batch_size", self.batch_size, f"at most the {n} training examples of {self.dataset!r}")

    @property
    def embedded_name(self) -> Optional[str]:
        """The embedded image set `dataset` names (`"mnist5k"`, `"embedded:digits"`), else None."""
        name = self.dataset[len("embedded:"):] if self.dataset.startswith("embedded:") else self.dataset
        return name if name in EMBEDDED_IMAGES else None

    def train_examples(self) -> Optional[int]:
        """Examples in the training split of an embedded set (None for other sources).

        Example:
        >>> Config(dataset="digits").train_examples()
        1259
        """
        if self.embedded_name is None:
            return None

        splits = embedded.load(self.embedded_name, val_fraction=self.val_fraction, test_fraction=TEST_FRACTION)
        return splits.sizes()["train"]

    @property
    def depth(self) -> int:
        return int(self.model.replace("resnet", ""))

    @property
    def peak_lr(self) -> float:
        """Peak LR after warmup: base_lr x batch_size / lr_base_batch [Goyal]."""
        return scaled_lr(self.base_lr, self.batch_size, self.lr_base_batch)

    @property
    def use_small_stem(self) -> bool:
        return self.image_size <= 64 if self.small_stem is None else self.small_stem

    @property
    def optimizer_name(self) -> str:
        if self.optimizer != "auto":
            return self.optimizer
        return "lars" if self.batch_size > self.lars_threshold else "sgd"


def _cfg(cfg: Config | None, overrides: dict) -> Config:
    if cfg is None:
        return Config(**overrides)
    return cfg.replace(**overrides) if overrides else cfg


# --------------------------------------------------------------------------- data
def build_data(cfg: Config, input_context=None, train_size=None, start=None):
    """The train/val/test `tf.data` pipelines of `cfg.dataset` (`trainwell.data.images`).

    With `cfg.image_size_schedule`, the training images have the side `train_size`
    holds (`epoch_image_size(cfg)`, made here when not given: epoch 0's side until its
    callback sets another); validation and test images have `cfg.image_size`. With
    `start` (`data_start`), the resumed epoch's iterator drops the examples already
    trained before decoding them.

    Example:
    >>> data = build_data(Config(dataset="digits", image_size=8, batch_size=32))  # doctest: +SKIP
    >>> data.num_classes  # doctest: +SKIP
    10
    """
    # lazy: it imports Keras/TensorFlow; loaded on first use, not with this module
    from trainwell.data.images import build_image_datasets

    if train_size is None:
        train_size = epoch_image_size(cfg)
    return build_image_datasets(
        cfg.dataset,
        image_size=cfg.image_size,
        global_batch_size=cfg.batch_size,
        seed=cfg.seed,
        data_dir=cfg.data_dir,
        cache=cfg.cache,
        augment=cfg.augment,
        crop_padding=cfg.crop_padding,
        val_fraction=cfg.val_fraction,
        test_fraction=TEST_FRACTION,
        input_context=input_context,
        one_hot=True,
        train_size=None if train_size is None else train_size.variable,
        start_at=None if start is None else start.variable,
        data_service=cfg.data_service,
    )


def data_start(cfg: Config, checkpoint_dir):
    """Where the training data of a run in `checkpoint_dir` starts: `(EpochStart, batches)`.

    The epoch the run resumes in and the batches of it already trained, for the checkpoint
    `Checkpoint` will load (`resume_checkpoint`'s choice); `(epoch 0, 0)` for a new run.

    Example:
    >>> data_start(Config(dataset="digits"), "/nonexistent")[1]  # doctest: +SKIP
    0
    """
    # lazy: the callbacks and the pipeline import Keras/TensorFlow; loaded when a run starts
    from trainwell.callbacks.checkpoint import resume_checkpoint
    from trainwell.callbacks.checkpoint.resume import batches_to_skip
    from trainwell.data.epoch_start import EpochStart

    chosen = resume_checkpoint(checkpoint_dir)
    if chosen is None:
        return EpochStart(0, 0), 0
    skip = batches_to_skip(chosen["position"])
    return EpochStart(int(chosen["position"]["epoch"]), skip * cfg.batch_size), skip


def epoch_image_size(cfg: Config):
    """Progressive resizing: the side of each epoch's training images, or None without a schedule.

    A `trainwell.data.resizing.EpochImageSize` over `cfg.image_size_schedule` and
    `cfg.epochs`: its `variable` goes to `build_data`, its `callback()` to `fit`. One
    `fit` trains every size: each epoch's batches come at that epoch's side, the model
    takes any side (global average pooling) and is traced at most once per side, the
    batch size and steps per epoch stay fixed (so the LR schedule, which counts steps, is
    unchanged), and the side is a function of the epoch alone, so a resume is exact
    across a size change and no callback has more state. Segments of `fit`, one per
    size, were the other way: they would run every callback's `on_train_begin` and
    `on_train_end` again (a checkpoint loaded again, early stopping's state reset).

    Example:
    >>> epoch_image_size(Config(dataset="digits", epochs=4, image_size=16,
    ...                         image_size_schedule=[[0, 8], [0.5, 16]])).sizes
    [8, 8, 16, 16]
    """
    if not cfg.image_size_schedule:
        return None
    from trainwell.data.resizing import EpochImageSize  # lazy: it imports TensorFlow when made

    return EpochImageSize(cfg.image_size_schedule, cfg.epochs)


def training_steps(cfg: Config, data) -> int:
    """Full training batches per epoch of `data` (`build_data`'s), or a one-line error.

    A source whose size is known only once it is built (a folder, TFRecords) is
    checked here against `batch_size`; the embedded sets are checked by `Config`.

    Example:
    >>> training_steps(Config(dataset="digits"), build_data(Config(dataset="digits")))  # doctest: +SKIP
    9
    """
    steps = data.steps_per_epoch
    if steps == 0:
        raise_invalid("batch_size", cfg.batch_size, f"at most the {data.counts['train']} training examples of {cfg.dataset!r}")
    if steps is None:
        raise ValueError(f"Cannot tell the number of training batches of {cfg.dataset!r}; set a sized source.")
    return steps


# --------------------------------------------------------------------------- model
def build_model(cfg: Config, num_classes: int, channels: int = 3):
    """ResNet v1.5 of `cfg.model` (`trainwell.models.resnet.build_resnet`).

    RandAugment / MixUp / CutMix, when enabled, run in the training input pipeline
    (`augment_batch`), not in the model, so evaluation and export never see them.

    Example:
    >>> model = build_model(Config(model="resnet18", image_size=32, width=16), 10)  # doctest: +SKIP
    """
    # lazy: it imports Keras/TensorFlow; loaded on first use, not with this module
    from trainwell.models.resnet import build_resnet

    return build_resnet(
        cfg.depth,
        num_classes=num_classes,
        # any side with progressive resizing (global average pooling: no weight depends on it)
        input_shape=(None, None, channels) if cfg.image_size_schedule else (cfg.image_size, cfg.image_size, channels),
        small_stem=cfg.use_small_stem,
        dropout=cfg.dropout,
        zero_init_residual=cfg.zero_init_residual,
        width=cfg.width,
        fused_batchnorm=cfg.fused_batchnorm,
    )


def augment_batch(cfg: Config, train_ds, num_classes: int):
    """Adds the optional batch augmentations (Keras layers) to a training dataset.

    `keras.layers.RandAugment` (uint8-range images: the pipeline's normalised images are
    mapped back and forth), `keras.layers.MixUp` and `keras.layers.CutMix` on one-hot labels.
    """
    if not (cfg.randaugment or cfg.mixup_alpha or cfg.cutmix_alpha):
        return train_ds
    # lazy: Keras/TensorFlow load on first use, not with this module
    import keras
    import tensorflow as tf

    layers = []
    if cfg.randaugment:
        layers.append(("randaugment", keras.layers.RandAugment(value_range=(-3.0, 3.0), seed=cfg.seed)))
    if cfg.mixup_alpha:
        layers.append(("mixup", keras.layers.MixUp(alpha=cfg.mixup_alpha, seed=cfg.seed)))
    if cfg.cutmix_alpha:
        layers.append(("cutmix", keras.layers.CutMix(factor=cfg.cutmix_alpha, seed=cfg.seed)))

    def apply(x, y):
        for kind, layer in layers:
            if kind == "randaugment":
                x = layer(x, training=True)
            else:
                out = layer({"images": x, "labels": y}, training=True)
                x, y = out["images"], out["labels"]
        return x, y

    return train_ds.map(apply, num_parallel_calls=tf.data.AUTOTUNE)


# --------------------------------------------------------------------------- optimiser
def build_optimizer(cfg: Config, steps_per_epoch: int, learning_rate=None):
    """SGD with Nesterov momentum (or LARS above `lars_threshold`) on a warmup schedule.

    Weight decay is decoupled and not applied to BatchNorm parameters and biases
    (`exclude_from_weight_decay`, a Keras built-in). The schedule is a trainwell
    `WarmupCosineDecay` / `WarmupStepDecay`, whose LR multiplier lets NaN rollback
    lower the LR of the built optimizer.

    Args:
        cfg: The config.
        steps_per_epoch: Training batches per epoch (sizes the schedule).
        learning_rate: A fixed LR (or schedule) instead of the recipe's schedule,
            e.g. for the LR range test. Defaults to `None`.

    Example:
    >>> opt = build_optimizer(Config(batch_size=256), steps_per_epoch=100)  # doctest: +SKIP
    """
    # lazy: Keras/TensorFlow load on first use, not with this module
    import keras

    from trainwell.callbacks.schedules import WarmupCosineDecay, WarmupStepDecay  # lazy: the callbacks import Keras

    total = max(1, cfg.epochs * steps_per_epoch)
    warmup = min(total, int(round(cfg.warmup_epochs * steps_per_epoch)))
    if learning_rate is not None:
        lr = learning_rate
    elif cfg.schedule == "cosine":
        lr = WarmupCosineDecay(cfg.peak_lr, total_steps=total, warmup_steps=warmup, min_lr=cfg.min_lr)
    else:
        # Epochs to steps; boundaries that fall on one step (a run of few steps) count once.
        steps = sorted({int(round(b * steps_per_epoch)) for b in cfg.step_boundaries})
        lr = WarmupStepDecay(
            cfg.peak_lr, boundaries=[b for b in steps if warmup <= b < total and b >= 1] or [total],
            decay_rate=0.1, warmup_steps=warmup,
        )
    common = dict(use_ema=cfg.use_ema, ema_momentum=cfg.ema_momentum)
    if cfg.optimizer_name == "lars":
        # lazy: it imports Keras/TensorFlow; loaded on first use, not with this module
        from trainwell.optimizers import LARS

        opt = LARS(learning_rate=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, nesterov=cfg.nesterov, **common)
    else:
        opt = keras.optimizers.SGD(
            learning_rate=lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
            weight_decay=cfg.weight_decay or None, **common,
        )
        opt.exclude_from_weight_decay(var_names=["gamma", "beta", "bias"])
    return opt


def compile_model(cfg: Config, model, steps_per_epoch: int, learning_rate=None) -> None:
    """Compiles `model` with the recipe's optimizer, loss (label smoothing) and metrics."""
    from trainwell.losses import CategoricalCrossentropy  # lazy: Keras loads on first use, not with this module
    from trainwell.recipes.harness import steps_per_execution  # lazy, as the recipe's other harness uses

    model.compile(
        optimizer=build_optimizer(cfg, steps_per_epoch, learning_rate=learning_rate),
        # Keras's, with the smoothing in a variable: a PBT exploit that explores it keeps the traced step
        loss=CategoricalCrossentropy(label_smoothing=cfg.label_smoothing),
        # weighted: a short last evaluation batch padded with zero-weighted examples (JAX data
        # parallelism, trainwell/data/batches.py) is not counted; the same values everywhere else
        weighted_metrics=["accuracy"],
        jit_compile="auto" if cfg.jit_compile is None else cfg.jit_compile,
        steps_per_execution=steps_per_execution(cfg.steps_per_execution),
    )


def lr_find_setup(cfg: Config):
    """A compiled model (fixed LR) and the training data, for `trainwell lr-find`.

    Example:
    >>> model, data = lr_find_setup(Config(dataset="digits", image_size=8))  # doctest: +SKIP
    """
    data = build_data(cfg)
    model = build_model(cfg, data.num_classes, data.channels)
    compile_model(cfg, model, data.steps_per_epoch or 1, learning_rate=1e-3)
    return model, data.train


def lr_to_config(cfg: Config, peak_lr: float) -> dict:
    """The config change that makes `peak_lr` the recipe's peak LR (`base_lr` is per 256)."""
    return {"base_lr": peak_lr * cfg.lr_base_batch / cfg.batch_size}


# --------------------------------------------------------------------------- callbacks
def build_callbacks(cfg: Config, run_dir, schedule=None, chief: bool = True) -> list:
    """trainwell's reliability stack plus TensorBoard and CSVLogger for a run directory.

    Args:
        cfg: The config.
        run_dir: The run directory.
        schedule: The optimizer's LR schedule (logged and plotted). Defaults to `None`.
        chief: Whether this process writes the run directory. Defaults to `True`.

    Example:
    >>> cbs = build_callbacks(Config(), "/tmp/run")  # doctest: +SKIP
    """
    # lazy: it imports Keras/TensorFlow; loaded on first use, not with this module
    from trainwell.recipes.harness import standard_callbacks

    return standard_callbacks(
        cfg, run_dir,
        monitor="val_accuracy", mode="max",
        schedule=schedule,
        checkpoint_every=cfg.checkpoint_every,
        keep_last=cfg.keep_last,
        nan_rollback=cfg.nan_rollback,
        snapshot_every=cfg.snapshot_every,
        early_stopping_patience=cfg.early_stopping_patience,
        warmup_epochs=int(math.ceil(cfg.warmup_epochs)),
        doctor=cfg.doctor,
        chief=chief,
    )


# --------------------------------------------------------------------------- train
def train(cfg: Config | None = None, *, callbacks=None, model_hook=None, segment: bool = False, **overrides):
    """Trains the recipe and returns a `trainwell.recipes.harness.RunResult`.

    Args:
        cfg: A `Config`. Defaults to `None` (the published defaults).
        callbacks: Extra Keras callbacks, run after the recipe's own (e.g. a
            KerasTuner reporter). Defaults to `None`.
        model_hook: `model_hook(factory) -> factory`, wrapping the function that
            builds and compiles the run's model (`factory(cfg) -> model`): how a
            PBT search hands a member the model it kept from its previous segment
            (see `trainwell.recipes.hypermodel.recipe_model_hook`). Defaults to `None`.
        segment: The run is one segment of a longer one, continued later (a PBT or
            Hyperband segment): the test evaluation and `curves.png` are
            skipped (nothing reads them before the last segment). Defaults to `False`.
        **overrides: Config fields to change, e.g. `epochs=5`.

    Returns:
        `RunResult(model, history, metrics, run_dir, config)`; `metrics` holds the test
        split's `test_loss` and `test_accuracy`.

    Example:
    >>> run = train(dataset="mnist5k", epochs=1, image_size=28, batch_size=128,
    ...             model="resnet18", width=16)  # doctest: +SKIP
    """
    # lazy: the harness and the quick switch import Keras; loaded when training starts
    from trainwell import quick
    from trainwell.compat import build_before_fit, raw_learning_rate
    from trainwell.recipes import harness  # lazy: it imports Keras
    from trainwell.callbacks import Checkpoint, WarmupCosine  # lazy: the callbacks import Keras

    cfg = _cfg(cfg, overrides)
    with harness.setup_run(cfg, RECIPE) as ctx:  # releases the run dir's lock at the end
        sizes = epoch_image_size(cfg)
        start, skip = data_start(cfg, harness.checkpoint_dir(ctx.run_dir))
        if cfg.data_service and (start.epoch or skip):  # `Checkpoint` takes the trained batches from the service
            warnings.warn(f"Resuming with data_service={cfg.data_service!r}: the epoch and the examples trained are "
                          "exact, their order is not; a bit-identical resume needs data_service=null.", stacklevel=2)
        data = build_data(cfg, train_size=sizes, start=None if cfg.data_service else start)
        steps = training_steps(cfg, data)
        # Exact resume: the resumed epoch sees the same order and augmentation as it would have.
        train_ds = harness.advance_epochs(data.train, start.epoch)
        train_ds = augment_batch(cfg, train_ds, data.num_classes)

        def build_compiled(cfg: Config):
            model = build_model(cfg, data.num_classes, data.channels)
            compile_model(cfg, model, steps)
            return model

        with ctx.strategy.scope():
            model = (model_hook(build_compiled) if model_hook is not None else build_compiled)(cfg)
        schedule = raw_learning_rate(model.optimizer)
        callbacks = build_callbacks(cfg, ctx.run_dir, schedule=schedule, chief=ctx.is_chief) + list(callbacks or ())
        if not any(isinstance(c, WarmupCosine) for c in callbacks):  # the step schedule: its LR in the history
            callbacks.insert(0, harness.log_learning_rate(model))
        if data.starts_at:  # the resumed epoch's batches already trained are dropped before decoding
            callbacks.insert(0, start.callback())
            next(c for c in callbacks if isinstance(c, Checkpoint)).data_positioned(skip)
        if sizes is not None:  # first: it sets the epoch's image side before the epoch's iterator is made
            callbacks.insert(0, sizes.callback())
        build_before_fit(model, train_ds)  # one trace on TF; on JAX the k-th iterator stays the k-th epoch
        with ctx.fit_scope():  # JAX: fit reads the distribution when called
            history = model.fit(
                train_ds, validation_data=data.val, epochs=cfg.epochs, steps_per_epoch=steps,
                callbacks=callbacks, verbose=cfg.verbose, shuffle=False,  # the pipeline shuffles (seeded)
            )
            test = {}
            if data.test is not None and not segment and not harness.trained_nothing(history, ctx.run_dir):
                if cfg.verbose != 0:
                    print(f"Evaluating on the test split ({data.counts['test']} images) ...", flush=True)
                test = model.evaluate(data.test, verbose=cfg.verbose, return_dict=True,
                                      steps=quick.test_steps())  # TRAINWELL_QUICK: a few test batches
        metrics = {f"test_{k}": v for k, v in test.items()}
        return harness.finish_run(ctx, cfg, model, metrics, history, plots=not segment)


# --------------------------------------------------------------------------- hyperparameter search
def _tuning_space(hp, cfg: Config) -> dict:
    """Declares the search space on `hp` (defaults = `cfg`) and returns the config fields it sets.

    `peak_lr` is the peak LR at the config's batch size; with another `batch_size`
    the linear scaling rule applies (`base_lr = peak_lr x lr_base_batch / cfg.batch_size`).
    """
    from trainwell.recipes.hypermodel import batch_size_choice, log_float  # lazy: keras_tuner loads only for a search

    peak_lr = log_float(hp, "peak_lr", cfg.peak_lr, 10.0)
    weight_decay = log_float(hp, "weight_decay", cfg.weight_decay or 5e-5, 10.0)
    # ranges widen to hold the config's own value, so the defaults give back the config
    frac = cfg.warmup_epochs / cfg.epochs
    warmup = hp.Float("warmup_fraction", 0.0, max(0.3, frac), default=frac)
    smoothing = hp.Float("label_smoothing", 0.0, max(0.3, cfg.label_smoothing), default=cfg.label_smoothing)
    dropout = hp.Float("dropout", 0.0, max(0.5, cfg.dropout), default=cfg.dropout)
    batch = batch_size_choice(hp, cfg.batch_size, limit=cfg.train_examples())
    optimizer = hp.Choice("optimizer", ["sgd", "lars"], default=cfg.optimizer_name)
    return {
        "base_lr": peak_lr * cfg.lr_base_batch / cfg.batch_size,
        "weight_decay": weight_decay,
        "warmup_epochs": warmup * cfg.epochs,  # the trial's epochs (the search's, for Hyperband and PBT)
        "label_smoothing": smoothing,
        "dropout": dropout,
        "batch_size": batch,
        "optimizer": optimizer,
        "zero_init_residual": cfg.zero_init_residual,  # the same network at every batch size
    }


def _tuning_build(cfg: Config):
    data = build_data(cfg)
    model = build_model(cfg, data.num_classes, data.channels)
    compile_model(cfg, model, data.steps_per_epoch or 1)
    return model


def export_model(model, cfg: Config, run_dir=None, path="best_model"):
    """Saves `model` for serving as `path/model.keras`: raw images in, class probabilities out.

    The recipe's model takes images the input pipeline has resized and normalised
    (`trainwell.data.images`) and is compiled with a loss on one-hot labels; the
    export does what the pipeline's evaluation does in the model itself
    (`keras.layers.Resizing` with a centre crop to a square, the 0.875 centre crop
    above 64 px, then `Normalization` with the pipeline's mean and std of 0-255
    pixels), so it takes images as a user has them: `(N, H, W, C)`, uint8 or
    float pixels in [0, 255], any size. It is saved uncompiled (no optimizer
    state): `keras.models.load_model` after `import trainwell.models.layers`
    (its BatchNorm) gives `predict(images) -> (N, num_classes)` probabilities, in
    the order of the dataset's classes. Above 64 px the pipeline crops, then
    resizes; the export resizes to `image_size / 0.875`, then crops (the same
    region, resampled in the other order, as torchvision's evaluation).

    Args:
        model: The trained model (`build_model`'s).
        cfg: Its config (`image_size`).
        run_dir: The trial's run directory (unused; `RecipeHyperModel`'s `export_fn` signature).
        path: The export's directory. Defaults to `"best_model"`.

    Returns:
        The path of the saved `model.keras`.

    Example:
    >>> export_model(run.model, run.config, run.run_dir, "served")  # doctest: +SKIP
    >>> keras.models.load_model("served/model.keras").predict(load("digits").test[0])  # doctest: +SKIP
    """
    import keras  # lazy: Keras at import time

    from trainwell.data.images import (  # lazy: it imports TensorFlow
        EVAL_CROP_FRACTION, GRAY_MEAN, GRAY_STD, IMAGENET_MEAN, IMAGENET_STD, SMALL_IMAGE_MAX,
    )

    channels = int(model.input_shape[-1])
    size = int(cfg.image_size)
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else (GRAY_MEAN, GRAY_STD)
    crop = EVAL_CROP_FRACTION if size > SMALL_IMAGE_MAX else 1.0
    clean = keras.models.clone_model(model)  # uncompiled: no optimizer or loss in the export
    clean.set_weights(model.get_weights())
    images = keras.Input((None, None, channels), name="images")
    side = int(round(size / crop))
    x = keras.layers.Resizing(side, side, crop_to_aspect_ratio=True, name="resize")(images)
    if side != size:
        x = keras.layers.CenterCrop(size, size, name="center_crop")(x)
    x = keras.layers.Normalization(mean=[255.0 * m for m in mean], variance=[(255.0 * d) ** 2 for d in std],
                                   name="normalise")(x)
    serving = keras.Model(images, clean(x), name=f"{model.name}_serving")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / ".model.keras.tmp.keras"
    serving.save(str(tmp))
    os.replace(tmp, path / "model.keras")
    return path / "model.keras"


def hypermodel(cfg: Config | None = None, **overrides):
    """A `keras_tuner.HyperModel` over this recipe (see `trainwell.tuning`).

    The space: peak LR (log, /10 to x10 of the config's), weight decay (log), warmup
    fraction (of the trial's epochs: the search's `max_epochs` for Hyperband and PBT),
    label smoothing, dropout, batch size (half, same, double, none above an embedded
    set's training split; LR by the linear scaling rule) and the optimizer (SGD or
    LARS), each defaulting to the config; every trial builds the config's network
    (its `zero_init_residual` at every batch size). A trial runs `train()` in its own run directory with the recipe's
    callbacks (NaN rollback, early stopping when `early_stopping_patience` is set,
    checkpoints), `verbose=0` and no TrainingDoctor unless `doctor` is overridden,
    and reports `val_accuracy`. PBT never explores `batch_size`, `optimizer` and
    `dropout` (an exploit takes the donor's with its checkpoint): they change the data or
    the optimizer state, and `dropout=0` builds no `Dropout` layer (its seed generator),
    so an exploit that moved it off 0 could not load the donor's checkpoint. The best
    trial's export (`export_model`) takes raw images and returns probabilities.

    Example:
    >>> from trainwell import tuning
    >>> hm = hypermodel(dataset="digits", image_size=8, model="resnet18", width=8, epochs=6)
    >>> result = tuning.search(hm, "bayesian", max_trials=10)  # doctest: +SKIP
    """

    from trainwell.recipes.hypermodel import recipe_hypermodel  # lazy: keras_tuner loads only for a search

    cfg = _cfg(cfg, overrides)
    trial = {"verbose": 0}
    if "doctor" not in overrides:
        trial["doctor"] = False
    return recipe_hypermodel(
        sys.modules[__name__], cfg, _tuning_space, build_fn=_tuning_build, export_fn=export_model, trial_overrides=trial,
        objective="val_accuracy", direction="max", static=("batch_size", "optimizer", "dropout"), name=RECIPE,
    )
