"""Checkpoint I/O of a ResNet-50 full training state: ours (sync, async) vs Keras.

Model: `keras.applications.ResNet50(weights=None)` compiled with SGD + momentum,
optimizer built (weights + momentum slots + BN statistics, ~51M floats).

Measured in one run, medians over `--repeats`:

- ours sync: `Checkpoint.save()` (copy to host, write `arrays.npz` + `state.json`
  into a temp dir, fsync files and dir, rename, rewrite the index);
- ours async: the time `Checkpoint.save()` blocks the caller (the training loop)
  with `async_save=True` (one compiled read of all variables + thread start),
  the time until the background commit is done, and the extra time of an
  optimizer update (SGD-momentum `apply` on all variables) that runs while the
  background write holds the snapshot (TensorFlow's copy-on-write of the
  updated buffers), against the same update without a pending write;
- restore: `load_checkpoint(..., include_optimizer=True)` (read, check, assign);
- checksums: what a save spends on them (read the CRC-32s zipfile computed from
  the zip's directory, SHA-256 of state.json), and what a resume spends verifying
  a checkpoint before it picks it (`resume_checkpoint`: a full CRC-32 pass over
  arrays.npz, done once per resume);
- baseline: `model.save_weights(...weights.h5)` / `model.load_weights` (what
  `BackupAndRestore` does: in place, not fsynced, same variables incl. optimizer);
- sizes on disk.

The target: async blocks the loop for < 10% of the sync save time. The JSON
also gives the loop's full cost of an async save (blocked + copy-on-write).

`--case tiny`: the per-epoch commit of a sub-millisecond model (the MLP
64-128-128-10 + Adam of `callback_overhead.py --case tiny`), where `fsync`
dominates: `Checkpoint.on_epoch_end` timed inside a `fit` of one step an
epoch, with the number of `os.fsync` calls and the time in them, against
Keras's `BackupAndRestore.on_epoch_end` (medians over `--saves`, the first
epoch not counted).

Usage: `python bench/checkpoint_io.py [--repeats 3] [--case tiny --saves 30]`.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import zipfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from trainwell.callbacks import checkpoint as ckpt_mod  # noqa: E402
from trainwell.callbacks.checkpoint import files as ckpt_files  # noqa: E402
from trainwell.callbacks.checkpoint import state as ckpt_state  # noqa: E402
from trainwell.callbacks.checkpoint import Checkpoint, latest_checkpoint, load_checkpoint  # noqa: E402


def _du(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def tiny(saves: int) -> dict:
    """`Checkpoint.on_epoch_end` of a tiny MLP in a `fit`, its `fsync`s, and `BackupAndRestore`'s."""
    real_fsync = os.fsync
    counter = [0, 0.0]

    def counting_fsync(fd):
        t = time.perf_counter()
        real_fsync(fd)
        counter[0] += 1
        counter[1] += time.perf_counter() - t

    def timed(cls):
        class Timed(cls):
            times, fsyncs, fsync_s = [], [], []

            def on_epoch_end(self, epoch, logs=None):
                counter[:] = [0, 0.0]
                os.fsync = counting_fsync
                t = time.perf_counter()
                try:
                    super().on_epoch_end(epoch, logs)
                finally:
                    os.fsync = real_fsync
                if epoch > 0:  # the first save traces the compiled read
                    self.times.append(time.perf_counter() - t)
                    self.fsyncs.append(counter[0])
                    self.fsync_s.append(counter[1])

        return Timed

    keras.utils.set_random_seed(0)
    x = tf.random.normal((128, 64)).numpy()
    y = (tf.range(128) % 10).numpy()
    res: dict = {}
    root = tempfile.mkdtemp(prefix="trainwell-bench-ckpt-tiny-")
    try:
        for name, cls, kwargs in (
            ("ours", Checkpoint, {}),
            ("keras_backup_and_restore", keras.callbacks.BackupAndRestore, {"delete_checkpoint": False}),
        ):
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                                      keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
            model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            cb = timed(cls)(os.path.join(root, name), **kwargs)
            model.fit(x, y, batch_size=128, epochs=saves + 1, verbose=0, callbacks=[cb])
            res[f"{name}_epoch_end_ms"] = 1e3 * statistics.median(cb.times)
            res[f"{name}_fsyncs_per_save"] = statistics.median(cb.fsyncs)
            res[f"{name}_fsync_ms_per_save"] = 1e3 * statistics.median(cb.fsync_s)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "benchmark": "checkpoint_io",
        "case": "tiny",
        "model": "MLP 64-128-128-10 + Adam, one step an epoch",
        "saves": saves,
        **{k: round(v, 3) for k, v in res.items()},
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "keras": keras.__version__,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--case", choices=("resnet50", "tiny"), default="resnet50")
    p.add_argument("--saves", type=int, default=30, help="--case tiny: timed epoch commits")
    args = p.parse_args()
    if args.case == "tiny":
        print(json.dumps(tiny(args.saves), indent=2))
        return

    keras.utils.set_random_seed(0)
    t0 = time.perf_counter()
    model = keras.applications.ResNet50(weights=None)
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), loss="sparse_categorical_crossentropy")
    model.optimizer.build(model.trainable_variables)
    build_s = time.perf_counter() - t0
    n_floats = sum(int(v.numpy().size) for v in model.variables) + sum(
        int(v.numpy().size) for v in model.optimizer.variables
    )

    root = tempfile.mkdtemp(prefix="trainwell-bench-ckpt-")
    try:
        res: dict = {}
        # --- ours, sync (first save is separate: it walks the model once)
        sync = Checkpoint(os.path.join(root, "sync"), keep_last=1)
        sync.set_model(model)
        t = time.perf_counter()
        sync.save()
        res["ours_first_save_s"] = time.perf_counter() - t
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            sync.save()
            times.append(time.perf_counter() - t)
        res["ours_sync_save_s"] = statistics.median(times)
        ckpt_path = latest_checkpoint(os.path.join(root, "sync"))
        res["ours_size_mb"] = _du(ckpt_path) / 2**20

        # --- ours, async: blocked time vs time to commit
        asy = Checkpoint(os.path.join(root, "async"), keep_last=1, async_save=True)
        asy.set_model(model)
        asy.save()
        asy.wait()
        blocked, total = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            asy.save()
            blocked.append(time.perf_counter() - t)
            asy.wait()
            total.append(time.perf_counter() - t)
        res["ours_async_blocked_s"] = statistics.median(blocked)
        res["ours_async_total_s"] = statistics.median(total)
        res["async_blocked_fraction_of_sync"] = res["ours_async_blocked_s"] / res["ours_sync_save_s"]

        # --- copy-on-write cost paid by the training step that overlaps the background write
        zeros = [tf.zeros_like(v) for v in model.trainable_variables]

        @tf.function
        def update():
            model.optimizer.apply(zeros, model.trainable_variables)

        update()
        plain, during, held = [], [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            update()
            plain.append(time.perf_counter() - t)
            snapshot = ckpt_state.capture(asy._plan(), weights_only=False, include_metrics=False)
            t = time.perf_counter()
            update()  # copy-on-write only: the snapshot is held, nothing is being written
            held.append(time.perf_counter() - t)
            del snapshot
            asy.save()
            t = time.perf_counter()
            update()  # copy-on-write + CPU contention with the writer thread
            during.append(time.perf_counter() - t)
            asy.wait()
        res["update_s"] = statistics.median(plain)
        res["update_with_snapshot_held_s"] = statistics.median(held)
        res["update_during_async_write_s"] = statistics.median(during)
        res["ours_async_loop_cost_s"] = res["ours_async_blocked_s"] + max(
            0.0, res["update_during_async_write_s"] - res["update_s"]
        )
        res["async_loop_cost_fraction_of_sync"] = res["ours_async_loop_cost_s"] / res["ours_sync_save_s"]

        # --- restore
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            load_checkpoint(ckpt_path, model, include_optimizer=True)
            times.append(time.perf_counter() - t)
        res["ours_restore_s"] = statistics.median(times)

        # --- checksums: the part of a save they cost, and a resume's verification
        state = json.loads((Path(ckpt_path) / ckpt_mod.STATE_FILE).read_text())
        seal_t, verify_t = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            with zipfile.ZipFile(Path(ckpt_path) / ckpt_mod.ARRAYS_FILE) as zf:
                state["arrays_crc32"] = ckpt_files.zip_crcs(zf)
            ckpt_files.seal(state)
            seal_t.append(time.perf_counter() - t)
            ckpt_files._verification.cache_clear()
            t = time.perf_counter()
            ckpt_mod.resume_checkpoint(os.path.join(root, "sync"))
            verify_t.append(time.perf_counter() - t)
        res["ours_checksum_on_save_s"] = statistics.median(seal_t)
        res["ours_verify_on_resume_s"] = statistics.median(verify_t)

        # --- baseline: Keras .weights.h5 (in place, no fsync)
        h5 = os.path.join(root, "baseline.weights.h5")
        save_t, load_t = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            model.save_weights(h5)
            save_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            model.load_weights(h5)
            load_t.append(time.perf_counter() - t)
        res["keras_save_weights_s"] = statistics.median(save_t)
        res["keras_load_weights_s"] = statistics.median(load_t)
        res["keras_size_mb"] = _du(h5) / 2**20
    finally:
        shutil.rmtree(root, ignore_errors=True)

    out = {
        "benchmark": "checkpoint_io",
        "model": "ResNet50(weights=None) + SGD(momentum=0.9), optimizer built",
        "state_floats_millions": round(n_floats / 1e6, 2),
        "repeats": args.repeats,
        "build_s": round(build_s, 2),
        **{k: round(v, 4) for k, v in res.items()},
        "target_async_blocked_lt_10pct_of_sync": res["async_blocked_fraction_of_sync"] < 0.10,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "keras": keras.__version__,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
