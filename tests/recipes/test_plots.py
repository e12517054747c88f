"""Plots a reader can read (issue 18): curves of a short run, the trials of a search, the PBT lineage."""

import pytest


@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions save, kept open for inspection."""
    from trainwell import io
    from trainwell.recipes import harness as recipe

    saved = []
    original = io.save_figure

    def keep(fig, path):
        fig.canvas.draw()
        saved.append(fig)
        return original(fig, path)

    monkeypatch.setattr(io, "save_figure", keep)
    monkeypatch.setattr(recipe, "save_figure", keep)
    return saved


def _integer_ticks(ax) -> bool:
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
    return bool(ticks) and all(float(t).is_integer() for t in ticks)


def test_curves_of_a_one_epoch_run_have_markers_no_empty_panel_and_integer_epochs(tmp_path, figures):
    from trainwell.recipes.harness import plot_history

    history = {"epoch": [0.0], "accuracy": [0.4], "loss": [1.8], "lr": [0.08], "learning_rate": [0.08],
               "nan_rollbacks": [0.0], "val_accuracy": [0.5], "val_loss": [1.5]}
    assert plot_history(history, tmp_path / "curves.png").stat().st_size > 1000
    axes = figures[0].axes
    assert [ax.get_title() for ax in axes] == ["accuracy", "loss"]  # no flat nan_rollbacks panel, no LR
    assert all(line.get_marker() == "o" for ax in axes for line in ax.get_lines())  # one point is visible
    assert all(_integer_ticks(ax) for ax in axes)
    # a rollback that happened is shown
    plot_history({**history, "nan_rollbacks": [1.0]}, tmp_path / "c2.png")
    assert [ax.get_title() for ax in figures[1].axes] == ["accuracy", "loss", "nan_rollbacks"]


def test_trials_and_lineage_have_integer_axes(tmp_path, figures):
    from trainwell.tuning.pbt import plot_lineage
    from trainwell.tuning import plot_trials

    rows = [{"order": i, "score": s, "status": "COMPLETED"} for i, s in enumerate([0.5, 0.7, 0.6])]
    plot_trials(rows, "val_accuracy", tmp_path / "trials.png")
    assert _integer_ticks(figures[0].axes[0])
    lineage = [{"trial_id": f"{i}", "member": i % 2, "generation": i // 2, "epochs": i // 2 + 1, "action": "start",
                "parent": None, "donor": None, "hyperparameters": {"peak_lr": 0.1 * (i + 1), "batch_size": 64},
                "status": "COMPLETED", "score": 0.5 + 0.1 * i} for i in range(4)]
    plot_lineage(lineage, tmp_path / "lineage.png", "val_accuracy")
    shown = [ax for ax in figures[1].axes if ax.axison]
    assert [ax.get_title() for ax in shown] == ["peak_lr", "val_accuracy"]  # no flat batch_size panel
    assert all(_integer_ticks(ax) for ax in shown)
