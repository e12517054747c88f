"""Runtime: distribution strategy, precision policy, seeding, cross-worker helpers.

These are thin, explicit wrappers over `tf.distribute` (TensorFlow backend),
`keras.distribution` (JAX backend) and `keras.mixed_precision`: Keras already
provides the machinery, what it lacks is one call that picks the right thing for
the machine (`"auto"`), a way to test data parallelism without GPUs (`"cpu:N"`
logical or host devices), and a run directory whose manifest says exactly what ran
(`trainwell.rundir`).

The backend is Keras's (`KERAS_BACKEND`). On TensorFlow a strategy is a
`tf.distribute.Strategy`; on JAX it is a `JaxStrategy` around a
`keras.distribution.DataParallel` (or none), used the same way: models are built
under `strategy.scope()` and `num_replicas(strategy)` counts the replicas.

Why one module: everything here is what a process settles before it builds a
model (devices, strategy, precision, seeds), and the cross-worker helpers
(`any_across_workers`, `broadcast_from_chief`, `sync_workers`) branch on the kind
of strategy this module makes; read it top to bottom in that order.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from typing import Any

import numpy as np


#: Seeds go to `random`, NumPy and TensorFlow; NumPy's legacy seed takes 32 bits.
MAX_SEED = 2**32 - 1
STRATEGY_SPECS = ("auto", "mirrored", "multiworker", "tpu", "one_device", "cpu:N")
PRECISION_SPECS = ("auto", "mixed_float16", "mixed_bfloat16", "float32")
_CPU_RE = re.compile(r"^cpu:(\d+)$")


def _tf():
    # lazy: TensorFlow loads on first use, not with this module
    import tensorflow as tf

    return tf


def validate_strategy_spec(spec: Any) -> None:
    """Raises `ValueError` unless `spec` is a valid strategy spec or instance.

    Example:
    >>> validate_strategy_spec("cpu:2")
    """
    if isinstance(spec, str):
        m = _CPU_RE.match(spec)
        if spec in STRATEGY_SPECS[:-1] or (m and int(m.group(1)) >= 1):
            return
    elif isinstance(spec, JaxStrategy) or _is_keras_distribution(spec):
        return
    elif _is_tf_strategy(spec):
        return
    raise ValueError(
        "Invalid value for argument `strategy`. Expected one of "
        f"{', '.join(repr(s) for s in STRATEGY_SPECS)} (N >= 1), a tf.distribute.Strategy (TensorFlow "
        f"backend) or a keras.distribution DataParallel/ModelParallel (JAX backend). Received: strategy={spec!r}"
    )


def _keras_backend() -> str:
    # lazy: Keras loads on first use, not with this module
    import keras

    return keras.config.backend()


def _is_tf_strategy(obj) -> bool:
    tf = sys.modules.get("tensorflow")  # a strategy exists only once TensorFlow is loaded: never import it here
    return tf is not None and isinstance(obj, tf.distribute.Strategy)


def _is_keras_distribution(obj) -> bool:
    # Keras exports no base class of its distributions; these are the two it offers.
    keras = sys.modules.get("keras")  # never imports Keras for this check
    return keras is not None and isinstance(obj, (keras.distribution.DataParallel, keras.distribution.ModelParallel))


def _tf_config_cluster() -> dict | None:
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


def _tpu_requested() -> bool:
    return bool(os.environ.get("TPU_NAME") or os.environ.get("COLAB_TPU_ADDR") or os.path.exists("/dev/accel0"))


def ensure_logical_cpus(n: int) -> list[str]:
    """Splits the host CPU into `n` logical devices and returns their names.

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
        raise ValueError(f"Invalid value for argument `n`. Expected an int >= 1. Received: n={n!r}")
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


