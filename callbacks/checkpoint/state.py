"""Capturing a model's training state into arrays, and putting it back.

`Plan` maps every array key to a variable: model weights by the structural
path Keras's own `.weights.h5` uses (`model:layers/dense_1/0`, so the keys do
not depend on auto-generated layer names), optimizer slots by the path of their
model variable (`opt:...`), seed generators (`seed:...`) and metric
accumulators (`metric:...`); under a strategy with several replicas, every
replica's copy of the variables each replica updates on its own (BatchNorm's
moving statistics, and the metric accumulators: `replica:<key>`,
`[replicas, *shape]`; `compat.replicas`).
`capture` snapshots them in one compiled read (`compat.snapshot.read_function`);
`restore_model_arrays`/`restore_vars` check every key and shape before
assigning and raise `CheckpointMismatchError` naming the keys. `rng_capture` and
`rng_restore` cover Python's, NumPy's, Keras's and TensorFlow's global RNGs.
`load_checkpoint` is the public entry: a checkpoint's weights into a model.

Example:
>>> import keras
>>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
>>> sorted(k for k, _ in Plan(model, include_optimizer=False).model_items())
['model:layers/dense/0', 'model:layers/dense/1']
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
from typing import Any

import keras
import numpy as np

from trainwell.callbacks.checkpoint.files import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    read_checkpoint,
    resolve_checkpoint_path,
)
from trainwell.compat.backend import kept_on_model, strategy_scope
from trainwell.compat.keras_internals import (
    keras_global_seed_state,
    model_fully_built,
    seed_generators,
    walk_saveables,
)
from trainwell.compat.replicas import (
    num_replicas,
    per_replica_variables,
    replica_reader,
    replica_writer,
    variable_strategy,
)
from trainwell.compat.sharded import ShardedArray, restore_sharded
from trainwell.compat.snapshot import read_function, set_tf_rng_state, tf_rng_state
from trainwell.compat.snapshot import to_host as host  # noqa: F401  (the writer's name for it)
from trainwell.validation import invalid_argument

def to_numpy(value) -> np.ndarray:
    if hasattr(value, "numpy"):
        value = value.numpy()
    return np.asarray(value)


def dedup(key: str, used: dict[str, int]) -> str:
    if key in used:
        used[key] += 1
        return f"{key}#{used[key]}"
    used[key] = 0
    return key


def _optimizer_objects(optimizer) -> list:
    out = []
    while optimizer is not None and optimizer not in out:
        out.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return out


class Plan:
    """Which array key maps to which variable of a model (built once per model).

    `frozen`: the model weights left out of the checkpoint (`Checkpoint`'s
    `frozen_weights`): `"non_trainable"` (every weight not in
    `model.trainable_weights`), their variable paths, or (on restore) the keys a
    checkpoint lists. Their keys are `frozen_keys`; `model_items()` leaves them out.
    """

    def __init__(self, model, include_optimizer: bool, frozen=None, frozen_keys=None):
        optimizer = getattr(model, "optimizer", None)
        opt_objs = _optimizer_objects(optimizer)
        skip = {id(o) for o in opt_objs}
        self.layer_stores: list[tuple[str, Any, dict]] = []  # (path, saveable, {i: variable})
        self.seed_vars: list[tuple[str, Any]] = []
        # Keys of the variables each replica updates on its own (BatchNorm's moving statistics,
        # the metrics' accumulators): every replica's copy is kept, `replica:<key>` (`compat.replicas`).
        self.replica_keys: set[str] = set()
        self.strategy = getattr(model, "distribute_strategy", None)
        self.model = model
        var_key_by_path: dict[str, str] = {}
        seen_sg: set[int] = set()
        for path, obj in walk_saveables(model, skip):
            if hasattr(obj, "save_own_variables"):
                store: dict = {}
                obj.save_own_variables(store)
                if store:
                    self.layer_stores.append((path, obj, store))
                    for k, v in store.items():
                        vpath = getattr(v, "path", None)
                        if vpath:
                            var_key_by_path[vpath] = f"{path}/{k}" if path else str(k)
                    own = {id(v) for v in per_replica_variables(obj)}
                    self.replica_keys.update(f"model:{path}/{k}" if path else f"model:{k}"
                                             for k, v in store.items() if id(v) in own)
            for j, sg in enumerate(seed_generators(obj)):
                if id(sg) in seen_sg or getattr(sg, "state", None) is None:
                    continue
                seen_sg.add(id(sg))
                self.seed_vars.append((f"seed:{path}/{j}", sg.state))
        self.opt_vars: list[tuple[str, Any]] = []
        if include_optimizer and optimizer is not None:
            mangled = sorted(
                ((p.replace("/", "_"), key) for p, key in var_key_by_path.items()),
                key=lambda t: -len(t[0]),
            )
            used: dict[str, int] = {}
            for v in optimizer.variables:
                name = str(v.name)
                key = name
                for m, mkey in mangled:
                    if name.startswith(m + "_"):
                        key = f"{mkey}~{name[len(m) + 1:]}"
                        break
                self.opt_vars.append((dedup(f"opt:{key}", used), v))
        used = {}
        self.metric_vars = [(dedup(f"metric:{v.path}", used), v) for v in model.metrics_variables]
        self.replica_keys.update(k for k, _ in self.metric_vars)
        self.readers: dict = {}
        self.names: dict[str, str] = {}
        self.frozen_keys = frozenset(frozen_keys) if frozen_keys is not None else self._frozen_keys(model, frozen)

    def _frozen_keys(self, model, frozen) -> frozenset:
        if frozen is None:
            return frozenset()
        items = list(self.all_model_items())
        if frozen == "non_trainable":
            trainable = {id(v) for v in model.trainable_weights}
            return frozenset(k for k, v in items if id(v) not in trainable)
        by_path = {str(getattr(v, "path", "")): k for k, v in items}
        unknown = sorted(p for p in frozen if p not in by_path)
        if unknown:
            raise ValueError(f"frozen_weights names {len(unknown)} path(s) that are not weights of {model.name} "
                             f"(as `model.weights` names them): {unknown[:5]}")
        return frozenset(by_path[p] for p in frozen)

    def all_model_items(self):
        for path, _, store in self.layer_stores:
            for k, v in store.items():
                yield (f"model:{path}/{k}" if path else f"model:{k}"), v

    def model_items(self):
        """The model's (key, variable) pairs a checkpoint holds: all but the frozen ones."""
        return [(k, v) for k, v in self.all_model_items() if k not in self.frozen_keys]

    def frozen_items(self):
        return [(k, v) for k, v in self.all_model_items() if k in self.frozen_keys]


