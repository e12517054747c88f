"""Population-based training against random search at the same total epochs, median of 3 seeds.

The problem: an MLP (784-128-10, ReLU) on the embedded mnist5k digits (3,500 train /
500 validation / 1,000 test), trained with plain SGD at a *constant* learning rate
(no schedule), so the best LR changes during training: a high LR gets the loss
down fastest early, a low LR settles better late. Both searches tune the same space
(learning rate, log-uniform in [1e-3, 1]; label smoothing in [0, 0.2], read from a variable
by `trainwell.losses.CategoricalCrossentropy`, as the shipped ResNet recipe's is, so no exploit
retraces; `--keras-loss` uses Keras's loss, whose smoothing is a constant of the traced step: an
exploit that changes it builds and traces a new model; `--space lr` tunes the learning rate alone,
an optimizer variable) through
`trainwell.tuning.search`, each trial with the tiny recipe below (trainwell's
`setup_run`, `standard_callbacks`: NaN rollback, checkpoints; `finish_run`):

- random: `tuner="random"`, `--trials` trials of `--epochs` epochs each;
- pbt: `tuner="pbt"`, a population of `--trials` members, `--ready-interval`
  epochs a segment, `--epochs` epochs each: the same total number of epochs
  (trials x epochs). Its initial population is the same random sample as random
  search's trials (same oracle seed, `start_with_defaults=False`), so what differs
  is PBT itself.

Design (set so that the issue's premise, "the best LR changes during training",
actually holds and PBT has room to act on it; chosen before measuring, not tuned
on the outcome):

- batch size 16 (`--batch-size`; 64 before): SGD's gradient noise grows as the batch
  shrinks, so a constant high LR stalls at a higher noise floor and lowering the
  LR late in training pays more;
- population 8 (`--trials`; 4 before): truncation selection at 25% then moves 2
  members a generation (with 4, one: the worst copied the best and little else
  happened);
- 12 epochs, ready every epoch (`--epochs`, `--ready-interval`; 8 before): 11
  exploit/explore rounds, enough x0.8 steps (or resamples) for a lineage's LR to
  fall by several times.

Score of a search: the validation accuracy (the objective) of its best trial (for
PBT, its best segment), and the test accuracy of that trial's best checkpoint
(`tuner.load_model`); the target compares the test accuracies. Each seed changes
the oracle seed and the model's initialisation; both searches of a seed run in this
process one after the other (alternating which goes first). Prints one JSON object:
per seed and median, for each search, and the differences. For PBT it also gives the
LR of the best member's lineage by segment (`best_lr_by_epoch`) and the exploits.

Run:
    python bench/pbt_vs_random.py                      # 8 trials x 12 epochs x 3 seeds: ~20-30 min on 2 loaded cores
    python bench/pbt_vs_random.py --quick              # 2 members x 2 epochs x 1 seed smoke run
    python bench/pbt_vs_random.py --trials 4 --epochs 8 --batch-size 64 --seeds 3   # the earlier design
    python bench/pbt_vs_random.py --trials 4 --seeds 1 --with-rebuild   # + PBT with a new model per segment
    python bench/pbt_vs_random.py --trials 4 --epochs 4 --seeds 2 --space lr   # the LR alone
    python bench/pbt_vs_random.py --trials 4 --epochs 4 --seeds 2 --keras-loss   # exploits retrace

Wall time (`wall_s`) and CPU time (`cpu_s`, this process's) are the search's alone (not
the bench's evaluation of the best model after it), after an untimed warm-up search of each
kind (2 trials x 2 epochs; not with `--quick`) takes the process's one-time costs;
`wall_time_vs_random` is PBT's over random search's, per seed (target <= 1.2), and
`cpu_time_vs_random` the same in CPU time (steadier than wall time when other jobs share the
machine). With `--with-rebuild` a third search, `pbt_rebuild`, runs PBT with
`reuse_models=False` (a new model and trace per segment, as before the model cache):
it must give the same lineage and scores as `pbt`, only slower.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import log, machine_info, parse_seeds, print_json, rnd  # noqa: E402
from trainwell.config import BaseConfig  # noqa: E402

RECIPE = "mlp-mnist5k"


@dataclasses.dataclass
class Config(BaseConfig):
    """The bench's recipe: an MLP on mnist5k with SGD at a constant learning rate."""

    dataset: str = "mnist5k"
    epochs: int = 8
    batch_size: int = 16
    precision: str = "float32"
    learning_rate: float = 0.1
    label_smoothing: float = 0.0
    units: int = 128
    verbose: int = 0
    tune_label_smoothing: bool = True  # `--space lr`: False, the LR alone is tuned
    keras_loss: bool = False  # `--keras-loss`: Keras's loss, its smoothing a constant of the traced step


