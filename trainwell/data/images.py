"""Image classification input pipelines: TFDS, image folders, ImageNet TFRecords, embedded, synthetic.

Every source (`trainwell.data.image_sources`) feeds the same decode and augment
(`trainwell.data.image_ops`), batch and shard steps (here), which must stay identical
across sources for exact resume.

One function, `build_image_datasets`, returns train/val/test `tf.data.Dataset`s of
`(image, label)` batches plus their metadata (`ImageDatasets`). What it does is the
TF Model Garden / "ImageNet in 1 hour" input pipeline:

Training (`augment="inception"`, the default above 64 px): Inception-style random
resized crop (area 8%-100% of the image, aspect ratio 3/4-4/3, drawn with
`tf.image.stateless_sample_distorted_bounding_box`), decoded with
`tf.image.decode_and_crop_jpeg` so only the crop is decoded (PNG and other formats are
decoded in full, then cropped), bilinear resize to `image_size`, random horizontal
flip, then normalisation with the ImageNet mean/std.

Small images (64 px or less, e.g. CIFAR): `"pad_crop_flip"` (zero-pad `image_size/8`
pixels, random crop back, random flip: the ResNet-on-CIFAR recipe of He et al. 2016).
Grayscale images (MNIST, digits): `"pad_crop"`, the same **without flips**: a mirrored
2, 3, 5, 7 or 9 is not the same digit. Grayscale images are normalised with the mean of
the ImageNet means and stds (0.449, 0.226; what timm uses for one-channel models).

Evaluation: centre crop then resize. The crop is the central square of side
`eval_crop_fraction * min(height, width)` (0.875 above 64 px, i.e. "resize to
image_size / 0.875 then take the central image_size" done in the other order so that
`decode_and_crop_jpeg` decodes only the crop; 1.0 for small images).

Throughput: parallel interleave over files, `AUTOTUNE` maps, `prefetch`, optional
`cache`. Determinism: seeded file and record shuffles, `deterministic=True` options, and
augmentation drawn with stateless ops from a per-element seed (`[seed, position]`;
a seeded stateful draw under FILE autosharding); the same arguments give
the same batches in the same order (within one TensorFlow global seed; `seed` and
`keras.utils.set_random_seed` both matter).

Corrupt or unreadable images never crash a run, and are counted
(`ImageDatasets.skipped`, names in `skipped_examples`): unreadable files (permissions,
dangling links) when a folder is listed; while iterating, every record goes through a
cheap in-graph check before it is decoded (a known image signature, and for JPEG/PNG
the end marker, so empty, truncated, non-image and garbled-header files are caught;
a TFRecord without image or label; a label out of range), and a record that fails is
replaced by a flagged placeholder, counted and filtered out. What the decoders still
reject after that check (rare: damaged entropy-coded data) is dropped by
`ignore_errors(log_warning=True)`: the run goes on and TensorFlow logs it, but it is
not in the count (counting it too needs each record in its own `ignore_errors` dataset:
too slow; bench/README.md). The count grows as the datasets are iterated.

Batches per epoch: the training dataset yields exactly `ImageDatasets.steps` batches per iteration
(times its share of the replicas under `input_context`) and has that cardinality, so Keras,
told `steps_per_epoch`, makes a new iterator each epoch (what exact resume builds on). A
training epoch short of full batches (images skipped, a smaller shard) is topped up with
images of a fixed-order pass over the split. Under FILE auto-sharding the training stream is
endless (each worker's share of the files is unknown) and Keras counts the steps. Evaluation
splits score each readable image once in `ceil(readable / batch)` batches, their cardinality:
the images that read and decode are counted when the datasets are built (one pass of the
evaluation pipeline, without batching), and evaluation splits are sharded by data, never by
file, so every worker counts the same batches. The last two batches share the remainder, so
that no replica is left an empty batch.

Multi-worker: pass `input_context` (from `strategy.distribute_datasets_from_function`)
and each input pipeline reads its own share of the files (folders, TFRecords with at
least as many files as pipelines), records or TFDS shards, and batches per replica.
Without it, the datasets set `AutoShardPolicy.FILE` for TFRecords with at least one
file per worker (several workers in `TF_CONFIG`) and `DATA` otherwise; a folder of
images cannot use `FILE` (tf.data's file sharding recognises reader datasets such as
`TFRecordDataset` only), so it is sharded by data unless `input_context` is given.
FILE sharding cannot walk through `ignore_errors`, so those pipelines go without that
last safety net (the in-graph check still flags and counts bad records).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import zlib
from typing import Any

import numpy as np
import tensorflow as tf

from trainwell.data.batches import batch_with_even_tail
from trainwell.data.image_ops import Transform, valid_image
from trainwell.data.image_sources import (
    IMAGENET_TRAIN_EXAMPLES,
    IMAGENET_VAL_EXAMPLES,
    SPLITS,
    Source,
    Split,
    open_source,
)
from trainwell.data.sources import AUGMENTATIONS, DataError
from trainwell.data.service import distribute
from trainwell.data.synthetic import synthetic_datasets
from trainwell.validation import invalid_argument, is_int, is_number

logger = logging.getLogger("trainwell.data")

AUTOTUNE = tf.data.AUTOTUNE

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# One-channel images: the mean of ImageNet's channel means and stds (timm's convention).
GRAY_MEAN = (0.449,)
GRAY_STD = (0.226,)

SMALL_IMAGE_MAX = 64
EVAL_CROP_FRACTION = 0.875


# --------------------------------------------------------------------------- metadata
class SkipCounter:
    """Thread-safe count of the images skipped per split (fed from inside tf.data).

    Example:
    >>> c = SkipCounter(); c.record("train", "a.jpg"); c.counts()["train"]
    1
    """
    MAX_EXAMPLES = 20

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[str, set[str]] = {s: set() for s in SPLITS}
        self._events: dict[str, int] = {s: 0 for s in SPLITS}

    def record(self, split: str, key: str) -> None:
        with self._lock:
            new = key not in self._keys[split]
            self._keys[split].add(key)
            self._events[split] += 1
            n = len(self._keys[split])
        if new and n <= self.MAX_EXAMPLES:
            logger.warning("Skipped a corrupt or unreadable image in the %s split: %s", split, key)

    def counts(self) -> dict[str, int]:
        """Distinct images skipped so far, per split."""
        with self._lock:
            return {s: len(k) for s, k in self._keys.items()}

    def events(self) -> dict[str, int]:
        """Skips so far, per split, counting each epoch again."""
        with self._lock:
            return dict(self._events)

    def examples(self) -> dict[str, list[str]]:
        with self._lock:
            return {s: sorted(k)[: self.MAX_EXAMPLES] for s, k in self._keys.items()}


@dataclasses.dataclass
class ImageDatasets:
    """The datasets of `build_image_datasets` and what a recipe needs to know about them.

    Attributes:
        train: Shuffled, augmented `(images, labels)` batches, `drop_remainder=True`.
        val: Validation batches (centre crop), or `None` when there is no validation split.
        test: Test batches (centre crop), or `None`.
        num_classes: Number of classes.
        class_names: Class names, indexed by label.
        image_size: Side of the square output images.
        channels: 3 (RGB) or 1 (grayscale).
        source: The `source` argument.
        augment: The training augmentation used (`"inception"`, `"pad_crop_flip"`,
            `"pad_crop"` or `"none"`).
        global_batch_size: Batch size over all replicas.
        batch_size: Batch size of these datasets (per replica under `input_context`).
        counts: Examples per split over all workers, before skipping corrupt images
            (`None` if unknown without reading the data).
        steps: Batches per epoch per split over all replicas (`train`: `counts // global`;
            eval: `ceil(n / global)`, `n` the examples scored: for encoded images those that
            read and decode, counted when the datasets are built), `None` if
            the count is unknown: what each dataset yields per iteration (see the module
            docstring).
        mean, std: The normalisation applied (`image = (pixels / 255 - mean) / std`).
        one_hot: Whether labels are one-hot float32 (else int32 class ids).

    Example:
    >>> data = build_image_datasets("digits", image_size=8, global_batch_size=32)
    >>> data.num_classes, data.steps["train"]
    (10, 39)
    """
    train: tf.data.Dataset
    val: tf.data.Dataset | None
    test: tf.data.Dataset | None
    num_classes: int
    class_names: list[str]
    image_size: int
    channels: int
    source: str
    augment: str
    global_batch_size: int
    batch_size: int
    counts: dict[str, int | None]
    steps: dict[str, int | None]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    one_hot: bool
    starts_at: bool = False  # whether `train` drops the `start_at` examples (not under FILE sharding)
    _skips: SkipCounter = dataclasses.field(default_factory=SkipCounter, repr=False)

    @property
    def steps_per_epoch(self) -> int | None:
        return self.steps["train"]

    @property
    def skipped(self) -> dict[str, int]:
        """Distinct corrupt/unreadable images skipped so far per split (grows while iterating)."""
        return self._skips.counts()

    @property
    def skipped_examples(self) -> dict[str, list[str]]:
        """Up to 20 names (file paths, TFDS ids, `shard#crc32`) of skipped images per split."""
        return self._skips.examples()

    def summary(self) -> dict[str, Any]:
        """A JSON-serialisable description (for the run manifest)."""
        return {
            "source": self.source,
            "num_classes": self.num_classes,
            "image_size": self.image_size,
            "channels": self.channels,
            "augment": self.augment,
            "global_batch_size": self.global_batch_size,
            "batch_size": self.batch_size,
            "counts": dict(self.counts),
            "steps": dict(self.steps),
            "skipped": self.skipped,
        }


# --------------------------------------------------------------------------- helpers
def _num_workers_from_tf_config() -> int:
    try:
        cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster") or {}
    except (json.JSONDecodeError, AttributeError):
        return 1
    return max(1, sum(len(cluster.get(k) or []) for k in ("chief", "worker")))


# --------------------------------------------------------------------------- image ops
# --------------------------------------------------------------------------- pipeline
def _skip_recorder(skips: SkipCounter, split: str, hashed_key: bool):
    """Returns `on_error(key, payload) -> False` that records a skipped image (runs in Python)."""
    def record(key, payload):
        k = key.numpy().decode("utf-8", "replace")
        if hashed_key:  # shard name / TFDS id + checksum of the record: unique per record
            k = f"{k}#{zlib.crc32(payload.numpy()):08x}"
        skips.record(split, k)
        return False

    def on_error(key, payload):
        return tf.reshape(tf.py_function(record, [key, payload], tf.bool), [])

    return on_error


def _flag_only(image, label, ok):
    return ok


def _last_true(*element):
    return element[-1]


def _drop_last(*element):
    return element[:-1]


def _drop_flag(image, label, ok):
    return image, label


def build_image_datasets(
    # one piece: a docstring that is the reference of every argument, then the build steps in order.
    source: str,
    image_size: int,
    global_batch_size: int,
    *,
    seed: int = 0,
    data_dir: str | None = None,
    cache: bool | str = False,
    augment: str | bool | None = None,
    val_fraction: float = 0.1,
    test_fraction: float = 0.2,
    input_context: tf.distribute.InputContext | None = None,
    one_hot: bool = True,
    num_classes: int | None = None,
    eval_crop_fraction: float | None = None,
    shuffle_buffer: int = 10_000,
    split_seed: int = 0,
    deterministic: bool = True,
    label_offset: int | None = None,
    num_examples: dict[str, int] | None = None,
    synthetic_examples: tuple[int, int] = (IMAGENET_TRAIN_EXAMPLES, IMAGENET_VAL_EXAMPLES),
    cycle_length: int = 16,
    crop_padding: int | None = None,
    train_size: Any = None,
    start_at: Any = None,
    data_service: str | None = None,
) -> ImageDatasets:
    """Builds train/val/test image classification datasets and their metadata.

    Args:
        source: Where the images are:
            - `"tfds:NAME"` (`tfds:imagenet2012`, `tfds:imagenette`, `tfds:cifar10`,
              `tfds:mnist`, `"tfds:NAME:VERSION"`), read from `data_dir` (never downloaded);
            - `"folder:PATH"`: one subfolder per class (JPEG/PNG/BMP/GIF), optionally
              under `PATH/train`, `PATH/val` (or `validation`) and `PATH/test`;
            - `"tfrecord:GLOB"` (or a directory): the ImageNet layout of TF Model Garden /
              `imagenet_to_gcs.py`, `image/encoded` + 1-based `image/class/label`,
              `train-*` and `validation-*` shards (files without those prefixes are all
              training data);
            - `"mnist5k"` or `"digits"`: the embedded datasets (`trainwell.data.embedded`);
            - `"synthetic"`: one fixed batch of random, already-normalised RGB images
              and labels (1000 classes unless `num_classes`), repeated: no decoding, so
              `fit` measures the model, not the input pipeline.
        image_size: Side of the square output images, >= 1.
        global_batch_size: Batch size over all replicas, >= 1.
        seed: Seed of the shuffles and augmentations. Defaults to `0`.
        data_dir: TFDS data directory, and base of relative folder/TFRecord paths.
            Defaults to `None`.
        cache: `True` caches in memory, a string caches to that file prefix: encoded
            training records (before shuffling and augmentation) and decoded evaluation
            images. Defaults to `False`.
        augment: Training augmentation: `"inception"`, `"pad_crop_flip"`, `"pad_crop"`,
            `"none"` (or `False`), `"auto"` (or `None`): `"pad_crop"` for grayscale,
            `"pad_crop_flip"` up to 64 px, else `"inception"`. Defaults to `None`.
        val_fraction: Fraction of train held out as validation when the source has no
            separate validation split (with a test split, or when the validation split
            serves as test). `0` disables validation. Defaults to `0.1`.
        test_fraction: Fraction of train held out as test, only when the source has
            neither a test nor a validation split. Defaults to `0.2`.
        input_context: A `tf.distribute.InputContext` from
            `strategy.distribute_datasets_from_function`: shard per input pipeline and
            batch per replica. Defaults to `None`.
        one_hot: One-hot float32 labels (for `CategoricalCrossentropy(label_smoothing=...)`)
            instead of int32 ids. Defaults to `True`.
        num_classes: Number of classes where the source does not say (TFRecords:
            1000; synthetic: 1000). Defaults to `None`.
        eval_crop_fraction: Central crop of evaluation images. Defaults to `None`
            (0.875 above 64 px, else 1.0).
        shuffle_buffer: Record shuffle buffer (TFDS and TFRecords; folders and
            in-memory sets are shuffled whole). Defaults to `10_000`.
        split_seed: Seed of carved validation/test splits, kept apart from `seed` so
            the held-out set does not change between runs. Defaults to `0`.
        deterministic: Keep the element order fixed (`tf.data.Options.deterministic`).
            Defaults to `True`.
        label_offset: Subtracted from TFRecord labels. Defaults to `None` (1: the
            ImageNet TFRecords' labels are 1-based).
        num_examples: Known example counts of TFRecord splits (`{"train": ..., "val": ...,
            "test": ...}`), which otherwise are counted by reading the records (except for
            the full ImageNet layout). Defaults to `None`.
        synthetic_examples: `(train, test)` sizes of `"synthetic"`. Defaults to
            `(1_281_167, 50_000)`.
        cycle_length: Files read in parallel. Defaults to `16`.
        crop_padding: Pixels of zero padding on each side for `"pad_crop"` and
            `"pad_crop_flip"` (the shift range of the random crop). Defaults to `None`
            (`image_size / 8`: 4 px at 32 px, He et al. 2016's CIFAR recipe).
        train_size: Progressive resizing: a scalar int32 `tf.Variable` holding the side of
            the training images, read as each is made (`trainwell.data.resizing.EpochImageSize`;
            the training batches then have no static side; `crop_padding` `None` pads
            side / 8 of it). Evaluation splits stay at `image_size`. Defaults to `None`
            (`image_size`).
        start_at: A scalar int `tf.Variable`: each iteration of the training dataset drops
            that many examples before decoding them (a resumed epoch's position, set for
            its iterator only; `trainwell.data.epoch_start.EpochStart`). The training dataset
            then reads, checks and drops bad records before decoding (the same examples,
            in the same order). Not under FILE auto-sharding. Defaults to `None`.
        data_service: A tf.data service dispatcher, `"grpc://HOST:PORT"`: the training examples are
            read, decoded and augmented on its workers as one endless stream (each pass has each example
            once, reshuffled, in an order that is not deterministic; `trainwell.data.service`) and batched
            here; Keras counts each epoch's steps. Not with `start_at`. Defaults to `None`.

    Returns:
        An `ImageDatasets`.

    Raises:
        DataNotFoundError: a folder, TFRecord pattern or TFDS dataset that does not exist
            or is not prepared (a `FileNotFoundError` too); the message names the path.
        DataError: data that cannot be trained on: an empty folder, a folder with images
            of one class only or none readable (`trainwell.data.sources.check_image_folder`),
            an unknown TFDS dataset.
        ValueError: an invalid argument or an unknown source.

    Example:
    >>> data = build_image_datasets("mnist5k", image_size=28, global_batch_size=128)
    >>> images, labels = next(iter(data.train))
    >>> images.shape, labels.shape
    (TensorShape([128, 28, 28, 1]), TensorShape([128, 10]))
    """
    augment = _check_arguments(
        source=source, image_size=image_size, global_batch_size=global_batch_size, augment=augment,
        val_fraction=val_fraction, test_fraction=test_fraction, eval_crop_fraction=eval_crop_fraction,
        num_classes=num_classes, crop_padding=crop_padding, shuffle_buffer=shuffle_buffer,
        cycle_length=cycle_length, cache=cache,
    )
    if train_size is not None and (not isinstance(train_size, tf.Variable) or train_size.dtype != tf.int32
                                   or train_size.shape.rank != 0):
        raise invalid_argument("train_size", "None or a scalar int32 tf.Variable (EpochImageSize.variable)", train_size)
    batch_size = global_batch_size
    num_pipelines, pipeline_id = 1, 0
    if input_context is not None:
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        num_pipelines, pipeline_id = input_context.num_input_pipelines, input_context.input_pipeline_id
    shard = (num_pipelines, pipeline_id) if num_pipelines > 1 else None

    if source.partition(":")[0].strip().lower() == "synthetic":
        return ImageDatasets(**synthetic_datasets(source, image_size, global_batch_size, batch_size, seed,
                                                  num_classes or 1000, one_hot, synthetic_examples))
    src = open_source(
        source, data_dir=data_dir, num_classes=num_classes, num_examples=num_examples, label_offset=label_offset,
        cycle_length=cycle_length, input_context=input_context if shard else None,
        val_fraction=val_fraction, test_fraction=test_fraction, split_seed=split_seed, seed=seed,
    )
    channels = src.channels
    if augment == "auto":
        augment = "pad_crop" if channels == 1 else ("pad_crop_flip" if image_size <= SMALL_IMAGE_MAX else "inception")
    if eval_crop_fraction is None:
        eval_crop_fraction = EVAL_CROP_FRACTION if image_size > SMALL_IMAGE_MAX else 1.0
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else (GRAY_MEAN, GRAY_STD)
    transform = Transform(image_size=image_size, channels=channels, augment=augment,
                           eval_crop_fraction=eval_crop_fraction, mean=mean, std=std,
                           num_classes=src.num_classes, one_hot=one_hot, crop_padding=crop_padding,
                           train_size=train_size)
    skips = SkipCounter()
    for split_name, paths in src.unreadable.items():
        for path_ in paths:
            skips.record(split_name, path_)
    pipeline = _Pipeline(
        src=src, transform=transform, skips=skips, shard=shard, options=_shard_options(src, shard, deterministic),
        batch_size=batch_size, seed=seed, cache=cache, shuffle_buffer=shuffle_buffer,
        label_offset=1 if label_offset is None else label_offset, start_at=start_at, data_service=data_service,
    )

    counts = {s: (src.splits[s].count if src.splits[s] is not None else 0) for s in SPLITS}
    if counts["train"] == 0:
        raise DataError(f"The training split of {source!r} is empty.")
    steps = _steps(counts, global_batch_size)
    # This pipeline's batches per global step: its replicas' share (1 without `input_context`).
    per_step = global_batch_size // (batch_size * num_pipelines)
    # Encoded evaluation splits score the images that read and decode: counted by one pass here.
    readable = {s: pipeline.readable(s, src.splits[s]) for s in ("val", "test")
                if src.splits[s] is not None and src.splits[s].kind != "array"}
    if shard is None:
        steps.update({s: math.ceil(n / global_batch_size) for s, n in readable.items()})

    def evaluation(split):
        rec = src.splits[split]
        return None if rec is None else pipeline.evaluation(split, rec, readable.get(split))

    return ImageDatasets(
        train=pipeline.train(src.splits["train"], None if steps["train"] is None else steps["train"] * per_step),
        val=evaluation("val"),
        test=evaluation("test"),
        num_classes=src.num_classes,
        class_names=list(src.class_names),
        image_size=image_size,
        channels=channels,
        source=source,
        augment=augment,
        global_batch_size=global_batch_size,
        batch_size=batch_size,
        counts=counts,
        steps=steps,
        mean=tuple(mean),
        std=tuple(std),
        one_hot=one_hot,
        starts_at=start_at is not None and not pipeline.file_sharded,
        _skips=skips,
    )


def _check_arguments(*, source, image_size, global_batch_size, augment, val_fraction, test_fraction,
                     eval_crop_fraction, num_classes, crop_padding, shuffle_buffer, cycle_length, cache) -> str:
    """Raises `invalid_argument`'s error for a bad argument; returns `augment` as a name (`"auto"`...)."""
    if not isinstance(source, str) or not source.strip():
        raise invalid_argument("source", "a non-empty string such as 'tfds:cifar10', 'folder:PATH', 'tfrecord:GLOB', "
              "'mnist5k', 'digits' or 'synthetic'", source)
    if not is_int(image_size) or image_size < 1:
        raise invalid_argument("image_size", "an int >= 1", image_size)
    if not is_int(global_batch_size) or global_batch_size < 1:
        raise invalid_argument("global_batch_size", "an int >= 1", global_batch_size)
    if augment is None or augment is True:
        augment = "auto"
    if augment is False:
        augment = "none"
    if augment not in AUGMENTATIONS:
        raise invalid_argument("augment", f"one of {', '.join(map(repr, AUGMENTATIONS))}, None or False", augment)
    for arg, v in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not is_number(v) or not 0 <= v < 1:
            raise invalid_argument(arg, "a float in [0, 1)", v)
    if val_fraction + test_fraction >= 1:
        raise invalid_argument("test_fraction", f"val_fraction + test_fraction < 1 (val_fraction={val_fraction})", test_fraction)
    if eval_crop_fraction is not None and not 0 < eval_crop_fraction <= 1:
        raise invalid_argument("eval_crop_fraction", "None or a float in (0, 1]", eval_crop_fraction)
    if num_classes is not None and (not is_int(num_classes) or num_classes < 1):
        raise invalid_argument("num_classes", "None or an int >= 1", num_classes)
    if crop_padding is not None and (not is_int(crop_padding) or crop_padding < 0):
        raise invalid_argument("crop_padding", "None or an int >= 0", crop_padding)
    if not is_int(shuffle_buffer) or shuffle_buffer < 1:
        raise invalid_argument("shuffle_buffer", "an int >= 1", shuffle_buffer)
    if not is_int(cycle_length) or cycle_length < 1:
        raise invalid_argument("cycle_length", "an int >= 1", cycle_length)
    if not isinstance(cache, (bool, str)):
        raise invalid_argument("cache", "a bool or a file path prefix", cache)
    return augment


def _shard_options(src: Source, shard, deterministic: bool) -> tf.data.Options:
    """The datasets' options: determinism and the auto-shard policy (OFF when sharded by `input_context`)."""
    options = tf.data.Options()
    options.deterministic = deterministic
    if shard is not None:
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    else:
        # FILE only matters (and only applies) with several workers; tf.data's file sharding
        # cannot walk through `ignore_errors`, so FILE pipelines go without that safety net.
        workers = _num_workers_from_tf_config()
        file_ok = workers > 1 and all(
            s is None or (s.kind == "example" and s.num_files >= workers) for s in src.splits.values()
        )
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.FILE if file_ok else tf.data.experimental.AutoShardPolicy.DATA
        )
    return options


def _steps(counts: dict[str, int | None], global_batch_size: int) -> dict[str, int | None]:
    """Steps per epoch of each split: whole batches for train (the remainder is dropped), all for val/test."""
    return {
        "train": None if counts["train"] is None else counts["train"] // global_batch_size,
        **{s: (None if counts[s] is None else math.ceil(counts[s] / global_batch_size)) for s in ("val", "test")},
    }


@dataclasses.dataclass
class _Pipeline:
    """Turns a source's `Split`s into batched `(image, label)` datasets: read, check, decode and augment, batch."""

    src: Source
    transform: Transform
    skips: SkipCounter
    shard: tuple[int, int] | None
    options: tf.data.Options
    batch_size: int
    seed: int
    cache: bool | str
    shuffle_buffer: int
    label_offset: int
    start_at: Any = None
    data_service: str | None = None

    @property
    def file_sharded(self) -> bool:
        return self.options.experimental_distribute.auto_shard_policy == tf.data.experimental.AutoShardPolicy.FILE

    @property
    def safety_net(self) -> bool:
        """Whether `ignore_errors` may drop what the decoders reject (FILE sharding cannot walk through it)."""
        return not self.file_sharded

    def to_bytes(self, split_kind):
        """`(payload, label) -> (encoded image bytes, label)` for records of `split_kind`."""
        if split_kind == "path":
            return lambda payload, label: (tf.io.read_file(payload), label)
        # TFRecords come parsed (image bytes, label - label_offset): the source parses them in batches.
        return lambda payload, label: (payload, label)

    def records(self, rec: Split, ordered: bool = False):
        """`rec`'s `(payload, label, key)` records of this pipeline's shard; `ordered`: files unshuffled."""
        return rec.make(self.shard if (self.shard is not None and not self.src.shards_itself) else None, ordered)

    def checked(self, split, kind, make_image, record: bool = True, decode: bool = True):
        """Map `(payload, label, key, *extra)` to `(image, label, ok)`; bad records are counted (with `record`).
        `decode=False`: to `(image bytes, int32 label, key, *extra, ok)`, nothing decoded."""
        read = self.to_bytes(kind)
        on_error = _skip_recorder(self.skips, split, hashed_key=kind not in ("path", "bytes_path"))
        if not record:
            def on_error(key, payload):
                return tf.constant(False)
        transform = self.transform

        def fn(payload, label, key, *extra):
            image_bytes, label = read(payload, label)
            label = tf.cast(label, tf.int32)
            ok = tf.logical_and(valid_image(image_bytes), transform.label_ok(label))
            if not decode:
                return image_bytes, label, key, *extra, tf.cond(ok, lambda: tf.constant(True),
                                                                 lambda: on_error(key, image_bytes))
            image = tf.cond(ok, lambda: make_image(image_bytes, *extra), lambda: transform.placeholder(split == "train"))
            flag = tf.cond(ok, lambda: tf.constant(True), lambda: on_error(key, image_bytes))
            return image, transform.label(label), flag

        return fn

    def drop_flagged(self, ds, *, train: bool = True):
        """Drops the flagged records; anything the decoders still reject (rare: the structure
        looked fine) is dropped by ignore_errors and logged (evaluation splits are never FILE-sharded)."""
        if self.safety_net or not train:
            ds = ds.ignore_errors(log_warning=True)
        return ds.filter(_flag_only).map(_drop_flag)

    def options_of(self, split: str) -> tf.data.Options:
        """The options of `split`'s dataset: an evaluation split is sharded by data, never by file
        (each worker counts and reads the whole split, so all agree on its batches)."""
        if split == "train" or not self.file_sharded:
            return self.options
        options = tf.data.Options()
        options.deterministic = self.options.deterministic
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
        return options

    def finish(self, ds, split, *, batches=None):
        """Caches evaluation images, batches, normalises, prefetches.

        With `batches`, the dataset yields exactly that many batches per iteration and says
        so (its cardinality), so Keras makes a new iterator each epoch: the training stream
        comes here endless (topped up); evaluation splits come with their length stated.
        """
        train = split == "train"
        if self.cache and not train:  # evaluation output is deterministic: cache the decoded images
            ds = ds.cache("" if self.cache is True else f"{self.cache}_{split}")
        if train:
            ds = ds.batch(self.batch_size, drop_remainder=True)
        else:
            ds = batch_with_even_tail(ds, int(ds.cardinality()), self.batch_size)
        if batches is not None:
            ds = ds.take(batches)  # a known cardinality (a `filter` leaves it unknown)
        ds = ds.map(self.transform.normalise, num_parallel_calls=AUTOTUNE).prefetch(AUTOTUNE)
        return ds.with_options(self.options_of(split))

    def augmented(self, rec: Split, *, top_up: bool = False):
        """`(image, label, ok)` of the training records: (cached,) shuffled, augmented with a
        per-element seed. `top_up`: the records in their stored order (no shuffle, no cache,
        no seed generator drawn from, skips not counted again), augmented with other seeds."""
        ds, kind = self.seeded(rec, top_up=top_up)
        transform = self.transform
        if rec.kind != "array":
            fn = self.checked("train", kind, lambda image_bytes, s: transform.train_image(image_bytes, s, encoded=True),
                              record=not top_up)
            return ds.map(fn, num_parallel_calls=AUTOTUNE)
        return ds.map(lambda p, y, k, s: (transform.train_image(p, s, encoded=False), transform.label(y)),
                      num_parallel_calls=AUTOTUNE)

    def seeded(self, rec: Split, *, top_up: bool = False):
        """`augmented`'s `(payload, label, key, seed)` records before decoding, and their kind."""
        ds = self.records(rec, ordered=top_up)
        encoded = rec.kind != "array"
        kind = rec.kind
        cache, seed, transform = self.cache and not top_up, self.seed, self.transform
        if cache and encoded:
            # Cache the encoded images (files read, records parsed) before shuffling.
            read = self.to_bytes(rec.kind)
            ds = ds.map(lambda p, y, k: (*read(p, y), k), num_parallel_calls=AUTOTUNE)
            if self.safety_net:
                ds = ds.ignore_errors(log_warning=True)
            kind = "bytes_path" if rec.kind == "path" else "bytes"
        if cache:
            ds = ds.cache("" if cache is True else f"{cache}_train")
        if not top_up:
            buffer = rec.count if rec.kind in ("path", "array") and rec.count else self.shuffle_buffer
            ds = ds.shuffle(max(1, min(buffer, 1_000_000)), seed=seed, reshuffle_each_iteration=True)
        # Per-element augmentation seed: fixed by position and `seed`; positions get
        # other images each epoch. `[seed, position]` counted by a `scan` has no
        # stateful op (a `tf.random.uniform` in a map drew other numbers on each worker
        # and in each run once tf.distribute rewrote the graph), but tf.data's FILE
        # autosharding cannot walk through a `scan` (nor a zipped `Dataset.random`):
        # FILE-sharded pipelines keep the seeded stateful draw, reproducible in one
        # process; pass `input_context` for exactly reproducible multi-worker runs.
        # The top-up (never FILE-sharded: see `train`) counts its positions down from -1.
        if self.file_sharded:
            ds = ds.map(lambda p, y, k: (p, y, k, tf.random.uniform([2], maxval=tf.int64.max, dtype=tf.int64,
                                                                     seed=seed)))
        else:
            seed_t = tf.constant(int(seed), tf.int64)
            step = -1 if top_up else 1
            ds = ds.scan(tf.constant(step if top_up else 0, tf.int64),
                         lambda i, e: (i + step, (*e, tf.stack([seed_t, i]))))
        return ds, kind

    def started(self, rec: Split, batches: int | None):
        """`train`'s examples in its order, the first `start_at` of each iteration dropped before decoding.

        The records are read and checked (`valid_image`, the label), the flagged ones dropped
        and the top-up appended, then the first `start_at` are dropped and the rest decoded:
        a resumed epoch starts at its position without decoding what it skips. The same
        images as `train`'s other path unless a decoder rejects an image that passed the
        check inside the skipped part (rare; TensorFlow logs each).
        """
        transform, start_at = self.transform, self.start_at

        def checked(top_up: bool):
            ds, kind = self.seeded(rec, top_up=top_up)
            if rec.kind == "array":
                return ds
            fn = self.checked("train", kind, lambda image_bytes, s: image_bytes, record=not top_up, decode=False)
            ds = ds.map(fn, num_parallel_calls=AUTOTUNE)
            return (ds.ignore_errors(log_warning=True) if self.safety_net else ds).filter(_last_true).map(_drop_last)

        ds = checked(False)
        if batches is not None and rec.kind != "array":
            ds = ds.concatenate(checked(True).repeat())  # a repeat of a pass that yields nothing ends
        def kept(i, example):
            return i >= tf.cast(start_at, tf.int64)

        def decoded(i, example):
            payload, label, _, seed = example
            return transform.train_image(payload, seed, encoded=encoded), transform.label(label)

        encoded = rec.kind != "array"
        ds = ds.scan(tf.constant(0, tf.int64), lambda i, e: (i + 1, (i, e))).filter(kept)
        ds = ds.map(decoded, num_parallel_calls=AUTOTUNE)
        return ds.ignore_errors(log_warning=True) if encoded and self.safety_net else ds

    def train(self, rec: Split, batches: int | None = None):
        """The training dataset: (cached,) shuffled, augmented with a per-element seed, batched.

        With `batches`, exactly that many full batches per iteration: an epoch short of them
        (images skipped as corrupt, a smaller shard) is topped up with examples from a pass
        over the records in their stored order, repeated, so every epoch trains what Keras is
        told, and the shuffle's seed generator is drawn from once per epoch (exact resume).
        Under FILE auto-sharding each worker reads files of its own, whose share of the
        batches is unknown: the stream is endless (reshuffled each pass) and Keras counts the
        steps of each epoch.
        """
        if self.start_at is not None and not self.file_sharded:  # its length: a `filter` leaves it unknown
            ds = self.finish(self.started(rec, batches), "train", batches=batches)
            return ds if batches is None else ds.apply(tf.data.experimental.assert_cardinality(batches))
        encoded = rec.kind != "array"
        ds = self.augmented(rec)
        if encoded:
            ds = self.drop_flagged(ds)
        if self.file_sharded or self.data_service is not None:
            ds, batches = ds.repeat(), None  # a repeat of a pass that yields nothing ends
        elif batches is not None and encoded:
            ds = ds.concatenate(self.drop_flagged(self.augmented(rec, top_up=True)).repeat())
        if self.data_service is not None:  # one endless job whose passes reshuffle (trainwell.data.service)
            ds = distribute(ds, self.data_service)
        return self.finish(ds, "train", batches=batches)

    def evaluation_examples(self, split, rec: Split):
        """`(image, label)` of each readable example of an evaluation split, once, in order
        (centre crop, no shuffle)."""
        ds = self.records(rec)
        transform = self.transform
        if rec.kind == "array":
            return ds.map(lambda p, y, k: (transform.eval_image(p, encoded=False), transform.label(y)),
                          num_parallel_calls=AUTOTUNE)
        fn = self.checked(split, rec.kind, lambda image_bytes: transform.eval_image(image_bytes, encoded=True))
        return self.drop_flagged(ds.map(fn, num_parallel_calls=AUTOTUNE), train=False)

    def readable(self, split, rec: Split) -> int:
        """How many examples an evaluation split of encoded images scores: one pass of
        `evaluation_examples` (what the check flags and what the decoders reject is not
        counted, and the skipped images are counted in `skips` from here on)."""
        return int(self.evaluation_examples(split, rec).reduce(np.int64(0), lambda n, _: n + 1))

    def evaluation(self, split, rec: Split, examples: int | None = None):
        """A validation or test dataset: every readable example once (the last batch may be short),
        in batches whose number is its cardinality, so Keras reads no further and does not warn
        that the data ran out.

        Encoded images: `examples` is `readable`'s count (images skipped as corrupt are not
        scored, and nothing can stand in for them: an empty batch breaks convolutions on
        TensorFlow's CPU kernels, a placeholder would be scored). The last two batches share
        what is left over (`trainwell.data.batches.batch_with_even_tail`): no replica gets an empty batch.
        """
        ds = self.evaluation_examples(split, rec)
        if examples is not None:
            ds = ds.apply(tf.data.experimental.assert_cardinality(examples))
        return self.finish(ds, split)


__all__ = [
    "AUGMENTATIONS",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ImageDatasets",
    "SkipCounter",
    "build_image_datasets",
]
