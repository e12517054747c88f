"""Taking, putting back and computing on a model's training state, the same on TensorFlow and JAX.

Three callbacks work on the training state between steps: `NaNRollback` keeps
a copy of the weights and optimizer variables and puts it back when training
diverges, `Checkpoint` reads every variable (and the global RNGs) to write them
to disk, and the doctor's `GradientProbe` keeps the weights before a step and
runs a forward and backward pass that must leave the state as it was. Keras's
two trainers keep that state differently (`compat.backend`), and the
difference lives here:

- TensorFlow: a compiled read returns the variables' values as tensors without
  a copy. TensorFlow updates a variable whose buffer a read tensor still holds
  copy-on-write, so the tensors keep their values while training goes on (the
  copy is made by the next update, on the device).
- JAX: the state is immutable arrays, and the next train step deletes the
  arrays it is given (donation): a snapshot is a device copy of the live
  state's arrays, read without a sync (`compat.backend.StateReader`).

The API:

- `state_function(model, variables, fn)`: `fn(values)` of the variables'
  current values, compiled into one call; `keep(values)` inside it: values that
  outlive the next train step.
- `in_one_call(*functions)`: several of them in one compiled call.
- `Snapshot.of(model, variables)`: `take()` the values, `restore()` them (as
  often as needed), read them as `values`; `Snapshot(read, assign)` for compiled
  functions made (and kept) by the caller with `read_function` and
  `assign_function`.
- `function_on_state(model, fn)`: `fn(state, *args)` compiled, on the current
  values of the model's variables, leaving them as they were.
- `to_host(value)`: a value read above as a NumPy array.
- `tf_rng_state()` / `set_tf_rng_state(...)`: TensorFlow's global generator, the
  one global RNG that only one backend has.
- `outside_trace()`, `initialized(variables)`: for a snapshot taken while
  TensorFlow traces the train function (its trainer builds an unbuilt model
  inside the first trace).

Example:
>>> import keras
>>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, bias_initializer="ones")])
>>> snap = Snapshot.of(model, model.weights)
>>> snap.take()
>>> _ = model.layers[0].bias.assign([5.0])
>>> snap.restore()
>>> float(model.layers[0].bias.numpy()[0])
1.0
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import keras
import numpy as np

from trainwell.compat.backend import StateReader, compile_function, is_jax, sync_variables

__all__ = [
    "Snapshot",
    "state_function",
    "keep",
    "in_one_call",
    "read_function",
    "assign_function",
    "function_on_state",
    "to_host",
    "tf_rng_state",
    "set_tf_rng_state",
    "outside_trace",
    "initialized",
]


class _OnValues:
    """`fn([v.value for v in variables], *args)`, for one `tf.function` (TensorFlow).

    The variables are read inside the compiled function (captured, not passed).
    A callable object, not a closure: TensorFlow's retracing detector counts the
    traces of a closure's code over every model, and would warn when several
    models each trace their own.
    """

    def __init__(self, fn: Callable, variables: list) -> None:
        self.fn, self.variables = fn, list(variables)

    def __call__(self, *args):
        return self.fn([v.value for v in self.variables], *args)


class _OnLiveState:
    """`fn(values)` compiled with `jax.jit`, given the live state's arrays of `variables` (JAX)."""

    def __init__(self, model, variables: list, fn: Callable) -> None:
        self.reader, self.fn = StateReader(model, variables), compile_function(fn)

    def __call__(self):
        return self.fn(self.reader())


def state_function(model, variables: list, fn: Callable) -> Callable[[], Any]:
    """`fn(values)` of the current values of `variables`, compiled into one call without arguments.

    `fn` is written with `keras.ops`; `values` are the variables' values in
    training now, also inside a JAX `fit` (without a sync). One dispatch, and
    traced once: on TensorFlow a `tf.function` that reads the variables, on JAX
    `jax.jit(fn)` given the live state's arrays.

    Args:
        model: The Keras model whose training state the variables are. Required.
        variables: Keras variables of `model` (its weights, its optimizer's or
            its metrics'). Required.
        fn: `fn(values) -> tensors`. Required.

    Returns:
        The compiled function.

    Example:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, bias_initializer="ones")])
    >>> total = state_function(model, model.weights, lambda vals: keras.ops.sum(vals[1]))
    >>> float(total())
    1.0
    """
    if is_jax():
        return _OnLiveState(model, variables, fn)
    import tensorflow as tf  # lazy: TensorFlow at import time, which a JAX run need not load

    return tf.function(_OnValues(fn, variables), autograph=False)


class _Together:
    """`tuple(f() for f in functions)`, for one `tf.function` (TensorFlow; see `_OnValues`)."""

    def __init__(self, functions) -> None:
        self.functions = list(functions)

    def __call__(self):
        return tuple(f() for f in self.functions)


class _LiveTogether:
    """`_OnLiveState` functions in one `jax.jit` (JAX): each one's `fn` on its own reader's arrays."""

    def __init__(self, functions) -> None:
        import jax  # lazy: only the JAX backend has it

        self.functions = list(functions)
        self.fn = jax.jit(lambda values: tuple(f.fn(v) for f, v in zip(self.functions, values)))

    def __call__(self):
        return self.fn([f.reader() for f in self.functions])