def _data(cfg: Config):
    import numpy as np
    import tensorflow as tf

    from trainwell.data import load

    s = load(cfg.dataset, seed=0)

    def prep(split):
        x, y = split
        return x.reshape(len(x), -1).astype("float32") / 255.0, np.eye(10, dtype="float32")[y]

    x, y = prep(s.train)
    train = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=cfg.seed, reshuffle_each_iteration=True)
    return (train.batch(cfg.batch_size), tf.data.Dataset.from_tensor_slices(prep(s.val)).batch(500),
            tf.data.Dataset.from_tensor_slices(prep(s.test)).batch(1000), -(-len(x) // cfg.batch_size))


def build_model(cfg: Config):
    import keras

    from trainwell.losses import CategoricalCrossentropy

    keras.utils.set_random_seed(cfg.seed)
    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(cfg.units, activation="relu"),
                              keras.layers.Dense(10)])
    loss = (keras.losses.CategoricalCrossentropy if cfg.keras_loss else CategoricalCrossentropy)(
        from_logits=True, label_smoothing=cfg.label_smoothing)
    model.compile(optimizer=keras.optimizers.SGD(cfg.learning_rate), loss=loss, metrics=["accuracy"])
    return model


def train(cfg: Config, *, callbacks=None, model_hook=None, segment=False):
    from trainwell.compat import build_before_fit
    from trainwell.recipes import harness as recipe

    with recipe.setup_run(cfg, RECIPE) as ctx:  # releases the run dir's lock at the end
        train_ds, val, test, steps = _data(cfg)
        train_ds = recipe.advance_epochs(train_ds, recipe.resume_epoch(ctx.run_dir / "checkpoints"))
        model = (model_hook(build_model) if model_hook else build_model)(cfg)  # PBT's ModelCache: the member's
        cbs = recipe.standard_callbacks(cfg, ctx.run_dir, monitor="val_accuracy", mode="max", doctor=False)
        build_before_fit(model, train_ds)  # one trace on TensorFlow, as the shipped recipes do
        history = model.fit(train_ds, validation_data=val, epochs=cfg.epochs, steps_per_epoch=steps,
                            callbacks=cbs + list(callbacks or []), verbose=0)
        if segment:  # to be continued (a PBT segment): nothing reads its test score or curves
            return recipe.RunResult(model=model, history=recipe.read_history_csv(ctx.run_dir / "history.csv"),
                                    metrics={}, run_dir=ctx.run_dir, config=cfg)
        metrics = {f"test_{k}": v for k, v in model.evaluate(test, verbose=0, return_dict=True).items()}
        return recipe.finish_run(ctx, cfg, model, metrics, history)


def space(hp, cfg: Config) -> dict:
    out = {"learning_rate": hp.Float("learning_rate", 1e-3, 1.0, sampling="log", default=cfg.learning_rate)}
    if cfg.tune_label_smoothing:  # with --keras-loss a constant of the traced loss: an exploit changing it traces
        out["label_smoothing"] = hp.Float("label_smoothing", 0.0, 0.2, default=cfg.label_smoothing)
    return out


def hypermodel(cfg: Optional[Config] = None, **overrides):
    from trainwell.recipes.hypermodel import recipe_hypermodel

    return recipe_hypermodel(sys.modules[__name__], cfg or Config(**overrides), space, build_fn=build_model,
                             name=RECIPE)


