"""Snapshot/restore cost of `NaNRollback` against file-based saving, side by side.

Ours: the callback's device-side copy (`trainwell.compat.snapshot.Snapshot`: the values
read as tensors in one compiled function, kept by TensorFlow's copy-on-write) of the model
weights and the optimizer state. Baselines, in the same
run on the same model: `model.save_weights`/`load_weights` (.weights.h5, model
weights only, so less state than ours) and `tf.train.Checkpoint(model,
optimizer).write/read` (the same state as ours). Also the cost of one weight
check (one compiled finiteness reduction).

`--hooks`: instead, the cost of the callback's batch hooks inside a `fit` against Keras's
`TerminateOnNaN` (the sub-millisecond MLP of `callback_overhead.py --case tiny`, spe 1),
microseconds per execution, the step's wait included (both wait for it).

Usage: python bench/nan_rollback_snapshot.py [--width 2048] [--repeats 20] [--hooks [--rounds 5]]
Prints one JSON object (times in milliseconds, medians over the repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from trainwell.callbacks.nan_rollback import NaNRollback  # noqa: E402


class _Touch:
    """An update of every variable (`v.assign_add(1)`), as an optimizer step does."""

    def __init__(self, variables):
        self.variables = variables

    def __call__(self):
        for v in self.variables:
            v.assign_add(tf.ones_like(v))


def _median_ms(fn, repeats: int, sync) -> float:
    fn()
    sync()  # warm-up (tracing)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1000.0)
    return round(statistics.median(times), 3)


def hook_cost(rounds: int) -> dict:
    """Median microseconds per execution in each callback's batch hooks, over `rounds` epochs."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(128 * 128, 64)).astype("float32"), rng.integers(0, 10, 128 * 128)
    res: dict[str, list[float]] = {"nan_rollback": [], "terminate_on_nan": []}
    models = {}
    for kind in res:
        keras.utils.set_random_seed(0)
        models[kind] = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                                         keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
        models[kind].compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for r in range(rounds + 1):  # the first: tracing
        for kind, times in res.items():
            cb, spent = NaNRollback() if kind == "nan_rollback" else keras.callbacks.TerminateOnNaN(), []
            for name in ("on_train_batch_begin", "on_train_batch_end"):
                def timed(*a, _f=getattr(cb, name), **k):
                    t0 = time.perf_counter()
                    _f(*a, **k)
                    spent.append(time.perf_counter() - t0)
                setattr(cb, name, timed)
            models[kind].fit(x, y, batch_size=128, epochs=1, verbose=0, callbacks=[cb], shuffle=False)
            if r:
                times.append(sum(spent) / 128 * 1e6)
    return {k: {"median_us_per_execution": round(statistics.median(v), 1), "rounds": [round(t, 1) for t in v]}
            for k, v in res.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048, help="hidden width of the MLP")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--hooks", action="store_true", help="the batch hooks' cost in a fit instead")
    parser.add_argument("--rounds", type=int, default=5, help="with --hooks: timed epochs")
    args = parser.parse_args()
    if args.hooks:
        print(json.dumps(hook_cost(args.rounds), indent=2))
        return

    keras.utils.set_random_seed(0)
    w = args.width
    model = keras.Sequential(
        [keras.Input((w // 2,)), keras.layers.Dense(w, activation="relu"), keras.layers.Dense(w // 2), keras.layers.Dense(10)]
    )
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).normal(size=(64, w // 2)).astype("float32")
    y = np.zeros((64,), "int32")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # builds the optimizer slots

    cb = NaNRollback()
    cb.set_model(model)
    cb._build_machinery()
    snap, probe_full = cb._snapshot, cb._fns["probe_full"]
    last = model.weights[-1]

    def sync():
        return last.numpy()

    state_vars = cb._state_variables()
    result = {
        "device": (tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU"))[0].name,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "model_params": int(model.count_params()),
        "state_variables": len(state_vars),
        "state_floats": int(sum(np.prod(v.shape) for v in state_vars)),
        "repeats": args.repeats,
    }
    # TensorFlow variables are copy-on-write: the snapshot's read shares the
    # buffer, and a copy happens at the next update of `var` (the next
    # optimizer step) if that update cannot write in place. So each copy is also
    # timed together with an update of every state variable (`touch`), minus
    # the cost of `touch` alone: the effective cost added to training.
    touch = tf.function(_Touch([v.value for v in state_vars]), autograph=False)
    t_touch = _median_ms(touch, args.repeats, sync)
    t_snap = _median_ms(lambda: (snap.take(), touch()), args.repeats, sync)
    t_restore = _median_ms(lambda: (snap.restore(), touch()), args.repeats, sync)
    result["ours_device_copy"] = {
        "snapshot_effective_ms": round(t_snap - t_touch, 3),
        "restore_effective_ms": round(t_restore - t_touch, 3),
        "snapshot_call_only_ms": _median_ms(snap.take, args.repeats, sync),
        "restore_call_only_ms": _median_ms(snap.restore, args.repeats, sync),
        "update_all_state_ms": t_touch,
        "weight_check_ms": _median_ms(lambda: probe_full().numpy(), args.repeats, lambda: None),
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.weights.h5")
        result["baseline_save_weights_h5"] = {
            "what": "model weights only",
            "save_ms": _median_ms(lambda: model.save_weights(path), args.repeats, sync),
            "load_ms": _median_ms(lambda: model.load_weights(path), args.repeats, sync),
        }
        ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        prefix = os.path.join(tmp, "ckpt")
        result["baseline_tf_checkpoint"] = {
            "what": "model weights + optimizer state",
            "save_ms": _median_ms(lambda: ckpt.write(prefix), args.repeats, sync),
            "load_ms": _median_ms(lambda: ckpt.read(prefix).assert_consumed(), args.repeats, sync),
        }
    ours, ck = result["ours_device_copy"], result["baseline_tf_checkpoint"]
    result["speedup_vs_tf_checkpoint"] = {
        "snapshot": round(ck["save_ms"] / max(ours["snapshot_effective_ms"], ours["snapshot_call_only_ms"]), 1),
        "restore": round(ck["load_ms"] / max(ours["restore_effective_ms"], ours["restore_call_only_ms"]), 1),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
