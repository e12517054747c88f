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
under `strategy.scope()` and `num_replicas(strategy)` counts the replicas. What
differs between the backends is in `trainwell.compat.distribution` (TensorFlow)
and `trainwell.compat.jax_distribution`; each function here makes one call there.

Why one module: everything here is what a process settles before it builds a
model (devices, strategy, precision, seeds) and the collectives its workers then
share, which take the strategy this module makes; read it top to bottom in that order.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

import numpy as np

from trainwell.validation import invalid_argument


#: Seeds go to `random`, NumPy and TensorFlow; NumPy's legacy seed takes 32 bits.
MAX_SEED = 2**32 - 1
STRATEGY_SPECS = ("auto", "mirrored", "multiworker", "tpu", "one_device", "cpu:N", "model_parallel:DxM")
PRECISION_SPECS = ("auto", "mixed_float16", "mixed_bfloat16", "float32")
_CPU_RE = re.compile(r"^cpu:(\d+)$")
_MODEL_PARALLEL_RE = re.compile(r"^model_parallel:(\d+)x(\d+)$")


def _backends():
    # lazy: trainwell.compat loads Keras, which trainwell.config (importing this module) must not
    from trainwell.compat import distribution

    return distribution


def validate_strategy_spec(spec: Any) -> None:
    """Raises `ValueError` unless `spec` is a valid strategy spec or instance.

    Example:
    >>> validate_strategy_spec("cpu:2")
    """
    if isinstance(spec, str):
        m = _CPU_RE.match(spec)
        mp = _MODEL_PARALLEL_RE.match(spec)
        if (spec in STRATEGY_SPECS[:-2] or (m and int(m.group(1)) >= 1)
                or (mp and min(int(mp.group(1)), int(mp.group(2))) >= 1)):
            return
    elif ("keras" in sys.modules or "tensorflow" in sys.modules) and _backends().is_strategy(spec):
        return  # a strategy exists only once Keras or TensorFlow is loaded: this check never loads them
    raise invalid_argument(
        "strategy", f"one of {', '.join(repr(s) for s in STRATEGY_SPECS)} (N, D, M >= 1), a tf.distribute.Strategy "
        "(TensorFlow backend) or a keras.distribution DataParallel/ModelParallel (JAX backend)", spec)


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
            - `"model_parallel:DxM"`: JAX backend only (a one-line error on TensorFlow):
              a data x model device mesh whose layout comes from the model's backbone
              (`use_backbone_layout`).
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
    return _backends().make_strategy(spec, collective_timeout_s)


def make_jax_strategy(spec: Any = "auto"):
    """`make_strategy` on Keras's JAX backend: a `JaxStrategy` (`trainwell.compat.jax_distribution.make_strategy`).

    Example:
    >>> make_jax_strategy("cpu:2").num_replicas_in_sync  # doctest: +SKIP
    2
    """
    validate_strategy_spec(spec)
    return _backends().jax_distribution.make_strategy(spec)


def use_backbone_layout(strategy, backbone) -> None:
    """Shards a `"model_parallel:DxM"` strategy's model by `backbone`'s keras-hub layout map; others: nothing.

    Call it before building the model (`trainwell.compat.jax_distribution.use_backbone_layout`
    says why the strategy waits for the backbone). A backbone without `get_layout_map`:
    a one-line `ValueError` naming those that have one.

    Args:
        strategy: The strategy `make_strategy` returned.
        backbone: The keras-hub `Backbone` class (or instance) the model will have.

    Example:
    >>> use_backbone_layout(None, object)  # not model parallel: nothing to do
    """
    if strategy is None:
        return
    _backends().jax_distribution.use_backbone_layout(strategy, backbone)


def ensure_logical_cpus(n: int) -> list[str]:
    """Splits the host CPU into `n` logical TensorFlow devices (`trainwell.compat.distribution.ensure_logical_cpus`).

    Example:
    >>> ensure_logical_cpus(2)  # doctest: +SKIP
    ['/cpu:0', '/cpu:1']
    """
    return _backends().ensure_logical_cpus(n)


