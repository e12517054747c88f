"""Loss-spike rollback of `NaNRollback`: false rollbacks on healthy runs, recoveries from spikes.

Two parts, in one JSON object:

- `healthy`: runs with nothing wrong in them whose per-step losses are noisy on
  purpose: the `make demo` ResNet recipe (shortened), a MiniLM fine-tune on a
  subset of Rotten Tomatoes (the recipe, shortened), and small MLP/CNN runs on
  the embedded digits with small batches, high learning rates, label noise,
  Adam without warmup, losses that go to ~0, a short warmup (so the first steps
  after it are in), mixed_float16 and `steps_per_execution=4`. Each run uses
  `NaNRollback` as configured (the recipes build their own: the defaults flow
  through) and counts its rollbacks (`false_rollbacks`: every one is false
  here). Each run also records its per-step losses and replays them through
  spike rules (`grid`): `ours` (`nan_rollback.spike_threshold`), `max` (factor x
  the recent max alone) and `median` (factor x the median of the window, the
  rule before), for windows 10-100 and factors 3-50: alarms, and `max_ratio`
  (every factor below it would have raised an alarm).
- `spikes`: an MLP on mnist5k with SGD + momentum (as in the report that led to
  spike detection being on by default) whose data has one batch with its inputs
  scaled (`--scales`, default x1e2, x1e3, x1e5: a finite loss, a huge gradient),
  under float32, mixed_float16 and `cpu:2` (`MirroredStrategy` over 2 logical
  CPUs, in a fresh process: the devices must be set before TensorFlow starts).
  Each spike is trained with spike detection off (`spike_factor=None`) and on
  (the setting under test), beside the clean run; test accuracies are compared.
  `moved`: the spike changed the final accuracy by more than 0.02 with detection
  off; `recovered`: with detection on, the accuracy is within 0.02 of the clean
  run's. Spikes land after 200 steps (`--spike-step`) and, as other rows, at
  step 6 (`--early-step`), where the history holds 5 losses. `spike_loss_off`:
  the spike's loss over the largest / the median of the 50 losses before it.

Target: 0 false rollbacks; every spike that moves the accuracy recovered.

Usage:
  python bench/spike_rollback.py              # everything: ~50 min on 2 shared cores, 25 of them the fine-tune
  python bench/spike_rollback.py --quick      # 1 seed, shorter runs, no recipes, float32 + cpu:2
  python bench/spike_rollback.py --part healthy --no-recipes
  python bench/spike_rollback.py --spike-factor 10 --spike-window 20 --no-recipes   # another setting
Prints one JSON object (stdout); progress and NaNRollback's event lines on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._common import load_avg, log, machine_info, print_json, rnd  # noqa: E402

GRID_FACTORS = (3.0, 5.0, 10.0, 20.0, 50.0)
GRID_WINDOWS = (10, 20, 50, 100)
TOLERANCE = 0.02  # accuracy change that counts as "moved" / "recovered"


# --------------------------------------------------------------------------- the detection rule, offline
def replay(losses: list[float], factor: float, window: int, rule: str = "ours", spe: int = 1) -> dict:
    """Replays a spike rule over a run's per-step losses (a spike is not added to the history).

    `"ours"`: `NaNRollback`'s rule (`nan_rollback.spike_threshold`): a loss above
    `factor` x the largest of the last `window` kept losses and above every kept
    loss of the run. `"max"`: the first condition alone. `"median"`: the rule
    before this benchmark (`factor` x the median of the window, from `window // 2`
    losses on). `spe`: batches per loss (`steps_per_execution`).
    """
    from trainwell.callbacks.nan_rollback import SPIKE_MIN_HISTORY, spike_threshold

    hist: list[float] = []
    alarms, max_ratio = [], 0.0
    for i, loss in enumerate(losses):
        recent = hist[-window:]
        if rule == "median":
            ref = statistics.median(recent) if len(hist) >= max(2, window // 2) else None
        else:
            ref = max(recent) if len(hist) * spe >= SPIKE_MIN_HISTORY else None
        if ref is not None:
            threshold = spike_threshold(recent, max(hist), factor, spe) if rule == "ours" else factor * ref
            if rule != "ours" or loss > max(hist):  # a factor below this makes it an alarm
                # ours: as a `spike_factor` (one batch at f x is (f + spe - 1) / spe x in the mean)
                max_ratio = max(max_ratio, loss / ref * spe - spe + 1 if rule == "ours" else loss / ref)
            if loss > threshold:
                alarms.append(i + 1)
                continue
        hist.append(loss)
    return {"alarms": len(alarms), "first_alarm_steps": alarms[:5], "max_ratio": max_ratio}


def grid(losses: list[float], spe: int = 1) -> dict:
    """Alarms per (rule, window, factor); `max_ratio`: every factor below it raises an alarm."""
    out = {}
    for rule in ("ours", "max", "median"):
        for w in GRID_WINDOWS:
            row = {}
            for f in GRID_FACTORS:
                r = replay(losses, f, w, rule, spe)
                row[f"alarms_x{f:g}"] = r["alarms"]
                row["max_ratio"] = rnd(r["max_ratio"], 2)
            out[f"{rule}_{w}"] = row
    return out


def spike_ratio(losses: list[float], at: int, window: int) -> dict:
    """The spike step's loss over the largest / the median of the `window` losses before it."""
    before, loss = losses[max(0, at - window):at], losses[at]
    if not before:
        return {"loss": rnd(loss, 4), "to_max": None, "to_median": None}
    return {"loss": rnd(loss, 4), "to_max": rnd(loss / max(before), 1), "to_median": rnd(loss / statistics.median(before), 1)}


