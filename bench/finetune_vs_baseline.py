"""The transformer fine-tuning recipe against a plain keras-hub fine-tune, same model, data and steps.

Both fine-tune the same pretrained model (default: the embedded MiniLM-L6-H384,
`configs/minilm_rotten_tomatoes.yaml`) on the same train split of the embedded Rotten
Tomatoes snippets (8,966 train / 1,280 validation / 2,562 test, split seed 0), for the
same number of optimizer steps (the recipe's steps per epoch x `--epochs`), with the
same batch size and maximum sequence length, validate on the same validation split
after each epoch, and are scored on the same 2,562 test snippets:

- recipe: `trainwell.recipes.transformer_finetune.train(cfg)` with the config: AdamW
  (weight decay 0.01, not on LayerNorm/bias), warmup 10% then linear decay, global
  clipnorm 1.0, length-bucketed batches, XLA as the config says, early stopping on
  validation accuracy with the best weights restored, trainwell's callbacks
  (checkpoints, NaN rollback) and run directory (under a temporary directory);
- baseline: what the keras-hub docs show: `TextClassifier.from_preset(preset,
  num_classes=2, preprocessor=TextClassifierPreprocessor.from_preset(preset,
  sequence_length=L))`, `compile()` with its defaults (Adam 5e-5, sparse categorical
  cross-entropy from logits, `jit_compile="auto"`), then `fit` on a shuffled, batched
  `tf.data` of the strings (the task's preprocessor tokenises them), `steps_per_epoch`
  = the recipe's, then `evaluate` on test.

Each run is a fresh subprocess; per seed the two alternate which goes first, so both
see the same load on a shared machine. Timing: `fit_s` is the wall time of the
`model.fit` call (training steps, per-epoch validation, callbacks), `per_step_s` is
`fit_s / steps` (and `per_step_cpu_s` the same with the process's CPU time, which
depends less on other people's load on a shared machine); `wall_s` is everything from loading the data to the test score
(the recipe's `train()` call, which also tokenises, checkpoints and exports; imports
excluded). Prints one JSON object: per seed and summarised test accuracy and times,
and the differences/ratios, with the issue's target (>= 2 points more accurate, or as
accurate in <= 60% of the steps, at <= 1.05x the time per step). With
`--recipe-steps-fraction F` the recipe trains for F x the baseline's steps (its config's
`max_steps`: the warmup and decay span those steps and the run stops there), which
checks the target's second form.

Run:
    python bench/finetune_vs_baseline.py                    # 3 epochs x 3 seeds: ~1 h on 2 quiet cores
    python bench/finetune_vs_baseline.py --seeds 1          # one seed
    python bench/finetune_vs_baseline.py --recipe-steps-fraction 0.6   # the recipe in 60% of the steps
    python bench/finetune_vs_baseline.py --quick            # 60 steps, 1 seed, train capped: a smoke run
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
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _common import alternate, load_avg, machine_info, parse_seeds, print_json, ratio, rnd, run_worker, summary  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "minilm_rotten_tomatoes.yaml"
KINDS = ("recipe", "baseline")


# --------------------------------------------------------------------------- workers
def _config(args):
    from trainwell.recipes import transformer_finetune as T

    overrides = {"seed": args.seed, "verbose": "0"}
    if args.epochs:
        overrides["epochs"] = args.epochs
    if args.run_dir:
        overrides["run_dir"] = args.run_dir
    if args.max_train_examples:
        overrides["max_train_examples"] = args.max_train_examples
    cfg = T.Config.load(args.config, overrides=overrides)
    if args.worker == "recipe" and args.recipe_steps_fraction < 1:
        # The recipe's run (schedule included) is cut to this fraction of the steps.
        spe = T.build_data(cfg, T.build_preprocessor(cfg)).steps_per_epoch
        cfg = cfg.replace(max_steps=max(1, int(args.recipe_steps_fraction * cfg.epochs * spe)))
    return cfg


class _FitTimer:
    """Times every `keras.Model.fit` call of the process (instrumentation only)."""

    def __init__(self):
        import keras

        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self._orig = keras.Model.fit
        timer = self

        def fit(model, *a, **kw):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return timer._orig(model, *a, **kw)
            finally:
                timer.seconds += time.perf_counter() - t0
                timer.cpu_seconds += time.process_time() - c0

        keras.Model.fit = fit


def run_recipe(cfg) -> dict:
    from trainwell.recipes import transformer_finetune as T

    timer = _FitTimer()
    t0 = time.perf_counter()
    run = T.train(cfg)
    wall = time.perf_counter() - t0
    epochs_run = len(run.history.get("loss", []))
    opt = run.model.optimizer
    steps = int(getattr(opt, "inner_optimizer", opt).iterations.numpy())  # optimizer steps taken
    return {
        "test_accuracy": float(run.metrics["test_accuracy"]),
        "test_loss": float(run.metrics["test_loss"]),
        "epochs_run": epochs_run,
        "steps": steps,
        "val_accuracy": run.history.get("val_accuracy"),
        "fit_s": timer.seconds,
        "fit_cpu_s": timer.cpu_seconds,
        "wall_s": wall,
        "settings": {k: getattr(cfg, k) for k in (
            "preset", "sequence_length", "batch_size", "epochs", "peak_lr", "weight_decay", "warmup_fraction",
            "schedule", "global_clipnorm", "bucket_by_length", "jit_compile", "early_stopping_patience",
            "max_steps")},
    }


def run_baseline(cfg) -> dict:
    import keras
    import keras_hub
    import tensorflow as tf

    from trainwell.recipes import transformer_finetune as T

    keras.utils.set_random_seed(cfg.seed)
    t0 = time.perf_counter()
    preset = T.resolve_preset(cfg.preset)
    pre = keras_hub.models.TextClassifierPreprocessor.from_preset(preset, sequence_length=cfg.sequence_length)
    # The recipe's data and steps per epoch (the same split; its bucketed batch count).
    data = T.build_data(cfg, pre)
    steps = data.steps_per_epoch
    (x, y), (xv, yv), (xt, yt) = data.splits.train, data.splits.val, data.splits.test
    model = keras_hub.models.TextClassifier.from_preset(preset, num_classes=data.num_classes, preprocessor=pre)
    model.compile()  # keras-hub defaults: Adam(5e-5), SparseCategoricalCrossentropy(from_logits), accuracy

    def strings(a):
        return tf.constant(a.astype(str))

    train = (tf.data.Dataset.from_tensor_slices((strings(x), y))
             .shuffle(len(y), seed=cfg.seed, reshuffle_each_iteration=True)
             .batch(cfg.batch_size, drop_remainder=True).repeat())
    val = tf.data.Dataset.from_tensor_slices((strings(xv), yv)).batch(2 * cfg.batch_size)
    test = tf.data.Dataset.from_tensor_slices((strings(xt), yt)).batch(2 * cfg.batch_size)
    t_fit, c_fit = time.perf_counter(), time.process_time()
    history = model.fit(train, validation_data=val, epochs=cfg.epochs, steps_per_epoch=steps, verbose=0)
    fit_s, fit_cpu_s = time.perf_counter() - t_fit, time.process_time() - c_fit
    result = model.evaluate(test, verbose=0, return_dict=True)
    wall = time.perf_counter() - t0
    acc_key = next(k for k in result if "accuracy" in k)
    return {
        "test_accuracy": float(result[acc_key]),
        "test_loss": float(result["loss"]),
        "epochs_run": len(history.history["loss"]),
        "steps": steps * len(history.history["loss"]),
        "val_accuracy": next((v for k, v in history.history.items() if k.startswith("val_") and "accuracy" in k), None),
        "fit_s": fit_s,
        "fit_cpu_s": fit_cpu_s,
        "wall_s": wall,
        "settings": {"optimizer": "Adam(5e-5) (keras-hub default)", "schedule": None, "weight_decay": None,
                     "clipnorm": None, "sequence_length": cfg.sequence_length, "padding": "to sequence_length",
                     "batch_size": cfg.batch_size, "jit_compile": "auto"},
    }


def worker(args) -> None:
    t0 = time.perf_counter()
    cfg = _config(args)
    with contextlib.redirect_stdout(sys.stderr):  # the parent reads one JSON line from stdout
        out = run_recipe(cfg) if args.worker == "recipe" else run_baseline(cfg)
    out.update(kind=args.worker, seed=args.seed, process_wall_s=time.perf_counter() - t0)
    if out.get("steps"):
        out["per_step_s"] = out["fit_s"] / out["steps"]
        out["per_step_cpu_s"] = out["fit_cpu_s"] / out["steps"]
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------- driver
def spawn(kind: str, seed: int, args, tmp: Path) -> dict:
    extra = ["--config", str(args.config)] + (["--epochs", str(args.epochs)] if args.epochs else [])
    extra += ["--recipe-steps-fraction", repr(args.recipe_steps_fraction)]
    if args.max_train_examples:
        extra += ["--max-train-examples", str(args.max_train_examples)]
    if kind == "recipe":
        extra += ["--run-dir", str(tmp / f"recipe-seed{seed}")]
    return run_worker(__file__, kind, seed, extra, tmp)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=None,
                   help="Epochs of both (steps = the recipe's per epoch x epochs). Default: the config's (3, the "
                        "BERT paper's fine-tuning length).")
    p.add_argument("--seeds", default="3", help="A count ('3': seeds 0,1,2; the default) or a list ('0,5').")
    p.add_argument("--config", default=str(CONFIG), help="The recipe config (default: MiniLM on rotten_tomatoes).")
    p.add_argument("--recipe-steps-fraction", type=float, default=1.0,
                   help="Train the recipe for this fraction of the baseline's steps (its schedule ends there: "
                        "the config's max_steps). Default 1.0. 0.6 checks the issue's 'as accurate in <= 60%% of "
                        "the steps'.")
    p.add_argument("--max-train-examples", type=int, default=None, help="Cap the training split (quick runs).")
    p.add_argument("--quick", action="store_true", help="Smoke run: 1 epoch of 1,920 examples, 1 seed.")
    p.add_argument("--keep-runs", action="store_true", help="Keep the recipe's run directories (printed).")
    p.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 0 < args.recipe_steps_fraction <= 1:
        p.error(f"--recipe-steps-fraction must be in (0, 1]. Received: {args.recipe_steps_fraction}")
    if args.quick:
        args.max_train_examples = args.max_train_examples or 1920
        args.epochs = args.epochs or 1
        args.seeds = "1" if args.seeds == "3" else args.seeds
    return args


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return None
    seeds = parse_seeds(args.seeds)
    machine = machine_info()
    t_start = time.perf_counter()

    def compare(row):
        row["accuracy_diff_recipe_minus_baseline"] = rnd(
            row["recipe"]["test_accuracy"] - row["baseline"]["test_accuracy"], 4)
        row["per_step_ratio_recipe_over_baseline"] = ratio(
            row["recipe"].get("per_step_s"), row["baseline"].get("per_step_s"))
        row["per_step_cpu_ratio_recipe_over_baseline"] = ratio(
            row["recipe"].get("per_step_cpu_s"), row["baseline"].get("per_step_cpu_s"))
        row["steps_ratio_recipe_over_baseline"] = ratio(row["recipe"].get("steps"), row["baseline"].get("steps"))

    per_seed = alternate(seeds, KINDS, lambda kind, seed, tmp: spawn(kind, seed, args, tmp), on_row=compare,
                         tmp_prefix="trainwell-finetune-vs-baseline-", keep=args.keep_runs)

    def compact(r: dict) -> dict:
        keys = ("test_accuracy", "test_loss", "val_accuracy", "steps", "epochs_run", "fit_s", "per_step_s",
                "fit_cpu_s", "per_step_cpu_s", "wall_s", "process_wall_s")
        out = {}
        for k in keys:
            v = r.get(k)
            out[k] = [rnd(x, 4) for x in v] if isinstance(v, list) else (rnd(v, 4) if isinstance(v, float) else v)
        return out

    summ = {}
    for kind in KINDS:
        summ[kind] = {
            "test_accuracy": {k: rnd(v, 4) for k, v in summary(r[kind]["test_accuracy"] for r in per_seed).items()},
            "per_step_s": {k: rnd(v, 3) for k, v in summary(r[kind].get("per_step_s") for r in per_seed).items()},
            "per_step_cpu_s": {k: rnd(v, 3) for k, v in summary(r[kind].get("per_step_cpu_s") for r in per_seed).items()},
            "wall_s": {k: rnd(v, 1) for k, v in summary(r[kind]["wall_s"] for r in per_seed).items()},
        }
    diff = summary(r["accuracy_diff_recipe_minus_baseline"] for r in per_seed)
    step_ratio = summary(r["per_step_ratio_recipe_over_baseline"] for r in per_seed)
    cpu_ratio = summary(r["per_step_cpu_ratio_recipe_over_baseline"] for r in per_seed)
    steps_ratio = summary(r["steps_ratio_recipe_over_baseline"] for r in per_seed)
    first = per_seed[0]
    out = {
        "benchmark": "finetune_vs_baseline",
        "dataset": "rotten_tomatoes",
        "config": str(Path(args.config).resolve().relative_to(REPO)) if str(Path(args.config).resolve()).startswith(str(REPO)) else str(args.config),
        "epochs": first["recipe"].get("settings", {}).get("epochs"),
        "max_train_examples": args.max_train_examples,
        "seeds": seeds,
        "recipe_settings": first["recipe"].get("settings"),
        "baseline_settings": first["baseline"].get("settings"),
        "machine": machine,
        "load_avg_1min_end": load_avg(),
        "per_seed": [
            {"seed": r["seed"], "order": r["order"], "recipe": compact(r["recipe"]), "baseline": compact(r["baseline"]),
             "accuracy_diff_recipe_minus_baseline": r["accuracy_diff_recipe_minus_baseline"],
             "per_step_ratio_recipe_over_baseline": r["per_step_ratio_recipe_over_baseline"],
             "per_step_cpu_ratio_recipe_over_baseline": r["per_step_cpu_ratio_recipe_over_baseline"],
             "steps_ratio_recipe_over_baseline": r["steps_ratio_recipe_over_baseline"]}
            for r in per_seed
        ],
        "summary": summ,
        "accuracy_diff_recipe_minus_baseline": {k: rnd(v, 4) for k, v in diff.items()},
        "per_step_ratio_recipe_over_baseline": {k: rnd(v, 3) for k, v in step_ratio.items()},
        "per_step_cpu_ratio_recipe_over_baseline": {k: rnd(v, 3) for k, v in cpu_ratio.items()},
        "recipe_steps_fraction": args.recipe_steps_fraction,
        "steps_ratio_recipe_over_baseline": {k: rnd(v, 4) for k, v in steps_ratio.items()},
        # The target: (>= 2 points more accurate, or as accurate (mean difference
        # >= 0) in <= 60% of the steps) at <= 1.05x the time per step; seed means.
        "target": {
            "accuracy_plus_2_points": diff["mean"] is not None and diff["mean"] >= 0.02,
            "as_accurate_in_le_60pct_steps": (diff["mean"] is not None and diff["mean"] >= 0
                                              and steps_ratio["max"] is not None and steps_ratio["max"] <= 0.6),
            "per_step_ratio_le_1_05": step_ratio["mean"] is not None and step_ratio["mean"] <= 1.05,
        },
        "total_wall_s": rnd(time.perf_counter() - t_start, 1),
    }
    print_json(out)
    return out


if __name__ == "__main__":
    main()
    sys.stdout.flush()
