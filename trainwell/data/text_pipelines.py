"""The tokenising `tf.data` pipelines of `trainwell.data.text`: `build_text_datasets` (training
batches grouped by length, evaluation batches in order) and `make_eval_dataset`.

See `trainwell.data.text`'s docstring for what they do; the names are importable from there.

Example:
>>> bucket_boundaries(64)
[16, 24, 32, 48, 64]
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from trainwell.data.base import DataError
from trainwell.validation import invalid_argument

if TYPE_CHECKING:
    from trainwell.data.text import TextSplits

__all__ = ["TextDatasets", "bucket_boundaries", "build_text_datasets", "make_eval_dataset"]

_BUCKET_BOUNDARIES = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
_EVAL_ROUND = 16


@dataclasses.dataclass
class TextDatasets:
    """Batched, tokenised datasets of `build_text_datasets` and what a recipe needs to know.

    Attributes:
        train: Shuffled `(inputs, labels)` batches grouped by length, full batches only.
        val, test: Evaluation batches in order, or `None`.
        splits: The `TextSplits` they were built from.
        global_batch_size: Batch size (over all replicas).
        sequence_length: Maximum tokens per example.
        steps: Batches per epoch per split (`train`: full batches only).

    Example:
    >>> data = build_text_datasets(splits, preprocessor, 32)  # doctest: +SKIP
    >>> data.steps_per_epoch  # doctest: +SKIP
    """

    train: Any
    val: Any
    test: Any
    splits: TextSplits
    global_batch_size: int
    sequence_length: int
    steps: dict[str, int]

    @property
    def steps_per_epoch(self) -> int:
        return self.steps["train"]

    @property
    def num_classes(self) -> int:
        return self.splits.num_classes

    @property
    def class_names(self) -> list[str]:
        return self.splits.class_names


def bucket_boundaries(sequence_length: int) -> list[int]:
    """Upper bounds of the length buckets for `sequence_length` (the last is it).

    Example:
    >>> bucket_boundaries(64)
    [16, 24, 32, 48, 64]
    """
    return [b for b in _BUCKET_BOUNDARIES if b < sequence_length] + [int(sequence_length)]


def _tokenised(texts: np.ndarray, labels: np.ndarray | None, preprocessor):
    """`(inputs, label, length)` per example, tokenised by `preprocessor` inside tf.data."""
    # lazy: TensorFlow loads on first use, not with this module
    import tensorflow as tf

    x = tf.constant(np.asarray(texts, dtype=object).astype(str))
    ds = tf.data.Dataset.from_tensor_slices((x, np.zeros(len(texts), np.int32) if labels is None else labels.astype(np.int32)))

    def tok(text, label):
        inputs = preprocessor(text)
        length = tf.reduce_sum(tf.cast(inputs["padding_mask"], tf.int32), axis=-1)
        return inputs, label, length

    # Tokenise batches (fast), then unbatch to single examples.
    return ds.batch(256).map(tok, num_parallel_calls=tf.data.AUTOTUNE).unbatch()


def _cut(inputs: dict, n):
    return {k: v[:, :n] for k, v in inputs.items()}


def make_eval_dataset(texts, labels, preprocessor, batch_size: int, sequence_length: int):
    """Evaluation/prediction batches in input order, cut to their longest example.

    Each batch is cut to the longest example it holds, rounded up to a multiple of 16
    (at most `sequence_length`). Labels are all 0 when `labels` is None.

    Example:
    >>> ds = make_eval_dataset(["so good"], None, preprocessor, 32, 64)  # doctest: +SKIP
    """
    # lazy: TensorFlow loads on first use, not with this module
    import tensorflow as tf

    ds = _tokenised(np.asarray(texts, dtype=object), None if labels is None else np.asarray(labels), preprocessor)
    ds = ds.batch(batch_size)

    def cut(inputs, label, length):
        n = tf.minimum(((tf.reduce_max(length) + _EVAL_ROUND - 1) // _EVAL_ROUND) * _EVAL_ROUND, sequence_length)
        return _cut(inputs, n), label

    ds = ds.map(cut, num_parallel_calls=tf.data.AUTOTUNE)
    # Known length: Keras then runs exactly these steps (no "ran out of data" warning).
    ds = ds.apply(tf.data.experimental.assert_cardinality(math.ceil(len(texts) / batch_size)))
    return ds.prefetch(tf.data.AUTOTUNE)


def build_text_datasets(
    splits: TextSplits,
    preprocessor,
    global_batch_size: int,
    *,
    sequence_length: int,
    seed: int = 0,
    bucket_by_length: bool = True,
    eval_batch_size: int | None = None,
) -> TextDatasets:
    """Builds the tokenising train / validation / test pipelines of `splits`.

    Args:
        splits: From `load_text_splits`.
        preprocessor: A keras-hub text classifier preprocessor (string in, dict of
            `token_ids`, `padding_mask`, ... of length `sequence_length` out).
        global_batch_size: Batch size over all replicas, >= 1.
        sequence_length: The preprocessor's sequence length.
        seed: Seed of the training shuffle. Defaults to `0`.
        bucket_by_length: Group training batches by length and cut them to the
            bucket's boundary. Defaults to `True`.
        eval_batch_size: Batch size of validation/test. Defaults to `None`
            (`2 * global_batch_size`).

    Returns:
        A `TextDatasets`.

    Example:
    >>> data = build_text_datasets(load_text_splits("rotten_tomatoes"), pre, 32, sequence_length=64)  # doctest: +SKIP
    """
    # lazy: TensorFlow loads on first use, not with this module
    import tensorflow as tf

    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise invalid_argument("global_batch_size", "an int >= 1", global_batch_size)
    if isinstance(sequence_length, bool) or not isinstance(sequence_length, int) or sequence_length < 2:
        raise invalid_argument("sequence_length", "an int >= 2", sequence_length)
    x, y = splits.train
    n = len(y)
    if n < global_batch_size:
        raise DataError(
            f"The training split of {splits.name!r} has {n} examples, fewer than one batch of "
            f"global_batch_size={global_batch_size}."
        )
    cached = _tokenised(x, y, preprocessor).cache()
    bounds = bucket_boundaries(sequence_length) if bucket_by_length else [int(sequence_length)]
    # One pass fills the cache (tokenising once) and gives the lengths, hence the exact
    # number of full batches per epoch.
    lengths = np.concatenate([b.numpy() for b in cached.map(lambda i, l, n_: n_).batch(4096)])
    bucket_ids = np.searchsorted(np.asarray(bounds), lengths, side="left")
    steps_train = int(sum(c // global_batch_size for c in np.bincount(bucket_ids, minlength=len(bounds))))
    if steps_train < 1:
        raise DataError(f"Too few training examples in {splits.name!r} for one full batch per length bucket.")
    options = tf.data.Options()
    options.deterministic = True
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    train = _train_dataset(cached, bounds, global_batch_size, seed, n, steps_train).with_options(options)

    eb = eval_batch_size or 2 * global_batch_size

    def ev(part):
        if part is None:
            return None, 0
        ds = make_eval_dataset(part[0], part[1], preprocessor, eb, sequence_length).with_options(options)
        return ds, math.ceil(len(part[1]) / eb)

    val, steps_val = ev(splits.val)
    test, steps_test = ev(splits.test)
    return TextDatasets(
        train=train, val=val, test=test, splits=splits, global_batch_size=global_batch_size,
        sequence_length=int(sequence_length), steps={"train": steps_train, "val": steps_val, "test": steps_test},
    )


def _train_dataset(cached, bounds: list[int], global_batch_size: int, seed: int, n: int, steps: int):
    """The training batches of the `n` tokenised examples `cached`: shuffled, grouped by length
    bucket (`bounds`), full batches only, each cut to its bucket's boundary, `steps` of them."""
    import tensorflow as tf  # lazy: TensorFlow at import time

    bounds_t = tf.constant(bounds, tf.int64)

    def key(inputs, label, length):
        return tf.cast(tf.searchsorted(bounds_t, tf.reshape(tf.cast(length, tf.int64), [1]), side="left")[0], tf.int64)

    def cut_to_bucket(inputs, label, length):
        b = tf.searchsorted(bounds_t, tf.reshape(tf.cast(tf.reduce_max(length), tf.int64), [1]), side="left")[0]
        return _cut(inputs, tf.cast(tf.gather(bounds_t, b), tf.int32)), label

    train = cached.shuffle(n, seed=seed, reshuffle_each_iteration=True)
    train = train.group_by_window(
        key_func=key,
        reduce_func=lambda _, window: window.batch(global_batch_size, drop_remainder=True),
        window_size=global_batch_size,
    )
    train = train.map(cut_to_bucket, num_parallel_calls=tf.data.AUTOTUNE)
    train = train.apply(tf.data.experimental.assert_cardinality(steps)).prefetch(tf.data.AUTOTUNE)
    return train