# --------------------------------------------------------------------------- pieces shared by the runs
def loss_trace():
    """A callback recording the loss of every check (from the running mean in `logs`)."""
    import keras

    class LossTrace(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.losses: list[float] = []

        def on_epoch_begin(self, epoch, logs=None):
            self._k, self._m = 0, 0.0

        def on_train_batch_begin(self, batch, logs=None):
            self._begin = int(batch)

        def on_train_batch_end(self, batch, logs=None):
            if not logs or "loss" not in logs:
                return
            n = int(batch) - self._begin + 1
            m, k = float(logs["loss"]), self._k + n
            self.losses.append((m * k - self._m * self._k) / n)
            self._k, self._m = k, m

    return LossTrace()


def events_of(callbacks) -> list[dict]:
    from trainwell.callbacks import NaNRollback

    return [e for cb in callbacks if isinstance(cb, NaNRollback) for e in cb.events]


def digits(name: str, seed: int, label_noise: float = 0.0):
    """`(x_train, y_train, x_test, y_test)` of an embedded digit set, x in [0, 1]."""
    import numpy as np

    from trainwell.data import embedded

    s = embedded.load(name)
    (xt, yt), (xe, ye) = s.train, s.test
    xt, xe = xt.astype("float32") / 255.0, xe.astype("float32") / 255.0
    yt = yt.astype("int32").copy()
    if label_noise:
        rng = np.random.default_rng(1000 + seed)
        flip = rng.random(len(yt)) < label_noise
        yt[flip] = rng.integers(0, 10, flip.sum())
    return xt, yt, xe, ye.astype("int32")


def dataset(x, y, batch: int, seed: int, spike_at=None, scale: float = 1.0):
    """Shuffled, repeated batches; the batch with global index `spike_at` gets its inputs x `scale`."""
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=seed).batch(batch, drop_remainder=True).repeat()
    at = -1 if spike_at is None else int(spike_at)

    def poison(i, b):
        xb, yb = b
        return tf.where(tf.equal(i, at), xb * scale, xb), yb

    return ds.enumerate().map(poison)


