"""Hyperparameter search over trainwell recipes with KerasTuner.

What KerasTuner already does is used as is: `HyperModel` (the search space),
its oracles (`RandomSearch`, `BayesianOptimization`, `Hyperband`), trial
bookkeeping, reloading a killed search from its project directory, and the
chief/worker distributed mode over gRPC. What this module adds:

- `RecipeHyperModel`: a `keras_tuner.HyperModel` over a recipe. A trial trains the
  recipe itself (its `train()`), so every trial gets the recipe's callbacks: NaN
  rollback, early stopping and an atomic, exactly resumable `Checkpoint` in the
  trial's own directory. A trial that diverges (`TrainingDivergedError`) is
  recorded as failed with its reason (`keras_tuner.errors.FailedTrialError`) and
  the search goes on.
- `RecipeTunerMixin` and the tuners built from it: a trial that continues another
  trial (Hyperband's `tuner/trial_id`, population-based training's exploit) starts
  from that trial's checkpoint, weights *and* optimizer state, instead of
  KerasTuner's weights-only `load_weights`; a killed trial resumes from its own
  last checkpoint when the search is rerun.
- `search()` / `trainwell tune`: one call that builds the tuner, runs it, prints and
  saves a summary table (`summary.json`, `summary.csv`), plots the score of every
  trial (`trials.png`; `pbt_lineage.png` for PBT) and exports the best model.
- `launch_distributed()` / `trainwell tune --workers N`: starts KerasTuner's chief
  oracle and N workers on one machine and cleans them up.

Population-based training is in `trainwell.pbt`.

Example:
>>> from trainwell import tuning
>>> result = tuning.search("resnet-imagenet", tuner="random", max_trials=8,
...                        overrides={"dataset": "mnist5k", "epochs": 5, "image_size": 28},
...                        directory="tuning")  # doctest: +SKIP
>>> result.best_hyperparameters  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import importlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

from trainwell.validation import is_int

TUNERS = ("random", "bayesian", "hyperband", "pbt")
#: Hyperparameter names KerasTuner (`tuner/...`) and PBT (`pbt/...`) add to a trial's
#: values to pass bookkeeping to the worker; they are not part of the search space.
META_PREFIXES = ("tuner/", "pbt/")
RUN_SUBDIR = "run"
BEST_MODEL_DIR = "best_model"


def hp_values(hp) -> dict:
    """The tunable values of a `HyperParameters` (bookkeeping `tuner/`, `pbt/` keys dropped).

    Example:
    >>> import keras_tuner as kt
    >>> hp = kt.HyperParameters(); hp.values.update({"lr": 0.1, "pbt/member": 0})
    >>> hp_values(hp)
    {'lr': 0.1}
    """
    values = hp.values if hasattr(hp, "values") else dict(hp)
    return {k: v for k, v in values.items() if not str(k).startswith(META_PREFIXES)}


# --------------------------------------------------------------------------- spaces
def log_range(default: float, factor: float, floor: float = 1e-12) -> tuple[float, float]:
    """`(default / factor, default * factor)`, a log-scale range around a default.

    Example:
    >>> log_range(0.1, 10)
    (0.01, 1.0)
    """
    d = max(float(default), floor)
    return d / factor, d * factor


def _clip_default(default: float, lo: float, hi: float) -> float:
    return float(min(max(default, lo), hi))


def log_float(hp, name: str, center: float, factor: float):
    """`hp.Float(name)` on a log scale over `log_range(center, factor)`, defaulting to `center`.

    Example:
    >>> import keras_tuner
    >>> log_float(keras_tuner.HyperParameters(), "peak_lr", 0.1, 10.0)
    0.1
    """
    lo, hi = log_range(center, factor)
    return hp.Float(name, lo, hi, sampling="log", default=_clip_default(center, lo, hi))


def batch_size_choice(hp, batch_size: int, limit: int | None = None) -> int:
    """`hp.Choice("batch_size")` over half, the same and double `batch_size` (default: the same).

    Args:
        hp: The `keras_tuner.HyperParameters` to declare it on.
        batch_size: The config's batch size.
        limit: The largest batch allowed, e.g. the number of training examples (a
            larger batch makes no full batch). Defaults to `None` (no limit).

    Example:
    >>> import keras_tuner
    >>> hp = keras_tuner.HyperParameters()
    >>> batch_size_choice(hp, 1024, limit=1259), hp.space[0].values
    (1024, [512, 1024])
    """
    options = {max(1, batch_size // 2), batch_size, batch_size * 2}
    options = sorted(b for b in options if limit is None or b <= limit or b == batch_size)
    return int(hp.Choice("batch_size", options, default=batch_size))


# --------------------------------------------------------------------------- checkpoints
def _checkpoint_dir(run_dir) -> Path:
    return Path(run_dir) / "checkpoints"


def has_checkpoint(run_dir) -> bool:
    """Whether a trial's run directory holds a committed checkpoint.

    Example:
    >>> has_checkpoint("/nonexistent")
    False
    """
    from trainwell.callbacks.checkpoint import latest_checkpoint

    return latest_checkpoint(_checkpoint_dir(run_dir)) is not None


def copy_checkpoint(src_run_dir, dst_run_dir) -> Path:
    """Copies the newest committed checkpoint of one run directory into another.

    The copy holds everything trainwell's `Checkpoint` saves (weights, optimizer
    state with `iterations` and slots, loss scale, RNG, data position, callback
    states), so the recipe's `train()` in `dst_run_dir` resumes from it exactly as
    if it had written it. The copy is marked as "not stopped": the source run was
    stopped at the end of its segment on purpose, and the destination goes on.
    Written to a temporary directory and renamed into place.

    Args:
        src_run_dir: Run directory (with `checkpoints/`) to copy from.
        dst_run_dir: Run directory to copy into.

    Returns:
        The copied checkpoint's directory.

    Example:
    >>> copy_checkpoint("tuning/p/trial_03/run", "tuning/p/trial_07/run")  # doctest: +SKIP
    """
    from trainwell.callbacks.checkpoint import STATE_FILE, latest_checkpoint
    from trainwell.io import atomic_write_json, fsync_dir

    src = latest_checkpoint(_checkpoint_dir(src_run_dir))
    if src is None:
        raise FileNotFoundError(f"No committed checkpoint to copy in {str(_checkpoint_dir(src_run_dir))!r}")
    src = Path(src)
    dst_dir = _checkpoint_dir(dst_run_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    tmp = dst_dir / f".tmp-{src.name}-copy-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    meta = json.loads((tmp / STATE_FILE).read_text(encoding="utf-8"))
    meta.setdefault("entry", {})["stopped"] = False
    meta["entry"]["copied_from"] = str(src)
    atomic_write_json(tmp / STATE_FILE, meta)
    final = dst_dir / src.name
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(dst_dir)
    return final


def best_checkpoint(run_dir, objective) -> str | None:
    """Path of the checkpoint of `run_dir` with the best monitored value (else the newest).

    Example:
    >>> best_checkpoint("/nonexistent", None) is None
    True
    """
    from trainwell.callbacks.checkpoint import list_checkpoints

    entries = list_checkpoints(_checkpoint_dir(run_dir))
    if not entries:
        return None
    scored = [e for e in entries if isinstance(e.get("value"), (int, float)) and math.isfinite(e["value"])]
    if scored and objective is not None:
        sign = -1.0 if getattr(objective, "direction", "max") == "max" else 1.0
        return min(scored, key=lambda e: sign * e["value"])["path"]
    return entries[-1]["path"]


# --------------------------------------------------------------------------- callbacks
def _stop_at_epoch_callback(stop_at: int):
    import keras

    class StopAtEpoch(keras.callbacks.Callback):
        """Ends `fit` after epoch `stop_at` (1-based count); one segment of a longer run."""

        def on_epoch_end(self, epoch, logs=None):
            if int(epoch) + 1 >= stop_at:
                self.model.stop_training = True

    return StopAtEpoch()


def starts_from_copied_checkpoint(run_dir) -> bool:
    """Whether the newest checkpoint of a run directory is a copy of another trial's (`copy_checkpoint`).

    Example:
    >>> starts_from_copied_checkpoint("/nonexistent")
    False
    """
    from trainwell.callbacks.checkpoint import STATE_FILE, latest_checkpoint

    latest = latest_checkpoint(_checkpoint_dir(run_dir))
    if latest is None:
        return False
    try:
        meta = json.loads((Path(latest) / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool((meta.get("entry") or {}).get("copied_from"))


def _keep_configured_lr_callback():
    import keras

    class KeepConfiguredLearningRate(keras.callbacks.Callback):
        """Keeps the learning rate this trial's config set over the one in a copied checkpoint.

        A plain (non-schedule) learning rate is an optimizer *variable* in Keras 3, so
        trainwell's `Checkpoint` restores it with the rest of the optimizer state: a
        trial that starts from another trial's checkpoint with other values (a PBT
        exploit: the donor's checkpoint, explored hyperparameters) would train at the
        donor's learning rate, not its own. This records the learning-rate variables
        as the recipe built them (`set_model`, before any callback runs) and assigns
        them back after the restore: at `on_train_begin`, before the first batch (in
        case the restoring callback comes later in the list) and after it (a model
        still unbuilt when `fit` starts is restored inside its first step, which then
        runs at the parent's LR; a NaN rollback in that first step has its LR cut
        undone, and the next divergence cuts it again). A learning rate given as a schedule is not a
        variable; the schedule built from the trial's config is used as is.

        Example:
        >>> callbacks.insert(0, _keep_configured_lr_callback())  # doctest: +SKIP
        """

        def set_model(self, model):
            super().set_model(model)
            opt = getattr(model, "optimizer", None)
            self._saved, seen = [], set()
            for o in (opt, getattr(opt, "inner_optimizer", None)):
                lr = getattr(o, "_learning_rate", None)
                if isinstance(lr, keras.Variable) and id(lr) not in seen:
                    seen.add(id(lr))
                    self._saved.append((lr, keras.ops.convert_to_numpy(lr.value).copy()))
            self._pending = {"begin", "end"}

        def _apply(self):
            for var, value in self._saved:
                var.assign(value)

        def on_train_begin(self, logs=None):
            self._apply()

        def on_train_batch_begin(self, batch, logs=None):
            if "begin" in self._pending:
                self._pending.discard("begin")
                self._apply()

        def on_train_batch_end(self, batch, logs=None):
            if "end" in self._pending:
                self._pending.discard("end")
                self._apply()

    return KeepConfiguredLearningRate()


# --------------------------------------------------------------------------- hypermodel
def _make_recipe_hypermodel_class():
    import keras_tuner

    class RecipeHyperModel(keras_tuner.HyperModel):
        """A `keras_tuner.HyperModel` whose trials train a trainwell recipe.

        Extends KerasTuner's `HyperModel` (so every KerasTuner tuner accepts it):
        `declare_hyperparameters` declares the recipe's search space (defaults = the
        recipe's config), `build(hp)` returns the compiled recipe model for `hp`, and
        `fit(hp, model, callbacks=...)` trains the recipe with its own `train()`, so
        a trial gets the recipe's data pipeline, schedule and callbacks (NaN
        rollback, early stopping, checkpoints). `fit` ignores the `model` KerasTuner
        built: the recipe builds its own inside its distribution strategy. The
        tuners of `trainwell.tuning` call `run()` instead, which adds a run
        directory per trial, starting from another trial's checkpoint and stopping
        after a segment (Hyperband, PBT).

        Args:
            recipe: The recipe module (with `train(cfg, callbacks=...)` and `RECIPE`).
            cfg: The base config; the search changes only the fields the space names.
            space: `space(hp, cfg) -> dict` declaring the hyperparameters on `hp` and
                returning the config fields they set.
            build_fn: `build_fn(cfg) -> compiled keras.Model`, for `build(hp)` and for
                loading a trial's checkpoint. Defaults to `None` (then `build` raises).
            export_fn: `export_fn(model, cfg, run_dir, path) -> Path` exporting a
                trial's model. Defaults to `None` (`model.save(path / "model.keras")`).
            trial_overrides: Config fields every trial sets (e.g. `verbose=0`,
                `doctor=False`). Defaults to `None`.
            objective: Metric the search optimises. Defaults to `"val_accuracy"`.
            direction: `"max"` or `"min"`. Defaults to `"max"`.
            static: Hyperparameters PBT must not change within a member's life (they
                change the shape of the optimizer state or of the data), e.g.
                `("batch_size", "optimizer")`. Defaults to `()`.
            name: Name of the hypermodel. Defaults to the recipe's name.

        Example:
        >>> from trainwell.recipes import resnet_imagenet
        >>> hm = resnet_imagenet.hypermodel(dataset="digits", image_size=8, model="resnet18", width=4)
        >>> import keras_tuner as kt
        >>> hp = kt.HyperParameters(); hm.declare_hyperparameters(hp)
        >>> "peak_lr" in hp.values
        True
        """

        def __init__(
            self, recipe, cfg, space, *, build_fn=None, export_fn=None, trial_overrides=None,
            objective="val_accuracy", direction="max", static=(), name=None,
        ):
            if not callable(space):
                raise ValueError(f"Invalid value for argument `space`. Expected a callable. Received: space={space!r}")
            if direction not in ("max", "min"):
                raise ValueError(
                    f"Invalid value for argument `direction`. Expected 'max' or 'min'. Received: direction={direction!r}"
                )
            if not isinstance(objective, str) or not objective:
                raise ValueError(
                    f"Invalid value for argument `objective`. Expected a metric name. Received: objective={objective!r}"
                )
            if not hasattr(recipe, "train"):
                raise ValueError(
                    f"Invalid value for argument `recipe`. Expected a module with `train(cfg, callbacks=...)`. "
                    f"Received: recipe={recipe!r}"
                )
            super().__init__(name=name or getattr(recipe, "RECIPE", None), tunable=True)
            self.recipe = recipe
            self.cfg = cfg
            self.space = space
            self.build_fn = build_fn
            self.export_fn = export_fn
            self.trial_overrides = dict(trial_overrides or {})
            self.objective_name = objective
            self.direction = direction
            self.static = tuple(static)

        def get_config(self) -> dict:
            """The constructor's JSON-able arguments (the recipe by name, the config as a dict)."""
            return {
                "recipe": getattr(self.recipe, "__name__", str(self.recipe)),
                "cfg": self.cfg.to_dict() if hasattr(self.cfg, "to_dict") else dataclasses.asdict(self.cfg),
                "trial_overrides": dict(self.trial_overrides),
                "objective": self.objective_name,
                "direction": self.direction,
                "static": list(self.static),
                "name": self.name,
            }

        @property
        def objective(self):
            import keras_tuner

            return keras_tuner.Objective(self.objective_name, self.direction)

        def declare_hyperparameters(self, hp) -> None:
            self.space(hp, self.cfg)

        def config_for(self, hp, **changes):
            """The recipe config of a trial: base config + `hp`'s values + `changes`.

            Example:
            >>> cfg = hm.config_for(hp, run_dir="tuning/p/trial_0/run")  # doctest: +SKIP
            """
            # The space reads the run it is for (e.g. a warmup fraction of the trial's
            # epochs), so `changes` apply first. On a copy of `hp`: declaring the space on
            # the trial's own `hp` would add the entries KerasTuner was told not to tune
            # to the trial's recorded values.
            base = self.cfg.replace(**changes) if changes else self.cfg
            overrides = dict(self.space(hp.copy(), base))
            overrides.update(self.trial_overrides)
            overrides.update(changes)
            return base.replace(**overrides)

        def build(self, hp):
            if self.build_fn is None:
                raise NotImplementedError(
                    f"The hypermodel of {self.name!r} has no `build_fn`; trials train through `fit`/`run`."
                )
            return self.build_fn(self.config_for(hp))

        def fit(self, hp, model, *args, callbacks=None, **kwargs):
            """Trains the recipe for `hp` (the `model` argument is not used); returns its history.

            Example:
            >>> history = hm.fit(hp, None, callbacks=[])  # doctest: +SKIP
            """
            run = self.run(hp, None, callbacks=callbacks)
            return {k: v for k, v in run.history.items() if k != "epoch"}

        def run(self, hp, run_dir, *, callbacks=None, epochs=None, stop_at_epoch=None, early_stopping=True):
            """Trains the recipe for `hp` in `run_dir` and returns its `RunResult`.

            A committed checkpoint already in `run_dir/checkpoints` (the trial's own
            after a crash, or one copied from another trial) is resumed by the
            recipe's `Checkpoint`, weights and optimizer state included.

            Args:
                hp: The trial's `HyperParameters`.
                run_dir: The trial's run directory (`None`: the recipe's default).
                callbacks: Extra Keras callbacks. Defaults to `None`.
                epochs: Total epochs of the schedule (`cfg.epochs`), e.g. Hyperband's
                    `max_epochs`. Defaults to `None` (the config's).
                stop_at_epoch: Stop after this many epochs in total (one segment of a
                    longer schedule). Defaults to `None` (train all `epochs`).
                early_stopping: Keep the recipe's early stopping; off for segmented
                    runs, where the tuner decides. Defaults to `True`.

            Example:
            >>> run = hm.run(hp, "tuning/p/trial_0/run", epochs=9, stop_at_epoch=3)  # doctest: +SKIP
            """
            changes = {}
            if run_dir is not None:
                changes["run_dir"] = str(run_dir)
            if epochs is not None:
                changes["epochs"] = int(epochs)
            if not early_stopping and hasattr(self.cfg, "early_stopping_patience"):
                changes["early_stopping_patience"] = None
            cfg = self.config_for(hp, **changes)
            cbs = list(callbacks or [])
            if stop_at_epoch is not None and int(stop_at_epoch) < int(cfg.epochs):
                cbs.append(_stop_at_epoch_callback(int(stop_at_epoch)))
            return self.recipe.train(cfg, callbacks=cbs)

        def load(self, hp, run_dir, objective=None):
            """The model of a trial: `build_fn(cfg)` with its best checkpoint loaded.

            Example:
            >>> model = hm.load(trial.hyperparameters, "tuning/p/trial_3/run")  # doctest: +SKIP
            """
            from trainwell.callbacks.checkpoint import load_checkpoint

            if self.build_fn is None:
                raise NotImplementedError(f"The hypermodel of {self.name!r} has no `build_fn`.")
            cfg = self.config_for(hp, run_dir=str(run_dir))
            model = self.build_fn(cfg)
            path = best_checkpoint(run_dir, objective or self.objective)
            if path is None:
                raise FileNotFoundError(f"No committed checkpoint in {str(_checkpoint_dir(run_dir))!r}")
            load_checkpoint(path, model)
            return model

        def export(self, hp, run_dir, path, objective=None) -> Path:
            """Exports the model of a trial (best checkpoint) to the directory `path`.

            Example:
            >>> hm.export(best.hyperparameters, "tuning/p/trial_3/run", "tuning/p/best_model")  # doctest: +SKIP
            """
            model = self.load(hp, run_dir, objective)
            cfg = self.config_for(hp, run_dir=str(run_dir))
            path = Path(path)
            if self.export_fn is not None:
                return Path(self.export_fn(model, cfg, Path(run_dir), path))
            path.mkdir(parents=True, exist_ok=True)
            tmp = path / ".model.keras.tmp.keras"
            model.save(str(tmp))
            os.replace(tmp, path / "model.keras")
            return path / "model.keras"

    return RecipeHyperModel


