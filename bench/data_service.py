"""tf.data service: the ResNet recipe's training pipeline in-process vs through 1 and 2 local workers.

Writes ImageNet-sized JPEGs (`input_pipeline.write_jpegs`) to a temporary folder, then reads
the training batches of `build_image_datasets("folder:...", 224, 32, augment="inception")`
three ways: in-process, and with `data_service=` a local service
(`trainwell.data.service.start_local_service`) of 1 and of 2 workers (one endless job each),
one case after the other: a warm-up epoch, then `--rounds` epochs timed as one window. Prints
one JSON object: images/s of each and their ratios to in-process, plus the machine.

What it shows on a small machine: the method and its overhead, not the scaling. The local
workers run in this process, on the same cores as the trainer (a 2-core machine has no
spare CPU for a second worker); the service gains where its workers run on other hosts'
cores (or on the idle cores of a big host), which this script cannot show here.
Run: `python bench/data_service.py` (options: `--images N`, `--rounds N`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import log, machine_info, print_json, ratio, rnd  # noqa: E402
from input_pipeline import write_jpegs  # noqa: E402

from trainwell.data.images import build_image_datasets  # noqa: E402
from trainwell.data.service import PROCESSING_MODE, start_local_service  # noqa: E402

BATCH = 32
SIZE = 224


def epoch_rate(stream, batches: int) -> float:
    """Images/s of the next `batches` batches of `stream` (an iterator: the service's is one endless job)."""
    t0, n = time.perf_counter(), 0
    for _ in range(batches):
        n += int(next(stream)[0].shape[0])
    return n / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="trainwell-bench-service-")
    services = []
    try:
        kib = write_jpegs(root, args.images)
        kw = dict(augment="inception", val_fraction=0.0, test_fraction=0.0)
        cases = {"in_process": build_image_datasets(f"folder:{root}", SIZE, BATCH, **kw)}
        for workers in (1, 2):
            services.append(start_local_service(workers=workers))
            cases[f"service_{workers}_workers"] = build_image_datasets(
                f"folder:{root}", SIZE, BATCH, data_service=services[-1].target, **kw)
        batches = cases["in_process"].steps["train"]
        med = {}
        for k, data in cases.items():
            # One case at a time, one stream each (the service's is one endless job, whose workers fill
            # their buffers while idle): an untimed warm-up epoch, then `rounds` epochs timed as one window.
            stream = iter(data.train.repeat())
            epoch_rate(stream, batches)
            med[k] = epoch_rate(stream, batches * args.rounds)
            del stream
            log(f"{k}: {med[k]:.0f} images/s")
        print_json({
            "benchmark": "data_service", "processing_mode": PROCESSING_MODE, "images": args.images,
            "mean_jpeg_kib": rnd(kib, 1), "image_size": SIZE, "batch": BATCH, "rounds": args.rounds,
            "images_per_s": {k: rnd(v, 1) for k, v in med.items()},
            "ratio_to_in_process": {k: ratio(v, med["in_process"]) for k, v in med.items()},
            "note": "local workers share this process's cores: the method and its overhead, not the scaling",
            "machine": machine_info(),
        })
    finally:
        for s in services:
            s.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
