"""The summary of a search: a table (`summary.json`, `summary.csv`, printed), `trials.png`, the best model.

Example:
>>> print(format_table([{"rank": 1, "trial_id": "0", "status": "COMPLETED", "score": 0.9,
...                      "hyperparameters": {"lr": 0.1}}], "val_accuracy"))
rank  trial  status     val_accuracy  lr
1     0      COMPLETED  0.9           0.1
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import re
import warnings
from pathlib import Path
from typing import Any, Sequence

from trainwell import io as tw_io
from trainwell import quick
from trainwell.io import atomic_write_json, atomic_write_text
from trainwell.tuning.pbt import plot_lineage
from trainwell.tuning.tuners import BEST_MODEL_DIR, META_PREFIXES, hp_values


@dataclasses.dataclass
class SearchResult:
    """What `search()` returns.

    Attributes:
        tuner: The KerasTuner tuner (its `oracle` holds every trial).
        best_hyperparameters: Tunable values of the best trial (`{}` if none completed).
        best_trial_id: Its id (`None` if none completed).
        best_score: Its objective value.
        rows: One dict per trial, best first (what `summary.json` holds).
        project_dir: The search's directory (its URL for a search on an object store).
        files: Paths (or URLs) written: `summary_json`, `summary_csv`, `plot`, `lineage_plot`, `best_model`.
        best_config: The best trial's recipe config: the base config with the search
            space's values mapped onto the recipe's fields (`best_hyperparameters` are the
            space's names, e.g. the ResNet recipe's `peak_lr` and `warmup_fraction`; its
            config sets `base_lr` per 256 images and `warmup_epochs`). `recipe.train(result.best_config)`
            trains it. `None` when no trial completed or the hypermodel has no `space`.

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
    project_dir: Path | str
    files: dict
    best_config: Any = None


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
    from matplotlib.ticker import MaxNLocator  # lazy: matplotlib loads only when a plot is drawn

    ordered = sorted(rows, key=lambda r: r["order"])
    xs = [r["order"] for r in ordered if r["score"] is not None]
    ys = [r["score"] for r in ordered if r["score"] is not None]
    fig, axes = tw_io.new_figure(figsize=(6.5, 3.8))
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
    return tw_io.save_figure(fig, path)


def _write_csv(rows: list[dict], objective_name: str, path: Path) -> None:
    """`summary.csv`: one row per trial, a column per hyperparameter any trial has."""
    names: list[str] = []
    for r in rows:
        for k in r["hyperparameters"]:
            if k not in names:
                names.append(k)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["rank", "trial_id", "status", objective_name, *names, "reason"])
    for r in rows:
        w.writerow([r["rank"] or "", r["trial_id"], r["status"], "" if r["score"] is None else r["score"],
                    *[r["hyperparameters"].get(k, "") for k in names], r["reason"]])
    atomic_write_text(path, buf.getvalue())


def _print_summary(summary: dict, objective, top_k: int, files: dict) -> None:
    """The printed summary: counts, the table, failed trials' reasons, the files written."""
    rows = summary["trials"]
    print()
    print(f"Search summary: {summary['num_completed']} completed, {summary['num_failed']} failed "
          f"of {summary['num_trials']} trials ({objective.name}, {objective.direction})"
          + (f"; TRAINWELL_QUICK={summary['quick']} smoke test: the scores mean nothing" if summary["quick"] else ""))
    print(format_table(rows, objective.name, top_k))
    for r in rows:
        if r["status"] in ("FAILED", "INVALID") and r["reason"]:
            print(f"  trial {r['trial_id']} {r['status'].lower()}: {r['reason']}")
    if summary["best"] is None:
        print("No trial completed: no best score, no best model.")
    print("files: " + ", ".join(f"{k}={v}" for k, v in files.items()))


def summarize(tuner, top_k: int = 10, export: bool = True, print_table: bool = True, where=str) -> SearchResult:
    """Prints and saves the summary table, plots the trials and exports the best model.

    Writes `summary.json` and `summary.csv` (one row per trial), `trials.png`,
    `pbt_lineage.png` for PBT, and `best_model/` to the tuner's project directory.

    Args:
        tuner: A KerasTuner tuner after its search. Required.
        top_k: Rows of the printed table. Defaults to `10`.
        export: Export the best trial's model. Defaults to `True`.
        print_table: Print the summary. Defaults to `True`.
        where: How a written path is named in the summary and the result (`str`; a
            search on an object store names its files by their URL). Defaults to `str`.

    Example:
    >>> result = summarize(tuner)  # doctest: +SKIP
    """
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
        # TRAINWELL_QUICK=N: a smoke test whose scores mean nothing (a real search refuses to continue it)
        "quick": quick.caps().batches if quick.caps() is not None else None,
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
    files["summary_json"] = where(project_dir / "summary.json")
    _write_csv(rows, objective.name, project_dir / "summary.csv")
    files["summary_csv"] = where(project_dir / "summary.csv")
    files["plot"] = where(plot_trials(rows, objective.name, project_dir / "trials.png", objective.direction))
    if lineage is not None:
        files["lineage_plot"] = where(plot_lineage(lineage, project_dir / "pbt_lineage.png", objective.name))
    if export and best is not None and hasattr(tuner.hypermodel, "export"):
        trial = oracle.get_trial(best["trial_id"])
        try:
            files["best_model"] = where(
                tuner.hypermodel.export(trial.hyperparameters, tuner.trial_run_dir(trial.trial_id),
                                        project_dir / BEST_MODEL_DIR, objective)
            )
        except NotImplementedError as e:
            warnings.warn(f"Best model not exported: {e}")
    atomic_write_json(project_dir / "summary.json", {**summary, "files": files})
    if print_table:
        _print_summary(summary, objective, top_k, files)
    best_config = None
    hm = getattr(tuner, "hypermodel", None)
    if best is not None and callable(getattr(hm, "space", None)) and hasattr(getattr(hm, "cfg", None), "replace"):
        # the space's values as the recipe's fields, without the trials' own settings (verbose=0, ...)
        best_config = hm.cfg.replace(**hm.space(oracle.get_trial(best["trial_id"]).hyperparameters.copy(), hm.cfg))
    return SearchResult(
        tuner=tuner,
        best_hyperparameters=dict(best["hyperparameters"]) if best else {},
        best_trial_id=best["trial_id"] if best else None,
        best_score=best["score"] if best else None,
        rows=rows,
        project_dir=project_dir if where is str else where(project_dir),
        files=files,
        best_config=best_config,
    )
