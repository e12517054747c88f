"""The on-disk format of a checkpoint: files, index, checksums, and reading them back.

A checkpoint is a directory `ckpt-<global_step>` holding `arrays.npz` (every
array: model weights, optimizer variables incl. `iterations` and the loss scale,
dropout/seed-generator states, metric accumulators, RNG states) and `state.json`
(everything else: epoch, step and data position, Python/NumPy RNG state, the
states of the other trainwell `StatefulCallback`s, the LR multiplier, the run
config, a manifest of the arrays). No pickle anywhere: the arrays are read back
with `np.load(..., allow_pickle=False)`.

A checkpoint is written into `directory/.tmp-ckpt-XXXX` (`write_npz`,
`write_text`), then committed by `commit_directory`: each file and the
temporary directory fsynced, one `os.rename` to `directory/ckpt-<step>`; the
index `directory/checkpoint.json` is then replaced (`write_index`), and the one
fsync of `directory` that ends it makes both renames durable. A loader
therefore never sees a half-written checkpoint: a `.tmp-ckpt-*` directory is
ignored (and removed when the next run starts, `clean_stale_temporaries`), and
a committed checkpoint that is missing from the index (a crash between the
rename and the index write) is found on disk and used. state.json records
checksums (its own SHA-256, the CRC-32 of each array in arrays.npz) that every
load checks; a resume skips a damaged checkpoint for the next older one
(`resume_checkpoint`).

On an object store (`directory` an `s3://`/`gs://` URL, `trainwell.storage`)
there is no rename: the files go under a fresh prefix `ckpt-<step>-<8 hex>`,
the index `checkpoint.json` is PUT last and is the commit; a reader trusts only
what the index lists (no scan), and verifies it as above.

Example:
>>> import tempfile
>>> list_checkpoints(tempfile.mkdtemp()), latest_checkpoint(tempfile.mkdtemp())
([], None)
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
import warnings
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np

from trainwell import storage
from trainwell.compat.sharded import SHARDED_DIR, placeholders
from trainwell.compat.sharded import complete as sharded_complete
from trainwell.io import fsync_dir, remove_stale_temporaries
from trainwell.storage import is_url, store_for, write_npz, write_text  # noqa: F401 - patched by the tests here
from trainwell.validation import is_int

logger = logging.getLogger("trainwell.checkpoint")

INDEX_FILE = "checkpoint.json"
ARRAYS_FILE = "arrays.npz"
STATE_FILE = "state.json"
FORMAT_VERSION = 1
TMP_PREFIX = ".tmp-ckpt-"
_CKPT_RE = re.compile(r"^ckpt-(\d+)$")
PREFIX_RE = re.compile(r"^ckpt-\d+-[0-9a-f]{8}$")  # a checkpoint's prefix on an object store


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


def encode_array(arr: np.ndarray) -> tuple[np.ndarray, str]:
    """Returns an array `np.save` can write without pickle, and its dtype name."""
    if arr.dtype.kind == "O":
        raise TypeError(f"cannot checkpoint an object array (dtype {arr.dtype})")
    if arr.dtype.isbuiltin != 1 or arr.dtype.kind == "V":  # e.g. ml_dtypes.bfloat16
        return arr.view(np.dtype(f"u{arr.dtype.itemsize}")), arr.dtype.name
    return arr, arr.dtype.name


def _dtype_from_name(dtype_name: str) -> np.dtype:
    """The dtype a checkpoint's manifest names; never an object (pointer) dtype."""
    try:
        dtype = np.dtype(dtype_name)
    except TypeError:
        dtype = np.dtype(getattr(ml_dtypes, str(dtype_name), None) or "O")
    if dtype.hasobject or (dtype.kind == "V" and dtype.isbuiltin != 2):  # only ml_dtypes' types are kind V
        raise CheckpointCorruptError(f"unsupported dtype {dtype_name!r} in the array manifest")
    return dtype


def _decode_array(arr: np.ndarray, dtype_name: str) -> np.ndarray:
    if arr.dtype.name == dtype_name:
        return arr
    return arr.view(_dtype_from_name(dtype_name))


