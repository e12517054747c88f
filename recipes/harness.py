"""What every recipe shares (floor 2, the recipes' harness): setting up a run, the standard callbacks, the result.

A recipe module (`trainwell.recipes.resnet_imagenet`, ...) reads top to bottom:
its `Config`, then `build_data`, `build_model`, `build_optimizer`,
`build_callbacks` and `train`. The parts that are the same for every recipe live
here, so both recipes build runs, callbacks and `RunResult`s in one place.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import shutil
import struct
import tempfile
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from trainwell import rundir, runtime, storage
from trainwell.config import ConfigError
from trainwell.data.base import DataError
from trainwell.io import atomic_write_json, new_figure, remove_stale_temporaries, save_figure


@dataclasses.dataclass
class RunResult:
    """What a recipe's `train()` returns.

    Attributes:
        model: The trained `keras.Model` (best weights when early stopping restored them).
        history: Per-epoch metrics of the whole run, including epochs trained before
            a resume (read back from `history.csv`), as `{name: [values]}`.
        metrics: Metrics on the held-out test split, e.g. `{"test_accuracy": 0.99}`.
        run_dir: The run directory (config, manifest, checkpoints, logs, plots); for a
            run on an object store, its URL (a `str`: the local staging copy is gone).
        config: The resolved config.

    Example:
    >>> run = RunResult(model=None, history={}, metrics={"test_accuracy": 0.9}, run_dir=Path("."), config=None)
    >>> run.metrics["test_accuracy"]
    0.9
    """

    model: Any
    history: dict[str, list[float]]
    metrics: dict[str, float]
    run_dir: Path | str
    config: Any = None


@dataclasses.dataclass
class RunContext:
    """The runtime of one run: strategy, precision policy, run directory, chief flag.

    The chief holds the run directory's lock (`trainwell.rundir.lock_run_dir`)
    from `setup_run` until `close()`, which also removes a run directory that
    this run created and left without any result (a run that failed before it
    trained anything, so that no half-made run is left to resume). `close()` runs
    by itself when the context is garbage-collected or the process exits; call it
    (or use `with setup_run(...) as ctx:`) to end the run at a known point.

    Example:
    >>> ctx = setup_run(cfg, "resnet-imagenet")  # doctest: +SKIP
    >>> with ctx.strategy.scope():  # doctest: +SKIP
    ...     model = build_model(cfg)
    """

    strategy: Any
    precision: str
    run_dir: Path
    is_chief: bool = True
    _end: Any = dataclasses.field(default=None, repr=False, compare=False)
    #: The run turned TensorFlow's op determinism on (`deterministic=True`): `close()` turns it off.
    _op_determinism: bool = dataclasses.field(default=False, repr=False, compare=False)

    @property
    def num_replicas(self) -> int:
        return runtime.num_replicas(self.strategy)

    def fit_scope(self):
        """The context `fit` and `evaluate` run in (`trainwell.runtime.fit_scope`)."""
        return runtime.fit_scope(self.strategy)

    def close(self) -> None:
        """Releases the run directory (see the class docstring) and turns op determinism off again
        if the run turned it on; idempotent."""
        if self._end is not None:
            self._end()
        if self._op_determinism:
            self._op_determinism = False
            runtime.end_op_determinism()

    def __enter__(self) -> "RunContext":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _verbose(cfg) -> bool:
    return str(getattr(cfg, "verbose", 1)) != "0"


#: Files a run writes before its first training step; a run directory holding only these
#: (and empty files, and TensorBoard files with no event yet) holds no result of the run.
_SETUP_FILES = {"manifest.json", "config.yaml", rundir.LOCK_FILE, "lr_schedule.png", "labels.json"}


def _event_records(path: Path, limit: int = 2) -> int:
    """How many records a TensorBoard event file holds (up to `limit`; 1 = the file header only)."""
    n = 0
    try:
        with path.open("rb") as f:
            while n < limit:
                head = f.read(12)
                if len(head) < 12:
                    break
                f.seek(struct.unpack("<Q", head[:8])[0] + 4, os.SEEK_CUR)
                n += 1
    except OSError:
        return limit
    return n


def _holds_results(run_dir: str | os.PathLike) -> bool:
    """Whether a run directory holds anything a run produced (checkpoints, history, logs, metrics).

    The files written before training (manifest, config, lock, schedule plot,
    label map), empty files and TensorBoard event files with no event are not
    results.
    """
    for root, _, files in os.walk(run_dir):
        for name in files:
            path = Path(root) / name
            if Path(root) == Path(run_dir) and name in _SETUP_FILES:
                continue
            try:
                if path.stat().st_size == 0:
                    continue
            except OSError:
                continue
            if ".tfevents." in name and _event_records(path) <= 1:
                continue
            return True
    return False


def _first_missing(path: Path) -> Path | None:
    """The highest of `path` and its parents that does not exist yet (what making `path` creates)."""
    top = None
    for p in (path, *path.parents):
        if os.path.lexists(p):
            break
        top = p
    return top


def _end_run(run_dir: Path, fresh: str | None, lock, made: Path | None = None) -> None:
    """`RunContext.close()`: discard a fresh run directory without results, then unlock.

    A directory this run created is removed with the parents it created (`made`: the
    highest of them, e.g. `runs/` for a default run directory), where they are empty.
    """
    try:
        if fresh and run_dir.is_dir() and not _holds_results(run_dir):
            if fresh == "created":
                shutil.rmtree(run_dir, ignore_errors=True)
                parent = run_dir.parent
                while made is not None and made in (parent, *parent.parents):
                    try:
                        parent.rmdir()  # only if empty: another run may have started in it since
                    except OSError:
                        break
                    parent = parent.parent
            else:  # it existed, empty: empty it again
                for child in run_dir.iterdir():
                    if child.is_dir():
                        shutil.rmtree(child, ignore_errors=True)
                    elif child.name != rundir.LOCK_FILE:  # released (and deleted) below
                        child.unlink(missing_ok=True)
    finally:
        # A fit that died in a callback never ran Checkpoint.on_train_end: its lock of the checkpoint
        # directory goes with the run, so another process can resume it.
        rundir.release_run_dir_lock(run_dir / "checkpoints")
        if lock is not None:
            lock.release()


def _announce(cfg, run_dir: Path, fresh: str | None) -> None:
    """The run's first lines: where it writes, and whether it resumes (one decision, see `resume_epoch`)."""
    # lazy, as every callback import here: importing the harness must not load Keras/TensorFlow
    # (the CLI starts TensorFlow quietly first; a worker's sitecustomize may import the harness)
    from trainwell.callbacks.checkpoint import CheckpointCorruptError, resume_checkpoint

    run_dir = _URL_RUNS.get(Path(run_dir), run_dir)  # a run on an object store is named by its URL
    try:
        chosen = resume_checkpoint(checkpoint_dir(run_dir))
    except CheckpointCorruptError as e:
        raise ConfigError(str(e)) from None
    if not _verbose(cfg):
        return
    if chosen is not None:
        print(f"Run directory: {run_dir} (resuming: {chosen['name']})", flush=True)
    elif fresh:
        print(f"Run directory: {run_dir} (new run)", flush=True)
    else:
        print(f"Run directory: {run_dir} holds no checkpoint: starting the run from scratch.", flush=True)


