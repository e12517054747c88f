"""Image classification input pipelines: TFDS, image folders, ImageNet TFRecords, embedded, synthetic.

One module (~1,200 lines) because every source feeds the same decode, augment, batch
and shard steps, which must stay identical across sources for exact resume.

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
not in the count. (A fully exact count needs each record in its own `ignore_errors`
dataset, which cost 0.4-0.6 ms of CPU per image here, about a quarter of decoding.)
The count grows as the datasets are iterated.

Batches per epoch: the training dataset yields exactly `ImageDatasets.steps` batches per iteration
(times its share of the replicas under `input_context`) and has that cardinality, so Keras,
told `steps_per_epoch`, makes a new iterator each epoch (what exact resume builds on). A
training epoch short of full batches (images skipped, a smaller shard) is topped up with
images of a fixed-order pass over the split. Under FILE auto-sharding the training stream is
endless (each worker's share of the files is unknown) and Keras counts the steps. Evaluation
splits score each readable image once in `ceil(readable / batch)` batches, their cardinality:
the images that read and decode are counted when the datasets are built (one pass of the
evaluation pipeline, without batching), and evaluation splits are sharded by data, never by
file, so every worker counts the same batches.

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
import re
import threading
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from trainwell.data.sources import (
    AUGMENTATIONS,
    DataError,
    DataNotFoundError,
    check_image_folder,
    list_images,
    resolve_path,
)
from trainwell.data import embedded
from trainwell.data.base import open_tfds_builder
from trainwell.data.embedded import stratified_split
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

# imagenet_to_gcs.py / TF Model Garden ImageNet TFRecord layout.
TFRECORD_IMAGE_KEY = "image/encoded"
TFRECORD_LABEL_KEY = "image/class/label"
IMAGENET_TRAIN_EXAMPLES = 1_281_167
IMAGENET_VAL_EXAMPLES = 50_000

# TFDS datasets whose held-out split is called "validation" (and have no "test").
# Used only when the builder's info has no split metadata (e.g. under tfds mocking).
_TFDS_VALIDATION_ONLY = {"imagenet2012", "imagenette", "imagewang", "imagenet_resized", "imagenet2012_subset",
                         "food101", "imagenet_a", "imagenet_r", "imagenet_lt", "stanford_online_products"}

_SPLITS = ("train", "val", "test")


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
        self._keys: dict[str, set[str]] = {s: set() for s in _SPLITS}
        self._events: dict[str, int] = {s: 0 for s in _SPLITS}

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


def _carve(key: tf.Tensor, split_seed: int) -> tf.Tensor:
    """A deterministic number in [0, 1) per record, from a hash of its bytes."""
    h = tf.strings.to_hash_bucket_fast(key, 1 << 62)
    mixed = tf.bitwise.bitwise_xor(h, tf.constant((split_seed * 0x9E3779B97F4A7C15) & ((1 << 62) - 1), tf.int64))
    return tf.cast(tf.math.floormod(mixed, 1_000_003), tf.float64) / 1_000_003.0


# --------------------------------------------------------------------------- image ops
def _decode_window(image_bytes, channels: int, window_fn):
    """Decodes only `window_fn(shape)` of a JPEG; other formats are decoded, then cropped."""
    def jpeg():
        y, x, h, w = window_fn(tf.image.extract_jpeg_shape(image_bytes))
        return tf.image.decode_and_crop_jpeg(image_bytes, tf.stack([y, x, h, w]), channels=channels)

    def other():
        image = tf.io.decode_image(image_bytes, channels=channels, expand_animations=False)
        y, x, h, w = window_fn(tf.shape(image))
        return tf.slice(image, tf.stack([y, x, 0]), tf.stack([h, w, channels]))

    image = tf.cond(tf.io.is_jpeg(image_bytes), jpeg, other)
    image.set_shape([None, None, channels])
    return image


def _crop_array(image, window_fn):
    y, x, h, w = window_fn(tf.shape(image))
    return tf.slice(image, tf.stack([y, x, 0]), tf.stack([h, w, tf.shape(image)[2]]))


def _inception_window(seed):
    def fn(shape):
        begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
            tf.cast(shape, tf.int32),
            bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
            seed=seed,
            min_object_covered=0.0,
            aspect_ratio_range=(3.0 / 4.0, 4.0 / 3.0),
            area_range=(0.08, 1.0),
            max_attempts=10,
            use_image_if_no_bounding_boxes=True,
        )
        return begin[0], begin[1], size[0], size[1]

    return fn


def _center_window(fraction: float):
    def fn(shape):
        h, w = tf.cast(shape[0], tf.int32), tf.cast(shape[1], tf.int32)
        side = tf.maximum(1, tf.cast(tf.round(fraction * tf.cast(tf.minimum(h, w), tf.float32)), tf.int32))
        return (h - side + 1) // 2, (w - side + 1) // 2, side, side

    return fn


def _tail_contains(image_bytes, seq: bytes, window: int = 1024):
    n = tf.strings.length(image_bytes)
    start = tf.maximum(n - window, 0)
    tail = tf.io.decode_raw(tf.strings.substr(image_bytes, start, n - start), tf.uint8)
    m = tf.maximum(tf.shape(tail)[0] - len(seq) + 1, 0)
    hit = tf.ones([m], tf.bool)
    for i, c in enumerate(seq):
        hit = tf.logical_and(hit, tf.equal(tail[i : i + m], c))
    return tf.reduce_any(hit)


def _valid_image(image_bytes):
    """Cheap structural check, in-graph: a known image signature and, for JPEG and PNG,
    an end marker (EOI `FFD9`, `IEND`) in the last KiB. Catches empty, non-image
    (HTML error pages, text), garbled-header and truncated files without decoding.
    The common case (a JPEG ending in EOI) costs three small ops."""

    def jpeg():
        n = tf.strings.length(image_bytes)
        last = tf.strings.substr(image_bytes, tf.maximum(n - 2, 0), tf.minimum(n, 2))
        return tf.cond(
            tf.equal(last, b"\xff\xd9"), lambda: tf.constant(True), lambda: _tail_contains(image_bytes, b"\xff\xd9")
        )

    def other():
        n = tf.strings.length(image_bytes)
        head = tf.strings.join([tf.strings.substr(image_bytes, 0, tf.minimum(n, 12)), "\0" * 12])

        def starts(signature: bytes, pos: int = 0):
            return tf.equal(tf.strings.substr(head, pos, len(signature)), signature)

        png = tf.logical_and(starts(b"\x89PNG\r\n\x1a\n"), _tail_contains(image_bytes, b"IEND"))
        webp = tf.logical_and(starts(b"RIFF"), starts(b"WEBP", 8))
        return tf.reduce_any(tf.stack([png, starts(b"GIF8"), starts(b"BM"), webp]))

    return tf.cond(tf.io.is_jpeg(image_bytes), jpeg, other)


class _Transform:
    """Per-example decode + augmentation, for one policy. Images come out float32 in
    [0, 255]; `normalise` runs on whole batches (one vectorised op instead of three per
    image)."""

    def __init__(self, *, image_size, channels, augment, eval_crop_fraction, mean, std, num_classes, one_hot,
                 crop_padding=None):
        self.size = image_size
        self.channels = channels
        self.augment = augment
        self.eval_crop = eval_crop_fraction
        self.crop_padding = max(1, int(round(image_size / 8))) if crop_padding is None else crop_padding
        # Tiled to the full image: broadcasting a 3-vector over the channel axis runs a
        # scalar loop in Eigen; broadcasting an [S, S, C] image over the batch axis is
        # vectorised (0.15 vs 0.55 ms of CPU per 224-px image here).
        tile = [image_size, image_size, 1]
        self.offset = tf.tile(tf.constant([[[255.0 * m for m in mean]]], tf.float32), tile)
        self.scale = tf.tile(tf.constant([[[1.0 / (255.0 * d) for d in std]]], tf.float32), tile)
        self.num_classes = num_classes
        self.one_hot = one_hot

    def normalise(self, images, labels):
        return (images - self.offset) * self.scale, labels

    def label(self, label):
        label = tf.cast(label, tf.int32)
        return tf.one_hot(label, self.num_classes, dtype=tf.float32) if self.one_hot else label

    def label_ok(self, label):
        return tf.logical_and(label >= 0, label < self.num_classes)

    def _resize(self, image):
        image = tf.image.resize(image, [self.size, self.size], method="bilinear")
        image.set_shape([self.size, self.size, self.channels])
        return image

    def _decode(self, payload, window, encoded):
        return _decode_window(payload, self.channels, window) if encoded else _crop_array(payload, window)

    def train_image(self, payload, seed, *, encoded: bool):
        crop_seed, flip_seed, pad_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 3))
        if self.augment == "inception":
            image = self._resize(self._decode(payload, _inception_window(crop_seed), encoded))
            return tf.image.stateless_random_flip_left_right(image, flip_seed)
        window = _center_window(1.0 if self.augment != "none" else self.eval_crop)
        image = self._resize(self._decode(payload, window, encoded))
        if self.augment in ("pad_crop", "pad_crop_flip"):
            pad = self.crop_padding
            image = tf.pad(image, [[pad, pad], [pad, pad], [0, 0]])
            image = tf.image.stateless_random_crop(image, [self.size, self.size, self.channels], pad_seed)
            if self.augment == "pad_crop_flip":
                image = tf.image.stateless_random_flip_left_right(image, flip_seed)
        return image

    def eval_image(self, payload, *, encoded: bool):
        return self._resize(self._decode(payload, _center_window(self.eval_crop), encoded))

    def placeholder(self):
        return tf.zeros([self.size, self.size, self.channels], tf.float32)


# --------------------------------------------------------------------------- sources
@dataclasses.dataclass
class _Split:
    """Records of one split: a function returning a dataset of (payload, label, key)."""
    make: Any  # (shard: tuple[int, int] | None, ordered: bool = False) -> tf.data.Dataset of (payload, label, key)
    count: int | None
    kind: str  # "path" (folder), "example" (TFRecord), "bytes" (TFDS), "array" (uint8 image)
    num_files: int = 0


@dataclasses.dataclass
class _Source:
    splits: dict[str, _Split | None]
    num_classes: int
    class_names: list[str]
    channels: int
    shards_itself: bool = False  # tfds: input_context is passed to the reader
    unreadable: dict[str, list[str]] = dataclasses.field(default_factory=dict)


def _split_fractions(val_fraction, test_fraction, has_val, has_test):
    """Which splits are carved from train: returns (val_from_train, test_from_train)."""
    if has_test:
        return (0.0 if has_val else val_fraction), 0.0
    if has_val:  # the validation split becomes test
        return val_fraction, 0.0
    return val_fraction, test_fraction


def _embedded_source(name, *, val_fraction, test_fraction, split_seed, seed):

    splits = embedded.load(name, val_fraction=val_fraction, test_fraction=test_fraction, seed=split_seed)

    def make_split(xy):
        x, y = xy
        if len(y) == 0:
            return None
        x = np.asarray(x, np.uint8)
        y = np.asarray(y, np.int64)

        def make(shard, ordered=False):
            xs, ys = (x, y) if shard is None else (x[shard[1] :: shard[0]], y[shard[1] :: shard[0]])
            keys = np.array([f"{name}[{i}]" for i in range(len(ys))])
            return tf.data.Dataset.from_tensor_slices((xs, ys, keys))

        return _Split(make, len(y), "array")

    return _Source(
        {"train": make_split(splits.train), "val": make_split(splits.val), "test": make_split(splits.test)},
        splits.num_classes,
        list(splits.class_names),
        channels=int(splits.train[0].shape[-1]),
    )


def _list_class_dir(root: Path) -> tuple[dict[str, list[str]], list[str]]:
    """`{class: [image paths]}` of `root`, and the image paths that cannot be read."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    out, unreadable = {}, []
    for c in classes:
        files = []
        for path in list_images(root / c)[0]:
            (files if os.access(path, os.R_OK) else unreadable).append(path)
        out[c] = files
    return out, unreadable


