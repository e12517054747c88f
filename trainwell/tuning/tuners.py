"""The tuners of `trainwell.tuning`: KerasTuner's, running a recipe per trial with its checkpoints.

`RecipeTunerMixin` is mixed in before a KerasTuner tuner, whose oracle is kept as is;
see its docstring for what it changes. The checkpoint helpers here let a trial start
from another trial's checkpoint (Hyperband's promotions, PBT's exploits).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import math
import os
import time
from pathlib import Path

import keras
import keras_tuner

from trainwell.callbacks.checkpoint import latest_checkpoint, list_checkpoints
from trainwell.callbacks.checkpoint.files import copy_checkpoint as copy_checkpoint_files
from trainwell.callbacks.nan_rollback import TrainingDivergedError
from trainwell.compat import get_lr_multiplier, learning_rate_variables, set_lr_multiplier, strategy_scope
from trainwell.compat.backend import reseeding_keeps_compiled_functions
from trainwell.compat.keras_internals import model_fully_built
from trainwell.compat.kernels import train_step_reads_outside_variables
from trainwell.compat.keras_tuner import is_chief_oracle, serve_chief
from trainwell.io import atomic_write_json
from trainwell.losses import VARIABLE_CONFIG_KEYS
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
    The checkpoint format's own `copy_checkpoint` writes it (temporary directory,
    one rename).

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
    return copy_checkpoint_files(src, checkpoint_dir(dst_run_dir), stopped=False, copied_from=str(src))


def starts_from_copied_checkpoint(run_dir) -> bool:
    """Whether the newest checkpoint of a run directory is a copy of another trial's (`copy_checkpoint`).

    Example:
    >>> starts_from_copied_checkpoint("/nonexistent")
    False
    """
    entries = list_checkpoints(checkpoint_dir(run_dir))
    return bool(entries and entries[-1].get("copied_from"))


# --------------------------------------------------------------------------- compiled models kept between segments
def _names(obj, out: list) -> list:
    """Every `"name"` value of a (serialized) config, depth first, in order."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "name" and isinstance(v, str):
                out.append(v)
            else:
                _names(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _names(v, out)
    return out


def _renamed(obj, mapping: dict):
    if isinstance(obj, dict):
        return {k: _renamed(v, mapping) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_renamed(v, mapping) for v in obj]
    if isinstance(obj, str):
        return mapping.get(obj, obj)
    return obj


def _without_variables(obj, keys=()):
    """A serialized config with the values the traced step reads from variables masked.

    `keys` (an optimizer's numeric `learning_rate`, an optimizer variable) and, where
    the compiled step reads a loss's own variables (`train_step_reads_outside_variables`),
    the `variable_config_keys` of trainwell's losses (`trainwell.losses`, e.g.
    `label_smoothing`): assigned, not traced.
    """
    if isinstance(obj, dict):
        if train_step_reads_outside_variables() and obj.get("registered_name") in VARIABLE_CONFIG_KEYS:
            keys = (*keys, *VARIABLE_CONFIG_KEYS[obj["registered_name"]])
        return {k: ("<variable>" if k in keys and isinstance(v, (int, float)) else _without_variables(v, keys))
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_without_variables(v, keys) for v in obj]
    return obj


def _graph_description(model):
    compile_config = dict(model.get_compile_config() or {})
    if not compile_config:
        return None
    compile_config = {k: _without_variables(v, ("learning_rate",) if k == "optimizer" else ())
                      for k, v in compile_config.items()}
    return {"model": model.get_config(), "compile": compile_config}


def _variable_backed_losses(model) -> list:
    """The compiled losses of `model` that read hyperparameters from variables (`trainwell.losses`)."""
    return [loss for loss in keras.tree.flatten(getattr(model, "loss", None))
            if getattr(loss, "uses_variable", False)]


def same_graph(model, other) -> bool:
    """Whether two compiled models trace to the same train step (up to auto-generated names and variables).

    The same class, distribution strategy, variables (shapes, dtypes) and
    optimizer, and the same `get_config()` and `get_compile_config()` (optimizer,
    loss, metrics, `steps_per_execution`, `jit_compile`, ...) once the names Keras
    numbers (`dense_3`) are matched up and the values the step reads from
    variables (assigned, not traced) are left out: a numeric learning rate, and
    on TensorFlow the label smoothing of `trainwell.losses.CategoricalCrossentropy`.
    Anything that cannot be compared counts as different.

    Example:
    >>> same_graph(build_model(cfg), build_model(cfg))  # doctest: +SKIP
    True
    """
    try:
        if type(model) is not type(other) or type(model.optimizer) is not type(other.optimizer):
            return False
        if getattr(model, "distribute_strategy", None) is not getattr(other, "distribute_strategy", None):
            return False
        if not (model_fully_built(model) and model_fully_built(other)):
            return False
        shapes = [(tuple(v.shape), str(v.dtype)) for v in model.variables]
        if shapes != [(tuple(v.shape), str(v.dtype)) for v in other.variables]:
            return False
        a, b = _graph_description(model), _graph_description(other)
        if a is None or b is None:
            return False
        names_a, names_b = _names(a, []), _names(b, [])
        if len(names_a) != len(names_b):
            return False
        mapping: dict = {}
        for x, y in zip(names_a, names_b):
            if mapping.setdefault(x, y) != y:
                return False
        return _renamed(a, mapping) == _renamed(b, {})  # both with tuples as lists
    except Exception:  # noqa: BLE001 - a model that cannot describe itself is rebuilt
        return False


def adopt_state(model, fresh) -> None:
    """Gives `model` the whole state of `fresh`, a new build of the same graph (see `same_graph`).

    Weights and seed-generator states (`model.variables`), every optimizer
    variable (`fresh`'s optimizer is built for this: iterations, learning rate,
    slots at their initial values), the schedule's LR multiplier and the
    variable-backed values of `trainwell.losses` (a label smoothing): after this
    `model` is what the recipe's build returned, but with its traced functions.

    Example:
    >>> adopt_state(cached_model, build_model(cfg))  # doctest: +SKIP
    """
    for dst, src in zip(model.variables, fresh.variables):
        dst.assign(src.value)
    if not fresh.optimizer.built:
        with strategy_scope(fresh):
            fresh.optimizer.build(fresh.trainable_variables)
    if not model.optimizer.built:
        with strategy_scope(model):
            model.optimizer.build(model.trainable_variables)
    for dst, src in zip(model.optimizer.variables, fresh.optimizer.variables):
        dst.assign(src.value)
    set_lr_multiplier(model.optimizer, get_lr_multiplier(fresh.optimizer))
    for dst, src in zip(_variable_backed_losses(model), _variable_backed_losses(fresh)):
        for key in dst.variable_config_keys:
            setattr(dst, key, getattr(src, key))
    model.reset_metrics()



@contextlib.contextmanager
def _donor_config_expected():
    """Silences `Checkpoint`'s line about another run config: a copied checkpoint was written under the donor's."""

    def keep(record):
        return "written under another run config" not in record.getMessage()

    log = logging.getLogger("trainwell.checkpoint")
    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)