_CLASSES: dict[str, Any] = {}


def __getattr__(name: str):
    # keras_tuner (and with it TensorFlow) is imported on first use of a class.
    if name == "RecipeHyperModel":
        if name not in _CLASSES:
            _CLASSES[name] = _make_recipe_hypermodel_class()
        return _CLASSES[name]
    if name in ("RecipeTunerMixin", "RecipeRandomSearch", "RecipeBayesianOptimization", "RecipeHyperband"):
        if name not in _CLASSES:
            _CLASSES.update(_make_tuner_classes())
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def recipe_hypermodel(recipe, cfg, space, **kwargs):
    """Builds a `RecipeHyperModel` (what each recipe's `hypermodel()` returns).

    Example:
    >>> hm = recipe_hypermodel(my_recipe, my_recipe.Config(), my_space)  # doctest: +SKIP
    """
    return __getattr__("RecipeHyperModel")(recipe, cfg, space, **kwargs)


# --------------------------------------------------------------------------- tuners
def _metrics_from_history(history: dict, objective, mode: str) -> dict:
    name = objective.name
    values = [float(v) for v in history.get(name, [])]
    if not values:
        import keras_tuner

        raise keras_tuner.errors.FailedTrialError(
            f"The trial logged no `{name}` (the search objective). Logged: {sorted(history)}"
        )
    if mode == "last":
        idx = len(values) - 1
    else:
        finite = [(v, i) for i, v in enumerate(values) if math.isfinite(v)]
        if not finite:
            idx = len(values) - 1
        else:
            idx = (max if objective.direction == "max" else min)(finite)[1]
    out = {}
    for k, v in history.items():
        if k in ("epoch",) or not v or len(v) != len(values):
            continue
        out[k] = float(v[idx])
    out[name] = values[idx]
    return out