def make_strategy(spec: Any = "auto"):
    """Returns the distribution strategy for `spec` on Keras's backend.

    On the TensorFlow backend the result is a `tf.distribute.Strategy`; on the JAX
    backend a `JaxStrategy` (see `make_jax_strategy` for what each spec means there).

    Args:
        spec: One of (TensorFlow backend):
            - `"auto"`: a TPU when one is configured (`TPU_NAME`, Colab, `/dev/accel0`),
              else `MultiWorkerMirroredStrategy` when `TF_CONFIG` names a cluster of more
              than one task, else `MirroredStrategy` over all GPUs, else the default
              (single-device) strategy.
            - `"mirrored"`: `MirroredStrategy` over all visible GPUs (or the CPU).
            - `"multiworker"`: `MultiWorkerMirroredStrategy` from `TF_CONFIG`.
            - `"tpu"`: `TPUStrategy` on the resolved TPU.
            - `"one_device"`: `OneDeviceStrategy` on the first GPU, else the CPU.
            - `"cpu:N"`: N logical CPU devices mirrored, so data parallelism can be tested
              without GPUs. Must be requested before TensorFlow initialises.
            - an existing `tf.distribute.Strategy`, returned as is.
            Defaults to `"auto"`.

    Returns:
        The strategy.

    Example:
    >>> strategy = make_strategy("auto")
    >>> with strategy.scope():  # doctest: +SKIP
    ...     model = build_model()
    """
    validate_strategy_spec(spec)
    if _keras_backend() == "jax":
        return make_jax_strategy(spec)
    tf = _tf()
    strategy = _make_tf_strategy(spec, tf)
    if strategy is not tf.distribute.get_strategy():
        # Keras draws (and drops) a batch at the start of every `fit` under a strategy,
        # which TensorFlow's single-device input pipeline sometimes survives only with
        # a segfault; the fix draws none when nothing needs building (`keras_fixes`).
        _apply_keras_fixes("symbolic_build")
    return strategy


def _make_tf_strategy(spec: Any, tf):
    """`make_strategy` on the TensorFlow backend, before the Keras fixes it needs."""
    if isinstance(spec, tf.distribute.Strategy):
        if isinstance(spec, tf.distribute.MultiWorkerMirroredStrategy):
            _apply_keras_fixes()  # all of them: the multi-worker fix among them
        return spec
    if not isinstance(spec, str):
        raise ValueError(
            "Invalid value for argument `strategy`. A keras.distribution strategy needs Keras's JAX backend "
            f"(KERAS_BACKEND=jax); this process runs TensorFlow. Received: strategy={spec!r}"
        )
    m = _CPU_RE.match(spec)
    if m:
        devices = ensure_logical_cpus(int(m.group(1)))
        if len(devices) == 1:
            return tf.distribute.OneDeviceStrategy(devices[0])
        return tf.distribute.MirroredStrategy(
            devices=devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
        )
    if spec == "auto":
        if _tpu_requested():
            spec = "tpu"
        elif _tf_config_cluster() is not None:
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
        return _make_multiworker(tf)
    # spec == "tpu"
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=os.environ.get("TPU_NAME", ""))
    tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
    return tf.distribute.TPUStrategy(resolver)


def _apply_keras_fixes(fixes=None) -> None:
    # lazy: it imports Keras/TensorFlow; loaded on first use, not with this module
    from trainwell.compat import keras_fixes

    keras_fixes.apply(fixes)


# --------------------------------------------------------------------------- the JAX backend
#: Keras's own environment variables for `keras.distribution.initialize()` (JAX multi-process);
#: `trainwell.launch` sets them for every local worker, as it sets `TF_CONFIG`.
KERAS_DISTRIBUTION_ENV = (
    "KERAS_DISTRIBUTION_JOB_ADDRESSES", "KERAS_DISTRIBUTION_NUM_PROCESSES", "KERAS_DISTRIBUTION_PROCESS_ID",
)
_HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


