"""`Checkpoint`, the callback: when to save and when to resume, within `fit`.

The jobs it delegates are the package's other modules: `files` (the format,
index and checksums), `state` (arrays in and out of a model), `writer`
(snapshot to committed files, async), `resume` (restore, and the resumed epoch's start) and
`preemption` (SIGTERM). What stays here is the part that follows `fit`: its
hooks, the thin wrapper around `model.train_function` that finds step
boundaries, and the callback's own config and state. It stays one class because
its hooks share the run's bookkeeping (position, pending epoch commit, current
iterator); split further, they would pass it back and forth.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
from pathlib import Path
from typing import Any

from trainwell import runtime, storage
from trainwell.callbacks.base import StatefulCallback, stateful_callbacks
from trainwell.callbacks.checkpoint.files import (
    clean_stale_temporaries,
    latest_checkpoint,
    list_checkpoints,
)
from trainwell.callbacks.checkpoint.preemption import PreemptionGuard
from trainwell.callbacks.checkpoint.resume import ResumeMixin, order_rng_capture, unwrap_hooks, wrap_hook
from trainwell.callbacks.checkpoint.state import config_to_dict, load_checkpoint
from trainwell.callbacks.checkpoint.writer import CheckpointWriter
from trainwell.compat.backend import callback_model, wrap_train_function
from trainwell.compat.keras_internals import get_initial_epoch, set_initial_epoch
from trainwell.compat.metrics import finite_value
from trainwell.rundir import lock_run_dir
from trainwell.validation import invalid_argument, is_int


class Checkpoint(PreemptionGuard, ResumeMixin, CheckpointWriter, StatefulCallback):
    """Atomic checkpoints that resume a `fit` exactly, mid-epoch included.

    Replaces `keras.callbacks.BackupAndRestore` (and covers `ModelCheckpoint`'s
    keep-best role) rather than extending it: `BackupAndRestore` overwrites its
    files in place, restores only the epoch, saves neither the data position nor
    any RNG state, keeps no best checkpoint and is not multi-worker aware. What
    is saved, when, how a run resumes mid-epoch, what happens to damaged
    checkpoints, preemption (SIGTERM -> checkpoint -> exit 143), multi-worker,
    weights-only warm starts and async saving are described in
    `docs/checkpoint.md`.

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
        mode: `"auto"`, `"min"` or `"max"`; `"auto"` is Keras's rule
            (`trainwell.compat.metric_direction`), and a metric it cannot place
            is minimized. Defaults to `"auto"`.
        weights_only: Save only model weights and the position. Defaults to `False`.
        frozen_weights: Model weights that training leaves as they are, kept out
            of every checkpoint: `"non_trainable"` (each weight not in
            `model.trainable_weights`: right for LoRA or a frozen pretrained
            backbone, wrong beside BatchNorm layers that still update their
            moving statistics) or a list of the weights' paths (as
            `model.weights` names them). A resume or `load_checkpoint` then needs
            a model that already holds them (built from the same preset): their
            fingerprints (a sum and a sum of squares each) are saved and checked,
            and a save raises if one changed during training. Defaults to `None`
            (every weight is saved).
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
    >>> import tempfile
    >>> ckpt = Checkpoint(tempfile.mkdtemp(), save_every=500, keep_last=2)
    >>> ckpt.get_config()["save_every"]
    500
    >>> model.fit(ds, epochs=10, steps_per_epoch=1000, callbacks=[ckpt])  # doctest: +SKIP
    >>> # after a crash or preemption the same call resumes at the next step
    >>> load_checkpoint(ckpt.directory, inference_model)  # doctest: +SKIP
    """

    #: Config fields a resume is meant to change (`trainwell resume RUN --set epochs=N`): not
    #: compared with the checkpoint's config.
    RESUME_FIELDS = ("epochs", "run_dir", "verbose")
    _CONFIG = ("directory", "save_every", "keep_last", "keep_best", "monitor", "mode", "weights_only",
               "frozen_weights", "async_save", "config", "resume", "warm_start_warmup_steps", "verbose")

    def __init__(
        self,
        directory,
        save_every="epoch",
        keep_last=3,
        keep_best=1,
        monitor="val_loss",
        mode="auto",
        weights_only=False,
        frozen_weights=None,
        async_save=False,
        config=None,
        resume=True,
        warm_start_warmup_steps=0,
        verbose=1,
    ):
        checks = (
            ("directory", directory, "a non-empty path",
             directory is not None and not (isinstance(directory, str) and not directory.strip())),
            ("save_every", save_every, "'epoch' or an int >= 1",
             save_every == "epoch" or (is_int(save_every) and save_every >= 1)),
            ("keep_last", keep_last, "an int >= 1", is_int(keep_last) and keep_last >= 1),
            ("keep_best", keep_best, "an int >= 0", is_int(keep_best) and keep_best >= 0),
            ("monitor", monitor, "a metric name", isinstance(monitor, str) and bool(monitor)),
            ("mode", mode, "one of 'auto', 'min', 'max'", mode in ("auto", "min", "max")),
            ("weights_only", weights_only, "a bool", isinstance(weights_only, bool)),
            ("frozen_weights", frozen_weights, "None, 'non_trainable' or a list of weight paths",
             frozen_weights in (None, "non_trainable") or (
                 isinstance(frozen_weights, (list, tuple)) and all(isinstance(p, str) and p for p in frozen_weights))),
            ("async_save", async_save, "a bool", isinstance(async_save, bool)),
            ("resume", resume, "a bool", isinstance(resume, bool)),
            ("warm_start_warmup_steps", warm_start_warmup_steps, "an int >= 0",
             is_int(warm_start_warmup_steps) and warm_start_warmup_steps >= 0),
            ("verbose", verbose, "0 or 1", isinstance(verbose, bool) or (is_int(verbose) and verbose in (0, 1))),
        )
        for name, value, expected, ok in checks:
            if not ok:
                raise invalid_argument(name, expected, value)
        self.directory = storage.check_url(directory) if storage.is_url(directory) else os.fspath(directory)
        self.verbose = int(verbose)
        self.save_every = save_every if save_every == "epoch" else int(save_every)
        if self.save_every != "epoch":
            self.on_train_batch_end = self._keep_batch_logs
        self.keep_last = int(keep_last)
        self.keep_best = int(keep_best)
        self.monitor = monitor
        self.mode = mode
        self.weights_only = weights_only
        self.frozen_weights = frozen_weights if frozen_weights in (None, "non_trainable") else list(frozen_weights)
        self.async_save = async_save
        self.config = config_to_dict(config)
        self.resume = resume
        self.warm_start_warmup_steps = int(warm_start_warmup_steps)
        self._lock = threading.RLock()
        self._worker: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._prev_sigterm = None
        self._sigterm_installed = False
        self._grace_timer = None
        self._in_fit = False
        self._writer_lock = None
        super().__init__()
        self._reset_run_vars()


    def get_config(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._CONFIG}


    def reset_state(self) -> None:
        self.global_step = 0
        self.epoch = 0
        self.step_in_epoch = 0
        self.last_save_step = -1
        self.batch_hooks = 0  # on_train_batch_begin calls of the run (Keras's TensorBoard numbers batches by them)
        self._entries: list[dict] = []
        self._warmup: dict | None = None
        self._iterator_continues: bool | None = None  # learned at the first epoch boundary
        self._order_rng: dict | None = None  # global RNG states at the current data iterator's first batch


    def get_state(self) -> dict[str, Any]:
        with self._lock:
            entries = [dict(e) for e in self._entries]
        return {
            "global_step": int(self.global_step),
            "epoch": int(self.epoch),
            "step_in_epoch": int(self.step_in_epoch),
            "last_save_step": int(self.last_save_step),
            "batch_hooks": int(self.batch_hooks),
            "checkpoints": [{k: v for k, v in e.items() if k != "path"} for e in entries],
            "best": [e["name"] for e in self._best_entries(entries)],
            "warmup": dict(self._warmup) if self._warmup else None,
            "iterator_continues": self._iterator_continues,
            "order_rng": self._order_rng,
        }


    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        self.global_step = int(state.get("global_step", 0))
        self.epoch = int(state.get("epoch", 0))
        self.step_in_epoch = int(state.get("step_in_epoch", 0))
        self.last_save_step = int(state.get("last_save_step", -1))
        self.batch_hooks = int(state.get("batch_hooks", self.global_step))
        with self._lock:
            self._entries = [dict(e) for e in state.get("checkpoints", [])]
        self._warmup = dict(state["warmup"]) if state.get("warmup") else None
        self._iterator_continues = state.get("iterator_continues")
        self._order_rng = state.get("order_rng")


    @property
    def checkpoints(self) -> list[dict]:
        """Index entries of the committed checkpoints, oldest first."""
        self.wait()
        with self._lock:
            return [dict(e) for e in self._entries]


    def best_checkpoint(self) -> dict | None:
        """The best committed checkpoint by `monitor`, or None."""
        best = self._best_entries(self.checkpoints)
        return best[0] if best else None


    def checkpoint_for_epoch(self, epoch: int) -> dict | None:
        """The committed checkpoint taken right after (0-based) `epoch`, or None."""
        return next((e for e in reversed(self.checkpoints) if e.get("completed_epoch") == epoch), None)


    def flush(self) -> None:
        """Commits a pending end-of-epoch save now and waits for all writes."""
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
        self._is_chief = runtime.is_chief(getattr(self.model, "distribute_strategy", None))
        self._prepare_directory(lock=False)  # a save by hand: the writer lock is a fit's
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


    def _reset_run_vars(self) -> None:
        self._pending_epoch: dict | None = None
        self._last_batch_logs: dict = {}
        self._batch_begin = 0
        self._last_iterator = None
        self._consumed = 0
        self._data_exhausted = False
        self._deferred: tuple | None = None
        self._pending_metrics: dict | None = None
        self._muting = False
        self._muted: list = []
        self._resumed_epoch_iterator = None
        self._watched: list = []
        self._epoch_commit: dict | None = None
        self._last_written: tuple | None = None
        self._frozen_at_start: dict | None = None  # fingerprints of frozen_weights when this fit began
        self._prev_initial_epoch = None
        self._is_chief = True
        self._sync_strategy = None
        self._mode_resolved = None
        self._async_error: BaseException | None = None
        self._preempt_requested = False
        self._preempt_from_peer = False


    def on_train_begin(self, logs=None) -> None:
        super().on_train_begin(logs)
        self._unwrap_train_function()
        self._reset_run_vars()
        self._in_fit = True
        strategy = getattr(self.model, "distribute_strategy", None)
        self._is_chief = runtime.is_chief(strategy)
        self._sync_strategy = strategy if runtime.num_workers(strategy) > 1 else None
        self._prepare_directory(lock=self._is_chief)
        if self._is_chief:
            clean_stale_temporaries(self.directory if storage.is_url(self.directory) else Path(self.directory))
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
        self._frozen_meta()  # what frozen_weights hold now: a save checks they did not change


    def _prepare_directory(self, lock: bool) -> None:
        """Creates the directory (checks the bucket of a URL); with `lock`, takes the writer lock (one line if held).

        Locally `trainwell.rundir.lock_run_dir` (flock); on an object store the
        lease object of `trainwell.storage.ObjectStore.acquire_lease`.
        """
        url = storage.is_url(self.directory)
        if url:
            storage.store_for(self.directory).check_bucket()
        else:
            Path(self.directory).mkdir(parents=True, exist_ok=True)
        if lock and self._writer_lock is None:
            if url:
                store = storage.store_for(self.directory)
                self._writer_lock = (store, store.acquire_lease())
            else:
                self._writer_lock = (None, lock_run_dir(self.directory))


    def _release_writer_lock(self) -> None:
        held, self._writer_lock = self._writer_lock, None
        if held is not None:
            store, token = held
            if store is None:
                token.release()
            else:
                store.release_lease(token)


    def _leave_fit(self) -> None:
        """Undoes what on_train_begin set up, but the SIGTERM handler (also when fit dies without on_train_end)."""
        self._in_fit = False
        self._end_resume()
        unwrap_hooks(self._watched)
        self._unwrap_train_function()
        try:
            self._stop_worker()  # lets a queued write finish
        finally:
            self._release_writer_lock()
            if self.model is not None:
                set_initial_epoch(self.model, self._prev_initial_epoch)


    def _abort_fit(self) -> None:
        """Cleanup when fit dies without on_train_end (an error in a step or in the restore)."""
        self._leave_fit()
        self._uninstall_sigterm()


    def on_epoch_begin(self, epoch, logs=None) -> None:
        self.epoch = int(epoch)
        self.step_in_epoch = 0
        self._data_exhausted = False
        self._ensure_wrapped()


    def on_train_batch_begin(self, batch, logs=None) -> None:
        self._batch_begin = int(batch)
        self.batch_hooks += 1
        self._ensure_wrapped()


    def _ensure_wrapped(self) -> None:
        # Another callback may rebuild the train function after our on_train_begin
        # (`make_train_function(force=True)`, e.g. WarmupCosine installing its
        # schedule); wrap the new one. fit() looks the function up after
        # on_train_batch_begin, so this takes effect for the coming step.
        fn = getattr(callback_model(self), "train_function", None)  # each step: no JAX state sync
        if self._in_fit and fn is not None and getattr(fn, "_trainwell_checkpoint_owner", None) is not self:
            self._wrap_train_function()


    def _keep_batch_logs(self, batch, logs=None) -> None:
        """`on_train_batch_end` when saving every N steps (the monitored value of a step's save).

        Not a hook with `save_every="epoch"`: Keras then skips the per-batch
        call, and reads the logs to the host only if another callback asks.
        """
        if logs:
            self._last_batch_logs = logs


    def on_epoch_end(self, epoch, logs=None) -> None:
        params = self.params or {}
        steps = params.get("steps")
        # Of unknown length and not stopped early, an epoch ends when the data runs out.
        complete = self._data_exhausted or (self.step_in_epoch >= steps if steps is not None
                                            else not self.model.stop_training)
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

        def watched(orig):
            def on_epoch_end(epoch, logs=None):
                orig(epoch, logs)
                c = self._epoch_commit
                if c is not None and c["completed_epoch"] == int(epoch):
                    self._amend_epoch_commit()

            return on_epoch_end

        for cb in stateful_callbacks(self.model).values():
            if cb is not self:
                wrap_hook(cb, "on_epoch_end", watched, self._watched)


    def on_train_end(self, logs=None) -> None:
        try:
            self._end_resume()
            self._amend_epoch_commit()  # e.g. `stop_training` set by a later (non-trainwell) callback
            self._save_pending_epoch()
            self.wait()
        finally:
            self._leave_fit()
            self._uninstall_sigterm()
            self._pending_epoch = None
            self._epoch_commit = None
            super().on_train_end(logs)
        if self._preempt_requested:
            self._exit_preempted()


    def _wrap_train_function(self) -> None:
        model = self.model
        orig = getattr(model, "train_function", None)
        if orig is None:
            model.make_train_function()
            orig = model.train_function
        train_function = wrap_train_function(model, orig, self._train_step)
        train_function._trainwell_checkpoint_original = orig
        train_function._trainwell_checkpoint_owner = self
        model.train_function = train_function


    def _unwrap_train_function(self) -> None:
        """Unwraps every layer of our own wrapping (a crashed fit leaves one behind)."""
        fn = getattr(self.model, "train_function", None)
        while fn is not None and hasattr(fn, "_trainwell_checkpoint_original"):
            fn = self.model.train_function = fn._trainwell_checkpoint_original


    def _spe(self) -> int:
        return int(getattr(callback_model(self), "steps_per_execution", 1) or 1)  # each step: no JAX state sync


    def _train_step(self, orig, iterator):
        try:
            return self._train_step_inner(orig, iterator)
        except StopIteration:
            raise  # the end of the data: Keras ends the epoch
        except BaseException:
            self._abort_fit()  # fit is dying (a failed save, an error in the step, preemption exit)
            raise


    def _idle(self, iterator) -> bool:
        """Whether this step needs nothing but the count of its batches (the fast path)."""
        return (
            iterator is self._last_iterator
            and self._epoch_commit is None
            and self._deferred is None
            and self._pending_metrics is None
            and not self._muting
            and self._pending_epoch is None
            and not self._warmup
            and self._sync_strategy is None
            and not self._preempt_requested
            and (self.save_every == "epoch" or not self._save_due())
        )


    def _train_step_inner(self, orig, iterator):
        if self._idle(iterator):
            return self._run_step(orig, iterator)
        if self._epoch_commit is not None:
            self._settle_epoch_commit(iterator)
        if iterator is not self._last_iterator:
            self._last_iterator = iterator  # keeps it alive, so identity is reliable
            self._consumed = 0
            self._order_rng = order_rng_capture()  # what its first batch may draw its order from
        if self._deferred is not None:
            self._apply_deferred(iterator)
        if self._pending_metrics is not None:
            self._restore_metrics(iterator)
        # Under multi-worker, act only on the flag every worker agreed on at this step: a
        # SIGTERM landing after the all-reduce is acted on at the next step, by all.
        preempt = self._agree_on_preemption() if self._sync_strategy is not None else self._preempt_requested
        if self._muting:  # every callback's hooks of the resumed step have run
            self._end_resume()
        spe = self._spe()
        self.step_in_epoch = self._batch_begin
        self._maybe_save()
        if preempt:
            self._preempt_save_and_exit()
        self._apply_warmup(spe)
        return self._run_step(orig, iterator)


    def _run_step(self, orig, iterator):
        """Runs the train function and counts the batches it took."""
        spe = self._spe()
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


    def _save_due(self) -> bool:
        if self.save_every == "epoch" or self.global_step <= self.last_save_step:
            return False  # with "epoch", committed in on_epoch_end
        return self.global_step - max(self.last_save_step, 0) >= self.save_every


    def _maybe_save(self) -> None:
        pending, self._pending_epoch = self._pending_epoch, None  # this step's state supersedes it
        if not self._save_due():
            return
        if pending is not None:
            value, completed = pending["value"], pending["completed_epoch"]
        else:
            value = finite_value(self._last_batch_logs.get(self.monitor))
            completed = self.epoch - 1 if self.step_in_epoch == 0 and self.epoch > 0 else None
        self._save(value=value, completed_epoch=completed, hooks_done=True)


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
            epoch=p["completed_epoch"] + 1,
            step_in_epoch=0,
        )


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
        if storage.is_url(self.directory):
            return f"run the same fit() again with Checkpoint({self.directory!r})"
        run_dir = Path(self.directory).parent
        try:
            recipe = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8")).get("recipe")
        except (OSError, ValueError, AttributeError):
            recipe = None
        if recipe:
            return f"trainwell resume {run_dir}"
        return f"run the same fit() again with Checkpoint({self.directory!r})"