#: Runs whose directory is a URL: their local staging directory -> the URL (`setup_run`).
_URL_RUNS: dict[Path, str] = {}
#: What a run on a URL mirrors: everything but its checkpoints, which `Checkpoint` writes to the URL itself.
_NOT_MIRRORED = ("checkpoints",)


def checkpoint_dir(run_dir: str | os.PathLike) -> str | Path:
    """Where the checkpoints of the run in `run_dir` are: `run_dir/checkpoints`, or under the run's URL.

    A run whose `run_dir` is a URL writes its other files in a local staging
    directory (`RunContext.run_dir`) mirrored to the URL; its checkpoints go to
    `URL/checkpoints` directly (the object store's commit protocol,
    docs/checkpoint.md). Both the staging directory and the URL name it here.

    Example:
    >>> checkpoint_dir("runs/exp1")
    PosixPath('runs/exp1/checkpoints')
    >>> checkpoint_dir("s3://bucket/run")
    's3://bucket/run/checkpoints'
    """
    url = run_dir if storage.is_url(run_dir) else _URL_RUNS.get(Path(run_dir))
    return storage.join(url, "checkpoints") if url else Path(run_dir) / "checkpoints"


def mirror_run_dir(run_dir: str | os.PathLike) -> int:
    """Uploads what changed in a URL run's staging directory (no-op for a local run); returns the count.

    Example:
    >>> mirror_run_dir("runs/exp1")
    0
    """
    staging = Path(run_dir)
    url = _URL_RUNS.get(staging)
    if url is None:
        return 0
    return storage.mirror_up(staging, url, _MIRRORED.setdefault(staging, {}), skip=_NOT_MIRRORED)