def _read_index(directory) -> list[dict]:
    path = storage.join(str(directory), INDEX_FILE)
    try:
        raw = store_for(directory).get(INDEX_FILE) if is_url(directory) else Path(path).read_bytes()
        data = json.loads(raw.decode("utf-8"))
        entries = data.get("checkpoints", [])
        return [e for e in entries if isinstance(e, dict) and "name" in e]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, AttributeError) as e:
        warnings.warn(f"Ignoring unreadable checkpoint index {path!r} ({e}); scanning the directory instead.")
        return []


def checkpoint_path(directory: Path, name) -> Path | None:
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
    `resume_checkpoint`. On an object store only the index counts.

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
    if is_url(directory):
        return _list_url(str(directory))
    directory = Path(directory)
    if not directory.is_dir():
        return []
    by_name = {}
    for e in _read_index(directory):
        path = checkpoint_path(directory, e["name"])
        if path is None:
            warnings.warn(
                f"Ignoring the entry {e['name']!r} of {str(directory / INDEX_FILE)!r}: not a checkpoint name "
                "trainwell writes (ckpt-<step>) inside that directory."
            )
            continue
        if path.is_dir():  # kept even if damaged: `resume_checkpoint` names it and falls back
            by_name[e["name"]] = dict(e)
    for child in directory.iterdir():
        if child.name in by_name or checkpoint_path(directory, child.name) is None:
            continue
        try:
            meta = json.loads((child / STATE_FILE).read_text(encoding="utf-8"))
            by_name[child.name] = dict(meta["entry"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    out = [dict(e, name=name, path=str(directory / name)) for name, e in by_name.items()]
    out.sort(key=lambda e: (int_or(e.get("seq"), 0), int_or(e.get("global_step"), 0)))
    return out


def _list_url(directory: str) -> list[dict]:
    """The checkpoints the index of an object-store directory lists (the commit): nothing else counts."""
    out = []
    for e in _read_index(directory):
        if not (_CKPT_RE.match(str(e["name"])) and PREFIX_RE.match(str(e.get("prefix")))):
            warnings.warn(f"Ignoring the entry {e['name']!r} of {directory}/{INDEX_FILE}: not one trainwell writes.")
            continue
        out.append(dict(e, path=storage.join(directory, e["prefix"])))
    out.sort(key=lambda e: (int_or(e.get("seq"), 0), int_or(e.get("global_step"), 0)))
    return out


_LAST_OBJECT: dict = {}  # the last arrays object read: verifying and then loading a checkpoint download it once


def _object(path: str, name: str):
    """`(store, key)` of file `name` of the checkpoint at object prefix `path`."""
    directory, prefix = path.rsplit("/", 1)
    return store_for(directory), f"{prefix}/{name}"


def _read_file(path, name: str) -> bytes:
    """The bytes of file `name` of the checkpoint at `path` (a local directory or an object prefix)."""
    if not is_url(str(path)):
        return (Path(path) / name).read_bytes()
    store, key = _object(str(path), name)
    ident = store.info_id(key)
    if ident is None:
        raise FileNotFoundError(2, "missing", name)
    cached = _LAST_OBJECT.get((str(path), name))
    if cached is not None and cached[0] == ident:
        return cached[1]
    data = store.get(key)
    if name == ARRAYS_FILE:
        _LAST_OBJECT.clear()
        _LAST_OBJECT[(str(path), name)] = (ident, data)
    return data


def int_or(x, default: int) -> int:
    return int(x) if is_int(x) else default


def latest_checkpoint(directory: str | os.PathLike) -> str | None:
    """Path of the newest committed checkpoint in `directory`, or None (not verified).

    Example:
    >>> import tempfile
    >>> latest_checkpoint(tempfile.mkdtemp()) is None
    True
    """
    entries = list_checkpoints(directory)
    return entries[-1]["path"] if entries else None


# ---- verification: written at commit (`seal`), checked at load (`_read_state`, `_check_zip`).
# state.json carries `state_sha256`, the SHA-256 of its own canonical JSON without that key and
# without `entry` (the index record, which tools annotate: `trainwell.tuning` marks copied
# checkpoints), and `arrays_crc32`, the CRC-32 of every member of arrays.npz. zipfile computes
# those CRCs while writing and checks each member against its CRC while reading it, so the arrays
# are verified at no extra pass over the data; recording them in the (hashed) state also ties the
# arrays file to its state file. Checkpoints written before this carry neither and still load.


def _canonical_state(meta: dict) -> bytes:
    body = {k: v for k, v in meta.items() if k not in ("entry", "state_sha256")}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True).encode("utf-8")


def seal(meta: dict) -> str:
    """Sets `meta["state_sha256"]` (of the JSON as a loader parses it) and returns state.json's text."""
    meta["state_sha256"] = hashlib.sha256(_canonical_state(json.loads(json.dumps(meta)))).hexdigest()
    return json.dumps(meta, indent=1, sort_keys=True)


def zip_crcs(zf: zipfile.ZipFile) -> dict[str, int]:
    """CRC-32 of every member, from the zip's central directory (no data read)."""
    return {i.filename: int(i.CRC) for i in zf.infolist()}


_POSITION_KEYS = ("epoch", "step_in_epoch", "global_step")


def _read_state(path) -> dict:
    """state.json of a checkpoint, parsed and verified; raises on any damage."""
    meta = json.loads(_read_file(path, STATE_FILE).decode("utf-8"))
    if not isinstance(meta, dict):
        raise CheckpointCorruptError("state.json does not hold a JSON object")
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"unsupported checkpoint format {meta.get('format')!r}")
    claimed = meta.get("state_sha256")
    if claimed is not None and hashlib.sha256(_canonical_state(meta)).hexdigest() != claimed:
        raise CheckpointCorruptError("state.json does not match its checksum")
    pos, manifest = meta.get("position"), meta.get("arrays")
    if not (isinstance(pos, dict) and all(is_int(pos.get(k)) for k in _POSITION_KEYS)):
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
    if recorded is not None and zip_crcs(zf) != recorded:
        raise CheckpointCorruptError("arrays.npz does not match the checksums in state.json")
    names = {n[:-4] if n.endswith(".npy") else n for n in zf.namelist()}
    missing = sorted(set(meta["arrays"]) - names)
    if missing:
        raise CheckpointCorruptError(f"arrays {missing[:5]} are missing from arrays.npz")


