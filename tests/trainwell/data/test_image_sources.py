"""TFRecord splits of `trainwell.data.image_sources` on a tiny prepared folder (`prepare_images`)."""

import numpy as np
import pytest
import tensorflow as tf

from trainwell.data import image_sources
from trainwell.data.image_sources import TFRECORD_IMAGE_KEY, TFRECORD_LABEL_KEY, _carve, open_source
from trainwell.data.prepare import prepare_images

SPEC = {TFRECORD_IMAGE_KEY: tf.io.FixedLenFeature([], tf.string, default_value=""),
        TFRECORD_LABEL_KEY: tf.io.FixedLenFeature([], tf.int64, default_value=-(10**9))}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, photo_folder):
    """20 tiny JPEGs in 2 classes prepared 6 a shard: 4 training shards of uneven length."""
    root = photo_folder(tmp_path_factory.mktemp("photos"), 20, (8, 19), name="{i:02d}.jpg")
    dst = tmp_path_factory.mktemp("prepared") / "dst"
    prepare_images(f"folder:{root}", dst, max_side=16, images_per_shard=6, workers=1, verbose=0)
    return dst


def _per_record(files, cycle_length, lo, hi, record_shard):
    """The reader before batched parsing: interleaved records, carved and sharded one by one, then
    `parse_single_example` of each (the order and examples the batched reader must keep)."""
    ds = tf.data.Dataset.from_tensor_slices(files).interleave(
        lambda f: tf.data.TFRecordDataset(f).map(lambda r: (r, f)), cycle_length=min(cycle_length, len(files)),
        block_length=1, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    if lo > 0.0 or hi < 1.0:
        ds = ds.filter(lambda r, f: tf.logical_and(_carve(r, 0) >= lo, _carve(r, 0) < hi))
    if record_shard is not None:
        ds = ds.shard(*record_shard)
    ex = ds.map(lambda r, f: (tf.io.parse_single_example(r, SPEC), f))
    return [(e[TFRECORD_IMAGE_KEY], int(e[TFRECORD_LABEL_KEY]) - 1, f) for e, f in ex.as_numpy_iterator()]


@pytest.mark.parametrize("cycle_length,shard", [(16, (2, 1)), (3, (5, 2))])
def test_batched_parse_yields_the_per_record_examples_in_order(prepared, monkeypatch, cycle_length, shard):
    monkeypatch.setattr(image_sources, "PARSE_BATCH", 3)  # groups that end mid-shard and mid-carve
    src = open_source(f"tfrecord:{prepared}", data_dir=None, num_classes=None, num_examples=None,
                      label_offset=None, cycle_length=cycle_length, input_context=None, val_fraction=0.3,
                      test_fraction=0.0, split_seed=0, seed=0)
    files = sorted(str(p) for p in prepared.glob("train-*"))
    assert len(files) == 4 and src.splits["train"].kind == "example"
    for split, (lo, hi) in {"train": (0.3, 1.0), "val": (0.0, 0.3)}.items():
        fl, record_shard = (files[shard[1]::shard[0]], None) if shard and shard[0] <= len(files) else (files, shard)
        want = _per_record(fl, cycle_length, lo, hi, record_shard)
        got = list(src.splits[split].make(shard, ordered=True).as_numpy_iterator())
        assert [(bytes(i), int(y), f.decode()) for i, y, f in got] == [(i, y, f.decode()) for i, y, f in want]
        assert want  # the carve leaves records in both splits
    assert src.splits["train"].count + src.splits["val"].count == 20


def test_a_record_that_is_not_an_example_is_flagged_in_its_place(tmp_path, monkeypatch):
    monkeypatch.setattr(image_sources, "PARSE_BATCH", 4)
    jpegs = [tf.io.encode_jpeg(np.full((4, 4, 3), i, np.uint8)).numpy() for i in range(6)]
    with tf.io.TFRecordWriter(str(tmp_path / "train-00000-of-00001")) as w:
        for i, jpeg in enumerate(jpegs):
            w.write(b"\xff\x00 not a proto" if i == 2 else tf.train.Example(features=tf.train.Features(feature={
                TFRECORD_IMAGE_KEY: tf.train.Feature(bytes_list=tf.train.BytesList(value=[jpeg])),
                TFRECORD_LABEL_KEY: tf.train.Feature(int64_list=tf.train.Int64List(value=[1 + i % 2]))})
            ).SerializeToString())
    src = open_source(f"tfrecord:{tmp_path}", data_dir=None, num_classes=2, num_examples=None, label_offset=None,
                      cycle_length=1, input_context=None, val_fraction=0.0, test_fraction=0.0, split_seed=0, seed=0)
    got = [(bytes(i), int(y)) for i, y, _ in src.splits["train"].make(None, ordered=True).as_numpy_iterator()]
    # The group holding it is parsed record by record: the others keep their place, it becomes an
    # empty image (the pipeline's check flags and counts it) instead of failing its whole group.
    assert got == [(j, i % 2) for i, j in enumerate(jpegs[:2])] + [(b"", -(10**9) - 1)] + [
        (j, i % 2) for i, j in enumerate(jpegs) if i > 2]