_PLAN_ATTR = "_trainwell_checkpoint_plan"


def plan_for(model, include_optimizer: bool, frozen=None) -> Plan:
    """`model`'s `Plan`, kept on the model while its variables stay the same.

    Each `fit` makes its own `Checkpoint`; keeping the plan (and the compiled
    read in it) with the model spares a later `fit` of the same model the trace
    of that read: a PBT member's kept model, or `fit` called again in a
    notebook. The key is the identity of every variable (a model compiled
    again with a new optimizer gets a new plan); the plan holds only those
    variables, which the model holds anyway.
    """
    opt = getattr(model, "optimizer", None)
    key = (
        bool(include_optimizer),
        frozen if frozen is None or isinstance(frozen, str) else tuple(frozen),
        tuple(id(v) for v in model.variables),
        tuple(id(v) for v in (opt.variables if opt is not None else ())),
        tuple(id(v) for v in model.metrics_variables),
    )
    return kept_on_model(model, _PLAN_ATTR, key, lambda: Plan(model, include_optimizer=include_optimizer, frozen=frozen))


def _plan_items(plan: Plan, *, weights_only: bool, include_metrics: bool) -> list[tuple[str, Any]]:
    items = list(plan.model_items())
    if not weights_only:
        items += plan.opt_vars + plan.seed_vars
        if include_metrics:
            items += plan.metric_vars
    return items


