"""Fixtures shared by the callback tests."""

import keras
import pytest


class Crash(Exception):
    """Stands in for a dying process in the crash-and-resume tests."""


class CrashAt(keras.callbacks.Callback):
    """Raises `Crash` at the n-th train batch end (a stand-in for a dying process)."""

    error = Crash

    def __init__(self, n):
        super().__init__()
        self.n, self.seen = n, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.n:
            raise Crash(f"crash at batch end {self.n}")


@pytest.fixture
def crash_at():
    """`crash_at(n)`: a callback raising `crash_at.error` at the n-th train batch end."""
    return CrashAt
