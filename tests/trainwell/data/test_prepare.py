"""Prepared image shards (`trainwell.data.prepare`, `trainwell prepare-images`) on a folder of tiny JPEGs."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from trainwell import cli
from trainwell.data import DataError
from trainwell.data import prepare
from trainwell.data.prepare import prepare_images, verify_prepared
from trainwell.recipes import resnet_imagenet

MAX_SIDE = 24
SPEC = {"image/encoded": tf.io.FixedLenFeature([], tf.string), "image/class/label": tf.io.FixedLenFeature([], tf.int64)}


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """train/: 20 JPEGs in 2 classes, shorter sides 12-47 px (about half above MAX_SIDE), and one corrupt
    file; val/: one 40x30 JPEG per class (the source's held-out split)."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for i in range(20):
        h, w = int(rng.integers(12, 48)), int(rng.integers(12, 48))
        (root / "train" / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        data = tf.io.encode_jpeg(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), quality=90).numpy()
        (root / "train" / f"c{i % 2}" / f"{i:02d}.jpg").write_bytes(data)
    (root / "train" / "c1" / "broken.jpg").write_bytes(b"<html>not found</html>")
    for c in ("c0", "c1"):
        (root / "val" / c).mkdir(parents=True)
        image = rng.integers(0, 256, (40, 30, 3), dtype=np.uint8)
        (root / "val" / c / "v.jpg").write_bytes(tf.io.encode_jpeg(image).numpy())
    return root


@pytest.fixture(scope="module")
def prepared(photos, tmp_path_factory):
    lines = []
    dst = tmp_path_factory.mktemp("prepared") / "dst"
    result = prepare_images(f"folder:{photos}", dst, max_side=MAX_SIDE, images_per_shard=6, verbose=0,
                            log=lines.append)
    return result, lines


def _records(directory, prefix="train-"):
    out = []
    for name in sorted(n for n in os.listdir(directory) if n.startswith(prefix)):
        for r in tf.data.TFRecordDataset(os.path.join(directory, name)):
            ex = tf.io.parse_single_example(r, SPEC)
            out.append((ex["image/encoded"].numpy(), int(ex["image/class/label"])))
    return out


def test_resize_semantics_index_and_skipped_file(photos, prepared):
    result, lines = prepared
    assert (result.count, result.skipped, result.shards) == (20, 1, 5)  # 21 files, 6 a shard; 1 held-out shard
    assert [line for line in lines if line.startswith("skipped:")] == [
        f"skipped: {photos / 'train' / 'c1' / 'broken.jpg'} (not an image, truncated, or a label out of range)"]
    sources = {p.read_bytes(): p for p in (photos / "train").rglob("*.jpg") if p.name != "broken.jpg"}
    records = _records(result.directory)
    assert len(records) == 20
    copied = resized = 0
    for data, label in records:
        h, w, _ = tf.image.extract_jpeg_shape(data).numpy()
        assert min(h, w) <= MAX_SIDE
        if data in sources:  # small enough: the source's bytes, untouched
            assert min(tf.image.extract_jpeg_shape(data).numpy()[:2]) <= MAX_SIDE
            assert label == 1 + int(sources[data].parent.name[1])  # 1-based, as ImageNet's TFRecords
            copied += 1
        else:  # larger: shorter side exactly MAX_SIDE, never below
            assert min(h, w) == MAX_SIDE
            resized += 1
    assert copied >= 5 and resized >= 5
    with open(os.path.join(result.directory, "index.json")) as f:
        index = json.load(f)
    assert index["class_names"] == ["c0", "c1"] and index["max_side"] == MAX_SIDE and index["skipped"] == 1
    assert [s["name"] for s in index["shards"]] == [f"train-{k:05d}-of-00004" for k in range(4)] + [
        "test-00000-of-00001"]  # the source's val/ is its held-out test split: it keeps that role
    assert index["counts"] == {"train": 20, "test": 2}
    assert [min(tf.image.extract_jpeg_shape(d).numpy()[:2]) for d, _ in _records(result.directory, "test-")] == [24, 24]
    assert sum(s["count"] for s in index["shards"]) == 22
    assert not os.path.exists(os.path.join(result.directory, ".partial"))


def test_the_recipe_reads_prepared_shards_with_their_classes(prepared):
    cfg = resnet_imagenet.Config(dataset=f"tfrecord:{prepared[0].directory}", image_size=16, batch_size=4,
                                 augment="inception", model="resnet18", width=4)
    data = resnet_imagenet.build_data(cfg)
    assert data.class_names == ["c0", "c1"] and data.num_classes == 2 and data.augment == "inception"
    # val carved from train as from the source; test: the held-out split
    assert data.counts["train"] + data.counts["val"] == 20 and data.counts["test"] == 2
    images, labels = next(iter(data.train))
    assert images.shape == (4, 16, 16, 3) and labels.shape == (4, 2)


@pytest.mark.slow  # a whole recipe run (~25 s on 2 busy cores); the fast test above checks its data
def test_the_recipe_trains_an_epoch_from_prepared_shards(prepared, tmp_path):
    run = resnet_imagenet.train(dataset=f"tfrecord:{prepared[0].directory}", epochs=1, model="resnet18", width=4,
                                image_size=16, batch_size=4, augment="inception", doctor=False, verbose=0,
                                jit_compile=False, run_dir=str(tmp_path / "run"))
    assert run.model.output_shape == (None, 2) and int(run.model.optimizer.iterations) >= 2
    assert np.isfinite(run.metrics["test_loss"])


def test_tfrecord_and_tfds_sources(prepared, tmp_path):
    # A prepared folder is a TFRecord source like any other: its classes and held-out split carry over.
    again = prepare_images(prepared[0].directory, tmp_path / "smaller", max_side=12, verbose=0)
    assert again.index["source"].startswith("tfrecord:") and again.index["class_names"] == ["c0", "c1"]
    assert again.index["counts"] == {"train": 20, "test": 2}
    assert max(min(tf.image.extract_jpeg_shape(d).numpy()[:2]) for d, _ in _records(tmp_path / "smaller")) <= 12
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=5):
        cifar = prepare_images("tfds:cifar10", tmp_path / "cifar", max_side=16, verbose=0)
    assert cifar.index["counts"] == {"train": 5, "test": 5} and len(cifar.index["class_names"]) == 10
    assert {tuple(tf.image.extract_jpeg_shape(d).numpy()) for d, _ in _records(tmp_path / "cifar")} == {(16, 16, 3)}