def _make_tuner_classes() -> dict:
    import keras
    import keras_tuner

    from trainwell.callbacks.nan_rollback import TrainingDivergedError
    from trainwell.io import atomic_write_json

    class RecipeTunerMixin:
        """What a KerasTuner `Tuner` needs to run trials of a `RecipeHyperModel`.

        Mixed in before a KerasTuner tuner (`RandomSearch`, `BayesianOptimization`,
        `Hyperband`, trainwell's `PBTTuner`), whose oracle is kept as is. It
        overrides `Tuner.run_trial`: KerasTuner's builds a model and saves weights
        with its own callback; here the recipe trains in `TRIAL_DIR/run` with its
        own checkpoints, a trial that continues another (`tuner/trial_id`,
        `pbt/parent`) starts from a copy of that trial's checkpoint (weights and
        optimizer state; KerasTuner's Hyperband reloads weights only) but trains at
        its own learning rate when its values differ from that trial's (a PBT
        exploit; a plain LR is an optimizer variable the copy would otherwise
        restore), a killed trial resumes from its own checkpoint, and `TrainingDivergedError` becomes
        `keras_tuner.errors.FailedTrialError` (recorded as failed with the reason;
        the search goes on). `load_model` loads a trial's best checkpoint.

        Example:
        >>> class MyTuner(RecipeTunerMixin, keras_tuner.RandomSearch): ...  # doctest: +SKIP
        """

        #: "best": a trial scores its best epoch (early stopping restores it);
        #: "last": its last epoch (PBT compares members as they are now).
        score_mode = "best"
        #: Total epochs of every trial's schedule (Hyperband, PBT); None: the config's.
        schedule_epochs = None
        #: Keep the recipe's early stopping in trials.
        trial_early_stopping = True

        def _populate_initial_space(self):
            # KerasTuner builds the model (repeatedly) to discover the space; a recipe
            # space has no conditional scopes, so declaring it is enough and no model
            # (a BERT, a ResNet-50) is built in the chief or the workers.
            if hasattr(self.hypermodel, "space") and hasattr(self.hypermodel, "run"):
                hp = self.oracle.get_space()
                self.hypermodel.declare_hyperparameters(hp)
                self.oracle.update_space(hp)
                return
            super()._populate_initial_space()

        def trial_run_dir(self, trial_id) -> Path:
            """The recipe's run directory of a trial (`TRIAL_DIR/run`)."""
            return Path(self.get_trial_dir(trial_id)) / RUN_SUBDIR

        def run_trial(self, trial, *args, **kwargs):
            hp = trial.hyperparameters
            values = hp.values
            run_dir = self.trial_run_dir(trial.trial_id)
            parent = values.get("pbt/parent") or values.get("tuner/trial_id")
            if parent and not has_checkpoint(run_dir):
                copy_checkpoint(self.trial_run_dir(parent), run_dir)
            stop_at = values.get("pbt/epochs", values.get("tuner/epochs"))
            atomic_write_json(
                Path(self.get_trial_dir(trial.trial_id)) / "worker.json",
                {"tuner_id": self.tuner_id, "pid": os.getpid(), "parent": parent or None},
            )
            callbacks = copy.deepcopy(list(kwargs.get("callbacks") or []))
            if parent and starts_from_copied_checkpoint(run_dir) and self._values_differ_from(hp, parent):
                # A plain LR is an optimizer variable: the copied checkpoint would
                # restore the parent's; this trial trains at its own (a PBT exploit's
                # explored value). Before the user's callbacks, which see the result.
                callbacks.insert(0, _keep_configured_lr_callback())
            # Frees the previous trial's graphs; it runs `gc.collect()` itself (a second
            # full collection here cost ~0.7 s a trial on a loaded 2-core VM, ~20% of a
            # 1-epoch PBT segment of a small MLP).
            keras.backend.clear_session()
            try:
                with warnings.catch_warnings():
                    # A copied checkpoint was written under the donor's config.
                    warnings.filterwarnings("ignore", message=r"Resuming from .*different run config")
                    run = self.hypermodel.run(
                        hp, run_dir, callbacks=callbacks, epochs=self.schedule_epochs,
                        stop_at_epoch=stop_at, early_stopping=self.trial_early_stopping,
                    )
            except TrainingDivergedError as e:
                raise keras_tuner.errors.FailedTrialError(f"Trial {trial.trial_id} diverged: {e}") from e
            except (keras_tuner.errors.FatalError, keras_tuner.errors.FailedTrialError):
                raise
            except Exception as e:
                if self.oracle.max_retries_per_trial:
                    raise  # KerasTuner records it INVALID and retries it
                # KerasTuner's INVALID (retry) would not count towards
                # `max_consecutive_failed_trials`: a search whose every trial fails the
                # same way (a config error, a missing file) would run all of them.
                raise keras_tuner.errors.FailedTrialError(f"{type(e).__name__}: {e}") from e
            return _metrics_from_history(run.history, self.oracle.objective, self.score_mode)

        def _values_differ_from(self, hp, parent_id) -> bool:
            try:
                parent = self.oracle.get_trial(parent_id)
            except Exception:  # unknown to this oracle: assume they differ (keeping the own config is safe)
                return True
            return hp_values(parent.hyperparameters) != hp_values(hp)

        def load_model(self, trial):
            return self.hypermodel.load(trial.hyperparameters, self.trial_run_dir(trial.trial_id), self.oracle.objective)

        def search(self, *fit_args, **fit_kwargs):
            from keras_tuner.src.distribute import utils as dist_utils

            if dist_utils.is_chief_oracle():
                # KerasTuner's chief polls for the end every 20 s; serve_chief polls
                # every 0.2 s and otherwise does the same.
                if "verbose" in fit_kwargs:
                    self.oracle.verbose = fit_kwargs["verbose"]
                self.save()
                serve_chief(self.oracle)
                return
            return super().search(*fit_args, **fit_kwargs)

        def pre_create_trial(self):
            # An oracle that answered IDLE (PBT waiting for a generation to finish)
            # is asked again at once by KerasTuner's loop; wait a little instead.
            if getattr(self, "_asked_without_trial", 0) > 0:
                time.sleep(min(2.0, 0.2 * self._asked_without_trial))
            self._asked_without_trial = getattr(self, "_asked_without_trial", 0) + 1

        def on_trial_begin(self, trial):
            self._asked_without_trial = 0
            super().on_trial_begin(trial)

    class RecipeRandomSearch(RecipeTunerMixin, keras_tuner.RandomSearch):
        """`keras_tuner.RandomSearch` running recipe trials (see `RecipeTunerMixin`).

        Example:
        >>> tuner = RecipeRandomSearch(hm, objective=hm.objective, max_trials=10, directory="tuning")  # doctest: +SKIP
        """

    class RecipeBayesianOptimization(RecipeTunerMixin, keras_tuner.BayesianOptimization):
        """`keras_tuner.BayesianOptimization` running recipe trials (see `RecipeTunerMixin`).

        Example:
        >>> tuner = RecipeBayesianOptimization(hm, objective=hm.objective, max_trials=10)  # doctest: +SKIP
        """

    class RecipeHyperband(RecipeTunerMixin, keras_tuner.Hyperband):
        """`keras_tuner.Hyperband` running recipe trials (see `RecipeTunerMixin`).

        Every trial runs the schedule of `max_epochs` epochs (warmup and decay
        over the whole budget) and stops at its bracket's `tuner/epochs`; a trial
        promoted to the next round continues from the checkpoint of the trial it
        extends, weights and optimizer state, with early stopping left to Hyperband.

        Example:
        >>> tuner = RecipeHyperband(hm, objective=hm.objective, max_epochs=9, factor=3)  # doctest: +SKIP
        """

        trial_early_stopping = False

        def __init__(self, *args, max_epochs=100, **kwargs):
            super().__init__(*args, max_epochs=max_epochs, **kwargs)
            self.schedule_epochs = int(max_epochs)

    return {
        "RecipeTunerMixin": RecipeTunerMixin,
        "RecipeRandomSearch": RecipeRandomSearch,
        "RecipeBayesianOptimization": RecipeBayesianOptimization,
        "RecipeHyperband": RecipeHyperband,
    }


