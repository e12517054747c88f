"""trainwell.recipes.harness: the pieces both recipes share (run setup, history, plots)."""

import csv
import dataclasses
import subprocess
import sys
import textwrap
from typing import Optional

import pytest

from trainwell.recipes import harness as recipe
from trainwell.recipes.harness import plot_history, plot_schedule, read_history_csv


@pytest.mark.slow
def test_plots_leave_the_matplotlib_backend_alone(tmp_path):
    # A notebook's inline backend must survive a recipe's plots: `matplotlib.use("Agg")`
    # in library code stopped `plt.show()` from drawing after `train()`.
    code = textwrap.dedent(f"""
        import matplotlib
        matplotlib.use("svg")
        from trainwell.recipes.harness import plot_history, plot_schedule
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


@dataclasses.dataclass
class Cfg:
    run_dir: Optional[str] = None
    strategy: str = "auto"
    precision: str = "float32"
    seed: int = 0
    verbose: int = 1


def _failed_run(run_dir, produce=None):
    """setup_run, then (optionally) some output, then an error before training completes."""
    def train():
        ctx = recipe.setup_run(Cfg(run_dir=None if run_dir is None else str(run_dir)), "resnet-imagenet")
        if produce:
            produce(ctx.run_dir)
        raise RuntimeError("failed before its first step")

    try:
        train()
    except RuntimeError:
        pass  # leaving this block frees train()'s frame, and with it the run's context


def test_a_run_that_fails_before_producing_anything_leaves_no_run_directory(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _failed_run(run_dir, produce=lambda d: (d / "history.csv").touch())  # CSVLogger opens it at on_train_begin
    assert f"Run directory: {run_dir} (new run)" in capsys.readouterr().out  # said at the start
    assert not run_dir.exists()
    # Something the run produced (here a history row) keeps the directory, lock released.
    _failed_run(run_dir, produce=lambda d: (d / "history.csv").write_text("epoch,loss\n0,1.0\n"))
    assert (run_dir / "history.csv").is_file() and (run_dir / "manifest.json").is_file()
    assert not (run_dir / ".trainwell.lock").exists()


def test_op_determinism_lasts_as_long_as_the_run_that_asked_for_it(tmp_path):
    import tensorflow as tf

    from trainwell.compat.tf_internals import disable_op_determinism, op_determinism_enabled

    with recipe.setup_run(Cfg(run_dir=str(tmp_path / "a")), "resnet-imagenet", deterministic=True):
        assert op_determinism_enabled()
    assert not op_determinism_enabled()
    tf.random.uniform([1])  # refused while determinism is on: unseeded
    # A process that turned it on itself keeps it on.
    tf.config.experimental.enable_op_determinism()
    try:
        with recipe.setup_run(Cfg(run_dir=str(tmp_path / "b")), "resnet-imagenet", deterministic=True):
            pass
        assert op_determinism_enabled()
    finally:
        disable_op_determinism()


def test_a_failed_run_removes_the_parent_directories_it_made(tmp_path, monkeypatch):
    # A config error found after the run directory was made (a damaged TFRecord file, say) left
    # `runs/` behind for a default run directory, and `a/b/` for `run_dir=a/b/run`.
    _failed_run(tmp_path / "a" / "b" / "run")
    assert not (tmp_path / "a").exists()
    monkeypatch.chdir(tmp_path)
    _failed_run(None)
    assert not (tmp_path / "runs").exists()
    (tmp_path / "runs" / "other").mkdir(parents=True)  # what existed before is kept
    _failed_run(None)
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["other"]


def test_a_run_that_died_in_a_callback_leaves_its_checkpoints_unlocked(tmp_path):
    """A user's callback raised inside fit: Checkpoint.on_train_end never ran, and its lock of the
    checkpoint directory stayed with the process (a notebook's kernel), so `trainwell resume` from
    a terminal was refused as a second writer. The run's end releases it."""
    from trainwell import rundir

    run_dir = tmp_path / "run"

    def produce(d):
        (d / "history.csv").write_text("epoch,loss\n0,1.0\n")
        (d / "checkpoints").mkdir()
        rundir.lock_run_dir(d / "checkpoints")  # what Checkpoint.on_train_begin takes (flock, re-entrant)

    _failed_run(run_dir, produce=produce)
    other = subprocess.run([sys.executable, "-c", "import sys; from trainwell import rundir; "
                            "rundir.lock_run_dir(sys.argv[1]).release()", str(run_dir / "checkpoints")],
                           capture_output=True, text=True, timeout=120)
    assert other.returncode == 0, other.stderr[-2000:]


def test_rerun_of_a_run_without_checkpoint_says_it_starts_from_scratch(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "manifest.json").write_text("{}")
    stale = run_dir / ".metrics.json.a1b2c3d4.tmp"  # left by a kill during an atomic write
    stale.write_text("{")
    with recipe.setup_run(Cfg(run_dir=str(run_dir)), "resnet-imagenet") as ctx:
        assert ctx.run_dir == run_dir and (run_dir / ".trainwell.lock").is_file()
    out = capsys.readouterr().out
    assert f"Run directory: {run_dir} holds no checkpoint: starting the run from scratch." in out
    assert not stale.exists() and not (run_dir / ".trainwell.lock").exists()
    assert (run_dir / "manifest.json").is_file()  # an existing run directory is never removed


def test_steps_per_execution_default_follows_the_device(monkeypatch):
    # Issue 21: None -> 8 on a GPU/TPU strategy or distribution, 1 on CPUs; a value set is kept.
    from trainwell.compat import devices
    from trainwell.recipes import harness

    assert harness.steps_per_execution(None) == 1  # this machine: CPUs only
    monkeypatch.setattr(devices, "on_accelerator", lambda: True)
    assert harness.steps_per_execution(None) == harness.ACCELERATOR_STEPS_PER_EXECUTION == 8
    assert harness.steps_per_execution(3) == 3


def test_an_epoch_that_trains_no_batch_is_a_one_line_error_before_any_logger_records_it(tmp_path):
    import keras
    import tensorflow as tf

    from trainwell.data import DataError

    # A dataset of unknown length (a filter) with `steps_per_epoch`: Keras keeps one iterator over the
    # epochs, and epoch 2 finds it empty; without the guard it logs a loss of 0 and goes on.
    x = tf.random.stateless_normal([8, 2], seed=[1, 2])
    ds = tf.data.Dataset.from_tensor_slices((x, tf.zeros([8]))).filter(lambda a, b: True).batch(4)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    csv_path = tmp_path / "history.csv"
    callbacks = [recipe.fail_on_empty_epoch(), keras.callbacks.CSVLogger(str(csv_path))]
    with pytest.warns(UserWarning, match="ran out of data"), pytest.raises(DataError) as info:
        model.fit(ds, epochs=3, steps_per_epoch=2, callbacks=callbacks, verbose=0)
    msg = str(info.value)
    assert "\n" not in msg and "Epoch 2 trained no batch" in msg and "2 batches per epoch" in msg
    assert [row["epoch"] for row in csv.DictReader(csv_path.open())] == ["0"]  # no row for the empty epoch
    # Data of the right length trains every epoch through the guard.
    ok = tf.data.Dataset.from_tensor_slices((x, tf.zeros([8]))).batch(4)
    hist = model.fit(ok, epochs=3, steps_per_epoch=2, callbacks=[recipe.fail_on_empty_epoch()], verbose=0)
    assert len(hist.history["loss"]) == 3


def test_standard_callbacks_put_the_empty_epoch_guard_first(tmp_path):
    from trainwell.recipes import resnet_imagenet

    cbs = resnet_imagenet.build_callbacks(resnet_imagenet.Config(), tmp_path)
    assert cbs[0].on_epoch_end.__qualname__.startswith("fail_on_empty_epoch")


def test_both_recipes_announce_their_early_stop_on_the_console(tmp_path):
    # The transformer recipe's early stop was never announced (EarlyStopping(verbose=0)); both recipes'
    # come from `standard_callbacks`, which now prints the stop and the restored epoch unless verbose is 0.
    from trainwell.callbacks import EarlyStopping
    from trainwell.recipes import resnet_imagenet, transformer_finetune

    for module, quiet in ((resnet_imagenet, 0), (transformer_finetune, "0")):
        for verbose, expected in (("auto" if module is resnet_imagenet else "1", 1), (quiet, 0)):
            cfg = module.Config(early_stopping_patience=2, verbose=verbose)
            es = [c for c in module.build_callbacks(cfg, tmp_path) if isinstance(c, EarlyStopping)]
            assert [c.verbose for c in es] == [expected], (module.__name__, verbose)