_MIRRORED: dict[Path, dict] = {}  # staging directory -> {file: (size, mtime)} as last uploaded


def _setup_url_run(cfg, recipe: str, strategy, precision: str) -> "RunContext":
    """`setup_run` for a `run_dir` URL: a local staging directory holding the URL's files, mirrored back.

    The staging directory gets every object of the URL but the checkpoints (a
    resume appends to `history.csv`, as locally); `Checkpoint` writes to
    `URL/checkpoints` and its writer lease keeps a second run off. The files are
    uploaded after the manifest, at every epoch end and at the end of the run.
    """
    url = storage.check_url(cfg.run_dir, "run_dir", what="", error=ConfigError)
    storage.store_for(url).check_bucket("run_dir", what="", error=ConfigError)
    if runtime.num_workers(strategy) > 1:
        raise ConfigError(f"Invalid value for `run_dir`: a URL for a multi-worker run (not supported yet: use a "
                          f"shared file system). Received: run_dir={url!r}")
    cfg.run_dir = url
    staging = Path(tempfile.mkdtemp(prefix="trainwell-run-"))
    _URL_RUNS[staging] = url
    try:
        storage.mirror_down(url, staging, skip=_NOT_MIRRORED, seen=_MIRRORED.setdefault(staging, {}))
        _announce(cfg, staging, None)
        rundir.write_manifest(staging, cfg, strategy=strategy, precision=precision, seed=cfg.seed, recipe=recipe)
        mirror_run_dir(staging)
    except BaseException:
        _end_url_run(staging, upload=False)
        raise
    ctx = RunContext(strategy=strategy, precision=precision, run_dir=staging, is_chief=True)
    ctx._end = weakref.finalize(ctx, _end_url_run, staging)
    return ctx


