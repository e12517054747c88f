"""Tests of trainwell.compat.keras_fixes: in-process patching, and real 2-worker jobs on 127.0.0.1.

The multi-worker jobs (tests/trainwell/compat/multiworker_worker.py, one TF thread per
process) all start together in one module fixture so the file stays short on a
busy machine:

- "no_symbolic_build" / "no_scalar_reduce": 2 workers with one fix removed: each fails in
  the Keras function its fix replaces, so the fixes are still needed.

That the fixed path trains correctly (2 workers with both fixes, as `runtime.make_strategy(
"multiworker")` sets up, match one process under `cpu:2`) is proven once, with a recipe, by
tests/recipes/test_multiworker.py::test_two_workers_match_single_process_mirrored.

Every process has a deadline; when one worker of a job fails, its peer gets a
short grace period and is then killed; everything still running is killed in
`finally`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from trainwell.compat import keras_fixes

WORKER = Path(__file__).with_name("multiworker_worker.py")
DEADLINE_S = 360  # whole fixture, all jobs together: a hang guard. Alone they take about 25 s; `make test` runs
# them beside the multi-worker recipe jobs (9 processes), where TensorFlow took 90 s to start (2026-12-02)
PEER_GRACE_S = 20  # after one worker of a job fails, how long its peer may take to fail too


# --------------------------------------------------------------------------- in-process


@pytest.fixture
def clean_fixes():
    before = keras_fixes.applied()
    keras_fixes.remove()
    yield
    keras_fixes.remove()
    if before:
        keras_fixes.apply(before, force=True)


def _targets():
    from keras.src.backend.tensorflow import trainer

    return trainer.TensorFlowTrainer.__dict__["_maybe_symbolic_build"], trainer.reduce_per_replica


def test_apply_remove_idempotent_and_restore_originals(clean_fixes):
    orig_build, orig_reduce = _targets()
    assert keras_fixes.needed()  # Keras 3.15 is in the known-broken range
    assert keras_fixes.apply() == keras_fixes.FIXES
    build1, reduce1 = _targets()
    assert build1 is not orig_build and reduce1 is not orig_reduce
    assert keras_fixes.apply() == keras_fixes.FIXES  # second apply changes nothing
    assert _targets() == (build1, reduce1)
    assert keras_fixes.remove("scalar_reduce") == ("scalar_reduce",)
    assert _targets() == (build1, orig_reduce)
    assert keras_fixes.remove() == ("symbolic_build",)
    assert keras_fixes.remove() == ()
    assert _targets() == (orig_build, orig_reduce)


def test_version_gate(clean_fixes, monkeypatch):
    assert keras_fixes.needed((3, 15)) and keras_fixes.needed((3, 0))
    assert not keras_fixes.needed((3, 16)) and not keras_fixes.needed((2, 15))
    orig = _targets()
    monkeypatch.setattr(keras_fixes, "keras_version", lambda: (3, 16))
    assert keras_fixes.apply() == ()
    assert _targets() == orig
    assert keras_fixes.apply("symbolic_build", force=True) == ("symbolic_build",)
    assert _targets()[0] is not orig[0]


def test_patched_context_manager_restores_previous_state(clean_fixes):
    orig = _targets()
    keras_fixes.apply("symbolic_build")
    with keras_fixes.patched() as names:
        assert names == keras_fixes.FIXES
    assert keras_fixes.applied() == ("symbolic_build",)  # applied before: stays
    keras_fixes.remove()
    assert _targets() == orig


def test_invalid_fix_name():
    with pytest.raises(ValueError, match="Received: fixes='nope'"):
        keras_fixes.apply("nope")


def test_apply_for_backend_patches_tensorflows_trainer_only_on_tensorflow(clean_fixes, monkeypatch):
    assert keras_fixes.apply_for_backend("symbolic_build") == ("symbolic_build",)  # this process: TensorFlow
    assert _targets()[0] is keras_fixes._fixed_maybe_symbolic_build
    keras_fixes.remove()
    monkeypatch.setattr(keras_fixes, "backend_name", lambda: "jax")
    monkeypatch.setattr(keras_fixes, "_target", lambda name: pytest.fail("TensorFlow's trainer touched on JAX"))
    assert keras_fixes.apply_for_backend("symbolic_build") == ()


def test_runtime_applies_fixes_for_multiworker(clean_fixes, monkeypatch):
    import tensorflow as tf

    from trainwell import runtime

    # Only the fix call is under test: the strategy itself is not created.
    monkeypatch.setattr(tf.distribute, "MultiWorkerMirroredStrategy", lambda: "mwms")
    assert runtime.make_strategy("multiworker") == "mwms"
    assert keras_fixes.applied() == keras_fixes.FIXES


def _fit_mirrored_one_cpu():
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(3)
    rs = np.random.RandomState(0)
    x, y = rs.randn(64, 4).astype("float32"), rs.randint(0, 2, 64)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hist = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    return hist.history, model.get_weights()


def test_fixes_leave_single_process_mirrored_unchanged(clean_fixes):
    hist_off, w_off = _fit_mirrored_one_cpu()
    with keras_fixes.patched():
        hist_on, w_on = _fit_mirrored_one_cpu()
    assert hist_off["loss"][1] < hist_off["loss"][0]
    for key in hist_off:
        assert np.allclose(hist_on[key], hist_off[key], rtol=0, atol=1e-7), key
    for a, b in zip(w_on, w_off):
        assert np.allclose(a, b, rtol=0, atol=1e-7)


def _fits_under_one_device(fits: int) -> tuple[int, list]:
    """`fits` fits of a new model under `OneDeviceStrategy`; how many times the data was started, and the weights."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(5)
    rs = np.random.RandomState(0)
    x, y = rs.randn(48, 4).astype("float32"), rs.randn(48, 1).astype("float32")
    started = []

    def gen():
        started.append(1)
        yield from zip(x, y)

    spec = (tf.TensorSpec((4,), tf.float32), tf.TensorSpec((1,), tf.float32))
    data = tf.data.Dataset.from_generator(gen, output_signature=spec).batch(16)
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), "mse", metrics=["mae"])
    for _ in range(fits):
        model.fit(data, epochs=1, verbose=0)
    return len(started), model.get_weights()


