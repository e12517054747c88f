"""trainwell.storage against a real S3-protocol server (moto, on 127.0.0.1): objects, lease, bad URLs."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest

from trainwell import storage
from trainwell.rundir import RunDirInUseError


def test_put_get_list_remove(s3_bucket):
    store = storage.ObjectStore(f"{s3_bucket}/run")
    store.check_bucket()
    store.put("ckpt-1-0123abcd/a.bin", b"x" * 10)
    store.put("ckpt-2-0123abcd/a.bin", b"y")
    assert store.get("ckpt-1-0123abcd/a.bin") == b"x" * 10
    assert sorted(store.children()) == ["ckpt-1-0123abcd", "ckpt-2-0123abcd"]
    removed = store.remove_unlisted(re.compile(r"^ckpt-"), {"ckpt-2-0123abcd"})
    assert removed == ["ckpt-1-0123abcd"] and store.children() == ["ckpt-2-0123abcd"]
    with pytest.raises(FileNotFoundError):
        store.get("ckpt-1-0123abcd/a.bin")


@pytest.mark.parametrize(
    "url, says",
    [
        ("s3://AKIAKEY:SuperSecret@bucket/run", "without credentials"),
        ("s3://user@bucket/run", "without credentials"),
        ("ftp://host/run", "scheme 'ftp' is not supported"),
        ("s3:///run", "naming a bucket"),
    ],
)
def test_bad_urls_are_refused_in_one_line(url, says):
    with pytest.raises(ValueError) as e:
        storage.check_url(url)
    msg = str(e.value)
    assert says in msg and "Received:" in msg and "\n" not in msg
    assert "SuperSecret" not in msg and "AKIAKEY" not in msg


def test_missing_driver_package_is_one_line(monkeypatch):
    real = importlib.util.find_spec  # the check lives in trainwell.validation (config checks run_dir URLs)
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: None if n == "gcsfs" else real(n))
    with pytest.raises(ValueError, match=r"gs:// needs gcsfs: pip install 'trainwell\[cloud\]'.*Received:"):
        storage.check_url("gs://bucket/run")


def test_missing_bucket_is_one_line(s3_bucket):
    with pytest.raises(ValueError, match=r"no bucket 'tw-no-such-bucket'.*Received:"):
        storage.ObjectStore("s3://tw-no-such-bucket/run").check_bucket()


def test_a_server_that_cannot_be_reached_is_named_not_the_bucket(monkeypatch):
    # s3fs's `exists` says False when it cannot connect: the message blamed the bucket
    for k, v in {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b",
                 "AWS_MAX_ATTEMPTS": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=r"Expected a reachable bucket \(EndpointConnectionError: .*Received:"):
        storage.store_for("s3://bucket/run").check_bucket()


def test_lease_second_writer_refused_then_free_after_release(s3_bucket):
    url = f"{s3_bucket}/run"
    store = storage.ObjectStore(url)
    # another live process on this host holds it
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        store.renew_lease("other-token")
        body = store.get(storage.LEASE_OBJECT).decode().replace(f'"pid": {os.getpid()}', f'"pid": {holder.pid}')
        store.put(storage.LEASE_OBJECT, body.encode())
        with pytest.raises(RunDirInUseError, match=f"pid {holder.pid}") as e:
            store.acquire_lease()
        assert "\n" not in str(e.value)
    finally:
        holder.kill()
        holder.wait()
    token = store.acquire_lease()  # the holder died: its lease is stale, taken over
    store.release_lease(token)
    assert store._lease() is None


def test_expired_lease_from_another_host_is_taken_over(s3_bucket):
    store = storage.ObjectStore(f"{s3_bucket}/run")
    store.put(storage.LEASE_OBJECT, json.dumps({"token": "t", "host": "elsewhere", "pid": 1,
                                                "expires": time.time() + 60}).encode())
    with pytest.raises(RunDirInUseError, match="'elsewhere'"):
        store.acquire_lease()
    store.put(storage.LEASE_OBJECT, json.dumps({"token": "t", "host": "elsewhere", "pid": 1,
                                                "expires": time.time() - 1}).encode())
    assert store.acquire_lease()