def _end_url_run(staging: Path, upload: bool = True) -> None:
    """`RunContext.close()` of a URL run: the last upload, then the staging directory goes."""
    try:
        if upload:
            mirror_run_dir(staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        _URL_RUNS.pop(staging, None)
        _MIRRORED.pop(staging, None)


def setup_run(cfg, recipe: str, deterministic: bool | None = None) -> RunContext:
    """Strategy, precision, seeds, run directory, its lock and manifest for `cfg`.

    The strategy comes first: `"cpu:N"` must split the CPU before any TensorFlow op.
    Under multi-worker every worker gets the chief's run directory
    (`rundir.shared_run_dir`); only the chief locks it and writes the manifest.
    The first lines printed (unless `cfg.verbose` is 0) name the run directory and
    whether the run is new or resumes; a run directory whose checkpoints are all
    damaged is refused here, in one line.

    Args:
        cfg: A recipe config (`trainwell.config.BaseConfig` subclass).
        recipe: The recipe's command-line name (recorded in the manifest so
            `trainwell resume RUN_DIR` knows what to run).
        deterministic: Enable op determinism, until `close()`. Defaults to
            `cfg.deterministic` if the config has that field, else `False`.

    Returns:
        A `RunContext`; its `close()` releases the run directory.

    Raises:
        trainwell.rundir.RunDirInUseError: Another process is running in that
            run directory (a `ConfigError`).
        trainwell.config.ConfigError: No checkpoint in the run directory is usable.

    Example:
    >>> ctx = setup_run(Config(epochs=1), "resnet-imagenet")  # doctest: +SKIP
    """
    strategy = runtime.make_strategy(cfg.strategy)  # on TensorFlow, also the Keras fixes a strategy needs
    precision = runtime.set_precision(cfg.precision)
    if deterministic is None:
        deterministic = bool(getattr(cfg, "deterministic", False))
    turned_on = runtime.seed_everything(cfg.seed, deterministic=deterministic)
    try:
        ctx = _setup_run_dir(cfg, recipe, strategy, precision)
    except BaseException:
        if turned_on:
            runtime.end_op_determinism()
        raise
    ctx._op_determinism = turned_on
    return ctx


def _setup_run_dir(cfg, recipe: str, strategy, precision: str) -> RunContext:
    """`setup_run` after the strategy, precision and seeds: the run directory, its lock and manifest."""
    if storage.is_url(cfg.run_dir):
        return _setup_url_run(cfg, recipe, strategy, precision)
    chief = runtime.is_chief(strategy)
    given = Path(cfg.run_dir) if cfg.run_dir is not None else None
    fresh = "created" if given is None or not given.exists() else None
    made = _first_missing(given if given is not None else Path("runs"))  # shared_run_dir's default root
    if given is not None and given.is_dir() and not any(given.iterdir()):
        fresh = "empty"  # e.g. named by `trainwell train --workers N` for its workers
    # Every worker must use the chief's run directory (not its own timestamp).
    run_dir = rundir.shared_run_dir(cfg.run_dir, strategy, prefix=recipe)
    if cfg.run_dir is None:
        cfg.run_dir = str(run_dir)
    if not chief:
        return RunContext(strategy=strategy, precision=precision, run_dir=run_dir, is_chief=False)
    lock = None
    try:
        lock = rundir.lock_run_dir(run_dir)
        remove_stale_temporaries(run_dir)
        _announce(cfg, run_dir, fresh)
        rundir.write_manifest(run_dir, cfg, strategy=strategy, precision=precision, seed=cfg.seed, recipe=recipe)
    except BaseException:
        _end_run(run_dir, fresh if lock is not None else None, lock, made)  # without the lock, touch nothing
        raise
    ctx = RunContext(strategy=strategy, precision=precision, run_dir=run_dir, is_chief=True)
    ctx._end = weakref.finalize(ctx, _end_run, run_dir, fresh, lock, made)
    return ctx


def read_history_csv(path: str | os.PathLike) -> dict[str, list[float]]:
    """Reads a Keras `CSVLogger` file into `{column: [floats]}` ({} if missing).

    A resumed run appends to the same file (`CSVLogger(append=True)`); rows of an
    epoch that was written again after a restart replace the earlier ones.

    Example:
    >>> read_history_csv("missing.csv")
    {}
    """
    path = Path(path)
    if not path.is_file():
        return {}
    rows: list[dict] = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            try:  # a resumed run rewrites epochs from where it restarted: drop the stale tail
                e = int(float(row["epoch"]))
                rows = [r for r in rows if int(float(r["epoch"])) < e]
            except (KeyError, TypeError, ValueError):
                pass
            rows.append(row)
    out: dict[str, list[float]] = {}
    for row in rows:
        for k, v in row.items():
            if k is None:
                continue
            try:
                out.setdefault(k, []).append(float(v))
            except (TypeError, ValueError):
                out.setdefault(k, []).append(math.nan)
    return out


def resume_epoch(checkpoint_dir: str | os.PathLike) -> int:
    """The epoch a run in `checkpoint_dir` resumes in (0 for a fresh run).

    It is the epoch of the checkpoint `Checkpoint` will load
    (`trainwell.callbacks.checkpoint.resume_checkpoint`: the newest one that
    verifies, not merely the newest listed), so the data pipeline is positioned
    for the state actually restored, also after a fallback past a damaged one.

    Raises:
        trainwell.callbacks.checkpoint.CheckpointCorruptError: Checkpoints exist
            but none is usable.

    Example:
    >>> resume_epoch("/nonexistent")
    0
    """
    from trainwell.callbacks.checkpoint import resume_checkpoint  # lazy: it imports Keras

    chosen = resume_checkpoint(checkpoint_dir)
    return 0 if chosen is None else int(chosen["position"]["epoch"])


def advance_epochs(dataset, epochs: int):
    """Positions a reshuffling `tf.data` pipeline at the start of epoch `epochs`.

    Keras makes a new iterator of the training dataset each epoch. A dataset shuffled
    with a fixed seed and `reshuffle_each_iteration=True` (and augmented with seeds
    drawn inside the pipeline) gives its k-th iterator the k-th epoch's order, so a
    process that resumes at epoch e must have made e iterators first. Making an
    iterator reads no data, so this costs milliseconds even on ImageNet, unlike
    replaying the consumed batches. `Checkpoint` then skips the batches already done
    inside the resumed epoch. Returns `dataset` itself.

    Example:
    >>> ds = advance_epochs(data.train, resume_epoch(run_dir / "checkpoints"))  # doctest: +SKIP
    """
    for _ in range(int(epochs)):
        it = iter(dataset)
        del it
    return dataset


#: Columns `curves.png` leaves out: the epoch index and the LR (it has `lr_schedule.png`).
_NOT_CURVES = ("epoch", "lr", "learning_rate")


def plot_history(history: dict[str, list[float]], path: str | os.PathLike) -> Path | None:
    """Plots loss and metric curves (train vs validation) to a PNG, one panel per metric.

    Points are marked (a run of one epoch is one point, not an invisible line), the
    epoch axis has integer ticks, and bookkeeping columns that stayed at zero (e.g.
    `nan_rollbacks` of a run that never rolled back) get no panel.

    Args:
        history: `{name: [per-epoch values]}`; `val_` pairs share a panel.
        path: Output PNG path.

    Returns:
        The path, or None when there is nothing to plot.

    Example:
    >>> plot_history({"loss": [1.0, 0.5], "val_loss": [1.1, 0.7]}, "/tmp/curves.png")  # doctest: +SKIP
    """
    def flat_zero(k):
        return f"val_{k}" not in history and all(v == 0 for v in history[k])

    names = [k for k in history if not k.startswith("val_") and k not in _NOT_CURVES]
    names = [k for k in names if history.get(k) and not flat_zero(k)]
    if not names:
        return None
    from matplotlib.ticker import MaxNLocator  # lazy: matplotlib loads only when a plot is drawn

    fig, axes = new_figure(1, len(names), figsize=(4.5 * len(names), 3.5))
    for ax, k in zip(axes[0], names):
        for label, ys in ((f"train {k}", history[k]), (f"val {k}", history.get(f"val_{k}"))):
            if ys:
                ax.plot(range(1, len(ys) + 1), ys, marker="o" if len(ys) <= 30 else None, ms=4, label=label)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        ax.set_title(k)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)


