"""Where the two backends' distribution differs: `tf.distribute` on TensorFlow, `keras.distribution` on JAX.

`trainwell.runtime` is the public face (`make_strategy`, `num_workers`,
`any_across_workers`, `broadcast_from_chief`, `sync_workers`, `is_chief`,
`fit_scope`, precision); each of its functions is one call here, which picks the
backend's half: by Keras's backend (`make_strategy`, the devices) or by the kind of
strategy (the collectives: a JAX strategy, or `None` once `jax.distributed` runs,
is JAX's; anything else is TensorFlow's). The TensorFlow half is below, the JAX
half is `jax_distribution`. TensorFlow and JAX are imported only by the half that
runs.

Example:
>>> num_workers(None), is_chief(None)
(1, True)
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any, Callable

import numpy as np

from trainwell.compat import jax_distribution
from trainwell.compat.backend import backend_name
from trainwell.validation import invalid_argument

__all__ = [
    "make_strategy", "is_strategy", "ensure_logical_cpus", "fit_scope", "tpu_visible", "gpu_compute_capabilities",
    "num_workers", "is_chief", "any_across_workers", "broadcast_from_chief", "sync_workers",
    "LEADER_EXIT_WAIT_S",
]

#: Longest time (seconds) a non-chief TensorFlow worker waits, after the last
#: barrier, for the chief's process to end (see `sync_workers`). The chief's teardown
#: usually takes seconds, but at interpreter exit each of its tf.data iterators may wait
#: out its autotune thread's sleep (up to 60 s); a worker gone 10 s before the chief is
#: reported as crashed. The wait ends as soon as the chief's process has.
LEADER_EXIT_WAIT_S = 300.0


def _tf():
    # lazy: TensorFlow loads on first use (never on the JAX backend's paths)
    import tensorflow as tf

    return tf


def _on_jax() -> bool:
    return backend_name() == "jax"


# --------------------------------------------------------------------------- strategies
def make_strategy(spec: Any, collective_timeout: Callable[[], float | None] = lambda: None):
    """The strategy for a valid spec (`trainwell.runtime.validate_strategy_spec`) on Keras's backend.

    A `tf.distribute.Strategy` on TensorFlow (see `trainwell.runtime.make_strategy`),
    a `JaxStrategy` on JAX (see `jax_distribution.make_strategy`).

    Args:
        spec: The spec or strategy.
        collective_timeout: Returns the seconds a TensorFlow multi-worker collective
            waits for a peer (`None`: forever); read only for a multi-worker strategy.

    Example:
    >>> make_strategy("auto")  # doctest: +SKIP
    """
    if _on_jax():
        return jax_distribution.make_strategy(spec)
    tf = _tf()
    strategy = _make_tf_strategy(spec, tf, collective_timeout)
    if strategy is not tf.distribute.get_strategy():
        # Keras draws (and drops) a batch at the start of every `fit` under a strategy,
        # which TensorFlow's single-device input pipeline sometimes survives only with
        # a segfault; the fix draws none when nothing needs building (`keras_fixes`).
        _apply_keras_fixes("symbolic_build")
    return strategy


def is_strategy(obj) -> bool:
    """Whether `obj` is a strategy of either backend (`tf.distribute`, `JaxStrategy`, `keras.distribution`).

    Imports neither TensorFlow nor Keras: a strategy exists only once they are loaded.
    """
    tf = sys.modules.get("tensorflow")
    return (isinstance(obj, jax_distribution.JaxStrategy) or jax_distribution.is_keras_distribution(obj)
            or (tf is not None and isinstance(obj, tf.distribute.Strategy)))


def _make_tf_strategy(spec: Any, tf, collective_timeout):
    if isinstance(spec, tf.distribute.Strategy):
        if isinstance(spec, tf.distribute.MultiWorkerMirroredStrategy):
            _apply_keras_fixes()  # all of them: the multi-worker fix among them
        return spec
    if not isinstance(spec, str):
        raise invalid_argument(
            "strategy", "a spec string or a tf.distribute.Strategy: a keras.distribution strategy needs Keras's "
            "JAX backend (KERAS_BACKEND=jax) and this process runs TensorFlow", spec)
    if spec.startswith("model_parallel:"):
        raise ValueError("strategy='model_parallel:DxM' runs on Keras's JAX backend only (KERAS_BACKEND=jax); "
                         f"on TensorFlow use 'mirrored', 'multiworker' or 'cpu:N'. Received: strategy={spec!r}")
    if spec.startswith("cpu:"):
        devices = ensure_logical_cpus(int(spec[4:]))
        if len(devices) == 1:
            return tf.distribute.OneDeviceStrategy(devices[0])
        return tf.distribute.MirroredStrategy(devices=devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
    if spec == "auto":
        if tpu_requested():
            spec = "tpu"
        elif tf_config_cluster() is not None:
            spec = "multiworker"
        elif tf.config.list_physical_devices("GPU"):
            spec = "mirrored"
        else:
            return tf.distribute.get_strategy()
    if spec == "mirrored":
        return tf.distribute.MirroredStrategy()
    if spec == "one_device":
        gpus = tf.config.list_logical_devices("GPU")
        return tf.distribute.OneDeviceStrategy(gpus[0].name if gpus else "/cpu:0")
    if spec == "multiworker":
        _apply_keras_fixes()  # all of them: the multi-worker fix among them
        timeout = collective_timeout()
        if timeout is None:
            return tf.distribute.MultiWorkerMirroredStrategy()
        options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout)
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    # spec == "tpu"
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=os.environ.get("TPU_NAME", ""))
    tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
    return tf.distribute.TPUStrategy(resolver)


def _apply_keras_fixes(fixes=None) -> None:
    # lazy: keras_fixes imports TensorFlow, which only the TensorFlow half loads
    from trainwell.compat import keras_fixes

    keras_fixes.apply(fixes)


def ensure_logical_cpus(n: int) -> list[str]:
    """Splits the host CPU into `n` logical TensorFlow devices and returns their names.

    Must run before TensorFlow initialises its devices (before the first op). If
    it already did with a different count, raises a `RuntimeError` that says so.

    Args:
        n: Number of logical CPU devices, >= 1.

    Returns:
        Device names, e.g. `["/cpu:0", "/cpu:1"]`.

    Example:
    >>> ensure_logical_cpus(2)  # doctest: +SKIP
    ['/cpu:0', '/cpu:1']
    """
    if not isinstance(n, int) or n < 1:
        raise invalid_argument("n", "an int >= 1", n)
    tf = _tf()
    cpus = tf.config.list_physical_devices("CPU")
    try:
        current = tf.config.get_logical_device_configuration(cpus[0])
    except Exception:  # pragma: no cover
        current = None
    if current is None or len(current) != n:
        try:
            tf.config.set_logical_device_configuration(
                cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
            )
        except RuntimeError:
            have = len(tf.config.list_logical_devices("CPU"))
            if have != n:
                raise RuntimeError(
                    f"strategy='cpu:{n}' needs {n} logical CPU devices but TensorFlow is already "
                    f"initialised with {have}. Call trainwell.runtime.make_strategy('cpu:{n}') before "
                    "running any TensorFlow op (or start a fresh process)."
                ) from None
    return [f"/cpu:{i}" for i in range(n)]


def tf_config_cluster() -> dict | None:
    """`TF_CONFIG` when it names a cluster of more than one task, else None."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return None
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"TF_CONFIG is not valid JSON ({e}). Received: TF_CONFIG={raw!r}") from None
    cluster = cfg.get("cluster") or {}
    n = sum(len(v) for v in cluster.values() if isinstance(v, list))
    return cfg if n > 1 else None


