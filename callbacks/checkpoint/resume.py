"""Resuming a `fit` from a checkpoint: arrays, callback states, replay to the exact batch, warm start.

`ResumeMixin` is the part of `Checkpoint` that acts at `on_train_begin` and at
the first steps of a resumed run: it loads the newest checkpoint that verifies
(`files.resume_checkpoint`), sets the epoch `fit` starts at, restores the model
and optimizer arrays (deferred to the first step when the model is built only
then), the other callbacks' states and the LR multiplier, and replays the
batches the interrupted epoch had already trained (read from the data, not
trained again, with the other `StatefulCallback`s' batch hooks muted). After a
weights-only checkpoint it re-warms the learning rate over
`warm_start_warmup_steps`.
"""

from __future__ import annotations

import math
import warnings

import keras

from trainwell.callbacks.base import StatefulCallback, stateful_callbacks
from trainwell.callbacks.checkpoint.files import CheckpointMismatchError, read_checkpoint, resume_checkpoint
from trainwell.callbacks.checkpoint.state import Plan, dedup, restore_model_arrays, restore_vars, rng_restore, to_numpy
from trainwell.compat.backend import sync_variables
from trainwell.compat.keras_internals import (
    compiled_metrics_unbuilt,
    model_fully_built,
    set_initial_epoch,
    symbolic_build,
)
from trainwell.compat.learning_rate import get_lr_multiplier, raw_learning_rate, set_lr_multiplier


class ResumeMixin:
    """Mixin of `Checkpoint`: how a run resumes (see the module docstring)."""

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
        sync_variables(model)  # on JAX inside fit: the assignments below reach the next step
        weights_only = bool(meta.get("weights_only"))
        if not weights_only and model.optimizer is not None and not model.optimizer.built:
            with model.distribute_strategy.scope():
                model.optimizer.build(model.trainable_variables)
        plan = Plan(model, include_optimizer=not weights_only and not self.weights_only)
        restore_model_arrays(plan, arrays, path)
        if weights_only:
            return
        if self.weights_only:
            return  # this run saves weights only; keep the optimizer fresh as configured
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


    def _apply_warmup(self, spe: int) -> None:
        w = self._warmup
        if not w:
            return
        sync_variables(self.model)  # it reads and sets the learning rate (a variable)
        opt = self.model.optimizer
        total = int(w["total"])
        s = int(w["step"])
        factor = 1.0 if s >= total else (s + 1) / total
        if w.get("kind") is None:
            lr = raw_learning_rate(opt)
            w["kind"] = "multiplier" if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule) else "variable"
        if w["kind"] == "variable":
            current = float(to_numpy(opt.learning_rate))
            if w["base"] is None or w["last_set"] is None or not math.isclose(current, w["last_set"], rel_tol=1e-6):
                w["base"] = current  # someone else (a schedule callback) set it for this step
            new = w["base"] * factor
            opt.learning_rate = new
            w["last_set"] = float(to_numpy(opt.learning_rate))
        elif w["kind"] == "multiplier":
            current = get_lr_multiplier(opt)
            if w["base"] is None or w["last_set"] is None or not math.isclose(current, w["last_set"], rel_tol=1e-6):
                w["base"] = current
            set_lr_multiplier(opt, w["base"] * factor)
            w["last_set"] = w["base"] * factor
        w["step"] = s + spe
        if s >= total:
            self._warmup = None
