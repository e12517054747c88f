"""Arrays that no single process holds whole, written and read by every process with Orbax (JAX).

With `keras.distribution.ModelParallel` over several processes (a mesh whose
`model` axis spans hosts), a variable's value is a `jax.Array` each process
holds only some shards of: NumPy cannot read it on any one process, and
gathering it on the chief would need the whole state in one host's memory.
`Checkpoint` hands such arrays here (`split_sharded`); `save_sharded` writes
them with Orbax (`orbax-checkpoint`, what Keras's own `OrbaxCheckpoint` uses:
every process writes the shards it owns, and Orbax commits the directory once
all have), and `restore_sharded` reads each array back straight into the
sharding of the variable it is for (another mesh, another number of processes:
Orbax reads the slices each device needs). The rest of a checkpoint (replicated
arrays, the data position, RNG and callback states, the index) stays
trainwell's own and is written by the chief as before.

Orbax is a public package; this module is in compat because only Keras's JAX
backend has such arrays (on TensorFlow, `MultiWorkerMirroredStrategy`
replicates every variable and the chief writes them all).

Example:
>>> import numpy as np
>>> split_sharded({"a": np.zeros(2)})  # nothing is sharded off JAX or in one process
({}, {'a': array([0., 0.])})
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from trainwell.compat.backend import is_jax

#: The directory inside a committed checkpoint that holds its sharded arrays.
SHARDED_DIR = "sharded"


def _is_sharded(value) -> bool:
    # `is_fully_replicated`: every process holds all of it (DataParallel), so NumPy reads it locally.
    return (not getattr(value, "is_fully_addressable", True)) and not getattr(value, "is_fully_replicated", True)


def split_sharded(arrays: dict) -> tuple[dict, dict]:
    """`(sharded, rest)`: the arrays of `arrays` no process holds whole, and the others.

    Example:
    >>> split_sharded({})
    ({}, {})
    """
    sharded = {k: v for k, v in arrays.items() if _is_sharded(v)}
    return sharded, {k: v for k, v in arrays.items() if k not in sharded}


def spans_processes(model) -> bool:
    """Whether some weight of `model` is split between processes (no process holds it whole).

    Example:
    >>> import keras
    >>> spans_processes(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
    False
    """
    weights = getattr(model, "weights", None)
    if not isinstance(weights, (list, tuple)):  # not a Keras model (Keras's own callback tests use such stand-ins)
        return False
    return any(_is_sharded(getattr(v, "value", None)) for v in weights)


def weights_copy(model) -> list:
    """`model.get_weights()`, or, where some weight is split between processes, the tensors themselves.

    NumPy cannot read such a weight on any one process; a JAX array never changes
    (a train step makes new ones), so keeping it is a copy as of now, in device
    memory (elsewhere, where nothing is split this way, a copy: `keras.ops.copy`).
    `model.set_weights` takes either back.

    Example:
    >>> import keras
    >>> [w.shape for w in weights_copy(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))]
    [(2, 1), (1,)]
    """
    if spans_processes(model):
        if is_jax():
            return [v.value for v in model.weights]
        import keras  # lazy: the seam itself needs no Keras

        return [keras.ops.copy(v) for v in model.weights]
    return model.get_weights()


def host_value(variable) -> np.ndarray:
    """`variable`'s whole value as a NumPy array, gathered from every process when it is split between them.

    A gather is a collective: with a split value, every process must call this
    for the same variables in the same order (each then holds the whole value).

    Example:
    >>> import keras
    >>> host_value(keras.Variable([1.0, 2.0])).tolist()
    [1.0, 2.0]
    """
    value = getattr(variable, "value", variable)
    if _is_sharded(value):
        # lazy: only JAX has split values
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    import keras  # lazy: the seam itself needs no Keras

    return np.asarray(keras.ops.convert_to_numpy(value))


class ShardedArray:
    """A checkpoint's sharded array, not yet read: its shape and dtype, for the checks before a restore.

    `read_checkpoint` returns one in place of each array it cannot read on one
    process; `restore_sharded` reads them into the model's variables.

    Example:
    >>> ShardedArray("ckpt-3/sharded", "a0", [4, 8], "float32").shape
    (4, 8)
    """

    def __init__(self, directory, item: str, shape, dtype: str):
        self.directory, self.item = str(directory), item
        self.shape, self.dtype = tuple(int(d) for d in shape), str(dtype)

    def __array__(self, *args, **kwargs):
        raise ValueError(
            f"Array {self.item!r} of {self.directory!r} is sharded across processes (Orbax): load it into a "
            "model (trainwell.callbacks.load_checkpoint, or a resume), which reads it into the model's sharding."
        )

    def __repr__(self) -> str:
        return f"ShardedArray({self.directory!r}, {self.item!r}, shape={self.shape}, dtype={self.dtype!r})"


def save_sharded(path, arrays: dict, names: dict) -> dict:
    """Writes `arrays` (every process calls this, with the same keys) to `path`; returns their manifest.

    Orbax's own commit: it writes into a temporary directory beside `path` and
    renames it once every process has written its shards; a directory already
    at `path` (left by a killed save of the same step) is replaced. The items
    are named `a0`, `a1`, ... (the manifest maps each key to its item).

    Example:
    >>> save_sharded("/tmp/x", {}, {})
    {}
    """
    if not arrays:
        return {}
    # lazy: Orbax (and TensorStore) load only where some array is sharded
    import orbax.checkpoint as ocp

    keys = sorted(arrays)  # (Orbax takes absolute paths only: both calls make them so)
    manifest = {k: {"item": f"a{i}", "shape": list(arrays[k].shape), "dtype": str(arrays[k].dtype),
                    "name": names.get(k, "")} for i, k in enumerate(keys)}
    with ocp.PyTreeCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(path), args=ocp.args.PyTreeSave({manifest[k]["item"]: arrays[k] for k in keys}),
                   force=True)
    return manifest


def complete(path) -> bool:
    """Whether Orbax committed `path` (its metadata file, written last) and every writer's shards are there.

    Example:
    >>> complete("/nonexistent")
    False
    """
    path = Path(path)
    if not (path / "_CHECKPOINT_METADATA").is_file():
        return False
    # Each process that wrote metadata wrote its shards (`ocdbt.process_N`, Orbax's default layout).
    writers = [p.name.rpartition("_")[2] for p in (path / "array_metadatas").glob("process_*")]
    return all((path / f"ocdbt.process_{i}" / "manifest.ocdbt").is_file() for i in writers)


def placeholders(path, manifest: dict) -> dict:
    """`{key: ShardedArray}` for a checkpoint's sharded-array manifest.

    Example:
    >>> placeholders("d", {"model:x": {"item": "a0", "shape": [2], "dtype": "float32"}})["model:x"].shape
    (2,)
    """
    return {k: ShardedArray(path, m["item"], m["shape"], m["dtype"]) for k, m in manifest.items()}


def restore_sharded(wanted: dict) -> dict:
    """Reads each `ShardedArray` into the sharding of its variable: `{key: (ShardedArray, variable)}` -> arrays.

    Only the slices each of this process's devices needs are read, so a
    checkpoint written on one mesh restores onto another.

    Example:
    >>> restore_sharded({})
    {}
    """
    if not wanted:
        return {}
    # lazy: as in save_sharded
    import jax
    import orbax.checkpoint as ocp

    out = {}
    by_dir: dict[str, list] = {}
    for key, (placeholder, variable) in wanted.items():
        by_dir.setdefault(placeholder.directory, []).append((key, placeholder, variable))
    for directory, items in by_dir.items():
        target = {p.item: jax.ShapeDtypeStruct(p.shape, jax.numpy.dtype(p.dtype), sharding=v.value.sharding)
                  for _, p, v in items}
        restore_args = {p.item: ocp.ArrayRestoreArgs(sharding=v.value.sharding) for _, p, v in items}
        with ocp.PyTreeCheckpointer() as ckptr:
            got = ckptr.restore(os.path.abspath(directory), args=ocp.args.PyTreeRestore(
                item=target, restore_args=restore_args, partial_restore=True))
        out.update({key: got[p.item] for key, p, _ in items})
    return out