def _read_snapshot(plan: Plan, items: list[tuple[str, Any]]) -> list:
    """Snapshots of the current values of `items`, in one compiled read kept in the plan.

    `compat.snapshot.read_function`: values that stay as they are while
    training goes on (on TensorFlow without a copy); `host` turns them into
    NumPy arrays when the checkpoint is written.
    """
    keys = tuple(k for k, _ in items)
    try:
        fn = plan.readers.get(keys)
        if fn is None:
            fn = plan.readers[keys] = read_function(plan.model, [v for _, v in items])
        return list(fn())
    except Exception:  # something a compiled function cannot read: copy now
        return [to_numpy(v) for _, v in items]


def capture(plan: Plan, *, weights_only: bool, include_metrics: bool) -> tuple[dict, dict]:
    """Snapshots of the model state; returns (values by key, variable names by key)."""
    items = _plan_items(plan, weights_only=weights_only, include_metrics=include_metrics)
    values = _read_snapshot(plan, items)
    out, names = {}, {}
    for (key, var), value in zip(items, values):
        out[key] = value
        name = plan.names.get(key)
        if name is None:
            name = plan.names[key] = str(getattr(var, "path", ""))
        names[key] = name
    own = [(k, v) for k, v in items if k in plan.replica_keys]
    if own and num_replicas(plan.strategy) > 1:
        keys = ("replicas",) + tuple(k for k, _ in own)
        read = plan.readers.get(keys)
        if read is None:  # an all-gather under multi-worker: every worker captures at the same steps
            read = plan.readers[keys] = replica_reader(plan.strategy, [v for _, v in own])
        for (key, var), value in zip(own, read()):
            out[f"replica:{key}"], names[f"replica:{key}"] = value, str(getattr(var, "path", ""))
    return out, names


def _restore_replicas(items: list[tuple[str, Any]], arrays: dict) -> None:
    """Gives each replica its own copy of `items`' variables from the `replica:` arrays, when there are some.

    Those of a checkpoint written with another number of replicas are not used:
    every replica keeps the value just assigned (the sum, or the first replica's copy).
    """
    found = [(v, arrays[f"replica:{k}"]) for k, v in items if f"replica:{k}" in arrays]
    strategy = variable_strategy(found[0][0]) if found else None
    n = num_replicas(strategy)
    if n > 1 and all(tuple(a.shape) == (n, *_shape(v)) for v, a in found):
        replica_writer(strategy, [v for v, _ in found])([a for _, a in found])


def _check_section(ckpt: str, section: str, expected: dict[str, tuple], saved: dict[str, np.ndarray]) -> None:
    missing = sorted(k for k in expected if k not in saved)
    extra = sorted(k for k in saved if k not in expected)
    bad = [
        f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(expected[k])}"
        for k in sorted(expected)
        if k in saved and tuple(saved[k].shape) != tuple(expected[k])
    ]
    if missing or extra or bad:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if extra:
            parts.append(f"not in the model: {extra[:8]}{' ...' if len(extra) > 8 else ''}")
        if bad:
            parts.append(f"shape mismatch: {bad[:8]}{' ...' if len(bad) > 8 else ''}")
        raise CheckpointMismatchError(
            f"Checkpoint {ckpt!r} does not match the {section} ({'; '.join(parts)}). "
            "Was it written by a different model or optimizer?"
        )


#: A layer in a list is named by its class (`walk_saveables`). trainwell's ResNet built Keras's
#: `BatchNormalization` on JAX (and with `fused_batchnorm=False`) before it built
#: `FusedBatchNormalization` everywhere: such a checkpoint's `batch_normalization_N` keys are read as
#: `fused_batch_normalization_N` when that, and only that, makes them match the model.
_LEGACY_NAME = re.compile(r"(?<=/)batch_normalization(?=(_\d+)?/)")


def _legacy_renamed(saved: dict, expected: dict) -> dict:
    if all(k in saved for k in expected):
        return saved
    renamed = {_LEGACY_NAME.sub("fused_batch_normalization", k): v for k, v in saved.items()}
    ok = len(renamed) == len(saved) and all(k in renamed for k in expected)
    return renamed if ok else saved


