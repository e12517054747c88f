"""Atomic, exact-resume training checkpoints.

A checkpoint is a directory `ckpt-<global_step>` holding `arrays.npz` (every
array: model weights, optimizer variables incl. `iterations` and the loss scale,
dropout/seed-generator states, metric accumulators, RNG states) and `state.json`
(everything else: epoch, step and data position, Python/NumPy RNG state, the
states of the other trainwell `StatefulCallback`s, the LR multiplier, the run
config, a manifest of the arrays). No pickle anywhere: the arrays are read back
with `np.load(..., allow_pickle=False)`.

A checkpoint is written into `directory/.tmp-ckpt-XXXX`, every file and the
directory are fsynced, and the directory is committed with one `os.rename` to
`directory/ckpt-<step>`; then the index `directory/checkpoint.json` is rewritten
atomically. A loader therefore never sees a half-written checkpoint: a
`.tmp-ckpt-*` directory is ignored (and removed when the next run starts), and a
committed checkpoint that is missing from the index (a crash between the rename
and the index write) is found on disk and used. state.json records checksums
(its own SHA-256, the CRC-32 of each array in arrays.npz) that every load checks;
a resume skips a damaged checkpoint for the next older one (`resume_checkpoint`).

Example:
>>> import tempfile, keras
>>> ckpt = Checkpoint(tempfile.mkdtemp(), save_every=100, keep_last=2)
>>> ckpt.get_config()["save_every"]
100
"""

from __future__ import annotations

import dataclasses
import errno as _errno
import hashlib
import json
import logging
import math
import os
import queue
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any

import keras
import numpy as np

from trainwell.callbacks.base import StatefulCallback, stateful_callbacks
from trainwell.compat.keras_internals import (
    compiled_metrics_unbuilt,
    get_initial_epoch,
    keras_global_seed_state,
    model_fully_built,
    seed_generators,
    set_initial_epoch,
    symbolic_build,
    walk_saveables,
)
from trainwell.compat.learning_rate import get_lr_multiplier, raw_learning_rate, set_lr_multiplier
from trainwell.compat.metrics import finite_value, metric_direction
from trainwell.io import atomic_write_json, atomic_write_text, fsync_dir, remove_stale_temporaries

logger = logging.getLogger("trainwell.checkpoint")

INDEX_FILE = "checkpoint.json"
ARRAYS_FILE = "arrays.npz"
STATE_FILE = "state.json"
FORMAT_VERSION = 1
_TMP_PREFIX = ".tmp-ckpt-"
_CKPT_RE = re.compile(r"^ckpt-(\d+)$")

#: Test hook: a callable `(tmp_dir: str) -> None` run after the files of a
#: checkpoint are written and fsynced and before the commit rename. The
#: crash-mid-save test sets it (in a subprocess) to stall the save and SIGKILL it.
_BEFORE_COMMIT = None


class CheckpointSaveError(OSError):
    """A checkpoint could not be written; `filename` is the path that failed.

    The previous checkpoints are untouched and the temporary directory is removed.
    """


class CheckpointMismatchError(ValueError):
    """The arrays of a checkpoint do not match the variables of the model."""


class CheckpointCorruptError(ValueError):
    """A checkpoint is damaged (truncated, altered, incomplete), or no checkpoint is usable.

    A resume skips a damaged checkpoint with a warning and loads the next older
    one; this is raised when none is left.
    """


# --------------------------------------------------------------------------- helpers


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _to_numpy(value) -> np.ndarray:
    if hasattr(value, "numpy"):
        value = value.numpy()
    return np.asarray(value)


def _encode_array(arr: np.ndarray) -> tuple[np.ndarray, str]:
    """Returns an array `np.save` can write without pickle, and its dtype name."""
    name = arr.dtype.name
    if arr.dtype.isbuiltin != 1 or arr.dtype.kind in "OV":  # e.g. ml_dtypes.bfloat16
        if arr.dtype.kind == "O":
            raise TypeError(f"cannot checkpoint an object array (dtype {arr.dtype})")
        return arr.view(np.dtype(f"u{arr.dtype.itemsize}")), name
    return arr, name


def _dtype_from_name(dtype_name: str) -> np.dtype:
    """The dtype a checkpoint's manifest names; never an object (pointer) dtype."""
    try:
        dtype = np.dtype(dtype_name)
    except TypeError:
        import ml_dtypes

        dtype = np.dtype(getattr(ml_dtypes, str(dtype_name), None) or "O")
    if dtype.hasobject or (dtype.kind == "V" and dtype.isbuiltin != 2):  # only ml_dtypes' types are kind V
        raise CheckpointCorruptError(f"unsupported dtype {dtype_name!r} in the array manifest")
    return dtype


def _decode_array(arr: np.ndarray, dtype_name: str) -> np.ndarray:
    if arr.dtype.name == dtype_name:
        return arr
    return arr.view(_dtype_from_name(dtype_name))


def _dedup(key: str, used: dict[str, int]) -> str:
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


class _Plan:
    """Which array key maps to which variable of a model (built once per model)."""

    def __init__(self, model, include_optimizer: bool):
        optimizer = getattr(model, "optimizer", None)
        opt_objs = _optimizer_objects(optimizer)
        skip = {id(o) for o in opt_objs}
        self.layer_stores: list[tuple[str, Any, dict]] = []  # (path, saveable, {i: variable})
        self.seed_vars: list[tuple[str, Any]] = []
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
                self.opt_vars.append((_dedup(f"opt:{key}", used), v))
        used = {}
        self.metric_vars = [(_dedup(f"metric:{v.path}", used), v) for v in model.metrics_variables]
        self.readers: dict = {}
        self.names: dict[str, str] = {}

    def model_items(self):
        for path, _, store in self.layer_stores:
            for k, v in store.items():
                yield (f"model:{path}/{k}" if path else f"model:{k}"), v


def _plan_signature(model):
    opt = getattr(model, "optimizer", None)
    return (len(model.variables), len(opt.variables) if opt is not None else 0, len(model.metrics_variables))


def _plan_items(plan: _Plan, *, weights_only: bool, include_metrics: bool) -> list[tuple[str, Any]]:
    items = list(plan.model_items())
    if not weights_only:
        items += plan.opt_vars + plan.seed_vars
        if include_metrics:
            items += plan.metric_vars
    return items


def _read_snapshot(plan: _Plan, items: list[tuple[str, Any]]) -> list:
    """Immutable snapshots of the current values of `items`.

    One compiled function reads every variable (a few ms for ResNet-50's ~540
    variables, against ~30 ms for one eager read each) and returns tensors.
    Tensors are values: TensorFlow updates a variable whose buffer is still
    referenced by a read tensor copy-on-write, so the snapshot stays as it was
    while training goes on, and no copy is made here. `_host` turns them into
    NumPy arrays (zero-copy on the CPU) when the checkpoint is written.
    """
    keys = tuple(k for k, _ in items)
    variables = [v for _, v in items]
    try:
        import tensorflow as tf

        fn = plan.readers.get(keys)
        if fn is None:
            tf_vars = [v.value for v in variables]

            @tf.autograph.experimental.do_not_convert
            def read_all():
                return [tf.identity(v) for v in tf_vars]

            fn = tf.function(read_all)
            plan.readers[keys] = fn
        return list(fn())
    except Exception:  # another backend, or something tf.function cannot read: copy now
        return [_to_numpy(v) for v in variables]


def _host(value) -> np.ndarray:
    """A snapshot (tensor or array) as a NumPy array; keep `value` alive while using it."""
    try:
        from trainwell.compat.tf_internals import host_array  # here: TensorFlow only, and only when writing
    except ImportError:  # another backend
        return _to_numpy(value)
    return host_array(value)


def _capture(plan: _Plan, *, weights_only: bool, include_metrics: bool) -> tuple[dict, dict]:
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
    return out, names


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


def _restore_model_arrays(plan: _Plan, arrays: dict, ckpt: str) -> None:
    expected = {k: tuple(_shape(v)) for k, v in plan.model_items()}
    saved = {k: a for k, a in arrays.items() if k.startswith("model:")}
    _check_section(ckpt, "model weights", expected, saved)
    for path, obj, store in plan.layer_stores:
        prefix = f"model:{path}/" if path else "model:"
        obj.load_own_variables({k: arrays[prefix + str(k)] for k in store})


def _restore_vars(items: list[tuple[str, Any]], arrays: dict, ckpt: str, section: str, prefix: str) -> None:
    expected = {k: tuple(_shape(v)) for k, v in items}
    saved = {k: a for k, a in arrays.items() if k.startswith(prefix)}
    _check_section(ckpt, section, expected, saved)
    for k, v in items:
        v.assign(arrays[k])


def _shape(v):
    return tuple(int(d) for d in v.shape)


def _rng_capture() -> tuple[dict, dict]:
    arrays, meta = {}, {}
    version, internal, gauss = random.getstate()
    meta["python"] = [version, list(internal), gauss]
    st = np.random.get_state()
    arrays["rng:numpy"] = np.asarray(st[1])
    meta["numpy"] = {"pos": int(st[2]), "has_gauss": int(st[3]), "cached_gaussian": float(st[4])}
    state = keras_global_seed_state()
    if state is not None:
        arrays["rng:keras_global"] = _to_numpy(state)
    try:
        from trainwell.compat.tf_internals import tf_global_generator  # here: TensorFlow only

        g = tf_global_generator()
        if g is not None:
            arrays["rng:tf_global"] = g.state.numpy()
            meta["tf_algorithm"] = int(g.algorithm)
    except Exception:  # pragma: no cover
        pass
    return arrays, meta


