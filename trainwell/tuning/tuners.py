"""The tuners of `trainwell.tuning`: KerasTuner's, running a recipe per trial with its checkpoints.

`RecipeTunerMixin` is mixed in before a KerasTuner tuner, whose oracle is kept as is;
see its docstring for what it changes. The checkpoint helpers here let a trial start
from another trial's checkpoint (Hyperband's promotions, PBT's exploits).
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import time
import warnings
from pathlib import Path

import keras
import keras_tuner

from trainwell.callbacks.checkpoint import STATE_FILE, latest_checkpoint
from trainwell.callbacks.nan_rollback import TrainingDivergedError
from trainwell.compat import learning_rate_variables
from trainwell.compat.keras_tuner import is_chief_oracle, serve_chief
from trainwell.io import atomic_write_json, fsync_dir
from trainwell.recipes.hypermodel import checkpoint_dir

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


# --------------------------------------------------------------------------- checkpoints
def has_checkpoint(run_dir) -> bool:
    """Whether a trial's run directory holds a committed checkpoint.

    Example:
    >>> has_checkpoint("/nonexistent")
    False
    """
    return latest_checkpoint(checkpoint_dir(run_dir)) is not None


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
    src = latest_checkpoint(checkpoint_dir(src_run_dir))
    if src is None:
        raise FileNotFoundError(f"No committed checkpoint to copy in {str(checkpoint_dir(src_run_dir))!r}")
    src = Path(src)
    dst_dir = checkpoint_dir(dst_run_dir)
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


def starts_from_copied_checkpoint(run_dir) -> bool:
    """Whether the newest checkpoint of a run directory is a copy of another trial's (`copy_checkpoint`).

    Example:
    >>> starts_from_copied_checkpoint("/nonexistent")
    False
    """
    latest = latest_checkpoint(checkpoint_dir(run_dir))
    if latest is None:
        return False
    try:
        meta = json.loads((Path(latest) / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool((meta.get("entry") or {}).get("copied_from"))


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
    >>> callbacks.insert(0, KeepConfiguredLearningRate())  # doctest: +SKIP
    """

    def set_model(self, model):
        super().set_model(model)
        opt = getattr(model, "optimizer", None)
        self._saved, seen = [], set()
        for lr in learning_rate_variables(opt) if opt is not None else ():
            if id(lr) not in seen:
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


def metrics_from_history(history: dict, objective, mode: str) -> dict:
    """A trial's score for KerasTuner: the objective's best (`mode="best"`) or last epoch, from a history.

    Example:
    >>> metrics_from_history({"val_accuracy": [0.5, 0.7, 0.6]}, keras_tuner.Objective("val_accuracy", "max"), "best")
    {'val_accuracy': 0.7}
    """
    name = objective.name
    values = [float(v) for v in history.get(name, [])]
    if not values:
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
            callbacks.insert(0, KeepConfiguredLearningRate())
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
        return metrics_from_history(run.history, self.oracle.objective, self.score_mode)

    def _values_differ_from(self, hp, parent_id) -> bool:
        try:
            parent = self.oracle.get_trial(parent_id)
        except Exception:  # unknown to this oracle: assume they differ (keeping the own config is safe)
            return True
        return hp_values(parent.hyperparameters) != hp_values(hp)

    def load_model(self, trial):
        return self.hypermodel.load(trial.hyperparameters, self.trial_run_dir(trial.trial_id), self.oracle.objective)

    def search(self, *fit_args, **fit_kwargs):
        if is_chief_oracle():
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
