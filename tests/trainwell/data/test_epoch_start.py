"""Constant-time mid-epoch resume (#35.4): the training pipeline drops the examples already trained before decoding."""

import os

import numpy as np
import pytest
import tensorflow as tf

from trainwell.data.epoch_start import EpochStart
from trainwell.data.images import build_image_datasets


@pytest.fixture(scope="module")
def folder_with_bad_images(tmp_path_factory):
    """3 classes x 24 small JPEGs, two of them truncated (flagged by the check, never decoded)."""
    root = tmp_path_factory.mktemp("start")
    rng = np.random.default_rng(0)
    for c in "abc":
        os.makedirs(root / c)
        for i in range(24):
            data = tf.io.encode_jpeg(rng.integers(0, 256, (12, 14, 3), dtype=np.uint8)).numpy()
            if c == "b" and i in (3, 17):
                data = data[: len(data) // 2]
            (root / c / f"{i}.jpg").write_bytes(data)
    return f"folder:{root}"


def _epoch(ds):
    return [images.numpy() for images, _ in ds]


@pytest.mark.parametrize("source, batch", [("digits", 64), ("folder", 12)])
def test_an_iterator_started_late_gives_the_rest_of_the_epoch_bit_for_bit(source, batch, folder_with_bad_images):
    source = folder_with_bad_images if source == "folder" else source
    kw = dict(image_size=8, global_batch_size=batch, val_fraction=0.0, test_fraction=0.0)
    plain = build_image_datasets(source, **kw)
    start = EpochStart(epoch=1, examples=0)
    data = build_image_datasets(source, start_at=start.variable, **kw)
    assert data.starts_at and not plain.starts_at
    steps = data.steps["train"]
    start.set_epoch(0)  # epoch 0: nothing dropped, the plain pipeline's batches
    first = _epoch(data.train)
    assert len(first) == steps and int(data.train.cardinality()) == steps
    for a, b in zip(_epoch(plain.train), first):
        np.testing.assert_array_equal(a, b)
    if source != "digits":  # 72 images, 2 of them bad, in 6 batches of 12: the last one is topped up
        assert data.counts["train"] - data.skipped["train"] < steps * batch
    # Epoch 1 resumed after steps - 1 batches (inside the top-up for the folder): the last batch.
    reference = _epoch(plain.train)[steps - 1]
    start = EpochStart(epoch=1, examples=(steps - 1) * batch)
    again = build_image_datasets(source, start_at=start.variable, **kw)
    iter(again.train)  # epoch 0's iterator: it draws that epoch's order (`harness.advance_epochs`)
    start.set_epoch(1)  # what the callback does before Keras makes the epoch's iterator
    np.testing.assert_array_equal(next(iter(again.train))[0].numpy(), reference)
    start.set_epoch(2)
    assert int(start.variable.numpy()) == 0


def test_epoch_start_arguments_are_checked():
    with pytest.raises(ValueError, match="Received: examples=-1"):
        EpochStart(epoch=0, examples=-1)