def read_sharded(plan: Plan, arrays: dict, ckpt: str) -> dict:
    """`arrays` with each sharded array (`compat.sharded.ShardedArray`) read into its variable's sharding.

    One whose key or shape matches no variable of `plan` stays as it is, for
    the checks of `restore_model_arrays`/`restore_vars` to name.
    """
    variables = dict(plan.all_model_items())
    variables.update(plan.opt_vars + plan.seed_vars + plan.metric_vars)
    wanted = {k: (a, variables[k]) for k, a in arrays.items()
              if isinstance(a, ShardedArray) and k in variables and a.shape == _shape(variables[k])}
    try:
        return {**arrays, **restore_sharded(wanted)}
    except Exception as e:  # noqa: BLE001 - any failure to read them means damage
        raise CheckpointCorruptError(f"Checkpoint {ckpt!r} is damaged or unreadable (its sharded arrays: "
                                     f"{str(e).splitlines()[0] if str(e) else type(e).__name__})") from e


def restore_model_arrays(plan: Plan, arrays: dict, ckpt: str) -> None:
    expected = {k: tuple(_shape(v)) for k, v in plan.model_items()}
    saved = _legacy_renamed({k: a for k, a in arrays.items() if k.startswith("model:")}, expected)
    _check_section(ckpt, "model weights", expected, saved)
    for path, obj, store in plan.layer_stores:
        prefix = f"model:{path}/" if path else "model:"
        if any(prefix + str(k) in plan.frozen_keys for k in store):
            # The layer keeps its frozen weights: its other variables are assigned one by one
            # (`load_own_variables` takes all of them or none).
            for k, v in store.items():
                if prefix + str(k) not in plan.frozen_keys:
                    v.assign(saved[prefix + str(k)])
        else:
            obj.load_own_variables({k: saved[prefix + str(k)] for k in store})
    _restore_replicas(list(plan.model_items()), arrays)


def frozen_fingerprints(plan: Plan) -> dict:
    """`{key: {"path", "sum", "sumsq"}}` of the frozen weights: what a resume checks them against.

    Two float32 reductions per weight, computed where the weight lives (no copy to
    the host): enough to tell another preset or a changed weight from the same one.
    """
    out = {}
    for key, v in plan.frozen_items():
        x = keras.ops.cast(v, "float32")
        out[key] = {"path": str(getattr(v, "path", "")), "sum": float(keras.ops.sum(x)),
                    "sumsq": float(keras.ops.sum(x * x))}
    return out


def changed_frozen(saved: dict, now: dict, rtol: float = 1e-5) -> list[str]:
    """The keys of `saved` whose fingerprint differs from `now`'s (or that `now` lacks)."""
    def close(a, b):
        return abs(a - b) <= rtol * max(abs(a), abs(b), 1.0)
    return sorted(k for k, f in saved.items()
                  if k not in now or not (close(f["sum"], now[k]["sum"]) and close(f["sumsq"], now[k]["sumsq"])))


def check_frozen(plan: Plan, meta: dict, ckpt: str) -> None:
    """Raises `CheckpointMismatchError` when the model's frozen weights are not those `meta` was written with."""
    saved = meta.get("frozen") or {}
    bad = changed_frozen(saved, frozen_fingerprints(plan))
    if bad:
        raise CheckpointMismatchError(
            f"Checkpoint {ckpt!r} holds no frozen weights (frozen_weights), and the model's differ from those it "
            f"was written beside: {bad[:5]}{' ...' if len(bad) > 5 else ''}. Build the model from the same "
            "pretrained weights (preset) before resuming or loading."
        )


def restore_vars(items: list[tuple[str, Any]], arrays: dict, ckpt: str, section: str, prefix: str) -> None:
    expected = {k: tuple(_shape(v)) for k, v in items}
    saved = _legacy_renamed({k: a for k, a in arrays.items() if k.startswith(prefix)}, expected)
    _check_section(ckpt, section, expected, saved)
    for k, v in items:
        v.assign(saved[k])
    _restore_replicas(items, arrays)


def _shape(v):
    return tuple(int(d) for d in v.shape)


