"""Overhead of trainwell's callback stack on `model.fit`, against bare Keras.

The same model, data and seed are trained in three ways, alternating within one
run (absolute times on shared machines are noisy; the ratios are what counts):

- `bare`: `model.fit` with no callbacks;
- `trainwell`: the full stack at defaults: `WarmupCosine`, `NaNRollback`,
  `Checkpoint` each epoch, `EarlyStopping`;
- `backup_and_restore`: `keras.callbacks.BackupAndRestore` saving each epoch (the
  built-in that `Checkpoint` replaces).

Timing covers every epoch after the first (the first traces and compiles), from
the end of epoch 1 to the end of `fit`, so saves at epoch boundaries and the final
save are included. The model is a small CNN whose training step takes >= 20 ms on
a 2-core CPU (the issue's floor: below that, per-step Python overhead dominates).
Target: trainwell steps/s >= 0.97 x bare.

Usage: python bench/callback_overhead.py [--rounds 3] [--epochs 4] [--steps 30]
Prints one JSON object.

The short-step case (`--case short`, issue #21): on an accelerator a step takes a
few milliseconds and any per-step Python work or host sync shows in throughput, so
a small MLP (784-256-256-10, batch 128: about 4 ms a step on a 2-core CPU) trains
`--short-epochs` x `--short-steps` steps (9 x 128: the first epoch traces and is
not timed, the 1,024 steps after it are), each configuration in a fresh process,
the order rotated each round, the median of `--rounds` rounds, at
`steps_per_execution` 1 and 8 (`--spe`). Every configuration validates on the
same 512 examples each epoch. Configurations:

- `bare`: `fit` with no callbacks (constant LR);
- `keras`: Keras's nearest stack: `CosineDecay` with warmup (the optimizer's
  schedule) + `TerminateOnNaN` + `BackupAndRestore` each epoch + `EarlyStopping`;
- `trainwell`: trainwell's defaults: `WarmupCosine` + `NaNRollback` + `Checkpoint`
  each epoch + `EarlyStopping`;
- `warmup_cosine`, `nan_rollback`, `checkpoint`, `early_stopping`: each trainwell
  callback alone (attribution);
- only when `--kinds` names them: `keras_tensorboard` (Keras's `TensorBoard` at its
  defaults, which the recipes add) and `tensorboard` (trainwell's, which skips the
  per-batch summary calls that record nothing).

Figures: ms per step of the timed steps (wall and CPU), and ratios against `bare`
and `keras`. Target (#21): `trainwell` <= 1.02 x `keras` at both values of spe.

The sub-millisecond case (`--case tiny`, issue #31): the same configurations on a
64-128-128-10 MLP (batch 128: 0.35-0.9 ms a step on a 2-core CPU), at
`steps_per_execution` 1, 8 and 32 by default, plus each Keras counterpart alone:
`keras_cosine_decay` (the optimizer's `CosineDecay` with warmup, no callback),
`terminate_on_nan`, `backup_and_restore` (each epoch), `keras_early_stopping`. The
interleaved JSON gives each trainwell callback against its counterpart
(`<kind>_vs_counterpart`) and what each configuration adds to `bare` per execution of
`spe` steps (`extra_ms_per_execution_vs_bare`). Target (#31): `trainwell` <= 1.05 x
`keras` at each spe, medians of at least 5 interleaved rounds.

`--interleaved`: all configurations in one process, each `fit` in a thread of its own,
taking turns an epoch at a time (one runs, the others wait), `--short-epochs` - 1 timed
rounds; each ratio is the median over rounds of the per-round ratio (epochs seconds
apart), which cancels the drift in this VM's speed that separates fresh-process rounds
minutes apart. One model instance per configuration, so a run still carries that
instance's own speed: repeat the run.

    python bench/callback_overhead.py --case short --rounds 3
    python bench/callback_overhead.py --case short --spe 1 --kinds bare keras trainwell --rounds 7   # the headline only
    python bench/callback_overhead.py --case short --interleaved --spe 1 8 --short-epochs 16 \
        --kinds bare keras trainwell keras_tensorboard tensorboard   # one process, an epoch each in turn
    python bench/callback_overhead.py --case tensorboard_hooks --rounds 5   # TensorBoard's batch hooks alone
    python bench/callback_overhead.py --case tiny --interleaved --short-epochs 9   # sub-ms steps, spe 1 8 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def build(seed: int):
    import keras

    keras.utils.set_random_seed(seed)
    L = keras.layers
    model = keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            L.Conv2D(32, 3, padding="same", activation="relu"),
            L.Conv2D(32, 3, padding="same", activation="relu"),
            L.MaxPooling2D(),
            L.Conv2D(64, 3, padding="same", activation="relu"),
            L.MaxPooling2D(),
            L.GlobalAveragePooling2D(),
            L.Dense(10, activation="softmax"),
        ]
    )
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class _Timer:
    def __init__(self):
        import keras

        class T(keras.callbacks.Callback):
            def on_epoch_end(s, epoch, logs=None):
                if epoch == 0:
                    self.t0, self.c0 = time.perf_counter(), time.process_time()

            def on_train_end(s, logs=None):
                self.t1, self.c1 = time.perf_counter(), time.process_time()

        self.callback = T()


def run(kind: str, data, epochs: int, steps: int, workdir: str) -> tuple[float, float]:
    import keras

    from trainwell.callbacks import Checkpoint, EarlyStopping, NaNRollback, WarmupCosine

    (x, y), val = data
    model = build(0)
    timer = _Timer()
    d = tempfile.mkdtemp(dir=workdir)
    if kind == "bare":
        cbs = []
    elif kind == "trainwell":
        cbs = [WarmupCosine(warmup_epochs=1), NaNRollback(), EarlyStopping(patience=100), Checkpoint(d)]
    elif kind in ("warmup_cosine", "nan_rollback", "early_stopping", "checkpoint"):  # attribution
        cbs = [{"warmup_cosine": lambda: WarmupCosine(warmup_epochs=1), "nan_rollback": NaNRollback,
                "early_stopping": lambda: EarlyStopping(patience=100), "checkpoint": lambda: Checkpoint(d)}[kind]()]
    elif kind == "backup_and_restore":
        cbs = [keras.callbacks.BackupAndRestore(d, save_freq="epoch", delete_checkpoint=False)]
    else:  # pragma: no cover
        raise ValueError(kind)
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(64, drop_remainder=True).repeat()
    model.fit(ds, epochs=epochs, steps_per_epoch=steps, validation_data=val, callbacks=cbs + [timer.callback], verbose=0)
    n = (epochs - 1) * steps
    return n / (timer.t1 - timer.t0), n / (timer.c1 - timer.c0)


# --------------------------------------------------------------------------- the short-step case
SHORT_KINDS = ("bare", "keras", "trainwell", "warmup_cosine", "nan_rollback", "checkpoint", "early_stopping")
# Not in the default run (`--kinds` names them): Keras's `TensorBoard` at its defaults alone, and trainwell's.
TENSORBOARD_KINDS = ("keras_tensorboard", "tensorboard")
# Each Keras counterpart alone (`--case tiny`'s attribution): the schedule, TerminateOnNaN,
# BackupAndRestore each epoch, EarlyStopping.
KERAS_PART_KINDS = ("keras_cosine_decay", "terminate_on_nan", "backup_and_restore", "keras_early_stopping")
TINY_KINDS = SHORT_KINDS + KERAS_PART_KINDS
ALL_KINDS = TINY_KINDS + TENSORBOARD_KINDS
#: Each trainwell callback's Keras counterpart (`--case tiny`: `<kind>_vs_counterpart`).
COUNTERPARTS = {"warmup_cosine": "keras_cosine_decay", "nan_rollback": "terminate_on_nan",
                "checkpoint": "backup_and_restore", "early_stopping": "keras_early_stopping"}
SHORT_BATCH = 128
SHORT_LR = 0.05
#: The MLP of each case: input features and hidden widths (10 classes).
MODELS = {"short": (784, (256, 256)), "tiny": (64, (128, 128))}


def short_callbacks(kind: str, directory: str, total_steps: int, steps_per_epoch: int) -> list:
    """The callbacks of one short-step configuration (see the module docstring)."""
    import keras

    from trainwell.callbacks import Checkpoint, EarlyStopping, NaNRollback, WarmupCosine

    patience = 1000  # never stops: every configuration trains every step
    if kind == "bare":
        return []
    if kind in TENSORBOARD_KINDS:  # each at its defaults (update_freq="epoch"), as the recipes use it
        from trainwell.callbacks import TensorBoard

        cls = keras.callbacks.TensorBoard if kind == "keras_tensorboard" else TensorBoard
        return [cls(log_dir=os.path.join(directory, "tensorboard"))]
    keras_parts = {
        "keras_cosine_decay": lambda: None,  # the optimizer's schedule (see build_short): no callback
        "terminate_on_nan": keras.callbacks.TerminateOnNaN,
        "backup_and_restore": lambda: keras.callbacks.BackupAndRestore(
            os.path.join(directory, "backup"), save_freq="epoch", delete_checkpoint=False),
        "keras_early_stopping": lambda: keras.callbacks.EarlyStopping(monitor="val_loss", patience=patience),
    }
    if kind == "keras":  # the warmup + cosine schedule is the optimizer's (see build_short)
        return [keras_parts[k]() for k in KERAS_PART_KINDS[1:]]
    if kind in keras_parts:
        return [cb for cb in [keras_parts[kind]()] if cb is not None]
    parts = {
        "warmup_cosine": lambda: WarmupCosine(warmup_epochs=1),
        "nan_rollback": NaNRollback,
        "checkpoint": lambda: Checkpoint(os.path.join(directory, "ckpt")),
        "early_stopping": lambda: EarlyStopping(monitor="val_loss", patience=patience),
    }
    if kind == "trainwell":
        return [parts[k]() for k in ("warmup_cosine", "nan_rollback", "early_stopping", "checkpoint")]
    return [parts[kind]()]


def build_short(kind: str, spe: int, total_steps: int, steps_per_epoch: int, case: str = "short"):
    """The case's MLP (784-256-256-10 or 64-128-128-10), SGD with momentum.

    `keras` and `keras_cosine_decay` get Keras's `CosineDecay` with a 1-epoch warmup.
    """
    import keras

    keras.utils.set_random_seed(0)
    lr = SHORT_LR
    if kind in ("keras", "keras_cosine_decay"):
        lr = keras.optimizers.schedules.CosineDecay(
            0.0, decay_steps=total_steps - steps_per_epoch, warmup_target=SHORT_LR, warmup_steps=steps_per_epoch)
    features, hidden = MODELS[case]
    model = keras.Sequential([keras.Input((features,)), *(keras.layers.Dense(h, activation="relu") for h in hidden),
                              keras.layers.Dense(10)])
    model.compile(keras.optimizers.SGD(lr, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                  steps_per_execution=spe)
    return model


def short_data(steps: int, case: str = "short"):
    """`(train, validation)`: random MLP inputs, `steps` batches repeated, and 512 of them to validate on."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(SHORT_BATCH * steps, MODELS[case][0])).astype("float32")
    y = rng.integers(0, 10, size=(len(x),)).astype("int32")
    val = tf.data.Dataset.from_tensor_slices((x[:512], y[:512])).batch(SHORT_BATCH)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(SHORT_BATCH, drop_remainder=True).repeat(), val