def serve_chief(oracle, poll_s: float = 0.2) -> None:
    """Serves `oracle` to the workers over gRPC until the search is over.

    KerasTuner's `oracle_chief.start_server` with a shorter poll: it serves the
    same `OracleServicer` on `KERASTUNER_ORACLE_IP:KERASTUNER_ORACLE_PORT` (no
    authentication, no TLS: bind it to 127.0.0.1 or a private network) and returns
    once a worker was told to stop and no trial or worker is left.

    Example:
    >>> serve_chief(tuner.oracle)  # doctest: +SKIP
    """
    from concurrent import futures

    import grpc
    from keras_tuner.src import protos
    from keras_tuner.src.distribute.oracle_chief import OracleServicer, exit_chief

    address = f"{os.environ['KERASTUNER_ORACLE_IP']}:{os.environ['KERASTUNER_ORACLE_PORT']}"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    servicer = OracleServicer(oracle)
    protos.get_service_grpc().add_OracleServicer_to_server(servicer, server)
    if server.add_insecure_port(address) == 0:
        raise RuntimeError(f"The chief oracle cannot listen on {address} (port in use?).")
    server.start()
    try:
        while not (servicer.stop_triggered and exit_chief(oracle)):
            time.sleep(poll_s)
    finally:
        server.stop(grace=2.0)


# --------------------------------------------------------------------------- search
@dataclasses.dataclass
class SearchResult:
    """What `search()` returns.

    Attributes:
        tuner: The KerasTuner tuner (its `oracle` holds every trial).
        best_hyperparameters: Tunable values of the best trial (`{}` if none completed).
        best_trial_id: Its id (`None` if none completed).
        best_score: Its objective value.
        rows: One dict per trial, best first (what `summary.json` holds).
        project_dir: The search's directory.
        files: Paths written: `summary_json`, `summary_csv`, `plot`, `lineage_plot`, `best_model`.

    Example:
    >>> r = SearchResult(None, {"peak_lr": 0.1}, "03", 0.97, [], Path("."), {})
    >>> r.best_score
    0.97
    """

    tuner: Any
    best_hyperparameters: dict
    best_trial_id: str | None
    best_score: float | None
    rows: list
    project_dir: Path
    files: dict


def resolve_hypermodel(recipe, cfg=None, overrides=None):
    """A `RecipeHyperModel` from a recipe name, a recipe module, `"module:factory"` or a HyperModel.

    `"module:factory"` imports `module` and calls `factory(cfg, **overrides)`; a
    name on the command line (`resnet-imagenet`) uses that recipe's `hypermodel()`.

    Example:
    >>> hm = resolve_hypermodel("resnet-imagenet", overrides={"dataset": "digits"})  # doctest: +SKIP
    """
    overrides = dict(overrides or {})
    if hasattr(recipe, "declare_hyperparameters") and hasattr(recipe, "build"):
        if cfg is not None or overrides:
            raise ValueError("Pass `config`/`overrides` to the recipe's `hypermodel()`, not with a HyperModel.")
        return recipe
    if isinstance(recipe, str):
        if ":" in recipe:
            mod_name, _, attr = recipe.partition(":")
            factory = getattr(importlib.import_module(mod_name), attr)
            return factory(cfg, **overrides)
        from trainwell.recipes import get

        recipe = get(recipe)
    if not hasattr(recipe, "hypermodel"):
        raise ValueError(
            f"Invalid value for argument `recipe`. Expected a recipe name, a recipe module with `hypermodel()`, "
            f"'module:factory' or a HyperModel. Received: recipe={recipe!r}"
        )
    return recipe.hypermodel(cfg, **overrides)


#: The KerasTuner version from which trainwell's fixes of its saves and reload are no
#: longer applied (they were written against 1.4).
KERAS_TUNER_FIXED_IN = (1, 5)


def _keras_tuner_needs_fixes() -> bool:
    import keras_tuner

    major, minor = (int(x) for x in keras_tuner.__version__.split(".")[:2])
    return (major, minor) < KERAS_TUNER_FIXED_IN


_ATOMIC_SAVES = {"applied": False}


def atomic_keras_tuner_saves() -> bool:
    """Makes KerasTuner write its state files atomically (a fix for KerasTuner 1.4).

    KerasTuner 1.4 saves `oracle.json`, every `trial.json` and the tuner's file
    with `open(path, "w").write(...)`: a search killed during a save (SIGKILL,
    preemption, power loss) leaves an empty or torn file, and rerunning the search
    then fails in `Oracle.reload` with a `JSONDecodeError` instead of continuing.
    This replaces `keras_tuner.src.utils.save_json`, through which all of them go,
    with a write to a temporary file, fsync and rename (`trainwell.io`), for local
    paths; other paths (`gs://`) keep KerasTuner's write. Applied by `make_tuner`;
    gated on KerasTuner < 1.5. Returns whether the fix is in place.

    Example:
    >>> atomic_keras_tuner_saves()  # doctest: +SKIP
    True
    """
    if _ATOMIC_SAVES["applied"]:
        return True
    if not _keras_tuner_needs_fixes():
        return False
    from keras_tuner.src import utils as kt_utils

    original = kt_utils.save_json

    def save_json(path, obj):
        if "://" in str(path):
            return original(path, obj)
        from trainwell.io import atomic_write_text

        obj_str = json.dumps(obj)
        atomic_write_text(path, obj_str)
        return obj_str

    save_json.__doc__ = original.__doc__
    kt_utils.save_json = save_json
    _ATOMIC_SAVES["applied"] = True
    return True