def _folder_source(path, *, val_fraction, test_fraction, split_seed, seed, data_dir):
    root = Path(resolve_path(path, data_dir))
    check_image_folder(root)  # exists, 2+ classes with images, not every image corrupt
    sub = {p.name.lower(): p for p in root.iterdir() if p.is_dir()}
    split_dirs = {}
    if "train" in sub:
        split_dirs["train"] = sub["train"]
        for name in ("val", "validation"):
            if name in sub:
                split_dirs["val"] = sub[name]
                break
        if "test" in sub:
            split_dirs["test"] = sub["test"]
    else:
        split_dirs["train"] = root
    listed = {k: _list_class_dir(v) for k, v in split_dirs.items()}
    listing = {k: v[0] for k, v in listed.items()}
    class_names = sorted(c for c, files in listing["train"].items() if files)
    index = {c: i for i, c in enumerate(class_names)}

    def flat(split):
        paths, labels = [], []
        for c, files in listing[split].items():
            if not files:
                continue
            if c not in index:
                raise DataError(
                    f"Class folder {c!r} of {str(split_dirs[split])!r} does not exist in the training folder "
                    f"{str(split_dirs['train'])!r} (source 'folder:{path}')."
                )
            paths.extend(files)
            labels.extend([index[c]] * len(files))
        return np.array(paths, dtype=object), np.array(labels, np.int64)

    has_val, has_test = "val" in split_dirs, "test" in split_dirs
    val_f, test_f = _split_fractions(val_fraction, test_fraction, has_val, has_test)
    tp, tl = flat("train")
    arrays = {}
    if val_f > 0 or test_f > 0:

        idx = stratified_split(tl, val_f, test_f, split_seed)
        arrays["train"] = (tp[np.sort(idx["train"])], tl[np.sort(idx["train"])])
        if val_f > 0:
            arrays["val"] = (tp[np.sort(idx["val"])], tl[np.sort(idx["val"])])
        if test_f > 0:
            arrays["test"] = (tp[np.sort(idx["test"])], tl[np.sort(idx["test"])])
    else:
        arrays["train"] = (tp, tl)
    if has_test:
        arrays["test"] = flat("test")
        if has_val:
            arrays["val"] = flat("val")
    elif has_val:
        arrays["test"] = flat("val")

    def make_split(split):
        if split not in arrays or len(arrays[split][1]) == 0:
            return None
        p, y = arrays[split]

        def make(shard, ordered=False):
            ps, ys = (p, y) if shard is None else (p[shard[1] :: shard[0]], y[shard[1] :: shard[0]])
            # File names as the bytes the OS gave (os.fsencode): a name that is not UTF-8
            # is read like any other instead of failing the tensor conversion.
            ps = np.array([os.fsencode(x) for x in ps], dtype=object)
            return tf.data.Dataset.from_tensor_slices((ps, ys, ps))

        return _Split(make, len(y), "path", num_files=len(y))

    # Unreadable files (permissions, dangling links) are skipped and counted at listing time.
    as_split = {"train": "train", "val": "val" if has_test else "test", "test": "test"}
    unreadable = {as_split[k]: v[1] for k, v in listed.items() if v[1]}
    return _Source({s: make_split(s) for s in _SPLITS}, len(class_names), class_names, channels=3,
                   unreadable=unreadable)


