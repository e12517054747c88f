"""The ResNet recipe against the same network trained by hand with plain Keras, on mnist5k.

Both train the network of `configs/demo_mnist5k.yaml` (what `make demo` runs:
ResNet-18 v1.5, width 16, small 3x3 stem, 28 px) for the same number of epochs on the
same train split of the embedded 5,000 MNIST digits (3,500 train / 500 validation /
1,000 test, split seed 0), and are scored on the same 1,000 test digits:

- recipe: `trainwell.recipes.resnet_imagenet.train(cfg)` with the demo config: SGD +
  Nesterov with the linear-scaled peak LR, warmup then cosine decay, decoupled weight
  decay, label smoothing 0.1, pad-and-crop augmentation, its callbacks (NaN rollback,
  training doctor, checkpoints, logs) and its run directory (under a temporary
  directory here);
- plain: what a user writes by hand: `trainwell.models.resnet.build_resnet` with the same
  depth, width and stem, `Adam(1e-3)`, no schedule, no label smoothing, no augmentation,
  `model.fit(x_train / 255, y_train, batch_size, epochs, validation_data=...)` with
  integer labels and sparse categorical cross-entropy, then `model.evaluate` on test.

Each run is a fresh subprocess (no state carried between runs); per seed the two
alternate which goes first, so both see the same load on a shared machine. Wall time
is measured inside the subprocess, from before the data are loaded to after the test
evaluation (the recipe's `train()` call, which also writes its run directory; imports
excluded). Prints one JSON object: per seed and summarised (mean/min/max) test accuracy
and wall time of each, and the differences/ratios.

`--slow-start` asks why a short run of the recipe learns slowly on small data: the
recipe's first epochs without warmup (`warmup_epochs=0`, the schedule of `--epochs`,
default 2), once as configured and once with each suspect changed (zero-init residual
gamma, augmentation, label smoothing, weight decay, Keras's own BatchNormalization,
the TrainingDoctor, two CPU replicas), against the plain Keras run. Prints the training
accuracy of every epoch and the test accuracy of each, one subprocess each.

Run:
    python bench/recipe_vs_plain_keras.py                 # 20 epochs x 3 seeds: ~20-40 min on 2 cores
    python bench/recipe_vs_plain_keras.py --quick         # 2 epochs x 1 seed smoke run
    python bench/recipe_vs_plain_keras.py --epochs 10 --seeds 0,1
    python bench/recipe_vs_plain_keras.py --slow-start    # 2 epochs x 9 runs: ~15-30 min on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _common import alternate, load_avg, machine_info, parse_seeds, print_json, ratio, rnd, run_worker, summary  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO / "configs" / "demo_mnist5k.yaml"
KINDS = ("recipe", "plain")
#: `--slow-start`: one change each to the recipe's config (its first epochs, no warmup).
SUSPECTS = {
    "recipe": {},
    "zero_init_residual": {"zero_init_residual": True},  # the default before it followed the batch
    "no_augment": {"augment": "none"},
    "no_label_smoothing": {"label_smoothing": 0.0},
    "no_weight_decay": {"weight_decay": 0.0},
    "keras_batchnorm": {"fused_batchnorm": False},
    "no_doctor": {"doctor": False},  # its probe batch moves the seeded reshuffle on by one epoch
    "cpu2": {"strategy": "cpu:2"},
}


# --------------------------------------------------------------------------- workers
def _load_config(path: str, epochs: int | None, seed: int, run_dir: str | None, changes: dict | None = None):
    from trainwell.recipes import resnet_imagenet as R

    overrides = {"seed": seed, "verbose": "0", **(changes or {})}
    if run_dir is not None:
        overrides["run_dir"] = run_dir
    if epochs is not None:
        overrides["epochs"] = epochs  # the warmup and LR steps follow (a share of the run)
    return R.Config.load(path, overrides=overrides)


def run_recipe(cfg) -> dict:
    """The recipe's `train()`; returns its test metrics and wall time."""
    from trainwell.recipes import resnet_imagenet as R

    t0 = time.perf_counter()
    run = R.train(cfg)
    wall = time.perf_counter() - t0
    return {
        "test_accuracy": float(run.metrics["test_accuracy"]),
        "test_loss": float(run.metrics["test_loss"]),
        "epochs_run": len(run.history.get("loss", [])),
        "final_val_accuracy": (run.history.get("val_accuracy") or [None])[-1],
        "train_accuracy": [round(a, 4) for a in run.history.get("accuracy", [])],
        "wall_s": wall,
        "config": {k: getattr(cfg, k) for k in ("model", "width", "image_size", "batch_size", "epochs",
                                                  "base_lr", "warmup_epochs", "weight_decay", "label_smoothing",
                                                  "zero_init_residual")},
    }


