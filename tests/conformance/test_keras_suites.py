"""Keras's own tests, run against trainwell's callbacks and schedules.

The Keras wheel ships its test files. This module loads seven of them from the
installed package (located through `keras.__file__`; nothing is copied into this
repository), puts trainwell's class in place of the Keras class each one tests,
and hands their `TestCase` classes to pytest with Keras's assertions unchanged
(paths under `keras/src/`):

- `callbacks/early_stopping_test.py`: `EarlyStopping` -> trainwell's `EarlyStopping`;
- `callbacks/backup_and_restore_test.py`: `BackupAndRestore` -> `Checkpoint`;
- `callbacks/terminate_on_nan_test.py`: `TerminateOnNaN` -> `NaNRollback`, and
  `BackupAndRestore` -> `Checkpoint`;
- `callbacks/reduce_lr_on_plateau_test.py`: Keras's `ReduceLROnPlateau` alongside
  trainwell's stateful callbacks (below);
- `optimizers/schedules/learning_rate_schedule_test.py`, `CosineDecayTest` only:
  `CosineDecay` -> `WarmupCosineDecay`;
- `callbacks/tensorboard_test.py`: `TensorBoard` -> trainwell's `TensorBoard`;
- `losses/losses_test.py`, `CategoricalCrossentropyTest` only: `CategoricalCrossentropy`
  -> trainwell's (`trainwell.losses`, its label smoothing in a variable).

Adapters translate argument names only (below, one per Keras name). The
`BackupAndRestore` adapter also answers the private attributes Keras's tests
read (`_current_epoch` and the backup's file paths) from `Checkpoint`'s
committed checkpoints, i.e. from what a resume would load.

ReduceLROnPlateau has no trainwell counterpart; what a user needs is that it
keeps working next to trainwell's callbacks. So its tests run with Keras's
`ReduceLROnPlateau` and trainwell's `Checkpoint`, `NaNRollback` and
`EarlyStopping` attached to every `fit` (the module's `Sequential` is a
subclass that appends them), and the test that an optimizer on a schedule
refuses a new LR uses trainwell's `WarmupLinearDecay` for Keras's
`PolynomialDecay`: Keras refuses it with the same `TypeError`, as it refuses
any `LearningRateSchedule`. To lower a scheduled LR, use the schedule's
multiplier (`trainwell.callbacks.scale_learning_rate`), as `NaNRollback` does.

Where trainwell deliberately differs, the test is listed once in `DEVIATIONS`
(with the reason) and deselected by `conftest.py`; a Keras test that fails on a
trainwell defect being fixed elsewhere is a strict xfail in the same list. A
missing file, class or patched name is a failing test
(`test_keras_ships_the_tests`), and every other test must construct trainwell's
class at least once (checked after it), so a Keras release that moves things
cannot quietly test Keras against itself.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import shutil
import sys
import tempfile
import textwrap
import types
from pathlib import Path

import keras
import numpy as np
import pytest

from trainwell.callbacks.checkpoint import ARRAYS_FILE, STATE_FILE, Checkpoint
from trainwell.callbacks.early_stopping import EarlyStopping
from trainwell.callbacks.nan_rollback import NaNRollback
from trainwell.callbacks.schedules import WarmupCosineDecay, WarmupLinearDecay
from trainwell.callbacks.tensorboard import TensorBoard
from trainwell.losses import CategoricalCrossentropy

KERAS_SRC = Path(keras.__file__).resolve().parent / "src"


# --------------------------------------------------------------------------- adapters
class BackupAndRestore(Checkpoint):
    """Keras's `BackupAndRestore` arguments on `Checkpoint`.

    `backup_dir` -> `directory`, `save_freq` -> `save_every`,
    `double_checkpoint=True` -> `keep_last=2` (else 1). `delete_checkpoint` has
    no counterpart: `Checkpoint` keeps its checkpoints (see DEVIATIONS).
    """

    def __init__(self, backup_dir, save_freq="epoch", double_checkpoint=False, delete_checkpoint=True):
        super().__init__(backup_dir, save_every=save_freq, keep_last=2 if double_checkpoint else 1, keep_best=0)

    # What Keras's tests read from BackupAndRestore's private attributes, answered
    # from the committed checkpoints: the newest (and the one before it).
    def _committed(self, back: int) -> dict | None:
        entries = self.checkpoints
        return entries[-back] if len(entries) >= back else None

    def _file(self, back: int, name: str) -> str:
        entry = self._committed(back)
        return str(Path(entry["path"]) / name) if entry else str(Path(self.directory) / f"<no checkpoint {back}>")

    @property
    def _current_epoch(self) -> int:
        entry = self._committed(1)
        return int(entry["epoch"]) if entry else 0

    _weights_path = property(lambda self: self._file(1, ARRAYS_FILE))
    _training_metadata_path = property(lambda self: self._file(1, STATE_FILE))
    _prev_weights_path = property(lambda self: self._file(2, ARRAYS_FILE))
    _prev_training_metadata_path = property(lambda self: self._file(2, STATE_FILE))


def TerminateOnNaN(raise_error=False):
    """What a user puts in place of `TerminateOnNaN`: `NaNRollback()`.

    `raise_error=True` (stop with an error at the first NaN) is
    `NaNRollback(max_rollbacks=0)`, which raises at the first divergence.
    """
    return NaNRollback(max_rollbacks=0) if raise_error else NaNRollback()


def CosineDecay(initial_learning_rate, decay_steps, alpha=0.0, name="CosineDecay", warmup_target=None,
                warmup_steps=0):
    """Keras's `CosineDecay` arguments on `WarmupCosineDecay` (its docstring gives the mapping).

    `name` (a name scope in Keras) has no counterpart. Without `warmup_target`
    Keras ignores `warmup_steps`, and so does this.
    """
    if warmup_target is None:
        return WarmupCosineDecay(initial_learning_rate, decay_steps, min_lr=alpha * initial_learning_rate)
    return WarmupCosineDecay(
        warmup_target, warmup_steps + decay_steps, warmup_steps=warmup_steps,
        min_lr=alpha * warmup_target, warmup_start=initial_learning_rate,
    )


def PolynomialDecay(initial_learning_rate, decay_steps, end_learning_rate=0.0001, power=1.0, cycle=False,
                    name="PolynomialDecay"):
    """Keras's linear `PolynomialDecay` (power 1, no cycle) on `WarmupLinearDecay`."""
    if power != 1.0 or cycle:
        raise NotImplementedError("Only the linear PolynomialDecay has a trainwell counterpart (WarmupLinearDecay).")
    return WarmupLinearDecay(initial_learning_rate, decay_steps, min_lr=end_learning_rate)