def _check_sharded(path, meta: dict) -> None:
    """The sharded arrays a checkpoint lists (`compat.sharded`) are there, committed by Orbax."""
    if meta.get("sharded") and (is_url(str(path)) or not sharded_complete(Path(path) / SHARDED_DIR)):
        raise CheckpointCorruptError(f"its sharded arrays ({SHARDED_DIR}/) are missing or were not committed")


def _arrays_source(path):
    """What `zipfile`/`np.load` open for arrays.npz: the local file, or the object's bytes (read once)."""
    return io.BytesIO(_read_file(path, ARRAYS_FILE)) if is_url(str(path)) else Path(path) / ARRAYS_FILE


def _verify(path) -> dict:
    """Verifies a whole checkpoint (every array byte against its CRC); returns its state."""
    meta = _read_state(path)
    with zipfile.ZipFile(_arrays_source(path)) as zf:
        _check_zip(zf, meta)
        bad = zf.testzip()
        if bad is not None:
            raise CheckpointCorruptError(f"arrays.npz member {bad!r} fails its CRC-32 check")
    _check_sharded(path, meta)
    return meta


def _file_ids(path) -> tuple:
    """Identities of a checkpoint's files: a rewritten or replaced file changes them."""
    if is_url(str(path)):
        return tuple(store.info_id(key) for store, key in (_object(str(path), n) for n in (STATE_FILE, ARRAYS_FILE)))
    path = Path(path)
    out = []
    for name in (STATE_FILE, ARRAYS_FILE):
        try:
            st = (path / name).stat()
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _verification(path: str, file_ids: tuple) -> dict | str:
    """`_verify(path)`'s state, or what is wrong; remembered while the files stay the same, so the
    recipe (which positions its data pipeline) and `Checkpoint` (which loads) decide once, alike."""
    try:
        return _verify(path if is_url(path) else Path(path))
    except Exception as e:  # noqa: BLE001 - any failure to read a checkpoint means damage
        return _damage(e)