_RELOAD_FIX = {"applied": False}


def reconcile_reloaded_trials(oracle) -> dict:
    """Puts a reloaded oracle's trial bookkeeping in line with its trial files.

    KerasTuner 1.4 commits a trial's start and end in two files, one after the
    other: `create_trial` writes `trial_N/trial.json` (RUNNING) and then
    `oracle.json`; `end_trial` writes `trial.json` (COMPLETED) and then an
    `oracle.json` that still lists the trial as ongoing (it is removed from
    `ongoing_trials` after the save). `Oracle.reload` takes `oracle.json` as the
    truth, so a search killed between the two writes reloads wrongly:

    - killed after a trial's start: the trial is RUNNING on disk but in no queue.
      It is never run again and never ends; random search finishes one trial
      short with a RUNNING trial left, and PBT waits forever for that member.
    - killed after a trial's end: the COMPLETED trial is listed as ongoing and
      `reload` sends it for retry, so it runs a second time.

    This runs after `Oracle.reload` (see `recover_interrupted_trials`): trials that
    are RUNNING on disk are queued for retry (their values recorded as tried, so
    the oracle does not hand them out again), and trials that already ended
    (COMPLETED, FAILED) are taken off the retry queue. INVALID trials waiting for
    their retry stay. Returns `{"requeued": [...], "dropped": [...]}`.

    Example:
    >>> reconcile_reloaded_trials(tuner.oracle)  # doctest: +SKIP
    {'requeued': ['02'], 'dropped': []}
    """
    from keras_tuner.src.engine.trial import TrialStatus

    ended = {TrialStatus.COMPLETED, TrialStatus.FAILED}
    dropped = [tid for tid in oracle._retry_queue if oracle.trials[tid].status in ended]
    oracle._retry_queue = [tid for tid in oracle._retry_queue if tid not in dropped]
    waiting = set(oracle._retry_queue) | {t.trial_id for t in oracle.ongoing_trials.values()}
    requeued = []
    for tid in sorted(oracle.trials):  # trial ids are zero-padded creation numbers
        trial = oracle.trials[tid]
        if trial.status == TrialStatus.RUNNING and tid not in waiting:
            oracle._record_values(trial)
            if tid not in oracle.start_order:
                oracle.start_order.append(tid)
            # `create_trial` pops the queue from its end: these run after the trials
            # KerasTuner queued itself, oldest first.
            oracle._retry_queue.insert(0, tid)
            requeued.append(tid)
    return {"requeued": requeued, "dropped": dropped}


def recover_interrupted_trials() -> bool:
    """Makes KerasTuner's `Oracle.reload` rerun trials a kill interrupted (a fix for KerasTuner 1.4).

    Wraps `keras_tuner.Oracle.reload`, which every oracle (random, Bayesian,
    Hyperband, trainwell's PBT) uses to continue a search from its project
    directory, with `reconcile_reloaded_trials`: see there for the two kill points
    KerasTuner mishandles. Applied by `make_tuner`; gated on KerasTuner < 1.5.
    Returns whether the fix is in place.

    Example:
    >>> recover_interrupted_trials()  # doctest: +SKIP
    True
    """
    if _RELOAD_FIX["applied"]:
        return True
    if not _keras_tuner_needs_fixes():
        return False
    from keras_tuner.src.engine import oracle as oracle_module

    original = oracle_module.Oracle.reload

    def reload(self):
        original(self)
        fixed = reconcile_reloaded_trials(self)
        if (fixed["requeued"] or fixed["dropped"]) and getattr(self, "verbose", 1):
            print(f"trainwell: reloaded search: trials rerun after a kill {fixed['requeued']}, "
                  f"finished trials not rerun {fixed['dropped']}")

    reload.__doc__ = original.__doc__
    reload._trainwell_original = original
    oracle_module.Oracle.reload = reload
    _RELOAD_FIX["applied"] = True
    return True


#: Failed trials in a row that end a search: KerasTuner's default (PBT: a generation's worth).
MAX_CONSECUTIVE_FAILED_TRIALS = 3
#: What a search records about its hypermodel, to refuse a rerun with another one.
SEARCH_CONFIG_FILE = "trainwell_search.json"
#: Config fields that do not change what a trial trains.
_CONFIG_FIELDS_NOT_COMPARED = ("run_dir", "verbose")


class SearchFailedError(RuntimeError):
    """A search that stopped because its trials failed; the message (one line) gives their reason.

    Example:
    >>> raise SearchFailedError("The search stopped after 3 failed trials in a row ...")  # doctest: +SKIP
    """


def _search_config(hypermodel) -> dict | None:
    get_config = getattr(hypermodel, "get_config", None)
    if not callable(get_config):
        return None
    out = json.loads(json.dumps(get_config(), default=str))
    out.pop("recipe", None)  # a module path, which depends on how it was imported; `name` stays
    for k in _CONFIG_FIELDS_NOT_COMPARED:
        (out.get("cfg") or {}).pop(k, None)
    return out


