"""Fault injection: two processes on one run directory.

The holder is a real second process (a lock is about processes); everything else runs
in-process. The holder imports only `trainwell.runtime` (no TensorFlow), so it starts fast.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import types

import pytest

from trainwell import runtime
from trainwell.recipes import harness
from trainwell.rundir import LOCK_FILE, RunDirInUseError, lock_run_dir


def _holder(run_dir):
    """A process that takes the run directory's lock and waits; returns it once it holds the lock."""
    code = textwrap.dedent(f"""
        import sys, time
        from trainwell import rundir
        rundir.lock_run_dir({str(run_dir)!r})
        print("locked", flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _cfg(run_dir):
    """What `setup_run` reads of a recipe config before it writes the manifest."""
    return types.SimpleNamespace(run_dir=str(run_dir), strategy="auto", precision="float32", seed=0, verbose=0)


def test_second_process_fails_in_one_line_naming_the_holder_until_the_holder_dies(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = _holder(run_dir)
    try:
        with pytest.raises(RunDirInUseError) as exc:
            harness.setup_run(_cfg(run_dir), "resnet-imagenet")  # the recipes' entry point
        msg = str(exc.value)
        assert "\n" not in msg and f"process {proc.pid} on host {socket.gethostname()}" in msg
        assert not (run_dir / "manifest.json").exists()  # nothing of the holder's run was touched
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    # The holder crashed (SIGKILL): its lock is stale and the next run takes it.
    lock = lock_run_dir(run_dir)
    try:
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    assert not (run_dir / LOCK_FILE).exists()


def test_without_flock_the_recorded_pid_and_host_decide(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)  # e.g. a network filesystem without locking
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=60)
    cases = [
        ({"pid": gone.pid, "host": socket.gethostname()}, None),  # crashed here: stale, taken over
        ({"pid": os.getppid(), "host": socket.gethostname()}, f"process {os.getppid()}"),  # alive here
        ({"pid": 1234, "host": "other-host"}, "on host other-host"),  # cannot tell: refused
    ]
    for record, refused in cases:
        (tmp_path / LOCK_FILE).write_text(json.dumps(record))
        if refused:
            with pytest.raises(RunDirInUseError, match=refused):
                lock_run_dir(tmp_path)
        else:
            lock = lock_run_dir(tmp_path)
            assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
            lock.release()
            assert not (tmp_path / LOCK_FILE).exists()


def test_only_the_chief_locks_the_run_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(runtime, "is_chief", lambda strategy=None: False)
    ctx = harness.setup_run(_cfg(tmp_path), "resnet-imagenet")
    assert not ctx.is_chief and not (tmp_path / LOCK_FILE).exists() and not (tmp_path / "manifest.json").exists()