def in_one_call(*functions) -> Callable[[], tuple]:
    """The `state_function`s `functions` called together in one compiled call; returns their results.

    One dispatch instead of one each. On TensorFlow each function is traced
    inside this one's trace once, and its trace is shared with its own calls.

    Example:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, bias_initializer="ones")])
    >>> read = read_function(model, model.weights)
    >>> count = state_function(model, model.weights, lambda vals: keras.ops.size(vals[0]))
    >>> values, n = in_one_call(read, count)()
    >>> int(n), len(values)
    (2, 2)
    """
    if is_jax():
        return _LiveTogether(functions)
    import tensorflow as tf  # lazy: TensorFlow at import time

    return tf.function(_Together(functions), autograph=False)


def keep(values: list) -> list:
    """Inside a `state_function`: `values` as tensors that keep their values after the next train step.

    On TensorFlow a read (`tf.identity`): copy-on-write keeps it as it was; on
    JAX a device copy, since the next step deletes the arrays it is given.

    Example:
    >>> import keras
    >>> v = keras.Variable([1.0, 2.0])
    >>> read = state_function(keras.Sequential(), [v], keep)
    >>> before = read()
    >>> _ = v.assign([5.0, 6.0])
    >>> [float(x) for x in before[0]]
    [1.0, 2.0]
    """
    if is_jax():
        import jax.numpy as jnp  # lazy: only the JAX backend has it

        return [jnp.copy(x) for x in values]
    import tensorflow as tf  # lazy: TensorFlow at import time

    return [tf.identity(x) for x in values]


def read_function(model, variables: list) -> Callable[[], list]:
    """One compiled call returning the current values of `variables`, kept as they are (`keep`).

    One dispatch instead of one eager read per variable.

    Example:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> [tuple(x.shape) for x in read_function(model, model.weights)()]
    [(2, 1), (1,)]
    """
    return state_function(model, variables, keep)


class _Assign:
    """`variables[i].assign(values[i])` for all i, for one `tf.function` (TensorFlow; see `_OnValues`)."""

    def __init__(self, variables: list) -> None:
        self.variables = list(variables)

    def __call__(self, values) -> None:
        for v, x in zip(self.variables, values):
            v.value.assign(x)


_COPY: list = []


def _copies(values: list) -> list:
    """Device copies of JAX arrays, in one dispatch (the next train step deletes the arrays it is given)."""
    if not _COPY:
        import jax  # lazy: only the JAX backend has it

        _COPY.append(jax.jit(keep))
    return list(_COPY[0](list(values)))


class _AssignCopies:
    """Writes copies of `values` into `variables` after a sync, so the next step starts from them (JAX)."""

    def __init__(self, model, variables: list) -> None:
        self.model, self.variables = model, list(variables)

    def __call__(self, values) -> None:
        sync_variables(self.model)
        for v, a in zip(self.variables, _copies(values)):  # copies: `values` stay valid for another restore
            v.assign(a)


def assign_function(model, variables: list) -> Callable[[list], None]:
    """`assign(values)`: writes values read by `read_function` back into `variables`, also inside `fit`.

    On TensorFlow one compiled call (under a `tf.distribute` strategy it writes
    every replica); on JAX the variables are synced and given copies of the
    values, and the next train step starts from them. `values` stay valid for
    another call.

    Example:
    >>> import keras
    >>> v = keras.Variable([1.0])
    >>> assign_function(keras.Sequential(), [v])([keras.ops.ones((1,)) * 3])
    >>> float(v.numpy()[0])
    3.0
    """
    if is_jax():
        return _AssignCopies(model, variables)
    import tensorflow as tf  # lazy: TensorFlow at import time

    return tf.function(_Assign(variables), autograph=False)


class Snapshot:
    """A copy of the values of some of a model's training-state variables: take it, put it back.

    `take()` reads the values now in one compiled call (on TensorFlow without a
    copy: copy-on-write keeps them); `restore()` writes them back, and the
    snapshot stays valid for another restore. The snapshot lives on the device
    that holds the variables.

    Args:
        read: `read() -> values`, e.g. `read_function(model, variables)`. Required.
        assign: `assign(values)`, e.g. `assign_function(model, variables)`. Required.

    Attributes:
        values: The values taken (device tensors or arrays), or `None`.

    Example:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> snap = Snapshot.of(model, model.weights)
    >>> snap.values is None
    True
    """

    def __init__(self, read: Callable[[], list], assign: Callable[[list], None]) -> None:
        self.read, self.assign = read, assign
        self.values: list | None = None

    @classmethod
    def of(cls, model, variables: list) -> "Snapshot":
        """A snapshot of `variables` of `model`, with compiled functions of its own."""
        return cls(read_function(model, variables), assign_function(model, variables))

    def take(self, values: list | None = None) -> None:
        """Takes the values now, or `values` (read by `read` or a function that calls it)."""
        self.values = list(self.read() if values is None else values)

    def restore(self) -> None:
        """Writes the values taken back into the variables."""
        self.assign(self.values)


