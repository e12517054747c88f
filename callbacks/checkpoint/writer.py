"""Writing checkpoints: snapshot, files, commit, index and rotation, in the background if asked.

`CheckpointWriter` is the part of `Checkpoint` that turns the current training
state into a committed checkpoint (`_save`): a snapshot of every array
(`state.capture`, no copy), the JSON state, then the files written and
committed through `files` (`write_npz`, `write_text`, `commit_directory`; the
test suite stalls or fails a save by patching those), the index replaced
(`write_index`: its fsync of the directory makes the commit's rename durable too),
and the checkpoints beyond `keep_last`/`keep_best` removed. With `async_save`
everything after the snapshot runs in one writer thread, in order. Only the
chief writes into `directory`; other workers write the same files to a scratch
directory and delete it, uncommitted and unsynced.
"""

from __future__ import annotations

import errno
import io
import os
import queue
import shutil
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import keras
import numpy as np

from trainwell.callbacks.base import stateful_callbacks
from trainwell.callbacks.checkpoint import files
from trainwell.callbacks.checkpoint.files import (
    ARRAYS_FILE,
    FORMAT_VERSION,
    INDEX_FILE,
    PREFIX_RE,
    STATE_FILE,
    TMP_PREFIX,
    CheckpointSaveError,
    checkpoint_path,
    encode_array,
    int_or,
    seal,
    zip_crcs,
)
from trainwell.callbacks.checkpoint.state import (
    Plan,
    capture,
    changed_frozen,
    frozen_fingerprints,
    host,
    json_safe,
    plan_for,
    rng_capture,
)
from trainwell.compat.backend import sync_variables
from trainwell.compat.sharded import SHARDED_DIR, save_sharded, split_sharded
from trainwell.compat.learning_rate import get_lr_multiplier
from trainwell import storage
from trainwell.compat.metrics import finite_value, metric_direction
from trainwell.io import atomic_write_text


