"""What a recipe offers a hyperparameter search: its search space and a KerasTuner `HyperModel`.

Floor 2 (with the recipes): each recipe's `hypermodel(cfg)` returns a
`RecipeHyperModel` built here, and its space uses `log_float` / `batch_size_choice`,
so a recipe never imports the search machinery (`trainwell.tuning`, floor 3), which
uses these classes. KerasTuner's `HyperModel` is extended, not replaced: any
KerasTuner tuner accepts a `RecipeHyperModel`.

Example:
>>> import keras_tuner
>>> hp = keras_tuner.HyperParameters()
>>> log_float(hp, "peak_lr", 0.1, 10.0), batch_size_choice(hp, 256)
(0.1, 256)
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
from pathlib import Path

import keras
import keras_tuner

from trainwell.callbacks.checkpoint import list_checkpoints, load_checkpoint
from trainwell.validation import invalid_argument


# --------------------------------------------------------------------------- search-space helpers
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


# --------------------------------------------------------------------------- checkpoints of a trial
def checkpoint_dir(run_dir) -> Path:
    """Where a run directory's `Checkpoint` writes (`RUN_DIR/checkpoints`, as `standard_callbacks` sets it).

    Example:
    >>> checkpoint_dir("runs/x").as_posix()
    'runs/x/checkpoints'
    """
    return Path(run_dir) / "checkpoints"


def best_checkpoint(run_dir, objective) -> str | None:
    """Path of the checkpoint of `run_dir` with the best monitored value (else the newest).

    Example:
    >>> best_checkpoint("/nonexistent", None) is None
    True
    """
    entries = list_checkpoints(checkpoint_dir(run_dir))
    if not entries:
        return None
    scored = [e for e in entries if isinstance(e.get("value"), (int, float)) and math.isfinite(e["value"])]
    if scored and objective is not None:
        sign = -1.0 if getattr(objective, "direction", "max") == "max" else 1.0
        return min(scored, key=lambda e: sign * e["value"])["path"]
    return entries[-1]["path"]


# --------------------------------------------------------------------------- the hypermodel
class StopAtEpoch(keras.callbacks.Callback):
    """Ends `fit` after epoch `stop_at` (1-based count); one segment of a longer run.

    Args:
        stop_at: Epochs in total after which training stops.

    Example:
    >>> StopAtEpoch(3).stop_at
    3
    """

    def __init__(self, stop_at: int):
        super().__init__()
        self.stop_at = int(stop_at)

    def on_epoch_end(self, epoch, logs=None):
        if int(epoch) + 1 >= self.stop_at:
            self.model.stop_training = True


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
        static: Hyperparameters PBT never explores (they change the shape of the
            optimizer state, of the data or of the checkpoint): a member keeps its
            own while it continues, an exploit takes its donor's with the donor's
            checkpoint. E.g. `("batch_size", "optimizer")`. Defaults to `()`.
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
            raise invalid_argument("space", "a callable", space)
        if direction not in ("max", "min"):
            raise invalid_argument("direction", "'max' or 'min'", direction)
        if not isinstance(objective, str) or not objective:
            raise invalid_argument("objective", "a metric name", objective)
        if not hasattr(recipe, "train"):
            raise invalid_argument("recipe", "a module with `train(cfg, callbacks=...)`", recipe)
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

    def run(self, hp, run_dir, *, callbacks=None, epochs=None, stop_at_epoch=None, early_stopping=True,
            model_hook=None):
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
                longer run). Defaults to `None` (train all `epochs`).
            early_stopping: Keep the recipe's early stopping; off for segmented
                runs, where the tuner decides. Defaults to `True`.
            model_hook: `model_hook(factory) -> factory`: wraps the function with
                which the run gets its compiled model (PBT's `ModelCache` hands back
                a member's model through it); see `recipe_model_hook`. Defaults to
                `None` (the recipe's own).

        A recipe's `train()` may take two optional keywords, passed only if it
        does: `model_hook` (see `recipe_model_hook`) and `segment`, `True`
        when the run stops at `stop_at_epoch` before its schedule ends to be
        continued later (a PBT or Hyperband segment): the recipe may then skip
        its end-of-run work, which nothing reads before the run's last segment
        (the test split's evaluation, `curves.png`); the search scores trials
        from the history.

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
        extra = {}
        if stop_at_epoch is not None and int(stop_at_epoch) < int(cfg.epochs):
            cbs.append(StopAtEpoch(int(stop_at_epoch)))
            if _takes(self.recipe.train, SEGMENT_ARG):
                extra[SEGMENT_ARG] = True
        with recipe_model_hook(self.recipe, model_hook) as hook_kwargs:
            return self.recipe.train(cfg, callbacks=cbs, **hook_kwargs, **extra)

    def load(self, hp, run_dir, objective=None):
        """The model of a trial: `build_fn(cfg)` with its best checkpoint loaded.

        Example:
        >>> model = hm.load(trial.hyperparameters, "tuning/p/trial_3/run")  # doctest: +SKIP
        """
        if self.build_fn is None:
            raise NotImplementedError(f"The hypermodel of {self.name!r} has no `build_fn`.")
        cfg = self.config_for(hp, run_dir=str(run_dir))
        model = self.build_fn(cfg)
        path = best_checkpoint(run_dir, objective or self.objective)
        if path is None:
            raise FileNotFoundError(f"No committed checkpoint in {str(checkpoint_dir(run_dir))!r}")
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


#: The keyword of a recipe's `train()` that takes a hook around its (compiling) model factory for one run.
MODEL_HOOK_ARG = "model_hook"
#: The keyword of a recipe's `train()` that says the run is a segment to be continued (see `RecipeHyperModel.run`).
SEGMENT_ARG = "segment"


def _takes(fn, name: str) -> bool:
    """Whether `fn` has a parameter called `name` (not merely `**kwargs`, which a recipe reads as config fields)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False