def short_child(kind: str, spe: int, epochs: int, steps: int, profile: str | None = None,
                case: str = "short") -> dict:
    """One configuration in this (fresh) process: ms per timed step, wall and CPU."""
    ds, val = short_data(steps, case)
    model = build_short(kind, spe, epochs * steps, steps, case)
    timer = _Timer()
    with tempfile.TemporaryDirectory() as d:
        cbs = short_callbacks(kind, d, epochs * steps, steps)
        prof = None
        if profile:
            import cProfile

            prof = cProfile.Profile()
        import keras

        class ProfileTimedPart(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                if epoch == 0 and prof is not None:
                    prof.enable()

            def on_train_end(self, logs=None):
                if prof is not None:
                    prof.disable()

        model.fit(ds, epochs=epochs, steps_per_epoch=steps, validation_data=val, verbose=0,
                  callbacks=cbs + [timer.callback, ProfileTimedPart()])
    if prof is not None:
        prof.dump_stats(profile)
    n = (epochs - 1) * steps
    return {"kind": kind, "spe": spe, "ms_per_step": 1000 * (timer.t1 - timer.t0) / n,
            "cpu_ms_per_step": 1000 * (timer.c1 - timer.c0) / n}


def short_interleaved(kinds, spe: int, epochs: int, steps: int, case: str = "short", target: float = 1.02) -> dict:
    """Every configuration in this one process, taking turns an epoch at a time.

    Each configuration's `fit` runs in a thread of its own; a turn is one epoch (steps,
    validation, every callback's epoch hooks), and only one thread runs at a time (the
    others wait on a condition), so a configuration never shares the CPU with another.
    The ratios are taken per round (the epochs of one round ran seconds apart), which
    cancels the slow drifts in this machine's speed that fresh-process rounds minutes
    apart cannot (2026-12-02: a bare fit measured 6.2 to 12.6 ms/step across rounds).
    The first epoch (the trace) of each is not timed.
    """
    import threading

    import keras

    cond = threading.Condition()
    state = {"turn": 0, "done": set()}
    walls = {k: [] for k in kinds}
    cpus = {k: [] for k in kinds}
    errors = []

    def pass_on(i):
        with cond:
            for j in range(1, len(kinds) + 1):
                nxt = (i + j) % len(kinds)
                if nxt not in state["done"]:
                    break
            state["turn"] = nxt
            cond.notify_all()

    def wait(i):
        with cond:
            cond.wait_for(lambda: state["turn"] == i)

    class Turns(keras.callbacks.Callback):
        def __init__(self, i):
            super().__init__()
            self.i = i

        def on_train_begin(self, logs=None):
            wait(self.i)

        def on_epoch_end(self, epoch, logs=None):
            if epoch >= 1:
                walls[kinds[self.i]].append(time.perf_counter() - self.t)
                cpus[kinds[self.i]].append(time.process_time() - self.c)
            pass_on(self.i)
            wait(self.i)
            self.t, self.c = time.perf_counter(), time.process_time()

        def on_train_end(self, logs=None):
            with cond:
                state["done"].add(self.i)
            pass_on(self.i)

    def one(i, kind, directory):
        try:
            ds, val = short_data(steps, case)
            model = build_short(kind, spe, epochs * steps, steps, case)
            cbs = short_callbacks(kind, directory, epochs * steps, steps)
            model.fit(ds, epochs=epochs, steps_per_epoch=steps, validation_data=val, verbose=0,
                      callbacks=cbs + [Turns(i)])
        except BaseException as e:  # noqa: BLE001 - reported below, after the others finish
            errors.append((kind, e))
            with cond:
                state["done"].add(i)
            pass_on(i)

    with tempfile.TemporaryDirectory() as d:
        threads = [threading.Thread(target=one, args=(i, k, os.path.join(d, k))) for i, k in enumerate(kinds)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise RuntimeError(f"a configuration failed: {errors}")
    ms = {k: [1000 * v / steps for v in walls[k]] for k in kinds}
    cms = {k: [1000 * v / steps for v in cpus[k]] for k in kinds}
    rounds = min(len(v) for v in ms.values())

    def ratios(a, b, table):
        return [table[a][r] / table[b][r] for r in range(rounds)]

    out = {"ms_per_step": {k: round(statistics.median(v), 3) for k, v in ms.items()},
           "cpu_ms_per_step": {k: round(statistics.median(v), 3) for k, v in cms.items()},
           "rounds": rounds}
    for a, b in (("trainwell", "keras"), ("trainwell", "bare"), ("keras", "bare")):
        out[f"{a}_vs_{b}"] = round(statistics.median(ratios(a, b, ms)), 4)
        out[f"{a}_vs_{b}_cpu"] = round(statistics.median(ratios(a, b, cms)), 4)
        out[f"{a}_vs_{b}_per_round"] = [round(r, 3) for r in ratios(a, b, ms)]
    for k in kinds:
        if k not in ("bare", "keras", "trainwell"):
            out[f"{k}_vs_bare"] = round(statistics.median(ratios(k, "bare", ms)), 4)
        if COUNTERPARTS.get(k) in kinds:
            out[f"{k}_vs_counterpart"] = round(statistics.median(ratios(k, COUNTERPARTS[k], ms)), 4)
    # What a configuration adds to bare, per execution of `spe` steps (median of the rounds' differences).
    out["extra_ms_per_execution_vs_bare"] = {
        k: round(spe * statistics.median(ms[k][r] - ms["bare"][r] for r in range(rounds)), 3)
        for k in kinds if k != "bare"}
    out[f"target_trainwell_within_{target:g}x_keras_met"] = out["trainwell_vs_keras"] <= target
    return out


def _model_name(case: str) -> str:
    features, hidden = MODELS[case]
    return f"MLP {features}-{'-'.join(map(str, hidden))}-10, batch {SHORT_BATCH}, SGD momentum 0.9"


def short_case(args) -> dict:
    case = args.case
    kinds = tuple(args.kinds or (TINY_KINDS if case == "tiny" else SHORT_KINDS))
    target = 1.05 if case == "tiny" else 1.02
    if args.interleaved:
        out = {"benchmark": "callback_overhead", "case": case, "mode": "interleaved",
               "model": _model_name(case), "steps_per_epoch": args.short_steps,
               "epochs": args.short_epochs}
        for spe in args.spe:
            out[f"spe_{spe}"] = short_interleaved(kinds, spe, args.short_epochs, args.short_steps, case, target)
            print(f"spe {spe}: {out[f'spe_{spe}']}", file=sys.stderr, flush=True)
        out["load_avg_1min"] = os.getloadavg()[0]
        print(json.dumps(out, indent=2))
        return out
    configs = [(k, spe) for spe in args.spe for k in kinds]
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    for r in range(args.rounds):
        shift = (r * len(configs)) // max(1, args.rounds)  # rotate the order each round
        for kind, spe in configs[shift:] + configs[:shift]:
            cmd = [sys.executable, os.path.abspath(__file__), "--short-child", kind, "--spe", str(spe),
                   "--short-epochs", str(args.short_epochs), "--short-steps", str(args.short_steps),
                   "--case", case]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                 env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
            res = json.loads(out.stdout.strip().splitlines()[-1])
            runs[(kind, spe)].append(res)
            print(f"round {r} spe {spe} {kind}: {res['ms_per_step']:.3f} ms/step "
                  f"({res['cpu_ms_per_step']:.3f} CPU ms)", file=sys.stderr, flush=True)
    out: dict = {
        "benchmark": "callback_overhead",
        "case": case,
        "model": _model_name(case),
        "steps_timed": (args.short_epochs - 1) * args.short_steps,
        "steps_per_epoch": args.short_steps,
        "rounds": args.rounds,
    }
    for spe in args.spe:
        med = {k: statistics.median(x["ms_per_step"] for x in runs[(k, spe)]) for k in kinds}
        med_cpu = {k: statistics.median(x["cpu_ms_per_step"] for x in runs[(k, spe)]) for k in kinds}
        out[f"spe_{spe}"] = {
            "ms_per_step": {k: round(v, 3) for k, v in med.items()},
            "ms_per_step_all": {k: [round(x["ms_per_step"], 3) for x in runs[(k, spe)]] for k in kinds},
            "cpu_ms_per_step_all": {k: [round(x["cpu_ms_per_step"], 3) for x in runs[(k, spe)]] for k in kinds},
            "cpu_ms_per_step": {k: round(v, 3) for k, v in med_cpu.items()},
            "wall_vs_bare": {k: round(v / med["bare"], 4) for k, v in med.items() if k != "bare"},
            "cpu_vs_bare": {k: round(v / med_cpu["bare"], 4) for k, v in med_cpu.items() if k != "bare"},
            "extra_ms_per_step_vs_bare": {k: round(v - med["bare"], 3) for k, v in med.items() if k != "bare"},
            "trainwell_vs_keras": round(med["trainwell"] / med["keras"], 4),
            "trainwell_vs_keras_cpu": round(med_cpu["trainwell"] / med_cpu["keras"], 4),
            f"target_trainwell_within_{target:g}x_keras_met": med["trainwell"] / med["keras"] <= target,
        }
    out["load_avg_1min"] = os.getloadavg()[0]
    print(json.dumps(out, indent=2))
    return out


def tensorboard_hooks(rounds: int, calls: int = 2000) -> dict:
    """Microseconds per step of the batch hooks of Keras's `TensorBoard` and trainwell's, at their defaults.

    Both in this process, alternating, `rounds` rounds of `calls` steps each, with a
    batch's logs of two values (a loss and one metric), outside any `fit`.
    """
    import keras
    import tensorflow as tf

    from trainwell.callbacks import TensorBoard

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse", metrics=["mae"])
    logs = {"loss": tf.constant(0.5), "mae": tf.constant(0.3)}
    out: dict = {"keras": [], "trainwell": []}
    with tempfile.TemporaryDirectory() as d:
        cbs = {}
        for name, cls in (("keras", keras.callbacks.TensorBoard), ("trainwell", TensorBoard)):
            cb = cls(log_dir=os.path.join(d, name), write_graph=False)
            cb.set_model(model)
            cb.on_train_begin()
            cb.on_epoch_begin(0)
            cbs[name] = cb
        step = 0
        for _ in range(rounds):
            for name, cb in cbs.items():
                t = time.perf_counter()
                for _ in range(calls):
                    cb.on_train_batch_begin(step)
                    cb.on_train_batch_end(step, logs)
                    step += 1
                out[name].append(1e6 * (time.perf_counter() - t) / calls)
    med = {k: statistics.median(v) for k, v in out.items()}
    return {"benchmark": "callback_overhead", "case": "tensorboard_hooks", "logs_values": 2,
            "us_per_step": {k: round(v, 1) for k, v in med.items()},
            "us_per_step_all": {k: [round(x, 1) for x in v] for k, v in out.items()},
            "load_avg_1min": os.getloadavg()[0]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=("cnn", "short", "tiny", "tensorboard_hooks"), default="cnn",
                   help="cnn: the small CNN in one process; short: the ~4 ms MLP, a process per run; "
                        "tiny: the sub-millisecond MLP (64-128-128-10), with Keras's parts alone too; "
                        "tensorboard_hooks: the batch hooks of Keras's TensorBoard and trainwell's, timed alone")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--steps", type=int, default=30, help="steps per epoch")
    p.add_argument("--attribute", action="store_true", help="also time each trainwell callback alone")
    p.add_argument("--spe", type=int, nargs="+", help="short/tiny case: steps_per_execution values "
                   "(default: 1 8 for short, 1 8 32 for tiny)")
    p.add_argument("--short-epochs", type=int, default=9, help="short case: epochs (the first is not timed)")
    p.add_argument("--short-steps", type=int, default=128, help="short case: steps per epoch")
    p.add_argument("--kinds", nargs="+", choices=ALL_KINDS,
                   help="short case: only these configurations (must include bare, keras and trainwell)")
    p.add_argument("--interleaved", action="store_true",
                   help="short case: all configurations in one process, taking turns an epoch at a time")
    p.add_argument("--short-child", choices=ALL_KINDS, help=argparse.SUPPRESS)
    p.add_argument("--profile", help="with --short-child: write a cProfile of the timed epochs here")
    args = p.parse_args(argv)
    if args.spe is None:
        args.spe = [1, 8, 32] if args.case == "tiny" else [1, 8]
    if args.short_child:
        res = short_child(args.short_child, args.spe[0], args.short_epochs, args.short_steps, args.profile,
                          "tiny" if args.case == "tiny" else "short")
        print(json.dumps(res))
        return res
    if args.kinds and not {"bare", "keras", "trainwell"} <= set(args.kinds):
        p.error(f"--kinds must include bare, keras and trainwell (the ratios need them). Received: {args.kinds}")
    if args.case in ("short", "tiny"):
        return short_case(args)
    if args.case == "tensorboard_hooks":
        res = tensorboard_hooks(args.rounds)
        print(json.dumps(res, indent=2))
        return res
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * args.steps, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=(len(x),)).astype("int32")
    val = (x[:256], y[:256])
    kinds = ["bare", "trainwell", "backup_and_restore"]
    if args.attribute:
        kinds += ["warmup_cosine", "nan_rollback", "early_stopping", "checkpoint"]
    results: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as work:
        for r in range(args.rounds):
            order = kinds if r % 2 == 0 else kinds[::-1]
            for k in order:
                wall, per_cpu_s = run(k, ((x, y), val), args.epochs, args.steps, work)
                results[k].append(wall)
                cpu[k].append(per_cpu_s)
                print(f"round {r} {k}: {wall:.2f} steps/s, {per_cpu_s:.2f} steps per CPU-s", file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    out = {
        "benchmark": "callback_overhead",
        "steps_per_epoch": args.steps,
        "epochs_timed": args.epochs - 1,
        "rounds": args.rounds,
        "step_ms_bare": 1000.0 / med["bare"],
        "steps_per_s": {k: round(v, 3) for k, v in med.items()},
        "steps_per_s_all": {k: [round(x, 3) for x in v] for k, v in results.items()},
        "ratio_trainwell_vs_bare": round(med["trainwell"] / med["bare"], 4),
        "ratio_backup_and_restore_vs_bare": round(med["backup_and_restore"] / med["bare"], 4),
        "ratio_trainwell_vs_backup_and_restore": round(med["trainwell"] / med["backup_and_restore"], 4),
        # CPU time is far less sensitive than wall time to other jobs on a shared machine
        "steps_per_cpu_s": {k: round(v, 3) for k, v in med_cpu.items()},
        "cpu_ratio_vs_bare": {k: round(v / med_cpu["bare"], 4) for k, v in med_cpu.items() if k != "bare"},
        "target_ratio": 0.97,
        "load_avg_1min": os.getloadavg()[0],
    }
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