def finish_run(ctx: RunContext, cfg, model, test_metrics: dict[str, float], history=None,
               plots: bool = True) -> RunResult:
    """Writes `metrics.json` and, with `plots`, `curves.png` (chief only) and returns the `RunResult`.

    `plots=False` for a run that is one segment of a longer one (a PBT or
    Hyperband segment, `train(segment=True)`): nothing reads its curves before
    the last segment, and drawing them costs seconds per segment.

    After a `fit` that trained nothing (`trained_nothing`) the run's files stay as they
    are: `metrics` are the ones `metrics.json` holds.

    Example:
    >>> run = finish_run(ctx, cfg, model, {"test_accuracy": 0.99})  # doctest: +SKIP
    """
    full = read_history_csv(ctx.run_dir / "history.csv")
    where = _URL_RUNS.get(Path(ctx.run_dir), ctx.run_dir)  # a run on an object store: its URL
    if not full and history is not None:
        full = {k: [float(x) for x in v] for k, v in history.history.items()}
    if trained_nothing(history, ctx.run_dir):
        metrics_file = ctx.run_dir / "metrics.json"
        metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else {}
        return RunResult(model=model, history=full, metrics=metrics, run_dir=where, config=cfg)
    metrics = {k: float(v) for k, v in test_metrics.items()}
    if ctx.is_chief:
        atomic_write_json(ctx.run_dir / "metrics.json", metrics)
        if plots:
            plot_history(full, ctx.run_dir / "curves.png")
    return RunResult(model=model, history=full, metrics=metrics, run_dir=where, config=cfg)


