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

import contextlib
import inspect
import time

import numpy as np
import tensorflow as tf

from trainwell.compat.versions import gate, upstream_changed

__all__ = [
    "audit", "tf_global_generator", "host_array", "strategy_num_workers", "dataset_batch_size",
    "wait_for_coordination_leader", "kernel_caches_kept", "stateful_random_functions", "stop_data_service_server",
]


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
    from tensorflow.python.ops import stateful_random_ops  # lazy: TensorFlow's private module only when a checkpoint needs it

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
    from tensorflow.python.data.experimental.ops import distribute  # lazy: TensorFlow's private module only when needed

    try:
        n = int(distribute.compute_batch_size(dataset).numpy())
    except (IndexError, ValueError, NotImplementedError, tf.errors.OpError):  # not batched, or no batch op found
        return None
    return n if n > 0 else None


#: A key of the coordination service's key-value store that nothing sets: reading it
#: blocks until the service goes away (or the wait times out).
_NEVER_SET_KEY = "trainwell/coordination-leader-exited"
#: Longest time (seconds) one read of that key stays pending on the leader
#: (see `wait_for_coordination_leader`).
_LEADER_POLL_S = 1.0


def wait_for_coordination_leader(timeout_s: float) -> bool:
    """Blocks until this task's coordination service is gone (its leader process ended), at most `timeout_s`.

    A multi-worker TensorFlow job's coordination service lives in its leader (the
    chief, else worker 0); every other task sends it heartbeats. A task that exits
    while the leader is still alive (writing its last files, or tearing down) misses
    heartbeats, and the leader logs "The tasks have crashed" for a job that
    succeeded (tensorflow/tensorflow#58434). A task that waits here leaves after the
    leader: the wait reads a key that nothing sets (`context.get_config_key_value`),
    which fails with `UnavailableError` once the leader's server is down. Each read
    stays pending at most `_LEADER_POLL_S` seconds (a precaution: no read is left
    pending on a leader that is shutting down; runs with one read for the whole
    wait showed no such hold).

    Args:
        timeout_s: Longest wait in seconds.

    Returns:
        True when the leader's service went away; False when the wait timed out or
        this process has no coordination service (nothing to wait for).

    Example:
    >>> wait_for_coordination_leader(1.0)  # a single process has no coordination service
    False
    """
    gate("context.Context.get_config_key_value", "tensorflow")
    from tensorflow.python.eager import context  # lazy: TensorFlow's private module only at the end of a multi-worker run

    ctx = context.context()
    if ctx.coordination_service is None:
        return False
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            ctx.get_config_key_value(_NEVER_SET_KEY, timeout_in_ms=max(1, int(min(left, _LEADER_POLL_S) * 1000)))
        except tf.errors.UnavailableError:
            return True
        except tf.errors.DeadlineExceededError:
            continue  # the leader is still there: read again
        except tf.errors.OpError:  # the service refused the read (e.g. it is shutting down)
            return False
        return False  # pragma: no cover - someone set the key
    return False


# --------------------------------------------------------------------------- reseeding without re-instantiation
@contextlib.contextmanager
def kernel_caches_kept():
    """Within the block, `tf.random.set_seed` keeps TensorFlow's kernel caches.

    TensorFlow's eager `Context._set_global_seed` (what `tf.random.set_seed` and
    `keras.utils.set_random_seed` call) clears the context's kernel caches
    (`TFE_ContextClearCaches`), so that stateful random kernels (`RandomUniform`
    and the like) restart from the new seed. Those caches also hold each traced
    function's instantiation: the next call of every `tf.function` instantiates
    it again (TensorFlow's graph optimizer runs again: a cost per function, see
    bench/README.md, "Moved from docstrings"). Within the block
    the seed and the operation-seed sequence are set exactly as without it; only
    the caches stay. Used by PBT's model cache while a segment runs, so the
    members' kept models stay ready (see `trainwell.tuning.tuners.ModelCache`).

    Example:
    >>> with kernel_caches_kept():
    ...     tf.random.set_seed(0)
    """
    gate("context.Context._set_global_seed", "tensorflow")
    from tensorflow.python import pywrap_tfe  # lazy: TensorFlow's private modules only when the caches are kept
    from tensorflow.python.eager import context

    clear = getattr(pywrap_tfe, "TFE_ContextClearCaches", None)
    original = context.Context.__dict__.get("_set_global_seed")
    if clear is None or original is None:
        raise upstream_changed("context.Context._set_global_seed", "tensorflow",
                               "it clears the kernel caches through pywrap_tfe.TFE_ContextClearCaches")

    def set_global_seed(ctx, seed):
        pywrap_tfe.TFE_ContextClearCaches = lambda handle: None  # looked up at each call by context.py
        try:
            original(ctx, seed)
        finally:
            pywrap_tfe.TFE_ContextClearCaches = clear

    context.Context._set_global_seed = set_global_seed
    try:
        yield
    finally:
        context.Context._set_global_seed = original


# --------------------------------------------------------------------------- op determinism, on and off again
def op_determinism_enabled() -> bool:
    """Whether `tf.config.experimental.enable_op_determinism()` is in effect (TensorFlow has no public reader).

    Example:
    >>> op_determinism_enabled()
    False
    """
    gate("framework.config.is_op_determinism_enabled", "tensorflow")
    from tensorflow.python.framework import config  # lazy: TensorFlow's private module, only for this switch

    return bool(config.is_op_determinism_enabled())


