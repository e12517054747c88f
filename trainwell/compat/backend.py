"""What differs between Keras's TensorFlow and JAX trainers, behind one small API.

trainwell's callbacks observe and change the training state between steps
(a checkpoint reads it, a NaN rollback puts an older copy back) and wrap the
train function (a checkpoint skips already-trained batches). Keras's two
trainers keep that state differently:

- TensorFlow: the Keras variables *are* the state; `model.train_function(iterator)`
  updates them in place.
- JAX: the train step is stateless. Inside `fit`, the state is a tuple of
  immutable arrays passed to `model.train_function(state, iterator)` and
  returned updated; the Keras variables are emptied ("purged") at the start of
  an epoch and refilled by `model.jax_state_sync()` at its end (or when a
  callback calls it). The step *donates* its input state (`jax.jit(...,
  donate_argnums=0)`), so an array of a past step is deleted by the next one:
  a snapshot must be a copy.

The API:

- `sync_variables(model)`: make the Keras variables hold the current state and
  make writes to them reach the next step (a no-op on TensorFlow). Call it
  before reading or assigning variables inside a `fit`.
- `StateReader(model, variables)`: the current values of some variables without
  a sync (the NaN check reads a few every step; a sync writes every variable).
- `callback_model(callback)`: a callback's model without the sync that Keras's
  `Callback.model` does on JAX (for per-step hooks that read attributes only).
- `wrap_train_function(fn, step)`: the train function with `step(run, iterator)`
  around it, the same on both trainers.
- `compile_function(fn)`: one compiled dispatch (`tf.function` or `jax.jit`).
  Taking, restoring and computing on the state: `compat.snapshot`.
- `strategy_scope(model)`: where variables for `model` are made (its
  `tf.distribute` strategy's scope on TensorFlow; no scope on JAX).
- `build_before_fit(model, dataset)`: builds before `fit` from the data's element
  spec: one trace of the train step on TensorFlow (not two), and on JAX a
  reshuffling `tf.data` pipeline's k-th iterator stays the k-th epoch.

The checkpoint format never depends on the backend: state is read and written
through Keras variables (NumPy arrays on disk).

Example:
>>> import keras
>>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
>>> sync_variables(model)  # outside fit: nothing to do
>>> [tuple(v.shape) for v in StateReader(model, model.weights)()]
[(2, 1), (1,)]
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable

import keras
import numpy as np

from trainwell.compat.keras_internals import compiled_metrics_unbuilt, model_fully_built, symbolic_build
from trainwell.compat.versions import gate

__all__ = [
    "backend_name",
    "is_jax",
    "backend_tensor",
    "sync_variables",
    "StateReader",
    "callback_model",
    "wrap_train_function",
    "compile_function",
    "kept_on_model",
    "build_before_fit",
    "strategy_scope",
    "add_step_output",
    "StepOutput",
]

# The state tuple of Keras's JAX train step, in its order (`JAXTrainer._get_jax_state`).
_JAX_STATE = ("trainable_variables", "non_trainable_variables", "optimizer_variables", "metrics_variables")


def backend_name() -> str:
    """The Keras backend in use (`keras.backend.backend()`): "tensorflow", "jax", ...

    Example:
    >>> backend_name() in ("tensorflow", "jax", "torch", "numpy")
    True
    """
    return keras.backend.backend()


def is_jax() -> bool:
    """Whether Keras runs on JAX.

    Example:
    >>> is_jax() == (keras.backend.backend() == "jax")
    True
    """
    return backend_name() == "jax"


def backend_tensor(value):
    """`value` (a NumPy array, or a `tf.Tensor` of a `tf.data` batch) as a tensor of the backend in use.

    JAX takes no `tf.Tensor`: it goes through NumPy there.

    Example:
    >>> tuple(backend_tensor(np.ones((2, 3))).shape)
    (2, 3)
    """
    return keras.ops.convert_to_tensor(np.asarray(value) if is_jax() else value)


def _state_variables(model) -> tuple[list, list, list, list]:
    """The model's variables in the order of the JAX train step's state."""
    opt = getattr(model, "optimizer", None)
    return (
        list(model.trainable_variables),
        list(model.non_trainable_variables),
        list(opt.variables) if opt is not None else [],
        list(model.metrics_variables),
    )


def _live_jax_state(model) -> dict | None:
    """The JAX trainer's unsynced state dict inside `fit`, or None when the variables are current."""
    gate("JAXTrainer._jax_state / _jax_state_synced")
    state = getattr(model, "_jax_state", None)
    if not state or getattr(model, "_jax_state_synced", True):
        return None
    return state


