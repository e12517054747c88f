"""`trainwell input-report`: where the ResNet recipe's input pipeline spends its CPU, per stage.

`input_report(cfg)` runs the recipe's training pipeline on the data `cfg` names, one
growing prefix at a time, each for a bounded share of `seconds`:

1. `read`: list the records and shuffle them, read the bytes (files read, TFRecords parsed);
2. `decode`: + decode the image (for the Inception crop only its window, as the pipeline does);
3. `augment`: + crop, resize to `image_size` and flip (the pipeline's own `Transform.train_image`);
4. `batch`: + batch;
5. `prefetch`: the recipe's own training dataset (`build_data(cfg).train`: + the checks,
   normalisation and prefetch).

For each it reports images/s and images per CPU-second of this process (user + system
time of all its threads, `os.times`), the CPU milliseconds per image the stage adds over
the one before (a difference of two measurements: small stages can come out slightly
negative), and the slowest stage (the most CPU per image added). Images per CPU-second
of the whole pipeline give the cores that would feed `target` images/s: `target /
images_per_cpu_s` (cores at full use, without the training step's own CPU).

The doctor's `input_bound` finding points here; `trainwell prepare-images` is the usual
answer when `decode` is the slowest stage.

Example (docs/recipes.md runs one on a prepared `digits`):
>>> from trainwell.recipes import resnet_imagenet
>>> cfg = resnet_imagenet.Config(dataset="digits", batch_size=32)
>>> report = input_report(cfg, seconds=1, verbose=0)  # doctest: +SKIP
>>> [s["stage"] for s in report["stages"]] == list(STAGES)  # doctest: +SKIP
True
>>> STAGES
('read', 'decode', 'augment', 'batch', 'prefetch')
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from trainwell import recipes
from trainwell.config import ConfigError
from trainwell.validation import invalid_argument, is_number

__all__ = ["IMAGE_RECIPES", "STAGES", "add_input_report_parser", "cmd_input_report", "format_report", "input_report"]

#: The recipes whose input pipeline this measures.
IMAGE_RECIPES = ("resnet-imagenet",)

#: The stages, in pipeline order.
STAGES = ("read", "decode", "augment", "batch", "prefetch")
#: Elements drawn from each stage before its clock starts (tracing, first file opens).
WARMUP_ELEMENTS = 2
#: Images per element drawn from a one-image stage (`read`, `decode`, `augment`).
COUNT_GROUP = 64


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _stage_datasets(cfg, data) -> dict[str, Any]:
    """The five prefixes of the recipe's training pipeline: `(dataset, images per element)` by stage.

    Built from the pieces `build_image_datasets` uses (the source's records, the TFRecord
    parse, `decode_window` with the same windows, `Transform.train_image`), with the
    augmentation, classes and normalisation it resolved (`data`); the last stage is `data.train`.
    """
    # lazy: TensorFlow and the data modules load when a report runs, not with the command's parser
    import tensorflow as tf

    # lazy, as TensorFlow above: the data modules and the recipe import it
    from trainwell.data.image_ops import Transform, center_window, decode_window, inception_window, valid_image
    from trainwell.data.image_sources import open_source
    from trainwell.data.images import EVAL_CROP_FRACTION, SMALL_IMAGE_MAX
    from trainwell.recipes.resnet_imagenet import TEST_FRACTION

    auto = tf.data.AUTOTUNE
    src = open_source(cfg.dataset, data_dir=cfg.data_dir, num_classes=None, num_examples=None, label_offset=None,
                      cycle_length=16, input_context=None, val_fraction=cfg.val_fraction, test_fraction=TEST_FRACTION,
                      split_seed=0, seed=cfg.seed)
    rec = src.splits["train"]
    transform = Transform(image_size=cfg.image_size, channels=data.channels, augment=data.augment,
                          eval_crop_fraction=EVAL_CROP_FRACTION if cfg.image_size > SMALL_IMAGE_MAX else 1.0,
                          mean=data.mean, std=data.std, num_classes=data.num_classes, one_hot=True,
                          crop_padding=cfg.crop_padding)
    encoded = rec.kind != "array"

    def read(payload, label, key):
        if rec.kind == "path":
            return tf.io.read_file(payload), label
        return payload, label  # TFRecords come parsed by the source (image bytes, label)

    def seeded(i, element):
        return (*element, tf.stack([tf.constant(cfg.seed, tf.int64), i]))

    def decode(image, label, seed):
        crop_seed = tf.random.experimental.stateless_split(seed, 3)[0]
        window = inception_window(crop_seed) if data.augment == "inception" else center_window(1.0)
        return (decode_window(image, data.channels, window) if encoded else image), label

    def augment(image, label, seed):
        return transform.train_image(image, seed, encoded=encoded), transform.label(label)

    buffer = rec.count if rec.kind in ("path", "array") and rec.count else 10_000
    records = rec.make(None, False).shuffle(max(1, min(buffer, 1_000_000)), seed=cfg.seed).repeat()
    raw = records.map(read, num_parallel_calls=auto)
    if encoded:  # the pipeline's cheap check: what it would skip as corrupt is left out here too
        raw = raw.filter(lambda image, label: valid_image(image))
    raw = raw.enumerate().map(seeded)
    augmented = raw.map(augment, num_parallel_calls=auto).ignore_errors()
    def probe(image, *rest):
        # A value that needs the stage's output (a shape alone could be folded away, and the stage with it).
        if image.dtype == tf.string:
            return tf.cast(tf.strings.length(image), tf.float32)
        return tf.cast(tf.reshape(image, [-1])[0], tf.float32)

    def counted(ds):
        # The one-image stages are drawn in groups from C++: one Python `next` per image would cost
        # more than a stage (about 0.3 ms here).
        return ds.map(probe).batch(COUNT_GROUP), COUNT_GROUP

    return {
        "read": counted(raw),
        "decode": counted(raw.map(decode, num_parallel_calls=auto).ignore_errors()),
        "augment": counted(augmented),
        "batch": (augmented.batch(data.batch_size, drop_remainder=True), data.batch_size),
        "prefetch": (data.train.repeat(), data.batch_size),
    }


def _measure(ds, per_element: int, seconds: float) -> dict[str, float]:
    """Images/s and images per CPU-second of `ds` over about `seconds` (after a short warm-up)."""
    it = iter(ds)
    for _ in range(WARMUP_ELEMENTS):
        next(it)
    images = 0
    wall, cpu = time.perf_counter(), _cpu_seconds()
    while time.perf_counter() - wall < seconds:
        next(it)
        images += per_element
    wall, cpu = time.perf_counter() - wall, max(_cpu_seconds() - cpu, 1e-9)
    return {"images": images, "wall_s": wall, "cpu_s": cpu}


def input_report(cfg, *, seconds: float = 20.0, target: float | None = None, verbose: int = 1) -> dict[str, Any]:
    """Measures the ResNet recipe's training input pipeline stage by stage on `cfg`'s data (module docstring).

    Args:
        cfg: A `trainwell.recipes.resnet_imagenet.Config` (its dataset, image size, batch
            size, augmentation, seed and data directory are what is measured).
        seconds: Time to spend in all, shared by the five stages, > 0. Defaults to `20.0`.
        target: Images/s to feed; the report says how many cores that takes. Defaults to
            `None` (none).
        verbose: 1 prints a progress bar (`keras.utils.Progbar`), 0 nothing. Defaults to `1`.

    Returns:
        A dict: `stages` (per stage `images_per_s`, `images_per_cpu_s`, `cpu_ms_per_image`,
        `added_cpu_ms_per_image`), `slowest_stage`, `images_per_cpu_s` of the whole
        pipeline, `cores` this process may use, and with `target`, `cores_for_target`.

    Raises:
        ValueError: an invalid argument, or a config without an image dataset.

    Example:
    >>> from trainwell.recipes import resnet_imagenet
    >>> cfg = resnet_imagenet.Config(dataset="digits", batch_size=32)
    >>> r = input_report(cfg, seconds=1, target=5000, verbose=0)  # doctest: +SKIP
    >>> r["slowest_stage"] in STAGES, r["cores_for_target"] > 0  # doctest: +SKIP
    (True, True)
    """
    for name in ("dataset", "image_size", "batch_size", "seed", "data_dir"):
        if not hasattr(cfg, name):
            raise invalid_argument("cfg", "the config of an image recipe (resnet-imagenet: a dataset, image_size, "
                                   "batch_size)", type(cfg).__name__)
    if not is_number(seconds) or not seconds > 0:
        raise invalid_argument("seconds", "a number > 0", seconds)
    if target is not None and (not is_number(target) or not target > 0):
        raise invalid_argument("target", "None or a number > 0", target)
    if cfg.dataset.partition(":")[0].strip().lower() == "synthetic":
        raise invalid_argument("cfg.dataset", "a source of images to read (synthetic data has no input pipeline)",
                               cfg.dataset)
    # lazy: the recipe's pipeline imports TensorFlow; loaded when a report runs
    from trainwell.recipes import resnet_imagenet

    data = resnet_imagenet.build_data(cfg)
    stages = _stage_datasets(cfg, data)
    share = seconds / len(STAGES)
    bar = None
    if verbose:
        # lazy: Keras loads only for the progress bar
        import keras

        bar = keras.utils.Progbar(len(STAGES), unit_name="stage")
    rows, before = [], 0.0
    for k, name in enumerate(STAGES):
        ds, per = stages[name]
        m = _measure(ds, per, share)
        ms = 1e3 * m["cpu_s"] / max(m["images"], 1)
        rows.append({"stage": name, "images_per_s": round(m["images"] / m["wall_s"], 1),
                     "images_per_cpu_s": round(m["images"] / m["cpu_s"], 1), "cpu_ms_per_image": round(ms, 3),
                     "added_cpu_ms_per_image": round(ms - before, 3), "images": m["images"]})
        before = ms
        if bar is not None:
            bar.update(k + 1)
    slowest = max(rows, key=lambda r: r["added_cpu_ms_per_image"])["stage"]
    report = {"dataset": cfg.dataset, "image_size": cfg.image_size, "batch_size": data.batch_size,
              "augment": data.augment, "seconds": seconds, "cores": _cores(), "stages": rows,
              "slowest_stage": slowest, "images_per_cpu_s": rows[-1]["images_per_cpu_s"]}
    if target is not None:
        report["target"] = target
        report["cores_for_target"] = round(target / rows[-1]["images_per_cpu_s"], 1)
    return report


def format_report(report: dict[str, Any]) -> str:
    """The report as the command prints it: one line per stage, then the slowest stage and the cores.

    Example:
    >>> r = {"dataset": "d", "image_size": 8, "batch_size": 4, "augment": "none", "cores": 2, "slowest_stage": "read",
    ...      "images_per_cpu_s": 9.0, "stages": [{"stage": "read", "images_per_s": 10.0, "images_per_cpu_s": 9.0,
    ...      "cpu_ms_per_image": 111.1, "added_cpu_ms_per_image": 111.1}]}
    >>> print(format_report(r).splitlines()[2])
    read          10.0      9.0   111.100   +111.100
    """
    lines = [f"input report: {report['dataset']}, {report['image_size']} px, batch {report['batch_size']}, "
             f"augment {report['augment']}, {report['cores']} core(s)",
             "stage      images/s  per CPU-s  CPU ms/img  added ms/img"]
    for r in report["stages"]:
        lines.append(f"{r['stage']:<10} {r['images_per_s']:>7.1f} {r['images_per_cpu_s']:>8.1f} "
                     f"{r['cpu_ms_per_image']:>9.3f}   {r['added_cpu_ms_per_image']:+.3f}")
    lines.append(f"slowest stage: {report['slowest_stage']}")
    if "target" in report:
        lines.append(f"cores to feed {report['target']:g} images/s: {report['cores_for_target']:g} "
                     f"(at {report['images_per_cpu_s']:g} images per CPU-second)")
    return "\n".join(lines)


def cmd_input_report(args) -> int:
    """Runs `input_report` on the recipe's config from `--config`/`--set`; prints the report. Returns 0.

    Example:
    >>> import argparse
    >>> cmd_input_report(argparse.Namespace(recipe="transformer-finetune", config=None, set=[], seconds=1,
    ...                                     target=None, json=False, quiet=True))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    trainwell.config.ConfigError: Invalid value for `RECIPE`: ... Received: RECIPE='transformer-finetune'
    """
    if args.recipe not in IMAGE_RECIPES:
        raise ConfigError(str(invalid_argument("RECIPE", f"expected one of {', '.join(IMAGE_RECIPES)} (the recipes "
                                               "with an image input pipeline)", args.recipe, what="")))
    cfg = recipes.get(args.recipe).Config.load(args.config, args.set or [])
    try:
        report = input_report(cfg, seconds=args.seconds, target=args.target, verbose=0 if args.quiet else 1)
    except ValueError as e:  # an argument's "Received:" line: a usage error, exit 2
        raise ConfigError(str(e)) from None
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def add_input_report_parser(sub) -> None:
    """Adds the `input-report` command to `sub` (an `add_subparsers()` result).

    Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser(); add_input_report_parser(p.add_subparsers())
    >>> p.parse_args(["input-report", "resnet-imagenet", "--target", "7000"]).target
    7000.0
    """
    ir = sub.add_parser("input-report", help="images/s and CPU per image of each stage of a recipe's input pipeline")
    ir.add_argument("recipe", metavar="RECIPE", help=f"one of: {', '.join(IMAGE_RECIPES)}")
    ir.add_argument("--config", metavar="FILE", help="YAML or JSON file of config values")
    ir.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                    help="override one config value (repeatable), e.g. --set dataset=folder:photos")
    ir.add_argument("--seconds", type=float, default=20.0, help="time to spend in all (default 20)")
    ir.add_argument("--target", type=float, help="images/s to feed: prints the cores that takes")
    ir.add_argument("--json", action="store_true", help="print the report as JSON")
    ir.add_argument("--quiet", action="store_true", help="no progress bar")
    ir.set_defaults(func=cmd_input_report)
