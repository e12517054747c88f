"""trainwell.recipe: the pieces both recipes share (history, plots)."""

import csv
import subprocess
import sys
import textwrap

from trainwell.recipe import plot_history, plot_schedule, read_history_csv


def test_plots_leave_the_matplotlib_backend_alone(tmp_path):
    # A notebook's inline backend must survive a recipe's plots: `matplotlib.use("Agg")`
    # in library code stopped `plt.show()` from drawing after `train()`.
    code = textwrap.dedent(f"""
        import matplotlib
        matplotlib.use("svg")
        from trainwell.recipe import plot_history, plot_schedule
        from trainwell.callbacks.schedules import WarmupCosineDecay
        plot_history({{"loss": [1.0, 0.5], "val_loss": [1.2, 0.6]}}, r"{tmp_path}/c.png")
        plot_schedule(WarmupCosineDecay(0.1, 100, 10), 100, r"{tmp_path}/s.png")
        print(matplotlib.get_backend())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "svg"


def test_plot_history_and_schedule_write_pngs(tmp_path):
    from trainwell.callbacks.schedules import WarmupCosineDecay

    p = plot_history({"loss": [1.0, 0.5], "val_loss": [1.2, 0.6], "lr": [0.1, 0.05]}, tmp_path / "c.png")
    q = plot_schedule(WarmupCosineDecay(0.1, 100, 10), 100, tmp_path / "s.png")
    for f in (p, q):
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_history({"lr": [0.1]}, tmp_path / "none.png") is None


def test_read_history_csv_keeps_the_last_row_of_a_replayed_epoch(tmp_path):
    path = tmp_path / "history.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["epoch", "loss"])
        w.writerows([[0, 1.0], [1, 0.8], [1, 0.7], [2, 0.5]])  # epoch 1 replayed after a crash
    assert read_history_csv(path) == {"epoch": [0.0, 1.0, 2.0], "loss": [1.0, 0.7, 0.5]}
