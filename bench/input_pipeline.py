"""Training input pipeline throughput: trainwell's vs a naive tf.data pipeline.

Writes ~200 ImageNet-sized JPEGs (about 400x350, textured so they compress like photos)
to a temporary folder, then alternates rounds of

- ours: `build_image_datasets("folder:...", 224, 32, augment="inception")`: parallel
  reads, `decode_and_crop_jpeg` of the random crop only, AUTOTUNE maps, prefetch;
- naive: the same files, `read_file -> decode_jpeg (full) -> resize 224 -> flip ->
  normalise`, one element at a time (no `num_parallel_calls`), no prefetch,

and, with `--prepared 256,160` (the default), the same training pipeline on the same images
prepared once by `trainwell prepare-images` at each `max_side` (`tfrecord:DST`, shorter side at
most `max_side`, the same Inception crop and 224-px output): the ratio of its images per
CPU-second to today's folder pipeline (target >= 2x) and the cores that would feed 7,120
images/s (one H200 training ResNet-50) and 8 times that (`cases`). Prints one JSON object with
images/s of each (median over rounds), per core, images per CPU-second (the per-core cost,
which does not depend on how many cores the run got on a shared machine) and the ratios. Each pipeline runs one untimed warm-up
epoch first. The speedup over the naive pipeline comes from parallelism (so it grows
with the free cores: on a shared 2-core machine it cannot pass about 2x the CPU ratio)
and from less CPU per image (decoding only the crop; one vectorised normalisation per
batch). `floor` measures, one image at a time, the CPU cost of the work no such
pipeline avoids (decoding the crop, resizing it); the naive pipeline's CPU per image
over that floor bounds the images per CPU-second any pipeline that decodes and resizes
every image can gain over the naive one. Run:
`python bench/input_pipeline.py` (options: `--images N`, `--rounds N`, `--epochs-per-round N`,
`--prepared SIDES`;
on a many-core machine use more images and epochs, so that each timed pass lasts long
enough; `taskset -c 0-3 python bench/input_pipeline.py` measures on 4 of the cores).
"""

from __future__ import annotations

import argparse
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

from trainwell.data.image_ops import inception_window  # noqa: E402
from trainwell.data.images import IMAGENET_MEAN, IMAGENET_STD, build_image_datasets  # noqa: E402
from trainwell.data.prepare import prepare_images  # noqa: E402

NUM_IMAGES = 200
CLASSES = 4
IMAGE_SIZE = 224
BATCH = 32
ROUNDS = 3
EPOCHS_PER_ROUND = 3
#: Images/s of ResNet-50 training on one H200 (bench/README.md, resnet_throughput.py).
H200_IMAGES_PER_S = 7120


def write_jpegs(root: str, num_images: int = NUM_IMAGES) -> float:
    """Photo-like JPEGs: a smooth random field plus noise, 320-480 x 300-400 px. Returns mean KiB."""
    rng = np.random.default_rng(0)
    sizes = []
    for i in range(num_images):
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