def _rng_restore(arrays: dict, meta: dict) -> None:
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
        import tensorflow as tf

        alg = meta.get("tf_algorithm")
        gen = tf.random.get_global_generator()
        if alg is None or int(gen.algorithm) == int(alg):
            gen.reset(arrays["rng:tf_global"])
        else:
            tf.random.set_global_generator(tf.random.Generator.from_state(arrays["rng:tf_global"], alg))


def _config_to_dict(config) -> dict | None:
    if config is None:
        return None
    if isinstance(config, dict):
        return dict(config)
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    raise ValueError(
        "Invalid value for argument `config`. Expected a dict, a dataclass or an object with "
        f"`to_dict()`. Received: config={config!r}"
    )


def _json_safe(obj):
    """Round-trips `obj` through JSON, failing loudly on what JSON cannot hold."""
    return json.loads(json.dumps(obj, allow_nan=True))


# --------------------------------------------------------------------------- reading


def _read_index(directory: Path) -> list[dict]:
    path = directory / INDEX_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        entries = data.get("checkpoints", [])
        return [e for e in entries if isinstance(e, dict) and "name" in e]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, AttributeError) as e:
        warnings.warn(f"Ignoring unreadable checkpoint index {str(path)!r} ({e}); scanning the directory instead.")
        return []


def _checkpoint_path(directory: Path, name) -> Path | None:
    """`directory/name` if `name` is one trainwell writes (`ckpt-<int>`) and stays inside `directory`.

    Index entries are data read from disk: a tampered name such as `../../x`
    must never reach `shutil.rmtree` (rotation) or a loader.
    """
    if not isinstance(name, str) or not _CKPT_RE.match(name):
        return None
    path = directory / name
    try:
        if path.resolve().parent != directory.resolve():  # e.g. a symlink pointing elsewhere
            return None
    except OSError:
        return None
    return path


def list_checkpoints(directory: str | os.PathLike) -> list[dict]:
    """Committed checkpoints in `directory`, oldest first.

    Merges the index with the `ckpt-*` directories on disk (a checkpoint renamed
    into place just before a crash is not lost); entries whose directory is gone
    are dropped, `.tmp-ckpt-*` directories are ignored, and an index entry whose
    name is not one `Checkpoint` writes (`ckpt-<int>`, inside `directory`) is
    ignored with a warning. Listed checkpoints are not verified; see
    `resume_checkpoint`.

    Args:
        directory: A `Checkpoint` directory.

    Returns:
        Index entries (dicts with `name`, `path`, `epoch`, `step_in_epoch`,
        `global_step`, `value`, `seq`, ...), sorted by commit order.

    Example:
    >>> import tempfile
    >>> list_checkpoints(tempfile.mkdtemp())
    []
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    by_name = {}
    for e in _read_index(directory):
        path = _checkpoint_path(directory, e["name"])
        if path is None:
            warnings.warn(
                f"Ignoring the entry {e['name']!r} of {str(directory / INDEX_FILE)!r}: not a checkpoint name "
                "trainwell writes (ckpt-<step>) inside that directory."
            )
            continue
        if path.is_dir():  # kept even if damaged: `resume_checkpoint` names it and falls back
            by_name[e["name"]] = dict(e)
    for child in directory.iterdir():
        if child.name in by_name or _checkpoint_path(directory, child.name) is None:
            continue
        try:
            meta = json.loads((child / STATE_FILE).read_text(encoding="utf-8"))
            by_name[child.name] = dict(meta["entry"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    out = []
    for name, e in by_name.items():
        e["name"] = name
        e["path"] = str(directory / name)
        out.append(e)
    out.sort(key=lambda e: (_int_or(e.get("seq"), 0), _int_or(e.get("global_step"), 0)))
    return out


def _int_or(x, default: int) -> int:
    return int(x) if _is_int(x) else default


def latest_checkpoint(directory: str | os.PathLike) -> str | None:
    """Path of the newest committed checkpoint in `directory`, or None (not verified).

    Example:
    >>> import tempfile
    >>> latest_checkpoint(tempfile.mkdtemp()) is None
    True
    """
    entries = list_checkpoints(directory)
    return entries[-1]["path"] if entries else None


# ---- verification: written at commit (`_seal`), checked at load (`_read_state`, `_check_zip`).
# state.json carries `state_sha256`, the SHA-256 of its own canonical JSON without that key and
# without `entry` (the index record, which tools annotate: `trainwell.tuning` marks copied
# checkpoints), and `arrays_crc32`, the CRC-32 of every member of arrays.npz. zipfile computes
# those CRCs while writing and checks each member against its CRC while reading it, so the arrays
# are verified at no extra pass over the data; recording them in the (hashed) state also ties the
# arrays file to its state file. Checkpoints written before this carry neither and still load.


def _canonical_state(meta: dict) -> bytes:
    body = {k: v for k, v in meta.items() if k not in ("entry", "state_sha256")}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True).encode("utf-8")


def _seal(meta: dict) -> str:
    """Sets `meta["state_sha256"]` (of the JSON as a loader parses it) and returns state.json's text."""
    meta["state_sha256"] = hashlib.sha256(_canonical_state(json.loads(json.dumps(meta)))).hexdigest()
    return json.dumps(meta, indent=1, sort_keys=True)


def _zip_crcs(zf: zipfile.ZipFile) -> dict[str, int]:
    """CRC-32 of every member, from the zip's central directory (no data read)."""
    return {i.filename: int(i.CRC) for i in zf.infolist()}


_POSITION_KEYS = ("epoch", "step_in_epoch", "global_step")


def _read_state(path: Path) -> dict:
    """state.json of a checkpoint, parsed and verified; raises on any damage."""
    meta = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    if not isinstance(meta, dict):
        raise CheckpointCorruptError("state.json does not hold a JSON object")
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"unsupported checkpoint format {meta.get('format')!r}")
    claimed = meta.get("state_sha256")
    if claimed is not None and hashlib.sha256(_canonical_state(meta)).hexdigest() != claimed:
        raise CheckpointCorruptError("state.json does not match its checksum")
    pos, manifest = meta.get("position"), meta.get("arrays")
    if not (isinstance(pos, dict) and all(_is_int(pos.get(k)) for k in _POSITION_KEYS)):
        raise CheckpointCorruptError("state.json has no valid position")
    if not isinstance(manifest, dict) or not all(isinstance(v, dict) for v in manifest.values()):
        raise CheckpointCorruptError("state.json has no valid array manifest")
    if not isinstance(meta.get("entry", {}), dict):
        raise CheckpointCorruptError("state.json has no valid entry")
    for v in manifest.values():
        _dtype_from_name(v.get("dtype", "float32"))
    return meta


def _check_zip(zf: zipfile.ZipFile, meta: dict) -> None:
    """The members of arrays.npz against the CRCs recorded at commit, and against the manifest."""
    recorded = meta.get("arrays_crc32")
    if recorded is not None and _zip_crcs(zf) != recorded:
        raise CheckpointCorruptError("arrays.npz does not match the checksums in state.json")
    names = {n[:-4] if n.endswith(".npy") else n for n in zf.namelist()}
    missing = sorted(set(meta["arrays"]) - names)
    if missing:
        raise CheckpointCorruptError(f"arrays {missing[:5]} are missing from arrays.npz")


def _verify(path: Path) -> dict:
    """Verifies a whole checkpoint (every array byte against its CRC); returns its state."""
    meta = _read_state(path)
    with zipfile.ZipFile(path / ARRAYS_FILE) as zf:
        _check_zip(zf, meta)
        bad = zf.testzip()
        if bad is not None:
            raise CheckpointCorruptError(f"arrays.npz member {bad!r} fails its CRC-32 check")
    return meta


#: Verification results by checkpoint path and file identities, so the recipe (which
#: positions its data pipeline) and `Checkpoint` (which loads) decide once, alike.
_VERIFIED: dict[str, tuple[tuple, dict | str]] = {}


def _file_ids(path: Path) -> tuple:
    out = []
    for name in (STATE_FILE, ARRAYS_FILE):
        try:
            st = (path / name).stat()
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


def _verified_state(path: Path) -> dict:
    """`_verify(path)`, remembered while the files stay the same; raises CheckpointCorruptError."""
    key, ids = str(path), _file_ids(path)
    hit = _VERIFIED.get(key)
    if hit is None or hit[0] != ids:
        try:
            result: dict | str = _verify(path)
        except Exception as e:  # noqa: BLE001 - any failure to read a checkpoint means damage
            result = _damage(e)
        if len(_VERIFIED) > 64:
            _VERIFIED.clear()
        hit = _VERIFIED[key] = (ids, result)
    if isinstance(hit[1], str):
        raise CheckpointCorruptError(hit[1])
    return hit[1]


def resume_checkpoint(directory: str | os.PathLike) -> dict | None:
    """The checkpoint a resume from `directory` loads: the newest one that verifies.

    Each checkpoint is verified against the checksums written when it was
    committed (state.json's own SHA-256, the CRC-32 of every array); one that
    fails (truncated, altered, a file missing, an unsupported dtype) is skipped
    with a warning naming it, and the next older one is tried. `Checkpoint`
    resumes from this checkpoint and `trainwell.recipe.resume_epoch` positions
    the data pipeline from it, so the two always agree.

    Args:
        directory: A `Checkpoint` directory.

    Returns:
        The index entry of that checkpoint, with `position` (`epoch`,
        `step_in_epoch`, `global_step`, ... as stored in it), or None when
        `directory` holds no checkpoint.

    Raises:
        CheckpointCorruptError: Checkpoints exist but none is usable.

    Example:
    >>> import tempfile
    >>> resume_checkpoint(tempfile.mkdtemp()) is None
    True
    """
    directory = Path(directory)
    damaged = []
    for entry in reversed(list_checkpoints(directory)):
        try:
            meta = _verified_state(Path(entry["path"]))
        except CheckpointCorruptError as e:
            damaged.append(f"{entry['name']} ({e})")
            warnings.warn(f"Checkpoint {entry['path']!r} is damaged ({e}); trying the next older one.")
            continue
        out = dict(entry)
        out["position"] = dict(meta["position"])
        return out
    if damaged:
        raise CheckpointCorruptError(
            f"No usable checkpoint in {str(directory)!r}: {'; '.join(damaged)}. Restore the directory from a "
            "backup, or move it away to start the run from scratch."
        )
    return None