def run_plain(cfg) -> dict:
    """The same network trained the plain way: Adam 1e-3, integer labels, `model.fit`."""
    import keras
    import numpy as np

    from trainwell.data import embedded
    from trainwell.models.resnet import build_resnet

    keras.utils.set_random_seed(cfg.seed)
    t0 = time.perf_counter()
    # The recipe's split: val_fraction from the config, test_fraction 0.2, split seed 0.
    splits = embedded.load(cfg.dataset, val_fraction=cfg.val_fraction, test_fraction=0.2, seed=0)
    (x, y), (xv, yv), (xt, yt) = splits.train, splits.val, splits.test

    def prep(a):
        return np.asarray(a, np.float32) / 255.0

    model = build_resnet(cfg.depth, num_classes=splits.num_classes, input_shape=tuple(x.shape[1:]),
                         small_stem=cfg.use_small_stem, width=cfg.width, zero_init_residual=cfg.zero_init_residual)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    history = model.fit(prep(x), y, batch_size=cfg.batch_size, epochs=cfg.epochs,
                        validation_data=(prep(xv), yv) if len(yv) else None, verbose=0)
    test = model.evaluate(prep(xt), yt, verbose=0, return_dict=True)
    wall = time.perf_counter() - t0
    return {
        "test_accuracy": float(test["accuracy"]),
        "test_loss": float(test["loss"]),
        "epochs_run": len(history.history["loss"]),
        "final_val_accuracy": (history.history.get("val_accuracy") or [None])[-1],
        "train_accuracy": [round(a, 4) for a in history.history["accuracy"]],
        "wall_s": wall,
        "train_examples": int(len(y)),
        "test_examples": int(len(yt)),
    }


def worker(args) -> None:
    t0 = time.perf_counter()
    changes = {"warmup_epochs": 0.0, **SUSPECTS[args.suspect]} if args.suspect else None
    cfg = _load_config(args.config, args.epochs, args.seed, args.run_dir, changes)
    with contextlib.redirect_stdout(sys.stderr):  # the parent reads one JSON line from stdout
        out = run_recipe(cfg) if args.worker == "recipe" else run_plain(cfg)
    out.update(kind=args.worker, seed=args.seed, process_wall_s=time.perf_counter() - t0)
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------- driver
def spawn(kind: str, seed: int, args, tmp: Path) -> dict:
    extra = ["--config", str(args.config)]
    if args.epochs is not None:
        extra += ["--epochs", str(args.epochs)]
    if kind == "recipe":
        extra += ["--run-dir", str(tmp / f"recipe-seed{seed}")]
    return run_worker(__file__, kind, seed, extra, tmp)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=None, help="Epochs of both (default: the config's, 20).")
    p.add_argument("--seeds", default=None, help="A count ('3': seeds 0,1,2; the default) or a list ('0,5').")
    p.add_argument("--quick", action="store_true", help="Smoke run: 2 epochs, 1 seed (unless given).")
    p.add_argument("--config", default=str(DEMO_CONFIG), help="The recipe config (default: the demo's).")
    p.add_argument("--keep-runs", action="store_true", help="Keep the recipe's run directories (printed).")
    p.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--slow-start", action="store_true",
                   help="The first --epochs (default 2) of the recipe without warmup, with each suspect changed.")
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--suspect", choices=sorted(SUSPECTS), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.slow_start:
        args.epochs = args.epochs or 2
    if args.quick:
        args.epochs = args.epochs or 2
        args.seeds = args.seeds or "1"
    args.seeds = args.seeds or "3"
    return args


