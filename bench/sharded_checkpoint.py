"""Checkpoint of state sharded across two JAX processes: Orbax per-process shards vs gathered on every process.

Model: `--layers` Dense layers of `--width` x `--width` (float32) whose kernels
are split over a `1 x 8` mesh (`ModelParallel`, the `model` axis spanning both
processes: each process holds half of every kernel), with Adam built, so the
state is weights + two Adam slots (`3 * layers * width^2 * 4` bytes: the
defaults, 3 x 8192^2, are 2.25 GiB). Two processes of 4 virtual CPU devices each
(`jax.distributed` on 127.0.0.1, started by `trainwell.launch`), for each of two
ways to write the same state, each in fresh processes:

- `sharded`: what `Checkpoint` does (`trainwell.compat.sharded`): every process
  writes the shards it owns with Orbax; the restore reads each array into the
  variable's sharding.
- `gathered`: the same `Checkpoint` with each sharded array first gathered with
  `jax.experimental.multihost_utils.process_allgather` (JAX has no gather to one
  process: every process receives the whole array) and written by the chief into
  `arrays.npz`, as trainwell wrote replicated state before; the restore reads the
  whole arrays.npz on every process and lets Keras lay each array out.

Per process: `save_s` (`Checkpoint.save()`), `restore_s` (`load_checkpoint(...,
include_optimizer=True)`, in new processes), `own_shard_mb` (this process's share
of the state), `base_mb` (RSS with TensorFlow, Keras and JAX loaded and the processes
joined, before the model is built), `resident_mb` (RSS with the
state built: on a CPU the devices' memory is the host's), `peak_save_mb` and
`peak_restore_mb` (peak RSS, `ru_maxrss`). The issue's target: peak RSS per process
no more than its own shard + 20 % above its baseline; write time no worse than gathered.

Usage: `python bench/sharded_checkpoint.py [--width 8192] [--layers 3]`. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(mode: str, phase: str, directory: str, width: int, layers: int, out: str) -> None:
    import jax
    import keras
    from jax.experimental import multihost_utils

    from trainwell import runtime
    from trainwell.callbacks import Checkpoint, load_checkpoint
    from trainwell.callbacks.checkpoint import writer
    from trainwell.compat import sharded

    keras.distribution.initialize()
    base = _rss_mb()  # TensorFlow, Keras, JAX and the distributed client loaded; no state yet
    mesh = keras.distribution.DeviceMesh((1, 8), ("batch", "model"), devices=jax.devices())
    layouts = keras.distribution.LayoutMap(mesh)
    layouts[".*kernel"] = (None, "model")
    strategy = runtime.make_strategy(keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch"))
    with strategy.scope():
        model = keras.Sequential([keras.Input((width,))] + [
            keras.layers.Dense(width, use_bias=False, kernel_initializer="ones") for _ in range(layers)])
        model.compile(keras.optimizers.Adam(1e-3), "mse")
        model.optimizer.build(model.trainable_variables)
    runtime.sync_workers(strategy)
    resident = _rss_mb()
    if mode == "gathered":
        def gather_all(arrays):
            got, rest = sharded.split_sharded(arrays)
            rest.update({k: multihost_utils.process_allgather(v, tiled=True) for k, v in got.items()})
            return {}, rest
        writer.split_sharded = gather_all
    t0 = time.perf_counter()
    if phase == "save":
        ckpt = Checkpoint(directory, verbose=0)
        ckpt.set_model(model)
        ckpt.save()
    else:
        load_checkpoint(directory, model, include_optimizer=True)
    seconds = time.perf_counter() - t0
    runtime.sync_workers(strategy)
    state_bytes = sum(v.value.nbytes for v in model.weights + model.optimizer.variables)
    with open(os.path.join(out, f"{mode}-{phase}-{jax.process_index()}.json"), "w") as f:
        json.dump({"seconds": seconds, "base_mb": base, "resident_mb": resident, "peak_mb": _peak_mb(),
                   "own_shard_mb": state_bytes / jax.process_count() / 2**20, "state_mb": state_bytes / 2**20}, f)


def main() -> None:
    from bench._common import log, machine_info, print_json, ratio, rnd
    from trainwell import launch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=8192)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--worker", nargs=4, metavar=("MODE", "PHASE", "DIR", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(*args.worker[:3], args.width, args.layers, args.worker[3])
        return
    env = {"KERAS_BACKEND": "jax", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    rows = {}
    with tempfile.TemporaryDirectory(prefix="trainwell-bench-sharded-") as tmp:
        for mode in ("sharded", "gathered"):
            directory = os.path.join(tmp, mode)
            for phase in ("save", "restore"):
                log(f"{mode} {phase} ...")
                code = launch.launch(
                    [sys.executable, __file__, "--width", str(args.width), "--layers", str(args.layers),
                     "--worker", mode, phase, directory, tmp], workers=2, env=env, timeout_s=1200,
                    stream_chief=False, peer_grace_s=10)
                if code != 0:
                    raise SystemExit(f"{mode} {phase}: the workers exited with {code}")
                rows[mode, phase] = [json.loads(Path(tmp, f"{mode}-{phase}-{i}.json").read_text()) for i in (0, 1)]
    out = {"bench": "sharded_checkpoint", "machine": machine_info(), "width": args.width, "layers": args.layers,
           "state_mb": rnd(rows["sharded", "save"][0]["state_mb"], 1), "processes": 2, "devices": 8}
    for mode in ("sharded", "gathered"):
        save, restore = rows[mode, "save"], rows[mode, "restore"]
        out[mode] = {
            "save_s": rnd(max(r["seconds"] for r in save), 2),
            "restore_s": rnd(max(r["seconds"] for r in restore), 2),
            "per_process": [{
                "own_shard_mb": rnd(s["own_shard_mb"], 1), "base_mb": rnd(s["base_mb"], 1),
                "resident_mb": rnd(s["resident_mb"], 1), "peak_save_mb": rnd(s["peak_mb"], 1),
                "peak_restore_mb": rnd(r["peak_mb"], 1),
                # the measure: (peak - baseline) / own shard; <= 1.2 is its target
                "save_over_base_per_shard": ratio(s["peak_mb"] - s["base_mb"], s["own_shard_mb"]),
                "restore_over_base_per_shard": ratio(r["peak_mb"] - r["base_mb"], r["own_shard_mb"]),
                # what the save itself adds to the built state, per own shard
                "save_over_resident_per_shard": ratio(s["peak_mb"] - s["resident_mb"], s["own_shard_mb"]),
            } for s, r in zip(save, restore)],
        }
    out["save_ratio_sharded_to_gathered"] = ratio(out["sharded"]["save_s"], out["gathered"]["save_s"])
    out["restore_ratio_sharded_to_gathered"] = ratio(out["sharded"]["restore_s"], out["gathered"]["restore_s"])
    print_json(out)


if __name__ == "__main__":
    main()
