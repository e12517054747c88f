"""Even batches for data parallelism on JAX: a partial last batch padded with zero-weighted examples.

Keras's JAX data parallelism (`keras.distribution.DataParallel`) splits every
batch evenly over the devices of every process. An evaluation split whose size is
not a multiple of the global batch ends with a short batch that does not split:
with several processes each gets a different number of batches and the
collective of the last one waits for ever; on one process with several devices
the split fails. TensorFlow's `tf.distribute` handles short batches itself.

`pad_partial_batches` makes every batch the same size, a multiple of the
replicas, by appending zero-weighted examples (copies of the batch's first) and
adding sample weights:

- every real example is scored exactly once, and the padding weighs nothing;
- the loss equals the unpadded one: Keras averages each batch's loss over its
  size (padding included) and the batches by their size, so the real examples
  weigh `padded size / real size` (a constant over the split), which also
  leaves `weighted_metrics` exact;
- metrics passed to `compile(metrics=...)` ignore sample weights in Keras and
  would count the padding: compile them as `weighted_metrics` (the same values
  when there is no padding).

Example:
>>> import tensorflow as tf
>>> ds = tf.data.Dataset.from_tensor_slices(([[1.0]] * 5, [1] * 5)).batch(2)
>>> [[round(float(v), 3) for v in w] for _, _, w in pad_partial_batches(ds, 2)]
[[1.2, 1.2], [1.2, 1.2], [1.2, 0.0]]
"""

from __future__ import annotations

import math
import warnings
import weakref

from trainwell.validation import invalid_argument

__all__ = ["batch_with_even_tail", "pad_partial_batches"]

# dataset -> (examples, largest batch): counted once per dataset object (one pass over it).
_COUNTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def pad_partial_batches(dataset, multiple_of: int):
    """`dataset` with every batch of one size, a multiple of `multiple_of`, padded with zero-weighted examples.

    A dataset whose batches already all have that size (e.g. `drop_remainder=True`
    with a size that divides), one that is not a batched `(x, y)` or
    `(x, y, sample_weight)` `tf.data.Dataset` of dense tensors, one of infinite
    length and an empty one are returned as they are. Otherwise the dataset is
    read once to count its examples (cached for the dataset object), and each
    batch becomes `(x, y, sample_weight)`, padded with copies of its first example
    weighted 0, the real examples weighted `slots / examples` times their own
    weight, which keeps the loss Keras reports equal to the unpadded one (see the
    module docstring); an empty batch becomes zeros weighted 0. A dataset
    of unknown length (`dataset.cardinality()`: a `filter` or `ignore_errors`) is
    not read ahead: each short batch is padded as it comes to the batch size read from the
    dataset's graph, the real examples weighted 1, so `weighted_metrics` stay
    exact and the reported loss counts the padded slots (lower than the unpadded
    loss; a warning says so; `tf.data.experimental.assert_cardinality` makes it exact).

    Args:
        dataset: A batched `tf.data.Dataset`. Required.
        multiple_of: The batch size must be a multiple of this (the data-parallel
            replicas). Required.

    Returns:
        The dataset, padded where needed.

    Example:
    >>> import tensorflow as tf
    >>> ds = tf.data.Dataset.from_tensor_slices(([[1.0]] * 3, [0] * 3)).batch(2)
    >>> [x.shape[0] for x, _, _ in pad_partial_batches(ds, 2)]
    [2, 2]
    """
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
        raise invalid_argument("multiple_of", "an int >= 1", multiple_of)
    import tensorflow as tf  # lazy: TensorFlow at import time (a tf.data dataset here means it is loaded)

    if not isinstance(dataset, tf.data.Dataset):
        return dataset
    spec = dataset.element_spec
    if not isinstance(spec, tuple) or len(spec) not in (2, 3):
        return dataset  # no targets (predict): nothing can weigh the padding out
    flat = tf.nest.flatten(spec)
    if not all(isinstance(s, tf.TensorSpec) and s.shape.rank for s in flat):
        return dataset  # unbatched, ragged or sparse: left to Keras
    if flat[0].shape[0] is not None and flat[0].shape[0] % multiple_of == 0:
        return dataset  # drop_remainder=True: every batch full, and it splits evenly
    cardinality = int(dataset.cardinality())
    if cardinality == tf.data.INFINITE_CARDINALITY:
        return dataset  # a repeated dataset: no last batch
    if cardinality == tf.data.UNKNOWN_CARDINALITY:
        return _pad_unknown_length(dataset, multiple_of)
    examples, largest = _count(dataset)
    size = math.ceil(largest / multiple_of) * multiple_of if largest else 0
    batches = cardinality  # empty batches included
    if examples == 0 or examples == batches * size:
        return dataset  # every batch is full and splits evenly
    real_weight = batches * size / examples
    warnings.warn(
        f"trainwell: padded {batches * size - examples} examples of weight 0 onto a dataset of {examples} examples "
        f"(batches of {largest}) so that its batches split evenly over {multiple_of} replicas; metrics compiled "
        "with `metrics=` ignore sample weights and count them: compile them as `weighted_metrics=`.",
        stacklevel=2,
    )
    return _padded(dataset, size, real_weight)


