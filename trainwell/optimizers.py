"""Optimizers Keras lacks: LARS (You et al. 2017) for large-batch training, and
`LayerwiseAdamW` (AdamW with a learning-rate factor per variable: layer-wise LR
decay and a head-only phase for fine-tuning, ELECTRA / ULMFiT).

Also the weight-decay exclusion patterns for BatchNorm/LayerNorm and biases, usable
with any Keras optimizer's built-in `exclude_from_weight_decay` (see
`exclude_norm_and_bias`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import keras
from keras import ops

from trainwell.compat.keras_internals import OwnWeightDecay, uses_weight_decay, variable_index
from trainwell.compat.learning_rate import raw_learning_rate
from trainwell.validation import invalid_argument, is_int, is_number

# Regex patterns (`re.search`) matching BatchNorm/LayerNorm scale and offset and all
# biases in Keras 3: their variables are named "gamma", "beta" and "bias" (a
# variable's `.name` is the short name, its `.path` is "layer/name"; the TF backend's
# decoupled decay sees the tf.Variable, named "bias:0"). Anchored to a whole path
# component so that, e.g., a layer called "alphabet" is not excluded.
NORM_AND_BIAS_PATTERNS: tuple[str, ...] = (r"(^|/)bias(:\d+)?$", r"(^|/)gamma(:\d+)?$", r"(^|/)beta(:\d+)?$")


def exclude_norm_and_bias(optimizer):
    """Excludes BatchNorm/LayerNorm gamma and beta and all biases from weight decay.

    Calls the optimizer's built-in `exclude_from_weight_decay(var_names=...)` with
    `NORM_AND_BIAS_PATTERNS`; must run before the optimizer is built (before the first
    `fit` step). Works for every Keras optimizer with decoupled `weight_decay` (SGD,
    AdamW, ...) and for `LARS`; a `LossScaleOptimizer` is unwrapped.

    Args:
        optimizer: A `keras.optimizers.Optimizer` (or a `LossScaleOptimizer`).

    Returns:
        The same optimizer, for chaining.

    Example:
    >>> opt = exclude_norm_and_bias(keras.optimizers.AdamW(1e-3, weight_decay=0.05))
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if not hasattr(inner, "exclude_from_weight_decay"):
        raise invalid_argument("optimizer", "a keras.optimizers.Optimizer", optimizer)
    inner.exclude_from_weight_decay(var_names=list(NORM_AND_BIAS_PATTERNS))
    return optimizer


def _check_patterns(arg: str, value) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(p, str) for p in value):
        raise invalid_argument(arg, "None or a list of regex strings", value)
    for p in value:
        try:
            re.compile(p)
        except re.error as e:
            raise invalid_argument(arg, f"valid regular expressions ({e})", value) from None
    return list(value)


def _matches(patterns: list[str] | None, variable) -> bool:
    if not patterns:
        return False
    path = getattr(variable, "path", None) or variable.name
    return any(re.search(p, path) is not None for p in patterns)