def sync_variables(model) -> None:
    """Makes `model`'s Keras variables hold its current training state.

    On JAX inside `fit`, the state lives in arrays outside the variables between
    epochs' ends; this writes them back (Keras's `model.jax_state_sync()`), and
    the next step reads its state from the variables again, so an `assign` made
    after this call reaches training. On TensorFlow, and outside `fit`, nothing
    to do.

    Args:
        model: A Keras model. Required.

    Example:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> sync_variables(model)
    """
    if not is_jax() or _live_jax_state(model) is None:
        return
    model.jax_state_sync()


def callback_model(callback):
    """The model of a Keras `callback`, without the JAX state sync of `Callback.model`.

    On JAX, reading Keras's `Callback.model` inside `fit` writes the whole training state
    back into the variables (`jax_state_sync`), which the next step then reads back: for
    ResNet-50 about 20 ms of host time per read, serial with the accelerator as soon as
    any callback waits for a step's logs (measured on an H200: bench/README.md). Per-step
    hooks that need the model's attributes (its train function, optimizer, strategy,
    `steps_per_execution`) but not variable values use this; values come from
    `StateReader`. On other backends this is `callback.model`.

    Args:
        callback: A `keras.callbacks.Callback` whose `set_model` was called. Required.

    Example:
    >>> import keras
    >>> cb = keras.callbacks.Callback()
    >>> model = keras.Sequential()
    >>> cb.set_model(model)
    >>> callback_model(cb) is model
    True
    """
    if not is_jax():
        return callback.model
    gate("Callback._model")
    return callback._model


class StateReader:
    """The current values of `variables` of `model`, inside or outside `fit`, without a sync.

    On TensorFlow (and on JAX when the variables are current) these are the
    variables' values; on JAX inside `fit`, the arrays of the live state the next
    step will be given. Positions are looked up once.

    Args:
        model: A Keras model. Required.
        variables: Keras variables of `model` (weights, optimizer or metric
            variables). Required.

    Example:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> len(StateReader(model, model.trainable_variables)())
    2
    """

    def __init__(self, model, variables: list) -> None:
        self.model = model
        self.variables = list(variables)
        self._where: list[tuple[int, int]] | None = None

    def _positions(self) -> list[tuple[int, int]]:
        if self._where is None:
            index = {}
            for i, group in enumerate(_state_variables(self.model)):
                for j, v in enumerate(group):
                    index.setdefault(id(v), (i, j))
            missing = [v.path for v in self.variables if id(v) not in index]
            if missing:
                raise ValueError(f"Variables not in the model's training state: {missing[:4]}")
            self._where = [index[id(v)] for v in self.variables]
        return self._where

    def __call__(self) -> list:
        state = _live_jax_state(self.model) if is_jax() else None
        if state is None:
            return [v.value for v in self.variables]
        groups = [state.get(k) for k in _JAX_STATE]
        return [groups[i][j] for i, j in self._positions()]


def wrap_train_function(model, fn: Callable, step: Callable[[Callable, Any], Any]) -> Callable:
    """Keras's train function `fn` with `step(run, iterator)` around it, on either trainer.

    `step` gets `run(iterator)`, which runs `fn` on the coming batches and returns
    its logs, and the batch iterator (to skip batches with `next(iterator)`); it
    returns the logs for the step (it may not call `run` at all). The wrapper has
    the signature the trainer calls: `(iterator)` on TensorFlow, `(state,
    iterator) -> (logs, state)` on JAX, where `sync_variables(model)` inside
    `step` writes the passed state into the variables, and the step then reads
    it back (with whatever `step` assigned). Costs nothing per step otherwise.

    Args:
        model: The model whose `train_function` `fn` is. Required.
        fn: `model.train_function`. Required.
        step: `step(run, iterator) -> logs`. Required.

    Returns:
        The wrapped function, to assign to `model.train_function`.

    Example:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> model.make_train_function()
    >>> model.train_function = wrap_train_function(model, model.train_function, lambda run, it: run(it))
    >>> model.fit(keras.ops.ones((4, 2)), keras.ops.ones((4, 1)), verbose=0).history["loss"][0] > 0
    True
    """
    if not is_jax():

        def train_function(iterator):
            return step(fn, iterator)

        return train_function

    def train_function(state, iterator):
        gate("JAXTrainer._jax_state / _jax_state_synced")
        box = {"state": state}
        model._jax_state = dict(zip(_JAX_STATE, state))  # what `jax_state_sync` writes back if `step` asks
        model._jax_state_synced = False

        def current():
            if model._jax_state_synced:  # `step` synced (and maybe assigned): read the variables back
                box["state"] = _read_jax_state(model)
            return box["state"]

        def run(it):
            logs, box["state"] = fn(current(), it)
            # The step's output is the state now. A sync during the call (tracing the step reads
            # variables, e.g. `add_step_output`'s positions) wrote the *input* arrays into the
            # variables, which the step has donated since: never read them back.
            model._jax_state = dict(zip(_JAX_STATE, box["state"]))
            model._jax_state_synced = False
            return logs

        logs = step(run, iterator)
        return logs, current()

    return train_function


