"""Multi-worker scaling: 1 process vs 2 workers on 127.0.0.1, same per-replica batch.

Ours: `trainwell.launch` starting 2 `MultiWorkerMirroredStrategy` workers (one
replica each, global batch = 2 x per-replica batch) training a small CNN with
`model.fit`. Baseline: the same model and per-replica batch in one process with
the default strategy. Every process is limited to `--threads` TensorFlow threads
(default 1), so 2 workers use at most twice the cores of the single process.

Reported: examples/s (steps/s x global batch) of each, measured on the steps
after `--warmup` steps; scaling efficiency = (2-worker examples/s) / (2 x
1-process examples/s); 1.0 is perfect linear scaling. The loopback "network"
costs little, so the gap is the all-reduce, the synchronisation of the two
processes and, on a shared machine, the cores being busy with other work.
Configurations alternate for `--rounds` rounds (the machines here are shared).

Usage: python bench/scaling.py [--batch 32] [--steps 60] [--warmup 10] [--rounds 2] [--threads 1]
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._common import log, print_json, rnd  # noqa: E402

WORKER = r'''
import json, os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np
import tensorflow as tf
threads = int(sys.argv[5])
tf.config.threading.set_intra_op_parallelism_threads(threads)
tf.config.threading.set_inter_op_parallelism_threads(threads)
import keras
from trainwell import runtime

out, per_replica, steps, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
strategy = runtime.make_strategy("multiworker" if os.environ.get("TF_CONFIG") else "one_device")
n = strategy.num_replicas_in_sync
gb = per_replica * n
keras.utils.set_random_seed(0)
rs = np.random.RandomState(0)
x = rs.rand(gb * 8, 28, 28, 1).astype("float32")
y = rs.randint(0, 10, gb * 8)
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(gb, drop_remainder=True).repeat()
opt = tf.data.Options()
opt.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
ds = ds.with_options(opt)
with strategy.scope():
    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Flatten(), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10),
    ])
    model.compile(keras.optimizers.SGD(0.01 * n), keras.losses.SparseCategoricalCrossentropy(from_logits=True))

class Timer(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == warmup:
            self.t0, self.c0 = time.perf_counter(), time.process_time()
        if batch + 1 == steps:
            self.t1, self.c1 = time.perf_counter(), time.process_time()

t = Timer()
model.fit(ds, epochs=1, steps_per_epoch=steps, callbacks=[t], verbose=0)
task = json.loads(os.environ["TF_CONFIG"])["task"]["index"] if os.environ.get("TF_CONFIG") else -1
res = {"task": task, "replicas": n, "global_batch": gb, "seconds": t.t1 - t.t0, "cpu_seconds": t.c1 - t.c0,
       "steps": steps - warmup}
with open(f"{out}-{task}.json", "w") as f:
    json.dump(res, f)
os._exit(0)
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32, help="per-replica batch size")
    ap.add_argument("--steps", type=int, default=60, help="steps per measurement (incl. warmup)")
    ap.add_argument("--warmup", type=int, default=10, help="steps not timed")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="TensorFlow threads per process")
    args = ap.parse_args()
    if args.warmup >= args.steps:
        ap.error(f"--warmup must be < --steps. Received: warmup={args.warmup}, steps={args.steps}")
    from trainwell import launch

    tmp = Path(tempfile.mkdtemp(prefix="trainwell-bench-scaling-"))
    script = tmp / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    cmd_args = [str(args.batch), str(args.steps), str(args.warmup), str(args.threads)]
    single, multi = [], []
    for r in range(args.rounds):
        log(f"round {r + 1}/{args.rounds}: 1 process")
        out = str(tmp / f"single{r}")
        subprocess.run([sys.executable, str(script), out, *cmd_args], env=env, check=True, timeout=600)
        s = json.loads(Path(f"{out}--1.json").read_text())
        single.append(s["steps"] * s["global_batch"] / s["seconds"])
        log(f"  {single[-1]:.1f} examples/s ({s['steps'] / s['seconds']:.2f} steps/s)")
        log(f"round {r + 1}/{args.rounds}: 2 workers on 127.0.0.1")
        out = str(tmp / f"multi{r}")
        code = launch.launch([sys.executable, str(script), out, *cmd_args], 2, env={"TF_CPP_MIN_LOG_LEVEL": "3"},
                             timeout_s=600, stream_chief=False, log_dir=tmp / f"logs{r}")
        if code != 0:
            raise SystemExit(f"the 2-worker run failed with status {code}; logs in {tmp / f'logs{r}'}")
        w = [json.loads(Path(f"{out}-{i}.json").read_text()) for i in range(2)]
        seconds = max(x["seconds"] for x in w)
        multi.append(w[0]["steps"] * w[0]["global_batch"] / seconds)
        log(f"  {multi[-1]:.1f} examples/s ({w[0]['steps'] / seconds:.2f} steps/s)")
    best_single, best_multi = max(single), max(multi)
    print_json({
        "benchmark": "scaling",
        "per_replica_batch": args.batch,
        "threads_per_process": args.threads,
        "timed_steps": args.steps - args.warmup,
        "one_process_examples_per_s": [rnd(v, 1) for v in single],
        "two_workers_examples_per_s": [rnd(v, 1) for v in multi],
        "one_process_steps_per_s": [rnd(v / args.batch, 2) for v in single],
        "two_workers_steps_per_s": [rnd(v / (2 * args.batch), 2) for v in multi],
        "speedup_best": rnd(best_multi / best_single, 3),
        "scaling_efficiency_best": rnd(best_multi / (2 * best_single), 3),
        "cpu_count": os.cpu_count(),
        "load_average": [rnd(x, 2) for x in os.getloadavg()],
    })


if __name__ == "__main__":
    main()