class SequentialWithTrainwell(keras.Sequential):
    """A `Sequential` whose every `fit` also runs trainwell's stateful callbacks.

    Appended after the test's own callbacks: `Checkpoint` (in a temporary
    directory, removed afterwards), `NaNRollback()` and an `EarlyStopping` whose
    patience outlasts the fit (so it never changes how long Keras's test trains).
    """

    def fit(self, *args, callbacks=None, **kwargs):
        directory = tempfile.mkdtemp(prefix="trainwell-conformance-")
        epochs = kwargs.get("epochs", 1)
        stack = [Checkpoint(directory), NaNRollback(), EarlyStopping(monitor="loss", patience=epochs)]
        try:
            return super().fit(*args, callbacks=[*(callbacks or []), *stack], **kwargs)
        finally:
            shutil.rmtree(directory, ignore_errors=True)


class _Overlay(types.ModuleType):
    """A Keras package module seen through a few replaced names (`callbacks.EarlyStopping`)."""

    def __init__(self, base: types.ModuleType):
        super().__init__(base.__name__)
        self._base = base

    def __getattr__(self, name):
        return getattr(self._base, name)


# --------------------------------------------------------------------------- the suites
# Per Keras test file: the TestCase classes to run, the module globals to replace
# (a dict value overlays that package module), and trainwell's classes the tests
# must construct.
SUITES = {
    "callbacks/early_stopping_test.py": {
        "classes": ("EarlyStoppingTest",),
        "replace": {"callbacks": {"EarlyStopping": EarlyStopping}},
        "ours": (EarlyStopping,),
    },
    "callbacks/backup_and_restore_test.py": {
        "classes": ("BackupAndRestoreCallbackTest",),
        "replace": {"callbacks": {"BackupAndRestore": BackupAndRestore}},
        "ours": (Checkpoint,),
    },
    "callbacks/terminate_on_nan_test.py": {
        "classes": ("TerminateOnNaNTest",),
        "replace": {
            "callbacks": {"TerminateOnNaN": TerminateOnNaN, "BackupAndRestore": BackupAndRestore},
            "TerminateOnNaN": TerminateOnNaN,
            "BackupAndRestore": BackupAndRestore,
        },
        "ours": (NaNRollback,),
    },
    "callbacks/reduce_lr_on_plateau_test.py": {
        "classes": ("ReduceLROnPlateauTest",),
        "replace": {
            "Sequential": SequentialWithTrainwell,
            "optimizers": {"schedules": {"PolynomialDecay": PolynomialDecay}},
        },
        "ours": (SequentialWithTrainwell,),
    },
    "optimizers/schedules/learning_rate_schedule_test.py": {
        "classes": ("CosineDecayTest",),
        "replace": {"schedules": {"CosineDecay": CosineDecay}},
        "ours": (WarmupCosineDecay,),
    },
    "callbacks/tensorboard_test.py": {
        "classes": ("TestTensorBoardV2",),
        "replace": {"callbacks": {"TensorBoard": TensorBoard}},
        "ours": (TensorBoard,),
    },
    "losses/losses_test.py": {
        "classes": ("CategoricalCrossentropyTest",),
        "replace": {"losses": {"CategoricalCrossentropy": CategoricalCrossentropy}},
        "ours": (CategoricalCrossentropy,),
    },
}