def _read_jax_state(model) -> tuple:
    """The state tuple read from the variables, emptying them as Keras's own fit does."""
    gate("JAXTrainer._get_jax_state")
    state = model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
        purge_model_variables=True,
    )
    model._jax_state_synced = False
    return state


def compile_function(fn: Callable) -> Callable:
    """`fn` compiled into one dispatch: `tf.function` on TensorFlow, `jax.jit` on JAX.

    Args:
        fn: A function of tensors written with `keras.ops`. Required.

    Example:
    >>> f = compile_function(lambda x: keras.ops.sum(x))
    >>> float(f(keras.ops.ones((3,))))
    3.0
    """
    if is_jax():
        import jax  # here: only the JAX backend has it

        return jax.jit(fn)
    if backend_name() == "tensorflow":
        import tensorflow as tf  # here: only the TensorFlow backend compiles with it

        # TensorFlow counts traces per Python code object to warn of "triggered tf.function
        # retracing": the functions compiled from one method for several models (one each,
        # traced once) would add up to that warning. A partial is counted as itself.
        return tf.function(functools.partial(fn), autograph=False)
    return fn


def kept_on_model(model, attr: str, key, make: Callable):
    """`make()`, kept on `model` under `attr` and made again when `key` changes.

    For what a callback compiles for a model (each `fit` makes new callbacks,
    so the model is what outlives them): a later `fit` of the same model, a
    PBT member's kept model or a notebook's second `fit`, reuses it instead of
    tracing again. `key` should name what the made object depends on, e.g.
    the identity of the variables it holds (a model compiled again with a new
    optimizer then gets a new one). The attribute is set past Keras's
    attribute tracking, so it is neither saved nor counted as a layer.

    Args:
        model: The Keras model. Required.
        attr: The attribute's name (one per kind of object). Required.
        key: A comparable value; a different one makes `make()` again. Required.
        make: `make() -> object`. Required.

    Example:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> a = kept_on_model(model, "_my_cache", 1, object)
    >>> kept_on_model(model, "_my_cache", 1, object) is a, kept_on_model(model, "_my_cache", 2, object) is a
    (True, False)
    """
    kept = vars(model).get(attr)
    if kept is not None and kept[0] == key:
        return kept[1]
    made = make()
    object.__setattr__(model, attr, (key, made))
    return made


@contextlib.contextmanager
def reseeding_keeps_compiled_functions():
    """A block in which reseeding keeps the compiled functions ready; yields whether it does.

    On TensorFlow, `keras.utils.set_random_seed` clears the kernel caches, which
    hold each traced function's instantiation: the next call of every traced
    function instantiates it again (`tf_internals.kernel_caches_kept` has the
    figures). Within the block they are kept, unless a traced function holds a
    stateful random op, whose stream restarts only when its kernel is made anew
    (then this yields False and changes nothing). JAX's seeding keeps its
    compiled functions: nothing to do (False).

    Example:
    >>> with reseeding_keeps_compiled_functions() as kept:
    ...     keras.utils.set_random_seed(0)
    """
    if backend_name() != "tensorflow":
        yield False
        return
    from trainwell.compat import tf_internals  # here: it imports TensorFlow, which a JAX run never loads

    if tf_internals.stateful_random_functions():
        yield False
        return
    with tf_internals.kernel_caches_kept():
        yield True


