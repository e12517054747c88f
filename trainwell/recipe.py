"""What every recipe shares: setting up a run, the standard callbacks, the result.

A recipe module (`trainwell.recipes.resnet_imagenet`, ...) reads top to bottom:
its `Config`, then `build_data`, `build_model`, `build_optimizer`,
`build_callbacks` and `train`. The parts that are the same for every recipe live
here, so both recipes build runs, callbacks and `RunResult`s in one place.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
from pathlib import Path
from typing import Any

from trainwell import runtime
from trainwell.io import atomic_write_json


@dataclasses.dataclass
class RunResult:
    """What a recipe's `train()` returns.

    Attributes:
        model: The trained `keras.Model` (best weights when early stopping restored them).
        history: Per-epoch metrics of the whole run, including epochs trained before
            a resume (read back from `history.csv`), as `{name: [values]}`.
        metrics: Metrics on the held-out test split, e.g. `{"test_accuracy": 0.99}`.
        run_dir: The run directory (config, manifest, checkpoints, logs, plots).
        config: The resolved config.

    Example:
    >>> run = RunResult(model=None, history={}, metrics={"test_accuracy": 0.9}, run_dir=Path("."), config=None)
    >>> run.metrics["test_accuracy"]
    0.9
    """

    model: Any
    history: dict[str, list[float]]
    metrics: dict[str, float]
    run_dir: Path
    config: Any = None


@dataclasses.dataclass
class RunContext:
    """The runtime of one run: strategy, precision policy, run directory, chief flag.

    Example:
    >>> ctx = setup_run(cfg, "resnet-imagenet")  # doctest: +SKIP
    >>> with ctx.strategy.scope():  # doctest: +SKIP
    ...     model = build_model(cfg)
    """

    strategy: Any
    precision: str
    run_dir: Path
    is_chief: bool = True

    @property
    def num_replicas(self) -> int:
        return runtime.num_replicas(self.strategy)


def setup_run(cfg, recipe: str, deterministic: bool | None = None) -> RunContext:
    """Strategy, precision, seeds, run directory and manifest for `cfg`.

    The strategy comes first: `"cpu:N"` must split the CPU before any TensorFlow op.

    Args:
        cfg: A recipe config (`trainwell.config.BaseConfig` subclass).
        recipe: The recipe's command-line name (recorded in the manifest so
            `trainwell resume RUN_DIR` knows what to run).
        deterministic: Enable op determinism. Defaults to `cfg.deterministic` if the
            config has that field, else `False`.

    Returns:
        A `RunContext`.

    Example:
    >>> ctx = setup_run(Config(epochs=1), "resnet-imagenet")  # doctest: +SKIP
    """
    strategy = runtime.make_strategy(cfg.strategy)
    precision = runtime.set_precision(cfg.precision)
    if deterministic is None:
        deterministic = bool(getattr(cfg, "deterministic", False))
    runtime.seed_everything(cfg.seed, deterministic=deterministic)
    chief = runtime.is_chief(strategy)
    run_dir = runtime.make_run_dir(cfg.run_dir, prefix=recipe)
    if cfg.run_dir is None:
        cfg.run_dir = str(run_dir)
    if chief:
        runtime.write_manifest(
            run_dir, cfg, strategy=strategy, precision=precision, seed=cfg.seed, recipe=recipe
        )
    return RunContext(strategy=strategy, precision=precision, run_dir=run_dir, is_chief=chief)


def read_history_csv(path: str | os.PathLike) -> dict[str, list[float]]:
    """Reads a Keras `CSVLogger` file into `{column: [floats]}` ({} if missing).

    Example:
    >>> read_history_csv("missing.csv")
    {}
    """
    path = Path(path)
    if not path.is_file():
        return {}
    out: dict[str, list[float]] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if k is None:
                    continue
                try:
                    out.setdefault(k, []).append(float(v))
                except (TypeError, ValueError):
                    out.setdefault(k, []).append(math.nan)
    return out


def plot_history(history: dict[str, list[float]], path: str | os.PathLike) -> Path | None:
    """Plots loss and metric curves (train vs validation) to a PNG.

    Args:
        history: `{name: [per-epoch values]}`; `val_` pairs share a panel.
        path: Output PNG path.

    Returns:
        The path, or None when there is nothing to plot.

    Example:
    >>> plot_history({"loss": [1.0, 0.5], "val_loss": [1.1, 0.7]}, "/tmp/curves.png")  # doctest: +SKIP
    """
    names = [k for k in history if not k.startswith("val_") and k not in ("epoch", "lr", "learning_rate")]
    names = [k for k in names if history.get(k)]
    if not names:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.5), squeeze=False)
    for ax, k in zip(axes[0], names):
        epochs = range(1, len(history[k]) + 1)
        ax.plot(epochs, history[k], label=f"train {k}")
        if history.get(f"val_{k}"):
            ax.plot(range(1, len(history[f"val_{k}"]) + 1), history[f"val_{k}"], label=f"val {k}")
        ax.set_xlabel("epoch")
        ax.set_title(k)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def finish_run(ctx: RunContext, cfg, model, test_metrics: dict[str, float], history=None) -> RunResult:
    """Writes `metrics.json` and `curves.png` (chief only) and returns the `RunResult`.

    Example:
    >>> run = finish_run(ctx, cfg, model, {"test_accuracy": 0.99})  # doctest: +SKIP
    """
    full = read_history_csv(ctx.run_dir / "history.csv")
    if not full and history is not None:
        full = {k: [float(x) for x in v] for k, v in history.history.items()}
    metrics = {k: float(v) for k, v in test_metrics.items()}
    if ctx.is_chief:
        atomic_write_json(ctx.run_dir / "metrics.json", metrics)
        plot_history(full, ctx.run_dir / "curves.png")
    return RunResult(model=model, history=full, metrics=metrics, run_dir=ctx.run_dir, config=cfg)