class CheckpointWriter:
    """Mixin of `Checkpoint`: how a checkpoint gets written (see the module docstring)."""

    def _capture_arrays(self, include_metrics: bool) -> tuple[dict, dict, dict]:
        """Snapshots of the state (see `state.capture`), names and RNG metadata."""
        sync_variables(self.model)  # on JAX inside fit, the variables are filled at epoch ends only
        values, names = capture(self._plan(), weights_only=self.weights_only, include_metrics=include_metrics)
        rng_meta: dict = {}
        if not self.weights_only:
            rng_arrays, rng_meta = rng_capture()
            values.update(rng_arrays)
            names.update((k, k) for k in rng_arrays)
        return values, names, rng_meta


    def _plan(self) -> Plan:
        return plan_for(self.model, include_optimizer=not self.weights_only, frozen=self.frozen_weights)


    def _frozen_meta(self) -> dict:
        """The frozen weights' fingerprints; raises if one changed since this fit began."""
        if self.frozen_weights is None:
            return {}
        now = frozen_fingerprints(self._plan())
        if self._frozen_at_start is None:  # the first call of a fit: at its start (`on_train_begin`)
            self._frozen_at_start = now
        changed = changed_frozen(self._frozen_at_start, now)
        if changed:
            raise ValueError(
                f"Checkpoint: {len(changed)} weight(s) of frozen_weights={self.frozen_weights!r} changed during "
                f"training, so a checkpoint without them would not resume: {changed[:3]}. BatchNorm's moving "
                "statistics are non-trainable yet updated; list the frozen weights' paths instead."
            )
        return now


    def _callback_states(self) -> dict:
        """JSON states of the other `StatefulCallback`s of this fit."""
        out = {}
        for key, cb in stateful_callbacks(self.model).items():
            if cb is self:
                continue
            try:
                out[key] = json_safe(cb.get_state())
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
        arrays, names, rng_meta = arrays or self._capture_arrays(include_metrics=step_in_epoch > 0)
        if data_position is None:
            data_position = int(self._consumed) if hooks_done else 0
        step = int(self.global_step)
        with self._lock:
            seq = max([int_or(e.get("seq"), 0) for e in self._entries] + [0]) + 1
        position = {"epoch": int(epoch), "step_in_epoch": int(step_in_epoch), "global_step": step}
        entry = {
            "name": f"ckpt-{step}",
            "seq": seq,
            **position,
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
                **position,
                "data_position": int(data_position),
                "hooks_done": bool(hooks_done),
                "epochs": (self.params or {}).get("epochs"),  # of this fit: a stop ends this fit, not the run
            },
            "config": self.config,
            "keras_version": keras.__version__,
            "arrays": {},
        }
        frozen = self._frozen_meta()
        if frozen:
            meta["frozen"] = frozen
        if not self.weights_only:
            meta["rng"] = rng_meta
            meta["callbacks"] = self._callback_states()
            meta["checkpoint"] = self.get_state()
            if getattr(model, "optimizer", None) is not None:
                meta["lr_multiplier"] = get_lr_multiplier(model.optimizer)
        sharded, arrays = split_sharded(arrays)
        staged = self._save_sharded(entry, sharded, names, meta) if sharded else None
        # Everything below (encoding, JSON, files) runs in the background with async_save.
        self._submit(self._write, arrays, names, meta, entry, staged)
        return meta

    def _save_sharded(self, entry: dict, sharded: dict, names: dict, meta: dict) -> Path:
        """Writes the arrays no process holds whole (`compat.sharded`), on every process, now.

        Every process takes part (Orbax's commit waits for all), so it runs in
        the training thread, never in the async writer: the processes reach it
        at the same step. The directory is staged beside the checkpoint and moved
        into it by `_write` before the commit; a killed save leaves only a
        temporary, removed when the next run starts.
        """
        if storage.is_url(self.directory):
            raise ValueError(
                "Checkpoint: this model's state is sharded across processes (keras.distribution.ModelParallel), "
                "which trainwell writes with Orbax to a local or shared file system only, not to an object store. "
                f"Received: directory={self.directory!r}")
        staged = Path(self.directory) / f"{TMP_PREFIX}{entry['name']}-{SHARDED_DIR}"
        try:
            meta["sharded"] = save_sharded(staged, sharded, names)
        except Exception as e:
            raise self._save_error(entry["name"], staged, e) from e
        return staged


    def _submit(self, fn, *args) -> None:
        """Runs a write now, or queues it for the writer thread (in order) with `async_save`."""
        if not self.async_save:
            fn(*args)
            return
        if self._worker is None or not self._worker.is_alive():
            self._queue = queue.Queue()
            self._worker = threading.Thread(
                target=self._worker_loop, args=(self._queue,), name="trainwell-checkpoint-writer", daemon=True
            )
            self._worker.start()
        self._queue.put((fn, args))  # no wait: a thread start would cost ~10 ms of GIL hand-over


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


    def _stop_worker(self) -> None:
        if self._worker is not None and self._worker.is_alive():
            self._queue.put(None)
            self._worker.join()
        self._worker = None


    def wait(self) -> None:
        """Blocks until a background write is done; raises its error, if any."""
        if self._queue is not None:
            self._queue.join()
        err, self._async_error = self._async_error, None
        if err is not None:
            raise err


    def _save_error(self, name: str, current, e: BaseException) -> Exception:
        failed = f"Could not save checkpoint {name!r}: writing {str(current)!r} failed"
        intact = f"Previous checkpoints in {str(self.directory)!r} are intact"
        if isinstance(e, OSError):
            code = e.errno if e.errno is not None else errno.EIO
            return CheckpointSaveError(code, f"{failed} ({e.strerror or e}). {intact}", str(current))
        return RuntimeError(f"{failed} ({e}). {intact}")


    def _write(self, arrays: dict, names: dict, meta: dict, entry: dict, staged: Path | None = None) -> None:
        if storage.is_url(self.directory):
            return self._write_objects(arrays, names, meta, entry)
        directory = Path(self.directory)
        base = tmp = None
        current = directory
        try:
            encoded = self._encode(arrays, names, meta)
            # The pid in a scratch directory's name: a SIGKILLed worker's leftover is recognisable.
            scratch = f"trainwell-ckpt-scratch-{os.getpid()}-"
            base = current = directory if self._is_chief else Path(tempfile.mkdtemp(prefix=scratch))
            tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=base))
            current = tmp / ARRAYS_FILE
            files.write_npz(current, encoded)
            del encoded
            with zipfile.ZipFile(current) as zf:
                meta["arrays_crc32"] = zip_crcs(zf)  # computed by zipfile while it wrote them
            current = tmp / STATE_FILE
            files.write_text(current, seal(meta))
            if not self._is_chief:
                return
            if staged is not None:  # the sharded arrays every process wrote (`_save_sharded`)
                os.rename(staged, tmp / SHARDED_DIR)
            current = directory / entry["name"]
            files.commit_directory(tmp, current)
            tmp = None
            self._last_written = (entry["name"], meta)
            current = directory / INDEX_FILE
            self._commit_index(entry)
        except Exception as e:
            raise self._save_error(entry["name"], current, e) from e
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            if base is not None and base != directory:
                shutil.rmtree(base, ignore_errors=True)


    def _encode(self, arrays: dict, names: dict, meta: dict) -> dict:
        """The arrays as `np.savez` writes them; fills the manifest `meta["arrays"]`."""
        encoded = {}
        for k, value in arrays.items():
            a = host(value)
            encoded[k], dtype_name = encode_array(np.asarray(a, order="C"))
            meta["arrays"][k] = {"shape": list(a.shape), "dtype": dtype_name, "name": names.get(k, "")}
        return encoded


    def _write_objects(self, arrays: dict, names: dict, meta: dict, entry: dict) -> None:
        """The object-store save: both objects under a fresh prefix, then the index PUT (the commit).

        A failure before the index PUT leaves an unlisted prefix, which no
        reader trusts and the next writer removes; the previous index stands.
        """
        store = storage.store_for(self.directory)
        entry["prefix"] = prefix = f"{entry['name']}-{os.urandom(4).hex()}"
        current = self.directory
        try:
            buf = io.BytesIO()
            files.write_npz(buf, self._encode(arrays, names, meta))
            with zipfile.ZipFile(buf) as zf:
                meta["arrays_crc32"] = zip_crcs(zf)
            if not self._is_chief:
                return  # nothing is uploaded by a non-chief worker
            if getattr(self, "_writer_lock", None) and self._writer_lock[0] is store:
                store.renew_lease(self._writer_lock[1])  # a long fit keeps its lease
            current = storage.join(self.directory, prefix, ARRAYS_FILE)
            store.put(f"{prefix}/{ARRAYS_FILE}", buf.getbuffer())
            del buf
            current = storage.join(self.directory, prefix, STATE_FILE)
            store.put(f"{prefix}/{STATE_FILE}", seal(meta).encode("utf-8"))
            self._last_written = (entry["name"], meta)
            current = storage.join(self.directory, INDEX_FILE)
            self._commit_index(entry)
        except Exception as e:
            raise self._save_error(entry["name"], current, e) from e


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
        url = storage.is_url(self.directory)
        path = storage.join(self.directory, meta["entry"]["prefix"] if url else name, STATE_FILE)
        try:
            if url:  # one PUT: a reader gets the old sealed state.json or the new one
                storage.store_for(self.directory).put(f"{meta['entry']['prefix']}/{STATE_FILE}", seal(meta).encode())
            else:
                atomic_write_text(path, seal(meta))
            if "stopped" in updates:
                path = storage.join(self.directory, INDEX_FILE)
                self._commit_index(meta["entry"])
        except Exception as e:
            raise self._save_error(name, path, e) from e


    def _commit_index(self, entry: dict) -> None:
        url = storage.is_url(self.directory)
        directory = self.directory if url else Path(self.directory)
        with self._lock:
            entries = [e for e in self._entries if e["name"] != entry["name"]]
            # on an object store a rerun of the same step replaced that prefix: removed once unlisted
            replaced = [
                e for e in self._entries if e["name"] == entry["name"] and e.get("prefix") != entry.get("prefix")
            ]
            entries.append(dict(entry, path=storage.join(str(directory), entry.get("prefix") or entry["name"])))
            keep = {x["name"] for x in entries[-self.keep_last:]}
            keep |= {x["name"] for x in self._best_entries(entries)[: self.keep_best]}
            kept = [x for x in entries if x["name"] in keep]
            dropped = [x for x in entries if x["name"] not in keep] + (replaced if url else [])
            files.write_index(
                directory,
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
            if url:
                if PREFIX_RE.match(str(x.get("prefix"))):  # never a name from the index that leaves the prefix
                    storage.store_for(self.directory).remove(x["prefix"])
                continue
            path = checkpoint_path(directory, x["name"])  # never a name from disk that leaves the directory
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
        found = metric_direction(self.monitor, self.mode, self.model) if use_model and self.model is not None else None
        return found or metric_direction(self.monitor, self.mode) or "min"
