"""Prepared image shards: a source's images, once, at a lower resolution, as JPEG TFRecords.

`prepare_images(source, dst, max_side=256)` reads any source the image pipeline reads
(`folder:PATH`, `tfds:NAME`, `tfrecord:GLOB`, the embedded sets), resizes every image so
that its shorter side is at most `max_side` (never upsampled: a JPEG already that small
is copied byte for byte; another format is re-encoded as JPEG), and writes the records as
`DST/train-NNNNN-of-NNNNN` in the ImageNet TFRecord layout the pipeline already reads
(`image/encoded`, 1-based `image/class/label`); a held-out split the source has (ImageNet's
validation set, a folder's `val/` or `test/`) goes to `validation-*` or `test-*` shards, so
the recipe carves and evaluates as it does on the source itself (and evaluates ImageNet the
standard way: a 256-px shorter side, the central 224 px). `index.json` (shard names, record counts,
SHA-256 checksums, `max_side`, class names) is written last, after every shard was read
back and checked. Train on it with `dataset="tfrecord:DST"`: the same augmentation (the
Inception crop is drawn on the smaller image: the same fractions of it) and the same
exact resume as any TFRecord source; the index gives the reader the class names.

Why: decoding is most of the input pipeline's CPU per image, and its cost grows with the
pixels decoded; FFCV and the fast ImageNet recipes store ImageNet once at a lower
resolution for this (figures: bench/README.md, `input_pipeline.py`).

Parallelism: one process, the decode, resize and encode as a `tf.data` map over
`workers` threads (a private thread pool). These are TensorFlow kernels that release the
GIL, so threads use every core without the per-process costs of a process pool (a
TensorFlow import and a reader of the source in each process); the map keeps the source's
order (`deterministic=True`), so shard `k` always holds the same images, which resuming
relies on. The main thread only writes records and hashes files.

Resume: shard `k` of a split holds the split's records `[k * images_per_shard, (k + 1) *
images_per_shard)` minus the bad ones. A shard is written under `DST/.partial/`, then
renamed into place and recorded with its checksum in `DST/.partial/progress.json`. A
rerun after a kill keeps every recorded shard whose file still has its checksum, skips
its records before they are read or decoded, and rewrites the rest (the shard being
written when the run died included).

Bad images (not an image, truncated, undecodable, a label out of range) are skipped:
one line each (`skipped: NAME (why)`), counted in the index.

Example:
>>> import os, tempfile
>>> dst = os.path.join(tempfile.mkdtemp(), "digits-8")
>>> result = prepare_images("digits", dst, max_side=8, verbose=0)
>>> result.count, result.skipped, sorted(os.listdir(dst))[:2]
(1797, 0, ['index.json', 'train-00000-of-00002'])
>>> verify_prepared(dst)["max_side"]
8
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from trainwell.config import check_dir_path
from trainwell.data.image_ops import valid_image
from trainwell.data.image_sources import TFRECORD_IMAGE_KEY, TFRECORD_LABEL_KEY, open_source
from trainwell.data.prepared_index import INDEX_FORMAT, INDEX_NAME, read_index, sha256_of
from trainwell.data.sources import DataError, check_source_url
from trainwell.io import atomic_write_json
from trainwell.validation import invalid_argument, is_int, is_url, redact

__all__ = ["PrepareResult", "prepare_images", "source_name", "verify_prepared"]

#: Where unfinished work lives: shards being written and the record of finished ones.
PARTIAL_DIR = ".partial"
PROGRESS_NAME = "progress.json"
#: Labels are written 1-based, as in ImageNet's TFRecords (the reader's default offset).
LABEL_OFFSET = 1
#: The source's splits and the shard prefix each is written under (the TFRecord reader's names:
#: a held-out split keeps its role, so the recipe carves and evaluates as on the source itself).
SPLIT_PREFIXES = (("train", "train"), ("val", "validation"), ("test", "test"))
#: The parameters that decide a shard's bytes: a rerun with other values cannot reuse them.
_PLAN_KEYS = ("source", "max_side", "quality", "images_per_shard", "source_count")


@dataclasses.dataclass
class PrepareResult:
    """What `prepare_images` wrote.

    Attributes:
        directory: The prepared folder (`dataset="tfrecord:<directory>"` reads it).
        count: Training images written (all splits: `index["counts"]`).
        skipped: Bad images skipped.
        skipped_examples: Up to 100 of their names.
        shards: Shard files.
        reused: Shards kept from an earlier, interrupted run (or all of them when the folder
            was complete already).
        seconds: Wall time of this call.
        index: The index written (`index.json`).

    Example:
    >>> PrepareResult("d", 10, 0, [], 1, 0, 0.1, {}).count
    10
    """
    directory: str
    count: int
    skipped: int
    skipped_examples: list[str]
    shards: int
    reused: int
    seconds: float
    index: dict[str, Any]


def source_name(src: str) -> str:
    """The source string of `src`: as given when it names a kind (`folder:`, `tfds:`, `tfrecord:`,
    `mnist5k`, `digits`); a directory of TFRecord shards (`train-*`, `*.tfrecord*`, a prepared
    folder) as `tfrecord:DIR`; another directory as `folder:DIR`.

    Example:
    >>> source_name("tfds:imagenette")
    'tfds:imagenette'
    >>> import tempfile; source_name(tempfile.gettempdir()).startswith("folder:")
    True
    """
    if not isinstance(src, (str, os.PathLike)) or not os.fspath(src).strip():
        raise invalid_argument("src", "a source such as 'folder:PATH', 'tfds:NAME', 'tfrecord:GLOB' or a directory",
                               src)
    src = os.fspath(src)
    kind = src.partition(":")[0].lower()
    if kind in ("folder", "tfds", "tfrecord", "embedded") or src in ("mnist5k", "digits"):
        return src
    if os.path.isdir(src):
        names = [n for n in os.listdir(src) if os.path.isfile(os.path.join(src, n))]
        if INDEX_NAME in names or any(n.startswith("train-") or ".tfrecord" in n for n in names):
            return f"tfrecord:{src}"
        return f"folder:{src}"
    raise invalid_argument("src", "'folder:PATH', 'tfds:NAME', 'tfrecord:GLOB', 'mnist5k', 'digits' or an existing "
                           "directory", src)


def _check(max_side, quality, images_per_shard, workers) -> None:
    if not is_int(max_side) or max_side < 1:
        raise invalid_argument("max_side", "an int >= 1", max_side)
    if not is_int(quality) or not 1 <= quality <= 100:
        raise invalid_argument("quality", "an int in [1, 100]", quality)
    if not is_int(images_per_shard) or images_per_shard < 1:
        raise invalid_argument("images_per_shard", "an int >= 1", images_per_shard)
    if workers is not None and (not is_int(workers) or workers < 1):
        raise invalid_argument("workers", "None or an int >= 1", workers)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _converter(kind: str, channels: int, num_classes: int, max_side: int, quality: int):
    """`(i, (payload, label, key)) -> (i, key, jpeg, label, ok)`: read, check, resize, encode one record
    (TFRecord sources come parsed: image bytes, label minus the source's `label_offset`)."""

    def shrink(image, already_jpeg, image_bytes):
        shape = tf.shape(image)
        short = tf.minimum(shape[0], shape[1])

        def resized():
            scale = tf.minimum(1.0, max_side / tf.cast(short, tf.float32))
            size = tf.maximum(1, tf.cast(tf.round(tf.cast(shape[:2], tf.float32) * scale), tf.int32))
            small = tf.image.resize(image, size, method="bilinear", antialias=True)
            small = tf.cast(tf.clip_by_value(tf.round(small), 0.0, 255.0), tf.uint8)
            return tf.io.encode_jpeg(small, quality=quality)

        return tf.cond(tf.logical_and(already_jpeg, short <= max_side), lambda: image_bytes, resized)

    def convert(i, record):
        payload, label, key = record
        if kind == "array":  # decoded uint8 images (the embedded sets)
            jpeg = shrink(payload, tf.constant(False), tf.constant(b""))
            return i, key, jpeg, tf.cast(label, tf.int64) + LABEL_OFFSET, tf.constant(True)
        image_bytes = tf.io.read_file(payload) if kind == "path" else payload
        label = tf.cast(label, tf.int64)
        ok = tf.logical_and(valid_image(image_bytes), tf.logical_and(label >= 0, label < num_classes))

        def good():
            image = tf.io.decode_image(image_bytes, channels=channels, expand_animations=False)
            return shrink(image, tf.io.is_jpeg(image_bytes), image_bytes)

        jpeg = tf.cond(ok, good, lambda: tf.constant(b""))
        return i, key, jpeg, label + LABEL_OFFSET, ok

    return convert


def _example(jpeg: bytes, label: int) -> bytes:
    return tf.train.Example(features=tf.train.Features(feature={
        TFRECORD_IMAGE_KEY: tf.train.Feature(bytes_list=tf.train.BytesList(value=[jpeg])),
        TFRECORD_LABEL_KEY: tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
    })).SerializeToString(deterministic=True)  # map entries sorted: the same bytes in any process


def _shard_name(prefix: str, k: int, n: int) -> str:
    return f"{prefix}-{k:05d}-of-{n:05d}"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def prepare_images(
    # one piece: validate, open the source, resume or start, write every split's shards, verify, index last
    source: str,
    dst: str | os.PathLike,
    *,
    max_side: int = 256,
    data_dir: str | None = None,
    quality: int = 90,
    images_per_shard: int = 1024,
    workers: int | None = None,
    num_classes: int | None = None,
    label_offset: int | None = None,
    verbose: int = 1,
    log: Callable[[str], None] | None = None,
) -> PrepareResult:
    """Writes `source`'s training split (and held-out splits) to `dst` as JPEG TFRecord shards of at
    most `max_side` px on the shorter side, resumably, then verifies them and writes the index (module docstring).

    Args:
        source: A source of `trainwell.data.images.build_image_datasets` (`"folder:PATH"`,
            `"tfds:NAME"`, `"tfrecord:GLOB"`, `"mnist5k"`, `"digits"`) or a directory
            (`source_name`). The whole training split is written (a split the recipe
            carves from it, `val_fraction`, is carved again from the prepared records), and
            the source's own validation and test splits.
        dst: The output folder: new, empty, or one an earlier call with the same arguments
            left (it resumes, or returns at once when complete).
        max_side: Largest shorter side in pixels, >= 1. Defaults to `256`.
        data_dir: TFDS data directory and base of relative paths. Defaults to `None`.
        quality: JPEG quality of re-encoded images, 1-100. Defaults to `90` (FFCV's).
        images_per_shard: Source records per shard. Defaults to `1024`.
        workers: Threads of the decode/resize/encode map. Defaults to `None` (the cores
            this process may use).
        num_classes: Classes of a TFRecord source (else 1000). Defaults to `None`.
        label_offset: Subtracted from a TFRecord source's labels. Defaults to `None` (1).
        verbose: 1 shows a progress bar (`keras.utils.Progbar`), 0 nothing. Defaults to `1`.
        log: Receives one line per skipped image and per event. Defaults to `None` (stderr).

    Returns:
        A `PrepareResult`.

    Raises:
        ValueError: an invalid argument (the "Received:" idiom).
        DataError: an unreadable source, or a `dst` holding something else (other files,
            shards of other arguments).

    Example:
    >>> import os, tempfile
    >>> r = prepare_images("digits", os.path.join(tempfile.mkdtemp(), "p"), max_side=4, verbose=0)  # doctest: +SKIP
    >>> r.index["max_side"], r.index["count"], len(r.index["shards"])  # doctest: +SKIP
    (4, 1797, 2)
    """
    # one piece: the plan, the resume check, the stream and the writer share the shard plan and
    # the progress record; apart, each would take most of them as arguments.
    _check(max_side, quality, images_per_shard, workers)
    if not isinstance(dst, (str, os.PathLike)) or not os.fspath(dst).strip():
        raise invalid_argument("dst", "a folder path", dst)
    if is_url(os.fspath(dst)):  # its index, checksums and resumable parts are local files
        raise invalid_argument("dst", "a local folder (copy the shards to a bucket afterwards)", redact(os.fspath(dst)))
    check_dir_path(dst, "dst", write=True)  # a file, a read-only file system: one line, before anything is read
    log = log or _stderr
    start = time.perf_counter()
    source = source_name(source)
    check_source_url(source, "src")
    dst = os.path.abspath(os.fspath(dst))
    workers = workers or _cores()
    src = open_source(source, data_dir=data_dir, num_classes=num_classes, num_examples=None,
                      label_offset=label_offset, cycle_length=min(16, workers), input_context=None,
                      val_fraction=0.0, test_fraction=0.0, split_seed=0, seed=0)
    splits = []  # (split, shard names, record stream maker): train, then the held-out splits the source has
    for split, prefix in SPLIT_PREFIXES:
        rec = src.splits[split]
        if rec is None:
            continue
        count = rec.count
        if count is None:  # e.g. TFDS without split metadata: one pass over the records, nothing decoded
            count = int(rec.make(None, True).reduce(np.int64(0), lambda n, _: n + 1))
        if count == 0 and split == "train":
            raise DataError(f"The training split of {source!r} is empty.")
        n = math.ceil(count / images_per_shard)
        splits.append((split, [_shard_name(prefix, k, n) for k in range(n)], rec, count))
    plan = {"source": source, "max_side": max_side, "quality": quality, "images_per_shard": images_per_shard,
            "source_count": {split: count for split, _, _, count in splits}}
    names = [name for _, split_names, _, _ in splits for name in split_names]

    index = _existing(dst, plan)
    if index is not None:  # complete already: verified, kept
        return PrepareResult(dst, index["count"], index["skipped"], index["skipped_examples"], len(names),
                             len(names), time.perf_counter() - start, index)
    partial = os.path.join(dst, PARTIAL_DIR)
    progress = _progress(partial, plan)
    done = {n: v for n, v in progress["shards"].items()
            if n in names and os.path.isfile(os.path.join(dst, n)) and sha256_of(os.path.join(dst, n)) == v["sha256"]}
    progress["shards"] = dict(done)
    if done:
        log(f"resuming: {len(done)} of {len(names)} shards already written and verified, "
            f"{len(names) - len(done)} to write")
    bar = _progbar(sum(min(images_per_shard, count - k * images_per_shard) for _, split_names, _, count in splits
                       for k, name in enumerate(split_names) if name not in done), verbose)
    convert = {kind: _converter(kind, src.channels, src.num_classes, max_side, quality)
               for kind in {rec.kind for _, _, rec, _ in splits}}
    for _, split_names, rec, count in splits:
        _write_split(rec, count, split_names, convert[rec.kind], _Writer(dst, partial, split_names, progress,
                                                                         images_per_shard, log), workers, bar)
    index = _finish(dst, partial, plan, splits, progress, src)
    log(f"prepared {index['count']} training images in {len(names)} shard(s) ({index['skipped']} skipped) in {dst}")
    return PrepareResult(dst, index["count"], index["skipped"], index["skipped_examples"], len(names),
                         len(done), time.perf_counter() - start, index)


def _write_split(rec, count: int, names: list[str], convert, writer: "_Writer", workers: int, bar) -> None:
    """Reads, converts and writes one split's shards that are not done yet, in order."""
    per = writer.per
    todo_mask = tf.constant([name not in writer.progress["shards"] for name in names] or [False])
    options = tf.data.Options()
    options.deterministic = True
    options.threading.private_threadpool_size = workers
    records = rec.make(None, True).enumerate().filter(lambda i, r: tf.gather(todo_mask, i // per))
    out = (records.map(convert, num_parallel_calls=workers, deterministic=True).ignore_errors()
           .prefetch(2 * workers).with_options(options))
    keys = iter(records.map(lambda i, r: (i, r[2])).with_options(options)) if rec.kind in ("path", "array") else None
    for i, key, jpeg, label, ok in out.as_numpy_iterator():
        i = int(i)
        writer.missing_before(i, keys)
        writer.at(i // per)
        if ok:
            writer.write(_example(jpeg, int(label)))
        else:
            writer.skip(_key_text(key, i), "not an image, truncated, or a label out of range")
        if bar is not None:
            bar.add(1)
    writer.missing_before(count, keys)
    writer.at(len(names))  # closes the last shard, and writes any shard whose images were all bad


def _key_text(key, i: int) -> str:
    k = key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)
    return k if os.path.sep in k or "[" in k else f"{k} (record {i} of the source)"


def _progbar(target: int, verbose: int):
    if not verbose or target <= 0:
        return None
    # lazy: Keras loads only for the progress bar, not with the data modules
    import keras

    return keras.utils.Progbar(target, unit_name="image")


class _Writer:
    """Writes the shards in order: one open at a time, each renamed into place and recorded when closed."""

    def __init__(self, dst, partial, names, progress, images_per_shard, log):
        self.dst, self.partial, self.names, self.progress, self.per, self.log = (
            dst, partial, names, progress, images_per_shard, log)
        self.current: int | None = None
        self.file = None
        self.written = 0
        self.skipped: list[str] = []

    def missing_before(self, i: int, keys) -> None:
        """Records the keys before position `i` that the map dropped (the decoder rejected them)."""
        if keys is None:
            return
        for j, key in keys:
            j = int(j)
            if j >= i:
                return
            self.at(j // self.per)
            self.skip(_key_text(key.numpy(), j), "the decoder rejected it")

    def at(self, shard: int) -> None:
        """Makes `shard` the open one: closes the open shard and writes the shards to write between as
        empty (all their images were bad); `len(names)` closes the last."""
        if self.current == shard:
            return
        if self.current is not None and self.current < len(self.names):
            self._close()
        for k in range(0 if self.current is None else self.current + 1, min(shard, len(self.names))):
            if self.names[k] not in self.progress["shards"]:
                self._open(k)
                self._close()
        if shard < len(self.names):
            self._open(shard)
        self.current = shard

    def _open(self, k: int) -> None:
        self.current, self.written, self.skipped = k, 0, []
        self.file = tf.io.TFRecordWriter(os.path.join(self.partial, self.names[k]))

    def write(self, record: bytes) -> None:
        self.file.write(record)
        self.written += 1

    def skip(self, name: str, why: str) -> None:
        self.log(f"skipped: {name} ({why})")
        self.skipped.append(name)

    def _close(self) -> None:
        name = self.names[self.current]
        self.file.close()
        tmp = os.path.join(self.partial, name)
        entry = {"count": self.written, "sha256": sha256_of(tmp), "skipped": self.skipped}
        os.replace(tmp, os.path.join(self.dst, name))
        self.progress["shards"][name] = entry
        atomic_write_json(os.path.join(self.partial, PROGRESS_NAME), self.progress)


def _existing(dst: str, plan: dict) -> dict | None:
    """A complete index of the same plan (verified), None for a new or unfinished folder; else a DataError."""
    index = read_index(dst) if os.path.isdir(dst) else None
    if index is not None:
        if {k: index.get(k) for k in _PLAN_KEYS} != plan:
            raise DataError(f"{dst!r} holds images prepared with other arguments "
                            f"({ {k: index.get(k) for k in _PLAN_KEYS} }); choose another folder or remove it.")
        index = verify_prepared(dst)
        shutil.rmtree(os.path.join(dst, PARTIAL_DIR), ignore_errors=True)  # a kill after the index was written
        return index
    if os.path.isdir(dst):
        others = [n for n in os.listdir(dst) if n != PARTIAL_DIR
                  and not n.startswith(tuple(f"{prefix}-" for _, prefix in SPLIT_PREFIXES))]
        if others or (os.listdir(dst) and not os.path.isdir(os.path.join(dst, PARTIAL_DIR))):
            raise DataError(f"{dst!r} is not empty and holds no unfinished preparation "
                            f"(found {sorted(os.listdir(dst))[:3]}); choose a new or empty folder.")
    return None


def _progress(partial: str, plan: dict) -> dict:
    """The progress record of an interrupted run of the same plan, or a new one."""
    os.makedirs(partial, exist_ok=True)
    path = os.path.join(partial, PROGRESS_NAME)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                progress = json.load(f)
        except (OSError, ValueError):
            progress = None
        if isinstance(progress, dict) and progress.get("plan") == plan:
            return progress
    return {"plan": plan, "shards": {}}


def _finish(dst, partial, plan, splits, progress, src) -> dict:
    """Verifies every shard (checksum and records), writes the index last, removes the partial folder."""
    shards, skipped, counts = [], [], {}
    for split, names, _, _ in splits:
        for name in names:
            entry = progress["shards"][name]
            shards.append({"name": name, "split": split, "count": entry["count"], "sha256": entry["sha256"],
                           "bytes": os.path.getsize(os.path.join(dst, name))})
            skipped.extend(entry["skipped"])
            counts[split] = counts.get(split, 0) + entry["count"]
    index = {"format": INDEX_FORMAT, **plan, "label_offset": LABEL_OFFSET, "num_classes": src.num_classes,
             "class_names": list(src.class_names), "channels": src.channels, "shards": shards,
             "count": counts["train"], "counts": counts, "skipped": len(skipped), "skipped_examples": skipped[:100]}
    _verify(dst, index)
    atomic_write_json(os.path.join(dst, INDEX_NAME), index)
    shutil.rmtree(partial, ignore_errors=True)
    return index


def _verify(dst: str, index: dict) -> None:
    for shard in index["shards"]:
        path = os.path.join(dst, shard["name"])
        if not os.path.isfile(path):
            raise DataError(f"Prepared shard {path!r} is missing (listed in {INDEX_NAME}).")
        if sha256_of(path) != shard["sha256"]:
            raise DataError(f"Prepared shard {path!r} does not match its checksum in {INDEX_NAME}: "
                            "it changed or is damaged; delete the folder and "
                            "prepare it again.")
        try:
            n = int(tf.data.TFRecordDataset(path).reduce(np.int64(0), lambda c, _: c + 1))
        except tf.errors.DataLossError:
            n = -1
        if n != shard["count"]:
            raise DataError(f"Prepared shard {path!r} holds {n} readable records, its index says {shard['count']}.")


def verify_prepared(dst: str | os.PathLike) -> dict[str, Any]:
    """Checks a prepared folder against its index: every shard present, its SHA-256 and record count.

    Args:
        dst: A folder `prepare_images` completed.

    Returns:
        The index.

    Raises:
        DataError: no index, or a shard missing, changed or damaged (the message names it).

    Example:
    >>> import os, tempfile
    >>> dst = prepare_images("digits", os.path.join(tempfile.mkdtemp(), "v"), verbose=0).directory  # doctest: +SKIP
    >>> verify_prepared(dst)["count"]  # doctest: +SKIP
    1797
    """
    if not isinstance(dst, (str, os.PathLike)):
        raise invalid_argument("dst", "a folder path", dst)
    index = read_index(dst)
    if index is None:
        raise DataError(f"{os.fspath(dst)!r} has no {INDEX_NAME}: not a prepared folder, or its preparation did "
                        "not finish (run prepare-images again to resume it).")
    _verify(os.fspath(dst), index)
    return index
