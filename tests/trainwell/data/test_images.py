"""Image pipelines on tiny local fixtures: folders, TFRecords, mocked TFDS, embedded, synthetic."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from trainwell.data import DataError
from trainwell.data import image_ops
from trainwell.data.images import GRAY_MEAN, GRAY_STD, IMAGENET_MEAN, IMAGENET_STD, build_image_datasets
from trainwell.data.sources import check_image_folder, image_problem

CLASSES = ("ant", "bee", "cat")


def _jpeg(rng, h=32, w=36):
    return tf.io.encode_jpeg(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), quality=90).numpy()


def _png(rng, h=32, w=36):
    return tf.io.encode_png(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).numpy()


def _write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


@pytest.fixture(scope="module")
def flat_folder(tmp_path_factory):
    """3 classes x 8 images (6 JPEG + 2 PNG), plus one corrupt JPEG in class 'bee'."""
    root = tmp_path_factory.mktemp("flat")
    rng = np.random.default_rng(0)
    for c in CLASSES:
        for i in range(8):
            _write(str(root / c / f"{i}.{'png' if i < 2 else 'jpg'}"), _png(rng) if i < 2 else _jpeg(rng))
    _write(str(root / "bee" / "broken.jpg"), b"\xff\xd8\xff this is not a jpeg")
    _write(str(root / "bee" / "notes.txt"), b"ignored: not an image extension")
    return root


def _example(image_bytes, label):
    feature = {
        "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[image_bytes])),
        "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


@pytest.fixture(scope="module")
def tfrecord_dir(tmp_path_factory):
    """ImageNet layout: 3 train shards x 8, 2 validation shards x 6; labels 1-based (1..4).

    validation-00001 holds one truncated JPEG and one out-of-range label (5 with 4 classes).
    """
    root = tmp_path_factory.mktemp("tfrecords")
    rng = np.random.default_rng(1)
    k = 0
    for split, shards, per in (("train", 3, 8), ("validation", 2, 6)):
        for s in range(shards):
            with tf.io.TFRecordWriter(str(root / f"{split}-{s:05d}-of-{shards:05d}")) as w:
                for i in range(per):
                    data, label = _jpeg(rng), 1 + k % 4
                    if split == "validation" and s == 1 and i == 0:
                        data = data[:120]  # truncated
                    if split == "validation" and s == 1 and i == 1:
                        label = 5
                    w.write(_example(data, label))
                    k += 1
    return root


def _epoch(ds):
    xs, ys = [], []
    for x, y in ds:
        xs.append(x.numpy())
        ys.append(y.numpy())
    return np.concatenate(xs), np.concatenate(ys)


# ----------------------------------------------------------------------------- folder
def test_folder_flat_shapes_counts_and_corrupt_file_skipped(flat_folder):
    data = build_image_datasets(f"folder:{flat_folder}", 24, 5, augment="inception", val_fraction=0.0,
                                test_fraction=0.0, seed=1)
    assert data.val is None and data.test is None
    assert data.class_names == list(CLASSES) and data.num_classes == 3 and data.channels == 3
    assert data.counts["train"] == 25 and data.steps["train"] == 5  # the broken file is listed, .txt is not
    x, y = _epoch(data.train)
    # the 5 batches Keras is told: the 24 good images and one of the top-up for the broken one
    assert x.shape == (25, 24, 24, 3) and x.dtype == np.float32
    assert y.shape == (25, 3) and np.allclose(y.sum(axis=1), 1.0)
    assert data.skipped == {"train": 1, "val": 0, "test": 0}
    assert data.skipped_examples["train"] == [str(flat_folder / "bee" / "broken.jpg")]
    _epoch(data.train)  # second epoch: still one distinct skipped image
    assert data.skipped["train"] == 1 and data._skips.events()["train"] == 2
    # Normalised with ImageNet statistics: the range of (u8/255 - mean)/std.
    lo = (0 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    hi = (1 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    assert np.all(x >= lo - 1e-4) and np.all(x <= hi + 1e-4)


def test_folder_carved_splits_are_stratified_and_disjoint(flat_folder):
    data = build_image_datasets(f"folder:{flat_folder}", 24, 4, val_fraction=0.25, test_fraction=0.25, one_hot=False)
    # per class: 8 (bee 9) files -> round(8 * .25) = 2 (bee: round(2.25) = 2) to val and test each.
    assert data.counts == {"train": 13, "val": 6, "test": 6}
    assert data.steps == {"train": 3, "val": 2, "test": 2}
    _, yv = _epoch(data.val)
    _, yt = _epoch(data.test)
    assert yv.dtype == np.int32
    for y, split in ((yv, "val"), (yt, "test")):
        per_class = np.bincount(y, minlength=3)
        assert per_class.sum() + data.skipped[split] == 6 and per_class.min() >= 1 and per_class.max() == 2


def test_folder_train_val_layout_and_centre_crop(tmp_path):
    rng = np.random.default_rng(2)
    for split in ("train", "val"):
        for c in ("a", "b"):
            for i in range(3):
                # 40x40 PNG: a constant 35x35 centre (0.875 of 40) in a black frame. Offsets
                # as TF Model Garden: ((40 - 35) + 1) // 2 = 3 before, 2 after.
                img = np.zeros((40, 40, 3), np.uint8)
                img[3:38, 3:38] = (200, 100, 50)
                _write(str(tmp_path / split / c / f"{i}.png"), tf.io.encode_png(img).numpy())
    _write(str(tmp_path / "train" / "a" / "x.jpg"), _jpeg(rng))
    data = build_image_datasets(f"folder:{tmp_path}", 35, 2, eval_crop_fraction=0.875, val_fraction=0.3)
    # val folder exists and no test folder: the val folder is the test split, val carved from
    # train (round(4 * .3) + round(3 * .3) = 2).
    assert data.counts == {"train": 5, "val": 2, "test": 6}
    x, y = _epoch(data.test)
    want = (np.array([200, 100, 50]) / 255.0 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    assert x.shape == (6, 35, 35, 3)
    assert np.allclose(x, want.astype(np.float32), atol=1e-5)  # exact central 35x35 crop, no border
    assert y.argmax(axis=1).tolist() == [0, 0, 0, 1, 1, 1]


def test_inception_crop_of_constant_image_keeps_colour(tmp_path):
    for c in ("a", "b"):
        for i in range(4):
            img = np.full((48, 64, 3), (30, 160, 220), np.uint8)
            _write(str(tmp_path / c / f"{i}.jpg"), tf.io.encode_jpeg(img, quality=100).numpy())
    data = build_image_datasets(f"folder:{tmp_path}", 16, 8, augment="inception", val_fraction=0.0, test_fraction=0.0)
    x, _ = _epoch(data.train)
    want = (np.array([30, 160, 220]) / 255.0 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    assert np.allclose(x, want.astype(np.float32), atol=0.05)


def test_seeded_order_is_deterministic(flat_folder):
    def first_epoch(seed):
        d = build_image_datasets(f"folder:{flat_folder}", 24, 4, augment="inception", seed=seed,
                                 val_fraction=0.0, test_fraction=0.0)
        return _epoch(d.train), d

    (x1, y1), d1 = first_epoch(3)
    (x2, y2), _ = first_epoch(3)
    assert np.allclose(x1, x2) and np.array_equal(y1, y2)
    (x3, _), _ = first_epoch(4)
    assert not np.allclose(x1, x3)
    x1b, _ = _epoch(d1.train)  # next epoch: reshuffled and re-augmented
    assert not np.allclose(x1, x1b)


# ----------------------------------------------------------------------------- tfrecord
def test_tfrecord_imagenet_layout(tfrecord_dir, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    data = build_image_datasets(f"tfrecord:{tfrecord_dir}/*", 24, 4, num_classes=4, augment="inception", one_hot=False)
    # validation-* shards become the test split; val is carved from train by record hash.
    assert data.counts["test"] == 12
    assert data.counts["train"] + data.counts["val"] == 24 and data.counts["val"] >= 1
    xt, yt = _epoch(data.test)
    assert xt.shape == (10, 24, 24, 3)  # 12 minus a truncated JPEG and a label out of range
    assert data.skipped["test"] == 2
    assert all(k.startswith(str(tfrecord_dir / "validation-00001-of-00002#")) for k in data.skipped_examples["test"])
    assert set(yt.tolist()) <= {0, 1, 2, 3}  # 1-based labels shifted
    xs, ys = _epoch(data.train)
    assert len(ys) == (data.counts["train"] // 4) * 4 and data.skipped["train"] == 0
    # One worker: DATA (harmless); the last-resort ignore_errors stays in the pipeline.
    assert data.train.options().experimental_distribute.auto_shard_policy == tf.data.experimental.AutoShardPolicy.DATA


def test_tfrecord_pipeline_survives_file_autosharding(tmp_path, monkeypatch):
    try:
        from tensorflow.python.data.experimental.ops.distribute import _AutoShardDataset
    except ImportError:  # pragma: no cover
        pytest.skip("tf.data auto-shard internals moved")
    rng = np.random.default_rng(3)
    for s in range(3):  # file s holds only class s (label s + 1)
        with tf.io.TFRecordWriter(str(tmp_path / f"train-{s:05d}-of-00003")) as w:
            for _ in range(4):
                w.write(_example(_jpeg(rng), s + 1))
    cluster = {"cluster": {"worker": ["localhost:1", "localhost:2", "localhost:3"]}, "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(cluster))
    data = build_image_datasets(f"tfrecord:{tmp_path}", 24, 1, num_classes=3, val_fraction=0.0,
                                test_fraction=0.0, one_hot=False)
    assert data.counts["train"] == 12
    assert data.train.options().experimental_distribute.auto_shard_policy == tf.data.experimental.AutoShardPolicy.FILE
    # Each worker's share is unknown: an endless stream, and Keras counts each epoch's steps.
    assert data.train.cardinality() == tf.data.INFINITE_CARDINALITY
    seen = []
    for i in range(3):
        labels = [int(y[0]) for _, y in _AutoShardDataset(data.train, 3, i, num_replicas=1).take(8)]
        assert len(labels) == 8 and len(set(labels)) == 1  # one whole file per worker (DATA would mix)
        seen.append(labels[0])
    assert sorted(seen) == [0, 1, 2]


def test_input_context_shards_and_batches_per_replica(flat_folder):
    full = build_image_datasets(f"folder:{flat_folder}", 24, 4, val_fraction=0.0, test_fraction=0.25)
    xf, _ = _epoch(full.test)
    parts = []
    for i in range(2):
        ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=i, num_replicas_in_sync=2)
        d = build_image_datasets(f"folder:{flat_folder}", 24, 4, val_fraction=0.0, test_fraction=0.25,
                                 input_context=ctx)
        assert d.batch_size == 2 and d.global_batch_size == 4
        assert d.train.options().experimental_distribute.auto_shard_policy == tf.data.experimental.AutoShardPolicy.OFF
        xb, _ = next(iter(d.train))
        assert xb.shape[0] == 2
        parts.append(_epoch(d.test)[0])
    assert len(parts[0]) + len(parts[1]) == len(xf)
    both = np.concatenate(parts).reshape(len(xf), -1)
    assert sorted(map(bytes, both.round(4))) == sorted(map(bytes, xf.reshape(len(xf), -1).round(4)))


def test_cache_keeps_encoded_images_after_files_are_gone(flat_folder, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(flat_folder, copy)
    data = build_image_datasets(f"folder:{copy}", 24, 4, val_fraction=0.0, test_fraction=0.0, cache=True)
    n1 = len(_epoch(data.train)[1])
    shutil.rmtree(copy)  # epoch 2 must come from the in-memory cache
    n2 = len(_epoch(data.train)[1])
    assert n1 == n2 == 24
    # broken.jpg is readable (cached) but not decodable: skipped again, still one image.
    assert data.skipped["train"] == 1 and data._skips.events()["train"] == 2


# ----------------------------------------------------------------------------- tfds
def test_tfds_mock_mnist_and_cifar10():
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=20):
        data = build_image_datasets("tfds:mnist", 24, 8)
        assert data.channels == 1 and data.num_classes == 10 and data.augment == "pad_crop"
        assert data.mean == GRAY_MEAN and data.std == GRAY_STD
        x, y = next(iter(data.train))
        assert x.shape == (8, 24, 24, 1) and y.shape == (8, 10)
        assert sum(1 for _ in data.test.unbatch()) == 20  # the test split
        assert data.val is not None  # carved from train (train[..%])
        cifar = build_image_datasets("tfds:cifar10", 32, 4, val_fraction=0.0)
        assert cifar.channels == 3 and cifar.augment == "pad_crop_flip" and cifar.val is None
        xc, _ = next(iter(cifar.train))
        assert xc.shape == (4, 32, 32, 3)
        imagenette = build_image_datasets("tfds:imagenette", 96, 4, val_fraction=0.0)
        assert imagenette.augment == "inception"  # > 64 px
        assert next(iter(imagenette.test))[0].shape == (4, 96, 96, 3)  # validation used as test


def test_tfds_not_prepared_and_unknown(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        build_image_datasets("tfds:mnist", 24, 8, data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="no_such_dataset_xyz"):
        build_image_datasets("tfds:no_such_dataset_xyz", 24, 8, data_dir=str(tmp_path))


# ----------------------------------------------------------------------------- embedded, synthetic
def test_embedded_mnist5k_matches_arrays():
    from trainwell.data import embedded

    data = build_image_datasets("mnist5k", 28, 100, seed=0)
    assert data.counts == {"train": 3500, "val": 500, "test": 1000}
    assert data.steps == {"train": 35, "val": 5, "test": 10}
    assert data.augment == "pad_crop" and data.channels == 1
    x, y = next(iter(data.test))
    raw = embedded.load("mnist5k").test
    want = (raw[0][:100].astype(np.float32) / 255.0 - GRAY_MEAN[0]) / GRAY_STD[0]
    assert np.allclose(x.numpy(), want, atol=1e-5)
    assert np.array_equal(y.numpy().argmax(1), raw[1][:100])
    xt, yt = next(iter(data.train))
    assert xt.shape == (100, 28, 28, 1) and yt.shape == (100, 10)


def test_embedded_digits_resized():
    data = build_image_datasets("digits", 16, 64, one_hot=False)
    assert data.counts["train"] + data.counts["val"] + data.counts["test"] == 1797
    x, y = next(iter(data.train))
    assert x.shape == (64, 16, 16, 1) and y.dtype == tf.int32


def test_pad_crop_never_flips_but_pad_crop_flip_does():
    image = np.zeros((16, 16, 1), np.uint8)
    image[:, :6] = 255  # bright left side
    kw = dict(image_size=16, channels=1, eval_crop_fraction=1.0, mean=(0.0,), std=(1.0,), num_classes=2, one_hot=False)
    left_brighter = {}
    for policy in ("pad_crop", "pad_crop_flip"):
        t = image_ops.Transform(augment=policy, **kw)
        sides = []
        for s in range(24):
            out = t.train_image(tf.constant(image), tf.constant([s, 7], tf.int64), encoded=False).numpy()
            sides.append(out[:, :8].mean() > out[:, 8:].mean())
        left_brighter[policy] = sides
    assert all(left_brighter["pad_crop"])
    assert 0 < sum(left_brighter["pad_crop_flip"]) < 24


def test_synthetic():
    data = build_image_datasets("synthetic", 32, 8, synthetic_examples=(40, 10), num_classes=7)
    assert data.steps == {"train": 5, "val": 0, "test": 2} and data.val is None
    batches = list(data.train)
    assert len(batches) == 5
    x, y = batches[0]
    assert x.shape == (8, 32, 32, 3) and y.shape == (8, 7)
    assert np.allclose(batches[0][0].numpy(), batches[4][0].numpy())  # one batch, repeated
    assert abs(float(np.std(x.numpy())) - 1.0) < 0.05


# ----------------------------------------------------------------------------- errors
def test_missing_and_empty_sources(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        build_image_datasets(f"folder:{missing}", 24, 4)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=str(empty)):
        build_image_datasets(f"folder:{empty}", 24, 4)
    (empty / "cls").mkdir()
    _write(str(empty / "cls" / "readme.txt"), b"x")
    with pytest.raises(ValueError, match="Empty image folder"):
        build_image_datasets(f"folder:{empty}", 24, 4)
    with pytest.raises(FileNotFoundError, match="train-\\*"):
        build_image_datasets(f"tfrecord:{tmp_path}/train-*", 24, 4)
    with pytest.raises(ValueError, match="Received: source='imagenet'"):
        build_image_datasets("imagenet", 24, 4)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"image_size": 0}, "image_size=0"),
        ({"global_batch_size": -1}, "global_batch_size=-1"),
        ({"augment": "randaugment"}, "augment='randaugment'"),
        ({"val_fraction": 1.0}, "val_fraction=1.0"),
        ({"val_fraction": 0.6, "test_fraction": 0.5}, "test_fraction=0.5"),
        ({"eval_crop_fraction": 0.0}, "eval_crop_fraction=0.0"),
        ({"shuffle_buffer": True}, "shuffle_buffer=True"),  # a bool is not a count
        ({"num_classes": True}, "num_classes=True"),
    ],
)
def test_invalid_arguments(kwargs, match):
    args = {"source": "digits", "image_size": 8, "global_batch_size": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        build_image_datasets(**args)


def test_structural_check_catches_truncated_and_non_images(tmp_path):
    rng = np.random.default_rng(4)
    img = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)
    jpeg, png = tf.io.encode_jpeg(img).numpy(), tf.io.encode_png(img).numpy()
    cases = {
        "jpeg": (jpeg, True), "jpeg with trailing zeros": (jpeg + b"\0" * 50, True),
        "truncated jpeg": (jpeg[:-300], False), "png": (png, True), "truncated png": (png[:-20], False),
        "empty": (b"", False), "html": (b"<html>404 not found</html>", False), "gif": (b"GIF89a...;", True),
        "one byte": (b"\xff", False),
    }
    check = tf.function(image_ops.valid_image)
    got = {k: bool(check(tf.constant(v))) for k, (v, _) in cases.items()}
    assert got == {k: want for k, (_, want) in cases.items()}
    # The Python mirror that checks folders when a config is built agrees with the in-graph check.
    files = {}
    for k, (v, _) in cases.items():
        files[k] = _write(str(tmp_path / k.replace(" ", "_")), v)
    assert {k: image_problem(f) is None for k, f in files.items()} == got


def test_one_class_and_all_corrupt_folders_are_refused_with_the_counts(tmp_path):
    rng = np.random.default_rng(6)
    one = tmp_path / "one"
    for i in range(3):
        _write(str(one / "cat" / f"{i}.jpg"), _jpeg(rng))
    (one / "dog").mkdir()  # no images: not a class
    with pytest.raises(DataError, match=r"has images of only 1 class \('cat', 3 images\): a classifier needs at least 2"):
        build_image_datasets(f"folder:{one}", 16, 2)
    bad = tmp_path / "bad"
    for c in ("cat", "dog"):
        _write(str(bad / c / "a.jpg"), _jpeg(rng)[:-100])  # truncated
        _write(str(bad / c / "b.png"), b"<html>Not Found</html>")
    with pytest.raises(DataError, match=r"Nothing to train on: all 4 images of the image folder '.*bad' are corrupt"):
        build_image_datasets(f"folder:{bad}", 16, 2)
    _write(str(bad / "dog" / "c.jpg"), _jpeg(rng))  # one readable image is enough to go on (the rest is skipped)
    check_image_folder(bad)


def test_a_file_name_that_is_not_utf8_is_read(tmp_path):
    rng = np.random.default_rng(7)
    for c in ("a", "b"):
        for i in range(2):
            _write(str(tmp_path / c / f"{i}.jpg"), _jpeg(rng))
    latin1_name = os.path.join(os.fsencode(tmp_path / "a"), b"caf\xe9.jpg")  # not valid UTF-8
    with open(latin1_name, "wb") as f:
        f.write(_jpeg(rng))
    data = build_image_datasets(f"folder:{tmp_path}", 16, 1, val_fraction=0.0, test_fraction=0.0)
    x, _ = _epoch(data.train)
    assert data.counts["train"] == 5 and len(x) == 5 and data.skipped["train"] == 0


def test_undecodable_image_passing_the_check_is_dropped_not_fatal(tmp_path):
    rng = np.random.default_rng(5)
    for c in ("a", "b"):
        for i in range(3):
            _write(str(tmp_path / c / f"{i}.jpg"), _jpeg(rng))
    # Right signature and end marker, garbage in between: only the decoder can tell.
    _write(str(tmp_path / "a" / "garbled.jpg"), b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4 + b"\xff\xd9")
    os.symlink(str(tmp_path / "missing.jpg"), str(tmp_path / "b" / "dangling.jpg"))
    data = build_image_datasets(f"folder:{tmp_path}", 16, 1, val_fraction=0.0, test_fraction=0.0)
    assert data.counts["train"] == 7  # 6 good + garbled; the dangling link is skipped at listing
    assert data.skipped["train"] == 1 and data.skipped_examples["train"] == [str(tmp_path / "b" / "dangling.jpg")]
    x, _ = _epoch(data.train)
    # the garbled file is dropped by the ignore_errors safety net, and the epoch topped up to its 7 batches
    assert len(x) == 7 and len({a.tobytes() for a in x.round(4)}) <= 7


def test_an_evaluation_split_states_the_batches_of_its_readable_images(tmp_path):
    rng = np.random.default_rng(6)
    for split, per in (("train", 4), ("val", 2)):
        for c in ("a", "b"):
            for i in range(per):
                _write(str(tmp_path / split / c / f"{i}.jpg"), _jpeg(rng, 8, 8))
    # 6 listed in val/ (the test split), 2 batches of 4; 4 read and decode: 1 batch. The garbled
    # file passes the structural check: only the decoder rejects it.
    _write(str(tmp_path / "val" / "a" / "garbled.jpg"), b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4 + b"\xff\xd9")
    _write(str(tmp_path / "val" / "b" / "truncated.jpg"), _jpeg(rng, 8, 8)[:60])
    data = build_image_datasets(f"folder:{tmp_path}", 8, 4, val_fraction=0.0)
    assert data.counts["test"] == 6 and data.steps["test"] == 1
    assert data.test.cardinality() == 1 and [len(y) for _, y in data.test] == [4]
    assert data.skipped["test"] == 1  # the truncated file, flagged by the check (already at the count)
    # The last two batches share the remainder: 2 + 2, not 3 + 1.
    assert [len(y) for _, y in build_image_datasets(f"folder:{tmp_path}", 8, 3, val_fraction=0.0).test] == [2, 2]


def test_no_evaluation_batch_is_left_smaller_than_half_a_batch():
    # A last batch of 1 leaves the second of 2 replicas an empty batch, which TensorFlow's oneDNN
    # convolutions reject ("input depth must be evenly divisible by filter depth").
    data = build_image_datasets("digits", 8, 89)  # 179 val and 359 test images: 1 and 3 left over
    for split in ("val", "test"):
        ds = getattr(data, split)
        sizes = [len(y) for _, y in ds]
        assert sum(sizes) == data.counts[split] and len(sizes) == data.steps[split] == ds.cardinality()
        assert sizes[:-2] == [89] * (len(sizes) - 2) and min(sizes) >= 89 // 2, sizes


def test_datasets_feed_keras_fit():
    import keras

    keras.utils.set_random_seed(0)
    data = build_image_datasets("digits", 8, 64)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.CategoricalCrossentropy(label_smoothing=0.1),
                  metrics=["accuracy"])
    hist = model.fit(data.train, validation_data=data.val, epochs=3, verbose=0)
    assert len(hist.history["loss"]) == 3 and hist.history["loss"][-1] < hist.history["loss"][0]
    assert hist.history["val_accuracy"][-1] > 0.5  # 10 classes: well above chance after 3 epochs


@pytest.mark.slow
def test_distribute_datasets_from_function_mirrored_cpu2(python_subprocess):
    result = python_subprocess(
        """
        import json, keras
        from trainwell import runtime
        strategy = runtime.make_strategy("cpu:2")
        from trainwell.data.images import build_image_datasets
        seen = []
        def dataset_fn(ctx):
            data = build_image_datasets("digits", 8, 32, input_context=ctx)
            seen.append((ctx.num_replicas_in_sync, data.batch_size))
            return data.train
        ds = strategy.distribute_datasets_from_function(dataset_fn)
        with strategy.scope():
            model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(10, activation="softmax")])
            model.compile(optimizer="sgd", loss="categorical_crossentropy")
        hist = model.fit(ds, epochs=1, steps_per_epoch=5, verbose=0)
        print(json.dumps({"seen": seen, "loss": hist.history["loss"][0]}))
        """,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["seen"] == [[2, 16]]  # 2 replicas in sync, per-replica batch 32 / 2
    assert np.isfinite(out["loss"])


def test_crop_padding_sets_the_shift_range():
    from trainwell.data.images import build_image_datasets as build

    # zero padding: the pad-and-crop augmentation is the identity, so train images equal eval images
    d = build("digits", image_size=8, global_batch_size=256, augment="pad_crop", crop_padding=0, val_fraction=0.0,
              seed=1)
    e = build("digits", image_size=8, global_batch_size=256, augment="none", val_fraction=0.0, seed=1)
    (xd, yd), (xe, ye) = next(iter(d.train)), next(iter(e.train))
    np.testing.assert_allclose(np.asarray(xd), np.asarray(xe))
    s = build("digits", image_size=8, global_batch_size=256, augment="pad_crop", crop_padding=3, val_fraction=0.0, seed=1)
    assert not np.allclose(np.asarray(next(iter(s.train))[0]), np.asarray(xe))
    with pytest.raises(ValueError, match="Received: crop_padding=-1"):
        build("digits", image_size=8, global_batch_size=32, crop_padding=-1)


# ----------------------------------------------------------------------------- batches per epoch
def _layout(root, rng, corrupt: bool):
    """train/: 3 classes x 15 JPEGs of 8x8 (+ 4 corrupt: 49 listed, 3 batches of 16, 45 readable);
    val/ (the test split): 3 x 3 (+ 8 corrupt: 17 listed, 2 batches of 16, 9 readable: one)."""
    for split, per, bad in (("train", 15, 4), ("val", 3, 8)):
        for c in CLASSES:
            for i in range(per):
                _write(str(root / split / c / f"{i}.jpg"), _jpeg(rng, 8, 8))
        for i in range(bad if corrupt else 0):
            _write(str(root / split / CLASSES[i % 3] / f"bad{i}.jpg"), b"\xff\xd8\xff truncated %d" % i)
    return root


def _as_tfrecords(folder, out):
    """The same images as TFRecords: 2 train and 2 validation files (1-based labels)."""
    out.mkdir()
    for split, prefix in (("train", "train"), ("val", "validation")):
        paths = sorted((folder / split).glob("*/*.jpg"))
        for s in range(2):
            with tf.io.TFRecordWriter(str(out / f"{prefix}-{s:05d}-of-00002")) as w:
                for p in paths[s::2]:
                    w.write(_example(p.read_bytes(), 1 + CLASSES.index(p.parent.name)))
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["clean", "corrupt"])
def layouts(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("layout")
    folder = _layout(root / "folder", np.random.default_rng(7), corrupt=request.param)
    return {"folder": f"folder:{folder}", "tfrecord": f"tfrecord:{_as_tfrecords(folder, root / 'tfrecords')}",
            "corrupt": request.param}


def _fit_counting(data, epochs=3):
    """Fits a tiny model as the recipe does (Keras told `steps_per_epoch`, the test split as
    validation data); returns the batches each epoch trained and evaluated, the warnings of `fit`
    and of the test split's evaluation, the history and the test metrics."""
    import warnings

    import keras

    class Count(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.train, self.eval = [], []

        def on_epoch_begin(self, epoch, logs=None):
            self.train.append(0)
            self.eval.append(0)

        def on_train_batch_begin(self, batch, logs=None):
            self.train[-1] += 1

        def on_test_batch_begin(self, batch, logs=None):
            self.eval[-1] += 1

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 8, data.channels)), keras.layers.Flatten(),
                              keras.layers.Dense(data.num_classes, activation="softmax")])
    model.compile(optimizer="sgd", loss="categorical_crossentropy", weighted_metrics=["accuracy"])
    count = Count()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hist = model.fit(data.train, validation_data=data.test, epochs=epochs, steps_per_epoch=data.steps["train"],
                         callbacks=[count], verbose=0)
        test = model.evaluate(data.test, verbose=0, return_dict=True)
    return count, [str(w.message) for w in caught], hist.history, test


