"""Training input pipeline throughput: trainwell's vs a naive tf.data pipeline.

Writes ~200 ImageNet-sized JPEGs (about 400x350, textured so they compress like photos)
to a temporary folder, then alternates rounds of

- ours: `build_image_datasets("folder:...", 224, 32, augment="inception")`: parallel
  reads, `decode_and_crop_jpeg` of the random crop only, AUTOTUNE maps, prefetch;
- naive: the same files, `read_file -> decode_jpeg (full) -> resize 224 -> flip ->
  normalise`, one element at a time (no `num_parallel_calls`), no prefetch,

and prints one JSON object with images/s of both (median over rounds), per core,
images per CPU-second (the per-core cost, which does not depend on how many cores the
run got on a shared machine) and the ratios. Each pipeline runs one untimed warm-up
epoch first. The speedup over the naive pipeline comes from parallelism (so it grows
with the free cores: on a shared 2-core machine it cannot pass about 2x the CPU ratio)
and from less CPU per image (decoding only the crop; one vectorised normalisation per
batch). Run:
`python bench/input_pipeline.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from trainwell.data.images import IMAGENET_MEAN, IMAGENET_STD, build_image_datasets  # noqa: E402

NUM_IMAGES = 200
CLASSES = 4
IMAGE_SIZE = 224
BATCH = 32
ROUNDS = 3
EPOCHS_PER_ROUND = 3


def write_jpegs(root: str) -> float:
    """Photo-like JPEGs: a smooth random field plus noise, 320-480 x 300-400 px. Returns mean KiB."""
    rng = np.random.default_rng(0)
    sizes = []
    for i in range(NUM_IMAGES):
        h, w = int(rng.integers(300, 401)), int(rng.integers(320, 481))
        coarse = rng.random((h // 16 + 1, w // 16 + 1, 3)).astype(np.float32)
        smooth = tf.image.resize(coarse[None], (h, w), method="bicubic")[0].numpy()
        img = np.clip(smooth * 200 + rng.normal(0, 18, (h, w, 3)), 0, 255).astype(np.uint8)
        data = tf.io.encode_jpeg(img, quality=90).numpy()
        d = os.path.join(root, f"class{i % CLASSES}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"{i:04d}.jpg"), "wb") as f:
            f.write(data)
        sizes.append(len(data))
    return float(np.mean(sizes) / 1024)


def naive_dataset(root: str) -> tf.data.Dataset:
    paths = sorted(tf.io.gfile.glob(os.path.join(root, "*", "*.jpg")))
    labels = [int(os.path.basename(os.path.dirname(p))[5:]) for p in paths]
    mean, std = tf.constant(IMAGENET_MEAN), tf.constant(IMAGENET_STD)

    def load(path, label):
        image = tf.io.decode_jpeg(tf.io.read_file(path), channels=3)
        image = tf.image.resize(image, (IMAGE_SIZE, IMAGE_SIZE))
        image = tf.image.random_flip_left_right(image)
        image = (image / 255.0 - mean) / std
        return image, tf.one_hot(label, CLASSES)

    ds = tf.data.Dataset.from_tensor_slices((paths, labels)).shuffle(len(paths), seed=0)
    return ds.map(load).batch(BATCH, drop_remainder=True)


def measure(ds: tf.data.Dataset, epochs: int) -> tuple[float, float]:
    """(images per wall-clock second, images per CPU-second of this process)."""
    n = 0
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(epochs):
        for x, _ in ds:
            n += int(x.shape[0])
    return n / (time.perf_counter() - wall), n / max(time.process_time() - cpu, 1e-9)


def main() -> dict:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    root = tempfile.mkdtemp(prefix="trainwell-bench-")
    try:
        kib = write_jpegs(root)
        ours = build_image_datasets(f"folder:{root}", IMAGE_SIZE, BATCH, augment="inception",
                                    val_fraction=0.0, test_fraction=0.0, seed=0).train
        naive = naive_dataset(root)
        measure(ours, 1), measure(naive, 1)  # warm-up: tracing, file cache
        rounds = []
        for _ in range(ROUNDS):  # alternating, so both see the same machine load
            (ow, oc), (nw, nc) = measure(ours, EPOCHS_PER_ROUND), measure(naive, EPOCHS_PER_ROUND)
            rounds.append({"ours": ow, "naive": nw, "ours_per_cpu_s": oc, "naive_per_cpu_s": nc})
        o = statistics.median(r["ours"] for r in rounds)
        n = statistics.median(r["naive"] for r in rounds)
        oc = statistics.median(r["ours_per_cpu_s"] for r in rounds)
        nc = statistics.median(r["naive_per_cpu_s"] for r in rounds)
        return {
            "benchmark": "input_pipeline",
            "images": NUM_IMAGES,
            "mean_jpeg_kib": round(kib, 1),
            "image_size": IMAGE_SIZE,
            "batch_size": BATCH,
            "cores": cores,
            "load_avg_1min": round(os.getloadavg()[0], 2),
            "ours_images_per_s": round(o, 1),
            "naive_images_per_s": round(n, 1),
            "ours_images_per_s_per_core": round(o / cores, 1),
            "naive_images_per_s_per_core": round(n / cores, 1),
            "speedup": round(o / n, 2),
            # CPU efficiency, independent of how many cores the run got: images per CPU-second.
            "ours_images_per_cpu_s": round(oc, 1),
            "naive_images_per_cpu_s": round(nc, 1),
            "cpu_efficiency_ratio": round(oc / nc, 2),
            "target_speedup": 3.0,
            "rounds": [{k: round(v, 1) for k, v in r.items()} for r in rounds],
            "tensorflow": tf.__version__,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    result = main()
    print(json.dumps(result))
    sys.exit(0)
