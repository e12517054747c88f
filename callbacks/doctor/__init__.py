"""The training doctor: `TrainingDoctor` and the rules it runs.

It says what is wrong with a training run, shows the evidence in numbers and
says what to change. One job per module: `findings` (codes, thresholds,
`Finding`, the loss history), `loss_rules` and `step_rules` (pure functions of
numbers, each returning a `Finding` or `None`; backend-free), `probe` (the
gradient/activation probe, TensorFlow and JAX, over `trainwell.compat.gradients`) and
`callback` (`TrainingDoctor`, which gathers the numbers during `fit`).

Example:
>>> from trainwell.callbacks.doctor import TrainingDoctor, step_noise
>>> TrainingDoctor(every_n_steps=50).get_config()["every_n_steps"]
50
>>> round(step_noise([1.0, 1.2] * 20), 3)
0.21
"""

from trainwell.callbacks.doctor.callback import TrainingDoctor
from trainwell.callbacks.doctor.findings import CODES, DEFAULT_THRESHOLDS, SEVERITIES, Finding, LossTracker
from trainwell.callbacks.doctor.loss_rules import (
    check_divergence,
    check_oscillation,
    check_overfitting,
    check_slow_convergence,
    chunk_noise,
    step_noise,
    zigzag,
)
from trainwell.callbacks.doctor.step_rules import (
    check_amp,
    check_dead_units,
    check_gradients,
    check_input_bound,
    run_queue_delays,
)

__all__ = [
    "TrainingDoctor",
    "Finding",
    "LossTracker",
    "CODES",
    "SEVERITIES",
    "DEFAULT_THRESHOLDS",
    "check_divergence",
    "check_oscillation",
    "check_slow_convergence",
    "check_overfitting",
    "check_input_bound",
    "check_amp",
    "check_gradients",
    "check_dead_units",
    "run_queue_delays",
    "step_noise",
    "chunk_noise",
    "zigzag",
]
