"""Checkpoint save + restore of one training state: a local S3 server (moto) vs local disk, in one run.

Model: an MLP of `--width` (3 Dense layers of width x width) + Adam, optimizer
built, so the state is weights + two Adam slots (~`3 * 3 * width^2` floats:
width 1024 is 36 MB). Each round, alternating the two backends:

- save: `Checkpoint.save()` (disk: temp dir, fsync, rename, index; S3: two PUTs
  under a fresh prefix, then the index PUT);
- restore: `load_checkpoint(directory, model, include_optimizer=True)` (the
  index read, the checkpoint read and verified, the arrays assigned).

The S3 server is moto's standalone server on 127.0.0.1 (`moto[server]`, its own process), reached
through `AWS_ENDPOINT_URL` as a user's MinIO would be; it keeps objects in
memory, so the figures are the protocol's and the client's cost, not a
network's. The target: S3 within 1.5x of disk (`ratio_*`).

Usage: `python bench/checkpoint_store.py [--width 1024] [--rounds 3]`. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import boto3  # noqa: E402
import keras  # noqa: E402

from bench._common import log, machine_info, print_json, ratio, rnd  # noqa: E402
from trainwell.callbacks.checkpoint import Checkpoint, load_checkpoint  # noqa: E402


def _model(width: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((width,))] + [keras.layers.Dense(width) for _ in range(3)])
    model.compile(keras.optimizers.Adam(1e-3), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


def _round(directory: str, model, other) -> tuple[float, float]:
    ckpt = Checkpoint(directory, verbose=0)
    ckpt.set_model(model)
    t0 = time.perf_counter()
    ckpt.save()
    t1 = time.perf_counter()
    load_checkpoint(directory, other, include_optimizer=True)
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # its own process, as a real server is (in this process it would compete for the GIL)
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1")
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    model, other = _model(args.width), _model(args.width)
    n_floats = sum(int(v.numpy().size) for v in model.variables + model.optimizer.variables)
    times = {"disk": {"save": [], "restore": []}, "s3": {"save": [], "restore": []}}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            _round(f"{tmp}/warm", model, other)  # imports, first-use costs
            _round("s3://bench/warm", model, other)
            for i in range(args.rounds):
                for kind, directory in (("disk", f"{tmp}/run{i}"), ("s3", f"s3://bench/run{i}")):
                    save, restore = _round(directory, model, other)
                    times[kind]["save"].append(save)
                    times[kind]["restore"].append(restore)
                    log(f"round {i} {kind}: save {save:.3f}s restore {restore:.3f}s")
    finally:
        server.terminate()
        server.wait()
    med = {k: {op: statistics.median(v) for op, v in ops.items()} for k, ops in times.items()}
    print_json({
        "benchmark": "checkpoint_store",
        "state_mb": rnd(n_floats * 4 / 2**20, 1),
        "rounds": args.rounds,
        "disk_s": {op: rnd(v, 3) for op, v in med["disk"].items()},
        "s3_s": {op: rnd(v, 3) for op, v in med["s3"].items()},
        "ratio_save": ratio(med["s3"]["save"], med["disk"]["save"]),
        "ratio_restore": ratio(med["s3"]["restore"], med["disk"]["restore"]),
        "ratio_total": ratio(sum(med["s3"].values()), sum(med["disk"].values())),
        "target_ratio": 1.5,
        "machine": machine_info(),
    })


if __name__ == "__main__":
    main()