def disable_op_determinism() -> None:
    """Turns TensorFlow's op determinism off again: `enable_op_determinism` has no public way back.

    A run with `deterministic=True` turns it on for the whole process; left on after
    the run, unseeded `tf.random` ops and the global generator refuse to run.

    Example:
    >>> disable_op_determinism()
    """
    gate("framework.config.disable_op_determinism", "tensorflow")
    from tensorflow.python.framework import config  # lazy: TensorFlow's private module, only for this switch

    config.disable_op_determinism()


_RANDOM_OPS_BY_FUNCTION: dict[str, bool] = {}


def _stateful_random_op(op_type: str) -> bool:
    """A stateful op with `seed`/`seed2` attributes: its random state lives in its kernel (`RandomUniform`, ...)."""
    from tensorflow.python.framework import op_def_registry  # lazy: TensorFlow's private module, as in kernel_caches_kept

    op_def = op_def_registry.get(op_type)
    if op_def is None:  # a function call: that function is checked on its own
        return False
    attrs = {a.name for a in op_def.attr}
    return op_def.is_stateful and {"seed", "seed2"} <= attrs


def stateful_random_functions() -> list[str]:
    """The traced functions of the eager context whose graph holds a stateful random op.

    Such an op's state lives in its kernel: keeping the kernel caches through a
    reseeding (`kernel_caches_kept`) would continue its stream where a fresh
    process restarts it. Keras 3 draws its randomness with stateless ops and
    seed-generator variables, so a Keras model's functions hold none. Each
    function is read once (a function's definition never changes).

    Example:
    >>> isinstance(stateful_random_functions(), list)
    True
    """
    gate("context.Context.list_function_names", "tensorflow")
    from tensorflow.python.eager import context  # lazy: TensorFlow's private module, as in kernel_caches_kept

    ctx = context.context()
    known = {}  # only the functions alive now: a long search traces thousands
    for name in ctx.list_function_names():
        known[name] = _RANDOM_OPS_BY_FUNCTION.get(name)
        if known[name] is None:
            known[name] = any(_stateful_random_op(n.op) for n in ctx.get_function_def(name).node_def)
    _RANDOM_OPS_BY_FUNCTION.clear()
    _RANDOM_OPS_BY_FUNCTION.update(known)
    return [name for name, holds in known.items() if holds]


def stop_data_service_server(server) -> None:
    """Stops a tf.data service `DispatchServer` or `WorkerServer` now (`server._stop()`: the public API has only `join`).

    Example:
    >>> svc = tf.data.experimental.service
    >>> stop_data_service_server(svc.DispatchServer(svc.DispatcherConfig(port=0)))
    """
    gate("tf.data.experimental.service.DispatchServer._stop", "tensorflow")
    server._stop()


def audit() -> list[str]:
    """The private TensorFlow names used here that the installed TensorFlow lacks (`[]`: all there).

    Example:
    >>> audit()
    []
    """
    from tensorflow.python.ops import stateful_random_ops  # lazy: only an audit imports TensorFlow's private module

    missing = []
    svc = tf.data.experimental.service
    if not (hasattr(svc.DispatchServer, "_stop") and hasattr(svc.WorkerServer, "_stop")):
        missing.append("tf.data.experimental.service.DispatchServer._stop")
    from tensorflow.python.framework import config  # lazy: TensorFlow's private module, as above

    if not (hasattr(config, "is_op_determinism_enabled") and hasattr(config, "disable_op_determinism")):
        missing.append("framework.config.disable_op_determinism")
    if not hasattr(stateful_random_ops, "global_generator"):
        missing.append("stateful_random_ops.global_generator")
    if not hasattr(tf.constant(0.0), "_numpy"):
        missing.append("EagerTensor._numpy")
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars  # lazy: TensorFlow's private module, as above

    if "self._num_workers =" not in inspect.getsource(cars.CollectiveAllReduceExtended):
        missing.append("CollectiveAllReduceExtended._num_workers")
    from tensorflow.python.data.experimental.ops import distribute  # lazy: TensorFlow's private module, as above

    if not hasattr(distribute, "compute_batch_size"):
        missing.append("data.experimental.ops.distribute.compute_batch_size")
    from tensorflow.python.eager import context  # lazy: TensorFlow's private module, as above

    ctx_cls = context.Context
    if not (hasattr(ctx_cls, "get_config_key_value") and hasattr(ctx_cls, "coordination_service")
            and "timeout_in_ms" in inspect.signature(ctx_cls.get_config_key_value).parameters):
        missing.append("context.Context.get_config_key_value")
    from tensorflow.python import pywrap_tfe  # lazy: TensorFlow's private module, as above

    if "TFE_ContextClearCaches" not in inspect.getsource(ctx_cls._set_global_seed) or not hasattr(
            pywrap_tfe, "TFE_ContextClearCaches"):
        missing.append("context.Context._set_global_seed")
    if not (hasattr(ctx_cls, "list_function_names") and hasattr(ctx_cls, "get_function_def")):
        missing.append("context.Context.list_function_names")
    return missing
