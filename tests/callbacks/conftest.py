"""Fixtures shared by the callback tests."""

import keras
import pytest


class Crash(Exception):
    """Stands in for a dying process in the crash-and-resume tests."""


class CrashAt(keras.callbacks.Callback):
    """At the n-th train batch end, raises `Crash` (a stand-in for a dying process) or calls `action()`."""

    error = Crash

    def __init__(self, n, action=None):
        super().__init__()
        self.n, self.seen, self.action = n, 0, action

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.n and self.action is not None:
            self.action()
        elif self.seen == self.n:
            raise Crash(f"crash at batch end {self.n}")


@pytest.fixture
def crash_at():
    """`crash_at(n, action=None)`: a callback raising `crash_at.error` (or calling `action()`) at the n-th
    train batch end."""
    return CrashAt