def slow_start(args) -> dict:
    """`--slow-start`: the recipe's first epochs with each suspect changed, and plain Keras."""
    import shutil
    import tempfile

    seed = parse_seeds(args.seeds)[0]
    tmp = Path(tempfile.mkdtemp(prefix="trainwell-slow-start-"))
    rows = {}
    try:
        for name in SUSPECTS:
            extra = ["--config", str(args.config), "--epochs", str(args.epochs), "--suspect", name,
                     "--run-dir", str(tmp / name)]
            rows[name] = run_worker(__file__, "recipe", seed, extra, tmp)
        rows["plain"] = run_worker(__file__, "plain", seed, ["--config", str(args.config), "--epochs", str(args.epochs)],
                                   tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = {
        "benchmark": "recipe_vs_plain_keras --slow-start",
        "config": str(args.config), "epochs": args.epochs, "seed": seed, "warmup_epochs": 0.0,
        "machine": machine_info(),
        "runs": {name: {"changed": SUSPECTS.get(name, "Adam(1e-3), x / 255, no augmentation or smoothing"),
                        "train_accuracy": r["train_accuracy"], "test_accuracy": rnd(r["test_accuracy"], 4)}
                 for name, r in rows.items()},
    }
    print_json(out)
    return out


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return None
    if args.slow_start:
        return slow_start(args)
    seeds = parse_seeds(args.seeds)
    machine = machine_info()
    t_start = time.perf_counter()

    def compare(row):
        row["accuracy_diff_recipe_minus_plain"] = rnd(row["recipe"]["test_accuracy"] - row["plain"]["test_accuracy"], 4)
        row["wall_ratio_recipe_over_plain"] = ratio(row["recipe"]["wall_s"], row["plain"]["wall_s"])

    per_seed = alternate(seeds, KINDS, lambda kind, seed, tmp: spawn(kind, seed, args, tmp), on_row=compare,
                         tmp_prefix="trainwell-recipe-vs-plain-", keep=args.keep_runs)

    def compact(r: dict) -> dict:
        keys = ("test_accuracy", "test_loss", "final_val_accuracy", "wall_s", "process_wall_s", "epochs_run")
        return {k: (rnd(r[k], 4) if isinstance(r.get(k), float) else r.get(k)) for k in keys}

    summ = {}
    for kind in KINDS:
        acc = summary(r[kind]["test_accuracy"] for r in per_seed)
        wall = summary(r[kind]["wall_s"] for r in per_seed)
        summ[kind] = {
            "test_accuracy": {k: rnd(v, 4) for k, v in acc.items()},
            "wall_s": {k: rnd(v, 1) for k, v in wall.items()},
        }
    first = per_seed[0]
    out = {
        "benchmark": "recipe_vs_plain_keras",
        "dataset": "mnist5k",
        "config": str(Path(args.config).resolve().relative_to(REPO)) if str(Path(args.config).resolve()).startswith(str(REPO)) else str(args.config),
        "epochs": first["recipe"]["epochs_run"],
        "seeds": seeds,
        "recipe_settings": first["recipe"].get("config"),
        "plain_settings": {"optimizer": "Adam(1e-3)", "schedule": None, "label_smoothing": 0.0,
                           "augmentation": None, "labels": "int", "input": "x / 255",
                           "batch_size": first["recipe"].get("config", {}).get("batch_size"),
                           "train_examples": first["plain"].get("train_examples"),
                           "test_examples": first["plain"].get("test_examples")},
        "machine": machine,
        "load_avg_1min_end": load_avg(),
        "per_seed": [
            {"seed": r["seed"], "order": r["order"], "recipe": compact(r["recipe"]), "plain": compact(r["plain"]),
             "accuracy_diff_recipe_minus_plain": r["accuracy_diff_recipe_minus_plain"],
             "wall_ratio_recipe_over_plain": r["wall_ratio_recipe_over_plain"]}
            for r in per_seed
        ],
        "summary": summ,
        "accuracy_diff_recipe_minus_plain": {k: rnd(v, 4) for k, v in summary(
            r["accuracy_diff_recipe_minus_plain"] for r in per_seed).items()},
        "wall_ratio_recipe_over_plain": {k: rnd(v, 3) for k, v in summary(
            r["wall_ratio_recipe_over_plain"] for r in per_seed).items()},
        "total_wall_s": rnd(time.perf_counter() - t_start, 1),
    }
    print_json(out)
    return out


if __name__ == "__main__":
    main()