@pytest.mark.parametrize("kind", ["folder", "tfrecord"])
def test_every_epoch_trains_and_evaluates_the_batches_keras_is_told(layouts, kind):
    # Before: a filtered pipeline (corrupt images dropped) had no known length, so Keras kept one
    # iterator over the epochs: epoch 2 found it empty ("Your input ran out of data", a loss of 0).
    data = build_image_datasets(layouts[kind], 8, 16, val_fraction=0.0, num_classes=3, label_offset=1)
    corrupt = layouts["corrupt"]
    assert data.counts == {"train": 49 if corrupt else 45, "val": 0, "test": 17 if corrupt else 9}
    # The test split scores its 9 readable images: 1 batch, also when 17 are listed (2 batches of 16).
    assert data.steps == {"train": 3 if corrupt else 2, "val": 0, "test": 1}
    assert data.train.cardinality() == data.steps["train"]  # Keras knows the length: a new iterator each epoch
    assert [sum(1 for _ in data.train) for _ in range(2)] == [data.steps["train"]] * 2
    # Each readable example of the test split is scored once, in the batches its length states.
    assert data.test.cardinality() == 1 and [len(y) for _, y in data.test] == [9]
    count, caught, history, test = _fit_counting(data)
    assert count.train == [data.steps["train"]] * 3 and count.eval == [data.steps["test"]] * 3
    assert not [w for w in caught if "ran out of data" in w], caught
    assert all(v > 0 for v in history["loss"]) and np.isfinite(test["loss"]) and 0 <= test["accuracy"] <= 1
    assert data.skipped["train"] == (4 if corrupt else 0)