def ensure_host_devices(n: int) -> list:
    """Gives JAX `n` CPU devices (`trainwell.compat.jax_distribution.ensure_host_devices`).

    Example:
    >>> ensure_host_devices(2)  # doctest: +SKIP
    [CpuDevice(id=0), CpuDevice(id=1)]
    """
    return _backends().jax_distribution.ensure_host_devices(n)


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
        value = float("nan")
    if not value >= 0:
        raise ValueError(
            f"Invalid value for environment variable `{COLLECTIVE_TIMEOUT_ENV}`. Expected seconds >= 0. "
            f"Received: {COLLECTIVE_TIMEOUT_ENV}={raw!r}"
        )
    return value or None


def num_workers(strategy) -> int:
    """Number of worker processes taking part in `strategy` (1 unless multi-worker).

    On JAX the processes are global (`jax.process_count()`), so `strategy=None`
    counts them too once `jax.distributed` is initialised: callbacks that find no
    `model.distribute_strategy` (JAX models have none) still see every worker.

    Example:
    >>> num_workers(None)
    1
    """
    return _backends().num_workers(strategy)


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

    return _backends().any_across_workers(strategy, replica_flags, per_replica=flags_fn is not None)


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
    return _backends().broadcast_from_chief(strategy, np.asarray([int(v) for v in values], dtype=np.int64))


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
    itself is done; on TensorFlow the other workers still wait for the chief's end.

    Args:
        strategy: The run's `tf.distribute.Strategy`, or `None`.

    Example:
    >>> sync_workers(None)
    """
    if num_workers(strategy) <= 1:
        return
    try:
        _backends().sync_workers(strategy)
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
    return _backends().fit_scope(strategy)


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
    return _backends().gpu_compute_capabilities()


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
        raise invalid_argument("precision", f"one of {', '.join(repr(s) for s in PRECISION_SPECS)}", spec)
    if spec != "auto":
        return spec
    if _backends().tpu_visible():
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


def seed_everything(seed: int, deterministic: bool = False) -> bool:
    """Seeds Python, NumPy, TensorFlow and Keras; optionally makes ops deterministic.

    Uses `keras.utils.set_random_seed` (Python `random`, NumPy, TF and the Keras
    backend seed generator) and, with `deterministic=True`,
    `tf.config.experimental.enable_op_determinism()`, which makes reruns on the
    same hardware bit-identical at some cost in speed, for the whole process:
    `end_op_determinism()` turns it off again (a recipe's run does at its end).

    Args:
        seed: An integer in [0, 2**32 - 1] (NumPy's legacy seed takes 32 bits).
        deterministic: Whether to enable op determinism. Defaults to `False`.

    Returns:
        Whether this call turned op determinism on (it was off before).

    Example:
    >>> seed_everything(42)
    False
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise invalid_argument("seed", "an int in [0, 2**32 - 1] (NumPy's seed range)", seed)
    # lazy: Keras loads on first use, not with this module
    import keras

    os.environ.setdefault("PYTHONHASHSEED", str(seed))
    keras.utils.set_random_seed(seed)
    if not deterministic:
        return False
    # lazy: TensorFlow loads only for this switch, not with this module
    import tensorflow as tf

    from trainwell.compat.tf_internals import op_determinism_enabled  # lazy, as TensorFlow above

    was_on = op_determinism_enabled()
    tf.config.experimental.enable_op_determinism()
    return not was_on


def end_op_determinism() -> None:
    """Turns TensorFlow's op determinism off again (after `seed_everything(..., deterministic=True)`).

    Example:
    >>> end_op_determinism()
    """
    from trainwell.compat.tf_internals import disable_op_determinism  # lazy: loads TensorFlow

    disable_op_determinism()


def is_chief(strategy=None) -> bool:
    """Whether this process is the chief (the one that writes run artifacts).

    True for single-process runs; under multi-worker, the `chief` task or worker 0
    when the cluster has no chief; on JAX, process 0 (`jax.process_index() == 0`,
    also with `strategy=None` once `jax.distributed` is initialised).

    Example:
    >>> is_chief()
    True
    """
    return _backends().is_chief(strategy)
