"""Does `TrainingDoctor` name what is wrong, and stay quiet on healthy runs? A zoo of small runs.

Each case is a small run with the doctor at its defaults (a probe and the loss rules
every 100 steps, verdicts again at the end of the run) and, to show that the
verdict does not hang on the probe interval, with `every_n_steps=10`:

- heavy momentum: MLPs trained with `SGD(0.3 or 0.1, momentum=0.995)` or
  `SGD(0.1, momentum=0.99)` on 3-class Gaussian blobs (the data of
  tests/callbacks/test_training_doctor.py, imported from it), 5 to 15
  epochs. The first case is the one an independent zoo found missed (reported as
  `dead_units` + `slow_convergence`): 5 epochs of 64 steps of `SGD(0.3,
  momentum=0.995)`; expected `oscillation`. The others swing too, some by so much
  that a swing reaches 4x the best loss to a new high: expected `oscillation` or
  `divergence`. Their swings also kill ReLU units (`dead_units`, named as the
  oscillation's consequence, is allowed besides).
- heavy momentum on 5 classes (#31.5): MLPs of 1-3 hidden ReLU layers of 32-256 units on
  32-dimensional Gaussian blobs of 5 classes (`tests/callbacks/test_training_doctor.py`'s
  `blobs`), `SGD` with LR 0.1-0.5 and momentum 0.99-0.999, 5 epochs of 64 steps. The first
  is the one an independent zoo found reported as `dead_units` + `slow_convergence`: 3 x 64
  units, `SGD(0.3, momentum=0.995)`. From about the null loss (ln 5) the loss goes up and
  swings above where it started, by less than 0.4 x the initial loss, and the swings kill
  the hidden layers; expected first: `oscillation` (two of them swing to 4x the best loss,
  to a new high: `divergence` first is right there too).
- heavy momentum on `digits` (8x8 digits, embedded): huge swings kill the hidden layers
  within some 40 steps; expected first: `oscillation` (the loss stands above where it
  started, up to 1.6x), `dead_units` or `divergence`.
- input bound, a run shorter than `every_n_steps`: 40 steps of a tiny MLP behind a
  `tf.data` map that sleeps 20 ms per batch in Python; expected `input_bound`.
- healthy: SGD with momentum 0.9 / Nesterov at sane learning rates (the twins of the
  momentum cases), Adam, RMSprop, small batches (2-16), label noise, `digits`, a second
  `fit` of a trained model, and the fast twin of the input-bound run; expected no
  finding at all. (Not in the zoo: a regression with 5% outliers of 10 sigma, MSE,
  batch 8, `SGD(0.01, momentum=0.9)`: its 10-step median loss rises 28x for some 20
  steps, and `divergence` is reported, although it comes back down.)

A miss is a pathological run whose first finding (the doctor lists a cause before its
consequences) is none of its expected codes (the alternatives listed); a false alarm is
any finding on a healthy run.
Deterministic (`keras.utils.set_random_seed`), except the input-bound timings.

Run: `python -m bench.doctor_zoo` (about 6 minutes on 2 CPU cores). Prints one
JSON object: per case and probe interval the codes found, and the totals.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from bench._common import log, machine_info, print_json  # noqa: E402
from trainwell.callbacks import TrainingDoctor  # noqa: E402
from trainwell.data import embedded  # noqa: E402

D = keras.layers.Dense
CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _doctor_tests():
    """tests/callbacks/test_training_doctor.py: the data and the input pipeline of its pathology tests."""
    path = Path(__file__).resolve().parents[1] / "tests" / "callbacks" / "test_training_doctor.py"
    spec = importlib.util.spec_from_file_location("test_training_doctor", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


T = _doctor_tests()


def datasets():
    x, y = T.XA, T.YA
    rng = np.random.default_rng(5)
    noisy = np.where(rng.random(len(y)) < 0.3, rng.integers(0, 3, len(y)), y)
    dg = embedded.load("digits")
    xd = dg.train[0].reshape(len(dg.train[0]), -1).astype("float32") / 255.0
    return {
        "blobs": (x, y), "blobs512": (x[:512], y[:512]), "noisy_labels": (x, noisy),
        "digits": (xd, dg.train[1]), "blobs5": T.blobs(2048, d=32, k=5),
    }


SGD, Adam, RMSprop = keras.optimizers.SGD, keras.optimizers.Adam, keras.optimizers.RMSprop

SWING = ["oscillation", "divergence"]
KILL = ["oscillation", "dead_units", "divergence"]

# name: (expected codes: any of them, hidden widths, optimizer, data, batch size, epochs, seed)
CASES = {
    "momentum0.995_lr0.3_2x32_seed0": (["oscillation"], [32, 32], lambda: SGD(0.3, momentum=0.995), "blobs", 32, 5, 0),
    "momentum0.995_lr0.3_2x32_seed1": (SWING, [32, 32], lambda: SGD(0.3, momentum=0.995), "blobs", 32, 5, 1),
    "momentum0.995_lr0.3_2x32_seed2": (SWING, [32, 32], lambda: SGD(0.3, momentum=0.995), "blobs", 32, 5, 2),
    "momentum0.995_lr0.3_2x64": (SWING, [64, 64], lambda: SGD(0.3, momentum=0.995), "blobs", 32, 5, 0),
    "momentum0.995_lr0.1_2x32": (SWING, [32, 32], lambda: SGD(0.1, momentum=0.995), "blobs", 32, 5, 0),
    "momentum0.99_lr0.1_1x32": (SWING, [32], lambda: SGD(0.1, momentum=0.99), "blobs512", 32, 15, 0),
    "5class_3x64_momentum0.995_lr0.3": (["oscillation"], [64] * 3, lambda: SGD(0.3, momentum=0.995), "blobs5", 32, 5, 0),
    "5class_3x64_momentum0.995_lr0.3_seed1": (["oscillation"], [64] * 3, lambda: SGD(0.3, momentum=0.995), "blobs5", 32, 5, 1),
    "5class_3x64_momentum0.99_lr0.1": (["oscillation"], [64] * 3, lambda: SGD(0.1, momentum=0.99), "blobs5", 32, 5, 0),
    "5class_3x64_momentum0.999_lr0.5": (["oscillation"], [64] * 3, lambda: SGD(0.5, momentum=0.999), "blobs5", 32, 5, 0),
    "5class_3x32_momentum0.999_lr0.1": (["oscillation"], [32] * 3, lambda: SGD(0.1, momentum=0.999), "blobs5", 32, 5, 0),
    "5class_3x256_momentum0.995_lr0.1": (["oscillation"], [256] * 3, lambda: SGD(0.1, momentum=0.995), "blobs5", 32, 5, 0),
    "5class_2x64_momentum0.995_lr0.5": (["oscillation"], [64] * 2, lambda: SGD(0.5, momentum=0.995), "blobs5", 32, 5, 0),
    "5class_3x128_momentum0.99_lr0.3": (SWING, [128] * 3, lambda: SGD(0.3, momentum=0.99), "blobs5", 32, 5, 0),
    "5class_1x64_momentum0.99_lr0.2": (SWING, [64], lambda: SGD(0.2, momentum=0.99), "blobs5", 32, 5, 0),
    "digits_momentum0.995_lr0.3": (KILL, [64, 64], lambda: SGD(0.3, momentum=0.995), "digits", 32, 8, 0),
    "digits_momentum0.99_lr0.1": (KILL, [64, 64], lambda: SGD(0.1, momentum=0.99), "digits", 32, 8, 0),
    "input_bound_40_steps": (["input_bound"], "pipeline", 0.020),
    "healthy_momentum0.9_lr0.05": ([], [32, 32], lambda: SGD(0.05, momentum=0.9), "blobs", 32, 5, 0),
    "healthy_momentum0.9_lr0.1": ([], [32, 32], lambda: SGD(0.1, momentum=0.9), "blobs", 32, 5, 0),
    "healthy_nesterov_lr0.05": ([], [32, 32], lambda: SGD(0.05, momentum=0.9, nesterov=True), "blobs", 32, 5, 0),
    "healthy_adam1e-3_4x64": ([], [64] * 4, lambda: Adam(1e-3), "blobs", 32, 5, 0),
    "healthy_adam1e-2": ([], [32, 32], lambda: Adam(1e-2), "blobs", 32, 5, 0),
    "healthy_rmsprop": ([], [32, 32], lambda: RMSprop(1e-3), "blobs", 32, 5, 0),
    "healthy_sgd0.1_batch8": ([], [32, 32], lambda: SGD(0.1), "blobs", 8, 2, 0),
    "healthy_sgd0.3_batch16": ([], [32], lambda: SGD(0.3), "blobs", 16, 3, 0),
    "healthy_sgd0.05_batch4": ([], [32, 32], lambda: SGD(0.05), "blobs", 4, 1, 0),
    "healthy_adam_batch2": ([], [32], lambda: Adam(1e-3), "blobs512", 2, 1, 0),
    "healthy_label_noise_30pct": ([], [32, 32], lambda: SGD(0.05, momentum=0.9), "noisy_labels", 32, 5, 0),
    "healthy_digits_momentum0.9": ([], [64, 64], lambda: SGD(0.05, momentum=0.9), "digits", 32, 8, 0),
    "healthy_digits_adam_batch8": ([], [64], lambda: Adam(3e-3), "digits", 8, 2, 0),
    "healthy_5class_3x64_momentum0.9_lr0.05": ([], [64] * 3, lambda: SGD(0.05, momentum=0.9), "blobs5", 32, 5, 0),
    "healthy_5class_3x64_momentum0.99_lr0.003": ([], [64] * 3, lambda: SGD(0.003, momentum=0.99), "blobs5", 32, 5, 0),
    "healthy_5class_3x64_adam1e-2": ([], [64] * 3, lambda: Adam(1e-2), "blobs5", 32, 5, 0),
    "healthy_5class_3x64_sgd0.05_batch4": ([], [64] * 3, lambda: SGD(0.05), "blobs5", 4, 1, 0),
    "healthy_second_fit": ([], [64, 64], lambda: SGD(0.05, momentum=0.9), "blobs", 32, 5, 0, "second_fit"),
    "healthy_fast_pipeline_40_steps": ([], "pipeline", 0.0),
}


def run_mlp(case, data, every):
    _, widths, opt, dname, bs, epochs, seed, *extra = case
    x, y = data[dname]
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((x.shape[1],))] + [D(w, activation="relu") for w in widths]
                             + [D(int(y.max()) + 1)])
    model.compile(opt(), CE)
    if extra == ["second_fit"]:
        model.fit(x, y, batch_size=bs, epochs=epochs, verbose=0)
    doctor = TrainingDoctor(every_n_steps=every, verbose=0)
    model.fit(x, y, batch_size=bs, epochs=epochs, verbose=0, callbacks=[doctor])
    return doctor


def run_pipeline(delay, every, steps=40):
    """A tiny MLP behind a `tf.data` map that sleeps `delay` s per batch in Python (the tests' pipeline)."""
    return T.pipeline_fit(delay, steps, doctor=TrainingDoctor(every_n_steps=every, verbose=0))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", default="100,10", help="probe intervals to run each case with (default 100,10)")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    args = ap.parse_args()
    every = [int(e) for e in args.every.split(",")]
    names = [n for n in args.cases.split(",") if n] or list(CASES)
    data = datasets()
    rows, misses, false_alarms = {}, [], []
    for name in names:
        case = CASES[name]
        expected = case[0]
        rows[name] = {"expected": expected}
        for e in every:
            t = time.perf_counter()
            doctor = run_pipeline(case[2], e) if case[1] == "pipeline" else run_mlp(case, data, e)
            codes = doctor.codes
            rows[name][f"every_{e}"] = {"codes": codes, "steps": doctor.step, "probes": doctor.probes,
                                       "findings": [f.line() for f in doctor.findings]}
            if expected and (not codes or codes[0] not in expected):
                misses.append(f"{name} (every_n_steps={e}): {codes}")
            if not expected and codes:
                false_alarms.append(f"{name} (every_n_steps={e}): {codes}")
            log(f"{name} every_n_steps={e}: {codes} ({time.perf_counter() - t:.1f} s)")
    n_path = sum(1 for n in names if CASES[n][0]) * len(every)
    n_healthy = sum(1 for n in names if not CASES[n][0]) * len(every)
    print_json({
        "benchmark": "doctor_zoo",
        "doctor": "TrainingDoctor() defaults, every_n_steps as given",
        "pathological_runs": n_path,
        "missed": len(misses),
        "healthy_runs": n_healthy,
        "false_alarms": len(false_alarms),
        "misses": misses,
        "false_alarm_runs": false_alarms,
        "cases": rows,
        "machine": machine_info(),
    })


if __name__ == "__main__":
    main()
