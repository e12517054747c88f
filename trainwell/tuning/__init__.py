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
- `launch_distributed()` (in `trainwell.launch`, re-exported here) / `trainwell tune --workers N`:
  starts KerasTuner's chief oracle and N workers on one machine and cleans them up.

The package, one job per module: `tuners` (the mixin, the tuners, trial checkpoints),
`pbt` (population-based training), `search` (`make_tuner`, `search`), `summary` (the
table, plots and best model). KerasTuner's private names and patches are in
`trainwell.compat.keras_tuner`; the hypermodel and the space helpers a recipe uses are
on the recipes' floor (`trainwell.recipes.hypermodel`).

Example:
>>> from trainwell import tuning
>>> result = tuning.search("resnet-imagenet", tuner="random", max_trials=8,
...                        overrides={"dataset": "mnist5k", "epochs": 5, "image_size": 28},
...                        directory="tuning")  # doctest: +SKIP
>>> result.best_hyperparameters  # doctest: +SKIP
"""

from trainwell.compat.keras_tuner import (
    atomic_keras_tuner_saves,
    reconcile_reloaded_trials,
    recover_interrupted_trials,
)
from trainwell.launch import launch_distributed
from trainwell.recipes.hypermodel import RecipeHyperModel, batch_size_choice, log_float, log_range, recipe_hypermodel
from trainwell.tuning.pbt import PBTOracle, PBTTuner, plot_lineage
from trainwell.tuning.search import (
    MAX_CONSECUTIVE_FAILED_TRIALS,
    SEARCH_CONFIG_FILE,
    TUNERS,
    SearchFailedError,
    check_project_config,
    check_search,
    make_tuner,
    resolve_hypermodel,
    resolve_objective,
    search,
)
from trainwell.tuning.summary import SearchResult, format_table, plot_trials, summarize, trial_rows
from trainwell.tuning.tuners import (
    BEST_MODEL_DIR,
    META_PREFIXES,
    RUN_SUBDIR,
    KeepConfiguredLearningRate,
    RecipeBayesianOptimization,
    RecipeHyperband,
    RecipeRandomSearch,
    RecipeTunerMixin,
    copy_checkpoint,
    has_checkpoint,
    hp_values,
    starts_from_copied_checkpoint,
)

__all__ = [
    "BEST_MODEL_DIR", "KeepConfiguredLearningRate", "MAX_CONSECUTIVE_FAILED_TRIALS", "META_PREFIXES", "PBTOracle",
    "PBTTuner", "RUN_SUBDIR", "RecipeBayesianOptimization", "RecipeHyperModel", "RecipeHyperband",
    "RecipeRandomSearch", "RecipeTunerMixin", "SEARCH_CONFIG_FILE", "SearchFailedError", "SearchResult", "TUNERS",
    "atomic_keras_tuner_saves", "batch_size_choice", "check_project_config", "check_search", "copy_checkpoint",
    "format_table", "has_checkpoint", "hp_values", "launch_distributed", "log_float", "log_range", "make_tuner",
    "plot_lineage", "plot_trials", "recipe_hypermodel", "reconcile_reloaded_trials", "recover_interrupted_trials",
    "resolve_hypermodel", "resolve_objective", "search", "starts_from_copied_checkpoint", "summarize", "trial_rows",
]