def _tfrecord_source(pattern, *, val_fraction, test_fraction, split_seed, seed, data_dir, num_classes,
                     num_examples, label_offset, cycle_length):
    full = resolve_path(pattern, data_dir)
    if os.path.isdir(full):
        full = os.path.join(full, "*")
    files = sorted(f for f in tf.io.gfile.glob(full) if not tf.io.gfile.isdir(f))
    if not files:
        parent = os.path.dirname(full) or "."
        if not tf.io.gfile.exists(parent):
            raise DataNotFoundError(f"TFRecord directory not found: {parent!r} (source 'tfrecord:{pattern}').")
        raise DataNotFoundError(f"No TFRecord files match {full!r} (source 'tfrecord:{pattern}').")
    base = {f: os.path.basename(f) for f in files}
    by_split = {
        "train": [f for f in files if base[f].startswith("train")],
        "validation": [f for f in files if base[f].startswith(("validation", "val-", "val_"))],
        "test": [f for f in files if base[f].startswith("test")],
    }
    if not any(by_split.values()):  # no train-/validation- prefixes: everything is training data
        by_split["train"] = files
    if not by_split["train"]:
        raise DataError(f"No training shards (train-*) among the {len(files)} files matching {full!r}.")
    has_val, has_test = bool(by_split["validation"]), bool(by_split["test"])
    val_f, test_f = _split_fractions(val_fraction, test_fraction, has_val, has_test)
    label_offset = 1 if label_offset is None else label_offset

    imagenet_layout = (
        len(by_split["train"]) == 1024
        and all(re.search(r"-of-01024$", base[f]) for f in by_split["train"])
        and len(by_split["validation"]) == 128
    )

    def record_filter(lo, hi):
        if lo <= 0.0 and hi >= 1.0:
            return None
        def keep(record, f):
            u = _carve(record, split_seed)
            return tf.logical_and(u >= lo, u < hi)

        return keep

    def reader(shard_files, keep, shuffle_files):
        def make(shard, ordered=False):
            fl = list(shard_files)
            record_shard = None
            if shard is not None:
                if len(fl) >= shard[0]:
                    fl = fl[shard[1] :: shard[0]]
                else:
                    record_shard = shard
            ds = tf.data.Dataset.from_tensor_slices(fl)
            if shuffle_files and not ordered:
                ds = ds.shuffle(len(fl), seed=seed, reshuffle_each_iteration=True)
            ds = ds.interleave(
                lambda f: tf.data.TFRecordDataset(f, buffer_size=8 << 20).map(lambda r: (r, f)),
                cycle_length=min(cycle_length, len(fl)),
                block_length=1,
                num_parallel_calls=AUTOTUNE,
                deterministic=True,
            )
            if keep is not None:
                ds = ds.filter(keep)
            if record_shard is not None:
                ds = ds.shard(*record_shard)
            return ds.map(lambda r, f: (r, tf.constant(0, tf.int64), f))

        return make

    counts_given = num_examples is not None

    def count(shard_files, keep, known):
        if counts_given:
            return known
        if imagenet_layout and known is not None:
            return known
        ds = tf.data.TFRecordDataset(shard_files, num_parallel_reads=min(cycle_length, len(shard_files)))
        if keep is not None:
            ds = ds.filter(lambda r: keep(r, ""))
        try:
            return int(ds.reduce(np.int64(0), lambda c, _: c + 1).numpy())
        except tf.errors.DataLossError:
            raise _not_a_tfrecord(shard_files, pattern) from None

    num_examples = num_examples or {}
    train_keep = record_filter(val_f + test_f, 1.0)
    val_keep = record_filter(0.0, val_f) if val_f > 0 else None
    test_keep = record_filter(val_f, val_f + test_f) if test_f > 0 else None
    n_imagenet_train = IMAGENET_TRAIN_EXAMPLES if imagenet_layout else None
    splits: dict[str, _Split | None] = {s: None for s in _SPLITS}
    known_train = num_examples.get("train", None if n_imagenet_train is None else round(n_imagenet_train * (1 - val_f - test_f)))
    splits["train"] = _Split(reader(by_split["train"], train_keep, True), count(by_split["train"], train_keep, known_train),
                             "example", num_files=len(by_split["train"]))
    if val_f > 0:
        known = num_examples.get("val", None if n_imagenet_train is None else round(n_imagenet_train * val_f))
        splits["val"] = _Split(reader(by_split["train"], val_keep, False), count(by_split["train"], val_keep, known),
                               "example", num_files=len(by_split["train"]))
    elif has_val and has_test:
        splits["val"] = _Split(reader(by_split["validation"], None, False),
                               count(by_split["validation"], None, num_examples.get("val")),
                               "example", num_files=len(by_split["validation"]))
    if has_test:
        splits["test"] = _Split(reader(by_split["test"], None, False), count(by_split["test"], None, num_examples.get("test")),
                                "example", num_files=len(by_split["test"]))
    elif has_val:
        known = num_examples.get("test", IMAGENET_VAL_EXAMPLES if imagenet_layout else None)
        splits["test"] = _Split(reader(by_split["validation"], None, False), count(by_split["validation"], None, known),
                                "example", num_files=len(by_split["validation"]))
    elif test_f > 0:
        splits["test"] = _Split(reader(by_split["train"], test_keep, False),
                                count(by_split["train"], test_keep, num_examples.get("test")),
                                "example", num_files=len(by_split["train"]))
    n_classes = num_classes or 1000
    return _Source(splits, n_classes, [str(i) for i in range(n_classes)], channels=3)


