"""trainwell.compat: the one seam between trainwell and the private parts of Keras, KerasTuner and TensorFlow.

Every private name of those libraries that trainwell uses (a `keras.src` import,
an attribute such as `model._symbolic_build` or `optimizer._learning_rate`, a
monkeypatch) is used in this package and nowhere else, so a Keras upgrade is
audited here only. The rule for anything added:

- one accessor per private name, which calls `versions.gate(name)` first: on a
  Keras/TensorFlow outside the tested range it warns once, and a name that is
  gone raises `versions.UpstreamChanged` naming it;
- a test in `tests/trainwell/compat/` that fails when the upstream changes (the
  name moves, or stops doing what the accessor relies on);
- a patch of a library bug lives in `keras_fixes`, applied only for the versions
  known to be broken, and is reversible (`apply`/`remove`/`patched`).

Modules: `versions` (the gate), `backend` (what differs between Keras's
TensorFlow and JAX trainers), `metrics` (the one "is this better" rule),
`learning_rate` (the one LR get/set), `keras_internals`, `tf_internals`
(TensorFlow only, not imported here), `keras_fixes` (the patches),
`keras_tuner` (KerasTuner's internals), `replicas` (the state each
`tf.distribute` replica keeps for itself, read from and written to every
replica), `distribution` / `jax_distribution` (strategies, devices and
cross-worker collectives of each backend, behind `trainwell.runtime`),
`snapshot` (take, restore and read a model's training state), `devices` (what
a strategy runs on), `kernels` (what compiled steps and kernels can do: fused
BatchNorm, a loss's own variable read at each step) and `gradients` (the
doctor's gradients). The names below are the public API.

Example:
>>> from trainwell.compat import metric_direction
>>> metric_direction("val_accuracy")
'max'
"""

from trainwell.compat.backend import backend_name, build_before_fit, strategy_scope, sync_variables
from trainwell.compat.learning_rate import (
    current_lr,
    get_lr_multiplier,
    has_multiplier,
    inner_optimizer,
    install_schedule,
    learning_rate_variables,
    raw_learning_rate,
    scale_learning_rate,
    set_lr_multiplier,
    set_raw_learning_rate,
)
from trainwell.compat.metrics import finite_value, is_improvement, metric_direction, monitored_value
from trainwell.compat.versions import UpstreamChanged, keras_version

__all__ = [
    "metric_direction",
    "monitored_value",
    "finite_value",
    "is_improvement",
    "inner_optimizer",
    "raw_learning_rate",
    "set_raw_learning_rate",
    "learning_rate_variables",
    "current_lr",
    "has_multiplier",
    "get_lr_multiplier",
    "set_lr_multiplier",
    "scale_learning_rate",
    "install_schedule",
    "keras_version",
    "UpstreamChanged",
    "backend_name",
    "sync_variables",
    "build_before_fit",
    "strategy_scope",
]
