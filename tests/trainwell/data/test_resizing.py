"""Progressive resizing's schedule (`trainwell.data.resizing`) and the image pipeline that follows it."""

import os

import numpy as np
import pytest
import tensorflow as tf

from trainwell.data.images import build_image_datasets
from trainwell.data.resizing import EpochImageSize, check_size_schedule, epoch_sizes


def test_epoch_sizes_start_at_the_first_epoch_at_or_after_the_fraction():
    assert epoch_sizes([[0, 160], [0.75, 192]], 90)[67:69] == [160, 192]  # 0.75 x 90 = 67.5: from epoch 68
    assert epoch_sizes([[0, 160], [0.75, 192]], 4) == [160, 160, 160, 192]
    assert epoch_sizes([[0, 8], [0.1, 16]], 30)[2:4] == [8, 16]  # 0.1 x 30 = 3.0000000000000004 is epoch 3
    assert epoch_sizes([[0, 8], [0.3, 12], [0.4, 16]], 2) == [8, 16]  # both land on epoch 1: the last applies
    assert epoch_sizes([[0, 8], [0.75, 16]], 1) == [8]  # never reached in a 1-epoch run
    with pytest.raises(ValueError, match="Received: epochs=0"):
        epoch_sizes([[0, 8]], 0)


@pytest.mark.parametrize("bad, expected", [
    ([], "a list of \\[fraction, size\\] pairs, e.g."),
    ([[0, 160, 1]], "pairs, e.g."),
    ([[0.1, 160]], "the first at fraction 0"),
    ([[0, 160], [1.0, 192]], "fractions of the run in \\[0, 1\\)"),
    ([[0, 160], [0.5, 192], [0.5, 224]], "strictly increasing fractions"),
    ([[0, 160], [0.5, 16]], "at least 32 px"),
    ([[0, 160.0]], "int sizes"),
    ("160", "pairs"),
])
def test_check_size_schedule_refuses_in_one_line(bad, expected):
    with pytest.raises(ValueError, match=expected) as e:
        check_size_schedule(bad, min_size=32)
    message = str(e.value)
    assert "\n" not in message and message.endswith(f"Received: image_size_schedule={bad!r}")


def test_the_training_pipeline_makes_the_variables_side_and_evaluation_stays_at_image_size():
    sched = EpochImageSize([[0, 8], [0.5, 12]], epochs=2)
    data = build_image_datasets("digits", image_size=16, global_batch_size=32, train_size=sched.variable,
                                augment="pad_crop")
    assert data.train.element_spec[0].shape.as_list() == [32, None, None, 1]
    # Epoch 1's side first: the same positions and seeds as a fixed-size pipeline at 12 px (side / 8 of padding).
    fixed = build_image_datasets("digits", image_size=12, global_batch_size=32, augment="pad_crop")
    sides = []
    for epoch in (1, 0):
        sched.set_epoch(epoch)  # what the callback does before Keras makes the epoch's iterator
        images, labels = next(iter(data.train))
        sides.append(images.shape[1:3])
        assert images.shape[3] == 1 and labels.shape == (32, 10)
        assert np.isfinite(images.numpy()).all() and abs(float(images.numpy().mean())) < 3  # normalised
        if epoch == 1:
            np.testing.assert_array_equal(images.numpy(), next(iter(fixed.train))[0].numpy())
    assert sides == [(12, 12), (8, 8)]
    assert data.val.element_spec[0].shape.as_list()[1:] == [16, 16, 1]
    assert next(iter(data.val))[0].shape[1:] == (16, 16, 1)


def test_train_size_must_be_an_int32_variable():
    with pytest.raises(ValueError, match="Received: train_size=12"):
        build_image_datasets("digits", image_size=16, global_batch_size=32, train_size=12)