def trained_nothing(history, run_dir=None) -> bool:
    """Whether a recipe's `fit` trained no epoch: a resume of a run that has all its epochs,
    or that stopped early (`Checkpoint` says so in one line, with how to train longer). The
    recipe then neither evaluates nor exports again, and `finish_run` leaves the run's files.

    With `run_dir`, a run without `metrics.json` (killed after its last checkpoint, before
    its evaluation) does not count: its resume evaluates, exports and writes the files.

    Example:
    >>> trained_nothing(None)
    False
    """
    if history is None or history.epoch:
        return False
    return run_dir is None or (Path(run_dir) / "metrics.json").is_file()


#: `steps_per_execution` the recipes use on a GPU or TPU when the config leaves it `None`.
#: Keras's `compile` docstring: several batches per compiled call "can greatly improve
#: performance on TPUs or small models with a large Python overhead"; on short steps
#: `bench/callback_overhead.py --case short` measured spe 8 at 0.7x the CPU time per step of
#: spe 1. 8 is the largest value `bench/spike_rollback.py` validated NaNRollback's spike rule
#: at (no false rollback on healthy runs at 4 and 8); callbacks then act every 8 steps.
ACCELERATOR_STEPS_PER_EXECUTION = 8


def steps_per_execution(value: int | None) -> int:
    """The recipes' `steps_per_execution`: `value`, or when `None`, 8 on a GPU/TPU and 1 on CPUs.

    Call it inside the strategy's scope (where the recipe compiles). See
    `ACCELERATOR_STEPS_PER_EXECUTION` for the source of 8.

    Args:
        value: The config's `steps_per_execution`, or `None` for the device's default.

    Returns:
        The value to compile with.

    Example:
    >>> steps_per_execution(4)
    4
    >>> steps_per_execution(None)  # on a CPU-only machine  # doctest: +SKIP
    1
    """
    if value is not None:
        return int(value)
    from trainwell.compat.devices import on_accelerator  # lazy: trainwell.compat imports Keras

    return ACCELERATOR_STEPS_PER_EXECUTION if on_accelerator() else 1


def log_learning_rate(model):
    """A Keras `LambdaCallback` that adds the optimizer's `learning_rate` to the epoch logs.

    Under the name Keras's own `LearningRateScheduler` logs it, with the value
    `WarmupCosine` logs for its own schedule (the LR of the next step), so `history.csv`
    and TensorBoard hold the LR of any schedule. Put it before the loggers.

    Example:
    >>> callbacks.insert(0, log_learning_rate(model))  # doctest: +SKIP
    """
    # lazy: Keras and the callbacks load when a run starts, not with the harness
    import keras

    from trainwell.callbacks.schedules import current_lr  # lazy: the callbacks import Keras

    def log(epoch, logs):
        if logs is not None:
            logs["learning_rate"] = current_lr(model.optimizer)

    return keras.callbacks.LambdaCallback(on_epoch_end=log)