@keras.saving.register_keras_serializable(package="trainwell")
class LARS(OwnWeightDecay, keras.optimizers.Optimizer):
    """Layer-wise Adaptive Rate Scaling (You, Gitman & Ginsburg 2017), as TF Model Garden.

    No Keras built-in fits: Keras 3 has no LARS, and `SGD(weight_decay=...)` applies
    *decoupled* decay after the update, while LARS adds the decay to the gradient
    *before* the trust ratio. This is TF Model Garden's
    `official/modeling/optimization/lars_optimizer.py` ported to a Keras 3
    `Optimizer` (`build` + `update_step`). For each variable `w` with gradient `g`:

    ```python
    g = g + weight_decay * w                      # unless excluded from weight decay
    trust = trust_coefficient * ||w|| / (||g|| + epsilon)   # 1 if ||w|| or ||g|| is 0,
                                                  # or if excluded from layer adaptation
    # classic_momentum=True (default):
    v = momentum * v + learning_rate * trust * g
    w = w - (momentum * v + learning_rate * trust * g if nesterov else v)
    # classic_momentum=False ("popular" momentum): trust from the update u instead of g
    v = momentum * v + g;  u = momentum * v + g if nesterov else v
    w = w - learning_rate * trust_coefficient * ||w|| / (||u|| + epsilon) * u
    ```

    Weight decay is applied exactly once, LARS-style: Keras's decoupled decay pass
    is off (`trainwell.compat.keras_internals.OwnWeightDecay`). Exclusion patterns are regexes
    searched in each variable's `path` (e.g. `"conv1/kernel"`, `"bn/gamma"`); pass
    `NORM_AND_BIAS_PATTERNS` to exclude BatchNorm/LayerNorm and biases (the usual
    large-batch practice). The base class's `exclude_from_weight_decay(var_list=...,
    var_names=...)` method works too.

    Args:
        learning_rate: A float, a `LearningRateSchedule` or a callable. Defaults to `0.1`.
        momentum: Momentum in [0, 1). Defaults to `0.9`.
        weight_decay: L2 coefficient added to the gradient, >= 0. Defaults to `1e-4`.
        trust_coefficient: LARS coefficient eta (the paper's 0.001), > 0. Defaults to `0.001`.
        epsilon: Added to the gradient norm in the trust ratio, >= 0. Defaults to `0.0`.
        nesterov: Use Nesterov momentum. Defaults to `False`.
        classic_momentum: Scale the learning rate inside the momentum (classic) or
            apply it after (popular), as Model Garden. Defaults to `True`.
        exclude_from_layer_adaptation: Regexes of variables that get trust ratio 1.
            `None` means the same as `exclude_from_weight_decay` (Model Garden).
            Defaults to `None`.
        exclude_from_weight_decay: Regexes of variables without weight decay.
            Defaults to `None` (all variables decayed).
        **kwargs: The base optimizer's arguments (`clipnorm`, `global_clipnorm`,
            `use_ema`, `gradient_accumulation_steps`, `name`, ...).

    Example:
    >>> opt = LARS(learning_rate=0.1, weight_decay=1e-4,
    ...            exclude_from_weight_decay=list(NORM_AND_BIAS_PATTERNS))
    >>> model = keras.Sequential([keras.layers.Dense(2)])
    >>> model.compile(optimizer=opt, loss="mse")  # doctest: +SKIP
    """

    def __init__(
        self,
        learning_rate=0.1,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        trust_coefficient: float = 0.001,
        epsilon: float = 0.0,
        nesterov: bool = False,
        classic_momentum: bool = True,
        exclude_from_layer_adaptation: Sequence[str] | None = None,
        exclude_from_weight_decay: Sequence[str] | None = None,
        name: str = "lars",
        **kwargs,
    ):
        if is_int(learning_rate):
            learning_rate = float(learning_rate)
        for arg, value, lo, hi, lo_open in (
            ("momentum", momentum, 0.0, 1.0, False),
            ("weight_decay", weight_decay, 0.0, None, False),
            ("trust_coefficient", trust_coefficient, 0.0, None, True),
            ("epsilon", epsilon, 0.0, None, False),
        ):
            ok = is_number(value) and (value > lo if lo_open else value >= lo) and (hi is None or value < hi)
            if not ok:
                rng = f"in [{lo}, {hi})" if hi is not None else (f"> {lo}" if lo_open else f">= {lo}")
                raise invalid_argument(arg, f"a float {rng}", value)
        wd_patterns = _check_patterns("exclude_from_weight_decay", exclude_from_weight_decay)
        adapt_patterns = _check_patterns("exclude_from_layer_adaptation", exclude_from_layer_adaptation)
        super().__init__(learning_rate=learning_rate, weight_decay=float(weight_decay), name=name, **kwargs)
        self.momentum = float(momentum)
        self.trust_coefficient = float(trust_coefficient)
        self.epsilon = float(epsilon)
        self.nesterov = bool(nesterov)
        self.classic_momentum = bool(classic_momentum)
        self._exclude_wd_patterns = wd_patterns
        self._exclude_adapt_patterns = adapt_patterns
        self._decay_flags: list[bool] = []
        self._adapt_flags: list[bool] = []

    # ----------------------------------------------------------------- decay
    def _decays(self, variable) -> bool:
        if not self.weight_decay:
            return False
        if _matches(self._exclude_wd_patterns, variable):
            return False
        return uses_weight_decay(self, variable)

    def _use_layer_adaptation(self, variable) -> bool:
        patterns = self._exclude_adapt_patterns
        if patterns is None:
            patterns = self._exclude_wd_patterns
        return not _matches(patterns, variable)

    # ----------------------------------------------------------------- update
    def build(self, variables):
        """Creates one momentum slot per variable and fixes the per-variable exclusions."""
        if self.built:
            return
        super().build(variables)
        self.momentums = self.add_optimizer_variables(variables, "momentum")
        # Decided once on the Keras variables (their `path`): inside `update_step` the
        # TF backend passes the underlying tf.Variable.
        self._decay_flags = [self._decays(v) for v in variables]
        self._adapt_flags = [bool(self._use_layer_adaptation(v)) for v in variables]

    def update_step(self, gradient, variable, learning_rate):
        """Applies one LARS step to `variable`."""
        index = variable_index(self, variable)
        dtype = variable.dtype
        lr = ops.cast(learning_rate, dtype)
        grad = ops.cast(gradient, dtype)
        momentum = ops.cast(self.momentum, dtype)
        v = self.momentums[index]
        w = ops.convert_to_tensor(variable)
        if self._decay_flags[index]:
            grad = ops.add(grad, ops.multiply(ops.cast(self.weight_decay, dtype), w))
        adapt = self._adapt_flags[index]

        def trust_ratio(direction):
            w_norm = ops.sqrt(ops.sum(ops.square(w)))
            d_norm = ops.sqrt(ops.sum(ops.square(direction)))
            ratio = ops.divide(
                ops.multiply(ops.cast(self.trust_coefficient, dtype), w_norm),
                ops.add(d_norm, ops.cast(self.epsilon, dtype)),
            )
            one = ops.ones_like(w_norm)
            return ops.where(ops.greater(w_norm, 0), ops.where(ops.greater(d_norm, 0), ratio, one), one)

        if self.classic_momentum:
            scaled_lr = ops.multiply(lr, trust_ratio(grad)) if adapt else lr
            next_v = ops.add(ops.multiply(momentum, v), ops.multiply(scaled_lr, grad))
            if self.nesterov:
                update = ops.add(ops.multiply(momentum, next_v), ops.multiply(scaled_lr, grad))
            else:
                update = next_v
            self.assign(v, next_v)
            self.assign_sub(variable, update)
        else:
            next_v = ops.add(ops.multiply(momentum, v), grad)
            update = ops.add(ops.multiply(momentum, next_v), grad) if self.nesterov else next_v
            scaled_lr = ops.multiply(lr, trust_ratio(update)) if adapt else lr
            self.assign(v, next_v)
            self.assign_sub(variable, ops.multiply(scaled_lr, update))

    def get_config(self):
        """Returns the constructor arguments (plus the base optimizer's)."""
        config = super().get_config()
        config.update(
            {
                "momentum": self.momentum,
                "weight_decay": self.weight_decay,
                "trust_coefficient": self.trust_coefficient,
                "epsilon": self.epsilon,
                "nesterov": self.nesterov,
                "classic_momentum": self.classic_momentum,
                "exclude_from_layer_adaptation": self._exclude_adapt_patterns,
                "exclude_from_weight_decay": self._exclude_wd_patterns,
            }
        )
        return config