class JaxStrategy:
    """The JAX backend's counterpart of a `tf.distribute.Strategy`: a `keras.distribution` to build under.

    Keras's JAX trainer reads the *global* `keras.distribution.distribution()`
    whenever it creates variables or feeds a batch; it has no strategy object that
    a model keeps, as TensorFlow's has. This wrapper gives the recipes the one
    interface they use on both backends: `with strategy.scope():` (sets the
    distribution, restores the previous one on exit: Keras's own
    `Distribution.scope()`), `num_replicas_in_sync` and `num_workers`. With no
    distribution (one device) `scope()` changes nothing, like TensorFlow's default
    strategy. Build the model, compile **and fit/evaluate** inside the scope: on JAX a
    `fit` outside it feeds every batch whole to every device (no data parallelism).

    Args:
        distribution: A `keras.distribution.DataParallel` (or `ModelParallel`),
            or `None` for a single device. Defaults to `None`.

    Example:
    >>> strategy = JaxStrategy()
    >>> strategy.num_replicas_in_sync
    1
    >>> with strategy.scope():  # doctest: +SKIP
    ...     model = build_model(); model.compile(...); model.fit(...)
    """

    def __init__(self, distribution=None):
        if distribution is not None and not _is_keras_distribution(distribution):
            raise ValueError(
                "Invalid value for argument `distribution`. Expected a keras.distribution DataParallel/ModelParallel "
                f"or None. Received: distribution={distribution!r}"
            )
        self.distribution = distribution

    @property
    def num_replicas_in_sync(self) -> int:
        """Data-parallel replicas over every process (the devices of the mesh's batch axis)."""
        if self.distribution is None:
            return 1
        mesh = self.distribution.device_mesh
        return int(mesh.shape[mesh.axis_names.index(self.distribution.batch_dim_name)])

    @property
    def num_workers(self) -> int:
        """Processes taking part (`jax.process_count()`; 1 unless `jax.distributed` is initialised)."""
        return _jax_process_group(self)[1]

    def local_replica_ids(self) -> list[int]:
        """Indices, in the mesh, of this process's devices (`[0]` without a distribution)."""
        if self.distribution is None:
            return [0]
        # lazy: a JaxStrategy exists only once JAX is loaded
        import jax

        me = jax.process_index()
        devices = self.distribution.device_mesh.backend_mesh.devices.flat
        return [i for i, d in enumerate(devices) if d.process_index == me]

    @contextlib.contextmanager
    def scope(self):
        """Makes the distribution current (Keras's `Distribution.scope()`); restores the previous one on exit."""
        if self.distribution is None:
            yield self
            return
        with self.distribution.scope():
            yield self

    def __repr__(self) -> str:
        return f"JaxStrategy({self.distribution!r}, num_replicas_in_sync={self.num_replicas_in_sync})"