def _damage(e: BaseException) -> str:
    """What is wrong with a checkpoint, from the error reading it raised."""
    if isinstance(e, FileNotFoundError):
        return f"{Path(e.filename or '').name or 'a file'} is missing"
    if isinstance(e, CheckpointCorruptError):
        return str(e)
    return f"{type(e).__name__}: {e}"


def _read_checkpoint(path: str | os.PathLike) -> tuple[dict, dict]:
    """(state, arrays) of one checkpoint, verified; raises CheckpointCorruptError naming it."""
    path = Path(path)
    try:
        meta = _read_state(path)
        manifest = meta["arrays"]
        arrays = {}
        with np.load(path / ARRAYS_FILE, allow_pickle=False) as z:
            _check_zip(z.zip, meta)
            for k in z.files:
                arr = z[k]  # zipfile checks the member's CRC-32 while reading it
                dtype = manifest.get(k, {}).get("dtype")
                arrays[k] = _decode_array(arr, dtype) if dtype else arr
    except Exception as e:  # noqa: BLE001 - any failure to read a checkpoint means damage
        raise CheckpointCorruptError(f"Checkpoint {str(path)!r} is damaged or unreadable ({_damage(e)})") from e
    return meta, arrays


def _resolve_checkpoint_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    if (path / STATE_FILE).is_file() or (path / ARRAYS_FILE).is_file():
        return path
    chosen = resume_checkpoint(path)
    if chosen is None:
        raise FileNotFoundError(f"No committed checkpoint found in {str(path)!r}")
    return Path(chosen["path"])


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
    ckpt = _resolve_checkpoint_path(path)
    if not model_fully_built(model):
        raise ValueError(
            f"Cannot load checkpoint {str(ckpt)!r} into an unbuilt model. Build it first, e.g. "
            "`model.build(input_shape)` or by calling it on a batch."
        )
    meta, arrays = _read_checkpoint(ckpt)
    if include_optimizer and meta.get("weights_only"):
        raise ValueError(f"Checkpoint {str(ckpt)!r} is weights-only: it holds no optimizer state.")
    if include_optimizer and model.optimizer is not None and not model.optimizer.built:
        with model.distribute_strategy.scope():
            model.optimizer.build(model.trainable_variables)
    plan = _Plan(model, include_optimizer=include_optimizer)
    _restore_model_arrays(plan, arrays, str(ckpt))
    if include_optimizer:
        _restore_vars(plan.opt_vars, arrays, str(ckpt), "optimizer", "opt:")
    entry = dict(meta.get("entry", {}))
    entry["path"] = str(ckpt)
    return entry


# --------------------------------------------------------------------------- callback


