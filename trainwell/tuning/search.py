"""`search()`: one call that builds a KerasTuner tuner over a recipe, runs it, summarises and exports.

Rerunning the same call on the same directory continues a killed search; a rerun with
another config, another tuner or another `TRAINWELL_QUICK` setting is refused
(`check_project_config`).
"""

from __future__ import annotations

import copy
import importlib
import json
import math
from pathlib import Path

import keras_tuner
from keras_tuner.engine.metrics_tracking import infer_metric_direction

from trainwell import quick
from trainwell.compat import metric_direction
from trainwell.compat.keras_tuner import (
    atomic_keras_tuner_saves,
    has_chief_oracle,
    is_chief_oracle,
    recover_interrupted_trials,
)
from trainwell.config import ConfigError, config_error, did_you_mean
from trainwell.io import atomic_write_json
from trainwell.recipes import get
from trainwell.tuning.pbt import PBTTuner
from trainwell.tuning.summary import SearchResult, summarize
from trainwell.tuning.tuners import RecipeBayesianOptimization, RecipeHyperband, RecipeRandomSearch
from trainwell.storage import StagedDirectory, store_for
from trainwell.validation import check_url, invalid_argument, is_int, is_url, redact

TUNERS = ("random", "bayesian", "hyperband", "pbt")


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
        recipe = get(recipe)
    if not hasattr(recipe, "hypermodel"):
        raise invalid_argument("recipe", "a recipe name, a recipe module with `hypermodel()`, "
                                         "'module:factory' or a HyperModel", recipe)
    return recipe.hypermodel(cfg, **overrides)


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


def _search_config(hypermodel, tuner=None, objective=None) -> dict | None:
    """What a search records in `SEARCH_CONFIG_FILE`: the hypermodel's config, the tuner, the objective,
    `TRAINWELL_QUICK`."""
    get_config = getattr(hypermodel, "get_config", None)
    out = json.loads(json.dumps(get_config(), default=str)) if callable(get_config) else {}
    out.pop("recipe", None)  # a module path, which depends on how it was imported; `name` stays
    for k in _CONFIG_FIELDS_NOT_COMPARED:
        (out.get("cfg") or {}).pop(k, None)
    if tuner is not None:
        out["tuner"] = tuner  # KerasTuner cannot reload one tuner's oracle as another's
    if objective is not None:  # the trials' scores are the objective's: another one would rank them wrongly
        out["objective"] = f"{objective.name} ({objective.direction})"
    caps = quick.caps()
    if caps is not None:
        out["quick"] = caps.batches  # smoke-test trials are never ranked with real ones
    return out or None