def check_project_config(hypermodel, project_dir, overwrite: bool = False, write: bool = True) -> None:
    """Refuses to continue a search in `project_dir` that was started with another config.

    A rerun of a search continues it (KerasTuner reloads the trials), which only makes
    sense with the same recipe config: trials of the two would be ranked together
    and a trial of one would resume another's checkpoint. The first run records the
    hypermodel's config in `PROJECT/trainwell_search.json`; a rerun with a different
    one raises a one-line `ConfigError` naming the fields and `--overwrite`.

    Args:
        hypermodel: The search's `RecipeHyperModel` (others are not checked).
        project_dir: The search's directory.
        overwrite: The search starts afresh: nothing to compare. Defaults to `False`.
        write: Record the config (once the tuner made the directory). Defaults to `True`.

    Example:
    >>> check_project_config(hm, "tuning/resnet-imagenet-random")  # doctest: +SKIP
    """
    from keras_tuner.src.distribute import utils as dist_utils

    from trainwell.config import ConfigError
    from trainwell.io import atomic_write_json

    mine = _search_config(hypermodel)
    if mine is None:
        return
    path = Path(project_dir) / SEARCH_CONFIG_FILE
    if not overwrite and path.is_file():
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            saved = None
        if isinstance(saved, dict) and saved != mine:
            a, b = saved.get("cfg") or {}, mine.get("cfg") or {}
            diff = [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            diff += [f"{k}: {saved.get(k)!r} -> {mine.get(k)!r}" for k in sorted(set(saved) | set(mine))
                     if k != "cfg" and saved.get(k) != mine.get(k)]
            raise ConfigError(
                f"The search in {str(project_dir)!r} was started with another config ({'; '.join(diff[:6])}"
                f"{' ...' if len(diff) > 6 else ''}). Rerun with --overwrite (overwrite=True) to start it afresh, "
                "or give another --project-name."
            )
    if write and (not dist_utils.has_chief_oracle() or dist_utils.is_chief_oracle()):
        atomic_write_json(path, mine)


def _stopped_by_failures(oracle) -> bool:
    """Whether the oracle's last ended trials are the failures that stop a search."""
    limit = getattr(oracle, "max_consecutive_failed_trials", None)
    ended = [oracle.trials[t].status for t in getattr(oracle, "end_order", [])]
    return bool(limit) and len(ended) >= limit and all(str(getattr(s, "value", s)) == "FAILED" for s in ended[-limit:])


def make_tuner(
    hypermodel, tuner: str = "random", *, max_trials: int = 10, directory="tuning", project_name=None,
    overwrite: bool = False, objective=None, max_epochs=None, factor: int = 3, population_size: int = 4,
    ready_interval: int = 1, seed: int | None = 0, hyperparameters=None, max_consecutive_failed_trials=None,
    **tuner_kwargs,
):
    """Builds the KerasTuner tuner of `search()` without running it. See `search` for the arguments.

    Example:
    >>> tuner = make_tuner(hm, "bayesian", max_trials=20, directory="tuning")  # doctest: +SKIP
    """
    if tuner not in TUNERS:
        raise ValueError(f"Invalid value for argument `tuner`. Expected one of {TUNERS}. Received: tuner={tuner!r}")
    if not (is_int(max_trials) and max_trials >= 1):
        raise ValueError(f"Invalid value for argument `max_trials`. Expected an int >= 1. Received: max_trials={max_trials!r}")
    if max_epochs is not None and not (is_int(max_epochs) and max_epochs >= 1):
        raise ValueError(f"Invalid value for argument `max_epochs`. Expected an int >= 1. Received: max_epochs={max_epochs!r}")
    import keras_tuner

    atomic_keras_tuner_saves()
    recover_interrupted_trials()
    objective = objective or hypermodel.objective
    if isinstance(objective, str):
        if objective == getattr(hypermodel, "objective_name", None):
            direction = hypermodel.direction
        else:
            direction = "min" if ("loss" in objective or "error" in objective) else "max"
        objective = keras_tuner.Objective(objective, direction)
    project_name = project_name or f"{getattr(hypermodel, 'name', None) or 'search'}-{tuner}"
    cfg_epochs = int(getattr(getattr(hypermodel, "cfg", None), "epochs", 0) or 0)
    if tuner in ("hyperband", "pbt"):
        # Every trial runs the schedule of the search's epochs: the space (a warmup
        # fraction, ...) and its defaults are read from that run, not the config's.
        epochs = max_epochs or cfg_epochs or (4 if tuner == "pbt" else 9)
        if cfg_epochs and epochs != cfg_epochs and hasattr(hypermodel, "config_for"):
            hypermodel = copy.copy(hypermodel)
            hypermodel.cfg = hypermodel.cfg.replace(epochs=epochs)
    project_dir = Path(directory) / project_name
    check_project_config(hypermodel, project_dir, overwrite, write=False)
    common = dict(
        hypermodel=hypermodel, objective=objective, directory=str(directory), project_name=project_name,
        overwrite=overwrite, seed=seed, hyperparameters=hyperparameters,
        **tuner_kwargs,
    )
    mcf = max_consecutive_failed_trials or MAX_CONSECUTIVE_FAILED_TRIALS
    if tuner == "pbt":
        from trainwell.pbt import PBTTuner

        t = PBTTuner(
            population_size=population_size, ready_interval=ready_interval,
            generations=max(1, math.ceil(epochs / ready_interval)), static_hyperparameters=getattr(hypermodel, "static", ()),
            max_consecutive_failed_trials=max_consecutive_failed_trials, **common,
        )
    elif tuner == "random":
        t = __getattr__("RecipeRandomSearch")(max_trials=max_trials, max_consecutive_failed_trials=mcf, **common)
    elif tuner == "bayesian":
        t = __getattr__("RecipeBayesianOptimization")(max_trials=max_trials, max_consecutive_failed_trials=mcf, **common)
    else:
        t = __getattr__("RecipeHyperband")(max_epochs=epochs, factor=factor, max_consecutive_failed_trials=mcf, **common)
    check_project_config(hypermodel, project_dir, overwrite=True)  # records it, now the directory exists
    return t


def search(
    recipe, tuner: str = "random", *, config=None, overrides=None, max_trials: int = 10, directory="tuning",
    project_name=None, overwrite: bool = False, objective=None, max_epochs=None, factor: int = 3,
    population_size: int = 4, ready_interval: int = 1, seed: int | None = 0, hyperparameters=None,
    callbacks=None, top_k: int = 10, export: bool = True, verbose: int = 1, max_consecutive_failed_trials=None,
    **tuner_kwargs,
) -> SearchResult:
    """Searches the hyperparameters of a recipe with KerasTuner; summarises and exports.

    Rerunning the same call (`overwrite=False`) on the same directory continues a
    killed search: KerasTuner reloads the oracle, the trials that were running are
    run again, and each resumes from its own last checkpoint. Under KerasTuner's
    distributed mode (`KERASTUNER_TUNER_ID`, `KERASTUNER_ORACLE_IP`,
    `KERASTUNER_ORACLE_PORT`; see `launch_distributed`) the chief serves the oracle
    and writes the summary, and a worker runs trials and returns an empty result.

    Args:
        recipe: A recipe name (`"resnet-imagenet"`), a recipe module, `"module:factory"`
            or a `RecipeHyperModel`.
        tuner: `"random"`, `"bayesian"`, `"hyperband"` or `"pbt"`. Defaults to `"random"`.
        config: The recipe's base `Config` (or `None` for its defaults). Defaults to `None`.
        overrides: Config fields to change, e.g. `{"dataset": "mnist5k"}`. Defaults to `None`.
        max_trials: Trials of random and Bayesian search (Hyperband sizes its own
            brackets; PBT runs `population_size` x generations trials plus
            replacements). Defaults to `10`.
        directory: Parent directory of the search. Defaults to `"tuning"`.
        project_name: Its subdirectory. Defaults to `"<recipe>-<tuner>"`.
        overwrite: Start afresh instead of continuing. Defaults to `False`.
        objective: Metric name or `keras_tuner.Objective`. Defaults to the recipe's
            (`val_accuracy`, max).
        max_epochs: Epochs per model for Hyperband and PBT. Defaults to `None`
            (the config's `epochs`).
        factor: Hyperband's reduction factor. Defaults to `3`.
        population_size: PBT population. Defaults to `4`.
        ready_interval: PBT epochs between exploit/explore steps. Defaults to `1`.
        seed: Oracle seed. Defaults to `0`.
        hyperparameters: A `keras_tuner.HyperParameters` overriding parts of the space
            (KerasTuner's own argument). Defaults to `None`.
        callbacks: Extra Keras callbacks for every trial (deep-copied per trial).
            Defaults to `None`.
        top_k: Rows printed in the summary table. Defaults to `10`.
        export: Export the best trial's model to `PROJECT/best_model`. Defaults to `True`.
        verbose: KerasTuner's verbosity. Defaults to `1`.
        max_consecutive_failed_trials: Stop after this many failed trials in a row
            (KerasTuner's argument), raising `SearchFailedError` with the last
            failure's reason once the summary is written. Every error of a trial
            counts (a divergence, a config error) unless `max_retries_per_trial` is
            set. Defaults to `None`: 3 (KerasTuner's default); PBT: `population_size`.
        **tuner_kwargs: More keyword arguments for the KerasTuner tuner.

    Returns:
        A `SearchResult`.

    Raises:
        SearchFailedError: `max_consecutive_failed_trials` trials failed in a row.
        trainwell.config.ConfigError: the directory holds a search started with
            another config (pass `overwrite=True`).

    Example:
    >>> r = search("resnet-imagenet", "hyperband", overrides={"dataset": "digits", "image_size": 8},
    ...            max_epochs=9, directory="tuning")  # doctest: +SKIP
    >>> r.best_hyperparameters["peak_lr"]  # doctest: +SKIP
    """
    from keras_tuner.src.distribute import utils as dist_utils

    hm = resolve_hypermodel(recipe, config, overrides)
    t = make_tuner(
        hm, tuner, max_trials=max_trials, directory=directory, project_name=project_name, overwrite=overwrite,
        objective=objective, max_epochs=max_epochs, factor=factor, population_size=population_size,
        ready_interval=ready_interval, seed=seed, hyperparameters=hyperparameters,
        max_consecutive_failed_trials=max_consecutive_failed_trials, **tuner_kwargs,
    )
    stopped = False
    try:
        t.search(callbacks=list(callbacks or []), verbose=verbose)
    except RuntimeError:
        # KerasTuner's `max_consecutive_failed_trials`: its message holds a traceback.
        if not _stopped_by_failures(t.oracle):
            raise
        stopped = True
    project_dir = Path(t.project_dir)
    if dist_utils.has_chief_oracle() and not dist_utils.is_chief_oracle():
        return SearchResult(t, {}, None, None, [], project_dir, {})
    result = summarize(t, top_k=top_k, export=export, print_table=True)
    if stopped:
        last = t.oracle.trials[t.oracle.end_order[-1]]
        reason = next((r["reason"] for r in result.rows if r["trial_id"] == last.trial_id), "")
        raise SearchFailedError(
            f"The search stopped after {t.oracle.max_consecutive_failed_trials} failed trials in a row "
            f"({result.files.get('summary_json')}); the last one: {reason}"
        )
    return result


# --------------------------------------------------------------------------- summary
def trial_rows(oracle) -> list[dict]:
    """One dict per trial of an oracle, best first, then the failed and unfinished ones.

    Example:
    >>> rows = trial_rows(tuner.oracle)  # doctest: +SKIP
    """
    direction = oracle.objective.direction if hasattr(oracle.objective, "direction") else "min"
    rows = []
    order = {tid: i for i, tid in enumerate(getattr(oracle, "start_order", []) or [])}
    for tid, trial in oracle.trials.items():
        values = trial.hyperparameters.values
        status = str(getattr(trial.status, "value", trial.status))
        msg = (trial.message or "").strip().splitlines()
        reason = ""
        if msg:
            # The last line of the traceback names the error (e.g. `... diverged: ...`);
            # KerasTuner's class name in front of a FailedTrialError's reason says nothing.
            reason = next((line for line in reversed(msg) if line.strip()), "")
            reason = re.sub(r"^[\w.]*FailedTrialError: ", "", reason)[:300]
        row = {
            "trial_id": tid,
            "order": order.get(tid, len(order)),
            "status": status,
            "score": None if trial.score is None or not math.isfinite(float(trial.score)) else float(trial.score),
            "hyperparameters": hp_values(trial.hyperparameters),
            "reason": reason if status != "COMPLETED" else "",
        }
        meta = {k: v for k, v in values.items() if str(k).startswith(META_PREFIXES)}
        if meta:
            row["meta"] = meta
        rows.append(row)
    sign = -1.0 if direction == "max" else 1.0
    rows.sort(key=lambda r: (r["status"] != "COMPLETED" or r["score"] is None,
                             sign * (r["score"] if r["score"] is not None else 0.0), r["order"]))
    for i, r in enumerate(rows):
        r["rank"] = i + 1 if r["status"] == "COMPLETED" and r["score"] is not None else None
    return rows


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def format_table(rows: Sequence[dict], objective_name: str, top_k: int = 10) -> str:
    """The summary table as text: rank, trial, status, score, then each hyperparameter.

    Example:
    >>> print(format_table([{"rank": 1, "trial_id": "0", "status": "COMPLETED", "score": 0.9,
    ...                      "hyperparameters": {"lr": 0.1}}], "val_accuracy"))
    rank  trial  status     val_accuracy  lr
    1     0      COMPLETED  0.9           0.1
    """
    names: list[str] = []
    for r in rows:
        for k in r["hyperparameters"]:
            if k not in names:
                names.append(k)
    header = ["rank", "trial", "status", objective_name] + names
    body = []
    for r in list(rows)[:top_k]:
        body.append(
            [_fmt(r.get("rank") or "-"), r["trial_id"], r["status"], _fmt(r["score"]) if r["score"] is not None else "-"]
            + [_fmt(r["hyperparameters"].get(k, "")) for k in names]
        )
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)] if body else [len(h) for h in header]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in [header] + body]
    return "\n".join(lines)


