"""Distribution on Keras's JAX backend: `JaxStrategy` over `keras.distribution`, and JAX's processes.

The JAX half of `trainwell.compat.distribution`, which picks a backend's half;
`trainwell.runtime` is the public face (`make_strategy`, `any_across_workers`, ...).
Keras's JAX trainer has no strategy object a model keeps: it reads the global
`keras.distribution.distribution()` whenever it creates variables or feeds a batch.
JAX itself is imported only inside the functions that run on JAX.

Example:
>>> JaxStrategy().num_replicas_in_sync
1
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import Any

import keras
import numpy as np

from trainwell.data.batches import pad_partial_batches
from trainwell.validation import invalid_argument

__all__ = [
    "KERAS_DISTRIBUTION_ENV", "JaxStrategy", "EvenBatchesDataParallel", "EvenBatchesModelParallel", "ensure_host_devices",
    "initialize_jax_processes", "make_strategy", "is_keras_distribution", "process_group",
    "use_backbone_layout", "lora_layouts",
]

#: Keras's own environment variables for `keras.distribution.initialize()` (JAX multi-process);
#: `trainwell.launch` sets them for every local worker, as it sets `TF_CONFIG`.
KERAS_DISTRIBUTION_ENV = (
    "KERAS_DISTRIBUTION_JOB_ADDRESSES", "KERAS_DISTRIBUTION_NUM_PROCESSES", "KERAS_DISTRIBUTION_PROCESS_ID",
)
_HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"
_MODEL_PARALLEL_RE = re.compile(r"^model_parallel:(\d+)x(\d+)$")
#: keras-hub 0.32's backbones with a `get_layout_map` (named in the error for one without).
LAYOUT_MAP_BACKBONES = ("GemmaBackbone", "LlamaBackbone", "QwenBackbone", "QwenMoeBackbone", "Qwen3MoeBackbone")


def is_keras_distribution(obj) -> bool:
    """Whether `obj` is a `keras.distribution` `DataParallel`/`ModelParallel`."""
    # Keras exports no base class of its distributions; these are the two it offers.
    return isinstance(obj, (keras.distribution.DataParallel, keras.distribution.ModelParallel))


class JaxStrategy:
    """The JAX backend's counterpart of a `tf.distribute.Strategy`: a `keras.distribution` to build under.

    This wrapper gives the recipes the one interface they use on both backends:
    `with strategy.scope():` (sets the distribution, restores the previous one on
    exit: Keras's own `Distribution.scope()`), `num_replicas_in_sync` and
    `num_workers`. With no distribution (one device) `scope()` changes nothing,
    like TensorFlow's default strategy. Build the model, compile **and
    fit/evaluate** inside the scope: on JAX a `fit` outside it feeds every batch
    whole to every device (no data parallelism).

    A model-parallel strategy (`make_strategy("model_parallel:DxM")`) starts with
    a `mesh` and no distribution: its layout comes from the model's backbone, so
    `use_backbone_layout` must give it one before the model is built (`scope()`
    refuses until then).

    Args:
        distribution: A `keras.distribution.DataParallel` (or `ModelParallel`),
            or `None` for a single device. Defaults to `None`.
        mesh: A `keras.distribution.DeviceMesh` with axes `("batch", "model")`
            awaiting a backbone's layout, or `None`. Defaults to `None`.

    Example:
    >>> strategy = JaxStrategy()
    >>> strategy.num_replicas_in_sync
    1
    >>> with strategy.scope():  # doctest: +SKIP
    ...     model = build_model(); model.compile(...); model.fit(...)
    """

    def __init__(self, distribution=None, mesh=None):
        if distribution is not None and not is_keras_distribution(distribution):
            raise invalid_argument("distribution", "a keras.distribution DataParallel/ModelParallel or None",
                                   distribution)
        if mesh is not None and (not isinstance(mesh, keras.distribution.DeviceMesh)
                                 or tuple(mesh.axis_names) != ("batch", "model")):
            raise invalid_argument("mesh", "a keras.distribution.DeviceMesh with axis_names ('batch', 'model') "
                                   "or None", mesh)
        self.distribution = distribution
        self.mesh = mesh

    @property
    def num_replicas_in_sync(self) -> int:
        """Data-parallel replicas over every process (the devices of the mesh's batch axis)."""
        if self.distribution is None:
            return 1 if self.mesh is None else int(self.mesh.shape[0])
        mesh = self.distribution.device_mesh
        return int(mesh.shape[mesh.axis_names.index(self.distribution.batch_dim_name)])

    @property
    def num_workers(self) -> int:
        """Processes taking part (`jax.process_count()`; 1 unless `jax.distributed` is initialised)."""
        return process_group(self)[1]

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
            if self.mesh is not None:
                raise RuntimeError(
                    f"strategy='model_parallel:{self.mesh.shape[0]}x{self.mesh.shape[1]}' has no layout yet: "
                    "call trainwell.runtime.use_backbone_layout(strategy, backbone class) before building the "
                    "model (the causal_lm recipe does).")
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
        raise invalid_argument("n", "an int >= 1", n)
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


def make_strategy(spec: Any) -> JaxStrategy:
    """The `JaxStrategy` for a valid strategy spec (`trainwell.runtime.validate_strategy_spec`).

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
            - `"model_parallel:DxM"`: a `JaxStrategy` holding a `DeviceMesh` of shape
              `(D, M)`, axes `("batch", "model")`, over every device (D * M of them);
              `use_backbone_layout` then gives it the `ModelParallel` distribution.
            - `"cpu:N"`: `DataParallel` over N CPU devices (`ensure_host_devices`), so
              data parallelism can be tested without accelerators; N = 1: none.
            - a `JaxStrategy` (returned as is) or a `keras.distribution` `DataParallel`/`ModelParallel` (wrapped).

    Returns:
        The `JaxStrategy`.

    Example:
    >>> make_strategy("cpu:2").num_replicas_in_sync  # doctest: +SKIP
    2
    """
    if isinstance(spec, JaxStrategy):
        return spec
    if not isinstance(spec, str):
        if not is_keras_distribution(spec):
            raise invalid_argument(
                "strategy", "a spec string or a keras.distribution DataParallel/ModelParallel (a "
                "tf.distribute.Strategy cannot distribute a model on Keras's JAX backend)", spec)
        return JaxStrategy(spec)
    # lazy: JAX loads with Keras's JAX backend only
    import jax

    if spec.startswith("model_parallel:"):
        if _multiprocess_requested():
            initialize_jax_processes()  # the mesh spans every process's devices
        return _model_parallel_mesh(spec, jax.devices())
    if spec.startswith("cpu:"):
        devices = ensure_host_devices(int(spec[4:]))
        if jax.distributed.is_initialized():
            devices = jax.devices("cpu")  # every process's
        return _data_parallel(devices) if len(devices) > 1 else JaxStrategy(None)
    if spec == "auto" and (_multiprocess_requested() or jax.distributed.is_initialized()):
        spec = "multiworker"
    if spec == "multiworker":
        initialize_jax_processes()
        return _data_parallel(jax.devices())
    if spec == "one_device":
        return JaxStrategy(None)
    if spec == "tpu":
        devices = local_devices("tpu")
        if not devices:
            raise RuntimeError("strategy='tpu' on JAX: no TPU device is visible (jax.local_devices()).")
    else:
        devices = jax.local_devices()
        if spec == "auto" and len(devices) == 1:
            return JaxStrategy(None)
    return _data_parallel(devices)


def _model_parallel_mesh(spec: str, devices) -> JaxStrategy:
    data, model = (int(g) for g in _MODEL_PARALLEL_RE.match(spec).groups())
    if data * model != len(devices):
        raise ValueError(f"strategy='model_parallel:DxM' needs D * M = {len(devices)} (the JAX devices there are). "
                         f"Received: strategy={spec!r}")
    mesh = keras.distribution.DeviceMesh(shape=(data, model), axis_names=("batch", "model"), devices=list(devices))
    return JaxStrategy(mesh=mesh)


def use_backbone_layout(strategy, backbone) -> None:
    """Gives a model-parallel `strategy` its `ModelParallel` distribution from `backbone`'s layout map.

    Why the strategy waits for the backbone: keras-hub's layout map is a static
    method of the backbone class (`GemmaBackbone.get_layout_map(mesh)`), and Keras
    places each variable when it is created, under the distribution then current,
    so the layout must be known before the model is built but cannot be known
    when the strategy is made (before the recipe reads its preset). A recipe
    calls this with the preset's backbone class, then builds under
    `strategy.scope()`; every other strategy is left as it is.

    The layout map gains patterns for LoRA adapters (`lora_layouts`): keras-hub's
    patterns end in `kernel` and, matched whole, miss `lora_kernel_a/b`.

    Args:
        strategy: A `JaxStrategy` (anything else, or one with no mesh: nothing happens).
        backbone: A keras-hub `Backbone` class (or instance) with `get_layout_map`.

    Example:
    >>> strategy = make_strategy("model_parallel:2x4")  # doctest: +SKIP
    >>> use_backbone_layout(strategy, keras_hub.models.GemmaBackbone)  # doctest: +SKIP
    """
    if not isinstance(strategy, JaxStrategy) or strategy.mesh is None:
        return
    get_layout_map = getattr(backbone, "get_layout_map", None)
    if get_layout_map is None:
        name = getattr(backbone, "__name__", type(backbone).__name__)
        raise ValueError(f"strategy='model_parallel' needs a backbone with a layout map (get_layout_map): "
                         f"{', '.join(LAYOUT_MAP_BACKBONES)}. Received: backbone={name}")
    layout_map = get_layout_map(strategy.mesh, model_parallel_dim_name="model", data_parallel_dim_name="batch")
    for pattern, axes in lora_layouts(layout_map).items():
        layout_map[pattern] = axes
    strategy.distribution = EvenBatchesModelParallel(layout_map=layout_map, batch_dim_name="batch")


def lora_layouts(layout_map) -> dict:
    """Layouts for the LoRA adapters of every kernel a `keras.distribution.LayoutMap` shards.

    Keras's LoRA computes `x @ lora_kernel_a @ lora_kernel_b` beside `x @ kernel`
    with `lora_kernel_a` of shape `kernel.shape[:-1] + (rank,)` and
    `lora_kernel_b` of shape `(rank, kernel.shape[-1])`. So A is sharded like the
    kernel's input dimensions (its rank axis whole) and B like the kernel's
    output dimension (its rank axis whole): each adapter's product lies on the
    devices of its kernel's. A pattern `...kernel` gives `...lora_kernel_a` and
    `...lora_kernel_b`; patterns that do not end in `kernel` give none.

    Args:
        layout_map: The `keras.distribution.LayoutMap`.

    Returns:
        `{pattern: axes}` to add to it.

    Example:
    >>> mesh = keras.distribution.DeviceMesh((1, 1), ("batch", "model"), keras.distribution.list_devices()[:1])
    >>> lm = keras.distribution.LayoutMap(mesh)
    >>> lm["block.*ffw.kernel"] = ("batch", "model")
    >>> lora_layouts(lm)
    {'block.*ffw.lora_kernel_a': ('batch', None), 'block.*ffw.lora_kernel_b': (None, 'model')}
    """
    out = {}
    for pattern in list(layout_map.keys()):
        if not pattern.endswith("kernel"):
            continue
        axes = tuple(layout_map[pattern].axes)
        stem = pattern[: -len("kernel")]
        out[stem + "lora_kernel_a"] = (*axes[:-1], None)
        out[stem + "lora_kernel_b"] = (None, axes[-1])
    return out


def _multiprocess_requested() -> bool:
    raw = os.environ.get("KERAS_DISTRIBUTION_NUM_PROCESSES", "").strip()
    return raw.isdigit() and int(raw) > 1


def _data_parallel(devices) -> JaxStrategy:
    return JaxStrategy(EvenBatchesDataParallel(devices=list(devices)))


class _PadsPartialBatches:
    """`distribute_dataset` that pads a short last batch (see `EvenBatchesDataParallel`).

    It also keeps the dataset's length: over several processes Keras splits each
    batch with `rebatch` + `shard`, after which tf.data no longer knows how many
    batches there are, and Keras's epoch iterator, told `steps_per_epoch`, then
    never starts a finite dataset again: the second epoch found it exhausted
    and trained nothing. Every batch being full (padded), each process gets as
    many batches as the dataset has; `assert_cardinality` says so (and fails
    loudly if it ever does not hold).
    """

    def distribute_dataset(self, dataset):
        replicas = JaxStrategy(self).num_replicas_in_sync
        if replicas > 1:
            dataset = pad_partial_batches(dataset, replicas)
        out = super().distribute_dataset(dataset)
        # lazy: a tf.data dataset here means TensorFlow is loaded
        import tensorflow as tf

        if isinstance(dataset, tf.data.Dataset) and isinstance(out, tf.data.Dataset):
            n = int(dataset.cardinality())
            if n >= 0 and int(out.cardinality()) == int(tf.data.UNKNOWN_CARDINALITY):
                out = out.apply(tf.data.experimental.assert_cardinality(n))
        return out


class EvenBatchesDataParallel(_PadsPartialBatches, keras.distribution.DataParallel):
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
    >>> make_strategy("cpu:2").distribution  # doctest: +SKIP
    <EvenBatchesDataParallel device_mesh=...>
    """


class EvenBatchesModelParallel(_PadsPartialBatches, keras.distribution.ModelParallel):
    """Keras's `ModelParallel` whose datasets split evenly over the mesh's batch axis, as `EvenBatchesDataParallel`.

    `use_backbone_layout` builds this: a held-out split of 5 examples on a 2 x 4
    mesh ends with a batch JAX cannot split in two; padded with zero-weighted
    examples, it is scored as on one device.

    Example:
    >>> use_backbone_layout(make_strategy("model_parallel:2x4"), GemmaBackbone)  # doctest: +SKIP
    """


def local_devices(platform: str) -> list:
    """This process's JAX devices of one platform (`"gpu"`, `"tpu"`, `"cpu"`)."""
    # lazy: JAX loads with Keras's JAX backend only
    import jax

    return [d for d in jax.local_devices() if d.platform == platform]


def gpu_compute_capabilities() -> list[tuple[int, int]]:
    """Compute capabilities of this process's JAX GPUs, e.g. `[(9, 0)]`."""
    return [tuple(int(c) for c in str(d.compute_capability).split("."))
            for d in local_devices("gpu") if getattr(d, "compute_capability", None)]


def process_group(strategy) -> tuple[int, int] | None:
    """`(process index, process count)` when `strategy` is a JAX one or JAX runs multi-process, else None.

    `strategy=None` counts as JAX's once `jax.distributed` is initialised. Never imports JAX.
    """
    jax = sys.modules.get("jax")
    if jax is None or not (isinstance(strategy, JaxStrategy) or is_keras_distribution(strategy)
                           or (strategy is None and jax.distributed.is_initialized())):
        return None
    return jax.process_index(), jax.process_count()


def any_across_processes(strategy, count: int, replica_flags, per_replica: bool) -> list[bool]:
    """`trainwell.runtime.any_across_workers` over `count` JAX processes.

    Each process ORs its local replicas' flags (`replica_flags(replica_id)` for
    each of its devices in the mesh when `per_replica`, else `replica_flags(0)`) and
    `multihost_utils.process_allgather` gathers one small int32 vector per process.
    """
    ids = strategy.local_replica_ids() if per_replica and isinstance(strategy, JaxStrategy) else [0]
    mine = [any(col) for col in zip(*(replica_flags(i) for i in ids))]
    if count <= 1:
        return mine
    # lazy: JAX is loaded already (a JAX process group exists)
    from jax.experimental import multihost_utils

    everyone = np.asarray(multihost_utils.process_allgather(np.asarray(mine, dtype=np.int32)))
    return [bool(x) for x in everyone.reshape(count, len(mine)).max(axis=0)]


def broadcast_from_process_0(values: np.ndarray) -> list[int]:
    """Process 0's int64 `values` on every process (as uint32 halves: JAX computes in 32 bits by default)."""
    # lazy: JAX is loaded already (a JAX process group exists)
    from jax.experimental import multihost_utils

    got = np.asarray(multihost_utils.broadcast_one_to_all(values.view(np.uint32)), dtype=np.uint32)
    return got.view(np.int64).tolist()


def barrier() -> None:
    """Returns once every JAX process has called it."""
    # lazy: JAX is loaded already (a JAX process group exists)
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("trainwell.runtime.sync_workers")