def _verified_state(path) -> dict:
    """The verified state of the checkpoint at `path`; raises CheckpointCorruptError."""
    result = _verification(str(path), _file_ids(path))
    if isinstance(result, str):
        raise CheckpointCorruptError(result)
    return result


def resume_checkpoint(directory: str | os.PathLike) -> dict | None:
    """The checkpoint a resume from `directory` loads: the newest one that verifies.

    Each checkpoint is verified against the checksums written when it was
    committed (state.json's own SHA-256, the CRC-32 of every array); one that
    fails (truncated, altered, a file missing, an unsupported dtype) is skipped
    with a warning naming it, and the next older one is tried. `Checkpoint`
    resumes from this checkpoint and `trainwell.recipes.harness.resume_epoch` positions
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
    directory = str(directory) if is_url(directory) else Path(directory)
    damaged = []
    for entry in reversed(list_checkpoints(directory)):
        try:
            meta = _verified_state(entry["path"] if is_url(directory) else Path(entry["path"]))
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


def read_checkpoint(path: str | os.PathLike) -> tuple[dict, dict]:
    """Reads one checkpoint, verified against its checksums: `(state, arrays)`.

    `state` is state.json as a dict (`entry`, `position`, `config`,
    `callbacks`, `lr_multiplier`, `rng`, the array manifest...); `arrays` maps
    each key (`model:layers/dense/0`, `opt:...`, `metric:...`, `rng:...`) to a
    NumPy array. Nothing is loaded into a model: see `load_checkpoint`.

    Args:
        path: A checkpoint directory (`.../ckpt-120`). Required.

    Returns:
        `(state, arrays)`.

    Raises:
        CheckpointCorruptError: The checkpoint is damaged or unreadable; the
            message names it and what is wrong.

    Example:
    >>> read_checkpoint("runs/exp1/checkpoints/ckpt-120")[0]["position"]  # doctest: +SKIP
    {'epoch': 2, 'step_in_epoch': 0, 'global_step': 120, 'data_position': 0, 'hooks_done': False}
    """
    path = str(path) if is_url(path) else Path(path)
    try:
        meta = _read_state(path)
        manifest = meta["arrays"]
        arrays = {}
        with np.load(_arrays_source(path), allow_pickle=False) as z:
            _check_zip(z.zip, meta)
            for k in z.files:
                arr = z[k]  # zipfile checks the member's CRC-32 while reading it
                dtype = manifest.get(k, {}).get("dtype")
                arrays[k] = _decode_array(arr, dtype) if dtype else arr
        _check_sharded(path, meta)
        arrays.update(placeholders(Path(path) / SHARDED_DIR, meta.get("sharded") or {}))
    except Exception as e:  # noqa: BLE001 - any failure to read a checkpoint means damage
        raise CheckpointCorruptError(f"Checkpoint {str(path)!r} is damaged or unreadable ({_damage(e)})") from e
    return meta, arrays


def resolve_checkpoint_path(path: str | os.PathLike) -> Path | str:
    """`path` if it is a checkpoint, else the checkpoint a resume from directory `path` would load."""
    if is_url(path):
        if PREFIX_RE.match(str(path).rstrip("/").rsplit("/", 1)[-1]):
            return str(path).rstrip("/")
        chosen = resume_checkpoint(path)
        if chosen is None:
            raise FileNotFoundError(f"No committed checkpoint found in {path!r}")
        return chosen["path"]
    path = Path(path)
    if (path / STATE_FILE).is_file() or (path / ARRAYS_FILE).is_file():
        return path
    chosen = resume_checkpoint(path)
    if chosen is None:
        raise FileNotFoundError(f"No committed checkpoint found in {str(path)!r}")
    return Path(chosen["path"])


def copy_checkpoint(src: str | os.PathLike, directory: str | os.PathLike, **entry) -> Path:
    """Copies the committed checkpoint `src` into the `Checkpoint` directory `directory`.

    The copy is written as a checkpoint is (a `.tmp-ckpt-*` directory, fsynced,
    committed with one rename, `commit_directory`), so a loader never sees half
    of it; a checkpoint of the same name already there is replaced. `entry`
    updates the copy's index record (state.json's `entry`, outside its
    checksum), e.g. `stopped=False` for a run that goes on from it. A
    `Checkpoint` in `directory` resumes from the copy as from its own.

    Args:
        src: A committed checkpoint (`.../ckpt-120`). Required.
        directory: The `Checkpoint` directory to copy into (created if needed).
            Required.
        **entry: Fields of the copy's index record to set.

    Returns:
        The copy's path (`directory/ckpt-<step>`).

    Raises:
        CheckpointCorruptError: `src` is damaged or not a checkpoint.

    Example:
    >>> copy_checkpoint("runs/a/checkpoints/ckpt-120", "runs/b/checkpoints", stopped=False)  # doctest: +SKIP
    PosixPath('runs/b/checkpoints/ckpt-120')
    """
    src, directory = Path(src), Path(directory)
    try:
        meta = _read_state(src)
    except Exception as e:  # noqa: BLE001 - any failure to read a checkpoint means damage
        raise CheckpointCorruptError(f"Checkpoint {str(src)!r} is damaged or unreadable ({_damage(e)})") from e
    directory.mkdir(parents=True, exist_ok=True)
    meta.setdefault("entry", {}).update(entry)
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=directory))
    try:
        shutil.copyfile(src / ARRAYS_FILE, tmp / ARRAYS_FILE)
        if (src / SHARDED_DIR).is_dir():
            shutil.copytree(src / SHARDED_DIR, tmp / SHARDED_DIR)
        write_text(tmp / STATE_FILE, json.dumps(meta, indent=1, sort_keys=True))
        commit_directory(tmp, directory / src.name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(directory)
    return directory / src.name


def commit_directory(tmp: Path, final: Path) -> None:
    """Commits the checkpoint written in `tmp` as `final` (`trainwell.storage.commit_directory`).

    The rename is durable once `final.parent` is fsynced: `write_index`, which
    follows it in a save, does it, so one fsync covers both renames.
    """
    storage.commit_directory(tmp, final, TMP_PREFIX)


def write_index(directory, index: dict) -> None:
    """Replaces `directory`'s index (a temporary, one rename), then fsyncs `directory`.

    On an object store it is one PUT: the commit of the checkpoints it lists.

    The index's own bytes are not fsynced: it is a cache of the committed
    checkpoints' `entry` records, and `list_checkpoints` reads those from disk
    when the index is missing or unreadable. The temporary is named as
    `trainwell.io`'s are, so `clean_stale_temporaries` removes a killed one.
    """
    if is_url(directory):
        store_for(directory).put(INDEX_FILE, json.dumps(index, indent=2, sort_keys=True).encode("utf-8"))
        return
    storage.write_json_replace(Path(directory), INDEX_FILE, index)


def clean_stale_temporaries(directory) -> None:
    """Removes what a killed save left: `.tmp-ckpt-*` directories and atomic-write temporaries.

    On an object store: the `ckpt-*` prefixes the index does not list (call it holding the writer lease).
    """
    if is_url(directory):
        listed = {e.get("prefix") for e in _read_index(directory)}
        for name in store_for(directory).remove_unlisted(PREFIX_RE, listed):
            logger.info("Removed %s/%s: not listed in the index (left by a killed save)", directory, name)
        return
    for child in directory.iterdir():
        if child.name.startswith(TMP_PREFIX):
            shutil.rmtree(child, ignore_errors=True)
            logger.info("Removed stale temporary checkpoint %s", child)
        elif checkpoint_path(directory, child.name) is not None and child.is_dir():
            remove_stale_temporaries(child)  # an amended state.json's temporary
    remove_stale_temporaries(directory)  # the index's (`.checkpoint.json.*.tmp`)