def decode_floor(root: str, repeats: int = 2) -> dict:
    """CPU ms per image of the unavoidable work, one image at a time in one tf.function:
    decoding the Inception crop (`decode_and_crop_jpeg` of a window drawn by the
    pipeline's own `inception_window`) and resizing it to 224 px; and, for reference,
    a full decode + resize."""
    paths = sorted(tf.io.gfile.glob(os.path.join(root, "*", "*.jpg")))
    blobs = [tf.io.read_file(p) for p in paths]
    windows = [tf.stack(inception_window(tf.constant([0, i]))(tf.image.extract_jpeg_shape(b)))
               for i, b in enumerate(blobs)]

    def cpu_ms(fn) -> float:
        f = tf.function(fn)
        for b, w in zip(blobs[:4], windows[:4]):
            f(b, w)
        c0 = time.process_time()
        for _ in range(repeats):
            for b, w in zip(blobs, windows):
                f(b, w).numpy()
        return (time.process_time() - c0) / (repeats * len(blobs)) * 1e3

    resize = lambda x: tf.image.resize(x, (IMAGE_SIZE, IMAGE_SIZE))  # noqa: E731
    crop = cpu_ms(lambda b, w: resize(tf.image.decode_and_crop_jpeg(b, w, channels=3)))
    full = cpu_ms(lambda b, w: resize(tf.io.decode_jpeg(b, channels=3)))
    return {"crop_decode_resize_cpu_ms": crop, "full_decode_resize_cpu_ms": full}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=NUM_IMAGES, help=f"JPEGs to write (default {NUM_IMAGES})")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"alternating rounds (default {ROUNDS})")
    parser.add_argument("--epochs-per-round", type=int, default=EPOCHS_PER_ROUND,
                        help=f"epochs of each pipeline per round (default {EPOCHS_PER_ROUND})")
    parser.add_argument("--prepared", default="256,160",
                        help="max_side values of prepared-shard cases, comma-separated ('' for none; default 256,160)")
    args = parser.parse_args(argv)
    try:
        sides = [int(v) for v in args.prepared.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--prepared must be comma-separated ints. Received: {args.prepared!r}")
    for name in ("images", "rounds", "epochs_per_round"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1. Received: {getattr(args, name)}")
    if args.images < BATCH:
        parser.error(f"--images must be >= the batch size {BATCH}. Received: {args.images}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    root = tempfile.mkdtemp(prefix="trainwell-bench-")
    try:
        kib = write_jpegs(root, args.images)
        ours = build_image_datasets(f"folder:{root}", IMAGE_SIZE, BATCH, augment="inception",
                                    val_fraction=0.0, test_fraction=0.0, seed=0).train
        naive = naive_dataset(root)
        prepared, preparing = {}, {}
        for side in sides:
            dst = f"{root}-prepared-{side}"
            c0, w0 = time.process_time(), time.perf_counter()
            prepare_images(f"folder:{root}", dst, max_side=side, verbose=0, log=lambda line: None)
            preparing[side] = {"wall_s": round(time.perf_counter() - w0, 2),
                               "images_per_cpu_s": round(args.images / (time.process_time() - c0), 1),
                               "mean_jpeg_kib": round(sum(os.path.getsize(os.path.join(dst, n)) for n in os.listdir(dst)
                                                          if n.startswith("train-")) / args.images / 1024, 1)}
            prepared[side] = build_image_datasets(f"tfrecord:{dst}", IMAGE_SIZE, BATCH, augment="inception",
                                                  val_fraction=0.0, test_fraction=0.0, seed=0).train
        measure(ours, 1), measure(naive, 1)  # warm-up: tracing, file cache
        for ds in prepared.values():
            measure(ds, 1)
        rounds = []
        for _ in range(args.rounds):  # alternating, so all see the same machine load
            (ow, oc), (nw, nc) = measure(ours, args.epochs_per_round), measure(naive, args.epochs_per_round)
            rounds.append({"ours": ow, "naive": nw, "ours_per_cpu_s": oc, "naive_per_cpu_s": nc})
            for side, ds in prepared.items():
                pw, pc = measure(ds, args.epochs_per_round)
                rounds[-1].update({f"prepared_{side}": pw, f"prepared_{side}_per_cpu_s": pc})
        o = statistics.median(r["ours"] for r in rounds)
        n = statistics.median(r["naive"] for r in rounds)
        oc = statistics.median(r["ours_per_cpu_s"] for r in rounds)
        nc = statistics.median(r["naive_per_cpu_s"] for r in rounds)
        # What decoding the crop + resizing costs by itself (the floor of any such pipeline),
        # and the best CPU-efficiency ratio over the naive pipeline that floor allows.
        f = decode_floor(root)
        floor = {k: round(v, 3) for k, v in f.items()}
        floor["naive_cpu_ms_per_image"] = round(1e3 / nc, 3)
        floor["ours_cpu_ms_per_image"] = round(1e3 / oc, 3)
        floor["max_cpu_efficiency_ratio"] = round((1e3 / nc) / f["crop_decode_resize_cpu_ms"], 2)
        floor["max_speedup_on_these_cores"] = round(cores * floor["max_cpu_efficiency_ratio"], 2)
        cases = {"today_folder": {"images_per_s": round(o, 1), "images_per_cpu_s": round(oc, 1)}}
        for side in prepared:
            pw = statistics.median(r[f"prepared_{side}"] for r in rounds)
            pc = statistics.median(r[f"prepared_{side}_per_cpu_s"] for r in rounds)
            cases[f"prepared_{side}"] = {"images_per_s": round(pw, 1), "images_per_cpu_s": round(pc, 1),
                                         "ratio_per_cpu_s_to_today": round(pc / oc, 2), "preparing": preparing[side]}
        for case in cases.values():
            case["cores_for_7120"] = round(H200_IMAGES_PER_S / case["images_per_cpu_s"], 1)
            case["cores_for_8x7120"] = round(8 * H200_IMAGES_PER_S / case["images_per_cpu_s"], 1)
        return {
            "benchmark": "input_pipeline",
            "cases": cases,
            "target_prepared_ratio": 2.0,
            "images": args.images,
            "rounds_count": args.rounds,
            "epochs_per_round": args.epochs_per_round,
            "mean_jpeg_kib": round(kib, 1),
            "image_size": IMAGE_SIZE,
            "batch_size": BATCH,
            "cores": cores,
            "machine_cpus": os.cpu_count(),
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
            "floor": floor,
            "rounds": [{k: round(v, 1) for k, v in r.items()} for r in rounds],
            "tensorflow": tf.__version__,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
        for side in sides:
            shutil.rmtree(f"{root}-prepared-{side}", ignore_errors=True)


if __name__ == "__main__":
    result = main()
    print(json.dumps(result))
    sys.exit(0)