def _pad_unknown_length(dataset, multiple_of: int):
    """Pads each short batch of a dataset of unknown length (a `filter`, `ignore_errors`; an image
    split read by workers from files of their own) as it comes, to the batch size the dataset was made with: no count, so the
    real examples weigh 1: `weighted_metrics` stay exact, and the loss Keras reports counts the
    padded slots (it is lower than the unpadded loss). Without a readable batch size it is
    returned as it is."""
    from trainwell.compat.tf_internals import dataset_batch_size  # lazy: it imports TensorFlow

    batch = dataset_batch_size(dataset)
    if batch is None:
        return dataset
    size = math.ceil(batch / multiple_of) * multiple_of
    warnings.warn(
        f"trainwell: a dataset of unknown length: each short batch is padded to {size} examples with examples of "
        f"weight 0 as it comes, so that it splits evenly over {multiple_of} replicas; the loss Keras reports counts "
        "the padded slots and is lower than the unpadded loss (state the length with `tf.data.experimental."
        "assert_cardinality` for an exact loss); compile accuracy-like metrics as `weighted_metrics=`.",
        stacklevel=3,
    )
    return _padded(dataset, size, 1.0)


def _padded(dataset, size: int, real_weight: float):
    """Each batch of `dataset` as `(x, y, sample_weight)` of `size` examples: the real ones weighted
    `real_weight` (times their own weight), then copies of the first weighted 0."""
    import tensorflow as tf  # lazy: TensorFlow at import time (see pad_partial_batches)

    def pad(t):
        # Copies of the batch's first example: real inputs (no all-zero image or fully masked
        # text whose loss could be NaN, and NaN x 0 is NaN), weighed out below. An empty batch
        # has none: zeros, weighted 0.
        t = tf.convert_to_tensor(t)
        missing = size - tf.shape(t)[0]
        fill = tf.cond(
            tf.shape(t)[0] > 0,
            lambda: tf.repeat(t[:1], missing, axis=0),
            lambda: tf.zeros(tf.concat([[missing], tf.shape(t)[1:]], 0), t.dtype),
        )
        return tf.ensure_shape(tf.concat([t, fill], axis=0), [size] + t.shape[1:].as_list())

    def padded(x, y, sample_weight=None):
        n = tf.shape(tf.nest.flatten(x)[0])[0]
        w = tf.ones([n], tf.float32) if sample_weight is None else tf.cast(sample_weight, tf.float32)
        w = w * real_weight
        weights = tf.concat([w, tf.zeros(tf.concat([[size - n], tf.shape(w)[1:]], 0), tf.float32)], axis=0)
        return (tf.nest.map_structure(pad, x), tf.nest.map_structure(pad, y),
                tf.ensure_shape(weights, [size] + w.shape[1:].as_list()))

    return dataset.map(padded, num_parallel_calls=tf.data.AUTOTUNE)


def _count(dataset) -> tuple[int, int]:
    """`(examples, largest batch)` of a batched dataset (one pass, cached per dataset object)."""
    try:
        return _COUNTS[dataset]
    except (KeyError, TypeError):
        pass
    import tensorflow as tf  # lazy: TensorFlow at import time (see pad_partial_batches)

    sizes = dataset.map(lambda *e: tf.cast(tf.shape(tf.nest.flatten(e)[0])[0], tf.int64))
    total, largest = sizes.reduce(
        (tf.constant(0, tf.int64), tf.constant(0, tf.int64)), lambda acc, n: (acc[0] + n, tf.maximum(acc[1], n))
    )
    out = (int(total), int(largest))
    try:
        _COUNTS[dataset] = out
    except TypeError:  # not weak-referenceable: count again next time
        pass
    return out


def batch_with_even_tail(ds, n: int, batch: int):
    """`ds`'s `n` examples in `ceil(n / batch)` batches: full ones, then the last two share the
    remainder evenly (batches of 16 for 33 examples: 16, 9, 8 instead of 16, 16, 1).

    A last batch smaller than the replicas leaves a replica an empty batch, which TensorFlow's
    oneDNN convolutions reject ("input depth must be evenly divisible by filter depth").
    One pass: each example's batch follows from its position (`group_by_window` closes each
    batch when it is full; the examples come in order, so the batches do too).

    Example:
    >>> import tensorflow as tf
    >>> [int(b.shape[0]) for b in batch_with_even_tail(tf.data.Dataset.range(33), 33, 16)]
    [16, 9, 8]
    """
    import tensorflow as tf  # lazy: TensorFlow at import time (see pad_partial_batches)

    if n < 0 or n <= batch or n % batch == 0:
        return ds.batch(batch)  # unknown length, one batch, or no remainder: nothing to share
    count = math.ceil(n / batch)
    head, tail = (count - 2) * batch, batch + n % batch
    sizes = tf.constant([batch] * (count - 2) + [(tail + 1) // 2, tail // 2], tf.int64)

    def key(position, example):
        first_tail = tf.cast(position - head >= sizes[-2], tf.int64)
        return tf.where(position < head, position // batch, count - 2 + first_tail)

    def batched(key, window):
        return window.map(_drop_position).batch(batch)

    def size(key):
        return sizes[key]

    ds = ds.enumerate().group_by_window(key_func=key, reduce_func=batched, window_size_func=size)
    return ds.apply(tf.data.experimental.assert_cardinality(count))


def _drop_position(position, example):
    return example