def test_the_top_up_keeps_the_epoch_order_seeded_and_independent_of_read_ahead(layouts):
    if not layouts["corrupt"]:
        pytest.skip("the top-up completes epochs short of images")
    first = build_image_datasets(layouts["folder"], 8, 16, val_fraction=0.0, seed=3)
    again = build_image_datasets(layouts["folder"], 8, 16, val_fraction=0.0, seed=3)
    # Epoch k of a fresh pipeline is epoch k of the first: the top-up draws from no seed generator,
    # so how far the pipeline read ahead into it does not move later epochs.
    e1 = [_epoch(first.train)[0] for _ in range(3)]
    e2 = [_epoch(again.train)[0] for _ in range(3)]
    assert all(a.shape == (48, 8, 8, 3) for a in e1)
    assert all(np.array_equal(a, b) for a, b in zip(e1, e2)) and not np.array_equal(e1[0], e1[1])
    skipped = first._skips.events()["train"]
    assert skipped == 3 * 4  # the top-up's own reads of the corrupt files are not counted again


def test_each_input_pipeline_yields_the_same_batches(layouts):
    # input_context: 2 pipelines x 1 replica; each yields the batches of a global step, whatever its share.
    full = build_image_datasets(layouts["folder"], 8, 16, val_fraction=0.0)
    seen = []
    for i in range(2):
        ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=i, num_replicas_in_sync=2)
        d = build_image_datasets(layouts["folder"], 8, 16, val_fraction=0.0, input_context=ctx)
        assert d.batch_size == 8
        assert d.train.cardinality() == full.steps["train"] and sum(1 for _ in d.train) == full.steps["train"]
        seen.append(_epoch(d.test)[0])
    both = np.concatenate(seen)
    assert len(both) == len(_epoch(full.test)[0])  # every readable test image once, over both pipelines