@contextlib.contextmanager
def recipe_model_hook(recipe, model_hook):
    """Hands `model_hook` to a recipe's `train()` for one call; yields the keyword arguments for `recipe.train`.

    `model_hook(factory) -> factory` wraps the function with which a run gets
    its compiled model. A recipe's `train()` that takes `model_hook` applies it
    to its own factory (`{"model_hook": model_hook}` is yielded). For a recipe
    whose `train()` does not take it yet, the module's `build_model` is wrapped
    instead while the block runs (restored when it ends; `{}` is yielded): that
    reaches the run's model only when `build_model` also compiles it (a hook
    such as PBT's `ModelCache` compares compiled models). With `model_hook=None`
    nothing changes.

    Args:
        recipe: The recipe module (`train`, maybe `build_model`).
        model_hook: `model_hook(factory) -> factory`, or `None`.

    Example:
    >>> import types
    >>> recipe = types.SimpleNamespace(build_model=lambda cfg: "model", train=lambda cfg, callbacks=None: None)
    >>> with recipe_model_hook(recipe, lambda build: lambda cfg: "kept " + build(cfg)) as kwargs:
    ...     kwargs, recipe.build_model(None)
    ({}, 'kept model')
    >>> recipe.build_model(None)
    'model'
    """
    if model_hook is None:
        yield {}
        return
    if _takes(recipe.train, MODEL_HOOK_ARG):
        yield {MODEL_HOOK_ARG: model_hook}
        return
    build = getattr(recipe, "build_model", None)
    if build is None:
        yield {}
        return
    recipe.build_model = model_hook(build)
    try:
        yield {}
    finally:
        recipe.build_model = build


def recipe_hypermodel(recipe, cfg, space, **kwargs):
    """Builds a `RecipeHyperModel` (what each recipe's `hypermodel()` returns).

    Example:
    >>> hm = recipe_hypermodel(my_recipe, my_recipe.Config(), my_space)  # doctest: +SKIP
    """
    return RecipeHyperModel(recipe, cfg, space, **kwargs)
