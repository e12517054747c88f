"""Fixes for Keras bugs that break trainwell, kept in one place and version-gated.

Today this holds the two fixes that make `model.fit` work under
`tf.distribute.MultiWorkerMirroredStrategy` with Keras 3 on the TensorFlow
backend (keras-team/keras#20585). Both live in
`keras.src.backend.tensorflow.trainer`:

- `"symbolic_build"`: `TensorFlowTrainer._maybe_symbolic_build` draws one batch to
  build the model and reduces that per-replica *data* batch with
  `strategy.reduce("MEAN", batch, axis=None)`. Under multi-worker, `fit` fails
  there before the first step with `ValueError: Attempt to convert a value
  (PerReplica...) with an unsupported type ... to a Tensor` (TF 2.21). The fix
  takes `strategy.experimental_local_results(x)[0]`, a local batch with the
  right shapes, and communicates nothing.
- `"scalar_reduce"`: `reduce_per_replica` reduces the metric results of each
  step with `strategy.reduce("MEAN", v, axis=0)` when running multi-worker. The
  results are scalars, for which `axis=0` does not exist: tracing the train
  function fails with `ValueError: Invalid reduction dimension 0 for input with
  0 dimensions`. The fix reduces rank-0 values with `axis=None` (a mean across
  replicas, so every worker reports the same logs) and leaves every other case
  to the original function.

The `"symbolic_build"` fix also stops a segfault of single-device strategies
(`OneDeviceStrategy`, `MirroredStrategy` over one GPU, what `make_strategy("auto")`
gives on a one-GPU machine). Keras's `_maybe_symbolic_build` draws its batch at
the start of *every* `fit`, `evaluate` and `predict` under a strategy, even when
the model, its compiled loss and metrics and its optimizer are all built and the
symbolic build does nothing; `fit` then drops that iterator at once
(`epoch_iterator.reset()`). TensorFlow 2.21's `MultiDeviceIterator` sometimes
frees its host iterator while its background thread still reads from it
(`MultiDeviceBuffer::BackgroundThread` -> `DatasetBaseIterator::GetNext` on
freed memory, a SIGSEGV, in loops of small `fit`s). The fix draws no batch
when nothing needs building, and builds an unbuilt model from the data's element
spec (`backend.build_before_fit`) before it falls back to drawing one.
`runtime.make_strategy` applies it for every TensorFlow strategy but the default
one (so the recipes, the CLI and the tuners get it), and `lr_find` on
TensorFlow (`apply_for_backend`). How often it crashed before and how many fits
ran without a crash after: bench/README.md, "Moved from docstrings"; how many
times a `fit` starts the data is tested in
`tests/trainwell/compat/test_keras_fixes.py`.

The module patches those two attributes only, and only for the Keras versions
known to be broken (`KNOWN_BROKEN`: `3.0 <= keras < 3.16`; tested with 3.15.1). A
newer Keras runs unpatched: re-run `tests/trainwell/compat/test_keras_fixes.py` with it
before widening the range. `apply()` and `remove()` are idempotent and
`patched()` is a context manager, so tests can run with and without a fix.
`trainwell.runtime.make_strategy("multiworker")` calls `apply()`.

A fix changes what gets traced: apply it before the first `fit`/`evaluate` of a
model (a `train_function` already traced keeps the code it was traced with).

Example:
>>> from trainwell.compat import keras_fixes
>>> applied = keras_fixes.apply()  # names of the fixes now active
>>> keras_fixes.remove() == applied
True
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from typing import Iterable, Iterator

from trainwell.compat.backend import backend_name
from trainwell.compat.versions import keras_version
from trainwell.validation import invalid_argument

#: Names of the fixes, in the order they are applied.
FIXES = ("symbolic_build", "scalar_reduce")

#: Keras versions with the bugs, as `(lowest, first fixed-or-untested)`: `lo <= v < hi`.
KNOWN_BROKEN = ((3, 0), (3, 16))

_TRAINER_MODULE = "keras.src.backend.tensorflow.trainer"
_lock = threading.RLock()
# name -> (owner object, attribute name, original value); present while applied.
_originals: dict[str, tuple[object, str, object]] = {}


def needed(version: tuple[int, int] | None = None) -> bool:
    """Whether `version` (default: the installed Keras) is in `KNOWN_BROKEN`.

    Args:
        version: `(major, minor)`. Defaults to `None` (the installed Keras).

    Example:
    >>> needed((3, 15)), needed((3, 16))
    (True, False)
    """
    v = keras_version() if version is None else tuple(version)
    lo, hi = KNOWN_BROKEN
    return lo <= v < hi


def applied() -> tuple[str, ...]:
    """Names of the fixes currently applied, in `FIXES` order.

    Example:
    >>> isinstance(applied(), tuple)
    True
    """
    with _lock:
        return tuple(n for n in FIXES if n in _originals)


def _names(fixes: str | Iterable[str] | None) -> tuple[str, ...]:
    if fixes is None:
        return FIXES
    names = (fixes,) if isinstance(fixes, str) else tuple(fixes)
    bad = [n for n in names if n not in FIXES]
    if bad:
        raise invalid_argument("fixes", f"names from {FIXES}", fixes)
    return names


# --------------------------------------------------------------------------- the fixes


def _nothing_to_build(model) -> bool:
    """What `Trainer._symbolic_build` checks: every layer, the compiled loss and metrics and the optimizer built."""
    # lazy: keras_internals imports Keras; this module stays importable without it (runs inside `fit`)
    from trainwell.compat.keras_internals import compiled_metrics_unbuilt, model_fully_built

    optimizer = getattr(model, "optimizer", None)
    return (model_fully_built(model) and not compiled_metrics_unbuilt(model)
            and (optimizer is None or optimizer.built))


def _fixed_maybe_symbolic_build(self, iterator=None, data_batch=None):
    """`TensorFlowTrainer._maybe_symbolic_build` drawing no batch when it can, and a local batch, not a reduced one."""
    import tensorflow as tf  # lazy: runs only on the TensorFlow backend, inside `fit`; module import stays TF-free
    from keras.src import tree  # lazy: as tensorflow above

    if self._distribute_strategy is None:
        return
    if data_batch is None and iterator is not None:
        built = _nothing_to_build(self)
        if not built:
            # The element spec builds most models with no iterator (and no batch drawn).
            from trainwell.compat.backend import build_before_fit  # lazy: it imports Keras, as above

            adapter = getattr(iterator, "data_adapter", None)
            try:
                dataset = adapter.get_tf_dataset() if adapter is not None else None
            except Exception:  # noqa: BLE001 - an adapter that cannot: draw a batch as Keras does
                dataset = None
            # A dataset already distributed (`distribute_datasets_from_function`) has per-replica
            # specs: Keras draws a batch from it, as before.
            if isinstance(dataset, tf.data.Dataset):
                build_before_fit(self, dataset)
                built = _nothing_to_build(self)
        if built:
            return  # `_symbolic_build` would do nothing (`_post_build` is a no-op on TensorFlow)
    if iterator is not None:
        for _, _, it in iterator:
            batch = next(it)
            is_distributed = tree.map_structure(
                lambda x: isinstance(x, tf.distribute.DistributedValues), batch
            )
            if all(tree.flatten(is_distributed)):
                strategy = self.distribute_strategy
                # Shapes are all the build needs: the first local replica's batch
                # has them, and taking it needs no cross-worker communication.
                data_batch = tree.map_structure(
                    lambda x: strategy.experimental_local_results(x)[0], batch
                )
            else:
                data_batch = batch
            break
    with self.distribute_strategy.scope():
        self._symbolic_build(data_batch=data_batch)


def _make_fixed_reduce_per_replica(original):
    def reduce_per_replica(values, strategy, reduction):
        """`reduce_per_replica` reducing rank-0 values with `axis=None` under multi-worker."""
        import tensorflow as tf  # lazy: runs only on the TensorFlow backend, inside `fit`
        from keras.src import tree  # lazy: as tensorflow above
        from keras.src.backend.tensorflow import trainer as tf_trainer  # lazy: TensorFlow's trainer

        if reduction == "auto" and not isinstance(strategy, tf.distribute.TPUStrategy):
            reduction = "mean"
        if reduction != "mean" or not tf_trainer._collective_all_reduce_multi_worker(strategy):
            return original(values, strategy, reduction)

        def _reduce(v):
            local = strategy.experimental_local_results(v)[0] if isinstance(
                v, tf.distribute.DistributedValues
            ) else v
            if getattr(getattr(local, "shape", None), "rank", None) == 0:
                return strategy.reduce("MEAN", v, axis=None)
            return original(v, strategy, reduction)

        return tree.map_structure(_reduce, values)

    reduce_per_replica._trainwell_fix = "scalar_reduce"
    return reduce_per_replica


def _target(name: str):
    """(owner, attribute, replacement factory) for fix `name`."""
    mod = importlib.import_module(_TRAINER_MODULE)
    if name == "symbolic_build":
        return mod.TensorFlowTrainer, "_maybe_symbolic_build", lambda _orig: _fixed_maybe_symbolic_build
    return mod, "reduce_per_replica", _make_fixed_reduce_per_replica


# --------------------------------------------------------------------------- apply / remove


def apply(fixes: str | Iterable[str] | None = None, force: bool = False) -> tuple[str, ...]:
    """Applies the fixes (idempotent) and returns the names now applied.

    Does nothing for a Keras version outside `KNOWN_BROKEN` unless `force=True`,
    and skips a fix whose target no longer exists in Keras.

    Args:
        fixes: A name or names from `FIXES`. Defaults to `None` (all of them).
        force: Apply even when the Keras version is not known to be broken.
            Defaults to `False`.

    Returns:
        The names of all fixes applied after the call (see `applied()`).

    Example:
    >>> apply("scalar_reduce")  # doctest: +SKIP
    ('scalar_reduce',)
    """
    names = _names(fixes)
    if not (force or needed()):
        return applied()
    with _lock:
        for name in names:
            if name in _originals:
                continue
            try:
                owner, attr, make = _target(name)
            except ImportError:  # not the TensorFlow backend's trainer
                continue
            # `vars()` so a subclass-inherited attribute is never mistaken for the original.
            original = vars(owner).get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
            if original is None:
                continue
            setattr(owner, attr, make(original))
            _originals[name] = (owner, attr, original)
    return applied()


def apply_for_backend(fixes: str | Iterable[str] | None = None) -> tuple[str, ...]:
    """`apply` where Keras runs TensorFlow's trainer, whose bugs these are; on another backend nothing.

    On JAX nothing is patched and TensorFlow's trainer is not imported.

    Args:
        fixes: A name or names from `FIXES`. Defaults to `None` (all of them).

    Returns:
        The names of all fixes applied after the call (see `applied()`).

    Example:
    >>> apply_for_backend("symbolic_build")  # doctest: +SKIP
    ('symbolic_build',)
    """
    if backend_name() != "tensorflow":
        return applied()
    return apply(fixes)


def remove(fixes: str | Iterable[str] | None = None) -> tuple[str, ...]:
    """Restores Keras's original code for the fixes (idempotent).

    Args:
        fixes: A name or names from `FIXES`. Defaults to `None` (all of them).

    Returns:
        The names of the fixes that were removed by this call.

    Example:
    >>> remove()  # doctest: +SKIP
    ('symbolic_build', 'scalar_reduce')
    """
    names = _names(fixes)
    removed = []
    with _lock:
        for name in names:
            entry = _originals.pop(name, None)
            if entry is None:
                continue
            owner, attr, original = entry
            setattr(owner, attr, original)
            removed.append(name)
    return tuple(n for n in FIXES if n in removed)


@contextlib.contextmanager
def patched(fixes: str | Iterable[str] | None = None, force: bool = False) -> Iterator[tuple[str, ...]]:
    """Context manager: the fixes are applied inside, and the previous state restored after.

    Fixes that were already applied before entering stay applied on exit.

    Args:
        fixes: A name or names from `FIXES`. Defaults to `None` (all of them).
        force: As in `apply`. Defaults to `False`.

    Example:
    >>> with patched():  # doctest: +SKIP
    ...     model.fit(dataset, epochs=1)
    """
    before = set(applied())
    now = apply(fixes, force=force)
    try:
        yield now
    finally:
        remove([n for n in now if n not in before])