def strategy_scope(model):
    """The context to create variables for `model` in: its `distribute_strategy`'s scope, or none.

    A TensorFlow model carries the `tf.distribute` strategy it was built under;
    optimizer slots, metrics and other variables made for it later (outside
    `fit`) must be made in that scope to be mirrored like its weights. A Keras
    model on JAX has no `distribute_strategy`: no scope.

    Example:
    >>> import keras
    >>> with strategy_scope(keras.Sequential()):
    ...     pass
    """
    strategy = getattr(model, "distribute_strategy", None)
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def build_before_fit(model, dataset) -> None:
    """Builds `model`, its optimizer and its compiled loss and metrics from `dataset`'s element spec before `fit`.

    Extends what Keras's trainers do at the start of `fit` (`Trainer._symbolic_build`),
    for two differences between them:

    - TensorFlow, without a distribution strategy, defers the build to the first
      trace of the train function; the compiled metrics (and an unbuilt optimizer)
      then create their variables inside that trace, and `tf.function` traces the
      whole train step a second time. Building first gives one trace: the first
      two steps of the transformer recipe on MiniLM cost a third less CPU time
      (`bench/first_step.py`).
    - JAX builds from one batch of a fresh iterator of the training data. A
      `tf.data` pipeline shuffled with a fixed seed and
      `reshuffle_each_iteration=True` gives its k-th iterator the k-th order, so
      every epoch would see the next epoch's order: a run resumed on the other
      backend would skip and repeat examples of the resumed epoch. Building from
      the element spec makes the two backends read the same batches.

    An unknown dimension other than the batch (a padded sequence) is built as 1:
    no weight depends on it. On TensorFlow an unbuilt model is built only from a
    spec without such guesses (Keras then builds it from its first batch). A
    no-op for data without an `element_spec` and when everything is built; if
    the spec cannot build the model, Keras's own build runs as before.

    Args:
        model: A compiled Keras model. Required.
        dataset: The training data given to `fit`. Required.

    Example:
    >>> import keras, tensorflow as tf
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse", metrics=["mae"])
    >>> build_before_fit(model, tf.data.Dataset.from_tensors((tf.zeros((4, 2)), tf.zeros((4, 1)))))
    >>> model.optimizer.built
    True
    """
    spec = getattr(dataset, "element_spec", None)
    if spec is None:
        return
    optimizer = getattr(model, "optimizer", None)
    model_built = model_fully_built(model)
    if not compiled_metrics_unbuilt(model) and model_built and (optimizer is None or optimizer.built):
        return
    guessed = any(d is None for s in keras.tree.flatten(spec) if s.shape.rank for d in s.shape[1:])
    if guessed and not model_built and not is_jax():
        return  # TensorFlow: weights are never built from a guessed length (Keras builds from a batch)

    def known(s):
        shape = [s.shape[0], *(1 if d is None else d for d in s.shape[1:])] if s.shape.rank else []
        return keras.KerasTensor(shape, dtype=s.dtype.name)

    try:
        with warnings.catch_warnings(), strategy_scope(model):
            warnings.simplefilter("ignore")  # shapes only: e.g. "softmax over an axis of size 1" for a length of 1
            symbolic_build(model, keras.tree.map_structure(known, spec))
    except Exception:  # noqa: BLE001 - e.g. a layer that needs the real length: Keras builds from a batch
        pass


# --------------------------------------------------------------------------- values computed inside the train step
_STEP_OUTPUTS = "_trainwell_step_outputs"


class StepOutput:
    """One value computed inside a model's compiled train step, carried outside its logs.

    Made by `add_step_output`. After each call of the train function, `take()`
    returns the value of its last step (a device tensor or array, not yet read
    to the host) once, then `None` until the next call; `None` also when the
    train function was not traced with it (or did not run a step).

    Example:
    >>> out = StepOutput()
    >>> out.value = 1.0
    >>> out.take(), out.take()
    (1.0, None)
    """

    def __init__(self) -> None:
        self.fn: Callable | None = None
        self.active = False
        self.value = None

    def take(self):
        value, self.value = self.value, None
        return value


