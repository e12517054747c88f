"""The notebooks in notebooks/ run top to bottom in a fresh kernel, and are committed with their outputs.

Each notebook is executed with nbclient (kernel "python3": jupyter_client runs it with this
interpreter, `sys.executable`) on a COPY in a temporary working directory; the committed file is
never rewritten. A cell that raises fails the test with the cell's source and the error. The
notebooks write their runs to temporary directories, never next to themselves.

The kernel runs with `TRAINWELL_QUICK=2` (trainwell/quick.py, the documented smoke-run switch:
every recipe run, search and LR-finder run, and a plain `fit` given `quick.run_callbacks()`, stops
after 2 batches): every cell runs against the current API at a fraction of the cost, and the
committed outputs come from full runs. `01_quickstart` runs in full: its story is a run that
crashes in epoch 3 and resumes, and a smoke run ends in epoch 1.

`test_committed_notebooks_have_outputs_and_no_errors` is the cheap check (no kernel): every
committed notebook has been executed, in order, with outputs and without error outputs.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = int(os.environ.get("TRAINWELL_NB_CELL_TIMEOUT", "600"))  # per cell
KERNEL_ARGS = ["--IPKernelApp.capture_fd_output=False"]  # TensorFlow's C++ start-up lines stay in the log
QUICK = "2"
FULL = {"01_quickstart"}  # needs 3 epochs (see the module docstring)


def _ids(paths):
    return [p.stem for p in paths]


def test_notebooks_exist():
    assert NOTEBOOKS, f"no notebooks in {NOTEBOOKS_DIR}"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_runs(path, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    copy = work / path.name
    shutil.copy(path, copy)  # execute a copy: the committed notebook is never rewritten
    nb = nbformat.read(copy, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    env_tmp = tmp_path / "tmp"  # notebooks' tempfile.mkdtemp() lands under the test's tmp_path
    env_tmp.mkdir()
    old = {k: os.environ.get(k) for k in ("TMPDIR", "HF_HUB_OFFLINE", "TF_CPP_MIN_LOG_LEVEL", "MPLBACKEND",
                                          "TRAINWELL_QUICK")}
    os.environ.update(TMPDIR=str(env_tmp), HF_HUB_OFFLINE="1", TF_CPP_MIN_LOG_LEVEL="2")
    os.environ.pop("TRAINWELL_QUICK", None)
    if path.stem not in FULL:
        os.environ["TRAINWELL_QUICK"] = QUICK
    os.environ.pop("MPLBACKEND", None)  # the kernel picks matplotlib's inline backend itself
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", extra_arguments=KERNEL_ARGS,
        resources={"metadata": {"path": str(work)}},
    )
    t0 = time.perf_counter()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name}: a cell raised.\n{e}", pytrace=False)
    except nbclient.exceptions.CellTimeoutError as e:
        pytest.fail(f"{path.name}: a cell ran longer than {CELL_TIMEOUT_S} s.\n{e}", pytrace=False)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(env_tmp, ignore_errors=True)  # run directories (03's checkpoints are ~100s of MB)
    print(f"{path.name}: executed in {time.perf_counter() - t0:.1f} s with {sys.executable}")
    # Nothing was written next to the notebook (runs go to temporary directories).
    assert sorted(p.name for p in work.iterdir()) == [path.name]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_committed_notebooks_have_outputs_and_no_errors(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{path.name} has no code cells"
    assert any(c.cell_type == "markdown" for c in nb.cells), f"{path.name} has no prose"
    counts = [c.execution_count for c in code if c.source.strip()]
    assert all(n is not None for n in counts), f"{path.name}: some code cells were never executed"
    assert counts == sorted(counts), f"{path.name}: cells were executed out of order: {counts}"
    with_output = [c for c in code if c.outputs]
    assert len(with_output) >= len(code) // 2, f"{path.name}: most code cells have no output (not executed?)"
    assert any(
        o.get("output_type") in ("display_data", "execute_result") and "image/png" in o.get("data", {})
        for c in code for o in c.outputs
    ), f"{path.name}: no plot in the outputs"
    errors = [
        (c.source.splitlines()[0] if c.source else "", o.get("ename"), o.get("evalue"))
        for c in code for o in c.outputs if o.get("output_type") == "error"
    ]
    assert not errors, f"{path.name}: error outputs committed: {errors}"
    size = path.stat().st_size
    assert size < 1_500_000, f"{path.name} is {size:,} bytes; keep figures small (dpi ~80) and outputs short"
