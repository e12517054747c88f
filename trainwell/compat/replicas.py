"""The state a `tf.distribute` replica keeps for itself: reading it from every replica, writing it back.

Keras 3 creates a layer's variables with `aggregation="none"`. Under a
`tf.distribute` strategy with several replicas (`MirroredStrategy`,
`MultiWorkerMirroredStrategy`, `cpu:N`), a variable a layer assigns inside the
train step is then updated by each replica on its own copy: BatchNormalization's
moving statistics are each replica's moving average of its own batches' moments
(Keras BatchNorm is not synchronised; tf.keras kept a `MEAN` on-read aggregate of
them). Reading such a variable outside a replica (`get_weights`, a checkpoint's
capture, `model.save`) gives the first replica's copy, and assigning it writes
every copy: a save and a restore make every replica start from the first
replica's statistics, so a resumed run evaluates differently from the run it
continues (each replica evaluates its share of the validation data with its own
statistics) until the moving averages have forgotten the difference.

The same holds for metric accumulators, which Keras creates on-read
(`synchronization="on_read"`, `aggregation="sum"`): each replica sums its own
batches, a read outside a replica sums the replicas, and an assignment there
splits the value evenly over them, so after a mid-epoch restore the epoch's
mean loss differed from the uninterrupted run's in its last bits.

`per_replica_variables` names a layer's such variables; `replica_reader` returns one
compiled call that reads every replica's copy (an all-gather across the workers
of a multi-worker strategy: every worker must call it at the same point), and
`replica_writer` one that writes each replica its own row back.
`trainwell.callbacks.checkpoint` keeps them in a checkpoint (`replica:` arrays)
so that a resumed run continues exactly.

TensorFlow backend only: on JAX the variables are not `tf.distribute` copies
(`num_replicas` is 1 and nothing is read or written). Public `tf.distribute`
API only.

Example:
>>> import keras
>>> bn = keras.layers.BatchNormalization()
>>> bn.build((None, 3))
>>> [v.name for v in per_replica_variables(bn)]
['moving_mean', 'moving_variance']
"""

from __future__ import annotations

from typing import Callable

import keras
import numpy as np

__all__ = ["num_replicas", "per_replica_variables", "replica_reader", "replica_writer", "variable_strategy"]


def per_replica_variables(layer) -> list:
    """The variables of `layer` that each replica updates on its own in a train step.

    BatchNormalization's (and its subclasses') variables other than `gamma` and
    `beta`: the moving mean and variance (and batch renormalisation's moving
    statistics). Other layers' non-trainable variables (a frozen layer's
    weights) are the same on every replica and are not included.

    Args:
        layer: A Keras layer (any object: a non-layer has none).

    Returns:
        A list of Keras variables (empty for other layers).
    """
    if not isinstance(layer, keras.layers.BatchNormalization):
        return []
    learned = {id(getattr(layer, "gamma", None)), id(getattr(layer, "beta", None))}
    return [v for v in layer.weights if id(v) not in learned]


def _raw(v):
    return getattr(v, "value", v) if isinstance(v, keras.Variable) else v


def num_replicas(strategy) -> int:
    """Replicas of `strategy` over every worker; 1 for none or a non-TensorFlow strategy.

    Args:
        strategy: A `tf.distribute.Strategy`, or anything else (None, a JAX strategy).

    Returns:
        `strategy.num_replicas_in_sync` for a `tf.distribute.Strategy`, else 1.
    """
    if strategy is None or keras.backend.backend() != "tensorflow":
        return 1
    import tensorflow as tf  # here: TensorFlow backend only

    if not isinstance(strategy, tf.distribute.Strategy):
        return 1
    return int(strategy.num_replicas_in_sync)


def variable_strategy(variable):
    """The `tf.distribute.Strategy` `variable` was created under, or None (not a distributed variable).

    Args:
        variable: A Keras or TensorFlow variable.

    Returns:
        The variable's `distribute_strategy`, or None.

    Example:
    >>> variable_strategy(keras.Variable(1.0)) is None
    True
    """
    return getattr(_raw(variable), "distribute_strategy", None)


def _groups(variables: list) -> dict:
    """Indices of `variables` by dtype: one flat vector per dtype is gathered."""
    out: dict = {}
    for i, v in enumerate(variables):
        out.setdefault(_raw(v).dtype, []).append(i)
    return out


def replica_reader(strategy, variables: list) -> Callable[[], list[np.ndarray]]:
    """A call returning each variable's copy on every replica, stacked: `[replicas, *shape]`.

    One compiled function: each replica reads its copies and flattens them into
    one vector per dtype, and `strategy.gather` concatenates the replicas'
    vectors in replica order (`replica_id_in_sync_group`). Under
    `MultiWorkerMirroredStrategy` the gather is a collective: every worker must
    make the call at the same point, and every worker gets every replica's values.

    Args:
        strategy: A `tf.distribute.Strategy` with more than one replica.
        variables: Keras (or TensorFlow) variables created under `strategy`.

    Returns:
        A callable with no arguments returning one NumPy array per variable.

    Example:
    >>> import tensorflow as tf
    >>> strategy = tf.distribute.get_strategy()  # one replica: rows of shape [1, ...]
    >>> v = keras.Variable([1.0, 2.0])
    >>> replica_reader(strategy, [v])()[0].tolist()
    [[1.0, 2.0]]
    """
    import tensorflow as tf  # here: TensorFlow backend only

    raw = [_raw(v) for v in variables]
    groups = _groups(raw)

    def local():
        return [tf.concat([tf.reshape(raw[i], [-1]) for i in idx], 0)[None] for idx in groups.values()]

    @tf.function(autograph=False)
    def gather():
        per_replica = strategy.run(local)
        return [strategy.gather(x, axis=0) for x in per_replica]

    def read() -> list[np.ndarray]:
        out: list = [None] * len(raw)
        for idx, rows in zip(groups.values(), gather()):
            rows, start = rows.numpy(), 0
            for i in idx:
                size = int(np.prod(raw[i].shape))
                out[i] = rows[:, start:start + size].reshape((rows.shape[0], *raw[i].shape))
                start += size
        return out

    return read


def replica_writer(strategy, variables: list) -> Callable[[list], None]:
    """A call writing each replica's copy of each variable from its row: the inverse of `replica_reader`.

    `write(values)` takes one array per variable, `[replicas, *shape]`; the
    replica with `replica_id_in_sync_group` r assigns row r to its own copy
    (a variable with `aggregation="none"`, or an on-read one, assigned inside a
    replica changes that replica's copy only). No communication: each worker
    writes its own replicas.

    Args:
        strategy: A `tf.distribute.Strategy`.
        variables: Keras (or TensorFlow) variables created under `strategy`,
            with `aggregation="none"` or `synchronization="on_read"`.

    Returns:
        A callable taking the list of arrays.
    """
    import tensorflow as tf  # here: TensorFlow backend only

    raw = [_raw(v) for v in variables]

    def local(values):
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        for v, x in zip(raw, values):
            v.assign(tf.gather(x, r))

    @tf.function(autograph=False)
    def write(values):
        strategy.run(local, args=(values,))

    def call(values: list) -> None:
        write([tf.convert_to_tensor(np.asarray(x), dtype=v.dtype) for v, x in zip(raw, values)])

    return call
