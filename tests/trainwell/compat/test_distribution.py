"""trainwell.compat.distribution: the end of a multi-worker TensorFlow run (`sync_workers`).

A non-chief worker must outlive the chief's process: the chief's coordination service
reports a worker gone before it (10 s without heartbeats) as crashed. The two-process
run is tests/trainwell/test_launch.py::test_cli_train_with_two_workers; these pin the
worker's side with a stand-in for the coordination service.
"""

import json

import pytest
import tensorflow as tf
from tensorflow.python.eager import context

from trainwell.compat import distribution
from trainwell.compat import tf_internals as ti


@pytest.fixture
def second_worker(monkeypatch):
    """This process is worker 1 of a two-worker TensorFlow job (not the chief)."""
    cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}}))
    assert not distribution.is_chief(None)


class _Clock:
    """A stand-in for `time` in tf_internals: each timed-out read advances it by its timeout."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now


def test_a_worker_outlives_a_chief_whose_exit_lingers(second_worker, monkeypatch):
    """The chief's process ended 100 s after the last barrier (its interpreter exit can wait on a
    tf.data iterator's autotune thread, up to 60 s each): the worker leaves only after it, when a
    read of the coordination service finds it gone. A worker that gave up at 60 s left first."""
    clock = _Clock()
    chief_gone_at = 100.0
    reads = []

    class Ctx:
        coordination_service = object()  # configured, as in a multi-worker job

        def get_config_key_value(self, key, timeout_in_ms=0):
            reads.append(clock.now)
            if clock.now >= chief_gone_at:
                raise tf.errors.UnavailableError(None, None, "Socket closed")
            clock.now = min(clock.now + timeout_in_ms / 1000, chief_gone_at)
            raise tf.errors.DeadlineExceededError(None, None, "timed out")

    monkeypatch.setattr(ti, "time", clock)
    monkeypatch.setattr(context, "context", lambda: Ctx())
    monkeypatch.setattr(distribution, "any_across_workers", lambda *a, **k: [False])
    distribution.sync_workers(None)
    assert reads[-1] == chief_gone_at  # the last read found the chief gone


def test_a_worker_waits_for_the_chief_even_when_the_last_barrier_failed(second_worker, monkeypatch):
    """A failed barrier (a collective timed out) is raised after the wait, not instead of it: the
    chief may still be running, and a worker leaving at once would be reported as crashed."""
    waits = []

    def barrier(*args, **kwargs):
        raise tf.errors.DeadlineExceededError(None, None, "collective timed out")

    monkeypatch.setattr(distribution, "any_across_workers", barrier)
    monkeypatch.setattr(ti, "wait_for_coordination_leader", lambda timeout_s: waits.append(timeout_s) or True)
    with pytest.raises(tf.errors.DeadlineExceededError):
        distribution.sync_workers(None)
    assert waits == [distribution.LEADER_EXIT_WAIT_S]


def test_the_chief_does_not_wait(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setattr(distribution, "any_across_workers", lambda *a, **k: [False])
    monkeypatch.setattr(ti, "wait_for_coordination_leader", lambda timeout_s: pytest.fail("the chief waited"))
    distribution.sync_workers(None)