def _not_a_tfrecord(files: list[str], pattern: str) -> DataError:
    """One line naming the first of `files` that TensorFlow cannot read as TFRecords (read one by one)."""
    for f in files:
        try:
            tf.data.TFRecordDataset(f).reduce(np.int64(0), lambda c, _: c + 1)
        except tf.errors.DataLossError as e:
            why = str(e.message).split("}}")[-1].strip().split(" (")[0].split(" [Op:")[0]  # "corrupted record at 0"
            return DataError(f"Not a TFRecord file, or a damaged one: {f!r} ({why}; source 'tfrecord:{pattern}').")
    return DataError(f"Unreadable TFRecord data among the {len(files)} files of source 'tfrecord:{pattern}'.")


def _tfds_source(name, *, val_fraction, test_fraction, split_seed, seed, data_dir, input_context, cycle_length):
    # lazy: TFDS loads on first use, not with this module
    import tensorflow_datasets as tfds

    builder = open_tfds_builder(name, data_dir)
    info = builder.info
    image_keys = [k for k, f in info.features.items() if isinstance(f, tfds.features.Image)]
    label_keys = [k for k, f in info.features.items() if isinstance(f, tfds.features.ClassLabel)]
    if not image_keys or not label_keys:
        raise DataError(
            f"TFDS dataset {name!r} is not an image classification dataset: it needs an Image and a ClassLabel "
            f"feature. Features: {list(info.features)}."
        )
    image_key = "image" if "image" in image_keys else image_keys[0]
    label_key = "label" if "label" in label_keys else label_keys[0]
    label_feature = info.features[label_key]
    shape = info.features[image_key].shape
    channels = int(shape[-1]) if shape and shape[-1] in (1, 3) else 3

    known = dict(info.splits.items()) if info.splits else {}
    if known:
        available = set(known)
    else:
        base_name = name.split(":")[0].split("/")[0]
        available = {"train", "validation"} if base_name in _TFDS_VALIDATION_ONLY else {"train", "test"}
    if "train" not in available:
        raise DataError(f"TFDS dataset {name!r} has no 'train' split. Splits: {sorted(available)}.")
    has_val, has_test = "validation" in available, "test" in available
    val_f, test_f = _split_fractions(val_fraction, test_fraction, has_val, has_test)
    n_train = known["train"].num_examples if "train" in known else None

    def slice_(lo, hi):
        if lo <= 0 and hi >= 1:
            return "train"
        if n_train:
            a, b = int(round(lo * n_train)), int(round(hi * n_train))
            return f"train[{a}:{b}]"
        return f"train[{int(round(lo * 100))}%:{int(round(hi * 100))}%]"

    split_names = {"train": slice_(val_f + test_f, 1.0)}
    if val_f > 0:
        split_names["val"] = slice_(0.0, val_f)
    elif has_val and has_test:
        split_names["val"] = "validation"
    if has_test:
        split_names["test"] = "test"
    elif has_val:
        split_names["test"] = "validation"
    elif test_f > 0:
        split_names["test"] = slice_(val_f, val_f + test_f)

    def make_split(split):
        if split not in split_names:
            return None
        tfds_split = split_names[split]
        count = None
        if known:
            try:
                count = int(known[tfds_split].num_examples) if tfds_split in known else int(info.splits[tfds_split].num_examples)
            except Exception:  # pragma: no cover - unusual split strings
                count = None

        def make(shard, ordered=False):
            read_config = tfds.ReadConfig(
                shuffle_seed=seed,
                input_context=input_context,
                add_tfds_id=True,
                try_autocache=False,
                interleave_cycle_length=cycle_length,
            )
            try:
                ds = builder.as_dataset(
                    split=tfds_split,
                    shuffle_files=(split == "train" and not ordered),
                    decoders={image_key: tfds.decode.SkipDecoding()},
                    read_config=read_config,
                )
            except (AssertionError, FileNotFoundError, tf.errors.NotFoundError) as e:
                raise DataNotFoundError(
                    f"TFDS dataset {name!r} is not prepared in data_dir {str(builder.data_dir)!r}: "
                    f"{str(e).strip().rstrip('.')}. "
                    f"Prepare it first (e.g. `tfds build {name} --data_dir DIR`; ImageNet needs a manual download)."
                ) from None
            return ds.map(lambda ex: (ex[image_key], ex[label_key], ex["tfds_id"]))

        return _Split(make, count, "bytes")

    splits = {s: make_split(s) for s in _SPLITS}
    return _Source(splits, int(label_feature.num_classes), list(label_feature.names), channels, shards_itself=True)


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


