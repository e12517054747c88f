"""Population-based training (Jaderberg et al. 2017) as a KerasTuner Oracle and Tuner.

KerasTuner has no population-based training (keras-team/keras-tuner#410). This
module adds it the KerasTuner way: `PBTOracle` extends `keras_tuner.Oracle` and
decides everything (which member trains next, from which checkpoint, with which
hyperparameters); `PBTTuner` extends `keras_tuner.Tuner` (through
`trainwell.tuning.tuners.RecipeTunerMixin`) and only runs what the oracle hands out.

One trial is one *segment* of one member: `ready_interval` epochs of the member's
schedule, started from a checkpoint. The oracle passes its decisions in the
trial's hyperparameter values (as KerasTuner's Hyperband passes `tuner/epochs`):
`pbt/member`, `pbt/generation`, `pbt/initial_epoch`, `pbt/epochs` (the epoch to
stop at), `pbt/parent` (the trial whose checkpoint to start from, `""` for
none), `pbt/donor` (the member exploited, -1 if none) and `pbt/action`
(`start`, `continue`, `exploit`, `replace`, `restart`). Everything the oracle
knows is derived from its trials, which KerasTuner saves one file each and
reloads after a crash, and in distributed mode the oracle lives in the chief:
workers see it only through KerasTuner's `OracleClient` (create_trial /
update_trial / end_trial / get_trial), and the checkpoints through the shared
project directory. Nothing is kept in a worker's memory.

The algorithm, synchronous by generation:

- **Start**: `population_size` members; member 0 starts from the space's
  defaults (the recipe's config), the others from random samples.
- **Ready**: after each segment. A member advances to generation g+1 once every
  member has finished generation g, and is ranked by its objective at g.
- **Exploit** (truncation selection): a member in the bottom
  `truncation_fraction` copies the checkpoint (weights, optimizer state with its
  `iterations` and moment/momentum slots, loss scale, RNG, data position) and
  the hyperparameters of a member drawn from the top `truncation_fraction`.
  Others continue from their own checkpoint with their own hyperparameters.
  The exploiting segment trains at its *explored* learning rate: a plain
  (non-schedule) LR is an optimizer variable, which the copied checkpoint would
  otherwise restore to the donor's (see `RecipeTunerMixin`).
- **Explore**: the copied hyperparameters are each resampled from the space with
  probability `resample_probability`, else perturbed: continuous ones are
  multiplied by a factor drawn from `perturb_factors` (x0.8 or x1.2; for
  log-scaled ones that is a step in log space; a linear one at 0 moves by a
  fraction of its range), integers likewise (by at least 1), clipped to their
  bounds; choices and booleans keep their value unless resampled.
  `static_hyperparameters` (batch size, optimizer) are never explored: an
  exploit takes the donor's unchanged, with the checkpoint made under them.
- **Divergence**: a member whose segment fails (`TrainingDivergedError` ->
  `FailedTrialError`) is replaced at once by an exploit of a top member of the
  previous generation (a restart from new random values in generation 0).

Example:
>>> from trainwell import tuning
>>> result = tuning.search("resnet-imagenet", tuner="pbt", population_size=8, ready_interval=2,
...                        max_epochs=20, overrides={"dataset": "mnist5k"})  # doctest: +SKIP
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import keras_tuner
import numpy as np
from keras_tuner.engine import hyperparameters as hp_types
from keras_tuner.engine.trial import TrialStatus

from trainwell import io as tw_io
from trainwell.compat.keras_tuner import next_oracle_seed, oracle_random_values
from trainwell.tuning.tuners import META_PREFIXES, ModelCache, RecipeTunerMixin, hp_values
from trainwell.validation import invalid_argument, is_int

META_KEYS = ("pbt/member", "pbt/generation", "pbt/initial_epoch", "pbt/epochs", "pbt/parent", "pbt/donor", "pbt/action")


def _check_args(population_size, ready_interval, generations, truncation_fraction, perturb_factors, resample_probability):
    if not (is_int(population_size) and population_size >= 2):
        raise invalid_argument("population_size", "an int >= 2", population_size)
    if not (is_int(ready_interval) and ready_interval >= 1):
        raise invalid_argument("ready_interval", "an int >= 1", ready_interval)
    if not (is_int(generations) and generations >= 1):
        raise invalid_argument("generations", "an int >= 1", generations)
    if not (isinstance(truncation_fraction, (int, float)) and 0 < truncation_fraction <= 0.5):
        raise invalid_argument("truncation_fraction", "a float in (0, 0.5]", truncation_fraction)
    factors = tuple(perturb_factors) if isinstance(perturb_factors, (list, tuple)) else ()
    if not factors or not all(isinstance(f, (int, float)) and f > 0 and f != 1 for f in factors):
        raise invalid_argument("perturb_factors", "a non-empty sequence of positive numbers != 1", perturb_factors)
    if not (isinstance(resample_probability, (int, float)) and 0 <= resample_probability <= 1):
        raise invalid_argument("resample_probability", "a float in [0, 1]", resample_probability)


class PBTOracle(keras_tuner.Oracle):
    """Population-based training as a KerasTuner `Oracle` (KerasTuner has none: keras-team/keras-tuner#410).

    Extends `keras_tuner.Oracle`, which keeps doing the trial bookkeeping, the
    saving and reloading of a search, retries and KerasTuner's distributed
    mode; `populate_space` is where PBT decides (see the module docstring).
    A trial whose values carry `pbt/parent` must start from that trial's
    checkpoint (weights and optimizer state): `PBTTuner` does that.

    Args:
        objective: Metric to optimise (name or `keras_tuner.Objective`).
        population_size: Members trained in parallel (>= 2). Defaults to `4`.
        ready_interval: Epochs per segment between exploit/explore steps.
            Defaults to `1`.
        generations: Segments per member; each member trains
            `generations * ready_interval` epochs. Defaults to `4`.
        truncation_fraction: Share of the population in the bottom (exploits)
            and in the top (donors), at least one member each. Defaults to `0.25`.
        perturb_factors: Factors of a perturbation. Defaults to `(0.8, 1.2)`.
        resample_probability: Probability of resampling a hyperparameter
            instead of perturbing it. Defaults to `0.25`.
        static_hyperparameters: Names never explored: a member keeps them while
            it continues, and an exploit takes the donor's with the donor's
            checkpoint, which was trained with them (e.g. `("batch_size", "optimizer")`).
            Defaults to `()`.
        start_with_defaults: Member 0 starts from the space's defaults.
            Defaults to `True`.
        max_trials: Cap on trials, replacements of diverged segments included.
            Defaults to `None` (2 x `population_size` x `generations`).
        hyperparameters, allow_new_entries, tune_new_entries, seed,
        max_retries_per_trial: As for `keras_tuner.Oracle`.
        max_consecutive_failed_trials: As for `keras_tuner.Oracle`. Defaults to
            `None` (`population_size`: a diverged member is replaced, but a
            generation's worth of failures in a row ends the search).

    Example:
    >>> oracle = PBTOracle(keras_tuner.Objective("val_accuracy", "max"), population_size=4,
    ...                    ready_interval=2, generations=5)  # doctest: +SKIP
    """

    def __init__(
        self, objective=None, population_size=4, ready_interval=1, generations=4, truncation_fraction=0.25,
        perturb_factors=(0.8, 1.2), resample_probability=0.25, static_hyperparameters=(),
        start_with_defaults=True, max_trials=None, hyperparameters=None, allow_new_entries=True,
        tune_new_entries=True, seed=None, max_retries_per_trial=0, max_consecutive_failed_trials=None,
    ):
        _check_args(population_size, ready_interval, generations, truncation_fraction, perturb_factors,
                    resample_probability)
        if max_trials is None:
            max_trials = 2 * population_size * generations
        if not (is_int(max_trials) and max_trials >= population_size * generations):
            raise invalid_argument(
                "max_trials", f"an int >= population_size * generations ({population_size * generations})", max_trials)
        super().__init__(
            objective=objective, max_trials=max_trials, hyperparameters=hyperparameters,
            allow_new_entries=allow_new_entries, tune_new_entries=tune_new_entries, seed=seed,
            max_retries_per_trial=max_retries_per_trial,
            max_consecutive_failed_trials=max_consecutive_failed_trials or population_size,
        )
        self.population_size = int(population_size)
        self.ready_interval = int(ready_interval)
        self.generations = int(generations)
        self.truncation_fraction = float(truncation_fraction)
        self.perturb_factors = tuple(float(f) for f in perturb_factors)
        self.resample_probability = float(resample_probability)
        self.static_hyperparameters = tuple(static_hyperparameters)
        self.start_with_defaults = bool(start_with_defaults)

    # ------------------------------------------------------------ config/state
    def get_config(self) -> dict:
        """The constructor's PBT arguments."""
        return {
            "population_size": self.population_size,
            "ready_interval": self.ready_interval,
            "generations": self.generations,
            "truncation_fraction": self.truncation_fraction,
            "perturb_factors": list(self.perturb_factors),
            "resample_probability": self.resample_probability,
            "static_hyperparameters": list(self.static_hyperparameters),
            "start_with_defaults": self.start_with_defaults,
            "max_trials": self.max_trials,
        }

    def get_state(self):
        # The population itself is derived from the trials, which KerasTuner
        # saves and reloads one file each; the RNG position (`seed_state`) is in
        # the base state. The config is saved to refuse a reload under other
        # PBT settings, and the lineage for readers of oracle.json.
        state = super().get_state()
        state["pbt"] = {"config": self.get_config(), "lineage": self.lineage()}
        return state

    def set_state(self, state):
        super().set_state(state)
        saved = (state.get("pbt") or {}).get("config")
        if saved is not None:
            mine = self.get_config()
            diff = {k: (saved.get(k), mine[k]) for k in ("population_size", "ready_interval", "generations")
                    if saved.get(k) != mine[k]}
            if diff:
                raise ValueError(
                    f"Cannot continue this PBT search with other settings (saved, given): {diff}. "
                    "Use the saved settings, another project name, or overwrite=True."
                )

    # ------------------------------------------------------------ population
    def _members(self) -> dict[int, list]:
        out: dict[int, list] = {}
        order = {tid: i for i, tid in enumerate(self.start_order)}
        for trial in self.trials.values():
            v = trial.hyperparameters.values
            if "pbt/member" in v:
                out.setdefault(int(v["pbt/member"]), []).append(trial)
        for m in out:
            out[m].sort(key=lambda t: (int(t.hyperparameters.values["pbt/generation"]), order.get(t.trial_id, 0)))
        return out

    @staticmethod
    def _gen(trial) -> int:
        return int(trial.hyperparameters.values["pbt/generation"])

    def _completed_at(self, trials, g):
        done = [t for t in trials if self._gen(t) == g and t.status == TrialStatus.COMPLETED and t.score is not None]
        return done[-1] if done else None

    def _rank(self, entries: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        """`(member, trial)` pairs, best first."""
        sign = -1.0 if self.objective.direction == "max" else 1.0
        return sorted(entries, key=lambda e: (sign * float(e[1].score), e[0]))

    def _cut(self) -> int:
        return max(1, int(math.floor(self.population_size * self.truncation_fraction)))

    def _rng(self):
        return np.random.default_rng([int(self.seed), next_oracle_seed(self)])

    def _default_values(self) -> dict:
        hps = self.hyperparameters.copy()
        hps.values = {}
        for hp in self.hyperparameters.space:
            if hps.is_active(hp):
                hps.values[hp.name] = hp.default
        return dict(hps.values)

    def explore(self, values: dict, rng) -> dict:
        """Perturbs or resamples each tunable value of a donor (see the module docstring).

        Example:
        >>> new = oracle.explore({"peak_lr": 0.1}, np.random.default_rng(0))  # doctest: +SKIP
        """
        out = {}
        for hp in self.hyperparameters.space:
            name = hp.name
            if name not in values or name.startswith(META_PREFIXES):
                continue
            v = values[name]
            if name in self.static_hyperparameters or isinstance(hp, hp_types.Fixed):
                out[name] = v
            elif rng.random() < self.resample_probability:
                out[name] = hp.random_sample(int(rng.integers(0, 2**31 - 1)))
            elif isinstance(hp, (hp_types.Float, hp_types.Int)):
                out[name] = self._perturb(hp, v, float(rng.choice(self.perturb_factors)))
            else:
                out[name] = v
        return out

    def _perturb(self, hp, value, factor: float):
        lo, hi = float(hp.min_value), float(hp.max_value)
        v = float(value)
        if getattr(hp, "sampling", "linear") in ("log", "reverse_log") and v > 0:
            new = math.exp(math.log(v) + math.log(factor))  # = v * factor: a step in log space
        elif v != 0:
            new = v * factor
        else:  # a linear value at 0 cannot be scaled: move by a fraction of the range
            new = v + (factor - 1.0) * 0.1 * (hi - lo)
        new = min(max(new, lo), hi)
        step = getattr(hp, "step", None)
        if isinstance(hp, hp_types.Int):
            n = int(round(new))
            if n == int(value):
                n = int(value) + (1 if factor > 1 else -1)
            if step and getattr(hp, "sampling", "linear") == "linear":
                n = int(hp.min_value + round((n - hp.min_value) / step) * step)
            return int(min(max(n, hp.min_value), hp.max_value))
        if step and getattr(hp, "sampling", "linear") == "linear":
            new = lo + round((new - lo) / step) * step
            new = min(max(new, lo), hi)
        return float(new)

    def _meta(self, member, generation, parent, donor, action) -> dict:
        return {
            "pbt/member": int(member),
            "pbt/generation": int(generation),
            "pbt/initial_epoch": int(generation * self.ready_interval),
            "pbt/epochs": int((generation + 1) * self.ready_interval),
            "pbt/parent": str(parent or ""),
            "pbt/donor": int(donor),
            "pbt/action": action,
        }

    def _sample(self) -> dict:
        values = oracle_random_values(self)
        if values is None:  # the space is small: allow a repeat
            rng = self._rng()
            values = {hp.name: hp.random_sample(int(rng.integers(0, 2**31 - 1))) for hp in self.hyperparameters.space}
        return values

    def populate_space(self, trial_id):
        members = self._members()
        # Start the population.
        if len(members) < self.population_size:
            m = len(members)
            values = self._default_values() if (m == 0 and self.start_with_defaults) else self._sample()
            return {"status": TrialStatus.RUNNING, "values": {**values, **self._meta(m, 0, "", -1, "start")}}
        latest = {m: ts[-1] for m, ts in members.items()}
        busy = {m for m, t in latest.items() if t.status in (TrialStatus.RUNNING, TrialStatus.IDLE)
                or any(o.trial_id == t.trial_id for o in self.ongoing_trials.values())}
        # A member whose segment failed is replaced at once.
        failed = sorted(
            (m for m, t in latest.items() if m not in busy and t.status in (TrialStatus.FAILED, TrialStatus.INVALID)),
            key=lambda m: (self._gen(latest[m]), m),
        )
        for m in failed:
            g = self._gen(latest[m])
            if g == 0:
                return {"status": TrialStatus.RUNNING,
                        "values": {**self._sample(), **self._meta(m, 0, "", -1, "restart")}}
            pool = [(o, self._completed_at(ts, g - 1)) for o, ts in members.items() if o != m]
            pool = [e for e in pool if e[1] is not None] or [
                (o, self._completed_at(ts, g - 1)) for o, ts in members.items() if self._completed_at(ts, g - 1)
            ]
            if not pool:
                continue
            top = self._rank(pool)[: self._cut()]
            rng = self._rng()
            donor, donor_trial = top[int(rng.integers(0, len(top)))]
            values = self.explore(hp_values(donor_trial.hyperparameters), rng)
            return {"status": TrialStatus.RUNNING,
                    "values": {**values, **self._meta(m, g, donor_trial.trial_id, donor, "replace")}}
        # Advance the members of the lowest finished generation (a barrier per generation).
        done = {m: max((self._gen(t) for t in ts if t.status == TrialStatus.COMPLETED), default=-1)
                for m, ts in members.items()}
        if all(d >= self.generations - 1 for d in done.values()) and not busy:
            return {"status": TrialStatus.STOPPED}
        floor = min(done.values())
        candidates = [m for m in sorted(members) if m not in busy and done[m] == floor
                      and latest[m].status == TrialStatus.COMPLETED and self._gen(latest[m]) == floor
                      and floor < self.generations - 1]
        if floor < 0 or not candidates:
            return {"status": TrialStatus.IDLE}
        m = candidates[0]
        ranked = self._rank([(o, self._completed_at(ts, floor)) for o, ts in members.items()])
        cut = self._cut()
        bottom = {o for o, _ in ranked[-cut:]}
        own = self._completed_at(members[m], floor)
        if m in bottom:
            rng = self._rng()
            donor, donor_trial = ranked[: cut][int(rng.integers(0, cut))]
            values = self.explore(hp_values(donor_trial.hyperparameters), rng)
            meta = self._meta(m, floor + 1, donor_trial.trial_id, donor, "exploit")
        else:
            values = hp_values(own.hyperparameters)
            meta = self._meta(m, floor + 1, own.trial_id, -1, "continue")
        return {"status": TrialStatus.RUNNING, "values": {**values, **meta}}

    def lineage(self) -> list[dict]:
        """One record per segment: member, generation, epochs, action, parent, donor, values, score.

        Example:
        >>> for rec in oracle.lineage(): print(rec["member"], rec["generation"], rec["action"])  # doctest: +SKIP
        """
        out = []
        order = {tid: i for i, tid in enumerate(self.start_order)}
        for trial in sorted(self.trials.values(), key=lambda t: order.get(t.trial_id, 0)):
            v = trial.hyperparameters.values
            if "pbt/member" not in v:
                continue
            score = trial.score
            out.append({
                "trial_id": trial.trial_id,
                "member": int(v["pbt/member"]),
                "generation": int(v["pbt/generation"]),
                "initial_epoch": int(v["pbt/initial_epoch"]),
                "epochs": int(v["pbt/epochs"]),
                "action": v["pbt/action"],
                "parent": v["pbt/parent"] or None,
                "donor": int(v["pbt/donor"]) if int(v["pbt/donor"]) >= 0 else None,
                "hyperparameters": hp_values(trial.hyperparameters),
                "status": str(getattr(trial.status, "value", trial.status)),
                "score": None if score is None or not math.isfinite(float(score)) else float(score),
            })
        return out


class PBTTuner(RecipeTunerMixin, keras_tuner.Tuner):
    """Population-based training of a `RecipeHyperModel`: a KerasTuner `Tuner` with a `PBTOracle`.

    Extends `keras_tuner.Tuner` through `trainwell.tuning.RecipeTunerMixin`:
    a trial is one segment; it starts from a copy of the `pbt/parent` trial's
    checkpoint (trainwell's `Checkpoint` restores weights and optimizer state,
    `iterations` and slots included, but not a plain learning-rate variable of
    a parent with other values: the trial keeps its own) and runs the recipe's schedule of
    `generations * ready_interval` epochs up to `pbt/epochs`. The score is the
    objective at the segment's last epoch (PBT ranks members as they are now),
    and early stopping is off (PBT decides). A member's compiled model is kept
    between its segments (`reuse_models`), so a generation costs about what
    its epochs cost in one `fit`, not a new trace per segment. Works under
    KerasTuner's distributed mode like any Tuner; the oracle stays in the chief
    (each worker keeps the models of the segments it ran).

    Args:
        hypermodel: A `RecipeHyperModel`.
        objective: Metric to optimise. Defaults to the hypermodel's.
        population_size, ready_interval, generations, truncation_fraction,
        perturb_factors, resample_probability, static_hyperparameters,
        start_with_defaults, max_trials, seed, hyperparameters, tune_new_entries,
        allow_new_entries, max_retries_per_trial, max_consecutive_failed_trials: See `PBTOracle`.
        reuse_models: Keep each member's compiled model between its segments
            and restore the checkpoint into it, instead of building and tracing
            a new one per segment (`trainwell.tuning.tuners.ModelCache`: a new
            model only when a hyperparameter changes the graph). Holds up to
            `population_size` models in memory per process; `False` frees each
            after its segment. Defaults to `True`.
        **kwargs: `keras_tuner.Tuner` arguments (`directory`, `project_name`,
            `overwrite`, ...).

    Example:
    >>> tuner = PBTTuner(resnet_imagenet.hypermodel(dataset="digits"), population_size=4,
    ...                  ready_interval=1, generations=6, directory="tuning")  # doctest: +SKIP
    >>> tuner.search()  # doctest: +SKIP
    """

    score_mode = "last"
    trial_early_stopping = False

    def __init__(
        self, hypermodel, objective=None, population_size=4, ready_interval=1, generations=4,
        truncation_fraction=0.25, perturb_factors=(0.8, 1.2), resample_probability=0.25,
        static_hyperparameters=None, start_with_defaults=True, max_trials=None, seed=None,
        hyperparameters=None, max_retries_per_trial=0, max_consecutive_failed_trials=None,
        tune_new_entries=True, allow_new_entries=True, reuse_models=True, **kwargs,
    ):
        if not isinstance(reuse_models, bool):
            raise invalid_argument("reuse_models", "a bool", reuse_models)
        if static_hyperparameters is None:
            static_hyperparameters = getattr(hypermodel, "static", ())
        oracle = PBTOracle(
            objective=objective or getattr(hypermodel, "objective", None), population_size=population_size,
            ready_interval=ready_interval, generations=generations, truncation_fraction=truncation_fraction,
            perturb_factors=perturb_factors, resample_probability=resample_probability,
            static_hyperparameters=static_hyperparameters, start_with_defaults=start_with_defaults,
            max_trials=max_trials, seed=seed, hyperparameters=hyperparameters,
            max_retries_per_trial=max_retries_per_trial,
            max_consecutive_failed_trials=max_consecutive_failed_trials,
            tune_new_entries=tune_new_entries, allow_new_entries=allow_new_entries,
        )
        super().__init__(oracle=oracle, hypermodel=hypermodel, **kwargs)
        self.schedule_epochs = int(generations) * int(ready_interval)
        self.model_cache = ModelCache() if reuse_models else None


def plot_lineage(lineage: Sequence[dict], path, objective_name: str = "score"):
    """PBT lineage: each member's hyperparameters and score over epochs, exploits dashed.

    One panel per numeric hyperparameter that differs between segments plus one for
    the objective; x is the epoch at the end of a segment (integer ticks), one colour
    per member; a dashed line joins a donor's point to the exploiting member's next
    point, an x marks a failed segment.

    Example:
    >>> plot_lineage(oracle.lineage(), "tuning/p/pbt_lineage.png", "val_accuracy")  # doctest: +SKIP
    """
    # lazy: matplotlib loads only when a plot is drawn
    from matplotlib import colormaps
    from matplotlib.ticker import MaxNLocator

    names: list[str] = []
    for rec in lineage:
        for k, v in rec["hyperparameters"].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in names:
                names.append(k)
    # A value no member ever changed (a fixed batch size) would be a flat panel.
    names = [k for k in names if len({rec["hyperparameters"].get(k) for rec in lineage}) > 1]
    panels = names + [objective_name]
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = tw_io.new_figure(rows, cols, figsize=(4.6 * cols, 3.2 * rows))
    by_id = {rec["trial_id"]: rec for rec in lineage}
    members = sorted({rec["member"] for rec in lineage})
    cmap = colormaps["tab10"]
    for i, name in enumerate(panels):
        ax = axes[i // cols][i % cols]
        for m in members:
            recs = [r for r in lineage if r["member"] == m and r["status"] == "COMPLETED"]
            ys = [r["score"] if name == objective_name else r["hyperparameters"].get(name) for r in recs]
            pts = [(r["epochs"], y) for r, y in zip(recs, ys) if y is not None]
            if pts:
                ax.plot(*zip(*pts), "o-", color=cmap(m % 10), label=f"member {m}", ms=3)
            for r in lineage:
                if r["member"] == m and r["status"] != "COMPLETED":
                    y = r["hyperparameters"].get(name) if name != objective_name else None
                    if y is not None:
                        ax.plot([r["epochs"]], [y], "x", color=cmap(m % 10))
        for r in lineage:
            if r["action"] in ("exploit", "replace") and r["parent"] in by_id and r["status"] == "COMPLETED":
                p = by_id[r["parent"]]
                y0 = p["score"] if name == objective_name else p["hyperparameters"].get(name)
                y1 = r["score"] if name == objective_name else r["hyperparameters"].get(name)
                if y0 is not None and y1 is not None:
                    ax.plot([p["epochs"], r["epochs"]], [y0, y1], "--", color=cmap(r["member"] % 10), lw=0.8)
        if name != objective_name and name in ("peak_lr", "learning_rate", "weight_decay") or name.endswith("_lr"):
            ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        ax.grid(alpha=0.3)
    for j in range(len(panels), rows * cols):
        axes[j // cols][j % cols].axis("off")
    if axes[0][0].get_legend_handles_labels()[0]:  # no member completed a segment: nothing to name
        axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return tw_io.save_figure(fig, Path(path))