def run_search(kind: str, seed: int, trials: int, epochs: int, root: Path, batch_size: int = 16,
               ready_interval: int = 1, space_name: str = "lr_smoothing", keras_loss: bool = False) -> dict:
    """One search; `kind` is "random", "pbt" or "pbt_rebuild" (PBT with a new model per segment)."""
    from trainwell import tuning

    t0, c0 = time.perf_counter(), time.process_time()
    hm = hypermodel(Config(epochs=epochs, seed=seed, batch_size=batch_size,
                           tune_label_smoothing=space_name == "lr_smoothing", keras_loss=keras_loss))
    # PBT's member 0 would start from the space's defaults; off here, so the initial
    # population is the same random sample (same oracle seed) as random search's trials.
    kw = (dict(population_size=trials, ready_interval=ready_interval, max_epochs=epochs, start_with_defaults=False,
               reuse_models=kind == "pbt")
          if kind.startswith("pbt") else dict(max_trials=trials))
    # Oracle seeds 1000 apart: KerasTuner draws value i of a search with seed `seed + i`,
    # so nearby seeds would share most of their samples.
    with contextlib.redirect_stdout(sys.stderr):  # the summary tables; stdout is the JSON only
        result = tuning.search(hm, "pbt" if kind.startswith("pbt") else kind, directory=root,
                               project_name=f"{kind}-{seed}", seed=1000 * (seed + 1), verbose=0, export=False, **kw)
    # the search itself (the test evaluation below is the bench's); CPU time is far less sensitive
    # than wall time to other jobs on a shared machine
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    best = result.tuner.oracle.get_trial(result.best_trial_id)
    model = result.tuner.load_model(best)
    _, _, test, _ = _data(hm.config_for(best.hyperparameters))
    test_acc = float(model.evaluate(test, verbose=0, return_dict=True)["accuracy"])
    epochs_run = 0
    for r in result.rows:
        meta = r.get("meta", {})
        epochs_run += (meta["pbt/epochs"] - meta["pbt/initial_epoch"]) if "pbt/epochs" in meta else epochs
    out = {
        "best_val_accuracy": rnd(result.best_score, 4),
        "test_accuracy_of_best": rnd(test_acc, 4),
        "best_hyperparameters": {k: rnd(v, 5) for k, v in result.best_hyperparameters.items()},
        "trials": len(result.rows),
        "total_epochs": epochs_run,
        "wall_s": rnd(wall, 1),
        "cpu_s": rnd(cpu, 1),
    }
    cache = getattr(result.tuner, "model_cache", None)
    if cache is not None:
        out["segments_reusing_the_model"] = sum(e == "reused" for _, e in cache.events)
        out["segments_building_a_model"] = sum(e == "built" for _, e in cache.events)
    if kind.startswith("pbt"):
        lineage = result.tuner.oracle.lineage()
        chain, tid = [], result.best_trial_id
        by_id = {r["trial_id"]: r for r in lineage}
        while tid:  # the best member's learning rate over time (its ancestry through exploits)
            chain.append(by_id[tid]["hyperparameters"]["learning_rate"])
            tid = by_id[tid]["parent"]
        out["best_lr_by_epoch"] = [rnd(x, 5) for x in reversed(chain)]
        out["exploits"] = sum(r["action"] == "exploit" for r in lineage)
    log(kind, f"seed {seed}:", out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=8, help="random-search trials = PBT population")
    ap.add_argument("--epochs", type=int, default=12, help="epochs per trial / per member")
    ap.add_argument("--batch-size", type=int, default=16, help="SGD batch size")
    ap.add_argument("--ready-interval", type=int, default=1, help="PBT: epochs per segment")
    ap.add_argument("--seeds", default="3", help="a count (3: seeds 0,1,2) or a list (0,4,7)")
    ap.add_argument("--with-rebuild", action="store_true",
                    help="also PBT with a new model per segment (reuse_models=False), the earlier behaviour")
    ap.add_argument("--space", choices=("lr_smoothing", "lr"), default="lr_smoothing",
                    help="lr_smoothing: learning rate and label smoothing (a variable of trainwell's loss; with "
                         "--keras-loss a constant of the traced loss: an exploit changing it builds and traces anew); "
                         "lr: the learning rate alone (an optimizer variable)")
    ap.add_argument("--keras-loss", action="store_true",
                    help="Keras's CategoricalCrossentropy (the smoothing a constant of the traced step: an exploit "
                         "that changes it builds and traces anew) instead of trainwell.losses' (a variable)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.trials, args.epochs, args.seeds = 2, 2, "1"
    seeds = parse_seeds(args.seeds)
    kinds = ["random", "pbt"] + (["pbt_rebuild"] if args.with_rebuild else [])
    per_seed = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="bench-pbt-") as tmp:
        if not args.quick:
            # Untimed: the first search of a process pays one-time costs (imports, TensorFlow's
            # and KerasTuner's first use, matplotlib for PBT's figure), 2-12 CPU-s on this VM, which
            # otherwise fell on whichever search ran first (random for seed 0, PBT for seed 1).
            for kind in kinds:
                run_search(kind, 10_000, 2, 2, Path(tmp) / "warmup", batch_size=args.batch_size,
                           ready_interval=args.ready_interval, space_name=args.space, keras_loss=args.keras_loss)
        for i, seed in enumerate(seeds):
            for kind in kinds[i % len(kinds):] + kinds[: i % len(kinds)]:  # the order rotates with the seed
                per_seed[kind].append(run_search(kind, seed, args.trials, args.epochs, Path(tmp),
                                                 batch_size=args.batch_size, ready_interval=args.ready_interval,
                                                 space_name=args.space, keras_loss=args.keras_loss))

    def med(kind, key):
        return rnd(statistics.median(r[key] for r in per_seed[kind]), 4)

    summary = {k: {"median_best_val_accuracy": med(k, "best_val_accuracy"),
                   "median_test_accuracy_of_best": med(k, "test_accuracy_of_best"),
                   "median_wall_s": med(k, "wall_s"),
                   "median_cpu_s": med(k, "cpu_s"),
                   "total_epochs": per_seed[k][0]["total_epochs"]} for k in per_seed}
    def ratio(key):
        return {k: rnd(statistics.median(p[key] / r[key] for p, r in zip(per_seed[k], per_seed["random"])), 3)
                for k in kinds if k != "random"}

    wall_ratio = ratio("wall_s")
    wins = sum(p["test_accuracy_of_best"] > r["test_accuracy_of_best"] for p, r in zip(per_seed["pbt"], per_seed["random"]))
    print_json({
        "benchmark": "pbt_vs_random",
        "problem": "MLP 784-128-10 on mnist5k, SGD at a constant LR (no schedule); space: learning_rate (log 1e-3..1)"
                   + (", label_smoothing (0..0.2)" if args.space == "lr_smoothing" else ""),
        "space": args.space,
        "loss": "keras.losses.CategoricalCrossentropy" if args.keras_loss else "trainwell.losses.CategoricalCrossentropy",
        "trials_or_population": args.trials,
        "epochs_per_trial_or_member": args.epochs,
        "batch_size": args.batch_size,
        "pbt_ready_interval": args.ready_interval,
        "seeds": seeds,
        "random": per_seed["random"],
        **{k: per_seed[k] for k in kinds if k != "random"},
        "summary": summary,
        # PBT's wall time over random search's at the same epochs, median over seeds of the per-seed ratio.
        "wall_time_vs_random": wall_ratio,
        "cpu_time_vs_random": ratio("cpu_s"),
        "target_pbt_wall_within_1_2x_met": wall_ratio["pbt"] <= 1.2,
        "pbt_minus_random": {
            "median_best_val_accuracy": rnd(summary["pbt"]["median_best_val_accuracy"]
                                            - summary["random"]["median_best_val_accuracy"], 4),
            "median_test_accuracy_of_best": rnd(summary["pbt"]["median_test_accuracy_of_best"]
                                                - summary["random"]["median_test_accuracy_of_best"], 4),
        },
        "pbt_wins_on_test_accuracy": f"{wins}/{len(seeds)}",
        "target_pbt_ahead_met": summary["pbt"]["median_test_accuracy_of_best"]
        > summary["random"]["median_test_accuracy_of_best"],
        "machine": machine_info(),
    })


if __name__ == "__main__":
    main()
