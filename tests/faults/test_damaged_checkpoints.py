"""Fault injection: damaged checkpoints and a tampered index never block, skew or escape a resume.

One tiny run (a 4-epoch Dense model on a reshuffling `tf.data` pipeline positioned the way
the recipes do it, `advance_epochs(ds, resume_epoch(dir))`) crashes in its last epoch,
once per module; each case damages a copy of its checkpoints and resumes in-process
(a SIGKILL is not the point here: the crash tests in tests/callbacks cover it).
"""

from __future__ import annotations

import json
import shutil
import struct
import warnings
import zipfile
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainwell.callbacks.checkpoint import (
    Checkpoint,
    CheckpointCorruptError,
    list_checkpoints,
    resume_checkpoint,
)
from trainwell.recipes.harness import advance_epochs, resume_epoch

EPOCHS, STEPS = 4, 5
_rs = np.random.RandomState(0)
X = _rs.randn(40, 4).astype("float32")
Y = (X @ _rs.randn(4, 1)).astype("float32")


class Crash(Exception):
    pass


class CrashAtStep(keras.callbacks.Callback):
    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations) == self.step:
            raise Crash(f"crash after step {self.step}")


def _run(ckdir, extra=()):
    """One process's worth of the run: seeds, data positioned for the resume, model, fit."""
    keras.utils.set_random_seed(0)
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(40, seed=3, reshuffle_each_iteration=True).batch(8)
    ds = advance_epochs(ds, resume_epoch(ckdir))  # a new iterator (new order) per epoch, like the recipes
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dropout(0.2), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.05), loss="mse")
    model.fit(ds, epochs=EPOCHS, steps_per_epoch=STEPS, verbose=0, shuffle=False,
              callbacks=[Checkpoint(ckdir, keep_last=3, verbose=0), *extra])
    return model


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """(reference weights of the uninterrupted run, checkpoint dir of a run that crashed in epoch 4)."""
    root = tmp_path_factory.mktemp("damaged")
    ref = _run(root / "ref").get_weights()
    with pytest.raises(Crash):
        _run(root / "crash", [CrashAtStep(3 * STEPS + 2)])
    assert [e["name"] for e in list_checkpoints(root / "crash")] == ["ckpt-5", "ckpt-10", "ckpt-15"]
    return ref, root / "crash"


def _copy(crashed, tmp_path) -> Path:
    d = tmp_path / "ck"
    shutil.copytree(crashed[1], d)
    return d


def _flip_array_byte(path: Path) -> None:
    """Flips the last data byte of the largest array in arrays.npz (what a bad sector does)."""
    with zipfile.ZipFile(path) as zf:
        info = max(zf.infolist(), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    data[info.header_offset + 30 + name_len + extra_len + info.file_size - 1] ^= 0x40
    path.write_bytes(bytes(data))


def _shift_position(ckpt: Path) -> None:
    meta = json.loads((ckpt / "state.json").read_text())
    meta["position"]["step_in_epoch"] += 1  # a changed value in an otherwise valid file
    (ckpt / "state.json").write_text(json.dumps(meta))


def _set_dtype_object(ckpt: Path) -> None:
    meta = json.loads((ckpt / "state.json").read_text())
    key = sorted(meta["arrays"])[0]
    meta["arrays"][key]["dtype"] = "object"
    (ckpt / "state.json").write_text(json.dumps(meta))


DAMAGE = {
    "arrays_truncated": lambda c: (c / "arrays.npz").write_bytes((c / "arrays.npz").read_bytes()[:700]),
    "arrays_byte_flipped": lambda c: _flip_array_byte(c / "arrays.npz"),
    "arrays_deleted": lambda c: (c / "arrays.npz").unlink(),
    "state_truncated": lambda c: (c / "state.json").write_text((c / "state.json").read_text()[:300]),
    "state_value_changed": _shift_position,
    "dtype_object": _set_dtype_object,
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_and_resumes_bit_identically(crashed, tmp_path, damage):
    ref, _ = crashed
    d = _copy(crashed, tmp_path)
    DAMAGE[damage](d / "ckpt-15")
    with pytest.warns(UserWarning, match=r"ckpt-15.* is damaged"):
        chosen, epoch = resume_checkpoint(d), resume_epoch(d)
    assert chosen["name"] == "ckpt-10" and epoch == 2  # the data follows the checkpoint really loaded
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _run(d)
    assert int(model.optimizer.iterations) == EPOCHS * STEPS
    for a, b in zip(model.get_weights(), ref):
        assert np.array_equal(a, b)  # bit-identical to the run that never crashed


def test_no_usable_checkpoint_is_one_clear_error(crashed, tmp_path):
    d = _copy(crashed, tmp_path)
    for name in ("ckpt-5", "ckpt-10", "ckpt-15"):
        (d / name / "arrays.npz").write_bytes(b"PK\x03\x04 not a zip")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointCorruptError) as exc:
            _run(d)
    msg = str(exc.value)
    assert "\n" not in msg and "No usable checkpoint" in msg and all(n in msg for n in ("ckpt-5", "ckpt-10", "ckpt-15"))


def test_checkpoint_without_checksums_still_loads(crashed, tmp_path):
    # Checkpoints written before checksums existed carry neither field.
    ref, _ = crashed
    d = _copy(crashed, tmp_path)
    for name in ("ckpt-5", "ckpt-10", "ckpt-15"):
        meta = json.loads((d / name / "state.json").read_text())
        del meta["state_sha256"], meta["arrays_crc32"]
        (d / name / "state.json").write_text(json.dumps(meta))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        assert resume_checkpoint(d)["name"] == "ckpt-15"
        model = _run(d)
    for a, b in zip(model.get_weights(), ref):
        assert np.array_equal(a, b)


def test_tampered_index_never_deletes_outside_the_checkpoint_dir(crashed, tmp_path):
    d = _copy(crashed, tmp_path)
    victim = tmp_path.parent / f"{tmp_path.name}-victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    index = json.loads((d / "checkpoint.json").read_text())
    outside = dict(index["checkpoints"][0], name=f"../../{victim.name}", seq=0)
    index["checkpoints"].insert(0, outside)
    (d / "checkpoint.json").write_text(json.dumps(index))
    try:
        with pytest.warns(UserWarning, match=r"Ignoring the entry '\.\./\.\./.*victim'"):
            names = [e["name"] for e in list_checkpoints(d)]
        assert names == ["ckpt-5", "ckpt-10", "ckpt-15"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _run(d)  # resumes and rotates (keep_last=3): the oldest entries are deleted
        assert (victim / "precious.txt").read_text() == "keep me"
        assert [e["name"] for e in list_checkpoints(d)] == ["ckpt-10", "ckpt-15", "ckpt-20"]
    finally:
        shutil.rmtree(victim, ignore_errors=True)
