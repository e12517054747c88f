"""The sources of `trainwell.data.images`: what a folder, TFRecords, a TFDS dataset or an embedded
set holds, as `Split`s of `(payload, label, key)` records, before any decoding.

Example:
>>> src = open_source("digits", data_dir=None, num_classes=None, num_examples=None, label_offset=None,
...                   cycle_length=1, input_context=None, val_fraction=0.1, test_fraction=0.2, split_seed=0, seed=0)
>>> src.num_classes, src.splits["train"].kind
(10, 'array')
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from trainwell.data import embedded
from trainwell.data.base import open_tfds_builder
from trainwell.data.embedded import stratified_split
from trainwell.data.prepared_index import read_index
from trainwell.data.sources import DataError, DataNotFoundError, check_image_folder, list_images, resolve_path
from trainwell.validation import invalid_argument

__all__ = ["SPLITS", "Source", "Split", "open_source"]

AUTOTUNE = tf.data.AUTOTUNE

# imagenet_to_gcs.py / TF Model Garden ImageNet TFRecord layout.
TFRECORD_IMAGE_KEY = "image/encoded"
TFRECORD_LABEL_KEY = "image/class/label"
IMAGENET_TRAIN_EXAMPLES = 1_281_167
IMAGENET_VAL_EXAMPLES = 50_000
# Defaults instead of errors: a record without image or label is flagged and counted downstream.
_EXAMPLE_SPEC = {
    TFRECORD_IMAGE_KEY: tf.io.FixedLenFeature([], tf.string, default_value=""),
    TFRECORD_LABEL_KEY: tf.io.FixedLenFeature([], tf.int64, default_value=-(10**9)),
}
# Records parsed together by one `tf.io.parse_example` (bench/README.md, "Prepared shards").
PARSE_BATCH = 64

# TFDS datasets whose held-out split is called "validation" (and have no "test").
# Used only when the builder's info has no split metadata (e.g. under tfds mocking).
_TFDS_VALIDATION_ONLY = {"imagenet2012", "imagenette", "imagewang", "imagenet_resized", "imagenet2012_subset",
                         "food101", "imagenet_a", "imagenet_r", "imagenet_lt", "stanford_online_products"}

SPLITS = ("train", "val", "test")

def _carve(key: tf.Tensor, split_seed: int) -> tf.Tensor:
    """A deterministic number in [0, 1) per record, from a hash of its bytes."""
    h = tf.strings.to_hash_bucket_fast(key, 1 << 62)
    mixed = tf.bitwise.bitwise_xor(h, tf.constant((split_seed * 0x9E3779B97F4A7C15) & ((1 << 62) - 1), tf.int64))
    return tf.cast(tf.math.floormod(mixed, 1_000_003), tf.float64) / 1_000_003.0


@dataclasses.dataclass
class Split:
    """Records of one split: a function returning a dataset of (payload, label, key)."""
    make: Any  # (shard: tuple[int, int] | None, ordered: bool = False) -> tf.data.Dataset of (payload, label, key)
    count: int | None
    # "path" (folder: payload a file name), "example" (TFRecord: payload the image bytes, parsed from
    # the record, label minus label_offset, key the shard name), "bytes" (TFDS), "array" (uint8 image)
    kind: str
    num_files: int = 0


@dataclasses.dataclass
class Source:
    splits: dict[str, Split | None]
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

        return Split(make, len(y), "array")

    return Source(
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

        return Split(make, len(y), "path", num_files=len(y))

    # Unreadable files (permissions, dangling links) are skipped and counted at listing time.
    as_split = {"train": "train", "val": "val" if has_test else "test", "test": "test"}
    unreadable = {as_split[k]: v[1] for k, v in listed.items() if v[1]}
    return Source({s: make_split(s) for s in SPLITS}, len(class_names), class_names, channels=3,
                   unreadable=unreadable)


def _tfrecord_source(pattern, *, val_fraction, test_fraction, split_seed, seed, data_dir, num_classes,
                     num_examples, label_offset, cycle_length):
    # one piece: the readers and counts of the splits are closures over one file listing, its
    # carve filters and known counts; apart, each would take most of this scope as arguments.
    full = resolve_path(pattern, data_dir)
    prepared = read_index(full) if os.path.isdir(full) else None  # `trainwell prepare-images`' folder
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
            # Parsed (and carved) PARSE_BATCH records at a time, in their order: one
            # `parse_example` per group costs a fraction of one `parse_single_example` per record.
            ds = ds.batch(PARSE_BATCH).interleave(parsed(keep), cycle_length=1, num_parallel_calls=AUTOTUNE,
                                                   deterministic=True).unbatch()
            return ds if record_shard is None else ds.shard(*record_shard)

        return make

    def parse(records, f):
        ex = tf.io.parse_example(records, _EXAMPLE_SPEC)
        return ex[TFRECORD_IMAGE_KEY], ex[TFRECORD_LABEL_KEY] - label_offset, f, records

    def one(record, f):
        """One record parsed; one that is not an `Example` becomes an empty image the check flags."""
        bad = tf.data.Dataset.from_tensors((tf.constant(""), tf.constant(-(10**9), tf.int64) - label_offset, f, record))
        fine = tf.data.Dataset.from_tensors((record[None], f[None])).map(parse).unbatch()
        return fine.ignore_errors().concatenate(bad).take(1)

    def parsed(keep):
        def group(records, f):
            """`(image bytes, label - label_offset, shard name)` of the records `keep` keeps, one group.
            A record that is not an `Example` fails `parse_example` for the whole group: that group
            is parsed again record by record (rare; the other records as before, in their place)."""
            fast = tf.data.Dataset.from_tensors((records, f)).map(parse).ignore_errors()
            slow = tf.data.Dataset.from_tensor_slices((records, f)).flat_map(one).batch(PARSE_BATCH)
            return fast.concatenate(slow).take(1).map(
                lambda image, label, f, records: tuple(
                    t if keep is None else tf.boolean_mask(t, keep(records, f)) for t in (image, label, f)))

        return group

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
    splits: dict[str, Split | None] = {s: None for s in SPLITS}
    known_train = num_examples.get("train", None if n_imagenet_train is None else round(n_imagenet_train * (1 - val_f - test_f)))
    splits["train"] = Split(reader(by_split["train"], train_keep, True), count(by_split["train"], train_keep, known_train),
                             "example", num_files=len(by_split["train"]))
    if val_f > 0:
        known = num_examples.get("val", None if n_imagenet_train is None else round(n_imagenet_train * val_f))
        splits["val"] = Split(reader(by_split["train"], val_keep, False), count(by_split["train"], val_keep, known),
                               "example", num_files=len(by_split["train"]))
    elif has_val and has_test:
        splits["val"] = Split(reader(by_split["validation"], None, False),
                               count(by_split["validation"], None, num_examples.get("val")),
                               "example", num_files=len(by_split["validation"]))
    if has_test:
        splits["test"] = Split(reader(by_split["test"], None, False), count(by_split["test"], None, num_examples.get("test")),
                                "example", num_files=len(by_split["test"]))
    elif has_val:
        known = num_examples.get("test", IMAGENET_VAL_EXAMPLES if imagenet_layout else None)
        splits["test"] = Split(reader(by_split["validation"], None, False), count(by_split["validation"], None, known),
                                "example", num_files=len(by_split["validation"]))
    elif test_f > 0:
        splits["test"] = Split(reader(by_split["train"], test_keep, False),
                                count(by_split["train"], test_keep, num_examples.get("test")),
                                "example", num_files=len(by_split["train"]))
    if prepared is not None and num_classes is None:  # its classes, by name
        return Source(splits, int(prepared["num_classes"]), list(prepared["class_names"]),
                      channels=int(prepared.get("channels", 3)))
    n_classes = num_classes or 1000
    return Source(splits, n_classes, [str(i) for i in range(n_classes)], channels=3)


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
    # one piece: the split names and each split's reader are closures over one builder and its info.
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

        return Split(make, count, "bytes")

    splits = {s: make_split(s) for s in SPLITS}
    return Source(splits, int(label_feature.num_classes), list(label_feature.names), channels, shards_itself=True)


def open_source(source, *, data_dir, num_classes, num_examples, label_offset, cycle_length, input_context,
                 val_fraction, test_fraction, split_seed, seed) -> Source:
    """The `Source` that `source` names (not `"synthetic"`); an unknown name raises `invalid_argument`'s error."""
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