def mlp(shape, width: int = 64, bn: bool = False, conv: bool = False):
    import keras

    L = keras.layers
    layers = [keras.Input(shape)]
    if conv:
        layers += [L.Conv2D(16, 3, padding="same"), *([L.BatchNormalization()] if bn else []), L.Activation("relu"),
                   L.MaxPooling2D(), L.Conv2D(32, 3, padding="same"), *([L.BatchNormalization()] if bn else []),
                   L.Activation("relu"), L.GlobalAveragePooling2D()]
    else:
        layers += [L.Flatten(), L.Dense(width, activation="relu")]
    layers += [L.Dense(10), L.Activation("linear", dtype="float32")]
    return keras.Sequential(layers)


def accuracy(model, x, y) -> float:
    import numpy as np

    return float(np.mean(np.argmax(model.predict(x, batch_size=256, verbose=0), axis=1) == y))


def rollback_kwargs(args) -> dict:
    """The NaNRollback setting under test: its defaults unless flags override them."""
    kw = {}
    if args.spike_factor is not None:
        kw["spike_factor"] = args.spike_factor
    if args.spike_window is not None:
        kw["spike_window"] = args.spike_window
    return kw


# --------------------------------------------------------------------------- healthy runs
SMALL_RUNS = {
    # name: dataset, model, batch, optimizer, peak LR, warmup steps, label noise, precision, spe
    "mlp_b8_sgd_hi_lr_noise30": dict(data="mnist5k", net="mlp", batch=8, opt="sgd", lr=0.05, warmup=100, noise=0.3),
    "mlp_b4_adam_noise10": dict(data="mnist5k", net="mlp", batch=4, opt="adam", lr=3e-3, warmup=50, noise=0.1),
    "mlp_b16_sgd_clean_to_zero": dict(data="mnist5k", net="mlp", batch=16, opt="sgd", lr=0.1, warmup=20, noise=0.0),
    "mlp_b32_adam_no_warmup": dict(data="mnist5k", net="mlp", batch=32, opt="adam", lr=1e-2, warmup=0, noise=0.0),
    "cnn_bn_b8_digits": dict(data="digits", net="cnn_bn", batch=8, opt="sgd", lr=0.1, warmup=50, noise=0.1),
    "mlp_b8_mixed_float16": dict(data="mnist5k", net="mlp", batch=8, opt="sgd", lr=0.05, warmup=100, noise=0.3,
                                 precision="mixed_float16"),
    "mlp_b8_spe4": dict(data="mnist5k", net="mlp", batch=8, opt="sgd", lr=0.05, warmup=100, noise=0.3, spe=4),
    "mlp_b4_adam_spe8": dict(data="mnist5k", net="mlp", batch=4, opt="adam", lr=3e-3, warmup=50, noise=0.1, spe=8),
}