def fail_on_empty_epoch():
    """A Keras callback that ends `fit` with a one-line `DataError` when an epoch trains no batch.

    Keras ends an epoch whose data ran out at once and still logs it (a loss of 0, a
    history row, a progress bar at its end) while the learning rate schedule moves on.
    This callback counts the batches each epoch ends (`on_train_batch_end`: a step whose
    data ran out has begun, not ended; the count is safe for Keras's asynchronous batch
    hooks) and raises in `on_epoch_end`; put it first, so that no logger, the progress
    bar or `History` records the empty epoch.

    Example:
    >>> callbacks.insert(0, fail_on_empty_epoch())  # doctest: +SKIP
    """
    import keras  # lazy: Keras loads when a run starts, not with the harness

    trained = [0]
    guard = keras.callbacks.LambdaCallback()
    guard.async_safe = True  # a counter: Keras may call its batch hook in its dispatch thread

    def on_epoch_begin(epoch, logs=None):
        trained[0] = 0

    def on_train_batch_end(batch, logs=None):
        trained[0] += 1

    def on_epoch_end(epoch, logs=None):
        if trained[0] == 0:
            steps = (guard.params or {}).get("steps")
            told = f"{steps} batches per epoch" if steps else "no number of batches"
            raise DataError(
                f"Epoch {epoch + 1} trained no batch: the training data ran out before it (fit was told {told}); "
                "the dataset must yield that many batches every epoch (a known length, or endless with `.repeat()`)."
            )

    guard.on_epoch_begin, guard.on_train_batch_end, guard.on_epoch_end = on_epoch_begin, on_train_batch_end, on_epoch_end
    return guard