def tpu_requested() -> bool:
    """Whether the environment names a TPU (`TPU_NAME`, Colab's `COLAB_TPU_ADDR`, `/dev/accel0`)."""
    return bool(os.environ.get("TPU_NAME") or os.environ.get("COLAB_TPU_ADDR") or os.path.exists("/dev/accel0"))


# --------------------------------------------------------------------------- devices
def tpu_visible() -> bool:
    """Whether Keras's backend sees a TPU device (or the environment names one)."""
    if tpu_requested():
        return True
    if _on_jax():
        return bool(jax_distribution.local_devices("tpu"))
    return bool(_tf().config.list_logical_devices("TPU"))


def gpu_compute_capabilities() -> list[tuple[int, int]]:
    """Compute capabilities of the visible GPUs, as Keras's backend sees them (see `trainwell.runtime`)."""
    if _on_jax():  # TensorFlow may see no GPU there, or be absent
        return jax_distribution.gpu_compute_capabilities()
    tf = _tf()
    caps = []
    for gpu in tf.config.list_physical_devices("GPU"):
        cc = tf.config.experimental.get_device_details(gpu).get("compute_capability")
        if cc:
            caps.append(tuple(int(c) for c in cc))
    return caps


# --------------------------------------------------------------------------- collectives, by kind of strategy
def fit_scope(strategy):
    """The context `fit` runs in: the strategy's scope on JAX, none on TensorFlow (see `trainwell.runtime`)."""
    if isinstance(strategy, jax_distribution.JaxStrategy):
        return strategy.scope()
    return contextlib.nullcontext()


