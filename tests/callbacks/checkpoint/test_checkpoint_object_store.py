"""Checkpoint on an object store (a real S3-protocol server, moto, on 127.0.0.1) and the same faults locally.

Faults: a failure during the array upload, between the uploads, during the index write (injected in
the storage layer), a truncated or missing object, two writers, and a real SIGKILL in the middle of a
save followed by a resume that ends bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest

from trainwell import storage
from trainwell.callbacks.checkpoint import (
    Checkpoint,
    CheckpointSaveError,
    list_checkpoints,
    load_checkpoint,
)
from trainwell.callbacks.checkpoint import files as ckpt_files
from trainwell.rundir import RunDirInUseError

WORKER = Path(__file__).with_name("s3_worker.py")
SECRET = "testing-secret-value"


def _data(n=40):
    rs = np.random.RandomState(0)
    x = rs.randn(n, 4).astype("float32")
    return x, (x @ rs.randn(4, 1)).astype("float32")


X, Y = _data()


def _model(seed=1):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.05), loss="mse")
    return model


def _fit(model, ckpt, epochs):
    model.fit(X, Y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=[ckpt])


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path):
    """A checkpoint directory on each backend."""
    if request.param == "local":
        return str(tmp_path / "ckpts")
    return f"{request.getfixturevalue('s3_bucket')}/run/checkpoints"


def _objects(url: str) -> dict[str, bytes]:
    store = storage.ObjectStore(url)
    return {p: store.fs.cat_file(p) for p in store.fs.find(store.root)}


def test_fit_saves_lists_loads_and_resumes_on_s3(s3_bucket, capfd, caplog):
    caplog.set_level(logging.DEBUG, logger="trainwell")
    url = f"{s3_bucket}/run/checkpoints"
    model = _model()
    _fit(model, Checkpoint(url, keep_last=2, monitor="loss", verbose=1), epochs=3)
    entries = list_checkpoints(url)
    assert [e["name"] for e in entries] == ["ckpt-10", "ckpt-15"]
    assert all(ckpt_files.PREFIX_RE.match(e["prefix"]) for e in entries)
    names = {p.split("/checkpoints/", 1)[1] for p in _objects(url)}
    listed = {e["prefix"] for e in entries}
    # rotation removed ckpt-5's prefix; the lease is released at the end of fit
    assert {n.split("/")[0] for n in names} == listed | {"checkpoint.json"}
    other = _model(seed=2)
    load_checkpoint(url, other)
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), other.get_weights()))
    # a resume from the URL trains on from the newest checkpoint
    resumed = _model(seed=3)
    _fit(resumed, Checkpoint(url, monitor="loss", verbose=1), epochs=4)
    assert int(resumed.optimizer.iterations.numpy()) == 20
    # no credential in anything the run wrote, printed or logged
    for blob in _objects(url).values():
        assert SECRET.encode() not in blob and b"testing-key-id" not in blob
    out, err = capfd.readouterr()
    assert "resuming from s3://" in out
    for text in (out, err, caplog.text):
        assert SECRET not in text and "testing-key-id" not in text


def _inject(monkeypatch, where: str, stage: str):
    """Makes the next save fail at `stage` ("arrays", "between", "index") on `where`'s backend."""
    calls = {"n": 0}

    def fail(*a, **k):
        raise OSError(5, "injected failure")

    if storage.is_url(where):
        real = storage.ObjectStore.put
        target = {"arrays": "/arrays.npz", "between": "/state.json", "index": "checkpoint.json"}[stage]

        def put(self, rel, data):
            if rel.endswith(target):
                calls["n"] += 1
                if calls["n"] == 1:
                    if stage == "arrays":  # half the object went up: a torn upload is never visible in S3
                        real(self, rel + ".part", bytes(data)[: len(data) // 2])
                    fail()
            return real(self, rel, data)

        monkeypatch.setattr(storage.ObjectStore, "put", put)
        return
    name = {"arrays": "write_npz", "between": "write_text", "index": "write_index"}[stage]
    real = getattr(ckpt_files, name)

    def local(*a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            if stage == "arrays":
                Path(a[0]).write_bytes(b"PK\x03\x04 torn")
            fail()
        return real(*a, **k)

    monkeypatch.setattr(ckpt_files, name, local)


@pytest.mark.parametrize("stage", ["arrays", "between", "index"])
def test_failed_save_leaves_previous_checkpoint_and_next_writer_cleans(where, stage, monkeypatch):
    model = _model()
    _fit(model, Checkpoint(where, monitor="loss", verbose=0), epochs=1)
    first = model.get_weights()
    with monkeypatch.context() as m:
        _inject(m, where, stage)
        with pytest.raises(CheckpointSaveError, match="injected failure"):
            _fit(model, Checkpoint(where, monitor="loss", verbose=0), epochs=2)
    # Locally the rename is the commit: a checkpoint renamed into place before the index write failed is
    # found on disk (files.py). On an object store the index PUT is the commit: that save never happened.
    committed = not storage.is_url(where) and stage == "index"
    expected = ["ckpt-5", "ckpt-10"] if committed else ["ckpt-5"]
    assert [e["name"] for e in list_checkpoints(where)] == expected
    assert ckpt_files.resume_checkpoint(where)["name"] == expected[-1]
    other = _model(seed=5)
    load_checkpoint(where, other)
    want = model.get_weights() if committed else first
    assert all(np.array_equal(a, b) for a, b in zip(want, other.get_weights()))
    # the next writer removes the garbage and goes on
    _fit(_model(seed=5), Checkpoint(where, monitor="loss", verbose=0), epochs=2)
    assert [e["name"] for e in list_checkpoints(where)] == ["ckpt-5", "ckpt-10"]
    if storage.is_url(where):
        tops = {p.split("/checkpoints/", 1)[1].split("/")[0] for p in _objects(where)}
        assert tops == {e["prefix"] for e in list_checkpoints(where)} | {"checkpoint.json"}
    else:
        # (not `.trainwell.lock`: the failed fit never reached on_train_end, so this process still holds it)
        names = sorted(p.name for p in Path(where).iterdir() if p.name != ".trainwell.lock")
        assert names == ["checkpoint.json", "ckpt-10", "ckpt-5"]


@pytest.mark.parametrize("damage", ["truncate", "missing"])
def test_damaged_newest_checkpoint_falls_back(where, damage):
    model = _model()
    _fit(model, Checkpoint(where, monitor="loss", verbose=0), epochs=2)
    newest = list_checkpoints(where)[-1]
    assert newest["name"] == "ckpt-10"
    if storage.is_url(where):
        store = storage.ObjectStore(where)
        key = f"{newest['prefix']}/arrays.npz"
        if damage == "truncate":
            store.put(key, store.get(key)[:-100])
        else:
            store.remove(key)
    else:
        path = Path(newest["path"]) / "arrays.npz"
        if damage == "truncate":
            path.write_bytes(path.read_bytes()[:-100])
        else:
            path.unlink()
    with pytest.warns(UserWarning, match="ckpt-10.* is damaged"):
        chosen = ckpt_files.resume_checkpoint(where)
    assert chosen["name"] == "ckpt-5"


def test_second_writer_refused_in_one_line(where, tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"] if storage.is_url(where) else
        [sys.executable, "-c", f"from trainwell.rundir import lock_run_dir; import os, time; "
         f"os.makedirs({where!r}, exist_ok=True); lock_run_dir({where!r}); print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        if storage.is_url(where):  # a live writer's lease (its pid runs on this host)
            store = storage.ObjectStore(where)
            store.put(storage.LEASE_OBJECT, json.dumps({"token": "x", "host": os.uname().nodename,
                                                        "pid": holder.pid, "expires": time.time() + 600}).encode())
        else:
            assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirInUseError) as e:
            _fit(_model(), Checkpoint(where, monitor="loss", verbose=0), epochs=1)
        assert "\n" not in str(e.value) and str(holder.pid) in str(e.value)
        assert list_checkpoints(where) == []
    finally:
        holder.kill()
        holder.wait()


def test_bad_urls_refused_at_construction():
    with pytest.raises(ValueError) as e:
        Checkpoint("s3://AKIAXX:topsecret@bucket/run")
    assert "topsecret" not in str(e.value) and "Received:" in str(e.value)
    with pytest.raises(ValueError, match="scheme 'hdfs' is not supported"):
        Checkpoint("hdfs://nn/run")


def test_missing_bucket_and_no_permission_are_one_line(s3_bucket, monkeypatch):
    with pytest.raises(ValueError, match="no bucket"):
        _fit(_model(), Checkpoint("s3://tw-missing-bucket/run", monitor="loss", verbose=0), epochs=1)
    url = f"{s3_bucket}/run"

    def denied(self, rel, data):
        raise PermissionError(13, "Access Denied")

    with monkeypatch.context() as m:
        m.setattr(storage.ObjectStore, "put", denied)
        with pytest.raises(PermissionError):
            _fit(_model(), Checkpoint(url, monitor="loss", verbose=0), epochs=1)
    assert list_checkpoints(url) == []


def _worker(url, tmp_path, tag, *extra):
    out = tmp_path / f"{tag}.npz"
    cmd = [sys.executable, str(WORKER), "--dir", url, "--ids", str(tmp_path / f"{tag}.ids"), "--out", str(out), *extra]
    return cmd, out


@pytest.mark.slow
def test_sigkill_mid_upload_then_resume_is_bit_identical(s3_bucket, tmp_path):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    cmd, ref = _worker(f"{s3_bucket}/ref", tmp_path, "ref")
    subprocess.run(cmd, check=True, timeout=240, env=env, capture_output=True)
    url = f"{s3_bucket}/crash"
    marker = tmp_path / "marker"
    cmd, out = _worker(url, tmp_path, "crash", "--stall-put", "3", "--marker", str(marker))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert marker.exists(), proc.stderr.read().decode()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # the third save (step 12) was killed while uploading: the index lists the first two only
    assert [e["name"] for e in list_checkpoints(url)] == ["ckpt-4", "ckpt-8"]
    cmd, out = _worker(url, tmp_path, "crash")
    subprocess.run(cmd, check=True, timeout=240, env=env, capture_output=True)
    a, b = np.load(ref), np.load(out)
    assert a.files == b.files and all(np.array_equal(a[k], b[k]) for k in a.files)
    tops = {p.split("/crash/", 1)[1].split("/")[0] for p in _objects(url)}
    assert tops == {e["prefix"] for e in list_checkpoints(url)} | {"checkpoint.json"}