def _drop_flag(image, label, ok):
    return image, label


def build_image_datasets(
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
    batch_size = global_batch_size
    num_pipelines, pipeline_id = 1, 0
    if input_context is not None:
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        num_pipelines, pipeline_id = input_context.num_input_pipelines, input_context.input_pipeline_id
    shard = (num_pipelines, pipeline_id) if num_pipelines > 1 else None

    if source.partition(":")[0].strip().lower() == "synthetic":
        return _synthetic(source, image_size, global_batch_size, batch_size, seed, num_classes or 1000, one_hot,
                          synthetic_examples)
    src = _open_source(
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
    transform = _Transform(image_size=image_size, channels=channels, augment=augment,
                           eval_crop_fraction=eval_crop_fraction, mean=mean, std=std,
                           num_classes=src.num_classes, one_hot=one_hot, crop_padding=crop_padding)
    skips = SkipCounter()
    for split_name, paths in src.unreadable.items():
        for path_ in paths:
            skips.record(split_name, path_)
    pipeline = _Pipeline(
        src=src, transform=transform, skips=skips, shard=shard, options=_shard_options(src, shard, deterministic),
        batch_size=batch_size, seed=seed, cache=cache, shuffle_buffer=shuffle_buffer,
        label_offset=1 if label_offset is None else label_offset,
    )

    counts = {s: (src.splits[s].count if src.splits[s] is not None else 0) for s in _SPLITS}
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


def _open_source(source, *, data_dir, num_classes, num_examples, label_offset, cycle_length, input_context,
                 val_fraction, test_fraction, split_seed, seed) -> _Source:
    """The `_Source` that `source` names (not `"synthetic"`); an unknown name raises `invalid_argument`'s error."""
    kind, _, rest = source.partition(":")
    kind = kind.strip().lower()
    common = dict(val_fraction=val_fraction, test_fraction=test_fraction, split_seed=split_seed, seed=seed)
    if source in ("mnist5k", "digits") or (kind == "embedded" and rest in ("mnist5k", "digits")):
        return _embedded_source(rest or source, **common)
    if kind == "folder" and rest:
        return _folder_source(rest, data_dir=data_dir, **common)
    if kind == "tfrecord" and rest:
        return _tfrecord_source(rest, data_dir=data_dir, num_classes=num_classes, num_examples=num_examples,
                                label_offset=label_offset, cycle_length=cycle_length, **common)
    if kind == "tfds" and rest:
        return _tfds_source(rest, data_dir=data_dir, input_context=input_context, cycle_length=cycle_length, **common)
    raise invalid_argument("source", "'tfds:NAME', 'folder:PATH', 'tfrecord:GLOB', 'mnist5k', 'digits' or 'synthetic'", source)


def _shard_options(src: _Source, shard, deterministic: bool) -> tf.data.Options:
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
    """Turns a source's `_Split`s into batched `(image, label)` datasets: read, check, decode and augment, batch."""

    src: _Source
    transform: _Transform
    skips: SkipCounter
    shard: tuple[int, int] | None
    options: tf.data.Options
    batch_size: int
    seed: int
    cache: bool | str
    shuffle_buffer: int
    label_offset: int

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
        if split_kind == "example":
            # Defaults instead of errors: a record without image or label is flagged and counted.
            spec = {
                TFRECORD_IMAGE_KEY: tf.io.FixedLenFeature([], tf.string, default_value=""),
                TFRECORD_LABEL_KEY: tf.io.FixedLenFeature([], tf.int64, default_value=-(10**9)),
            }
            label_offset = self.label_offset

            def parse(payload, label):
                ex = tf.io.parse_single_example(payload, spec)
                return ex[TFRECORD_IMAGE_KEY], ex[TFRECORD_LABEL_KEY] - label_offset

            return parse
        return lambda payload, label: (payload, label)

    def records(self, rec: _Split, ordered: bool = False):
        """`rec`'s `(payload, label, key)` records of this pipeline's shard; `ordered`: files unshuffled."""
        return rec.make(self.shard if (self.shard is not None and not self.src.shards_itself) else None, ordered)

    def checked(self, split, kind, make_image, record: bool = True):
        """Map `(payload, label, key, *extra)` to `(image, label, ok)`; bad records are counted (with `record`)."""
        read = self.to_bytes(kind)
        on_error = _skip_recorder(self.skips, split, hashed_key=kind not in ("path", "bytes_path"))
        if not record:
            def on_error(key, payload):
                return tf.constant(False)
        transform = self.transform

        def fn(payload, label, key, *extra):
            image_bytes, label = read(payload, label)
            label = tf.cast(label, tf.int32)
            ok = tf.logical_and(_valid_image(image_bytes), transform.label_ok(label))
            image = tf.cond(ok, lambda: make_image(image_bytes, *extra), transform.placeholder)
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
        ds = ds.batch(self.batch_size, drop_remainder=train)
        if batches is not None:
            ds = ds.take(batches)  # a known cardinality (a `filter` leaves it unknown)
        ds = ds.map(self.transform.normalise, num_parallel_calls=AUTOTUNE).prefetch(AUTOTUNE)
        return ds.with_options(self.options_of(split))

    def augmented(self, rec: _Split, *, top_up: bool = False):
        """`(image, label, ok)` of the training records: (cached,) shuffled, augmented with a
        per-element seed. `top_up`: the records in their stored order (no shuffle, no cache,
        no seed generator drawn from, skips not counted again), augmented with other seeds."""
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
        if encoded:
            fn = self.checked("train", kind, lambda image_bytes, s: transform.train_image(image_bytes, s, encoded=True),
                              record=not top_up)
            return ds.map(fn, num_parallel_calls=AUTOTUNE)
        return ds.map(lambda p, y, k, s: (transform.train_image(p, s, encoded=False), transform.label(y)),
                      num_parallel_calls=AUTOTUNE)

    def train(self, rec: _Split, batches: int | None = None):
        """The training dataset: (cached,) shuffled, augmented with a per-element seed, batched.

        With `batches`, exactly that many full batches per iteration: an epoch short of them
        (images skipped as corrupt, a smaller shard) is topped up with examples from a pass
        over the records in their stored order, repeated, so every epoch trains what Keras is
        told, and the shuffle's seed generator is drawn from once per epoch (exact resume).
        Under FILE auto-sharding each worker reads files of its own, whose share of the
        batches is unknown: the stream is endless (reshuffled each pass) and Keras counts the
        steps of each epoch.
        """
        encoded = rec.kind != "array"
        ds = self.augmented(rec)
        if encoded:
            ds = self.drop_flagged(ds)
        if self.file_sharded:
            ds, batches = ds.repeat(), None  # a repeat of a pass that yields nothing ends
        elif batches is not None and encoded:
            ds = ds.concatenate(self.drop_flagged(self.augmented(rec, top_up=True)).repeat())
        return self.finish(ds, "train", batches=batches)

    def evaluation_examples(self, split, rec: _Split):
        """`(image, label)` of each readable example of an evaluation split, once, in order
        (centre crop, no shuffle)."""
        ds = self.records(rec)
        transform = self.transform
        if rec.kind == "array":
            return ds.map(lambda p, y, k: (transform.eval_image(p, encoded=False), transform.label(y)),
                          num_parallel_calls=AUTOTUNE)
        fn = self.checked(split, rec.kind, lambda image_bytes: transform.eval_image(image_bytes, encoded=True))
        return self.drop_flagged(ds.map(fn, num_parallel_calls=AUTOTUNE), train=False)

    def readable(self, split, rec: _Split) -> int:
        """How many examples an evaluation split of encoded images scores: one pass of
        `evaluation_examples` (what the check flags and what the decoders reject is not
        counted, and the skipped images are counted in `skips` from here on)."""
        return int(self.evaluation_examples(split, rec).reduce(np.int64(0), lambda n, _: n + 1))

    def evaluation(self, split, rec: _Split, examples: int | None = None):
        """A validation or test dataset: every readable example once (the last batch may be short),
        in batches whose number is its cardinality, so Keras reads no further and does not warn
        that the data ran out.

        Encoded images: `examples` is `readable`'s count (images skipped as corrupt are not
        scored, and nothing can stand in for them: an empty batch breaks convolutions on
        TensorFlow's CPU kernels, a placeholder would be scored).
        """
        ds = self.evaluation_examples(split, rec)
        if examples is not None:
            ds = ds.apply(tf.data.experimental.assert_cardinality(examples))
        return self.finish(ds, split)


def _synthetic(source, image_size, global_batch_size, batch_size, seed, num_classes, one_hot, sizes):
    train_n, test_n = (int(v) for v in sizes)
    if train_n < global_batch_size:
        raise invalid_argument("synthetic_examples", f"a train size >= global_batch_size ({global_batch_size})", sizes)
    images = tf.random.stateless_normal([batch_size, image_size, image_size, 3], seed=[seed, 1])
    labels = tf.random.stateless_uniform([batch_size], seed=[seed, 2], maxval=num_classes, dtype=tf.int32)
    if one_hot:
        labels = tf.one_hot(labels, num_classes, dtype=tf.float32)
    batch = tf.data.Dataset.from_tensors((images, labels))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    steps = {"train": train_n // global_batch_size, "val": 0, "test": math.ceil(test_n / global_batch_size)}
    return ImageDatasets(
        train=batch.repeat(steps["train"]).with_options(options),
        val=None,
        test=batch.repeat(steps["test"]).with_options(options) if test_n else None,
        num_classes=num_classes,
        class_names=[str(i) for i in range(num_classes)],
        image_size=image_size,
        channels=3,
        source=source,
        augment="none",
        global_batch_size=global_batch_size,
        batch_size=batch_size,
        counts={"train": train_n, "val": 0, "test": test_n},
        steps=steps,
        mean=(0.0, 0.0, 0.0),
        std=(1.0, 1.0, 1.0),
        one_hot=one_hot,
    )


__all__ = [
    "AUGMENTATIONS",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ImageDatasets",
    "SkipCounter",
    "build_image_datasets",
]