class Checkpoint(StatefulCallback):
    """Atomic checkpoints that resume a `fit` exactly, mid-epoch included.

    Replaces `keras.callbacks.BackupAndRestore` (and covers `ModelCheckpoint`'s
    keep-best role) rather than extending it: `BackupAndRestore` overwrites its
    files in place (a crash mid-save loses the only backup), restores only the
    epoch (a mid-epoch backup replays the epoch from batch 0), saves neither the
    data position nor any RNG state, keeps no history or best checkpoint, and is
    not multi-worker aware. None of its methods survive those changes, so this
    class shares only its resume hook (`model._initial_epoch`).

    **What is saved.** Model weights, optimizer variables (incl. `iterations`
    and a `LossScaleOptimizer`'s loss scale), seed-generator states (dropout),
    the metric accumulators of a half-finished epoch, the LR multiplier of
    `trainwell.callbacks.schedules` (not an optimizer variable), the epoch, step
    and data position, Python/NumPy/Keras/`tf.random` global RNG states, the
    state of every other `StatefulCallback` in the same `fit`, and `config`.
    Arrays are matched on restore by structural path (the names Keras's own
    `.weights.h5` uses; optimizer slots by the path of their model variable),
    never by position alone; a mismatch raises `CheckpointMismatchError`
    naming the keys.

    **When.** `save_every="epoch"` commits each finished epoch in this
    callback's `on_epoch_end` (as `BackupAndRestore` does), so a callback that
    raises later in the same `on_epoch_end` round does not cost the epoch. What
    the other `StatefulCallback`s listed after this one do in their
    `on_epoch_end` (early-stopping counters, `stop_training`) is amended into
    that checkpoint right after them (state.json rewritten atomically), and
    `stop_training` set by any callback at `on_train_end`: the checkpoint is
    durable at once and complete when the round is. Put file loggers
    (`CSVLogger`) before `Checkpoint`. An int N saves every N steps, at a step
    boundary: just before a training step runs, inside a thin wrapper around
    `model.train_function` (after every callback has handled the previous batch
    end and this step's batch begin, whatever their order); with
    `steps_per_execution=k` batch callbacks fire every k steps, so saves land on
    the first multiple of k at or past N. The last epoch is committed at its
    end either way.

    **Resume (exact).** At `on_train_begin` the newest committed checkpoint is
    loaded, `model._initial_epoch` is set (as `BackupAndRestore` does) and the
    other callbacks' states are restored. If the model is not built yet (TF
    trainer without a distribution strategy defers building until tracing), the
    arrays are loaded just before the first step instead, after building the
    model from the iterator's `element_spec` (`model._symbolic_build`). A
    mid-epoch checkpoint continues from the next batch, not from batch 0: the
    wrapped train function first drains, without training, the batches the
    interrupted run had already taken from its current iterator (`next()`),
    then answers the first K calls of the resumed epoch by consuming
    `steps_per_execution` batches each without training. The data order is
    therefore identical for any input pipeline that yields the same stream in a
    fresh process: unshuffled data, or a seeded `shuffle(seed=...).repeat()`
    with `steps_per_epoch` (one iterator for the whole run). A pipeline that
    reshuffles per new iterator (`shuffle=True` on NumPy inputs,
    `reshuffle_each_iteration` without `repeat()`) resumes at the right step
    but cannot reproduce the interrupted epoch's order. During that replay the
    `on_epoch_begin`/`on_train_batch_begin`/`on_train_batch_end` hooks of the
    other `StatefulCallback`s are muted (their restored state already reflects
    those batches); plain Keras callbacks see them with empty logs (the
    progress bar counts them without metric values), and one line says how
    many batches are skipped.

    **Damaged checkpoints.** Every checkpoint carries checksums (state.json's
    own SHA-256, the CRC-32 of every array) checked at load. A resume takes the
    newest checkpoint that verifies (`resume_checkpoint`), warning about each
    damaged one it skips; if none verifies it raises `CheckpointCorruptError`.
    Index entries that are not `ckpt-<step>` names inside `directory` are
    ignored with a warning, so a tampered index never makes rotation delete
    anything else. A run whose checkpoint says it is complete trains nothing
    and says so.

    **Durability.** Files go to `directory/.tmp-ckpt-XXXX`, are fsynced with the
    directory, then renamed to `directory/ckpt-<global step>`; the index
    `checkpoint.json` is written with `trainwell.io.atomic_write_json`.
    Temporaries a kill leaves behind are removed when the next fit starts. The last
    `keep_last` and the best `keep_best` (by `monitor`) are kept. A failed write
    (no space, no permission) removes the temporary directory, leaves the
    previous checkpoints intact and raises `CheckpointSaveError` (an `OSError`)
    naming the path. Under multi-worker only the chief
    (`trainwell.runtime.is_chief`) writes; other workers write to a scratch
    directory and delete it.

    **Preemption.** A SIGTERM handler (installed only in the main thread,
    restored at `on_train_end`) makes the next step boundary write a checkpoint
    and raise `SystemExit(Checkpoint.PREEMPTED_EXIT_CODE)` (143 = 128 + SIGTERM,
    what a shell reports for a SIGTERM-killed process). Both events get a line
    of their own on stderr, the last one ending with the command that resumes
    (`trainwell resume RUN_DIR` for a recipe's run). A previous Python
    handler is called after the save; a second SIGTERM before the save falls
    through to the previous handler (default: terminate), and so does the
    first one if no step boundary comes within `PREEMPTION_GRACE_S` seconds.
    A `fit` that raises uninstalls the handler too (when the error passes
    through a training step or the restore).

    **Multi-worker.** Under `MultiWorkerMirroredStrategy` a SIGTERM usually
    reaches one worker (its host is being preempted). Before every step the
    workers OR-reduce their "preemption requested" flags
    (`trainwell.runtime.any_across_workers`, one tiny all-reduce), so every
    worker checkpoints at the same step (the chief commits it, the others
    write to scratch and discard it) and exits with `PREEMPTED_EXIT_CODE`;
    restarting every worker resumes from that checkpoint. The run directory
    must be on storage that every worker reads (the chief writes; all load).

    **Weights-only and warm start.** `weights_only=True` saves the model weights
    (and the position) only. Resuming from such a checkpoint leaves the
    optimizer fresh and re-applies a linear warmup over
    `warm_start_warmup_steps` steps: before each step the learning rate is
    scaled by `(s + 1) / warm_start_warmup_steps`. A plain learning-rate
    variable is scaled directly (and put back afterwards); an optimizer driven
    by a `LearningRateSchedule` is scaled through
    `trainwell.callbacks.schedules.set_lr_multiplier`.

    **Async.** `async_save=True` takes the snapshot synchronously and leaves the
    rest (host conversion, encoding, write, fsync, rename, index) to a
    background thread; a new save waits for the previous write, `on_train_end`
    waits, and an error from the thread is raised by the next save or by
    `on_train_end`. The snapshot is one compiled read of all variables that
    returns tensors; tensors are immutable (TensorFlow updates a variable whose
    buffer a tensor still references copy-on-write), so no copy is made while
    the loop waits. The copy of the updated buffers is paid by the training
    step that runs during the write (on a GPU: a device-memory copy, with the
    device-to-host transfer in the background).

    Args:
        directory: Directory for the checkpoints (created if missing). Reusing it
            resumes the run.
        save_every: `"epoch"` or an int N >= 1 (every N training steps).
            Defaults to `"epoch"`.
        keep_last: Number of most recent checkpoints to keep (>= 1). Defaults to `3`.
        keep_best: Number of best checkpoints by `monitor` to keep as well
            (>= 0). Defaults to `1`.
        monitor: Metric ranking checkpoints for `keep_best`: the epoch logs'
            value when the save follows an epoch end, else the last batch logs'.
            Defaults to `"val_loss"`.
        mode: `"auto"`, `"min"` or `"max"`; `"auto"` infers it from the metric.
            Defaults to `"auto"`.
        weights_only: Save only model weights and the position. Defaults to `False`.
        async_save: Write in a background thread. Defaults to `False`.
        config: The run config (a dict, a dataclass, or an object with
            `to_dict()`), stored in every checkpoint. Defaults to `None`.
        resume: Resume from the newest checkpoint in `directory` at
            `on_train_begin`. Defaults to `True`.
        warm_start_warmup_steps: LR warmup steps applied after resuming from a
            weights-only checkpoint (>= 0). Defaults to `0`.
        verbose: `1` prints one line when the callback acts on a run: where it
            resumes, the batches it skips, a run that is already complete; `0` is
            silent. (Keras's `ModelCheckpoint` defaults to `0`; these lines are
            rare and say what would otherwise look like a bug.) Preemption and
            damaged checkpoints are reported either way. Defaults to `1`.

    Example:
    >>> ckpt = Checkpoint("runs/exp1/checkpoints", save_every=500, keep_last=2)
    >>> model.fit(ds, epochs=10, steps_per_epoch=1000, callbacks=[ckpt])  # doctest: +SKIP
    >>> # after a crash or preemption the same call resumes at the next step
    >>> load_checkpoint("runs/exp1/checkpoints", inference_model)  # doctest: +SKIP
    """

    #: Exit status after a SIGTERM-triggered checkpoint (128 + SIGTERM).
    PREEMPTED_EXIT_CODE = 143
    #: Seconds a SIGTERM waits for the next step boundary before it falls through
    #: to the previous handler (default: terminate) without a checkpoint.
    PREEMPTION_GRACE_S = 120.0

    def __init__(
        self,
        directory,
        save_every="epoch",
        keep_last=3,
        keep_best=1,
        monitor="val_loss",
        mode="auto",
        weights_only=False,
        async_save=False,
        config=None,
        resume=True,
        warm_start_warmup_steps=0,
        verbose=1,
    ):
        if directory is None or (isinstance(directory, str) and not directory.strip()):
            raise ValueError(
                f"Invalid value for argument `directory`. Expected a non-empty path. Received: directory={directory!r}"
            )
        if not (save_every == "epoch" or (_is_int(save_every) and save_every >= 1)):
            raise ValueError(
                "Invalid value for argument `save_every`. Expected 'epoch' or an int >= 1. "
                f"Received: save_every={save_every!r}"
            )
        if not (_is_int(keep_last) and keep_last >= 1):
            raise ValueError(
                f"Invalid value for argument `keep_last`. Expected an int >= 1. Received: keep_last={keep_last!r}"
            )
        if not (_is_int(keep_best) and keep_best >= 0):
            raise ValueError(
                f"Invalid value for argument `keep_best`. Expected an int >= 0. Received: keep_best={keep_best!r}"
            )
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(
                f"Invalid value for argument `monitor`. Expected a metric name. Received: monitor={monitor!r}"
            )
        if mode not in ("auto", "min", "max"):
            raise ValueError(
                "Invalid value for argument `mode`. Expected one of 'auto', 'min', 'max'. "
                f"Received: mode={mode!r}"
            )
        for name, value in (("weights_only", weights_only), ("async_save", async_save), ("resume", resume)):
            if not isinstance(value, bool):
                raise ValueError(
                    f"Invalid value for argument `{name}`. Expected a bool. Received: {name}={value!r}"
                )
        if not (_is_int(warm_start_warmup_steps) and warm_start_warmup_steps >= 0):
            raise ValueError(
                "Invalid value for argument `warm_start_warmup_steps`. Expected an int >= 0. "
                f"Received: warm_start_warmup_steps={warm_start_warmup_steps!r}"
            )
        if not (isinstance(verbose, bool) or (_is_int(verbose) and verbose in (0, 1))):
            raise ValueError(
                f"Invalid value for argument `verbose`. Expected 0 or 1. Received: verbose={verbose!r}"
            )
        self.directory = os.fspath(directory)
        self.verbose = int(verbose)
        self.save_every = save_every if save_every == "epoch" else int(save_every)
        self.keep_last = int(keep_last)
        self.keep_best = int(keep_best)
        self.monitor = monitor
        self.mode = mode
        self.weights_only = weights_only
        self.async_save = async_save
        self.config = _config_to_dict(config)
        self.resume = resume
        self.warm_start_warmup_steps = int(warm_start_warmup_steps)
        self._lock = threading.RLock()
        self._worker: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._async_error: BaseException | None = None
        self._plan_cache = None
        self._prev_sigterm = None
        self._sigterm_installed = False
        self._grace_timer = None
        self._preempt_requested = False
        self._preempt_from_peer = False
        self._in_fit = False
        super().__init__()
        self._reset_run_vars()

    # ------------------------------------------------------------ config/state
    def get_config(self) -> dict[str, Any]:
        return {
            "directory": self.directory,
            "save_every": self.save_every,
            "keep_last": self.keep_last,
            "keep_best": self.keep_best,
            "monitor": self.monitor,
            "mode": self.mode,
            "weights_only": self.weights_only,
            "async_save": self.async_save,
            "config": self.config,
            "resume": self.resume,
            "warm_start_warmup_steps": self.warm_start_warmup_steps,
            "verbose": self.verbose,
        }

    def reset_state(self) -> None:
        self.global_step = 0
        self.epoch = 0
        self.step_in_epoch = 0
        self.last_save_step = -1
        self._entries: list[dict] = []
        self._warmup: dict | None = None
        self._iterator_continues: bool | None = None  # learned at the first epoch boundary

    def get_state(self) -> dict[str, Any]:
        with self._lock:
            entries = [dict(e) for e in self._entries]
        return {
            "global_step": int(self.global_step),
            "epoch": int(self.epoch),
            "step_in_epoch": int(self.step_in_epoch),
            "last_save_step": int(self.last_save_step),
            "checkpoints": [{k: v for k, v in e.items() if k != "path"} for e in entries],
            "best": [e["name"] for e in self._best_entries(entries)],
            "warmup": dict(self._warmup) if self._warmup else None,
            "iterator_continues": self._iterator_continues,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        self.global_step = int(state.get("global_step", 0))
        self.epoch = int(state.get("epoch", 0))
        self.step_in_epoch = int(state.get("step_in_epoch", 0))
        self.last_save_step = int(state.get("last_save_step", -1))
        with self._lock:
            self._entries = [dict(e) for e in state.get("checkpoints", [])]
        self._warmup = dict(state["warmup"]) if state.get("warmup") else None
        self._iterator_continues = state.get("iterator_continues")

    # ------------------------------------------------------------ public helpers
    @property
    def checkpoints(self) -> list[dict]:
        """Index entries of the committed checkpoints, oldest first."""
        self.wait()
        with self._lock:
            return [dict(e) for e in self._entries]

    def best_checkpoint(self) -> dict | None:
        """The best committed checkpoint by `monitor`, or None."""
        self.wait()
        with self._lock:
            best = self._best_entries(self._entries)
        return dict(best[0]) if best else None

    def checkpoint_for_epoch(self, epoch: int) -> dict | None:
        """The committed checkpoint taken right after (0-based) `epoch`, or None."""
        self.wait()
        with self._lock:
            for e in reversed(self._entries):
                if e.get("completed_epoch") == epoch:
                    return dict(e)
        return None

    def wait(self) -> None:
        """Blocks until a background write is done; raises its error, if any."""
        if self._queue is not None:
            self._queue.join()
        err, self._async_error = self._async_error, None
        if err is not None:
            raise err

    def flush(self) -> None:
        """Commits a pending end-of-epoch save now and waits for all writes."""
        if self._pending_epoch is not None and self.model is not None:
            self._save_pending_epoch()
        self.wait()

    def save(self, value: float | None = None) -> None:
        """Writes a checkpoint of the model's current state now, outside `fit`.

        During `fit` checkpoints are taken at step boundaries only (see the class
        docstring); this is for a model trained by hand or about to be handed
        over. With `async_save=True` it returns once the state is copied to host
        memory; call `wait()` to block until it is committed.

        Args:
            value: Monitored value to rank this checkpoint by. Defaults to `None`.

        Example:
        >>> ckpt = Checkpoint("runs/exp1/checkpoints")
        >>> ckpt.set_model(model)  # doctest: +SKIP
        >>> ckpt.save()  # doctest: +SKIP
        """
        if self.model is None:
            raise RuntimeError("Checkpoint.save() needs a model: call `set_model(model)` first.")
        if self._in_fit:
            raise RuntimeError(
                "Checkpoint.save() cannot be called during fit(): checkpoints are taken at step "
                "boundaries (use `save_every`)."
            )
        from trainwell import runtime

        self._is_chief = runtime.is_chief(getattr(self.model, "distribute_strategy", None))
        Path(self.directory).mkdir(parents=True, exist_ok=True)
        self.wait()
        with self._lock:
            self._entries = list_checkpoints(self.directory)
        self._save(value=finite_value(value), completed_epoch=None, hooks_done=False)

    @staticmethod
    def restore_latest(directory, model, include_optimizer: bool = False) -> dict:
        """Loads the newest checkpoint of `directory` into `model`. See `load_checkpoint`.

        Example:
        >>> Checkpoint.restore_latest("runs/exp1/checkpoints", model)  # doctest: +SKIP
        """
        return load_checkpoint(directory, model, include_optimizer=include_optimizer)

    load = staticmethod(load_checkpoint)
    latest = staticmethod(latest_checkpoint)

    # ------------------------------------------------------------ fit hooks
    def _reset_run_vars(self) -> None:
        self._pending_epoch: dict | None = None
        self._last_batch_logs: dict = {}
        self._batch_begin = 0
        self._last_iterator = None
        self._consumed = 0
        self._data_exhausted = False
        self._deferred: tuple | None = None
        self._pending_metrics: dict | None = None
        self._replay: dict | None = None
        self._muted: list = []
        self._watched: list = []
        self._epoch_commit: dict | None = None
        self._last_written: tuple | None = None
        self._prev_initial_epoch = None
        self._orig_train_function = None
        self._is_chief = True
        self._sync_strategy = None
        self._mode_resolved = None
        self._warmup_last_set = None

    def on_train_begin(self, logs=None) -> None:
        super().on_train_begin(logs)
        self._unwrap_train_function(stale_only=True)
        self._reset_run_vars()
        self._in_fit = True
        self._preempt_requested = False
        self._async_error = None
        from trainwell import runtime

        strategy = getattr(self.model, "distribute_strategy", None)
        self._is_chief = runtime.is_chief(strategy)
        self._sync_strategy = strategy if runtime.num_workers(strategy) > 1 else None
        self._preempt_from_peer = False
        Path(self.directory).mkdir(parents=True, exist_ok=True)
        if self._is_chief:
            self._clean_stale_temporaries()
        self._mode_resolved = self._resolve_mode()
        with self._lock:
            self._entries = list_checkpoints(self.directory)
        self._prev_initial_epoch = get_initial_epoch(self.model)
        self._install_sigterm()
        self._wrap_train_function()
        self._watch_late_epoch_ends()
        if self.resume:
            try:
                self._resume_from_disk()
            except BaseException:
                self._abort_fit()
                raise

    def _abort_fit(self) -> None:
        """Cleanup when fit dies without on_train_end (an error in a step or in the restore)."""
        self._in_fit = False
        self._end_replay()
        self._unwatch_late_epoch_ends()
        self._unwrap_train_function()
        self._uninstall_sigterm()
        try:
            self._stop_worker()  # lets a queued write finish
        finally:
            if self.model is not None:
                set_initial_epoch(self.model, self._prev_initial_epoch)

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self.epoch = int(epoch)
        self.step_in_epoch = 0
        self._data_exhausted = False
        self._ensure_wrapped()

    def on_train_batch_begin(self, batch, logs=None) -> None:
        self._batch_begin = int(batch)
        self._ensure_wrapped()

    def _ensure_wrapped(self) -> None:
        # Another callback may rebuild the train function after our on_train_begin
        # (`make_train_function(force=True)`, e.g. WarmupCosine installing its
        # schedule); wrap the new one. fit() looks the function up after
        # on_train_batch_begin, so this takes effect for the coming step.
        fn = getattr(self.model, "train_function", None)
        if self._in_fit and fn is not None and getattr(fn, "_trainwell_checkpoint_owner", None) is not self:
            self._wrap_train_function()

    def on_train_batch_end(self, batch, logs=None) -> None:
        if logs:
            self._last_batch_logs = logs

    def on_epoch_end(self, epoch, logs=None) -> None:
        params = self.params or {}
        steps = params.get("steps")
        complete = self._data_exhausted or (steps is not None and self.step_in_epoch >= steps)
        if not complete and not self.model.stop_training and steps is None:
            complete = True  # unknown length and not stopped early: the data ran out.
        if not complete or self.global_step <= self.last_save_step:
            self._pending_epoch = None
            return
        value = finite_value((logs or {}).get(self.monitor))
        epochs = params.get("epochs")
        last = bool(self.model.stop_training) or (epochs is not None and int(epoch) + 1 >= int(epochs))
        if self.save_every != "epoch" and not last:
            # Saves every N steps: a snapshot of this epoch end, committed at on_train_end
            # only if a callback after this one stops the run (no step follows).
            self._pending_epoch = {
                "epoch": int(epoch) + 1,
                "completed_epoch": int(epoch),
                "value": value,
                "snapshot": self._capture_arrays(include_metrics=False),
                "global_step": self.global_step,
            }
            return
        # The finished epoch is committed here, in this callback's on_epoch_end, not at the
        # next step: a callback after this one that raises in its on_epoch_end (or a kill
        # before the next step) must not cost the epoch (Keras's BackupAndRestore also saves
        # in on_epoch_end). Its position is the start of the next epoch with that epoch's
        # hooks not yet run (on resume every callback's on_epoch_begin runs, as it would
        # have). What callbacks listed AFTER this one do in their on_epoch_end belongs in
        # the epoch's checkpoint too (EarlyStopping's counters, `stop_training`): their
        # states are amended into it (state.json rewritten atomically, arrays untouched)
        # right after each of their on_epoch_end calls (`_watch_late_epoch_ends`), and
        # `stop_training` set by any callback is amended at on_train_end. So the epoch is
        # durable as early as possible and exact once every callback has run; a callback
        # that raises keeps the states of those that ran before it. Loggers that write
        # files (CSVLogger) should come BEFORE Checkpoint (`standard_callbacks` puts it
        # last): a row written then re-written after a crash is dropped by the reader,
        # a row never written is lost.
        self._pending_epoch = None
        continues = bool(self._iterator_continues)
        meta = self._save(
            value=value, completed_epoch=int(epoch), hooks_done=False, epoch=int(epoch) + 1, step_in_epoch=0,
            data_position=self._consumed if continues else 0,
        )
        self._epoch_commit = {
            "name": meta["entry"]["name"],
            "completed_epoch": int(epoch),
            "global_step": self.global_step,
            "callbacks": meta.get("callbacks"),
            "stopped": meta["entry"]["stopped"],
            "consumed": self._consumed,
            "data_position": meta["position"]["data_position"],
        }

    def _amend_epoch_commit(self) -> None:
        """Amends the epoch's checkpoint with what ran after this callback's on_epoch_end."""
        c = self._epoch_commit
        if c is None or c["global_step"] != self.global_step:
            return
        updates = {}
        if c["callbacks"] is not None:
            states = self._callback_states()
            if states != c["callbacks"]:
                updates["callbacks"] = c["callbacks"] = states
        stopped = bool(self.model.stop_training)
        if stopped != c["stopped"]:
            updates["stopped"] = c["stopped"] = stopped
        if updates:
            self._submit(self._amend_state, c["name"], updates)

    def _watch_late_epoch_ends(self) -> None:
        """Wraps the other StatefulCallbacks' on_epoch_end to amend the epoch's checkpoint after them."""
        ckpt = self
        for cb in stateful_callbacks(self.model).values():
            if cb is self:
                continue
            current = vars(cb).get("on_epoch_end")
            if current is not None and hasattr(current, "_trainwell_checkpoint_watch"):
                vars(cb).pop("on_epoch_end")  # left by a fit that died in a callback
            elif current is not None:
                continue  # the user's own instance attribute: leave it alone
            orig = cb.on_epoch_end

            def on_epoch_end(epoch, logs=None, _orig=orig):
                _orig(epoch, logs)
                c = ckpt._epoch_commit
                if c is not None and c["completed_epoch"] == int(epoch):
                    ckpt._amend_epoch_commit()

            on_epoch_end._trainwell_checkpoint_watch = True
            cb.on_epoch_end = on_epoch_end
            self._watched.append(cb)

    def _unwatch_late_epoch_ends(self) -> None:
        for cb in self._watched:
            current = vars(cb).get("on_epoch_end")
            if current is not None and hasattr(current, "_trainwell_checkpoint_watch"):
                vars(cb).pop("on_epoch_end")
        self._watched = []

    def on_train_end(self, logs=None) -> None:
        try:
            if self._replay is not None:
                self._end_replay()
            self._amend_epoch_commit()  # e.g. `stop_training` set by a later (non-trainwell) callback
            if self._pending_epoch is not None:
                self._save_pending_epoch()
            self.wait()
        finally:
            self._in_fit = False
            self._unwatch_late_epoch_ends()
            self._stop_worker()
            self._unwrap_train_function()
            self._uninstall_sigterm()
            if self.model is not None:
                set_initial_epoch(self.model, self._prev_initial_epoch)
            self._pending_epoch = None
            self._epoch_commit = None
            super().on_train_end(logs)
        if self._preempt_requested:
            self._exit_preempted()

    # ------------------------------------------------------------ train_function wrapper
    def _wrap_train_function(self) -> None:
        model = self.model
        orig = getattr(model, "train_function", None)
        if orig is None:
            model.make_train_function()
            orig = model.train_function
        self._orig_train_function = orig
        ckpt = self

        def train_function(iterator):
            return ckpt._train_step(orig, iterator)

        train_function._trainwell_checkpoint_original = orig
        train_function._trainwell_checkpoint_owner = self
        model.train_function = train_function

    def _unwrap_train_function(self, stale_only: bool = False) -> None:
        model = self.model
        if model is None:
            return
        fn = getattr(model, "train_function", None)
        # Unwrap every layer of our own wrapping (a crashed fit leaves one behind).
        while fn is not None and hasattr(fn, "_trainwell_checkpoint_original"):
            fn = fn._trainwell_checkpoint_original
            model.train_function = fn
        self._orig_train_function = None

    def _spe(self) -> int:
        return int(getattr(self.model, "steps_per_execution", 1) or 1)

    def _train_step(self, orig, iterator):
        try:
            return self._train_step_inner(orig, iterator)
        except StopIteration:
            raise  # the end of the data: Keras ends the epoch
        except BaseException:
            self._abort_fit()  # fit is dying (a failed save, an error in the step, preemption exit)
            raise

    def _train_step_inner(self, orig, iterator):
        if self._epoch_commit is not None:
            self._settle_epoch_commit(iterator)
        if iterator is not self._last_iterator:
            self._last_iterator = iterator  # keeps it alive, so identity is reliable
            self._consumed = 0
        if self._deferred is not None:
            self._apply_deferred(iterator)
        if self._pending_metrics is not None:
            self._restore_metrics(iterator)
        # Under multi-worker, act only on the flag every worker agreed on at this step: a
        # SIGTERM landing after the all-reduce is acted on at the next step, by all.
        preempt = self._agree_on_preemption() if self._sync_strategy is not None else self._preempt_requested
        spe = self._spe()
        replay = self._replay
        if replay is not None:
            if preempt:  # nothing new to save: the restored checkpoint is current
                self._preempt_save_and_exit()
            skip = replay.pop("fast_forward", 0)
            for _ in range(skip):
                next(iterator)
                self._consumed += 1
            if self._batch_begin < replay["until"]:
                if not replay.get("announced"):
                    replay["announced"] = True
                    self._say(
                        f"skipping {replay['until']} batches already trained in epoch {self.epoch + 1} "
                        "(resumed mid-epoch; they are read, not trained again)"
                    )
                for _ in range(spe):
                    next(iterator)
                    self._consumed += 1
                self.step_in_epoch = self._batch_begin + spe
                # No logs: nothing was trained. Keras's progress bar cannot start an epoch
                # at step K, so it still counts these steps, but without metric values
                # (the restored running means would look like training at constant loss).
                return {}
            self._end_replay()
        self.step_in_epoch = self._batch_begin
        self._maybe_save()
        if preempt:
            self._preempt_save_and_exit()
        self._apply_warmup(spe)
        try:
            out = orig(iterator)
        except StopIteration:
            self._data_exhausted = True
            raise
        self._consumed += spe
        steps = (self.params or {}).get("steps")
        done = spe if steps is None else max(0, min(spe, steps - self._batch_begin))
        self.global_step += done
        self.step_in_epoch = self._batch_begin + done
        return out

    def _settle_epoch_commit(self, iterator) -> None:
        """The first step after an epoch's commit: the commit is final; fix its data position.

        Keras keeps one iterator across epochs (`steps_per_epoch` with a longer or
        endless dataset) or makes a new one per epoch; which, shows only now. The
        commit assumed what the previous epoch boundary showed (none yet: a new
        iterator); if that was wrong, the position is amended before this step runs.
        """
        c, self._epoch_commit = self._epoch_commit, None
        continues = iterator is self._last_iterator and self._last_iterator is not None
        self._iterator_continues = continues
        want = c["consumed"] if continues else 0
        if want != c["data_position"]:
            self._submit(self._amend_state, c["name"], {"data_position": want, "iterator_continues": continues})

    def _agree_on_preemption(self) -> bool:
        """Whether any worker got a SIGTERM, the same answer on every worker at this step.

        The local flag is read once, before the all-reduce; a SIGTERM arriving later
        sets it for the next step's reduction, so no worker leaves alone.
        """
        from trainwell import runtime

        local = bool(self._preempt_requested)
        (any_requested,) = runtime.any_across_workers(self._sync_strategy, [local])
        if any_requested and not local and not self._preempt_requested:
            logger.warning("A peer worker was preempted: checkpointing at this step, then exiting.")
            self._preempt_requested = True
            self._preempt_from_peer = True
        return bool(any_requested)

    # ------------------------------------------------------------ saving
    def _save_due(self) -> bool:
        if self.global_step <= self.last_save_step:
            return False
        if self.save_every == "epoch":
            return False  # committed in on_epoch_end
        return self.global_step - max(self.last_save_step, 0) >= self.save_every

    def _maybe_save(self) -> None:
        pending = self._pending_epoch
        if self._save_due():
            if pending is not None:
                value, completed = pending["value"], pending["completed_epoch"]
            else:
                value, completed = finite_value(self._last_batch_logs.get(self.monitor)), None
            self._pending_epoch = None
            if completed is None and self.step_in_epoch == 0 and self.epoch > 0:
                completed = self.epoch - 1
            self._save(value=value, completed_epoch=completed, hooks_done=True)
        else:
            self._pending_epoch = None  # the fresh state of the next step supersedes it

    def _save_pending_epoch(self) -> None:
        p = self._pending_epoch
        self._pending_epoch = None
        if p is None or p["global_step"] <= self.last_save_step:
            return
        self._save(
            value=p["value"],
            completed_epoch=p["completed_epoch"],
            hooks_done=False,
            arrays=p["snapshot"],
            epoch=p["epoch"],
            step_in_epoch=0,
        )

    def _capture_arrays(self, include_metrics: bool) -> tuple[dict, dict, dict]:
        """Snapshots of the state (no copy; see `_read_snapshot`), names and RNG metadata."""
        values, names = _capture(self._plan(), weights_only=self.weights_only, include_metrics=include_metrics)
        rng_meta: dict = {}
        if not self.weights_only:
            rng_arrays, rng_meta = _rng_capture()
            for k, a in rng_arrays.items():
                values[k] = a
                names[k] = k
        return values, names, rng_meta

    def _plan(self) -> _Plan:
        model = self.model
        sig = (id(model), _plan_signature(model))
        if self._plan_cache is None or self._plan_cache[0] != sig:
            self._plan_cache = (sig, _Plan(model, include_optimizer=not self.weights_only))
        return self._plan_cache[1]

    def _callback_states(self) -> dict:
        """JSON states of the other `StatefulCallback`s of this fit."""
        out = {}
        for key, cb in stateful_callbacks(self.model).items():
            if cb is self:
                continue
            try:
                out[key] = _json_safe(cb.get_state())
            except (TypeError, ValueError) as e:
                raise TypeError(
                    f"The state of callback {key!r} ({type(cb).__name__}) is not JSON-serialisable: {e}"
                ) from None
        return out

    def _save(
        self, *, value, completed_epoch, hooks_done, arrays=None, epoch=None, step_in_epoch=None, data_position=None
    ) -> dict:
        """Writes a checkpoint (in the background with `async_save`); returns its state dict."""
        self.wait()  # never two writes at once; surfaces a previous async error
        model = self.model
        if epoch is None:
            epoch, step_in_epoch = self.epoch, self.step_in_epoch
        if arrays is None:
            arrays, names, rng_meta = self._capture_arrays(include_metrics=step_in_epoch > 0)
        else:
            arrays, names, rng_meta = arrays
        if data_position is None:
            data_position = int(self._consumed) if hooks_done else 0
        step = int(self.global_step)
        with self._lock:
            seq = max([_int_or(e.get("seq"), 0) for e in self._entries] + [0]) + 1
        entry = {
            "name": f"ckpt-{step}",
            "seq": seq,
            "epoch": int(epoch),
            "step_in_epoch": int(step_in_epoch),
            "global_step": step,
            "completed_epoch": completed_epoch,
            "monitor": self.monitor,
            "value": value,
            "weights_only": self.weights_only,
            "stopped": bool(model.stop_training) and step_in_epoch == 0,
            "time": time.time(),
        }
        self.last_save_step = step
        meta = {
            "format": FORMAT_VERSION,
            "entry": entry,
            "weights_only": self.weights_only,
            "position": {
                "epoch": int(epoch),
                "step_in_epoch": int(step_in_epoch),
                "global_step": step,
                "data_position": int(data_position),
                "hooks_done": bool(hooks_done),
            },
            "config": self.config,
            "keras_version": keras.__version__,
            "arrays": {},
        }
        if not self.weights_only:
            meta["rng"] = rng_meta
            meta["callbacks"] = self._callback_states()
            meta["checkpoint"] = self.get_state()
            if getattr(model, "optimizer", None) is not None:
                meta["lr_multiplier"] = get_lr_multiplier(model.optimizer)
        # Everything below (encoding, JSON, files) runs in the background with async_save.
        self._submit(self._write, arrays, names, meta, entry)
        return meta

    def _submit(self, fn, *args) -> None:
        """Runs a write now, or queues it for the writer thread (in order) with `async_save`."""
        if self.async_save:
            self._start_worker()
            self._queue.put((fn, args))  # no wait: a thread start would cost ~10 ms of GIL hand-over
        else:
            fn(*args)

    def _start_worker(self) -> None:
        if self._worker is not None and self._worker.is_alive():
            return
        self._queue = queue.Queue()
        self._worker = threading.Thread(
            target=self._worker_loop, args=(self._queue,), name="trainwell-checkpoint-writer", daemon=True
        )
        self._worker.start()

    def _stop_worker(self) -> None:
        if self._worker is not None and self._worker.is_alive():
            self._queue.put(None)
            self._worker.join()
        self._worker = None

    def _worker_loop(self, q: queue.Queue) -> None:
        while True:
            job = q.get()
            try:
                if job is None:
                    return
                fn, args = job
                fn(*args)
            except BaseException as e:  # surfaced by the next save, wait() or on_train_end
                self._async_error = e
            finally:
                q.task_done()

    def _save_error(self, name: str, current, e: BaseException) -> Exception:
        directory = str(self.directory)
        if isinstance(e, OSError):
            return CheckpointSaveError(
                e.errno if e.errno is not None else _errno.EIO,
                f"Could not save checkpoint {name!r}: writing {str(current)!r} failed "
                f"({e.strerror or e}). Previous checkpoints in {directory!r} are intact",
                str(current),
            )
        return RuntimeError(
            f"Could not save checkpoint {name!r}: writing {str(current)!r} failed ({e}). "
            f"Previous checkpoints in {directory!r} are intact"
        )

    def _write(self, arrays: dict, names: dict, meta: dict, entry: dict) -> None:
        directory = Path(self.directory)
        tmp = None
        base = None
        current = directory
        try:
            encoded = {}
            for k, value in arrays.items():
                a = _host(value)
                enc, dtype_name = _encode_array(np.asarray(a, order="C"))
                encoded[k] = enc
                meta["arrays"][k] = {"shape": list(a.shape), "dtype": dtype_name, "name": names.get(k, "")}
            if self._is_chief:
                base = directory
            else:
                # The pid in the name: a SIGKILLed worker's leftover is recognisable.
                base = current = Path(tempfile.mkdtemp(prefix=f"trainwell-ckpt-scratch-{os.getpid()}-"))
            tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=base))
            current = tmp / ARRAYS_FILE
            _write_npz(current, encoded)
            del encoded
            with zipfile.ZipFile(current) as zf:
                meta["arrays_crc32"] = _zip_crcs(zf)  # computed by zipfile while it wrote them
            current = tmp / STATE_FILE
            _write_text(current, _seal(meta))
            current = tmp
            fsync_dir(tmp)
            if _BEFORE_COMMIT is not None:
                _BEFORE_COMMIT(str(tmp))
            if not self._is_chief:
                return
            final = directory / entry["name"]
            current = final
            old = None
            if final.exists():
                old = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=directory)) / "old"
                os.rename(final, old)
            os.rename(tmp, final)
            tmp = None
            fsync_dir(directory)
            self._last_written = (entry["name"], meta)
            if old is not None:
                shutil.rmtree(old.parent, ignore_errors=True)
            current = directory / INDEX_FILE
            self._commit_index(entry)
        except Exception as e:
            raise self._save_error(entry["name"], current, e) from e
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            if not self._is_chief and base is not None:
                shutil.rmtree(base, ignore_errors=True)

    def _amend_state(self, name: str, updates: dict) -> None:
        """Rewrites state.json of the checkpoint `name` just committed (writer thread or inline).

        `updates` may hold `callbacks` (the other callbacks' states), `stopped`,
        `data_position` and `iterator_continues`. The file is replaced atomically
        and resealed; the arrays are untouched.
        """
        last = self._last_written
        if not self._is_chief or last is None or last[0] != name:
            return
        meta = last[1]
        if "callbacks" in updates:
            meta["callbacks"] = updates["callbacks"]
        if "data_position" in updates:
            meta["position"]["data_position"] = int(updates["data_position"])
        if "iterator_continues" in updates and isinstance(meta.get("checkpoint"), dict):
            meta["checkpoint"]["iterator_continues"] = bool(updates["iterator_continues"])
        if "stopped" in updates:
            meta["entry"]["stopped"] = bool(updates["stopped"])
        path = Path(self.directory) / name / STATE_FILE
        try:
            atomic_write_text(path, _seal(meta))
            if "stopped" in updates:
                path = Path(self.directory) / INDEX_FILE
                self._commit_index(meta["entry"])
        except Exception as e:
            raise self._save_error(name, path, e) from e

    def _commit_index(self, entry: dict) -> None:
        directory = Path(self.directory)
        with self._lock:
            entries = [e for e in self._entries if e["name"] != entry["name"]]
            e = dict(entry)
            e["path"] = str(directory / entry["name"])
            entries.append(e)
            keep = {x["name"] for x in entries[-self.keep_last:]}
            keep |= {x["name"] for x in self._best_entries(entries)[: self.keep_best]}
            kept = [x for x in entries if x["name"] in keep]
            dropped = [x for x in entries if x["name"] not in keep]
            atomic_write_json(
                directory / INDEX_FILE,
                {
                    "format": FORMAT_VERSION,
                    "monitor": self.monitor,
                    "mode": self._mode_resolved or self.mode,
                    "checkpoints": [{k: v for k, v in x.items() if k != "path"} for x in kept],
                    "best": [x["name"] for x in self._best_entries(kept)[: max(self.keep_best, 1)]],
                },
            )
            self._entries = kept
        for x in dropped:
            path = _checkpoint_path(directory, x["name"])  # never a name from disk that leaves the directory
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)

    def _best_entries(self, entries: list[dict]) -> list[dict]:
        valued = [
            e for e in entries if finite_value(e.get("value")) is not None and e.get("monitor") == self.monitor
        ]
        sign = -1.0 if (self._mode_resolved or self._resolve_mode(False)) == "max" else 1.0
        return sorted(valued, key=lambda e: (sign * float(e["value"]), -e.get("seq", 0)))

    def _resolve_mode(self, use_model: bool = True) -> str:
        """`trainwell.compat.metric_direction`: Keras's rule with the model, else by name; "min" if neither says."""
        model = self.model if use_model else None
        found = metric_direction(self.monitor, self.mode, model) if model is not None else None
        return found or metric_direction(self.monitor, self.mode) or "min"

    def _clean_stale_temporaries(self) -> None:
        """Removes what a killed save left: `.tmp-ckpt-*` directories and atomic-write temporaries."""
        directory = Path(self.directory)
        for child in directory.iterdir():
            if child.name.startswith(_TMP_PREFIX):
                shutil.rmtree(child, ignore_errors=True)
                logger.info("Removed stale temporary checkpoint %s", child)
            elif _checkpoint_path(directory, child.name) is not None and child.is_dir():
                remove_stale_temporaries(child)  # an amended state.json's temporary
        remove_stale_temporaries(directory)  # the index's (`.checkpoint.json.*.tmp`)

    # ------------------------------------------------------------ messages
    def _say(self, msg: str) -> None:
        """One line on stdout (the progress bar's stream), when `verbose`."""
        if self.verbose:
            print(f"Checkpoint: {msg}", flush=True)

    def _alert(self, msg: str) -> None:
        """One line on stderr, always, on a line of its own even mid progress bar."""
        bar = (self.params or {}).get("verbose", 0) in (1, "auto")  # Keras's bar ends its line with "\r" only
        sys.stdout.flush()
        print(("\n" if bar else "") + f"Checkpoint: {msg}", file=sys.stderr, flush=True)

    def _resume_command(self) -> str:
        """How to continue this run: `trainwell resume RUN_DIR` for a recipe's run directory."""
        run_dir = Path(self.directory).parent
        try:
            recipe = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8")).get("recipe")
        except (OSError, ValueError, AttributeError):
            recipe = None
        if recipe:
            return f"trainwell resume {run_dir}"
        return f"run the same fit() again with Checkpoint({self.directory!r})"

    # ------------------------------------------------------------ resuming
    def _resume_from_disk(self) -> None:
        chosen = resume_checkpoint(self.directory)  # the same decision the recipe positions its data by
        if chosen is None:
            return
        meta, arrays = _read_checkpoint(chosen["path"])
        self._restore(meta, arrays, chosen["path"])

    def _restore(self, meta: dict, arrays: dict, path: str) -> None:
        model = self.model
        pos = meta["position"]
        weights_only = bool(meta.get("weights_only"))
        if self.config is not None and meta.get("config") not in (None, self.config):
            warnings.warn(f"Resuming from {path!r}, which was written with a different run config.")
        own = meta.get("checkpoint")
        with self._lock:
            entries = self._entries
        if own:
            self.set_state(own)
        else:
            StatefulCallback.set_state(self, {})
        with self._lock:
            self._entries = entries  # disk is the source of truth for the list
        self.global_step = int(pos["global_step"])
        self.last_save_step = self.global_step
        self.epoch = int(pos["epoch"])
        self.step_in_epoch = int(pos["step_in_epoch"])
        if weights_only:
            self._warmup = (
                {"step": 0, "total": self.warm_start_warmup_steps, "base": None, "last_set": None, "kind": None}
                if self.warm_start_warmup_steps > 0
                else None
            )
        entry = meta.get("entry", {})
        start_epoch = int(pos["epoch"])
        epochs = (self.params or {}).get("epochs")
        stopped = bool(entry.get("stopped"))
        if stopped and epochs is not None:
            start_epoch = max(start_epoch, int(epochs))
        set_initial_epoch(model, start_epoch)
        self._announce_resume(path, pos, epochs, start_epoch, stopped)
        include_metrics = pos["step_in_epoch"] > 0
        if model_fully_built(model):
            self._apply_arrays(arrays, meta, path)
            if include_metrics and any(k.startswith("metric:") for k in arrays):
                self._pending_metrics = {"arrays": arrays, "path": path}
        else:
            self._deferred = (arrays, meta, path, include_metrics)
        if not weights_only:
            registry = stateful_callbacks(model)
            for key, state in (meta.get("callbacks") or {}).items():
                cb = registry.get(key)
                if cb is None or cb is self:
                    warnings.warn(f"Checkpoint {path!r} holds state for callback {key!r}, which is not in this fit.")
                    continue
                cb.set_state(state)
            if "lr_multiplier" in meta:
                try:
                    set_lr_multiplier(model.optimizer, float(meta["lr_multiplier"]))
                except Exception as e:
                    if float(meta["lr_multiplier"]) != 1.0:
                        warnings.warn(f"Could not restore the LR multiplier from {path!r}: {e}")
        until = int(pos["step_in_epoch"]) if pos.get("hooks_done") else 0
        fast_forward = max(0, int(pos.get("data_position", 0)) - until)
        if pos.get("hooks_done") or fast_forward:
            self._replay = {"until": until, "fast_forward": fast_forward}
            if pos.get("hooks_done"):
                self._mute_stateful_hooks()

    def _announce_resume(self, path: str, pos: dict, epochs, start_epoch: int, stopped: bool) -> None:
        epoch, step, done = int(pos["epoch"]), int(pos["step_in_epoch"]), int(pos["global_step"])
        if epochs is not None and start_epoch >= int(epochs):
            how = f"it stopped early after epoch {epoch}" if stopped else f"{min(epoch, int(epochs))} of {epochs} epochs trained"
            more = self._resume_command()
            more = f"{more} --set epochs=N" if more.startswith("trainwell") else more.replace("fit()", "fit(epochs=N)")
            self._say(
                f"the run is already complete ({how}, {done} steps; {path}): nothing to train. "
                f"To train longer: {more} with N > {epochs}."
            )
            return
        total = f"/{epochs}" if epochs is not None else ""
        where = f"at step {step} of epoch {epoch + 1}{total}" if step else f"at the start of epoch {epoch + 1}{total}"
        self._say(f"resuming from {path} {where} ({done} steps trained)")

    def _apply_arrays(self, arrays: dict, meta: dict, path: str) -> None:
        model = self.model
        weights_only = bool(meta.get("weights_only"))
        if not weights_only and model.optimizer is not None and not model.optimizer.built:
            with model.distribute_strategy.scope():
                model.optimizer.build(model.trainable_variables)
        plan = _Plan(model, include_optimizer=not weights_only and not self.weights_only)
        _restore_model_arrays(plan, arrays, path)
        if weights_only:
            return
        if self.weights_only:
            return  # this run saves weights only; keep the optimizer fresh as configured
        _restore_vars(plan.opt_vars, arrays, path, "optimizer", "opt:")
        _restore_vars(plan.seed_vars, arrays, path, "seed generators", "seed:")
        _rng_restore(arrays, meta.get("rng") or {})

    def _element_spec_build(self, iterator) -> None:
        model = self.model
        spec = getattr(iterator, "element_spec", None)
        if spec is None:
            raise RuntimeError(
                f"Checkpoint: cannot build model {model.name!r} to restore {self.directory!r}: the input "
                "iterator has no element_spec. Build the model before calling fit()."
            )
        with model.distribute_strategy.scope():
            symbolic_build(model, spec)

    def _apply_deferred(self, iterator) -> None:
        arrays, meta, path, include_metrics = self._deferred
        self._deferred = None
        if not model_fully_built(self.model):
            self._element_spec_build(iterator)
        self._apply_arrays(arrays, meta, path)
        if include_metrics and any(k.startswith("metric:") for k in arrays):
            self._pending_metrics = {"arrays": arrays, "path": path}

    def _restore_metrics(self, iterator) -> None:
        pending, self._pending_metrics = self._pending_metrics, None
        model = self.model
        if compiled_metrics_unbuilt(model):
            try:
                self._element_spec_build(iterator)
            except Exception as e:  # metrics are cosmetic; never block a resume
                warnings.warn(f"Could not rebuild metrics to restore them: {e}")
                return
        used: dict[str, int] = {}
        items = [(_dedup(f"metric:{v.path}", used), v) for v in model.metrics_variables]
        try:
            _restore_vars(items, pending["arrays"], pending["path"], "metrics", "metric:")
        except CheckpointMismatchError as e:
            warnings.warn(f"Metric accumulators not restored: {e}")

    def _mute_stateful_hooks(self) -> None:
        ckpt = self
        for cb in stateful_callbacks(self.model).values():
            if cb is self:
                continue
            for name in ("on_epoch_begin", "on_train_batch_begin", "on_train_batch_end"):
                if name in vars(cb):
                    continue
                orig = getattr(cb, name)

                def muted(*args, _orig=orig, **kwargs):
                    if ckpt._replay is not None:
                        return None
                    return _orig(*args, **kwargs)

                setattr(cb, name, muted)
                self._muted.append((cb, name))

    def _end_replay(self) -> None:
        self._replay = None
        for cb, name in self._muted:
            vars(cb).pop(name, None)
        self._muted = []

    # ------------------------------------------------------------ warm start
    def _apply_warmup(self, spe: int) -> None:
        w = self._warmup
        if not w:
            return
        opt = self.model.optimizer
        total = int(w["total"])
        s = int(w["step"])
        factor = 1.0 if s >= total else (s + 1) / total
        if w.get("kind") is None:
            lr = raw_learning_rate(opt)
            w["kind"] = "multiplier" if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule) else "variable"
        if w["kind"] == "variable":
            current = float(_to_numpy(opt.learning_rate))
            if w["base"] is None or w["last_set"] is None or not math.isclose(current, w["last_set"], rel_tol=1e-6):
                w["base"] = current  # someone else (a schedule callback) set it for this step
            new = w["base"] * factor
            opt.learning_rate = new
            w["last_set"] = float(_to_numpy(opt.learning_rate))
        elif w["kind"] == "multiplier":
            current = get_lr_multiplier(opt)
            if w["base"] is None or w["last_set"] is None or not math.isclose(current, w["last_set"], rel_tol=1e-6):
                w["base"] = current
            set_lr_multiplier(opt, w["base"] * factor)
            w["last_set"] = w["base"] * factor
        w["step"] = s + spe
        if s >= total:
            self._warmup = None

    # ------------------------------------------------------------ preemption
    def _install_sigterm(self) -> None:
        if self._sigterm_installed or threading.current_thread() is not threading.main_thread():
            return
        try:
            current = signal.getsignal(signal.SIGTERM)
            owner = getattr(current, "__self__", None)
            if isinstance(owner, Checkpoint) and owner is not self:
                # Another Checkpoint's handler is still installed: its fit died in a
                # callback (Keras then never calls on_train_end), so it is stale.
                # Retire it and chain to what it replaced, or a later SIGTERM would
                # reach it and terminate the process 120 s later (a notebook kernel).
                current = owner._retire_stale_sigterm()
            self._prev_sigterm = current
            signal.signal(signal.SIGTERM, self._on_sigterm)
            self._sigterm_installed = True
        except (ValueError, OSError):  # pragma: no cover - not the main interpreter
            self._sigterm_installed = False

    def _retire_stale_sigterm(self):
        """Disarms this (stale) handler and returns the handler it had replaced."""
        timer, self._grace_timer = self._grace_timer, None
        if timer is not None:
            timer.cancel()
        self._sigterm_installed = False
        self._preempt_requested = False
        self._in_fit = False
        return self._prev_sigterm

    def _uninstall_sigterm(self) -> None:
        timer, self._grace_timer = self._grace_timer, None
        if timer is not None:
            timer.cancel()
        if not self._sigterm_installed:
            return
        try:
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, self._prev_sigterm if self._prev_sigterm is not None else signal.SIG_DFL)
        except (ValueError, OSError):  # pragma: no cover
            pass
        self._sigterm_installed = False

    def _on_sigterm(self, signum, frame) -> None:
        if self._preempt_from_peer and self._in_fit:
            # Our own first SIGTERM after a peer's: the checkpoint is already under way.
            self._preempt_from_peer = False
            return
        if self._preempt_requested or not self._in_fit:
            # Second signal (or outside fit): fall through to the previous handler,
            # which now owns the shutdown.
            self._preempt_requested = False
            self._uninstall_sigterm()
            prev = self._prev_sigterm
            if callable(prev):
                prev(signum, frame)
            else:
                signal.raise_signal(signum)
            return
        self._alert("SIGTERM received: saving a checkpoint at the next step, then exiting.")
        self._preempt_requested = True
        timer = threading.Timer(self.PREEMPTION_GRACE_S, self._grace_expired)
        timer.daemon = True
        self._grace_timer = timer
        timer.start()

    def _grace_expired(self) -> None:
        if self._preempt_requested and self._sigterm_installed:
            logger.error(
                "No step boundary within %.0f s of SIGTERM: terminating without a checkpoint.", self.PREEMPTION_GRACE_S
            )
            os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM falls through

    def _preempt_save_and_exit(self) -> None:
        if self.global_step > self.last_save_step:
            self._save(value=None, completed_epoch=None, hooks_done=True)
        self.wait()
        self._stop_worker()
        self._in_fit = False
        self._unwrap_train_function()
        self._end_replay()
        if self.model is not None:
            set_initial_epoch(self.model, self._prev_initial_epoch)
        self._exit_preempted()

    def _exit_preempted(self) -> None:
        self._alert(
            f"preempted: the training state is saved in {os.path.join(self.directory, f'ckpt-{self.last_save_step}')} "
            f"(epoch {self.epoch + 1}, step {self.step_in_epoch}). To resume: {self._resume_command()}"
        )
        prev = self._prev_sigterm
        self._uninstall_sigterm()
        self._preempt_requested = False
        from_peer, self._preempt_from_peer = self._preempt_from_peer, False
        if callable(prev) and not from_peer:
            prev(signal.SIGTERM, None)
        raise SystemExit(self.PREEMPTED_EXIT_CODE)


# --------------------------------------------------------------------------- file writes


def _write_npz(path: Path, arrays: dict) -> None:
    with open(path, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