# The one list of Keras tests that do not run as they stand, keyed
# "<file under keras/src>::<TestCase>::<test>". kind "deviation": trainwell
# differs on purpose (deselected); kind "empty": the Keras test has no body
# (deselected; checked to be still empty); kind "defect": a trainwell defect being
# fixed elsewhere (a strict xfail: the fix turns it into a failure, so the entry goes).
_BAR = "callbacks/backup_and_restore_test.py::BackupAndRestoreCallbackTest::"
_NAN = "callbacks/terminate_on_nan_test.py::TerminateOnNaNTest::"
_NO_QUIET_STOP = (
    "NaNRollback rolls back; when rolling back does not help it raises TrainingDivergedError with the last "
    "good weights restored. It never ends fit quietly with a NaN loss in the history, which this test expects "
    "of TerminateOnNaN(raise_error=False)"
)
DEVIATIONS: dict[str, dict] = {
    # ---- deliberate differences (deselected)
    _BAR + "test_best_case_step": {"kind": "deviation", "reason": (
        "Checkpoint resumes a mid-epoch checkpoint at the next batch; BackupAndRestore trains the interrupted "
        "epoch again from batch 0. The test counts the layer's calls: 17 with the replay, 15 (each of the 5 x 3 "
        "batches trained once) with Checkpoint; it also reads `_last_batch_seen`, which has no counterpart"
    )},
    _BAR + "test_model_deleted_case_epoch": {"kind": "deviation", "reason": (
        "BackupAndRestore deletes its backup after a fit that ends normally; Checkpoint keeps its checkpoints: "
        "they are the run's result (keep_best, load_checkpoint for inference), and rerunning a finished run "
        "resumes instead of training again"
    )},
    _BAR + "test_backup_dir_empty_error": {"kind": "deviation", "reason": (
        "the ValueError is raised, with trainwell's Received idiom and Checkpoint's argument name ('Invalid value "
        "for argument `directory`. Expected a non-empty path. Received: directory='''), not Keras's 'Empty "
        "`backup_dir` argument passed' that the test matches"
    )},
    _BAR + "test_backup_dir_none_error": {"kind": "deviation", "reason": (
        "as test_backup_dir_empty_error, with directory=None"
    )},
    _NAN + "test_TerminateOnNaN": {"kind": "deviation", "reason": (
        _NO_QUIET_STOP + " (here every batch is non-finite: 1e5 weights through 5 layers): it rolls back to "
        "the snapshot taken right after Keras builds the model, max_rollbacks=3 times, then raises"
    )},
    _NAN + "test_terminate_on_nan_graceful_stop": {"kind": "deviation", "reason": _NO_QUIET_STOP},
    # ---- empty in this Keras (deselected while their bodies stay empty: test_keras_ships_the_tests)
    **{f"callbacks/tensorboard_test.py::TestTensorBoardV2::{name}": {"kind": "empty", "reason": (
        "the test's body is `pass` in Keras 3.15 (its code is commented out: 'TODO: Requires to_json "
        "implementation in trainer'); it constructs nothing, so it cannot test trainwell's TensorBoard"
    )} for name in ("test_TensorBoard_write_sequential_model_no_input_shape",
                    "test_TensorBoard_write_sequential_model_with_input_shape", "test_TensorBoard_write_model")},
}