class _StepOutputs:
    """The outputs registered on one model, and the wrappers that compute and carry them."""

    def __init__(self, model) -> None:
        self.model = model
        self.outputs: dict[str, StepOutput] = {}
        self.traced: set[str] = set()  # the keys the current train function computes
        self.train_step = model.train_step  # the bound method (or a user's override)
        self.make_train_function = model.make_train_function

    def step(self, *args):
        """Keras's `train_step` (`(data)` on TensorFlow, `(state, data)` on JAX), plus the outputs in its logs."""
        result = self.train_step(*args)
        logs, state = (result, None) if len(args) == 1 else result
        if state is None:

            def read(variables):
                return [v.value for v in variables]

        else:
            gate("JAXTrainer.train_step -> (logs, state in _JAX_STATE order)")  # at trace time only

            def read(variables):
                return [state[i][j] for i, j in StateReader(self.model, variables)._positions()]

        extra = {}
        for key, out in self.outputs.items():
            if out.active and out.fn is not None:
                value = out.fn(read)
                if value is not None:
                    extra[key] = value
                    self.traced.add(key)
        if extra:
            logs = {**logs, **{_STEP_OUTPUTS + ":" + k: v for k, v in extra.items()}}
        return logs if state is None else (logs, state)

    def make(self, force: bool = False):
        """`make_train_function`, whose result hands the outputs over and returns Keras's logs."""
        if self.model.train_function is not None and not force:
            return self.model.train_function
        self.traced = set()
        result = self.make_train_function(force=force)
        self.model.train_function = _CarryOutputs(self, self.model.train_function)
        return result if result is None else self.model.train_function

    def hand_over(self, logs) -> None:
        prefix = _STEP_OUTPUTS + ":"
        for name in [k for k in logs if isinstance(k, str) and k.startswith(prefix)]:
            value = logs.pop(name)
            out = self.outputs.get(name[len(prefix) :])
            if out is not None:
                out.value = value


class _CarryOutputs:
    """The train function, with the step outputs taken out of its logs (one dict scan per call)."""

    def __init__(self, owner: _StepOutputs, fn: Callable) -> None:
        self.owner, self.fn = owner, fn

    def __call__(self, *args):
        result = self.fn(*args)
        logs = result[0] if len(args) == 2 else result  # (state, iterator) -> (logs, state) on JAX
        if len(logs) > 0:  # a dict of tensors; a step that ran nothing returns {}
            self.owner.hand_over(logs)
        return result


def add_step_output(model, key: str, fn: Callable) -> StepOutput:
    """Computes `fn(read)` inside `model`'s compiled train step, after its update.

    `read(variables)` gives the values the step leaves in those Keras variables
    (the model's, its optimizer's or its metrics'); `fn` returns a tensor, or
    a tuple of them (each output tensor costs a little Python in every call;
    `None`: nothing to add), built with `keras.ops`. The value reaches the
    host only when the caller reads what `StepOutput.take()` returns, so it
    costs no dispatch and no sync of its own: a callback that reads it in
    `on_train_batch_end` waits for the same step Keras's own logs wait for.
    Under a `tf.distribute` strategy, `fn` runs per replica and the values
    are averaged over the replicas (Keras's reduction of a train step's
    outputs); with `steps_per_execution=N`, the value is that of the N-th step.

    How: the model's `train_step` and `make_train_function` are wrapped (on
    this instance, once); the value travels in the step's logs under a private
    name and is taken out of them as the train function returns, before Keras
    or any callback sees the logs. If the model's train function was made
    without `key`, it is dropped so that `fit` makes (and traces) it again; a
    traced train function keeps `key` until the model is compiled again, so
    later fits do not retrace. Call it before `fit` makes its train function
    (from a callback's `set_model`); `StepOutput.active = False` leaves `fn`
    out of the next trace.

    Args:
        model: A compiled Keras model. Required.
        key: A name for this output, unique per model. Required.
        fn: `fn(read) -> tensor or None`. Required.

    Returns:
        The `StepOutput` to `take()` the value from.

    Example:
    >>> import keras, numpy as np
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> out = add_step_output(model, "bias", lambda read: read([model.layers[0].bias])[0][0])
    >>> h = model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
    >>> sorted(h.history), float(out.take()) != 0.0
    (['loss'], True)
    """
    owner = vars(model).get(_STEP_OUTPUTS)
    if owner is None:
        owner = _StepOutputs(model)
        object.__setattr__(model, _STEP_OUTPUTS, owner)
        object.__setattr__(model, "train_step", owner.step)
        object.__setattr__(model, "make_train_function", owner.make)
    out = owner.outputs.setdefault(key, StepOutput())
    out.fn, out.active, out.value = fn, True, None
    if model.train_function is not None and key not in owner.traced:
        model.train_function = None  # made without it: fit makes it again
    return out