def check_project_config(hypermodel, project_dir, overwrite: bool = False, write: bool = True,
                         tuner: str | None = None, objective=None) -> None:
    """Refuses to continue a search in `project_dir` that was started with another config.

    A rerun of a search continues it (KerasTuner reloads the trials), which only makes
    sense with the same recipe config, tuner and `TRAINWELL_QUICK` setting: trials of
    the two would be ranked together, a trial of one would resume another's
    checkpoint, and KerasTuner cannot reload one tuner's oracle as another's. The
    first run records them in `PROJECT/trainwell_search.json` (`"quick": N` marks a
    `TRAINWELL_QUICK=N` smoke test); a rerun with different ones raises a one-line
    `ConfigError` naming the fields and `--overwrite`. A record without a tuner or
    an objective (written before they were recorded) is not compared on them.

    Args:
        hypermodel: The search's hypermodel (its config is compared when it has `get_config`).
        project_dir: The search's directory.
        overwrite: The search starts afresh: nothing to compare. Defaults to `False`.
        write: Record the config (once the tuner made the directory). Defaults to `True`.
        tuner: The tuner's name (`"random"`, ...). Defaults to `None` (not compared).
        objective: The search's `keras_tuner.Objective`. Defaults to `None` (not compared).

    Example:
    >>> check_project_config(hm, "tuning/resnet-imagenet-random", tuner="random")  # doctest: +SKIP
    """
    mine = _search_config(hypermodel, tuner, objective)
    if mine is None:
        return
    path = Path(project_dir) / SEARCH_CONFIG_FILE
    if not overwrite and path.is_file():
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            saved = None
        if isinstance(saved, dict):
            mine = {k: v for k, v in mine.items() if k in saved or k not in ("tuner", "objective")}
        if isinstance(saved, dict) and saved != mine:
            where = f"The search in {str(project_dir)!r}"
            hint = "Rerun with --overwrite (overwrite=True) to start it afresh, or give another --project-name."
            if saved.get("quick") and not mine.get("quick"):
                raise ConfigError(
                    f"{where} is a TRAINWELL_QUICK={saved['quick']} smoke test (its trials trained "
                    f"{saved['quick']} batch(es); their scores mean nothing), not continued by a real search. {hint}"
                )
            if mine.get("quick") and not saved.get("quick"):
                raise ConfigError(
                    f"{where} is a real search: TRAINWELL_QUICK={mine['quick']} would rank smoke-test trials with "
                    "its trials. Unset TRAINWELL_QUICK to continue it, or give another --project-name."
                )
            a, b = saved.get("cfg") or {}, mine.get("cfg") or {}
            diff = [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            diff += [f"{k}: {saved.get(k)!r} -> {mine.get(k)!r}" for k in sorted(set(saved) | set(mine))
                     if k != "cfg" and saved.get(k) != mine.get(k)]
            raise ConfigError(
                f"{where} was started with another config ({'; '.join(diff[:6])}"
                f"{' ...' if len(diff) > 6 else ''}). {hint}"
            )
    if write and (not has_chief_oracle() or is_chief_oracle()):
        atomic_write_json(path, mine)


def _stopped_by_failures(oracle) -> bool:
    """Whether the oracle's last ended trials are the failures that stop a search."""
    limit = getattr(oracle, "max_consecutive_failed_trials", None)
    ended = [oracle.trials[t].status for t in getattr(oracle, "end_order", [])]
    return bool(limit) and len(ended) >= limit and all(str(getattr(s, "value", s)) == "FAILED" for s in ended[-limit:])


def check_search(hypermodel, tuner: str = "random", *, max_trials: int = 10, directory="tuning", project_name=None,
                 overwrite: bool = False, max_epochs=None, objective=None) -> None:
    """Refuses, in one line, what `search()` would refuse at its start, without making anything.

    The arguments' values and a project directory holding a search started with
    another config, tuner or `TRAINWELL_QUICK` setting (`check_project_config`).
    `trainwell tune --workers N` calls it before it starts any process, so a bad
    search is one line in the parent, not one traceback per worker. See `search`
    for the arguments.

    Example:
    >>> check_search(hm, "hyperband", max_epochs=9, directory="tuning")  # doctest: +SKIP
    """
    max_trials, max_epochs, _, _ = quick.search_lengths(max_trials, max_epochs, 2, 1)
    _checked_search(hypermodel, tuner, max_trials, directory, project_name, overwrite, max_epochs, objective)


def _project_name(hypermodel, tuner: str, project_name) -> str:
    return project_name or f"{getattr(hypermodel, 'name', None) or 'search'}-{tuner}"


def resolve_objective(hypermodel, objective=None):
    """The search's `keras_tuner.Objective`: `objective` (a name or an `Objective`), else the hypermodel's.

    A name's direction comes from the hypermodel (its own objective), trainwell's rule for
    Keras's metric names, then KerasTuner's inference; a name none of them knows is a
    one-line `ConfigError` before anything trains.

    Example:
    >>> resolve_objective(None, "val_loss").direction
    'min'
    """
    objective = objective or getattr(hypermodel, "objective", None)
    if not isinstance(objective, str):
        return objective
    if objective == getattr(hypermodel, "objective_name", None):
        return keras_tuner.Objective(objective, hypermodel.direction)
    # trainwell's one rule (Keras's names), then KerasTuner's own inference (mae, mse, ...)
    direction = metric_direction(objective) or infer_metric_direction(objective)
    if direction is None:
        known = [getattr(hypermodel, "objective_name", None) or "val_accuracy", "val_loss", "loss", "accuracy"]
        raise config_error("objective", objective, f"cannot tell whether {objective!r} should go up or down (pass "
                                                   f"keras_tuner.Objective({objective!r}, 'min' or 'max'))",
                           did_you_mean(objective, known))
    return keras_tuner.Objective(objective, direction)


def _checked_search(hypermodel, tuner, max_trials, directory, project_name, overwrite, max_epochs, objective=None):
    """The checked arguments of a search: `(hypermodel, project_dir, epochs)` (`epochs`: Hyperband and PBT's)."""
    if tuner not in TUNERS:
        raise invalid_argument("tuner", f"one of {TUNERS}", tuner)
    if not (is_int(max_trials) and max_trials >= 1):
        raise invalid_argument("max_trials", "an int >= 1", max_trials)
    if max_epochs is not None and not (is_int(max_epochs) and max_epochs >= 1):
        raise invalid_argument("max_epochs", "an int >= 1", max_epochs)
    if is_url(str(directory)):  # `search` stages a URL's project locally; a bare tuner writes local files only
        raise invalid_argument("directory", "a local directory (a URL works with `search()`, which copies the "
                                            "project locally and uploads it)", redact(str(directory)))
    project_name = _project_name(hypermodel, tuner, project_name)
    cfg_epochs = int(getattr(getattr(hypermodel, "cfg", None), "epochs", 0) or 0)
    epochs = None
    if tuner in ("hyperband", "pbt"):
        # Every trial runs the schedule of the search's epochs: the space (a warmup
        # fraction, ...) and its defaults are read from that run, not the config's.
        epochs = max_epochs or cfg_epochs or (4 if tuner == "pbt" else 9)
        if cfg_epochs and epochs != cfg_epochs and hasattr(hypermodel, "config_for"):
            hypermodel = copy.copy(hypermodel)
            hypermodel.cfg = hypermodel.cfg.replace(epochs=epochs)
    project_dir = Path(directory) / project_name
    check_project_config(hypermodel, project_dir, overwrite, write=False, tuner=tuner,
                         objective=resolve_objective(hypermodel, objective))
    return hypermodel, project_dir, epochs


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
    hypermodel, project_dir, epochs = _checked_search(hypermodel, tuner, max_trials, directory, project_name,
                                                      overwrite, max_epochs, objective)
    project_name = project_dir.name
    atomic_keras_tuner_saves()
    recover_interrupted_trials()
    objective = resolve_objective(hypermodel, objective)
    common = dict(
        hypermodel=hypermodel, objective=objective, directory=str(directory), project_name=project_name,
        overwrite=overwrite, seed=seed, hyperparameters=hyperparameters,
        **tuner_kwargs,
    )
    mcf = max_consecutive_failed_trials or MAX_CONSECUTIVE_FAILED_TRIALS
    if tuner == "pbt":
        t = PBTTuner(
            population_size=population_size, ready_interval=ready_interval,
            generations=max(1, math.ceil(epochs / ready_interval)), static_hyperparameters=getattr(hypermodel, "static", ()),
            max_consecutive_failed_trials=max_consecutive_failed_trials, **common,
        )
    elif tuner == "random":
        t = RecipeRandomSearch(max_trials=max_trials, max_consecutive_failed_trials=mcf, **common)
    elif tuner == "bayesian":
        t = RecipeBayesianOptimization(max_trials=max_trials, max_consecutive_failed_trials=mcf, **common)
    else:
        t = RecipeHyperband(max_epochs=epochs, factor=factor, max_consecutive_failed_trials=mcf, **common)
    check_project_config(hypermodel, project_dir, overwrite=True, tuner=tuner,
                         objective=objective)  # records it, now the directory exists
    return t


def search(
    recipe, tuner: str = "random", *, config=None, overrides=None, max_trials: int = 10, directory="tuning",
    project_name=None, overwrite: bool = False, objective=None, max_epochs=None, factor: int = 3,
    population_size: int = 4, ready_interval: int = 1, seed: int | None = 0, hyperparameters=None,
    callbacks=None, top_k: int = 10, export: bool = True, verbose: int = 1, max_consecutive_failed_trials=None,
    **tuner_kwargs,
) -> SearchResult:
    # one piece: a 56-line docstring of its 20 arguments; the body is 37 lines
    """Searches the hyperparameters of a recipe with KerasTuner; summarises and exports.

    Rerunning the same call (`overwrite=False`) on the same directory continues a
    killed search: KerasTuner reloads the oracle, the trials that were running are
    run again, and each resumes from its own last checkpoint. Under KerasTuner's
    distributed mode (`KERASTUNER_TUNER_ID`, `KERASTUNER_ORACLE_IP`,
    `KERASTUNER_ORACLE_PORT`; see `launch_distributed`) the chief serves the oracle
    and writes the summary, and a worker runs trials and returns an empty result.

    A `directory` on an object store (`s3://bucket/tuning`, `gs://...`) holds the
    project as a local directory would: the search runs on a local copy of it
    (KerasTuner writes local files), uploaded after every trial and at the end, so
    a killed search continues from its last finished trial.

    Args:
        recipe: A recipe name (`"resnet-imagenet"`), a recipe module, `"module:factory"`
            or a `RecipeHyperModel`.
        tuner: `"random"`, `"bayesian"`, `"hyperband"` or `"pbt"`. Defaults to `"random"`.
        config: The recipe's base `Config` (or `None` for its defaults). Defaults to `None`.
        overrides: Config fields to change, e.g. `{"dataset": "mnist5k"}`. Defaults to `None`.
        max_trials: Trials of random and Bayesian search (Hyperband sizes its own
            brackets; PBT runs `population_size` x generations trials plus
            replacements). Defaults to `10`.
        directory: Parent directory of the search, or an `s3://`/`gs://` URL.
            Defaults to `"tuning"`.
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
    # TRAINWELL_QUICK: one short trial (PBT: 2 members x 2 epochs); see trainwell/quick.py.
    max_trials, max_epochs, population_size, ready_interval = quick.search_lengths(
        max_trials, max_epochs, population_size, ready_interval)
    hm = resolve_hypermodel(recipe, config, overrides)
    staged = _staged_project(directory, _project_name(hm, tuner, project_name))
    try:
        return _search(hm, tuner, staged, max_trials=max_trials, directory=directory, project_name=project_name,
                       overwrite=overwrite, objective=objective, max_epochs=max_epochs, factor=factor,
                       population_size=population_size, ready_interval=ready_interval, seed=seed,
                       hyperparameters=hyperparameters, callbacks=callbacks, top_k=top_k, export=export,
                       verbose=verbose, max_consecutive_failed_trials=max_consecutive_failed_trials, **tuner_kwargs)
    finally:
        if staged is not None:
            staged.close()


def _staged_project(directory, project_name: str):
    """A local copy of the project of a search whose `directory` is a URL (`None` for a local one)."""
    if not is_url(str(directory)):
        return None
    url = check_url(str(directory), "directory")
    store_for(url).check_bucket("directory")
    if has_chief_oracle():
        raise invalid_argument("directory", "a local or shared directory for a distributed search (a URL is "
                                            "not supported there yet)", redact(url))
    return StagedDirectory(f"{url}/{project_name}")


def _search(hm, tuner, staged, *, max_trials, directory, project_name, overwrite, objective, max_epochs, factor,
            population_size, ready_interval, seed, hyperparameters, callbacks, top_k, export, verbose,
            max_consecutive_failed_trials, **tuner_kwargs) -> SearchResult:
    """`search` after resolving the hypermodel; with `staged`, on that local copy of the project."""
    if staged is not None:
        directory, project_name = staged.path.parent, staged.path.name
    t = make_tuner(
        hm, tuner, max_trials=max_trials, directory=directory, project_name=project_name, overwrite=overwrite,
        objective=objective, max_epochs=max_epochs, factor=factor, population_size=population_size,
        ready_interval=ready_interval, seed=seed, hyperparameters=hyperparameters,
        max_consecutive_failed_trials=max_consecutive_failed_trials, **tuner_kwargs,
    )
    if staged is not None:
        staged.sync()  # the project as the tuner made it (with `overwrite`, the old search's objects go)
        trial_end = t.on_trial_end

        def on_trial_end(trial):  # KerasTuner's per-trial hook: the finished trial goes up
            trial_end(trial)
            staged.sync()

        t.on_trial_end = on_trial_end
    stopped = False
    try:
        t.search(callbacks=list(callbacks or []), verbose=verbose)
    except RuntimeError:
        # KerasTuner's `max_consecutive_failed_trials`: its message holds a traceback.
        if not _stopped_by_failures(t.oracle):
            raise
        stopped = True
    project_dir = Path(t.project_dir)
    if has_chief_oracle() and not is_chief_oracle():
        return SearchResult(t, {}, None, None, [], project_dir, {})
    result = summarize(t, top_k=top_k, export=export, print_table=True, where=staged.where if staged else str)
    if stopped:
        last = t.oracle.trials[t.oracle.end_order[-1]]
        reason = next((r["reason"] for r in result.rows if r["trial_id"] == last.trial_id), "")
        raise SearchFailedError(
            f"The search stopped after {t.oracle.max_consecutive_failed_trials} failed trials in a row "
            f"({result.files.get('summary_json')}); the last one: {reason}"
        )
    return result
