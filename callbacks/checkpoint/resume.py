"""Resuming a `fit` from a checkpoint: arrays, callback states, replay to the exact batch, warm start.

`ResumeMixin` is the part of `Checkpoint` that acts at `on_train_begin` and at
the first steps of a resumed run: it loads the newest checkpoint that verifies
(`files.resume_checkpoint`), sets the epoch `fit` starts at, restores the model
and optimizer arrays (deferred to the first step when the model is built only
then), the other callbacks' states and the LR multiplier, and makes the resumed
epoch start at the checkpoint's step: the batches the interrupted run had
already read are taken from the data before `fit`'s loop yields a step, so no
callback sees them (`_start_resumed_epoch`); a recipe whose pipeline drops them before
decoding says so (`data_positioned`), and none is taken. After a
weights-only checkpoint it re-warms the learning rate over
`warm_start_warmup_steps`.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import warnings

import keras
import numpy as np

from trainwell.callbacks.base import StatefulCallback, stateful_callbacks
from trainwell.callbacks.checkpoint.files import CheckpointMismatchError, read_checkpoint, resume_checkpoint
from trainwell.callbacks.checkpoint.state import (
    Plan,
    check_frozen,
    dedup,
    frozen_keys_of,
    read_sharded,
    restore_model_arrays,
    restore_vars,
    rng_restore,
    to_numpy,
)
from trainwell.compat.backend import sync_variables
from trainwell.compat.keras_internals import (
    adapter_shuffle,
    cancel_next_epoch_start,
    compiled_metrics_unbuilt,
    continue_tensorboard_steps,
    fit_callbacks,
    fit_epoch_iterator,
    model_fully_built,
    set_initial_epoch,
    start_next_epoch_at,
    symbolic_build,
)
from trainwell.compat.learning_rate import get_lr_multiplier, raw_learning_rate, set_lr_multiplier
from trainwell.compat.versions import upstream_changed

logger = logging.getLogger("trainwell.checkpoint")


def order_rng_capture() -> dict:
    """The Python and NumPy global RNG states (JSON), from which a data iterator may draw its order.

    Keras draws a shuffled `PyDataset`'s order from Python's `random`, and on
    JAX a shuffled NumPy input's from NumPy's, at the iterator's first batch.
    """
    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
    }


def order_rng_restore(state: dict) -> None:
    """Sets the global RNG states `order_rng_capture` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state(("MT19937", np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def batches_to_skip(position: dict) -> int:
    """The batches a resume takes from the resumed epoch's data before its first trained step.

    Those the interrupted run had read (`data_position`), at least the steps it had trained
    when the checkpoint was taken after their hooks (`hooks_done`). A recipe that builds its
    own pipeline drops them before decoding (`Checkpoint.data_positioned`).

    Example:
    >>> batches_to_skip({"step_in_epoch": 7, "data_position": 7, "hooks_done": True})
    7
    """
    until = int(position["step_in_epoch"]) if position.get("hooks_done") else 0
    return max(until, int(position.get("data_position", 0)))


def wrap_hook(cb, name: str, make, patched: list) -> None:
    """Sets `cb.<name>` to `make(current hook)` as an instance attribute, recorded in `patched`.

    One left by a fit that died in a callback is replaced; the user's own
    instance attribute is left alone. `unwrap_hooks(patched)` removes them.
    """
    current = vars(cb).get(name)
    if current is not None and not hasattr(current, "_trainwell_checkpoint_hook"):
        return
    vars(cb).pop(name, None)
    hook = make(getattr(cb, name))
    hook._trainwell_checkpoint_hook = True
    setattr(cb, name, hook)
    patched.append((cb, name))


def unwrap_hooks(patched: list) -> None:
    for cb, name in patched:
        if hasattr(vars(cb).get(name), "_trainwell_checkpoint_hook"):
            vars(cb).pop(name)
    patched.clear()


class ResumeMixin:
    """Mixin of `Checkpoint`: how a run resumes (see the module docstring)."""

    def data_positioned(self, batches: int) -> None:
        """Says that the resumed epoch's training data already starts `batches` batches in.

        A recipe that builds its pipeline drops the batches already trained before decoding
        them (`trainwell.data.epoch_start`); the resume then takes none from the iterator
        (constant time, whatever the position). `batches` must be `batches_to_skip` of the
        checkpoint this resume loads; without this call the batches are taken from the
        iterator (any dataset).

        Example:
        >>> ckpt = Checkpoint("ckpts"); ckpt.data_positioned(7)  # doctest: +SKIP
        """
        self._data_positioned = int(batches)

    def _resume_from_disk(self) -> None:
        chosen = resume_checkpoint(self.directory)  # the same decision the recipe positions its data by
        if chosen is None:
            return
        meta, arrays = read_checkpoint(chosen["path"])
        self._restore(meta, arrays, chosen["path"])


    def _restore(self, meta: dict, arrays: dict, path: str) -> None:
        model = self.model
        pos = meta["position"]
        weights_only = bool(meta.get("weights_only"))
        self._compare_config(meta.get("config"), path)
        own = meta.get("checkpoint")
        with self._lock:
            entries = self._entries
        if own:
            self.set_state(own)
        else:
            StatefulCallback.set_state(self, {})
        with self._lock:
            self._entries = entries  # disk is the source of truth for the list
        self.global_step = self.last_save_step = int(pos["global_step"])
        self.epoch, self.step_in_epoch = int(pos["epoch"]), int(pos["step_in_epoch"])
        if weights_only:
            self._warmup = (
                {"step": 0, "total": self.warm_start_warmup_steps, "base": None, "last_set": None, "kind": None}
                if self.warm_start_warmup_steps > 0
                else None
            )
        start_epoch = int(pos["epoch"])
        epochs = (self.params or {}).get("epochs")
        stopped = bool(meta.get("entry", {}).get("stopped"))
        # A stop (early stopping, `stop_training`) ends the fit that stopped, not the run: the same
        # fit again trains nothing, one with more epochs than that fit had trains on from the stop.
        stopped_fit_epochs = pos.get("epochs")  # None in checkpoints written before it was recorded
        train_longer = (
            stopped and epochs is not None and stopped_fit_epochs is not None and int(epochs) > int(stopped_fit_epochs)
        )
        if stopped and epochs is not None and not train_longer:
            start_epoch = max(start_epoch, int(epochs))
        set_initial_epoch(model, start_epoch)
        self._announce_resume(path, pos, epochs, start_epoch, stopped, train_longer)
        self._deferred = (arrays, meta, path)
        if model_fully_built(model):  # else at the first step, which builds it
            self._apply_deferred(iterator=None)
        if not weights_only:
            registry = stateful_callbacks(model)
            for key, state in (meta.get("callbacks") or {}).items():
                cb = registry.get(key)
                if cb is None or cb is self:
                    logger.warning(
                        "Checkpoint: %s holds the state of callback %r, which is not in this fit.", path, key
                    )
                    continue
                cb.set_state(state)
                if train_longer:
                    cb.continue_after_stop()
            if "lr_multiplier" in meta:
                try:
                    set_lr_multiplier(model.optimizer, float(meta["lr_multiplier"]))
                except Exception as e:
                    if float(meta["lr_multiplier"]) != 1.0:
                        warnings.warn(f"Could not restore the LR multiplier from {path!r}: {e}")
        if epochs is None or start_epoch < int(epochs):
            self._start_resumed_epoch(pos)


    def _start_resumed_epoch(self, pos: dict) -> None:
        """Makes the resumed epoch start where the checkpoint stopped, before any batch hook sees it.

        The batches the interrupted run had taken from its iterator (`data_position`:
        those of this epoch, and of earlier epochs when one iterator spans epochs) are
        taken from the new iterator before `fit`'s loop yields its first step, so every
        callback (progress bar, loggers, TensorBoard) sees only the steps trained now,
        numbered from the resumed step. A mid-epoch checkpoint was taken after every
        callback's hooks of its step had run (`hooks_done`): the other
        `StatefulCallback`s' `on_epoch_begin` and first `on_train_batch_begin` are
        muted, their restored state already reflects them.
        """
        hooks_done = bool(pos.get("hooks_done"))
        until = int(pos["step_in_epoch"]) if hooks_done else 0
        skip = batches_to_skip(pos)
        positioned = getattr(self, "_data_positioned", None)
        if positioned is not None and positioned != skip:
            raise RuntimeError(f"Checkpoint: the training data starts {positioned} batches into epoch {self.epoch + 1}, "
                               f"the checkpoint resumes after {skip}: position the data by `batches_to_skip`.")
        epoch_iterator = fit_epoch_iterator(self.model)
        if epoch_iterator is None:
            raise upstream_changed(
                "fit's local `epoch_iterator`", detail="Checkpoint cannot position the resumed epoch's data"
            )
        callbacks = fit_callbacks(self.model) or []
        if hooks_done:
            self.batch_hooks -= 1  # the checkpointed step's on_train_batch_begin runs again
        # Keras's TensorBoard numbers batch summaries by its count of batch-begin calls in this fit.
        hook_calls = int(self.batch_hooks)

        def on_start(data_iterator):
            continue_tensorboard_steps(callbacks, hook_calls)
            if until and positioned is not None:
                self._say(f"skipping {until} batches already trained in epoch {self.epoch + 1} "
                          "(resumed mid-epoch: dropped before decoding; no callback sees them)")
            elif until:
                self._say(
                    f"skipping {until} batches already trained in epoch {self.epoch + 1} "
                    "(resumed mid-epoch: they are read, not trained again, and no callback sees them)"
                )
                shuffle = adapter_shuffle(epoch_iterator.data_adapter)
                if shuffle in ("arrays", "pydataset_workers"):
                    what = "NumPy inputs" if shuffle == "arrays" else "a PyDataset read by workers"
                    logger.warning(
                        "Checkpoint: the rest of epoch %d is not in the interrupted run's order: Keras reshuffles "
                        "%s with shuffle=True in a way a checkpoint cannot replay (docs/checkpoint.md).",
                        self.epoch + 1, what,
                    )
            taken = skip if positioned is not None else self._skip_batches(data_iterator, skip)
            self._data_positioned = None  # this resume's only
            self._last_iterator, self._consumed = data_iterator, taken
            if taken < skip:
                self._alert(
                    f"the data ran out after {taken} of the {skip} batches the checkpoint had read: "
                    f"epoch {self.epoch + 1} trains nothing (is it the same data?)"
                )
                return None
            return skip - until

        start_next_epoch_at(epoch_iterator, until, on_start)
        self._resumed_epoch_iterator = epoch_iterator
        if hooks_done:
            self._mute_stateful_hooks()


    def _skip_batches(self, iterator, n: int) -> int:
        """Takes `n` batches from `iterator` without training on them; returns how many it got.

        The interrupted run's iterator drew its order (a shuffled PyDataset's) at its first
        batch from the global RNGs as they were then; this one draws it from the same states.
        """
        now = order_rng_capture()
        order_rng_restore(self._order_rng or now)
        try:
            return sum(1 for _ in itertools.islice(iterator, n))
        finally:
            order_rng_restore(now)


    def _announce_resume(self, path: str, pos: dict, epochs, start_epoch: int, stopped: bool, train_longer: bool) -> None:
        epoch, step, done = int(pos["epoch"]), int(pos["step_in_epoch"]), int(pos["global_step"])
        stopped_fit_epochs = pos.get("epochs")
        if epochs is not None and start_epoch >= int(epochs):
            if stopped:
                of = f" of {stopped_fit_epochs}" if stopped_fit_epochs is not None else ""
                how, longer = f"it stopped early after epoch {epoch}{of}", stopped_fit_epochs or epochs
            else:
                how, longer = f"{min(epoch, int(epochs))} of {epochs} epochs trained", max(int(epochs), epoch)
            more = self._resume_command()
            more = f"{more} --set epochs=N" if more.startswith("trainwell") else more.replace("fit()", "fit(epochs=N)")
            self._say(
                f"the run is already complete ({how}, {done} steps; {path}): nothing to train. "
                f"To train longer: {more} with N > {longer}."
            )
            return
        total = f"/{epochs}" if epochs is not None else ""
        where = f"at step {step} of epoch {epoch + 1}{total}" if step else f"at the start of epoch {epoch + 1}{total}"
        why = (
            f"; it had stopped early after epoch {epoch} of {stopped_fit_epochs}: training on to epoch {epochs}"
            if train_longer
            else ""
        )
        self._say(f"resuming from {path} {where} ({done} steps trained{why})")


    def _compare_config(self, saved, path: str) -> None:
        """One line when the checkpoint was written under another run config than this run's.

        Fields a resume is meant to change (`RESUME_FIELDS`: the length of the run,
        where it runs, how much it prints) are not compared.
        """
        if self.config is None or not isinstance(saved, dict) or saved == self.config:
            return
        def show(config, key):
            return repr(config[key]) if key in config else "(unset)"

        diffs = [
            f"{k}: {show(saved, k)} -> {show(self.config, k)}"
            for k in sorted(set(saved) | set(self.config), key=str)
            if k not in self.RESUME_FIELDS and show(saved, k) != show(self.config, k)
        ]
        if diffs:
            shown = "; ".join(diffs[:5]) + (f"; and {len(diffs) - 5} more" if len(diffs) > 5 else "")
            logger.warning("Checkpoint: resuming from %s, written under another run config (%s).", path, shown)


    def _apply_arrays(self, arrays: dict, meta: dict, path: str) -> None:
        model = self.model
        sync_variables(model)  # on JAX inside fit: the assignments below reach the next step
        weights_only = bool(meta.get("weights_only"))
        if not weights_only and model.optimizer is not None and not model.optimizer.built:
            with model.distribute_strategy.scope():
                model.optimizer.build(model.trainable_variables)
        plan = Plan(model, include_optimizer=not weights_only and not self.weights_only,
                    frozen_keys=frozen_keys_of(meta))
        check_frozen(plan, meta, path)
        arrays = read_sharded(plan, arrays, path)
        restore_model_arrays(plan, arrays, path)
        if weights_only or self.weights_only:
            return  # a run that saves weights only keeps its optimizer fresh as configured
        restore_vars(plan.opt_vars, arrays, path, "optimizer", "opt:")
        restore_vars(plan.seed_vars, arrays, path, "seed generators", "seed:")
        rng_restore(arrays, meta.get("rng") or {})


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
        arrays, meta, path = self._deferred
        self._deferred = None
        if not model_fully_built(self.model):
            self._element_spec_build(iterator)
        self._apply_arrays(arrays, meta, path)
        if meta["position"]["step_in_epoch"] > 0 and any(k.startswith("metric:") for k in arrays):
            self._pending_metrics = {"arrays": arrays, "path": path}


    def _restore_metrics(self, iterator) -> None:
        pending, self._pending_metrics = self._pending_metrics, None
        model = self.model
        sync_variables(model)
        if compiled_metrics_unbuilt(model):
            try:
                self._element_spec_build(iterator)
            except Exception as e:  # metrics are cosmetic; never block a resume
                warnings.warn(f"Could not rebuild metrics to restore them: {e}")
                return
        used: dict[str, int] = {}
        items = [(dedup(f"metric:{v.path}", used), v) for v in model.metrics_variables]
        try:
            restore_vars(items, pending["arrays"], pending["path"], "metrics", "metric:")
        except CheckpointMismatchError as e:
            warnings.warn(f"Metric accumulators not restored: {e}")


    def _mute_stateful_hooks(self) -> None:
        """Mutes the other StatefulCallbacks' hooks that ran before the checkpoint, until the first step."""
        self._muting = True

        def muted(orig):
            return lambda *args, **kwargs: None if self._muting else orig(*args, **kwargs)

        for cb in stateful_callbacks(self.model).values():
            if cb is not self:
                wrap_hook(cb, "on_epoch_begin", muted, self._muted)
                wrap_hook(cb, "on_train_batch_begin", muted, self._muted)


    def _end_resume(self) -> None:
        """Unmutes the hooks `_mute_stateful_hooks` muted; drops a resumed epoch start that did not come."""
        self._muting = False
        unwrap_hooks(self._muted)
        cancel_next_epoch_start(self._resumed_epoch_iterator)
        self._resumed_epoch_iterator = None


    def _apply_warmup(self, spe: int) -> None:
        """Scales the learning rate (or, under a schedule, its multiplier) up over the warm-start steps."""
        w = self._warmup
        if not w:
            return
        sync_variables(self.model)  # it reads and sets the learning rate (a variable)
        opt = self.model.optimizer
        total, s = int(w["total"]), int(w["step"])
        if w.get("kind") is None:
            schedule = isinstance(raw_learning_rate(opt), keras.optimizers.schedules.LearningRateSchedule)
            w["kind"] = "multiplier" if schedule else "variable"
        if w["kind"] == "variable":
            get, put = (lambda: float(to_numpy(opt.learning_rate))), (lambda v: setattr(opt, "learning_rate", v))
        else:
            get, put = (lambda: get_lr_multiplier(opt)), (lambda v: set_lr_multiplier(opt, v))
        current = get()
        if w["base"] is None or w["last_set"] is None or not math.isclose(current, w["last_set"], rel_tol=1e-6):
            w["base"] = current  # someone else (a schedule callback) set it for this step
        put(w["base"] * (1.0 if s >= total else (s + 1) / total))
        w["last_set"] = get()
        w["step"] = s + spe
        if s >= total:
            self._warmup = None
