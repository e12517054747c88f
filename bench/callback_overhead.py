"""Overhead of trainwell's callback stack on `model.fit`, against bare Keras.

The same model, data and seed are trained in three ways, alternating within one
run (absolute times on shared machines are noisy; the ratios are what counts):

- `bare`: `model.fit` with no callbacks;
- `trainwell`: the full stack at defaults: `WarmupCosine`, `NaNRollback`,
  `Checkpoint` each epoch, `EarlyStopping`;
- `backup_and_restore`: `keras.callbacks.BackupAndRestore` saving each epoch (the
  built-in that `Checkpoint` replaces).

Timing covers every epoch after the first (the first traces and compiles), from
the end of epoch 1 to the end of `fit`, so saves at epoch boundaries and the final
save are included. The model is a small CNN whose training step takes >= 20 ms on
a 2-core CPU (the issue's floor: below that, per-step Python overhead dominates).
Target: trainwell steps/s >= 0.97 x bare.

Usage: python bench/callback_overhead.py [--rounds 3] [--epochs 4] [--steps 30]
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def build(seed: int):
    import keras

    keras.utils.set_random_seed(seed)
    L = keras.layers
    model = keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            L.Conv2D(32, 3, padding="same", activation="relu"),
            L.Conv2D(32, 3, padding="same", activation="relu"),
            L.MaxPooling2D(),
            L.Conv2D(64, 3, padding="same", activation="relu"),
            L.MaxPooling2D(),
            L.GlobalAveragePooling2D(),
            L.Dense(10, activation="softmax"),
        ]
    )
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class _Timer:
    def __init__(self):
        import keras

        class T(keras.callbacks.Callback):
            def on_epoch_end(s, epoch, logs=None):
                if epoch == 0:
                    self.t0, self.c0 = time.perf_counter(), time.process_time()

            def on_train_end(s, logs=None):
                self.t1, self.c1 = time.perf_counter(), time.process_time()

        self.callback = T()


def run(kind: str, data, epochs: int, steps: int, workdir: str) -> tuple[float, float]:
    import keras

    from trainwell.callbacks import Checkpoint, EarlyStopping, NaNRollback, WarmupCosine

    (x, y), val = data
    model = build(0)
    timer = _Timer()
    d = tempfile.mkdtemp(dir=workdir)
    if kind == "bare":
        cbs = []
    elif kind == "trainwell":
        cbs = [WarmupCosine(warmup_epochs=1), NaNRollback(), EarlyStopping(patience=100), Checkpoint(d)]
    elif kind in ("warmup_cosine", "nan_rollback", "early_stopping", "checkpoint"):  # attribution
        cbs = [{"warmup_cosine": lambda: WarmupCosine(warmup_epochs=1), "nan_rollback": NaNRollback,
                "early_stopping": lambda: EarlyStopping(patience=100), "checkpoint": lambda: Checkpoint(d)}[kind]()]
    elif kind == "backup_and_restore":
        cbs = [keras.callbacks.BackupAndRestore(d, save_freq="epoch", delete_checkpoint=False)]
    else:  # pragma: no cover
        raise ValueError(kind)
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(64, drop_remainder=True).repeat()
    model.fit(ds, epochs=epochs, steps_per_epoch=steps, validation_data=val, callbacks=cbs + [timer.callback], verbose=0)
    n = (epochs - 1) * steps
    return n / (timer.t1 - timer.t0), n / (timer.c1 - timer.c0)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--steps", type=int, default=30, help="steps per epoch")
    p.add_argument("--attribute", action="store_true", help="also time each trainwell callback alone")
    args = p.parse_args(argv)
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * args.steps, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=(len(x),)).astype("int32")
    val = (x[:256], y[:256])
    kinds = ["bare", "trainwell", "backup_and_restore"]
    if args.attribute:
        kinds += ["warmup_cosine", "nan_rollback", "early_stopping", "checkpoint"]
    results: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as work:
        for r in range(args.rounds):
            order = kinds if r % 2 == 0 else kinds[::-1]
            for k in order:
                wall, per_cpu_s = run(k, ((x, y), val), args.epochs, args.steps, work)
                results[k].append(wall)
                cpu[k].append(per_cpu_s)
                print(f"round {r} {k}: {wall:.2f} steps/s, {per_cpu_s:.2f} steps per CPU-s", file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    out = {
        "benchmark": "callback_overhead",
        "steps_per_epoch": args.steps,
        "epochs_timed": args.epochs - 1,
        "rounds": args.rounds,
        "step_ms_bare": 1000.0 / med["bare"],
        "steps_per_s": {k: round(v, 3) for k, v in med.items()},
        "steps_per_s_all": {k: [round(x, 3) for x in v] for k, v in results.items()},
        "ratio_trainwell_vs_bare": round(med["trainwell"] / med["bare"], 4),
        "ratio_backup_and_restore_vs_bare": round(med["backup_and_restore"] / med["bare"], 4),
        "ratio_trainwell_vs_backup_and_restore": round(med["trainwell"] / med["backup_and_restore"], 4),
        # CPU time is far less sensitive than wall time to other jobs on a shared machine
        "steps_per_cpu_s": {k: round(v, 3) for k, v in med_cpu.items()},
        "cpu_ratio_vs_bare": {k: round(v / med_cpu["bare"], 4) for k, v in med_cpu.items() if k != "bare"},
        "target_ratio": 0.97,
        "load_avg_1min": os.getloadavg()[0],
    }
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
