"""Runtime: distribution strategy, precision policy, seeding, cross-worker helpers.

These are thin, explicit wrappers over `tf.distribute` and
`keras.mixed_precision`: Keras already provides the machinery, what it lacks is
one call that picks the right thing for the machine (`"auto"`), a way to test data
parallelism without GPUs (`"cpu:N"` logical devices), and a run directory whose
manifest says exactly what ran (`trainwell.rundir`).
"""

from __future__ import annotations

import json
import os
import re
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
    elif isinstance(spec, _tf().distribute.Strategy):
        return
    raise ValueError(
        "Invalid value for argument `strategy`. Expected one of "
        f"{', '.join(repr(s) for s in STRATEGY_SPECS)} (N >= 1) or a "
        f"tf.distribute.Strategy. Received: strategy={spec!r}"
    )


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
    """Returns a `tf.distribute.Strategy` for `spec`.

    Args:
        spec: One of:
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
    tf = _tf()
    if isinstance(spec, tf.distribute.Strategy):
        if isinstance(spec, tf.distribute.MultiWorkerMirroredStrategy):
            _apply_multiworker_fixes()
        return spec
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


def _apply_multiworker_fixes() -> None:
    # lazy: it imports Keras/TensorFlow; loaded on first use, not with this module
    from trainwell.compat import keras_fixes

    keras_fixes.apply()


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
    _apply_multiworker_fixes()
    timeout = collective_timeout_s()
    if timeout is None:
        return tf.distribute.MultiWorkerMirroredStrategy()
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout)
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


def num_workers(strategy) -> int:
    """Number of worker processes taking part in `strategy` (1 unless multi-worker).

    Example:
    >>> num_workers(None)
    1
    """
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

    Args:
        strategy: The `tf.distribute.Strategy` (or `None`: no reduction).
        flags: Sequence of booleans, this process's view.
        flags_fn: Optional `replica_id_in_sync_group -> sequence of booleans`, the
            flags of each replica (for tests: replicas that disagree). Defaults to
            `None` (every local replica contributes `flags`).

    Returns:
        A list of booleans, the same on every worker.

    Example:
    >>> any_across_workers(None, [False, True])
    [False, True]
    """
    local = [bool(f) for f in flags]
    if strategy is None or (flags_fn is None and num_workers(strategy) <= 1):
        return local
    tf = _tf()
    n = len(local)

    def value_fn(ctx):
        vals = flags_fn(ctx.replica_id_in_sync_group) if flags_fn is not None else local
        if len(vals) != n:
            raise ValueError(f"flags_fn returned {len(vals)} flags, expected {n}. Received: {vals!r}")
        return tf.constant([1 if v else 0 for v in vals], dtype=tf.int32)

    per_replica = strategy.experimental_distribute_values_from_function(value_fn)
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
    return [bool(x > 0) for x in np.asarray(total).reshape(-1)]


def sync_workers(strategy) -> None:
    """Returns once every worker of `strategy` has called it: a barrier (one small all-reduce).

    A no-op with a single worker. Multi-worker runs call it last (the `trainwell`
    command does, after printing the result): a worker that exits while the chief
    still evaluates, plots or exports looks like a crash to TensorFlow's coordination
    service, which the chief hosts. A barrier that fails (a peer is gone or a
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
        any_across_workers(strategy, [False])
    except Exception:  # noqa: BLE001 - a failed barrier at the very end changes nothing
        pass


def num_replicas(strategy) -> int:
    """Number of replicas in sync of `strategy` (1 for the default strategy).

    Example:
    >>> num_replicas(make_strategy("auto"))  # doctest: +SKIP
    1
    """
    return int(getattr(strategy, "num_replicas_in_sync", 1))


def gpu_compute_capabilities() -> list[tuple[int, int]]:
    """Compute capabilities of the visible GPUs, e.g. `[(9, 0)]` on an H100/H200.

    Example:
    >>> gpu_compute_capabilities()  # doctest: +SKIP
    []
    """
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
    tf = _tf()
    if _tpu_requested() or tf.config.list_logical_devices("TPU"):
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
    when the cluster has no chief.

    Example:
    >>> is_chief()
    True
    """
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
