"""Private TensorFlow names trainwell reads, behind one accessor each (the TF backend only).

Kept apart from `keras_internals` because they exist only with TensorFlow: a
JAX run never imports this module. Each accessor calls
`versions.gate(name, "tensorflow")`; `audit()` lists the names the installed
TensorFlow lacks, and `tests/trainwell/compat/` fails on any.

Example:
>>> audit()
[]
"""

from __future__ import annotations

import inspect

import numpy as np
import tensorflow as tf

from trainwell.compat.versions import gate

__all__ = ["audit", "tf_global_generator", "host_array", "strategy_num_workers", "dataset_batch_size"]


def tf_global_generator():
    """TensorFlow's global `tf.random.Generator` if one was created, else None (never creates one).

    `tf.random.get_global_generator()` would create it; a checkpoint must not
    change the RNG state it saves. Reads `stateful_random_ops.global_generator`.

    Example:
    >>> g = tf_global_generator()
    >>> g is None or isinstance(g, tf.random.Generator)
    True
    """
    gate("stateful_random_ops.global_generator", "tensorflow")
    from tensorflow.python.ops import stateful_random_ops  # here: TF's private module only when a checkpoint needs it

    return getattr(stateful_random_ops, "global_generator", None)


def host_array(value) -> np.ndarray:
    """A tensor as a NumPy array without a copy on the CPU (`EagerTensor._numpy`); anything else via `np.asarray`.

    Keep `value` alive while the array is in use: the array views its buffer.

    Example:
    >>> host_array(tf.constant([1.0, 2.0])).tolist()
    [1.0, 2.0]
    """
    if hasattr(value, "_numpy"):
        gate("EagerTensor._numpy", "tensorflow")
        try:
            return np.asarray(value._numpy())
        except Exception:  # pragma: no cover - a symbolic tensor: the public path below
            pass
    if hasattr(value, "numpy"):
        value = value.numpy()
    return np.asarray(value)


def strategy_num_workers(strategy) -> int | None:
    """The number of workers of a `tf.distribute` strategy (`strategy.extended._num_workers`), or None.

    Example:
    >>> strategy_num_workers(tf.distribute.get_strategy()) is None
    True
    """
    gate("StrategyExtended._num_workers", "tensorflow")
    n = getattr(getattr(strategy, "extended", None), "_num_workers", None)
    return None if n is None else int(n)


def dataset_batch_size(dataset) -> int | None:
    """The batch size a batched `tf.data.Dataset` was made with, read from its graph (no element read), or None.

    TensorFlow's `data.experimental.ops.distribute.compute_batch_size`, which
    Keras's own `DataParallel.distribute_tf_dataset` reads the global batch with.

    Example:
    >>> dataset_batch_size(tf.data.Dataset.range(10).batch(4))
    4
    """
    gate("data.experimental.ops.distribute.compute_batch_size", "tensorflow")
    from tensorflow.python.data.experimental.ops import distribute  # here: TF's private module only when needed

    try:
        n = int(distribute.compute_batch_size(dataset).numpy())
    except (IndexError, ValueError, NotImplementedError, tf.errors.OpError):  # not batched, or no batch op found
        return None
    return n if n > 0 else None


def audit() -> list[str]:
    """The private TensorFlow names used here that the installed TensorFlow lacks (`[]`: all there).

    Example:
    >>> audit()
    []
    """
    from tensorflow.python.ops import stateful_random_ops  # here: only an audit imports TF's private module

    missing = []
    if not hasattr(stateful_random_ops, "global_generator"):
        missing.append("stateful_random_ops.global_generator")
    if not hasattr(tf.constant(0.0), "_numpy"):
        missing.append("EagerTensor._numpy")
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars  # here: as above

    if "self._num_workers =" not in inspect.getsource(cars.CollectiveAllReduceExtended):
        missing.append("CollectiveAllReduceExtended._num_workers")
    from tensorflow.python.data.experimental.ops import distribute  # here: as above

    if not hasattr(distribute, "compute_batch_size"):
        missing.append("data.experimental.ops.distribute.compute_batch_size")
    return missing