def test_a_changed_shard_fails_verification(prepared, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(prepared[0].directory, dst)
    assert verify_prepared(dst)["count"] == 20
    shard = dst / "train-00002-of-00004"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="train-00002-of-00004.*checksum"):
        verify_prepared(dst)


CHILD = textwrap.dedent("""
    import sys, time
    from trainwell.data import prepare
    write = prepare._Writer.write
    def slow_write(self, record):  # stops for good in the middle of the second shard
        write(self, record)
        if self.current == 1 and self.written == 2:
            self.file.flush(); print("mid-shard", flush=True); time.sleep(120)
    prepare._Writer.write = slow_write
    prepare.prepare_images(sys.argv[1], sys.argv[2], max_side=24, images_per_shard=6, verbose=0)
""")


def _resume_and_compare(photos, prepared, dst):
    """Reruns the preparation in `dst` after a run that died in the second shard: the first is kept."""
    assert (dst / "train-00000-of-00004").is_file() and (dst / ".partial" / "train-00001-of-00004").is_file()
    assert not (dst / "index.json").exists()
    with pytest.raises(DataError, match="no index.json"):
        verify_prepared(dst)
    lines = []
    result = prepare_images(f"folder:{photos}", dst, max_side=MAX_SIDE, images_per_shard=6, verbose=0,
                            log=lines.append)
    assert result.reused == 1 and lines[0].startswith("resuming: 1 of 5 shards")
    assert (result.count, result.skipped) == (20, 1)
    # The same bytes as an uninterrupted run, shard for shard.
    for name in [f"train-{k:05d}-of-00004" for k in range(4)] + ["test-00000-of-00001"]:
        assert (dst / name).read_bytes() == open(os.path.join(prepared[0].directory, name), "rb").read()
    assert verify_prepared(dst)["count"] == 20


def test_a_failed_preparation_resumes_and_verifies(photos, prepared, tmp_path, monkeypatch):
    write = prepare._Writer.write

    def failing_write(self, record):  # dies in the middle of the second shard
        write(self, record)
        if self.current == 1 and self.written == 2:
            self.file.flush()
            raise OSError("injected: the disk went away")

    monkeypatch.setattr(prepare._Writer, "write", failing_write)
    with pytest.raises(OSError, match="injected"):
        prepare_images(f"folder:{photos}", tmp_path / "failed", max_side=MAX_SIDE, images_per_shard=6, verbose=0)
    monkeypatch.undo()
    _resume_and_compare(photos, prepared, tmp_path / "failed")


@pytest.mark.slow  # a real SIGKILL (no Python cleanup runs) costs a TensorFlow import in a child: ~10 s
def test_a_killed_preparation_resumes_and_verifies(photos, prepared, tmp_path):
    dst = tmp_path / "killed"
    child = subprocess.Popen([sys.executable, "-c", CHILD, f"folder:{photos}", str(dst)], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        assert child.stdout.readline().strip() == "mid-shard"
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    _resume_and_compare(photos, prepared, dst)


def test_a_complete_folder_is_kept_and_another_plan_refused(photos, prepared):
    os.makedirs(os.path.join(prepared[0].directory, ".partial"))  # as a kill after the index was written leaves it
    again = prepare_images(f"folder:{photos}", prepared[0].directory, max_side=MAX_SIDE, images_per_shard=6,
                           verbose=0)
    assert again.reused == again.shards == 5 and not os.path.exists(os.path.join(again.directory, ".partial"))
    with pytest.raises(DataError, match="other arguments"):
        prepare_images(f"folder:{photos}", prepared[0].directory, max_side=32, images_per_shard=6, verbose=0)


@pytest.mark.parametrize("argv, received", [
    (["--max-side", "0"], "Received: max_side=0"),
    (["--quality", "101"], "Received: quality=101"),
])
def test_cli_bad_input_is_one_line_and_exit_2(photos, tmp_path, capsys, argv, received):
    assert cli.main(["prepare-images", str(photos), str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and received in err[0] and err[0].startswith("trainwell: error:")


def test_cli_missing_source(tmp_path, capsys):
    assert cli.main(["prepare-images", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Received: src=" in err[0]