class ModelCache:
    """The compiled model of each PBT member, kept between the member's segments.

    A segment is a new `fit` of the recipe, which builds a new model: Keras
    traces its train and test functions again (seconds per segment, the bulk of
    PBT's cost over random search at the same epochs). While a segment runs,
    the hook `serving` yields wraps the recipe's model factory (passed to
    `RecipeHyperModel.run(model_hook=...)`, see
    `trainwell.recipes.hypermodel.recipe_model_hook`): it hands back the
    member's model from its previous segment instead of the new build, when the
    recipe's own new build describes the same graph (`same_graph`: a continued
    member always; an exploit when explore changed only values the step reads from
    variables: a plain learning rate, `trainwell.losses`' label smoothing):
    the new build lends it its whole state (`adopt_state`), and the segment's
    `Checkpoint` then restores the member's or the donor's checkpoint into it,
    as into a new model. Only a segment that resumes from a checkpoint reuses a
    model. The new build still runs (it is cheap beside a trace, and its side
    effects, e.g. seeding, stay as they were), so a segment trains exactly as
    it would in a fresh process (a search killed and continued gives the same
    results). One side effect of the recipe's seeding is left out while a
    segment runs: on TensorFlow it clears the kernel caches, and every traced
    function of every kept model would instantiate again (graph optimization
    included) at its next call; the caches stay
    (`reseeding_keeps_compiled_functions`), unless a traced function holds a
    stateful random op, whose stream restarts only with a new kernel (Keras 3's
    own randomness is stateless). An eager stateful random op (`tf.random.uniform`
    outside any traced function, after the seeding) would continue its stream
    instead of restarting it; pass `reuse_models=False` to a recipe that relies
    on that.

    Example:
    >>> cache = ModelCache()
    >>> with cache.serving(key=0, resumes=True) as hook:  # doctest: +SKIP
    ...     run = hypermodel.run(hp, run_dir, model_hook=hook)
    """

    def __init__(self):
        self._models: dict = {}
        #: `(key, "reused" | "built")` per segment served, for tests and benchmarks.
        self.events: list[tuple] = []

    def __len__(self) -> int:
        return len(self._models)

    @contextlib.contextmanager
    def serving(self, key, resumes: bool):
        """Yields a model hook (`hook(build_model) -> build_model`) whose first build may be `key`'s cached model.

        The model the block used is cached for `key` when the block ends without
        an error; after an error `key` has none (the next segment builds anew).
        """
        cached = self._models.pop(key, None)
        served: list = []

        def hook(build):
            def build_model(*args, **kwargs):
                model = build(*args, **kwargs)
                if served:  # a second build in the same run (e.g. for export): not the trained model
                    return model
                if resumes and cached is not None and same_graph(cached, model):
                    adopt_state(cached, model)
                    model = cached
                    self.events.append((key, "reused"))
                else:
                    self.events.append((key, "built"))
                served.append(model)
                return model

            return build_model

        # The recipe seeds each run; on TensorFlow that would make every traced function of every
        # kept model instantiate again at its next call (see reseeding_keeps_compiled_functions).
        with reseeding_keeps_compiled_functions():
            yield hook
        if served:
            self._models[key] = served[0]


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
    #: A `ModelCache` keeping each PBT member's compiled model between its segments; None: a new model each trial.
    model_cache = None

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
        member = values.get("pbt/member") if self.model_cache is not None else None
        if member is None:
            # Frees the previous trial's graphs; it runs `gc.collect()` itself (a second
            # full collection here cost ~0.7 s a trial on a loaded 2-core VM, ~20% of a
            # 1-epoch PBT segment of a small MLP). Not while models are kept: their
            # graphs are what is being saved, and the collection cost seconds a segment.
            keras.backend.clear_session()
            serving = contextlib.nullcontext()
        else:
            serving = self.model_cache.serving(int(member), resumes=has_checkpoint(run_dir))
        try:
            with _donor_config_expected(), serving as model_hook:
                run = self.hypermodel.run(
                    hp, run_dir, callbacks=callbacks, epochs=self.schedule_epochs,
                    stop_at_epoch=stop_at, early_stopping=self.trial_early_stopping, model_hook=model_hook,
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
        # What is alive as the search starts (TensorFlow, Keras and the rest of the
        # imports: ~0.5 million objects) lives as long as the process: frozen out of
        # the garbage collector's full collections, which otherwise scan it again
        # each time one triggers (0.3-0.7 s on this 2-core VM, about once a trial or
        # PBT segment). Objects made by the trials are collected as before. Left alone
        # if the caller froze objects already (unfreezing would release theirs).
        freeze = gc.get_freeze_count() == 0
        if freeze:
            gc.freeze()
        try:
            return super().search(*fit_args, **fit_kwargs)
        finally:
            if freeze:
                gc.unfreeze()

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
