"""Subprocess used by test_checkpoint.py: a tiny seeded run that can be killed.

Trains a small dropout MLP on (features, example id) pairs from a seeded
`shuffle(seed).repeat()` stream with `Checkpoint(save_every=N)`, and appends
`<global step> <ids...>` to `--ids` after every trained step (a resumed epoch's
batches trained before the kill reach no callback: a batch end without ids fails). Ways to die:

- `--kill-at-step K`: SIGKILL itself right after step K is logged (with
  `--spe N`, batch callbacks, and so the log, come every N steps).
- `--sigterm-at-step K`: send itself SIGTERM after step K (the checkpoint writes
  and exits with `Checkpoint.PREEMPTED_EXIT_CODE`).
- `--pause-at-save N --marker PATH`: the N-th save of this process stalls after
  writing its files and before the commit rename, after touching PATH, so the
  test can SIGKILL it mid-save.

On completion the final weights go to `--out` (.npz) and a JSON summary to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--ids", required=True)
    p.add_argument("--out", default=None)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--steps-per-epoch", type=int, default=6)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--kill-at-step", type=int, default=None)
    p.add_argument("--sigterm-at-step", type=int, default=None)
    p.add_argument("--pause-at-save", type=int, default=None)
    p.add_argument("--marker", default=None)
    p.add_argument("--spe", type=int, default=1, help="steps_per_execution (ids are logged for its last step)")
    args = p.parse_args(argv)

    import keras
    import numpy as np
    import tensorflow as tf

    from trainwell.callbacks.checkpoint import Checkpoint
    from trainwell.callbacks.checkpoint import files as ckpt_files
    from trainwell.callbacks.early_stopping import EarlyStopping
    from trainwell.compat.backend import StateReader, build_before_fit

    keras.utils.set_random_seed(1234)
    tf.config.experimental.enable_op_determinism()

    n, batch = 48, 8
    rs = np.random.RandomState(0)
    feats = rs.randn(n, 4).astype("float32")
    targets = (feats @ rs.randn(4, 1) + 0.1 * rs.randn(n, 1)).astype("float32")
    X, Y = tf.constant(feats), tf.constant(targets)

    ds = (
        tf.data.Dataset.range(n)
        .shuffle(n, seed=7, reshuffle_each_iteration=True)
        .repeat()
        .batch(batch, drop_remainder=True)
        .map(lambda ids: ((tf.gather(X, ids), ids), tf.gather(Y, ids)))
    )

    class IdModel(keras.Model):
        def __init__(self):
            super().__init__()
            self.d1 = keras.layers.Dense(16, activation="relu")
            self.drop = keras.layers.Dropout(0.25)
            self.d2 = keras.layers.Dense(1)

        def call(self, x, training=False):
            if isinstance(x, (tuple, list)):
                x = x[0]
            return self.d2(self.drop(self.d1(x), training=training))

        def train_step(self, *args):  # TensorFlow: (data) -> logs; JAX: (state, data) -> (logs, state)
            *state, ((x, ids), y) = args
            out = super().train_step(*state, (x, y))
            logs, new_state = (out, None) if not state else out
            logs = dict(logs)
            logs["ids"] = ids
            return logs if not state else (logs, new_state)

    model = IdModel()
    model(np.zeros((1, 4), "float32"))  # build the sublayers
    model.compile(keras.optimizers.Adam(0.01), loss="mse", steps_per_execution=args.spe)

    class LogIds(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.f = open(args.ids, "a", buffering=1)

        def on_train_batch_end(self, batch, logs=None):
            ids = logs["ids"]  # every batch end is a trained step's
            step = int(np.asarray(StateReader(self.model, [self.model.optimizer.iterations])()[0]))
            self.f.write(f"{step} " + " ".join(str(int(i)) for i in np.asarray(ids).ravel()) + "\n")
            self.f.flush()
            if args.kill_at_step is not None and step == args.kill_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if args.sigterm_at_step is not None and step == args.sigterm_at_step:
                os.kill(os.getpid(), signal.SIGTERM)

    if args.pause_at_save is not None:
        calls = {"n": 0}

        real_commit = ckpt_files.commit_directory

        def stall(tmp_dir, final):  # written, not yet fsynced nor renamed into place
            calls["n"] += 1
            if calls["n"] == args.pause_at_save:
                with open(args.marker, "w") as f:
                    f.write(str(tmp_dir))
                time.sleep(120)
            real_commit(tmp_dir, final)

        ckpt_files.commit_directory = stall

    callbacks = [
        Checkpoint(args.dir, save_every=args.save_every, keep_last=3, keep_best=1, monitor="loss"),
        EarlyStopping(monitor="loss", patience=100),
        LogIds(),
    ]
    build_before_fit(model, ds)  # on JAX, the same data order as on TensorFlow
    model.fit(
        ds,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        callbacks=callbacks,
        verbose=0,
    )
    if args.out:
        np.savez(args.out, *[np.asarray(w) for w in model.get_weights()])
    print(json.dumps({"iterations": int(model.optimizer.iterations.numpy())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