def small_healthy(name: str, spec: dict, seed: int, steps: int, args) -> dict:
    import keras

    from trainwell.callbacks import NaNRollback
    from trainwell.callbacks.schedules import WarmupCosineDecay

    keras.mixed_precision.set_global_policy(spec.get("precision", "float32"))
    keras.utils.set_random_seed(seed)
    xt, yt, xe, ye = digits(spec["data"], seed, spec["noise"])
    model = mlp(xt.shape[1:], bn=spec["net"] == "cnn_bn", conv=spec["net"] == "cnn_bn")
    sched = WarmupCosineDecay(spec["lr"], total_steps=steps, warmup_steps=spec["warmup"])
    opt = keras.optimizers.SGD(sched, momentum=0.9) if spec["opt"] == "sgd" else keras.optimizers.Adam(sched)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=spec.get("spe", 1))
    trace = loss_trace()
    cbs = [NaNRollback(**rollback_kwargs(args)), trace]
    spe = spec.get("spe", 1)
    per_epoch = max(spe, (len(xt) // spec["batch"]) // spe * spe)
    t0 = time.perf_counter()
    model.fit(dataset(xt, yt, spec["batch"], seed), steps_per_epoch=per_epoch, epochs=max(1, steps // per_epoch),
              callbacks=cbs, verbose=0)
    keras.mixed_precision.set_global_policy("float32")
    return {
        "run": name, "seed": seed, "steps": len(trace.losses) * spe, "checks": len(trace.losses),
        "test_accuracy": rnd(accuracy(model, xe, ye), 4), "wall_s": rnd(time.perf_counter() - t0, 1),
        "false_rollbacks": len(events_of(cbs)), "events": events_of(cbs),
        "loss_scale_skips": cbs[0].loss_scale_skips, "grid": grid(trace.losses, spe), "_losses": trace.losses,
    }


def recipe_healthy(which: str, seed: int, args, tmp: Path) -> dict:
    trace = loss_trace()
    t0 = time.perf_counter()
    if which == "demo":
        from trainwell.recipes import resnet_imagenet as r

        path = REPO / "configs" / "demo_mnist5k.yaml"
        over = dict(epochs=args.demo_epochs, warmup_epochs=min(2.0, args.demo_epochs / 2))
    else:
        from trainwell.recipes import transformer_finetune as r

        path = REPO / "configs" / "minilm_rotten_tomatoes.yaml"
        over = dict(epochs=args.finetune_epochs, max_train_examples=args.finetune_examples,
                    early_stopping_patience=None, export=False)
    run_dir = tmp / f"{which}-{seed}"
    _recipe_rollback(args)
    over.update(seed=seed, run_dir=str(run_dir), keep_last=1, verbose="0" if which == "finetune" else 0)
    cfg = r.Config.load(path, overrides=over)
    run = r.train(cfg, callbacks=[trace])
    events_file = run_dir / "nan_rollback.jsonl"
    events = [json.loads(line) for line in events_file.read_text().splitlines()] if events_file.exists() else []
    return {
        "run": which, "seed": seed, "steps": len(trace.losses), "test_accuracy": rnd(run.metrics.get("test_accuracy"), 4),
        "wall_s": rnd(time.perf_counter() - t0, 1), "false_rollbacks": len(events), "events": events,
        "grid": grid(trace.losses), "_losses": trace.losses,
    }


def _recipe_rollback(args) -> None:
    if args.spike_factor is not None or args.spike_window is not None:
        raise SystemExit("--spike-factor/--spike-window apply to the small runs only; the recipes use their own "
                         "defaults: add --no-recipes")


def part_healthy(args) -> dict:
    import shutil

    rows, losses = [], {}
    tmp = Path(tempfile.mkdtemp(prefix="trainwell-spike-"))
    names = [n for n, spec in SMALL_RUNS.items() if not (args.quick and (spec.get("precision") or spec.get("spe")))]
    names += ["demo", "finetune"] if args.recipes else []
    names = [n for n in names if not args.runs or n in args.runs]
    try:
        for seed in range(args.seeds):
            for name in names:
                if name not in SMALL_RUNS and seed >= args.recipe_seeds:
                    continue
                log(f"healthy {name} seed {seed} ...")
                if name in SMALL_RUNS:
                    rows.append(small_healthy(name, SMALL_RUNS[name], seed, args.healthy_steps, args))
                else:
                    rows.append(recipe_healthy(name, seed, args, tmp))
                log(f"  false rollbacks {rows[-1]['false_rollbacks']}, test accuracy {rows[-1]['test_accuracy']}, "
                    f"largest ratio to the recent max at a new high: {rows[-1]['grid']['ours_50']['max_ratio']}")
                losses[f"{name}-{seed}"] = rows[-1].pop("_losses")
                if args.keep_losses:
                    Path(args.keep_losses).write_text(json.dumps(losses))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    keys = list(rows[0]["grid"]) if rows else []
    total = {k: {f"x{f:g}": sum(r["grid"][k][f"alarms_x{f:g}"] for r in rows) for f in GRID_FACTORS} for k in keys}
    worst = {k: max(r["grid"][k]["max_ratio"] or 0 for r in rows) for k in keys}
    return {"runs": rows, "false_rollbacks": sum(r["false_rollbacks"] for r in rows),
            "grid_alarms_total": total, "grid_max_ratio": worst}


# --------------------------------------------------------------------------- spikes
def spike_run(precision: str, scale, spike_at, rollback, seed: int, args, strategy=None, spe: int = 1) -> dict:
    import keras

    from trainwell.callbacks import NaNRollback

    keras.mixed_precision.set_global_policy(precision)
    keras.utils.set_random_seed(seed)
    xt, yt, xe, ye = digits("mnist5k", seed)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = mlp(xt.shape[1:], width=64)
        model.compile(keras.optimizers.SGD(args.spike_lr, momentum=0.9),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True), steps_per_execution=spe)
    trace = loss_trace()
    cbs = [NaNRollback(**rollback), trace]
    per_epoch = len(xt) // 32 // spe * spe
    model.fit(dataset(xt, yt, 32, seed, spike_at if scale else None, scale or 1.0), steps_per_epoch=per_epoch,
              epochs=args.spike_epochs, callbacks=cbs, verbose=0)
    keras.mixed_precision.set_global_policy("float32")
    ev = events_of(cbs)
    out = {"test_accuracy": rnd(accuracy(model, xe, ye), 4), "rollbacks": len(ev),
           "causes": [e["causes"] for e in ev], "steps": [e["step"] for e in ev],
           "loss_scale_skips": cbs[0].loss_scale_skips}
    if scale and not ev:  # the spike's loss against the losses before it (as `replay` sees them)
        out["spike"] = spike_ratio(trace.losses, spike_at // spe, 50)
    return out


def spikes_for(setting: str, args, strategy=None) -> list[dict]:
    """All spike rows of one setting (`float32`, `mixed_float16`, `cpu:2` or `spe4`)."""
    precision = "mixed_float16" if setting == "mixed_float16" else "float32"
    spe = 4 if setting == "spe4" else 1
    on = rollback_kwargs(args)
    rows = []
    for seed in range(args.seeds):
        log(f"spikes {setting} seed {seed}: clean ...")
        clean = spike_run(precision, None, None, on, seed, args, strategy, spe)
        for where, step in (("after_history", args.spike_step), ("first_steps", args.early_step)):
            for scale in args.scales:
                off = spike_run(precision, scale, step, {"spike_factor": None}, seed, args, strategy, spe)
                det = spike_run(precision, scale, step, on, seed, args, strategy, spe)
                moved = abs(off["test_accuracy"] - clean["test_accuracy"]) > TOLERANCE
                recovered = abs(det["test_accuracy"] - clean["test_accuracy"]) <= TOLERANCE
                rows.append({
                    "setting": setting, "seed": seed, "where": where, "spike_step": step + 1, "scale": scale,
                    "clean_accuracy": clean["test_accuracy"], "clean_rollbacks": clean["rollbacks"],
                    "off_accuracy": off["test_accuracy"], "on_accuracy": det["test_accuracy"],
                    "moved": moved, "recovered": recovered, "on_rollbacks": det["rollbacks"],
                    "on_causes": det["causes"], "on_rollback_steps": det["steps"],
                    "off_loss_scale_skips": off["loss_scale_skips"], "on_loss_scale_skips": det["loss_scale_skips"],
                    "spike_loss_off": off.get("spike"),
                })
                log(f"  {where} x{scale:g}: clean {clean['test_accuracy']:.3f} off {off['test_accuracy']:.3f} "
                    f"on {det['test_accuracy']:.3f} rollbacks {det['rollbacks']} {det['causes']} spike {off.get('spike')}")
    return rows


def part_spikes(args) -> dict:
    rows = []
    for s in args.settings:
        if s == "cpu:2":
            rows += _spikes_in_fresh_process(args)
        else:
            rows += spikes_for(s, args)
    moved = [r for r in rows if r["moved"]]
    return {
        "rows": rows,
        "moved": len(moved),
        "moved_and_recovered": sum(r["recovered"] for r in moved),
        "not_recovered": [{k: r[k] for k in ("setting", "seed", "where", "scale", "clean_accuracy", "off_accuracy",
                                             "on_accuracy")} for r in moved if not r["recovered"]],
        "rollbacks_on_clean_runs": sum({(r["setting"], r["seed"]): r["clean_rollbacks"] for r in rows}.values()),
    }


def _spikes_in_fresh_process(args) -> list[dict]:
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--worker-cpu2", *sys.argv[1:]]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, cwd=str(REPO))
    if r.returncode != 0:
        raise RuntimeError(f"cpu:2 worker failed with exit code {r.returncode}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["all", "healthy", "spikes"], default="all")
    p.add_argument("--quick", action="store_true", help="1 seed, shorter runs, no recipes, no mixed_float16/spe4")
    p.add_argument("--seeds", type=int, default=None, help="seeds per run (default 2; 1 with --quick)")
    p.add_argument("--no-recipes", dest="recipes", action="store_false", help="skip the demo and fine-tune runs")
    p.add_argument("--runs", nargs="+", default=None, help=f"healthy runs to do: {', '.join(SMALL_RUNS)}, demo, finetune")
    p.add_argument("--healthy-steps", type=int, default=None, help="steps of each small healthy run (default 1300)")
    p.add_argument("--recipe-seeds", type=int, default=1, help="seeds of the demo and fine-tune runs")
    p.add_argument("--demo-epochs", type=int, default=3)
    p.add_argument("--finetune-epochs", type=int, default=2)
    p.add_argument("--finetune-examples", type=int, default=2000)
    p.add_argument("--spike-factor", type=float, default=None, help="default: NaNRollback's")
    p.add_argument("--spike-window", type=int, default=None, help="default: NaNRollback's")
    p.add_argument("--scales", type=float, nargs="+", default=[1e2, 1e3, 1e5])
    p.add_argument("--spike-step", type=int, default=200, help="global batch index of the spike (0-based)")
    p.add_argument("--early-step", type=int, default=5, help="global batch index of the early spike")
    p.add_argument("--spike-epochs", type=int, default=None, help="epochs of the spike runs (109 steps each; default 3)")
    p.add_argument("--spike-lr", type=float, default=0.05)
    p.add_argument("--settings", nargs="+", choices=["float32", "mixed_float16", "cpu:2", "spe4"], default=None,
                   help="spike settings (default: float32 mixed_float16 cpu:2; float32 cpu:2 with --quick); "
                        "spe4: float32 with steps_per_execution=4")
    p.add_argument("--keep-losses", default=None, help="write the healthy runs' per-step losses to this JSON file")
    p.add_argument("--worker-cpu2", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.seeds = args.seeds or (1 if args.quick else 2)
    args.healthy_steps = args.healthy_steps or (500 if args.quick else 1300)
    args.spike_epochs = args.spike_epochs or (2 if args.quick else 3)
    if args.quick:
        args.recipes = False
    args.settings = args.settings or (["float32", "cpu:2"] if args.quick else ["float32", "mixed_float16", "cpu:2"])

    if args.worker_cpu2:
        from trainwell import runtime

        strategy = runtime.make_strategy("cpu:2")  # before any TensorFlow op
        with contextlib.redirect_stdout(sys.stderr):  # NaNRollback prints its events
            rows = spikes_for("cpu:2", args, strategy)
        print(json.dumps(rows))
        return

    from trainwell.callbacks import NaNRollback

    defaults = NaNRollback().get_config()
    out = {
        "benchmark": "spike_rollback",
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "setting": {"spike_factor": defaults["spike_factor"], "spike_window": defaults["spike_window"],
                    **rollback_kwargs(args), "snapshot_every": defaults["snapshot_every"],
                    "lr_factor": defaults["lr_factor"]},
        "machine": machine_info(),
    }
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # NaNRollback and the doctor print their events
        if args.part in ("all", "healthy"):
            out["healthy"] = part_healthy(args)
        if args.part in ("all", "spikes"):
            out["spikes"] = part_spikes(args)
    out["wall_s"] = rnd(time.perf_counter() - t0, 0)
    out["machine"]["load_avg_1min_end"] = load_avg()
    print_json(out)


if __name__ == "__main__":
    main()
