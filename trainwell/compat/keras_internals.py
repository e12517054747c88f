"""Every private Keras name trainwell's callbacks and optimizers read or write, behind one accessor each.

Keras 3 gives callbacks no public way to do what an exact-resume checkpoint, a
NaN rollback and a training doctor need: walk a model's saveables the way
`.weights.h5` names them, set the epoch `fit` starts at, build a model from an
input spec, read the loss tracker, compute the loss the way `fit` does, or see
the data `fit` was given. Nor does it give an optimizer subclass a public way
to decay each variable by its own rule, ask whether a variable is excluded from
weight decay, or find a variable's slots (`OwnWeightDecay`,
`uses_weight_decay`, `variable_index`). Each such access is one function here; each calls
`versions.gate(name)` (a warning on an untested Keras) and raises
`versions.UpstreamChanged` when the name is gone. `audit()` lists the names the
installed Keras lacks; `tests/trainwell/compat/test_keras_internals.py` fails on
any, and checks each accessor's behaviour on a tiny model.

Example:
>>> import keras
>>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
>>> model_fully_built(model)
True
>>> [path for path, _ in walk_saveables(model, set())]
['', 'layers/dense']
>>> audit()
[]
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

import keras  # noqa: F401 - the examples use it

from trainwell.compat.versions import gate, upstream_changed

__all__ = [
    "audit",
    "walk_saveables",
    "model_fully_built",
    "seed_generators",
    "keras_global_seed_state",
    "get_initial_epoch",
    "set_initial_epoch",
    "symbolic_build",
    "compiled_metrics_unbuilt",
    "loss_tracker",
    "call_has_training_arg",
    "compute_loss",
    "fit_epoch_iterator",
    "fit_callbacks",
    "start_next_epoch_at",
    "cancel_next_epoch_start",
    "continue_tensorboard_steps",
    "adapter_sample_source",
    "adapter_shuffle",
    "OwnWeightDecay",
    "uses_weight_decay",
    "variable_index",
    "preset_backbone_class",
]


def _required(obj, attr: str, name: str):
    """`getattr(obj, attr)` behind the gate; `UpstreamChanged` when it is gone."""
    gate(name)
    try:
        return getattr(obj, attr)
    except AttributeError:
        raise upstream_changed(name) from None


# --------------------------------------------------------------------------- saving


def walk_saveables(root, skip_ids: set[int]) -> list[tuple[str, Any]]:
    """(path, object) for every Keras saveable under `root`, skipping the ids in `skip_ids`.

    Paths are the ones Keras's own `.weights.h5` uses (`layers/dense_1/...`):
    attribute names and class-based names made unique among siblings, so they do
    not depend on the auto-generated layer names of the process. Uses
    `keras.src.saving.saving_lib._walk_saveable` and `_get_unique_name`.

    Args:
        root: A model (or any Keras saveable). Required.
        skip_ids: `id()`s of objects not to visit (e.g. the optimizer). Required.

    Example:
    >>> m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1), keras.layers.Dense(1)])
    >>> [p for p, _ in walk_saveables(m, set())]
    ['', 'layers/dense', 'layers/dense_1']
    """
    gate("saving_lib._walk_saveable")
    try:  # lazy, not at the top: a moved keras.src path fails only the accessor that needs it
        from keras.src.saving import saving_lib  # lazy: as said on the `try`
        from keras.src.saving.keras_saveable import KerasSaveable  # lazy: as said on the `try`
        from keras.src.utils import naming  # lazy: as said on the `try`
    except ImportError as e:  # pragma: no cover - moved upstream
        raise upstream_changed("keras.src.saving.saving_lib", detail=str(e)) from None
    walk = _required(saving_lib, "_walk_saveable", "saving_lib._walk_saveable")
    unique = _required(saving_lib, "_get_unique_name", "saving_lib._get_unique_name")

    out: list[tuple[str, Any]] = []
    visited = set(skip_ids)

    def join(a, b):
        return f"{a}/{b}" if a else b

    def visit(obj, path):
        if id(obj) in visited:
            return
        visited.add(id(obj))
        out.append((path, obj))
        for attr, child in walk(obj):
            if isinstance(child, KerasSaveable):
                visit(child, join(path, attr))
            elif isinstance(child, (list, dict, tuple)):
                visit_container(child, join(path, attr), set())

    def visit_container(container, path, seen):
        if id(container) in seen:
            return
        seen.add(id(container))
        used: dict[str, int] = {}
        items = list(container.values()) if isinstance(container, dict) else container
        for item in items:
            if isinstance(item, KerasSaveable):
                visit(item, join(path, unique(naming.to_snake_case(type(item).__name__), used)))
            elif isinstance(item, (list, dict, tuple)):
                visit_container(item, join(path, unique("container", used)), seen)

    visit(root, "")
    return out


def model_fully_built(model) -> bool:
    """Whether `model` and every layer in it are built (`Layer._flatten_layers`).

    Example:
    >>> model_fully_built(keras.Sequential([keras.layers.Dense(1)]))
    False
    """
    if not getattr(model, "built", False):
        return False
    layers = _required(model, "_flatten_layers", "Layer._flatten_layers")
    return all(layer.built for layer in layers())


def seed_generators(layer) -> list:
    """The `SeedGenerator`s a layer owns (dropout's), from `Layer._seed_generators`.

    Example:
    >>> len(seed_generators(keras.layers.Dropout(0.5, seed=1)))
    1
    """
    gate("Layer._seed_generators")
    return list(getattr(layer, "_seed_generators", None) or [])


def keras_global_seed_state(create: bool = False):
    """The state variable of Keras's global `SeedGenerator` (`keras.random` without a seed).

    Args:
        create: Create the generator if none exists yet (restoring a
            checkpoint); otherwise return `None` then. Defaults to `False`.

    Example:
    >>> state = keras_global_seed_state()  # None until something draws from keras.random
    >>> state is None or tuple(state.shape) == (2,)
    True
    """
    gate("backend.common.global_state / random.seed_generator.global_seed_generator")
    try:  # lazy, not at the top: a moved keras.src path fails only the accessor that needs it
        from keras.src.backend.common import global_state  # lazy: as said on the `try`
        from keras.src.random.seed_generator import global_seed_generator  # lazy: as said on the `try`
    except ImportError as e:  # pragma: no cover - moved upstream
        raise upstream_changed("keras.src.random.seed_generator.global_seed_generator", detail=str(e)) from None
    if create:
        return global_seed_generator().state
    g = global_state.get_global_attribute("global_seed_generator")
    return None if g is None else g.state


# --------------------------------------------------------------------------- fit


def get_initial_epoch(model):
    """The epoch `fit` will start at when a callback set one (`Trainer._initial_epoch`), else None.

    Example:
    >>> get_initial_epoch(keras.Sequential()) is None
    True
    """
    gate("Trainer._initial_epoch")
    return getattr(model, "_initial_epoch", None)


def set_initial_epoch(model, epoch) -> None:
    """Makes the running `fit` start at `epoch` (what `BackupAndRestore` sets); `None` clears it.

    Keras's `fit` reads `self._initial_epoch` after `on_train_begin`.

    Example:
    >>> m = keras.Sequential(); set_initial_epoch(m, 3); get_initial_epoch(m)
    3
    """
    gate("Trainer._initial_epoch")
    model._initial_epoch = epoch


def symbolic_build(model, data_batch) -> None:
    """Builds `model` (and its compiled metrics) from a batch or an element spec (`Trainer._symbolic_build`).

    Args:
        model: A compiled Keras model. Required.
        data_batch: A batch, or a `tf.data` element spec. Required.

    Example:
    >>> m = keras.Sequential([keras.layers.Dense(1)]); m.compile("sgd", "mse")
    >>> import numpy as np; symbolic_build(m, (np.zeros((2, 3)), np.zeros((2, 1)))); m.built
    True
    """
    build = _required(model, "_symbolic_build", "Trainer._symbolic_build")
    build(data_batch=data_batch)


def compiled_metrics_unbuilt(model) -> bool:
    """Whether the compiled metrics or loss of `model` are not built yet (`_compile_metrics`, `_compile_loss`).

    Example:
    >>> m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> m.compile("sgd", "mse", metrics=["mae"]); compiled_metrics_unbuilt(m)
    True
    """
    gate("Trainer._compile_metrics")
    compiled = getattr(model, "_compile_metrics", None)
    loss = getattr(model, "_compile_loss", None)
    return (compiled is not None and not compiled.built) or (loss is not None and not loss.built)


def loss_tracker(model):
    """The `keras.metrics.Mean` behind `logs["loss"]` (`Trainer._loss_tracker`), or None.

    Its `total` and `count` variables give the running mean's parts.

    Example:
    >>> m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]); m.compile("sgd", "mse")
    >>> type(loss_tracker(m)).__name__
    'Mean'
    """
    gate("Trainer._loss_tracker")
    tracker = getattr(model, "_loss_tracker", None)
    if tracker is not None and hasattr(tracker, "total") and hasattr(tracker, "count"):
        return tracker
    return None


def call_has_training_arg(model) -> bool:
    """Whether `model.call` takes `training` (`Layer._call_has_training_arg`).

    Example:
    >>> call_has_training_arg(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
    True
    """
    return bool(_required(model, "_call_has_training_arg", "Layer._call_has_training_arg"))


def compute_loss(model, x=None, y=None, y_pred=None, sample_weight=None, training=True):
    """The loss as `fit`'s train step computes it, incl. regularization losses (`Trainer._compute_loss`).

    Example:
    >>> import numpy as np
    >>> m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]); m.compile("sgd", "mse")
    >>> float(compute_loss(m, y=np.ones((1, 1)), y_pred=np.zeros((1, 1))))
    1.0
    """
    fn = _required(model, "_compute_loss", "Trainer._compute_loss")
    return fn(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)


def _fit_local(model, name: str, max_depth: int):
    """The local `name` of the frame of `fit` on `model` up the stack (at most `max_depth` frames), or None."""
    frame = sys._getframe(2)
    for _ in range(max_depth):
        if frame is None:
            return None
        loc = frame.f_locals
        if frame.f_code.co_name == "fit" and loc.get("self") is model and name in loc:
            return loc[name]
        frame = frame.f_back
    return None


def fit_epoch_iterator(model, max_depth: int = 25):
    """The `EpochIterator` of the `fit` call now running on `model`, or None.

    Keras does not hand the training data to callbacks. `fit` keeps it in a local
    variable, `epoch_iterator`, of the frame that calls the callbacks; this looks
    up the stack (at most `max_depth` frames) for a frame of `fit` on `model`.
    Returns `None` when there is none (another Keras version, a custom loop).

    Args:
        model: The model being fitted. Required.
        max_depth: Frames to look through. Defaults to `25`.

    Example:
    >>> fit_epoch_iterator(keras.Sequential()) is None  # not inside fit
    True
    """
    gate("fit's local `epoch_iterator`")
    return _fit_local(model, "epoch_iterator", max_depth)


def fit_callbacks(model, max_depth: int = 25) -> list | None:
    """The callbacks of the `fit` call now running on `model` (its `CallbackList`'s), or None.

    Looked up like `fit_epoch_iterator`: `fit`'s local `callbacks`.

    Example:
    >>> fit_callbacks(keras.Sequential()) is None  # not inside fit
    True
    """
    gate("fit's local `callbacks`")
    found = _fit_local(model, "callbacks", max_depth)
    return list(getattr(found, "callbacks", None) or []) if found is not None else None


def start_next_epoch_at(epoch_iterator, step: int, on_start: Callable[[Any], Any]) -> None:
    """Makes the next epoch of `fit`'s `epoch_iterator` begin at step `step`, no batch hook seeing the steps before.

    Keras's `EpochIterator._enumerate_iterator` is the generator `fit` loops over:
    it yields `(begin_step, end_step, data_iterator)` per step, and the train
    function takes the batches from `data_iterator`. For the next epoch only,
    this calls `on_start(data_iterator)` at the epoch's first step (after every
    callback's `on_epoch_begin`, before any `on_train_batch_begin`), then drops
    the yields of the steps before `step` (they take no data: `on_start` takes
    what those steps would have taken). `on_start` returns the number of
    batches it took beyond those steps' (`EpochIterator._steps_seen` counts
    them too), or `None` when the data ran out (the epoch then has no step).

    Args:
        epoch_iterator: `fit_epoch_iterator(model)`. Required.
        step: The first step the epoch's batch hooks and progress bar see (>= 0).
        on_start: `on_start(data_iterator) -> int | None`. Required.

    Example:
    >>> import numpy as np
    >>> class FirstBatch(keras.callbacks.Callback):
    ...     def on_train_begin(self, logs=None):
    ...         start_next_epoch_at(fit_epoch_iterator(self.model), 2, lambda it: [next(it), next(it)] and 0)
    ...     def on_train_batch_begin(self, batch, logs=None):
    ...         self.first = getattr(self, "first", batch)
    >>> m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]); m.compile("sgd", "mse")
    >>> cb = FirstBatch(); _ = m.fit(np.ones((8, 2)), np.ones((8, 1)), batch_size=2, verbose=0, callbacks=[cb])
    >>> cb.first, int(m.optimizer.iterations)
    (2, 2)
    """
    gate("EpochIterator._enumerate_iterator")
    enumerate_epoch = _required(epoch_iterator, "_enumerate_iterator", "EpochIterator._enumerate_iterator")

    def enumerate_once():
        vars(epoch_iterator).pop("_enumerate_iterator", None)  # this epoch only
        started = False
        for begin, end, data in enumerate_epoch():
            if not started:
                started = True
                extra = on_start(data)
                if extra is None:
                    return
                epoch_iterator._steps_seen += int(extra)
            if begin >= step:
                yield begin, end, data

    epoch_iterator._enumerate_iterator = enumerate_once


def cancel_next_epoch_start(epoch_iterator) -> None:
    """Undoes a `start_next_epoch_at` whose epoch did not come (a run that ended first).

    Example:
    >>> cancel_next_epoch_start(None)  # nothing to undo
    """
    if "_enumerate_iterator" in getattr(epoch_iterator, "__dict__", {}):
        vars(epoch_iterator).pop("_enumerate_iterator")


def continue_tensorboard_steps(callbacks, step: int) -> None:
    """Makes each Keras `TensorBoard` among `callbacks` number its batch summaries on from `step`.

    Keras's `TensorBoard` counts batches from 0 in each `fit`
    (`TensorBoard._global_train_batch`, set in `on_train_begin`); a resumed run
    continues the interrupted one's steps. Call it after every callback's
    `on_train_begin`, before the first `on_train_batch_begin`.

    Example:
    >>> tb = keras.callbacks.TensorBoard(); continue_tensorboard_steps([tb], 7); tb._global_train_batch
    7
    """
    for cb in callbacks or ():
        if isinstance(cb, keras.callbacks.TensorBoard):
            gate("TensorBoard._global_train_batch")
            cb._global_train_batch = int(step)


def adapter_sample_source(adapter) -> tuple[str, Any]:
    """What a data adapter of `fit` holds, to draw a probe batch without consuming it.

    Returns one of `("arrays", (inputs, num_samples, batch_size))` for an
    `ArrayDataAdapter` (its `_inputs`, `_num_samples`, `_batch_size`),
    `("dataset", tf.data.Dataset)` for a `TFDatasetAdapter` (`_dataset`),
    `("pydataset", keras.utils.PyDataset)` for a `PyDatasetAdapter` (public
    `py_dataset`), or `("none", None)` (a generator, which reading would consume).

    Args:
        adapter: `epoch_iterator.data_adapter`. Required.

    Example:
    >>> adapter_sample_source(object())
    ('none', None)
    """
    kind = type(adapter).__name__
    if kind == "ArrayDataAdapter":
        gate("ArrayDataAdapter._inputs")
        inputs = getattr(adapter, "_inputs", None)
        n = int(getattr(adapter, "_num_samples", 0) or 0)
        bs = int(getattr(adapter, "_batch_size", 0) or 0)
        return ("arrays", (inputs, n, bs)) if inputs is not None else ("none", None)
    if kind == "TFDatasetAdapter":
        gate("TFDatasetAdapter._dataset")
        ds = getattr(adapter, "_dataset", None)
        return ("dataset", ds) if ds is not None else ("none", None)
    if kind == "PyDatasetAdapter":
        return "pydataset", adapter.py_dataset
    return "none", None


def adapter_shuffle(adapter) -> str | None:
    """How a data adapter of `fit` reorders its batches each epoch, or None when it does not.

    `"arrays"`: NumPy or tensor inputs with `shuffle=True` (`ArrayDataAdapter._shuffle`;
    on TensorFlow a `tf.random.shuffle` inside the pipeline); `"pydataset"`: a
    `PyDataset` with `shuffle=True` read in the main thread (its order drawn from
    Python's `random` at the iterator's first batch); `"pydataset_workers"`: the
    same read by its enqueuer's workers (the order drawn in a worker thread).

    Example:
    >>> adapter_shuffle(object()) is None
    True
    """
    kind = type(adapter).__name__
    if kind == "ArrayDataAdapter":
        gate("ArrayDataAdapter._shuffle")
        return "arrays" if getattr(adapter, "_shuffle", False) else None
    if kind == "PyDatasetAdapter" and getattr(adapter, "shuffle", False):
        return "pydataset_workers" if getattr(adapter, "enqueuer", None) is not None else "pydataset"
    return None


# --------------------------------------------------------------------------- optimizers


class OwnWeightDecay:
    """Mixin (listed first among the bases) for an optimizer that applies its weight decay in `update_step`.

    Keras applies decoupled weight decay in a pass of its own before the update
    (`BaseOptimizer._apply_weight_decay`; on TensorFlow through a `tf.distribute`
    merge call), with one learning rate for every variable and no public switch
    that turns it off while keeping `weight_decay`. An optimizer that decays per
    variable (`trainwell.optimizers.LARS` adds the decay to the gradient,
    `LayerwiseAdamW` scales it by each variable's LR factor) takes this mixin, and
    that pass does nothing.

    Example:
    >>> class NoDecaySGD(OwnWeightDecay, keras.optimizers.SGD):
    ...     pass
    >>> v = keras.Variable([1.0]); NoDecaySGD(0.1, weight_decay=0.5).apply([keras.ops.zeros((1,))], [v])
    >>> v.numpy().tolist()
    [1.0]
    """

    def _apply_weight_decay(self, variables):
        gate("BaseOptimizer._apply_weight_decay")


def uses_weight_decay(optimizer, variable) -> bool:
    """Whether `optimizer`'s weight decay applies to `variable` (`BaseOptimizer._use_weight_decay`).

    False for a variable excluded with the public
    `optimizer.exclude_from_weight_decay(var_list=..., var_names=...)`.

    Example:
    >>> opt = keras.optimizers.AdamW(weight_decay=0.1); opt.exclude_from_weight_decay(var_names=["bias"])
    >>> uses_weight_decay(opt, keras.Variable(0.0, name="bias")), uses_weight_decay(opt, keras.Variable(0.0))
    (False, True)
    """
    return bool(_required(optimizer, "_use_weight_decay", "BaseOptimizer._use_weight_decay")(variable))


def variable_index(optimizer, variable) -> int:
    """The position of `variable` in the per-variable lists a built optimizer keeps (`_get_variable_index`).

    What Keras's own `update_step`s use to find a variable's slots; it accepts the
    backend variable (the `tf.Variable` the TensorFlow backend passes) too.

    Example:
    >>> a, b = keras.Variable(1.0), keras.Variable(2.0)
    >>> opt = keras.optimizers.SGD(); opt.build([a, b]); variable_index(opt, b)
    1
    """
    return int(_required(optimizer, "_get_variable_index", "BaseOptimizer._get_variable_index")(variable))


# --------------------------------------------------------------------------- audit

def preset_backbone_class(preset: str):
    """The keras-hub `Backbone` class of `preset` (a name or a directory), read from its config: nothing built.

    keras-hub has no public way to name a preset's backbone class without loading
    the model; `CausalLM.from_preset` asks the preset's loader
    (`keras_hub.src.utils.preset_utils.get_preset_loader`), and so does this. A
    layout map (model parallel) must be known before the model is built.

    Example:
    >>> preset_backbone_class("/path/to/gemma_preset").__name__  # doctest: +SKIP
    'GemmaBackbone'
    """
    name = "keras_hub.src.utils.preset_utils.get_preset_loader"
    gate(name, "keras_hub")
    try:
        from keras_hub.src.utils.preset_utils import get_preset_loader  # lazy: keras-hub loads with its recipes
    except ImportError:
        raise upstream_changed(name, "keras_hub") from None
    return get_preset_loader(preset).check_backbone_class()


def _has_module_attr(module: str, attr: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return hasattr(importlib.import_module(module), attr)
        except ImportError:
            return False

    return check


def _has_class_attr(module: str, cls: str, attr: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return hasattr(getattr(importlib.import_module(module), cls), attr)
        except (ImportError, AttributeError):
            return False

    return check


#: `(name, check)` for every private Keras name above: `check()` is True while Keras has it.
_CHECKS: tuple[tuple[str, Callable[[], bool]], ...] = (
    ("saving_lib._walk_saveable", _has_module_attr("keras.src.saving.saving_lib", "_walk_saveable")),
    ("saving_lib._get_unique_name", _has_module_attr("keras.src.saving.saving_lib", "_get_unique_name")),
    ("keras_saveable.KerasSaveable", _has_module_attr("keras.src.saving.keras_saveable", "KerasSaveable")),
    ("naming.to_snake_case", _has_module_attr("keras.src.utils.naming", "to_snake_case")),
    ("global_state.get_global_attribute", _has_module_attr("keras.src.backend.common.global_state", "get_global_attribute")),
    ("seed_generator.global_seed_generator", _has_module_attr("keras.src.random.seed_generator", "global_seed_generator")),
    ("Layer._flatten_layers", _has_class_attr("keras", "Layer", "_flatten_layers")),
    ("Model._symbolic_build", _has_class_attr("keras", "Model", "_symbolic_build")),
    ("Model._compute_loss", _has_class_attr("keras", "Model", "_compute_loss")),
    ("EpochIterator._enumerate_iterator", _has_class_attr("keras.src.trainers.epoch_iterator", "EpochIterator", "_enumerate_iterator")),
    ("ArrayDataAdapter", _has_module_attr("keras.src.trainers.data_adapters.array_data_adapter", "ArrayDataAdapter")),
    ("TFDatasetAdapter", _has_module_attr("keras.src.trainers.data_adapters.tf_dataset_adapter", "TFDatasetAdapter")),
    ("BaseOptimizer._apply_weight_decay", _has_class_attr("keras.optimizers", "Optimizer", "_apply_weight_decay")),
    ("BaseOptimizer._use_weight_decay", _has_class_attr("keras.optimizers", "Optimizer", "_use_weight_decay")),
    ("BaseOptimizer._get_variable_index", _has_class_attr("keras.optimizers", "Optimizer", "_get_variable_index")),
    ("keras_hub preset_utils.get_preset_loader",
     _has_module_attr("keras_hub.src.utils.preset_utils", "get_preset_loader")),
)


def audit() -> list[str]:
    """The private Keras names this module uses that the installed Keras lacks (`[]`: all there).

    Instance attributes set in `__init__` or `compile` (`_initial_epoch`,
    `_loss_tracker`, `_compile_metrics`, `_seed_generators`, an adapter's
    `_inputs`...) cannot be checked on the class; the behaviour tests in
    `tests/trainwell/compat/` check them on a tiny model.

    Example:
    >>> audit()
    []
    """
    return [name for name, check in _CHECKS if not check()]