def plot_trials(rows: Sequence[dict], objective_name: str, path, direction: str = "max"):
    """Score of each trial in start order, failed trials marked, and the best so far.

    Example:
    >>> plot_trials(rows, "val_accuracy", "tuning/p/trials.png")  # doctest: +SKIP
    """
    from matplotlib.ticker import MaxNLocator

    from trainwell.io import new_figure, save_figure

    ordered = sorted(rows, key=lambda r: r["order"])
    xs = [r["order"] for r in ordered if r["score"] is not None]
    ys = [r["score"] for r in ordered if r["score"] is not None]
    fig, axes = new_figure(figsize=(6.5, 3.8))
    ax = axes[0, 0]
    ax.plot(xs, ys, "o", label="trial")
    best, run = [], None
    for y in ys:
        run = y if run is None else (max(run, y) if direction == "max" else min(run, y))
        best.append(run)
    if xs:
        ax.step(xs, best, where="post", label="best so far")
    failed = [r["order"] for r in ordered if r["status"] != "COMPLETED"]
    if failed:
        lo = min(ys) if ys else 0.0
        ax.plot(failed, [lo] * len(failed), "rx", label="failed / invalid")
    ax.set_xlabel("trial (start order)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_ylabel(objective_name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)


def summarize(tuner, top_k: int = 10, export: bool = True, print_table: bool = True) -> SearchResult:
    """Prints and saves the summary table, plots the trials and exports the best model.

    Writes `summary.json` and `summary.csv` (one row per trial), `trials.png`,
    `pbt_lineage.png` for PBT, and `best_model/` to the tuner's project directory.

    Example:
    >>> result = summarize(tuner)  # doctest: +SKIP
    """
    from trainwell.io import atomic_write_json, atomic_write_text

    oracle = tuner.oracle
    objective = oracle.objective
    project_dir = Path(tuner.project_dir)
    rows = trial_rows(oracle)
    best = next((r for r in rows if r["rank"] == 1), None)
    files: dict[str, str] = {}
    summary = {
        "objective": {"name": objective.name, "direction": objective.direction},
        "tuner": type(tuner).__name__,
        "oracle": type(oracle).__name__,
        "num_trials": len(rows),
        "num_completed": sum(r["status"] == "COMPLETED" for r in rows),
        "num_failed": sum(r["status"] in ("FAILED", "INVALID") for r in rows),
        "best": best,
        "trials": rows,
    }
    lineage = getattr(oracle, "lineage", None)
    if callable(lineage):
        lineage = lineage()
    if lineage is not None:
        summary["lineage"] = lineage
    atomic_write_json(project_dir / "summary.json", summary)
    files["summary_json"] = str(project_dir / "summary.json")
    names: list[str] = []
    for r in rows:
        for k in r["hyperparameters"]:
            if k not in names:
                names.append(k)
    import io as _io

    buf = _io.StringIO()
    w = csv.writer(buf)
    w.writerow(["rank", "trial_id", "status", objective.name, *names, "reason"])
    for r in rows:
        w.writerow([r["rank"] or "", r["trial_id"], r["status"], "" if r["score"] is None else r["score"],
                    *[r["hyperparameters"].get(k, "") for k in names], r["reason"]])
    atomic_write_text(project_dir / "summary.csv", buf.getvalue())
    files["summary_csv"] = str(project_dir / "summary.csv")
    files["plot"] = str(plot_trials(rows, objective.name, project_dir / "trials.png", objective.direction))
    if lineage is not None:
        from trainwell.pbt import plot_lineage

        files["lineage_plot"] = str(plot_lineage(lineage, project_dir / "pbt_lineage.png", objective.name))
    if export and best is not None and hasattr(tuner.hypermodel, "export"):
        trial = oracle.get_trial(best["trial_id"])
        try:
            files["best_model"] = str(
                tuner.hypermodel.export(trial.hyperparameters, tuner.trial_run_dir(trial.trial_id),
                                        project_dir / BEST_MODEL_DIR, objective)
            )
        except NotImplementedError as e:
            warnings.warn(f"Best model not exported: {e}")
    atomic_write_json(project_dir / "summary.json", {**summary, "files": files})
    if print_table:
        print()
        print(f"Search summary: {summary['num_completed']} completed, {summary['num_failed']} failed "
              f"of {summary['num_trials']} trials ({objective.name}, {objective.direction})")
        print(format_table(rows, objective.name, top_k))
        for r in rows:
            if r["status"] in ("FAILED", "INVALID") and r["reason"]:
                print(f"  trial {r['trial_id']} {r['status'].lower()}: {r['reason']}")
        if best is None:
            print("No trial completed: no best score, no best model.")
        print("files: " + ", ".join(f"{k}={v}" for k, v in files.items()))
    return SearchResult(
        tuner=tuner,
        best_hyperparameters=dict(best["hyperparameters"]) if best else {},
        best_trial_id=best["trial_id"] if best else None,
        best_score=best["score"] if best else None,
        rows=rows,
        project_dir=project_dir,
        files=files,
    )


# --------------------------------------------------------------------------- distributed
def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
    except ProcessLookupError:  # pragma: no cover - exited in between
        pass


def launch_distributed(
    argv: Sequence[str], workers: int, *, host: str = "127.0.0.1", port: int | None = None,
    timeout_s: float | None = None, env=None, chief_grace_s: float = 60.0, log_dir=None,
) -> int:
    """Runs a search as KerasTuner's chief oracle plus `workers` worker processes.

    Each process runs `python -m trainwell.cli <argv>` with KerasTuner's
    environment variables: `KERASTUNER_TUNER_ID` (`chief`, `tuner0`, ...),
    `KERASTUNER_ORACLE_IP` and `KERASTUNER_ORACLE_PORT`. The chief serves the
    oracle over gRPC **without authentication or TLS**: anyone who can reach the
    port can read the trials and submit results, so the default host is
    127.0.0.1. Waits are bounded: a worker that fails, the chief exiting, the
    overall `timeout_s`, or the chief still running `chief_grace_s` after the last
    worker finished stops everything; every child is terminated (SIGTERM, then
    SIGKILL) before this returns.

    Args:
        argv: Command-line arguments of `trainwell` for each process (without `--workers`).
        workers: Number of worker processes (>= 1).
        host: Address the chief listens on. Defaults to `"127.0.0.1"`.
        port: Its port. Defaults to `None` (a free port).
        timeout_s: Overall limit in seconds. Defaults to `None` (no limit).
        env: Base environment. Defaults to `None` (`os.environ`).
        chief_grace_s: Seconds the chief may take to finish after the workers.
            Defaults to `60.0`.
        log_dir: Directory for each process's output (`chief.log`, `tuner0.log`, ...);
            `None` lets them write to this process's stdout/stderr. Defaults to `None`.

    Returns:
        The exit status: the chief's, or 1 when a worker failed or time ran out.

    Example:
    >>> launch_distributed(["tune", "resnet-imagenet", "--tuner", "random"], workers=2)  # doctest: +SKIP
    0
    """
    if not (is_int(workers) and workers >= 1):
        raise ValueError(f"Invalid value for argument `workers`. Expected an int >= 1. Received: workers={workers!r}")
    from trainwell.launch import free_ports

    port = int(port or free_ports(1, host)[0])
    base = dict(os.environ if env is None else env)
    base.update({"KERASTUNER_ORACLE_IP": host, "KERASTUNER_ORACLE_PORT": str(port)})
    procs: dict[str, subprocess.Popen] = {}
    logs = []
    deadline = None if timeout_s is None else time.monotonic() + float(timeout_s)

    def spawn(tuner_id):
        e = dict(base, KERASTUNER_TUNER_ID=tuner_id)
        out = None
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            out = open(Path(log_dir) / f"{tuner_id}.log", "ab")
            logs.append(out)
        procs[tuner_id] = subprocess.Popen(
            [sys.executable, "-m", "trainwell.cli", *argv], env=e, stdout=out, stderr=subprocess.STDOUT if out else None
        )

    try:
        spawn("chief")
        for i in range(workers):
            spawn(f"tuner{i}")
        workers_done_at = None
        while True:
            if deadline is not None and time.monotonic() > deadline:
                print(f"trainwell tune: the distributed search ran past {timeout_s} s; stopping it.", file=sys.stderr)
                return 1
            chief_rc = procs["chief"].poll()
            worker_rcs = {k: p.poll() for k, p in procs.items() if k != "chief"}
            bad = {k: v for k, v in worker_rcs.items() if v not in (None, 0)}
            if bad:
                print(f"trainwell tune: worker(s) failed: {bad}; stopping the search.", file=sys.stderr)
                return 1
            if chief_rc is not None:
                if chief_rc != 0:
                    print(f"trainwell tune: the chief exited with status {chief_rc}.", file=sys.stderr)
                    return chief_rc
                # The chief ends once every worker was told to stop: let them exit.
                end = time.monotonic() + chief_grace_s
                while any(p.poll() is None for k, p in procs.items() if k != "chief") and time.monotonic() < end:
                    time.sleep(0.2)
                worker_rcs = {k: p.poll() for k, p in procs.items() if k != "chief"}
                bad = {k: v for k, v in worker_rcs.items() if v not in (None, 0)}
                if bad:
                    print(f"trainwell tune: worker(s) failed: {bad}.", file=sys.stderr)
                    return 1
                if any(v is None for v in worker_rcs.values()):
                    print("trainwell tune: worker(s) still running after the search ended; stopping them.",
                          file=sys.stderr)
                return 0
            if all(v == 0 for v in worker_rcs.values()):
                workers_done_at = workers_done_at or time.monotonic()
                if time.monotonic() - workers_done_at > chief_grace_s:
                    print("trainwell tune: the chief did not finish after its workers; stopping it.", file=sys.stderr)
                    return 1
            time.sleep(0.2)
    finally:
        for k in [k for k in procs if k != "chief"] + ["chief"]:
            if k in procs:
                _stop(procs[k])
        for f in logs:
            f.close()


def _child_argv(args) -> list[str]:
    out = ["tune", args.recipe, "--tuner", args.tuner, "--max-trials", str(args.max_trials)]
    for flag, attr in (("--directory", "directory"), ("--project-name", "project_name"), ("--max-epochs", "max_epochs"),
                       ("--population-size", "population_size"), ("--ready-interval", "ready_interval"),
                       ("--seed", "seed"), ("--objective", "objective"), ("--top-k", "top_k")):
        v = getattr(args, attr, None)
        if v is not None:
            out += [flag, str(v)]
    if getattr(args, "config", None):
        out += ["--config", args.config]
    for s in getattr(args, "set", None) or []:
        out += ["--set", s]
    if getattr(args, "no_export", False):
        out.append("--no-export")
    return out


def main(args) -> int:
    """`trainwell tune`: runs `search()` from parsed command-line arguments.

    With `--workers N` (N >= 1) it launches KerasTuner's chief and N workers on this
    machine (`launch_distributed`) and prints the chief's summary.

    Example:
    >>> from trainwell.cli import build_parser
    >>> main(build_parser().parse_args(["tune", "resnet-imagenet", "--set", "dataset=digits"]))  # doctest: +SKIP
    0
    """
    from keras_tuner.src.distribute import utils as dist_utils

    from trainwell.config import ConfigError

    directory = getattr(args, "directory", None) or "tuning"
    workers = int(getattr(args, "workers", 0) or 0)
    if workers < 0:
        raise ConfigError(f"Invalid value for `--workers`: expected an integer >= 0. Received: workers={workers}")
    hm = _hypermodel_from_args(args)
    from trainwell.data.sources import check_data_ready

    check_data_ready(hm.cfg.dataset, getattr(hm.cfg, "data_dir", None))  # e.g. a TFDS set not prepared: one line
    if getattr(args, "dry_run", False):
        import keras_tuner

        hp = keras_tuner.HyperParameters()
        hm.declare_hyperparameters(hp)
        print(json.dumps({"config": hm.cfg.to_dict(), "space": hp.get_config()}, indent=2, default=str))
        return 0
    if workers > 0 and not dist_utils.has_chief_oracle():
        project = getattr(args, "project_name", None) or f"{hm.name or 'search'}-{args.tuner}"
        if getattr(args, "overwrite", False):
            shutil.rmtree(Path(directory) / project, ignore_errors=True)
        child = argparse_namespace_copy(args, directory=directory, project_name=project)
        rc = launch_distributed(
            _child_argv(child), workers, host=getattr(args, "oracle_host", None) or "127.0.0.1",
            port=getattr(args, "oracle_port", None), timeout_s=getattr(args, "timeout", None),
        )
        summary = Path(directory) / project / "summary.json"
        if rc == 0 and summary.is_file():
            print(f"distributed search done ({workers} workers): {summary}")
        return int(rc)

    def arg(name, default):  # an option not given (None); a given 0 is not replaced by the default
        v = getattr(args, name, None)
        return default if v is None else v

    try:
        result = search(
            hm, args.tuner, max_trials=int(args.max_trials), directory=directory,
            project_name=getattr(args, "project_name", None), overwrite=bool(getattr(args, "overwrite", False)),
            objective=getattr(args, "objective", None), max_epochs=getattr(args, "max_epochs", None),
            population_size=int(arg("population_size", 4)), ready_interval=int(arg("ready_interval", 1)),
            seed=arg("seed", 0), top_k=int(arg("top_k", 10)), export=not getattr(args, "no_export", False),
        )
    except SearchFailedError as e:
        print(f"trainwell tune: {e}", file=sys.stderr)
        return 1
    if dist_utils.has_chief_oracle() and not dist_utils.is_chief_oracle():
        return 0
    return 0 if result.best_trial_id is not None else 1


def argparse_namespace_copy(args, **changes):
    """A copy of an `argparse.Namespace` with some attributes changed.

    Example:
    >>> import argparse
    >>> argparse_namespace_copy(argparse.Namespace(a=1), a=2).a
    2
    """
    import argparse

    d = dict(vars(args))
    d.update(changes)
    return argparse.Namespace(**d)


def _hypermodel_from_args(args):
    """The hypermodel of `trainwell tune RECIPE [--config FILE] [--set k=v ...]`.

    RECIPE is a recipe name or `module:factory`; the module's `Config` (if any)
    loads `--config` and `--set` with its types and validation.
    """
    from trainwell.config import ConfigError, parse_overrides, read_config_file

    recipe = args.recipe
    if ":" in recipe:
        mod_name, _, attr = recipe.partition(":")
        try:
            module = importlib.import_module(mod_name)
            factory = getattr(module, attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"Cannot load the hypermodel factory {recipe!r}: {e}") from None
    else:
        from trainwell.recipes import RECIPES, get

        if recipe not in RECIPES:
            raise ConfigError(f"Unknown recipe {recipe!r}. Expected one of: {', '.join(RECIPES)} or 'module:factory'.")
        module = get(recipe)
        factory = module.hypermodel
    if hasattr(module, "Config"):
        return factory(module.Config.load(getattr(args, "config", None), getattr(args, "set", None) or []))
    overrides = read_config_file(args.config) if getattr(args, "config", None) else {}
    overrides.update(parse_overrides(getattr(args, "set", None) or []))
    return factory(None, **overrides)
