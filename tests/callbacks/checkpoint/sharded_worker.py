"""One process of test_sharded_state.py: a Keras model on ModelParallel, its state sharded across processes.

argv: MODE OUT. MODE `full` trains 2 epochs x 4 steps uninterrupted; `crash` does the same but
both processes exit while committing the checkpoint of step 6 (after every process wrote its
shards, before the chief commits); `resume` is `full` again, resuming; `load` (one process, eight
devices, another mesh) loads the newest checkpoint. Each writes every variable's gathered value
(`<MODE>.npz`, process 0) and what it saw (`<MODE>-<process>.json`).
"""

import json
import os
import sys

import jax
import keras
import numpy as np
import tensorflow as tf
from jax.experimental import multihost_utils

from trainwell import runtime
from trainwell.callbacks import Checkpoint, load_checkpoint
from trainwell.callbacks.checkpoint import writer

mode, out = sys.argv[1], sys.argv[2]
if mode != "load":
    keras.distribution.initialize()  # from the launcher's KERAS_DISTRIBUTION_* variables
shape = (2, 4) if mode == "load" else (1, 8)  # 1 x 8 over two processes: each holds half of every kernel
mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"), devices=jax.devices())
layouts = keras.distribution.LayoutMap(mesh)
layouts[".*d1/kernel"], layouts[".*d1/bias"], layouts[".*d2/kernel"] = (None, "model"), ("model",), ("model", None)
strategy = runtime.make_strategy(keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch"))
keras.utils.set_random_seed(1)
with strategy.scope():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, name="d1", activation="relu"),
                              keras.layers.Dropout(0.2), keras.layers.Dense(4, name="d2")])
    model.compile(keras.optimizers.Adam(1e-2), "mse")
rng = np.random.default_rng(0)
x, y = rng.normal(size=(64, 16)).astype("float32"), rng.normal(size=(64, 4)).astype("float32")
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)
seen = {"batches": 0, "sharded_keys": []}


def dump(name):
    variables = model.weights + model.optimizer.variables
    values = {v.path.replace("/", "|"): np.asarray(multihost_utils.process_allgather(v.value, tiled=True))
              for v in variables}
    if jax.process_index() == 0:
        np.savez(os.path.join(out, name), **values)
    seen["local_only"] = [v.path for v in model.weights if not v.value.is_fully_addressable
                          and not v.value.is_fully_replicated]
    with open(os.path.join(out, f"{name}-{jax.process_index()}.json"), "w") as f:
        json.dump(seen, f)


if mode == "load":
    load_checkpoint(os.path.join(out, "ckpt"), model, include_optimizer=True)
    dump("load")
    sys.exit(0)

save_sharded = writer.save_sharded


def save_then_maybe_die(path, arrays, names):
    manifest = save_sharded(path, arrays, names)
    seen["sharded_keys"] = sorted(manifest)
    if mode == "crash" and "ckpt-6" in str(path):
        os._exit(3)  # every process wrote its shards; nothing is committed
    return manifest


writer.save_sharded = save_then_maybe_die


class Count(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        seen["batches"] += 1


directory = os.path.join(out, "full_ckpt" if mode == "full" else "ckpt")
with runtime.fit_scope(strategy):
    model.fit(data, epochs=2, steps_per_epoch=4, verbose=0,
              callbacks=[Checkpoint(directory, save_every=3, monitor="loss", verbose=0), Count()])
dump(mode)