def test_embedded_sources_state_their_length():
    # (TFDS records take the TFRecords' path: `_Split` of kind "bytes", with the count of the split's metadata.)
    digits = build_image_datasets("digits", 8, 100)
    for split in ("train", "val", "test"):
        ds = getattr(digits, split)
        assert ds.cardinality() == digits.steps[split] and sum(1 for _ in ds) == digits.steps[split]


@pytest.mark.slow
def test_two_replicas_train_every_epoch_of_a_folder_with_corrupt_images(python_subprocess, tmp_path):
    folder = _layout(tmp_path, np.random.default_rng(8), corrupt=True)
    result = python_subprocess(
        f"""
        import json, warnings, keras
        from trainwell import runtime
        strategy = runtime.make_strategy("cpu:2")
        from trainwell.data.images import build_image_datasets
        data = build_image_datasets("folder:{folder}", 8, 16, val_fraction=0.0)
        counts = []
        class Count(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                counts.append(0)
            def on_train_batch_begin(self, batch, logs=None):
                counts[-1] += 1
        with strategy.scope():
            model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Flatten(),
                                      keras.layers.Dense(3, activation="softmax")])
            model.compile(optimizer="sgd", loss="categorical_crossentropy", weighted_metrics=["accuracy"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hist = model.fit(data.train, epochs=3, steps_per_epoch=data.steps["train"], callbacks=[Count()], verbose=0)
            test = model.evaluate(data.test, verbose=0, return_dict=True)
        print(json.dumps({{"steps": data.steps["train"], "counts": counts, "loss": hist.history["loss"],
                          "val_loss": [test["loss"]], "warnings": [str(w.message) for w in caught]}}))
        """,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["steps"] == 3 and out["counts"] == [3, 3, 3]
    assert not [w for w in out["warnings"] if "ran out of data" in w], out["warnings"]
    assert all(v > 0 for v in out["loss"]) and all(np.isfinite(out["val_loss"]))


def test_a_file_that_is_not_tfrecords_is_one_line_naming_it(tmp_path, tfrecord_dir):
    import shutil

    for f in tfrecord_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "train-00009-of-00009").write_bytes(np.random.default_rng(0).bytes(5000))  # random bytes
    with pytest.raises(DataError) as info:
        build_image_datasets(f"tfrecord:{tmp_path}", 8, 4)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("Not a TFRecord file, or a damaged one:")
    assert repr(str(tmp_path / "train-00009-of-00009")) in msg and "corrupted record at 0" in msg