def ensure_host_devices(n: int) -> list:
    """Gives JAX `n` CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=n`) and returns them.

    The JAX counterpart of `ensure_logical_cpus`. XLA reads the flag once, when JAX
    initialises its backends (its first computation or device query), so this must
    run before that; importing Keras or JAX is early enough. If JAX already runs with
    another number of CPU devices, raises a one-line `RuntimeError` that says so.

    Args:
        n: Number of CPU devices, >= 1.

    Returns:
        The `jax.Device`s.

    Example:
    >>> ensure_host_devices(2)  # doctest: +SKIP
    [CpuDevice(id=0), CpuDevice(id=1)]
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"Invalid value for argument `n`. Expected an int >= 1. Received: n={n!r}")
    flags = re.sub(rf"{_HOST_DEVICES_FLAG}=\S*", "", os.environ.get("XLA_FLAGS", "")).split()
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"{_HOST_DEVICES_FLAG}={n}"])
    # lazy: JAX loads with Keras's JAX backend only
    import jax

    devices = jax.local_devices(backend="cpu")
    if len(devices) != n:
        raise RuntimeError(
            f"strategy='cpu:{n}' needs {n} JAX CPU devices but JAX is already initialised with {len(devices)}: "
            f"call trainwell.runtime.make_strategy('cpu:{n}') before any JAX computation, or start the process "
            f"with XLA_FLAGS={_HOST_DEVICES_FLAG}={n}."
        )
    return devices


def _jax_multiprocess_requested() -> bool:
    raw = os.environ.get("KERAS_DISTRIBUTION_NUM_PROCESSES", "").strip()
    return raw.isdigit() and int(raw) > 1


def initialize_jax_processes() -> None:
    """Joins this process to its JAX multi-process job (`keras.distribution.initialize()`), once.

    Keras reads `KERAS_DISTRIBUTION_JOB_ADDRESSES` (the first address is the
    coordinator), `KERAS_DISTRIBUTION_NUM_PROCESSES` and
    `KERAS_DISTRIBUTION_PROCESS_ID` (set by `trainwell train --workers N`);
    without them `jax.distributed.initialize()` detects the cluster itself (Slurm,
    Cloud TPU, ...). Must run before any JAX computation. A second call does nothing.

    Example:
    >>> initialize_jax_processes()  # doctest: +SKIP
    """
    # lazy: JAX loads with Keras's JAX backend only
    import jax
    import keras

    if jax.distributed.is_initialized():
        return
    try:
        keras.distribution.initialize()
    except (ValueError, RuntimeError) as e:
        missing = [k for k in KERAS_DISTRIBUTION_ENV if not os.environ.get(k)]
        raise RuntimeError(
            f"strategy='multiworker' on JAX could not join its processes ({str(e).splitlines()[0]}). "
            + (f"Set {', '.join(missing)} (trainwell train --workers N does), or run where "
               "jax.distributed detects the cluster." if missing else
               "Call make_strategy before any JAX computation, in a fresh process.")
        ) from None


def make_jax_strategy(spec: Any = "auto") -> JaxStrategy:
    """The `JaxStrategy` for `spec` on Keras's JAX backend.

    Args:
        spec: One of:
            - `"auto"`: several processes when `KERAS_DISTRIBUTION_NUM_PROCESSES` > 1
              or `jax.distributed` is initialised (as `"multiworker"`), else
              `keras.distribution.DataParallel` over the local accelerators (GPUs,
              TPU cores) when there are several, else no distribution (one device).
            - `"mirrored"`, `"tpu"`: `DataParallel` over the local devices (`"tpu"`: TPU cores).
            - `"multiworker"`: `initialize_jax_processes()`, then `DataParallel` over
              every device of every process.
            - `"one_device"`: no distribution (JAX's default device).
            - `"cpu:N"`: `DataParallel` over N CPU devices (`ensure_host_devices`), so
              data parallelism can be tested without accelerators; N = 1: none.
            - a `JaxStrategy` (returned as is) or a `keras.distribution` `DataParallel`/`ModelParallel` (wrapped).
            Defaults to `"auto"`.

    Returns:
        The `JaxStrategy`.

    Example:
    >>> make_jax_strategy("cpu:2").num_replicas_in_sync  # doctest: +SKIP
    2
    """
    validate_strategy_spec(spec)
    if isinstance(spec, JaxStrategy):
        return spec
    if not isinstance(spec, str):
        if not _is_keras_distribution(spec):
            raise ValueError(
                "Invalid value for argument `strategy`. A tf.distribute.Strategy cannot distribute a model on Keras's "
                "JAX backend; pass a spec string or a keras.distribution DataParallel/ModelParallel. "
                f"Received: strategy={spec!r}"
            )
        return JaxStrategy(spec)
    # lazy: JAX loads with Keras's JAX backend only
    import jax

    m = _CPU_RE.match(spec)
    if m:
        devices = ensure_host_devices(int(m.group(1)))
        if jax.distributed.is_initialized():
            devices = jax.devices("cpu")  # every process's
        return _data_parallel(devices) if len(devices) > 1 else JaxStrategy(None)
    if spec == "auto" and (_jax_multiprocess_requested() or jax.distributed.is_initialized()):
        spec = "multiworker"
    if spec == "multiworker":
        initialize_jax_processes()
        return _data_parallel(jax.devices())
    if spec == "one_device":
        return JaxStrategy(None)
    if spec == "tpu":
        devices = _jax_local_devices("tpu")
        if not devices:
            raise RuntimeError("strategy='tpu' on JAX: no TPU device is visible (jax.local_devices()).")
    else:
        devices = jax.local_devices()
        if spec == "auto" and len(devices) == 1:
            return JaxStrategy(None)
    return _data_parallel(devices)


def _data_parallel(devices) -> JaxStrategy:
    return JaxStrategy(_even_batches_data_parallel()(devices=list(devices)))


_EVEN_BATCHES: list = []


def _even_batches_data_parallel():
    """The class `EvenBatchesDataParallel` (made on first use: Keras loads lazily)."""
    if _EVEN_BATCHES:
        return _EVEN_BATCHES[0]
    # lazy: Keras loads on first use, not with this module
    import keras

    from trainwell.data.batches import pad_partial_batches

    class EvenBatchesDataParallel(keras.distribution.DataParallel):
        """Keras's `DataParallel` whose datasets split evenly: a short last batch is padded.

        Keras's `DataParallel` splits each batch evenly over every process's
        devices; an evaluation split whose size is not a multiple of the global
        batch ends with a batch that does not split (several processes: the
        processes get different numbers of batches and the last collective waits
        for ever; one process: the split fails). Before Keras shards a
        `tf.data.Dataset` over the processes, this pads such a dataset's batches
        to one size with zero-weighted examples (`trainwell.data.batches.
        pad_partial_batches`): every example is scored once and the loss and
        `weighted_metrics` equal a one-process evaluation. Metrics compiled as
        `metrics=` ignore sample weights (Keras) and count the padding.
        `make_strategy` builds this for `"auto"`, `"cpu:N"` and `"multiworker"`.

        Example:
        >>> make_jax_strategy("cpu:2").distribution  # doctest: +SKIP
        <EvenBatchesDataParallel device_mesh=...>
        """

        def distribute_dataset(self, dataset):
            replicas = JaxStrategy(self).num_replicas_in_sync
            if replicas > 1:
                dataset = pad_partial_batches(dataset, replicas)
            return super().distribute_dataset(dataset)

    _EVEN_BATCHES.append(EvenBatchesDataParallel)
    return EvenBatchesDataParallel


def _jax_local_devices(platform: str) -> list:
    # lazy: JAX loads with Keras's JAX backend only
    import jax

    return [d for d in jax.local_devices() if d.platform == platform]


def _jax_process_group(strategy) -> tuple[int, int] | None:
    """`(process index, process count)` when `strategy` is a JAX one or JAX runs multi-process, else None."""
    jax = sys.modules.get("jax")  # never imports JAX for this check
    if jax is None or not (isinstance(strategy, JaxStrategy) or _is_keras_distribution(strategy)
                           or (strategy is None and jax.distributed.is_initialized())):
        return None
    return jax.process_index(), jax.process_count()


#: Environment variable: seconds a cross-worker collective may wait for a peer
#: before it fails (`CommunicationOptions(timeout_seconds=...)`); unset or `0`:
#: no per-collective timeout. A crashed peer is detected without it: TensorFlow's
#: coordination service aborts the collectives of the others when the peer stops
#: sending heartbeats (seconds on loopback). The timeout also catches a peer that
#: is alive but stuck; keep it above the slowest step + the chief's checkpoint write.
COLLECTIVE_TIMEOUT_ENV = "TRAINWELL_COLLECTIVE_TIMEOUT_S"
#: Default of `COLLECTIVE_TIMEOUT_ENV` (None: no per-collective timeout).
DEFAULT_COLLECTIVE_TIMEOUT_S = None


def collective_timeout_s() -> float | None:
    """Seconds a multi-worker collective waits for a peer (`None`: forever).

    Read from the environment variable `TRAINWELL_COLLECTIVE_TIMEOUT_S`
    (unset or `0`: no timeout).

    Example:
    >>> collective_timeout_s() is None or collective_timeout_s() > 0
    True
    """
    raw = os.environ.get(COLLECTIVE_TIMEOUT_ENV, "")
    if not raw.strip():
        return DEFAULT_COLLECTIVE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"Invalid value for environment variable `{COLLECTIVE_TIMEOUT_ENV}`. Expected seconds >= 0. "
            f"Received: {COLLECTIVE_TIMEOUT_ENV}={raw!r}"
        ) from None
    if not value >= 0:
        raise ValueError(
            f"Invalid value for environment variable `{COLLECTIVE_TIMEOUT_ENV}`. Expected seconds >= 0. "
            f"Received: {COLLECTIVE_TIMEOUT_ENV}={raw!r}"
        )
    return value or None


def _make_multiworker(tf):
    _apply_keras_fixes()  # all of them: the multi-worker fix among them
    timeout = collective_timeout_s()
    if timeout is None:
        return tf.distribute.MultiWorkerMirroredStrategy()
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout)
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


def num_workers(strategy) -> int:
    """Number of worker processes taking part in `strategy` (1 unless multi-worker).

    On JAX the processes are global (`jax.process_count()`), so `strategy=None`
    counts them too once `jax.distributed` is initialised: callbacks that find no
    `model.distribute_strategy` (JAX models have none) still see every worker.

    Example:
    >>> num_workers(None)
    1
    """
    group = _jax_process_group(strategy)
    if group is not None:
        return group[1]
    if strategy is None:
        return 1
    # lazy: it imports TensorFlow, which a strategy has loaded already; runtime itself stays light
    from trainwell.compat.tf_internals import strategy_num_workers

    n = strategy_num_workers(strategy)
    return n if n is not None and n > 0 else 1


def any_across_workers(strategy, flags, flags_fn=None):
    """Element-wise OR of boolean `flags` over every replica of `strategy`.

    A decision that changes the training state (roll back, checkpoint and exit)
    must be taken by every worker at the same step, or the workers' weights part
    and their collectives stop matching. Each replica contributes its process's
    flags (or `flags_fn(replica_id)`); one all-reduce of a small int32 vector sums
    them, and a flag is set in the result when any replica set it. With a single
    worker this is a plain copy of `flags` (no device work) unless `flags_fn` is
    given.

    It is a collective under multi-worker: every worker must call it the same
    number of times, in the same order.

    On JAX the reduction is between processes: each process ORs its local
    replicas' flags and `jax.experimental.multihost_utils.process_allgather`
    gathers one small int32 vector per process (no collective with one process).
    `strategy=None` reduces over every JAX process once `jax.distributed` is
    initialised.

    Args:
        strategy: The `tf.distribute.Strategy` or `JaxStrategy` (or `None`: no
            reduction on TensorFlow; every JAX process on JAX).
        flags: Sequence of booleans, this process's view.
        flags_fn: Optional `replica_id_in_sync_group -> sequence of booleans`, the
            flags of each replica (for tests: replicas that disagree; on JAX the
            replica ids are this process's devices in the mesh). Defaults to
            `None` (every local replica contributes `flags`).

    Returns:
        A list of booleans, the same on every worker.

    Example:
    >>> any_across_workers(None, [False, True])
    [False, True]
    """
    local = [bool(f) for f in flags]
    n = len(local)

    def replica_flags(replica_id) -> list[bool]:
        vals = flags_fn(replica_id) if flags_fn is not None else local
        if len(vals) != n:
            raise ValueError(f"flags_fn returned {len(vals)} flags, expected {n}. Received: {vals!r}")
        return [bool(v) for v in vals]

    group = _jax_process_group(strategy)
    if group is not None:
        ids = strategy.local_replica_ids() if isinstance(strategy, JaxStrategy) and flags_fn is not None else [0]
        mine = [any(col) for col in zip(*(replica_flags(i) for i in ids))]
        if group[1] <= 1:
            return mine
        # lazy: JAX is loaded already (a JAX process group exists)
        from jax.experimental import multihost_utils

        everyone = np.asarray(multihost_utils.process_allgather(np.asarray(mine, dtype=np.int32)))
        return [bool(x) for x in everyone.reshape(group[1], n).max(axis=0)]
    if strategy is None or (flags_fn is None and num_workers(strategy) <= 1):
        return local
    tf = _tf()

    def value_fn(ctx):
        return tf.constant([1 if v else 0 for v in replica_flags(ctx.replica_id_in_sync_group)], dtype=tf.int32)

    per_replica = strategy.experimental_distribute_values_from_function(value_fn)
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
    return [bool(x > 0) for x in np.asarray(total).reshape(-1)]


def broadcast_from_chief(strategy, values) -> list[int]:
    """The chief's integers, on every worker: one small collective.

    For a choice the chief makes and every worker must share (e.g. the name of
    the run directory, `trainwell.rundir.shared_run_dir`). On TensorFlow only
    replica 0 (on the chief) contributes to a SUM all-reduce; on JAX
    `jax.experimental.multihost_utils.broadcast_one_to_all` sends process 0's
    values (as uint32 halves of int64: JAX computes in 32 bits by default). A
    collective under multi-worker: every worker calls it with as many values.

    Args:
        strategy: The `tf.distribute.Strategy` or `JaxStrategy`, or `None` (no
            collective on TensorFlow; every JAX process on JAX).
        values: Integers (int64 range); only the chief's matter.

    Returns:
        The chief's values, as a list of ints.

    Example:
    >>> broadcast_from_chief(None, [20261201, 7])
    [20261201, 7]
    """
    mine = np.asarray([int(v) for v in values], dtype=np.int64)
    group = _jax_process_group(strategy)
    if group is not None:
        if group[1] <= 1:
            return mine.tolist()
        # lazy: JAX is loaded already (a JAX process group exists)
        from jax.experimental import multihost_utils

        got = np.asarray(multihost_utils.broadcast_one_to_all(mine.view(np.uint32)), dtype=np.uint32)
        return got.view(np.int64).tolist()
    if strategy is None:
        return mine.tolist()
    tf = _tf()

    def value_fn(ctx):
        keep = ctx.replica_id_in_sync_group == 0  # replica 0 lives on the chief, the first task of the group
        return tf.constant(mine if keep else np.zeros_like(mine), dtype=tf.int64)

    per_replica = strategy.experimental_distribute_values_from_function(value_fn)
    return np.asarray(strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)).reshape(-1).tolist()


#: Longest time (seconds) a non-chief TensorFlow worker waits, after the last
#: barrier, for the chief's process to end (see `sync_workers`); the chief's
#: teardown takes seconds (about 3 s on 2 CPU cores).
LEADER_EXIT_WAIT_S = 60.0


def sync_workers(strategy) -> None:
    """Returns once every worker of `strategy` has called it: a barrier (one small all-reduce).

    A no-op with a single worker. Multi-worker runs call it last (the `trainwell`
    command does, after printing the result): a worker that exits while the chief
    still evaluates, plots or exports looks like a crash to TensorFlow's coordination
    service, which the chief hosts. On TensorFlow each other worker then stays until
    the chief's process has ended (at most `LEADER_EXIT_WAIT_S` seconds), since the
    chief still tears down after the barrier: a worker gone more than the service's
    heartbeat timeout (10 s) before the chief makes it print "The tasks have
    crashed" (tensorflow/tensorflow#58434). On JAX, `jax.distributed.shutdown` at
    exit already orders the ends. A barrier that fails (a peer is gone or a
    collective timed out, see `TRAINWELL_COLLECTIVE_TIMEOUT_S`) is ignored: the run
    itself is done.

    Args:
        strategy: The run's `tf.distribute.Strategy`, or `None`.

    Example:
    >>> sync_workers(None)
    """
    if num_workers(strategy) <= 1:
        return
    try:
        if _jax_process_group(strategy) is not None:
            # lazy: JAX is loaded already (a JAX process group exists)
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("trainwell.runtime.sync_workers")
        else:
            any_across_workers(strategy, [False])
            if not is_chief(strategy):
                # lazy: it imports TensorFlow, which a multi-worker strategy has loaded already
                from trainwell.compat.tf_internals import wait_for_coordination_leader

                wait_for_coordination_leader(LEADER_EXIT_WAIT_S)
    except Exception:  # noqa: BLE001 - a failed barrier at the very end changes nothing
        pass


def fit_scope(strategy):
    """The context `fit` and `evaluate` run in: the strategy's scope on JAX, none on TensorFlow.

    Keras's JAX trainer reads the distribution (`keras.distribution`) when `fit` is
    called, so a `fit` outside the scope would give every device the whole batch; a
    TensorFlow model carries its `tf.distribute` strategy, and `fit` runs outside the
    scope as Keras documents it.

    Example:
    >>> with fit_scope(None):
    ...     pass
    """
    if isinstance(strategy, JaxStrategy):
        return strategy.scope()
    return contextlib.nullcontext()


def num_replicas(strategy) -> int:
    """Number of replicas in sync of `strategy` (1 for the default strategy or no JAX distribution).

    Example:
    >>> num_replicas(make_strategy("auto"))  # doctest: +SKIP
    1
    """
    return int(getattr(strategy, "num_replicas_in_sync", 1))


def gpu_compute_capabilities() -> list[tuple[int, int]]:
    """Compute capabilities of the visible GPUs, e.g. `[(9, 0)]` on an H100/H200.

    Read from TensorFlow's device details, or from JAX's devices on the JAX backend
    (where TensorFlow may see no GPU, or be absent).

    Example:
    >>> gpu_compute_capabilities()  # doctest: +SKIP
    []
    """
    if _keras_backend() == "jax":
        return [tuple(int(c) for c in str(d.compute_capability).split("."))
                for d in _jax_local_devices("gpu") if getattr(d, "compute_capability", None)]
    tf = _tf()
    caps = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        cc = details.get("compute_capability")
        if cc:
            caps.append(tuple(int(c) for c in cc))
    return caps


def resolve_precision(spec: str = "auto") -> str:
    """Resolves a precision spec to a Keras dtype policy name without setting it.

    `"auto"` is `mixed_bfloat16` on TPU, `mixed_float16` when every GPU has compute
    capability >= 7.0 (tensor cores), and `float32` otherwise (CPU). Explicit
    policies are returned unchanged.

    Example:
    >>> resolve_precision("float32")
    'float32'
    """
    if spec not in PRECISION_SPECS:
        raise ValueError(
            "Invalid value for argument `precision`. Expected one of "
            f"{', '.join(repr(s) for s in PRECISION_SPECS)}. Received: precision={spec!r}"
        )
    if spec != "auto":
        return spec
    if _tpu_requested() or (_jax_local_devices("tpu") if _keras_backend() == "jax"
                            else _tf().config.list_logical_devices("TPU")):
        return "mixed_bfloat16"
    caps = gpu_compute_capabilities()
    if caps and all(c >= (7, 0) for c in caps):
        return "mixed_float16"
    return "float32"


def set_precision(spec: str = "auto") -> str:
    """Sets Keras's global dtype policy and returns its name.

    Args:
        spec: `"auto"`, `"mixed_float16"`, `"mixed_bfloat16"` or `"float32"`. See
            `resolve_precision` for what `"auto"` picks. Explicit policies are
            honoured on every device (mixed_float16 runs on the CPU too, slowly).
            Defaults to `"auto"`.

    Returns:
        The policy name that is now global.

    Example:
    >>> set_precision("float32")
    'float32'
    """
    # lazy: Keras loads on first use, not with this module
    import keras

    name = resolve_precision(spec)
    keras.mixed_precision.set_global_policy(name)
    return name


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seeds Python, NumPy, TensorFlow and Keras; optionally makes ops deterministic.

    Uses `keras.utils.set_random_seed` (Python `random`, NumPy, TF and the Keras
    backend seed generator) and, with `deterministic=True`,
    `tf.config.experimental.enable_op_determinism()`, which makes reruns on the
    same hardware bit-identical at some cost in speed.

    Args:
        seed: An integer in [0, 2**32 - 1] (NumPy's legacy seed takes 32 bits).
        deterministic: Whether to enable op determinism. Defaults to `False`.

    Example:
    >>> seed_everything(42)
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(
            f"Invalid value for argument `seed`. Expected an int in [0, 2**32 - 1] (NumPy's seed range). "
            f"Received: seed={seed!r}"
        )
    # lazy: Keras loads on first use, not with this module
    import keras

    os.environ.setdefault("PYTHONHASHSEED", str(seed))
    keras.utils.set_random_seed(seed)
    if deterministic:
        _tf().config.experimental.enable_op_determinism()


def is_chief(strategy=None) -> bool:
    """Whether this process is the chief (the one that writes run artifacts).

    True for single-process runs; under multi-worker, the `chief` task or worker 0
    when the cluster has no chief; on JAX, process 0 (`jax.process_index() == 0`,
    also with `strategy=None` once `jax.distributed` is initialised).

    Example:
    >>> is_chief()
    True
    """
    group = _jax_process_group(strategy)
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
    if task_type is None:
        return True
    if task_type == "chief":
        return True
    return task_type == "worker" and int(task_id or 0) == 0 and "chief" not in spec