def test_symbolic_build_draws_no_batch_from_data_it_does_not_need(clean_fixes):
    # Keras draws one batch from a new iterator at the start of every `fit` under a
    # strategy and drops that iterator; TensorFlow 2.21 sometimes segfaults there under
    # a single-device strategy (see keras_fixes). The fix builds the first fit's model
    # and compiled metrics from the element spec and draws nothing once all is built.
    started_off, w_off = _fits_under_one_device(3)
    with keras_fixes.patched("symbolic_build"):
        started_on, w_on = _fits_under_one_device(3)
    assert started_off == 6  # one epoch and one drawn batch per fit: the fix is still needed
    assert started_on == 3  # one epoch per fit, nothing else
    for a, b in zip(w_on, w_off):
        assert np.array_equal(a, b)


def test_make_strategy_applies_symbolic_build_for_every_strategy_but_the_default(clean_fixes, monkeypatch):
    from trainwell import runtime

    monkeypatch.delenv("TF_CONFIG", raising=False)

    runtime.make_strategy("auto")  # no GPU here: the default strategy, no patch needed
    assert keras_fixes.applied() == ()
    runtime.make_strategy("one_device")
    assert keras_fixes.applied() == ("symbolic_build",)


# --------------------------------------------------------------------------- real workers


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class _Job:
    def __init__(self, name: str, tmp: Path, workers: int, disable: str = ""):
        self.name, self.procs, self.outs, self.logs = name, [], [], []
        base_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TRAINWELL_DISABLE_KERAS_FIXES": disable}
        base_env.pop("TF_CONFIG", None)
        cluster = {"worker": [f"127.0.0.1:{p}" for p in _free_ports(workers)]}
        for i in range(workers):
            env = {**base_env, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})}
            out, log = tmp / f"{name}-{i}.json", open(tmp / f"{name}-{i}.log", "w")
            self.outs.append(out)
            self.logs.append(log)
            self.procs.append(
                subprocess.Popen([sys.executable, str(WORKER), str(out)], env=env, stdout=log,
                                 stderr=subprocess.STDOUT, cwd=str(tmp))
            )
        self.failed_at: float | None = None

    def poll(self, now: float) -> bool:
        """True when every process of the job has ended (killing a stuck peer after a failure)."""
        codes = [p.poll() for p in self.procs]
        if any(c not in (None, 0) for c in codes) and self.failed_at is None:
            self.failed_at = now
        if self.failed_at is not None and now - self.failed_at > PEER_GRACE_S:
            self.kill()
        return all(p.poll() is not None for p in self.procs)

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)

    def results(self) -> list[dict]:
        res = []
        for p, out, log in zip(self.procs, self.outs, self.logs):
            log.close()
            if out.exists():
                res.append(json.loads(out.read_text()))
            else:
                tail = Path(log.name).read_text()[-1500:]
                res.append({"error": f"no result (exit code {p.returncode}); log tail: {tail}"})
        return res


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multiworker")
    started: list[_Job] = []
    try:
        started = [
            _Job("no_symbolic_build", tmp, 2, disable="symbolic_build"),
            _Job("no_scalar_reduce", tmp, 2, disable="scalar_reduce"),
        ]
        t0 = time.monotonic()
        pending = list(started)
        while pending and time.monotonic() - t0 < DEADLINE_S:
            now = time.monotonic()
            pending = [j for j in pending if not j.poll(now)]
            time.sleep(0.5)
        for j in pending:
            j.kill()
        yield {j.name: j.results() for j in started}
    finally:
        for j in started:
            j.kill()
            for log in j.logs:
                log.close()


@pytest.mark.serial
def test_without_symbolic_build_fix_fit_fails(jobs):
    for r in jobs["no_symbolic_build"]:
        assert r.get("fixes") == ["scalar_reduce"], r.get("error")
        # Keras reduces the distributed *data* batch across workers to build the model.
        assert r["error"].startswith("ValueError: Attempt to convert a value (PerReplica"), r["error"][:300]
        assert "_maybe_symbolic_build" in r["frames"], r["frames"]


@pytest.mark.serial
def test_without_scalar_reduce_fix_fit_fails(jobs):
    for r in jobs["no_scalar_reduce"]:
        assert r.get("fixes") == ["symbolic_build"], r.get("error")
        # strategy.reduce("MEAN", scalar, axis=0) on the step's metric results.
        assert "Invalid reduction dimension 0 for input with 0 dimensions" in r["error"], r["error"][:300]
        assert "reduce_per_replica" in r["frames"], r["frames"]