def rng_capture() -> tuple[dict, dict]:
    arrays, meta = {}, {}
    version, internal, gauss = random.getstate()
    meta["python"] = [version, list(internal), gauss]
    st = np.random.get_state()
    arrays["rng:numpy"] = np.asarray(st[1])
    meta["numpy"] = {"pos": int(st[2]), "has_gauss": int(st[3]), "cached_gaussian": float(st[4])}
    state = keras_global_seed_state()
    if state is not None:
        arrays["rng:keras_global"] = to_numpy(state)
    tf_state = tf_rng_state()
    if tf_state is not None:
        arrays["rng:tf_global"], meta["tf_algorithm"] = tf_state
    return arrays, meta


def rng_restore(arrays: dict, meta: dict) -> None:
    if not meta:
        return
    if "python" in meta:
        version, internal, gauss = meta["python"]
        random.setstate((version, tuple(internal), gauss))
    if "rng:numpy" in arrays and "numpy" in meta:
        n = meta["numpy"]
        np.random.set_state(
            ("MT19937", arrays["rng:numpy"].astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
        )
    if "rng:keras_global" in arrays:
        keras_global_seed_state(create=True).assign(arrays["rng:keras_global"])
    if "rng:tf_global" in arrays:
        set_tf_rng_state(arrays["rng:tf_global"], meta.get("tf_algorithm"))


def config_to_dict(config) -> dict | None:
    if config is None:
        return None
    if isinstance(config, dict):
        return dict(config)
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    raise invalid_argument("config", "a dict, a dataclass or an object with `to_dict()`", config)


def json_safe(obj):
    """Round-trips `obj` through JSON, failing loudly on what JSON cannot hold."""
    return json.loads(json.dumps(obj, allow_nan=True))


def frozen_keys_of(meta: dict) -> list[str]:
    """The keys of the weights a checkpoint left out (`frozen_weights`)."""
    return list(meta.get("frozen") or {})


def load_checkpoint(path: str | os.PathLike, model, include_optimizer: bool = False) -> dict:
    """Loads the weights of a checkpoint into a built `model` (e.g. for inference).

    Args:
        path: A checkpoint (`.../ckpt-123`) or a `Checkpoint` directory, whose
            newest usable checkpoint is used (see `resume_checkpoint`).
        model: A built Keras model with the same architecture.
        include_optimizer: Also restore the optimizer variables (building the
            optimizer if needed). Defaults to `False`.

    Returns:
        The checkpoint's index entry (epoch, step, monitored value, path).

    Raises:
        FileNotFoundError: No checkpoint at `path`.
        CheckpointCorruptError: The checkpoint (or, for a directory, every
            checkpoint in it) is damaged.
        CheckpointMismatchError: The arrays do not match the model's variables;
            the message names the keys.

    Example:
    >>> load_checkpoint("runs/exp1/checkpoints", model)  # doctest: +SKIP
    {'name': 'ckpt-1200', 'epoch': 3, ...}
    """
    ckpt = resolve_checkpoint_path(path)
    if not model_fully_built(model):
        raise ValueError(
            f"Cannot load checkpoint {str(ckpt)!r} into an unbuilt model. Build it first, e.g. "
            "`model.build(input_shape)` or by calling it on a batch."
        )
    meta, arrays = read_checkpoint(ckpt)
    if include_optimizer and meta.get("weights_only"):
        raise ValueError(f"Checkpoint {str(ckpt)!r} is weights-only: it holds no optimizer state.")
    if include_optimizer and model.optimizer is not None and not model.optimizer.built:
        with strategy_scope(model):
            model.optimizer.build(model.trainable_variables)
    plan = Plan(model, include_optimizer=include_optimizer, frozen_keys=frozen_keys_of(meta))
    check_frozen(plan, meta, str(ckpt))
    arrays = read_sharded(plan, arrays, str(ckpt))
    restore_model_arrays(plan, arrays, str(ckpt))
    if include_optimizer:
        restore_vars(plan.opt_vars, arrays, str(ckpt), "optimizer", "opt:")
    entry = dict(meta.get("entry", {}))
    entry["path"] = str(ckpt)
    return entry
