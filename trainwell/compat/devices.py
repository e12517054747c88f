"""What the devices a run computes on are, asked of the backend that runs (TensorFlow's strategy, JAX's distribution).

Example:
>>> on_accelerator()  # on a machine with CPUs only
False
"""

from __future__ import annotations

import keras

from trainwell.compat.backend import backend_name

__all__ = ["on_accelerator"]


def on_accelerator() -> bool:
    """Whether the current strategy (TensorFlow) or distribution (JAX) computes on GPUs or TPUs.

    On TensorFlow outside a strategy's scope (the default strategy), whether TensorFlow
    sees a GPU or TPU at all: where it places ops.

    Returns:
        `True` on a GPU or TPU, `False` on CPUs.

    Example:
    >>> isinstance(on_accelerator(), bool)
    True
    """
    if backend_name() == "jax":
        import jax  # lazy: only the JAX backend has it

        dist = keras.distribution.distribution()
        devices = list(dist.device_mesh.devices.flat) if dist is not None else jax.devices()[:1]
        return any(d.platform in ("gpu", "tpu") for d in devices)
    import tensorflow as tf  # lazy: TensorFlow at import time

    try:
        devices = tf.distribute.get_strategy().extended.worker_devices
    except (RuntimeError, NotImplementedError, AttributeError):  # the default strategy: where TF places ops
        return bool(tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("TPU"))
    return any(":GPU:" in d.upper() or ":TPU:" in d.upper() for d in devices)
