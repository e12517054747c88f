"""Mid-epoch resume: time to the resumed step's first batch at 10 % and at 90 % of an epoch (#35.4).

Writes 10,000 small JPEGs (default 48x40 px, textured) as one ImageNet-layout TFRecord
shard (`train-00000-of-00001`), then builds the ResNet recipe's training pipeline on it
(`build_image_datasets("tfrecord:DIR", 32, 100, augment="inception")`: 100 batches an
epoch), makes epoch 0's iterator (what `harness.advance_epochs` does on a resume in epoch
1), and times, for a resume after 10 and after 90 of the 100 batches, the wall time from
making the resumed epoch's iterator to the first batch the resumed run trains on:

- `replay` (before #35.4, and still the path of any dataset a recipe did not build):
  `Checkpoint` takes the batches already trained from the iterator (read, decoded,
  augmented, thrown away), then the next one;
- `skip` (the recipe's pipeline now): `start_at` set to the examples already trained;
  they are read and checked but dropped before decoding, and the first batch is the one
  the resumed step trains on.

Each case builds its pipeline afresh and runs `--rounds` times (median). Prints one JSON
object: seconds per case, the 90 %/10 % ratio of each path (target for `skip`: <= 1.2)
and a check that both paths give the same first batch. Run: `python bench/resume_position.py`
(options: `--images N`, `--rounds N`, `--side PX`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from trainwell.data.epoch_start import EpochStart  # noqa: E402
from trainwell.data.images import build_image_datasets  # noqa: E402

BATCH, SIDE_OUT = 100, 32


def write_shard(directory: str, n: int, side: int) -> None:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (side, side + 8, 3), dtype=np.uint8)
    path = os.path.join(directory, "train-00000-of-00001")
    with tf.io.TFRecordWriter(path) as w:
        for i in range(n):
            image = np.roll(base, i % side, axis=0) ^ np.uint8(i % 251)
            data = tf.io.encode_jpeg(image, quality=90).numpy()
            ex = tf.train.Example(features=tf.train.Features(feature={
                "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[data])),
                "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[1 + i % 10])),
            }))
            w.write(ex.SerializeToString())


def first_batch(source: str, n: int, done: int, path: str) -> tuple[float, np.ndarray]:
    """Seconds from making the resumed epoch's iterator to the first batch trained after `done` batches."""
    kw = dict(image_size=SIDE_OUT, global_batch_size=BATCH, augment="inception", num_classes=10,
              num_examples={"train": n, "val": 0, "test": 0}, val_fraction=0.0, test_fraction=0.0)
    if path == "skip":
        start = EpochStart(epoch=1, examples=done * BATCH)
        data = build_image_datasets(source, start_at=start.variable, **kw)
        iter(data.train)  # epoch 0 (advance_epochs)
        start.set_epoch(1)
        t = time.perf_counter()
        batch = next(iter(data.train))[0].numpy()
    else:
        data = build_image_datasets(source, **kw)
        iter(data.train)
        t = time.perf_counter()
        it = iter(data.train)
        for _ in range(done):
            next(it)
        batch = next(it)[0].numpy()
    return time.perf_counter() - t, batch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--side", type=int, default=48)
    args = p.parse_args(argv)
    steps = args.images // BATCH
    at = {"10%": steps // 10, "90%": steps * 9 // 10}
    with tempfile.TemporaryDirectory() as d:
        write_shard(d, args.images, args.side)
        source = f"tfrecord:{d}"
        times = {path: {k: [] for k in at} for path in ("replay", "skip")}
        same = True
        for _ in range(args.rounds):
            for k, done in at.items():
                t_replay, a = first_batch(source, args.images, done, "replay")
                t_skip, b = first_batch(source, args.images, done, "skip")
                times["replay"][k].append(t_replay)
                times["skip"][k].append(t_skip)
                same = same and bool(np.array_equal(a, b))
    out = {"images": args.images, "batch": BATCH, "steps_per_epoch": steps, "side_px": args.side,
           "output_px": SIDE_OUT, "rounds": args.rounds, "same_first_batch": same}
    for path, cases in times.items():
        med = {k: statistics.median(v) for k, v in cases.items()}
        out[path] = {**{f"seconds_at_{k}": round(v, 4) for k, v in med.items()},
                     "ratio_90_over_10": round(med["90%"] / med["10%"], 3)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