def num_workers(strategy) -> int:
    """Worker processes taking part in `strategy` (see `trainwell.runtime.num_workers`)."""
    group = jax_distribution.process_group(strategy)
    if group is not None:
        return group[1]
    if strategy is None:
        return 1
    # lazy: it imports TensorFlow, which a strategy has loaded already
    from trainwell.compat.tf_internals import strategy_num_workers

    n = strategy_num_workers(strategy)
    return n if n is not None and n > 0 else 1


def is_chief(strategy=None) -> bool:
    """Whether this process is the chief (see `trainwell.runtime.is_chief`)."""
    group = jax_distribution.process_group(strategy)
    if group is not None:
        return group[0] == 0
    resolver = getattr(strategy, "cluster_resolver", None) if strategy is not None else None
    if resolver is not None and getattr(resolver, "task_type", None) is not None:
        task_type, task_id = resolver.task_type, resolver.task_id
        spec = resolver.cluster_spec().as_dict()
    else:
        raw = os.environ.get("TF_CONFIG")
        if not raw:
            return True
        try:
            cfg = json.loads(raw)
        except json.JSONDecodeError:
            return True
        task = cfg.get("task") or {}
        task_type, task_id = task.get("type"), task.get("index", 0)
        spec = cfg.get("cluster") or {}
    if task_type is None or task_type == "chief":
        return True
    return task_type == "worker" and int(task_id or 0) == 0 and "chief" not in spec


def any_across_workers(strategy, replica_flags, per_replica: bool) -> list[bool]:
    """Element-wise OR of `replica_flags(replica_id)` over every replica (see `trainwell.runtime`).

    Args:
        strategy: The strategy, or `None`.
        replica_flags: `replica_id -> list of booleans`.
        per_replica: Whether replicas may disagree (else every replica of this
            process has `replica_flags(0)`, and one worker needs no collective).
    """
    group = jax_distribution.process_group(strategy)
    if group is not None:
        return jax_distribution.any_across_processes(strategy, group[1], replica_flags, per_replica)
    if strategy is None or (not per_replica and num_workers(strategy) <= 1):
        return replica_flags(0)
    tf = _tf()

    def value_fn(ctx):
        return tf.constant([1 if v else 0 for v in replica_flags(ctx.replica_id_in_sync_group)], dtype=tf.int32)

    per_replica_values = strategy.experimental_distribute_values_from_function(value_fn)
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_values, axis=None)
    return [bool(x > 0) for x in np.asarray(total).reshape(-1)]


def broadcast_from_chief(strategy, values: np.ndarray) -> list[int]:
    """The chief's int64 `values` on every worker (see `trainwell.runtime.broadcast_from_chief`)."""
    group = jax_distribution.process_group(strategy)
    if group is not None:
        return values.tolist() if group[1] <= 1 else jax_distribution.broadcast_from_process_0(values)
    if strategy is None:
        return values.tolist()
    tf = _tf()

    def value_fn(ctx):
        keep = ctx.replica_id_in_sync_group == 0  # replica 0 lives on the chief, the first task of the group
        return tf.constant(values if keep else np.zeros_like(values), dtype=tf.int64)

    per_replica = strategy.experimental_distribute_values_from_function(value_fn)
    return np.asarray(strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)).reshape(-1).tolist()


def sync_workers(strategy) -> None:
    """A barrier of every worker, then (TensorFlow) the wait for the chief's end (see `trainwell.runtime`).

    A non-chief TensorFlow worker waits for the chief's end even when the barrier
    failed, then raises the barrier's error: the chief may still be running, and its
    coordination service reports a worker gone before it as crashed.
    """
    if jax_distribution.process_group(strategy) is not None:
        jax_distribution.barrier()
        return
    try:
        any_across_workers(strategy, lambda _: [False], per_replica=False)
    except Exception:
        _wait_for_chief(strategy)
        raise
    _wait_for_chief(strategy)


def _wait_for_chief(strategy) -> None:
    """On a non-chief TensorFlow worker, waits (at most `LEADER_EXIT_WAIT_S`) until the chief's process has ended."""
    if not is_chief(strategy):
        # lazy: it imports TensorFlow, which a multi-worker strategy has loaded already
        from trainwell.compat.tf_internals import wait_for_coordination_leader

        wait_for_coordination_leader(LEADER_EXIT_WAIT_S)