def standard_callbacks(
    # one piece: the recipes' callback stack in its order (the order is behaviour), one step per callback
    cfg,
    run_dir: str | os.PathLike,
    *,
    monitor: str = "val_loss",
    mode: str = "auto",
    schedule: Any = None,
    checkpoint_every: str | int = "epoch",
    keep_last: int = 3,
    keep_best: int = 1,
    nan_rollback: bool = True,
    snapshot_every: int = 100,
    early_stopping_patience: int | None = None,
    warmup_epochs: int = 0,
    doctor: bool = True,
    doctor_every_n_steps: int = 100,
    chief: bool = True,
    frozen_weights: str | None = None,
) -> list:
    """trainwell's reliability stack plus Keras's loggers, in the order they must run.

    `fail_on_empty_epoch` first (an epoch without a batch is an error, not a logged
    epoch), then `WarmupCosine` (LR into the epoch logs), `NaNRollback` before anything
    that reads the loss (it repairs the running mean after a rollback), then
    `CSVLogger` (`history.csv`, appended on resume) and `TensorBoard`, and
    `Checkpoint` last: it commits each epoch in its `on_epoch_end`, after the
    loggers wrote that epoch (a row written twice after a crash is dropped by
    `read_history_csv`; a row never written would be lost), and amends the
    states the other callbacks change after it.

    Args:
        cfg: The recipe config (saved inside every checkpoint).
        run_dir: The run directory.
        monitor: Metric for the best checkpoint and early stopping. Defaults to `"val_loss"`.
        mode: `"min"`, `"max"` or `"auto"`. Defaults to `"auto"`.
        schedule: The optimizer's trainwell schedule; a `WarmupCosineDecay` gets the
            `WarmupCosine` callback (LR in the logs, `lr_schedule.png`), others are
            plotted to `lr_schedule.png` directly. Defaults to `None`.
        checkpoint_every: `"epoch"` or a number of steps. Defaults to `"epoch"`.
        keep_last: Checkpoints kept. Defaults to `3`.
        keep_best: Best checkpoints kept by `monitor`. Defaults to `1`.
        nan_rollback: Add `NaNRollback`. Defaults to `True`.
        snapshot_every: NaN-rollback snapshot interval in steps. Defaults to `100`.
        early_stopping_patience: Patience in epochs; `None` disables early stopping.
            Defaults to `None`.
        warmup_epochs: Epochs early stopping does not count. Defaults to `0`.
        doctor: Add `TrainingDoctor`. Defaults to `True`.
        doctor_every_n_steps: The doctor's probe interval. Defaults to `100`.
        chief: Whether this process writes the run directory. Defaults to `True`.
        frozen_weights: `Checkpoint`'s: `"non_trainable"` keeps a LoRA run's frozen
            base out of its checkpoints. Defaults to `None` (every weight saved).

    Returns:
        A list of callbacks for `model.fit`.

    Example:
    >>> cbs = standard_callbacks(cfg, "runs/x", monitor="val_accuracy", mode="max")  # doctest: +SKIP
    """
    # lazy: Keras and the callbacks load when a run starts, not with the harness
    import keras

    from trainwell import quick  # lazy: it imports Keras
    from trainwell.callbacks import (  # lazy: the callbacks import Keras
        Checkpoint, EarlyStopping, NaNRollback, TensorBoard, TrainingDoctor, WarmupCosine,
    )
    from trainwell.callbacks.schedules import WarmupCosineDecay  # lazy: the callbacks import Keras

    run_dir = Path(run_dir)
    out: list = [fail_on_empty_epoch()]  # first: no other callback sees an epoch without a batch
    out += quick.run_callbacks()  # TRAINWELL_QUICK: stop every run after a few batches (trainwell.quick)
    if isinstance(schedule, WarmupCosineDecay):
        c = schedule.get_config()
        out.append(
            WarmupCosine(
                peak_lr=c["peak_lr"], warmup_steps=c["warmup_steps"], min_lr=c["min_lr"],
                warmup_start=c["warmup_start"], total_steps=c["total_steps"], run_dir=run_dir if chief else None,
            )
        )
    elif schedule is not None and chief:
        plot_schedule(schedule, getattr(schedule, "total_steps", None) or 1000, run_dir / "lr_schedule.png")
    if nan_rollback:
        out.append(NaNRollback(snapshot_every=snapshot_every, run_dir=run_dir if chief else None))
    if doctor:
        out.append(TrainingDoctor(every_n_steps=doctor_every_n_steps, run_dir=run_dir if chief else None, verbose=1))
    if early_stopping_patience is not None:
        out.append(
            EarlyStopping(
                monitor=monitor, mode=mode, patience=early_stopping_patience,
                warmup_epochs=warmup_epochs, restore_best_weights=True,
                verbose=int(chief and _verbose(cfg)),  # the stop and the restored epoch, on the console
            )
        )
    if chief:
        out.append(keras.callbacks.CSVLogger(str(run_dir / "history.csv"), append=True))
        # Keras's, without its per-batch summary calls that record nothing (callbacks/tensorboard.py)
        out.append(TensorBoard(log_dir=str(run_dir / "tensorboard"), write_graph=False))
    save_every = checkpoint_every if checkpoint_every == "epoch" else int(checkpoint_every)
    out.append(
        Checkpoint(
            checkpoint_dir(run_dir), save_every=save_every, keep_last=keep_last, keep_best=keep_best,
            monitor=monitor, mode=mode, config=cfg, verbose=int(chief and _verbose(cfg)),
            frozen_weights=frozen_weights,
        )
    )
    if chief and Path(run_dir) in _URL_RUNS:  # after Checkpoint: the epoch's rows and logs, then its commit
        out.append(keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs=None: mirror_run_dir(run_dir),
                                                  on_train_end=lambda logs=None: mirror_run_dir(run_dir)))
    return out


def plot_schedule(schedule, total_steps: int, path: str | os.PathLike) -> Path:
    """Plots any `LearningRateSchedule` over `total_steps` steps to a PNG.

    Example:
    >>> from trainwell.callbacks.schedules import WarmupStepDecay
    >>> plot_schedule(WarmupStepDecay(0.1, [50, 80]), 100, "/tmp/lr.png")  # doctest: +SKIP
    """
    steps = np.unique(np.linspace(0, max(1, total_steps), num=min(500, max(2, total_steps + 1))).astype(int))
    lrs = [float(schedule(int(s))) for s in steps]
    fig, axes = new_figure(figsize=(6, 3.5))
    ax = axes[0, 0]
    ax.plot(steps, lrs)
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.set_title(type(schedule).__name__)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path)
