"""The `"synthetic"` image source of `trainwell.data.images`: one fixed batch of random images, repeated.

No decoding: `fit` on it measures the model, not the input pipeline.

Example:
>>> fields = synthetic_datasets("synthetic", 8, 4, 4, 0, 10, True, (8, 4))
>>> fields["steps"], tuple(next(iter(fields["train"]))[0].shape)
({'train': 2, 'val': 0, 'test': 1}, (4, 8, 8, 3))
"""

from __future__ import annotations

import math

import tensorflow as tf

from trainwell.validation import invalid_argument

__all__ = ["synthetic_datasets"]


def synthetic_datasets(source, image_size, global_batch_size, batch_size, seed, num_classes, one_hot, sizes) -> dict:
    """The fields of `trainwell.data.images.ImageDatasets` for `"synthetic"`: already-normalised RGB images.

    Args:
        source: The source string, as given.
        image_size: Side of the images.
        global_batch_size: Batch size over all replicas.
        batch_size: Batch size of these datasets.
        seed: Seed of the images and labels.
        num_classes: Number of classes.
        one_hot: One-hot float32 labels instead of int32 ids.
        sizes: `(train, test)` example counts.

    Example:
    >>> synthetic_datasets("synthetic", 8, 4, 4, 0, 10, True, (8, 0))["test"] is None
    True
    """
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
    return dict(
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