def _empty_test(fn) -> bool:
    """Whether a test function's body is only `pass` (and a docstring)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body
    return all(isinstance(n, ast.Pass) or (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
               for n in body)


def deviation_key(item) -> str | None:
    """The `DEVIATIONS` key of a collected item, or None if it is not a Keras test."""
    cls = getattr(item, "cls", None)
    relpath = getattr(cls, "__keras_test_file__", None)
    return None if relpath is None else f"{relpath}::{cls.__name__}::{item.name}"


def _replace(owner, replaced: dict, where: str, problems: list[str]) -> None:
    """Sets `owner.<name> = value` for each entry; a dict value overlays the package module there."""
    for name, value in replaced.items():
        if not hasattr(owner, name):
            problems.append(f"{where} no longer has `{name}` to replace")
            continue
        if isinstance(value, dict):
            overlay = _Overlay(getattr(owner, name))
            _replace(overlay, value, f"{where}.{name}", problems)
            value = overlay
        setattr(owner, name, value)


def _load(relpath: str, suite: dict) -> tuple[types.ModuleType | None, list[str]]:
    """The Keras test module with trainwell's classes in place, and what went wrong."""
    path = KERAS_SRC / relpath
    if not path.is_file():
        return None, [f"keras {keras.__version__} does not ship {path}"]
    name = "trainwell_conformance." + relpath[:-3].replace("/", ".")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    problems: list[str] = []
    _replace(module, suite["replace"], relpath, problems)
    for cls_name in suite["classes"]:
        cls = vars(module).get(cls_name)
        if cls is None:
            problems.append(f"{relpath} no longer defines {cls_name}")
            continue
        cls.__keras_test_file__ = relpath
    return module, problems


LOADED = {relpath: _load(relpath, suite) for relpath, suite in SUITES.items()}
SUITE_OF_CLASS = {}
for _relpath, (_module, _) in LOADED.items():
    for _cls_name in SUITES[_relpath]["classes"]:
        if _module is not None and hasattr(_module, _cls_name):
            globals()[_cls_name] = getattr(_module, _cls_name)  # collected by pytest from here
            SUITE_OF_CLASS[_cls_name] = SUITES[_relpath]


@pytest.mark.parametrize("relpath", sorted(SUITES))
def test_keras_ships_the_tests(relpath):
    """Fails (never skips) when the pinned Keras stops shipping a file, class or name used here."""
    module, problems = LOADED[relpath]
    if module is not None:
        for key in DEVIATIONS:
            file, cls_name, test = key.split("::")
            if file != relpath:
                continue
            fn = getattr(vars(module).get(cls_name), test, None)
            if not callable(fn):
                problems.append(f"DEVIATIONS lists {key}, which this Keras does not have")
            elif DEVIATIONS[key]["kind"] == "empty" and not _empty_test(fn):
                problems.append(f"DEVIATIONS lists {key} as empty, but this Keras gives it a body: run it")
    assert not problems, "; ".join(problems)


@pytest.fixture(autouse=True)
def _trainwell_under_test(request, monkeypatch):
    """Counts constructions of trainwell's classes; puts back global state Keras's tests change."""
    suite = SUITE_OF_CLASS.get(getattr(request.cls, "__name__", None))
    if suite is None:
        yield
        return
    made = []
    for cls in suite["ours"]:
        if issubclass(cls, keras.layers.Layer):  # Keras reads a layer's `__init__` argspec: count in `__new__`
            new = cls.__new__

            def counting_new(klass, *args, _new=new, **kwargs):
                made.append(klass.__name__)
                return _new(klass, *args, **kwargs)

            monkeypatch.setattr(cls, "__new__", staticmethod(counting_new))
            continue
        init = cls.__init__

        @functools.wraps(init)
        def counting(self, *args, _init=init, **kwargs):
            made.append(type(self).__name__)
            _init(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", counting)
    from absl import logging as absl_logging
    from keras.src.utils import io_utils

    interactive = io_utils.is_interactive_logging_enabled()
    verbosity = absl_logging.get_verbosity()
    filtering = keras.config.is_traceback_filtering_enabled()
    rng = np.random.get_state()
    try:
        yield
    finally:
        # Keras's TestCase and some tests switch these off for the whole process.
        (io_utils.enable_interactive_logging if interactive else io_utils.disable_interactive_logging)()
        absl_logging.set_verbosity(verbosity)
        (keras.config.enable_traceback_filtering if filtering else keras.config.disable_traceback_filtering)()
        np.random.set_state(rng)
    assert made, (
        f"{request.node.nodeid} never constructed {[c.__name__ for c in suite['ours']]}: the substitution no "
        "longer reaches what this Keras test uses"
    )
