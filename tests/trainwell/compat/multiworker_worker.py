"""One worker of a loopback `MultiWorkerMirroredStrategy` job, used by test_keras_fixes.py.

The parent sets `TF_CONFIG` (cluster on 127.0.0.1, this task's index). The worker
limits TensorFlow to one thread, makes the strategy with
`trainwell.runtime.make_strategy("multiworker")` (which applies
`trainwell.compat.keras_fixes`), then removes the fixes named in the environment variable
`TRAINWELL_DISABLE_KERAS_FIXES` (comma-separated), trains a tiny seeded classifier
with `model.fit` (global batch 32 over 2 replicas, DATA sharding) and writes a JSON
summary to the path given as the only argument:
`{"task": i, "fixes": [...], "history": {...}, "weights": [[...], ...]}`
(weights flattened, one list per array).
Without `TF_CONFIG` it runs the same training in one process under
`make_strategy("cpu:2")` (same global batch and seed; `"task": -1`), the
reference the multi-worker results are compared with.
On an exception it writes `{"task": i, "fixes": [...], "error": "Type: message",
"frames": [function names of the traceback]}`
and exits 3.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

GLOBAL_BATCH = 32
N_EXAMPLES = 256
EPOCHS = 2


def make_data():
    import numpy as np

    rs = np.random.RandomState(0)
    x = rs.randn(N_EXAMPLES, 8).astype("float32")
    y = (x @ rs.randn(8, 3)).argmax(axis=1).astype("int64")
    return x, y


def main(out_path: str) -> int:
    tf_config = os.environ.get("TF_CONFIG")
    task = json.loads(tf_config)["task"]["index"] if tf_config else -1
    summary: dict = {"task": task}
    try:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        import keras

        keras.config.disable_traceback_filtering()  # keep Keras's frames in the reported traceback
        from trainwell import runtime
        from trainwell.compat import keras_fixes

        strategy = runtime.make_strategy("multiworker" if tf_config else "cpu:2")
        disable = [n for n in os.environ.get("TRAINWELL_DISABLE_KERAS_FIXES", "").split(",") if n]
        keras_fixes.remove(disable)
        summary["fixes"] = list(keras_fixes.applied())
        summary["replicas"] = int(strategy.num_replicas_in_sync)

        keras.utils.set_random_seed(7)
        x, y = make_data()
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
        ds = ds.with_options(options)

        with strategy.scope():
            model = keras.Sequential(
                [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]
            )
            model.compile(
                optimizer=keras.optimizers.SGD(0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
        hist = model.fit(ds, epochs=EPOCHS, verbose=0)
        summary["history"] = {k: [float(v) for v in vs] for k, vs in hist.history.items()}
        summary["weights"] = [w.ravel().tolist() for w in model.get_weights()]
        code = 0
    except Exception as e:  # reported to the parent, which asserts on it
        summary["error"] = f"{type(e).__name__}: {e}"[:4000]
        summary["frames"] = [f.name for f in traceback.extract_tb(e.__traceback__)]
        code = 3
    with open(out_path + ".tmp", "w") as f:
        json.dump(summary, f)
    os.replace(out_path + ".tmp", out_path)
    sys.stdout.flush()
    # Skip interpreter teardown: gRPC/collective threads can hang at exit once the peer is gone.
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
