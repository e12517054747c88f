"""The preemption guard: a SIGTERM becomes a checkpoint at the next step boundary, then an exit.

`PreemptionGuard` is the part of `Checkpoint` that handles SIGTERM (installed
only in the main thread, restored at `on_train_end`): the handler sets a flag;
the next step boundary writes a checkpoint and raises
`SystemExit(PREEMPTED_EXIT_CODE)` (143 = 128 + SIGTERM, what a shell reports for
a SIGTERM-killed process). A previous Python handler is called after the save; a
second SIGTERM before the save falls through to the previous handler (default:
terminate), and so does the first one if no step boundary comes within
`PREEMPTION_GRACE_S` seconds. Under multi-worker the workers OR-reduce their
flags before every step (`trainwell.runtime.any_across_workers`), so every
worker checkpoints at the same step and exits.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from trainwell import runtime

logger = logging.getLogger("trainwell.checkpoint")


class PreemptionGuard:
    """Mixin of `Checkpoint`: SIGTERM handling (see the module docstring)."""

    #: Exit status after a SIGTERM-triggered checkpoint (128 + SIGTERM).
    PREEMPTED_EXIT_CODE = 143


    #: Seconds a SIGTERM waits for the next step boundary before it falls through
    #: to the previous handler (default: terminate) without a checkpoint.
    PREEMPTION_GRACE_S = 120.0


    def _agree_on_preemption(self) -> bool:
        """Whether any worker got a SIGTERM, the same answer on every worker at this step.

        The local flag is read once, before the all-reduce; a SIGTERM arriving later
        sets it for the next step's reduction, so no worker leaves alone.
        """
        local = bool(self._preempt_requested)
        (any_requested,) = runtime.any_across_workers(self._sync_strategy, [local])
        if any_requested and not local and not self._preempt_requested:
            logger.warning("A peer worker was preempted: checkpointing at this step, then exiting.")
            self._preempt_requested = True
            self._preempt_from_peer = True
        return bool(any_requested)


    def _install_sigterm(self) -> None:
        if self._sigterm_installed or threading.current_thread() is not threading.main_thread():
            return
        try:
            current = signal.getsignal(signal.SIGTERM)
            owner = getattr(current, "__self__", None)
            if isinstance(owner, PreemptionGuard) and owner is not self:
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
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:  # installed from this (the main) thread
            signal.signal(signal.SIGTERM, self._prev_sigterm if self._prev_sigterm is not None else signal.SIG_DFL)
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
        self._leave_fit()
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