class _KeepingState:
    """`fn(state, *args)` on the variables' values, with the non-trainable and metric ones put back (TensorFlow)."""

    def __init__(self, model, fn: Callable) -> None:
        self.model, self.fn = model, fn

    def __call__(self, *args):
        import tensorflow as tf  # lazy: TensorFlow at import time

        m = self.model
        state = tuple([v.value for v in g] for g in (m.trainable_variables, m.non_trainable_variables,
                                                      m.metrics_variables))
        touched = state[1] + state[2]  # a training-mode forward pass updates BatchNorm's statistics, seeds...
        saved = [tf.identity(v) for v in touched]
        out = self.fn(state, *args)
        with tf.control_dependencies([v.assign(s) for v, s in zip(touched, saved)]):
            return tf.nest.map_structure(tf.identity, out)


class _OnState:
    """`jax.jit(fn)(state, *args)` with the live state's values: stateless already (JAX)."""

    def __init__(self, model, fn: Callable) -> None:
        m = model
        self.readers = [StateReader(m, g) for g in (m.trainable_variables, m.non_trainable_variables,
                                                     m.metrics_variables)]
        self.fn = compile_function(fn)

    def __call__(self, *args):
        return self.fn(tuple(r() for r in self.readers), *args)


def function_on_state(model, fn: Callable) -> Callable:
    """`fn(state, *args)` compiled into one call, on the model's training state now, leaving it as it was.

    `state` is `(trainable, non_trainable, metrics)`: the values of the model's
    variables in training now (also inside a JAX `fit`), for
    `model.stateless_call` / `stateless_compute_loss` and statistics. Whatever
    `fn` runs (a forward pass with `training=True`), the model's non-trainable
    and metric variables keep their values: on JAX `fn` is stateless; on
    TensorFlow, where a layer updates its variables as it runs, they are put
    back in the same compiled call.

    Args:
        model: A built Keras model. Required.
        fn: `fn(state, *args) -> tensors`, with `keras.ops`. Required.

    Returns:
        The compiled function of `*args`.

    Example:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, bias_initializer="ones")])
    >>> float(function_on_state(model, lambda state: keras.ops.sum(state[0][1]))())
    1.0
    """
    if is_jax():
        return _OnState(model, fn)
    import tensorflow as tf  # lazy: TensorFlow at import time

    return tf.function(_KeepingState(model, fn), autograph=False)


def to_host(value) -> np.ndarray:
    """A value read by `read_function` as a NumPy array (keep `value` alive while using it).

    On TensorFlow's CPU the array shares the tensor's buffer (no copy).

    Example:
    >>> to_host(keras.ops.ones((2,))).tolist()
    [1.0, 1.0]
    """
    if not is_jax():
        try:
            from trainwell.compat.tf_internals import host_array  # lazy: TensorFlow, and only when writing
        except ImportError:  # another backend without TensorFlow
            pass
        else:
            return host_array(value)
    return np.asarray(value.numpy() if hasattr(value, "numpy") else value)


def tf_rng_state() -> tuple[np.ndarray, int] | None:
    """TensorFlow's global generator as `(state, algorithm)`, or `None` (not made yet, or no TensorFlow).

    Python's, NumPy's and Keras's global RNGs are the same on every backend;
    TensorFlow's exists where TensorFlow runs (a JAX run's `tf.data` included).

    Example:
    >>> tf_rng_state() is None or len(tf_rng_state()) == 2
    True
    """
    try:
        from trainwell.compat.tf_internals import tf_global_generator  # lazy: TensorFlow at import time
    except ImportError:
        return None
    g = tf_global_generator()
    return None if g is None else (g.state.numpy(), int(g.algorithm))


def set_tf_rng_state(state: np.ndarray, algorithm: int | None) -> None:
    """Sets TensorFlow's global generator to what `tf_rng_state` returned.

    Example:
    >>> saved = tf_rng_state()
    >>> if saved is not None:
    ...     set_tf_rng_state(*saved)
    """
    import tensorflow as tf  # lazy: TensorFlow at import time; only a state taken under it gets here

    gen = tf.random.get_global_generator()
    if algorithm is None or int(gen.algorithm) == int(algorithm):
        gen.reset(state)
    else:
        tf.random.set_global_generator(tf.random.Generator.from_state(state, algorithm))


def outside_trace():
    """A context that runs eagerly, also while a train function is traced (`tf.init_scope`; nothing on JAX).

    Example:
    >>> with outside_trace():
    ...     pass
    """
    if is_jax():
        return contextlib.nullcontext()
    import tensorflow as tf  # lazy: TensorFlow at import time

    return tf.init_scope()


def initialized(variables: list) -> bool:
    """Whether every variable holds a value (on TensorFlow, one made in a function's first trace has none until then).

    Example:
    >>> initialized([keras.Variable(1.0)])
    True
    """
    if is_jax():
        return True
    return all(bool(v.value.is_initialized()) for v in variables)