@keras.saving.register_keras_serializable(package="trainwell")
class LayerwiseAdamW(OwnWeightDecay, keras.optimizers.AdamW):
    """`keras.optimizers.AdamW` with a learning-rate factor per variable.

    Extends Keras's `AdamW` (same arguments): Keras has no per-variable learning
    rate (no parameter groups), which layer-wise LR decay and a head-only phase
    need. Each variable's update and decoupled weight decay use
    `learning_rate * lr_scales[variable.path]` (1.0 for paths not listed), and the
    variables in `frozen_variables` have factor 0 until the optimizer has taken
    `freeze_steps` steps. During those steps the learning rate is `head_lr`
    (times the schedule's LR multiplier, so NaN rollback can lower it; without
    `head_lr`, the schedule's value at its step 0); afterwards the schedule runs
    from its step 0, i.e. a fresh warmup. The decay is AdamW's, applied in
    `update_step` with the variable's factor (Keras's own decay pass, one LR for
    all, is off: `trainwell.compat.keras_internals.OwnWeightDecay`); the head-only
    phase is the public `learning_rate` property, overridden.

    Args:
        lr_scales: `{variable path: factor >= 0}`. Defaults to `None` (all 1).
        frozen_variables: Paths trained only after `freeze_steps`. Defaults to `None`.
        freeze_steps: Steps (optimizer iterations, micro-steps under gradient
            accumulation) of the head-only phase. Defaults to `0`.
        head_lr: Learning rate of the head-only phase. Defaults to `None` (the
            schedule's value at step 0).
        **kwargs: `keras.optimizers.AdamW` arguments.

    Example:
    >>> opt = LayerwiseAdamW(learning_rate=3e-5, weight_decay=0.01,
    ...                      lr_scales={"transformer_layer_0/query/kernel": 0.5})
    >>> opt.get_config()["lr_scales"]
    {'transformer_layer_0/query/kernel': 0.5}
    """

    def __init__(self, *args, lr_scales=None, frozen_variables=None, freeze_steps=0, head_lr=None, **kwargs):
        super().__init__(*args, **kwargs)
        scales = dict(lr_scales or {})
        for k, s in scales.items():
            if not is_number(s) or s < 0:
                raise invalid_argument("lr_scales", f"factors >= 0 ({k!r} has {s!r})", lr_scales)
        if not is_int(freeze_steps) or freeze_steps < 0:
            raise invalid_argument("freeze_steps", "an int >= 0", freeze_steps)
        if head_lr is not None and (not is_number(head_lr) or head_lr <= 0):
            raise invalid_argument("head_lr", "a float > 0", head_lr)
        self.lr_scales = {str(k): float(v) for k, v in scales.items()}
        self.frozen_variables = [str(p) for p in (frozen_variables or [])]
        self.freeze_steps = int(freeze_steps)
        self.head_lr = None if head_lr is None else float(head_lr)

    def build(self, variables):
        super().build(variables)
        frozen = set(self.frozen_variables)
        self._tw_scales = [self.lr_scales.get(v.path, 1.0) for v in variables]
        self._tw_frozen = [v.path in frozen and self.freeze_steps > 0 for v in variables]

    def _scale(self, variable):
        """The factor of `variable`: a Python float, or a tensor during the freeze."""
        i = variable_index(self, variable)
        s = self._tw_scales[i]
        if self._tw_frozen[i]:
            gate = ops.cast(ops.greater_equal(self.iterations, self.freeze_steps), "float32")
            return gate * s
        return s

    @property
    def learning_rate(self):
        """The LR of the next step: in the head-only phase `head_lr`, then the schedule from its step 0."""
        lr = super().learning_rate
        if self.freeze_steps <= 0:
            return lr
        sched = raw_learning_rate(self)
        it = self.iterations
        if isinstance(sched, keras.optimizers.schedules.LearningRateSchedule):
            later = ops.cast(sched(ops.maximum(it - self.freeze_steps, 0)), "float32")
            mult = ops.cast(getattr(sched, "multiplier", 1.0), "float32")
        else:
            later, mult = ops.cast(lr, "float32"), 1.0
        # `later` already carries the schedule's multiplier; `head_lr` gets it here.
        head = later if self.head_lr is None else ops.cast(self.head_lr * mult, "float32")
        return ops.where(it < self.freeze_steps, head, later)

    @learning_rate.setter
    def learning_rate(self, value):
        keras.optimizers.AdamW.learning_rate.fset(self, value)

    def update_step(self, gradient, variable, learning_rate):
        """AdamW's decoupled weight decay, then Adam's step, both at `learning_rate` times the variable's factor."""
        s = self._scale(variable)
        if not (isinstance(s, float) and s == 1.0):
            learning_rate = ops.cast(learning_rate, "float32") * s
        if self.weight_decay is not None and uses_weight_decay(self, variable):
            lr = ops.cast(learning_rate, variable.dtype)
            wd = ops.cast(self.weight_decay, variable.dtype)
            self.assign_sub(variable, variable * wd * lr)
        return super().update_step(gradient, variable, learning_rate)

    def get_config(self):
        config = super().get_config()
        config.update(
            lr_scales=dict(self.lr_scales), frozen_variables=list(self.frozen_variables),
            freeze_steps=self.freeze_steps, head_lr=self.head_lr,
        )
        return config


__all__ = ["LARS", "LayerwiseAdamW", "NORM_AND_BIAS_PATTERNS", "exclude_norm_and_bias"]
