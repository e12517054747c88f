"""LoRA on a keras-hub backbone: enable it, and merge the adapters back into plain weights.

Keras 3's `Dense`, `EinsumDense` and `Embedding` layers carry LoRA themselves
(`layer.enable_lora(rank, lora_alpha=...)`: the kernel is frozen, the output gains
`(lora_alpha / rank) * x @ A @ B` with `B` initialised to zeros); keras-hub's
`Backbone.enable_lora(rank, target_layer_names)` freezes every backbone layer and
enables LoRA on the layers of those names (by default
`backbone.default_lora_layer_names()`: the attention's query and value projections,
Hu et al. 2021, sec. 7.1). What this module adds: the `lora_alpha` scaling, which
keras-hub's backbone method does not pass on; a one-line error when no layer has a
target name; and `merged_copy`, a model of the same class *without* LoRA whose
kernels are `W + (lora_alpha / rank) * A @ B`, for an export that plain keras-hub
loads.

It lives in the foundation (`trainwell.models`), not in a recipe: it depends on
Keras and keras-hub only, and every recipe that fine-tunes a keras-hub backbone
(classification today, causal LM next) applies and merges LoRA the same way.

Example:
>>> from trainwell.models.lora import enable_lora, merged_copy
>>> enable_lora(model.backbone, rank=8, alpha=16)  # doctest: +SKIP
>>> export = merged_copy(model)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from trainwell.compat.sharded import host_value
from trainwell.validation import invalid_argument

#: The adapter variables' names: Dense/EinsumDense and Embedding (Keras 3).
_ADAPTERS = {
    "kernel": ("lora_kernel_a", "lora_kernel_b"),
    "embeddings": ("lora_embeddings_a", "lora_embeddings_b"),
}


def enable_lora(backbone, rank: int, alpha: Optional[float] = None,
                target_layer_names: Optional[Sequence[str]] = None) -> list[str]:
    """Freezes `backbone` and adds rank-`rank` adapters to the layers named `target_layer_names`.

    Args:
        backbone: A built keras-hub `Backbone`.
        rank: The adapters' rank, >= 1.
        alpha: The scaling numerator: adapters add `(alpha / rank) * x @ A @ B`.
            Defaults to `None` (`rank`, Keras's default: a scale of 1).
        target_layer_names: Layer names to adapt. Defaults to `None`
            (`backbone.default_lora_layer_names()`, keras-hub's: query and value).

    Returns:
        The paths of the adapter variables (what trains in the backbone, with the
        adapted layers' biases).

    Raises:
        ValueError: No layer of the backbone has one of the names.

    Example:
    >>> paths = enable_lora(model.backbone, rank=4)  # doctest: +SKIP
    >>> paths[0]  # doctest: +SKIP
    'transformer_layer_0/self_attention_layer/query/lora_kernel_a'
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise invalid_argument("rank", "an integer >= 1", rank)
    if alpha is not None and not alpha > 0:
        raise invalid_argument("alpha", "a number > 0 or None", alpha)
    names = list(target_layer_names) if target_layer_names is not None else backbone.default_lora_layer_names()
    before = {id(v) for v in backbone.weights}
    backbone.enable_lora(rank, target_layer_names=names)
    added = [v for v in backbone.weights if id(v) not in before]
    if not added:
        raise ValueError(f"No layer of {backbone.name} is named {', '.join(map(repr, names))} (the LoRA targets); "
                         f"the backbone's defaults: {backbone.default_lora_layer_names()}.")
    for layer in _lora_layers(backbone):
        if alpha is not None:
            layer.lora_alpha = float(alpha)  # the attribute Keras's enable_lora(rank, lora_alpha) sets
        _store_raw_variables(layer)
    return [v.path for v in added]


def _store_raw_variables(layer) -> None:
    """Makes `layer`'s own-variable store its variables as they are: base kernel, bias, A, B.

    Keras's `save_own_variables` of a LoRA layer writes the *merged* kernel (a tensor
    computed when called, not a variable) and its `load_own_variables` assigns it to the
    base kernel and resets the adapters to zero: right for a deployed model, wrong for a
    training state. trainwell's checkpoints, NaN-rollback snapshots and best-weights
    restores go through these two methods (`callbacks/checkpoint/state.py`), so a resumed
    LoRA run would lose its adapters. On this instance they now store and assign the
    layer's variables one to one, so the training state round-trips exactly; the export
    goes through `merged_copy`, a fresh model that Keras saves the usual way.
    """
    variables = list(layer.variables)

    def save_own_variables(store):
        for i, v in enumerate(variables):
            store[str(i)] = v

    def load_own_variables(store):
        if len(store) != len(variables):
            raise ValueError(f"Expected {len(variables)} variables for the LoRA layer {layer.path!r} "
                             f"(base weights and adapters); the store holds {len(store)}.")
        for i, v in enumerate(variables):
            v.assign(store[str(i)])

    layer.save_own_variables = save_own_variables
    layer.load_own_variables = load_own_variables


def _lora_layers(model) -> list:
    """The layers of `model` (nested included) with LoRA enabled."""
    import keras  # lazy: Keras loads with the first model, not with trainwell.models

    found, stack, seen = [], [model], set()
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        if getattr(layer, "lora_enabled", False):
            found.append(layer)
        for value in vars(layer).values():  # sublayers are attributes (or lists of them)
            items = value if isinstance(value, (list, tuple)) else [value]
            stack.extend(v for v in items if isinstance(v, keras.layers.Layer))
    return found


def lora_scale(model) -> float:
    """`lora_alpha / rank` of the LoRA layers of `model` (one value for all of them).

    Raises:
        ValueError: `model` has no LoRA layer, or layers of different scales.

    Example:
    >>> lora_scale(model)  # doctest: +SKIP
    2.0
    """
    scales = {float(layer.lora_alpha) / float(layer.lora_rank) for layer in _lora_layers(model)}
    if len(scales) != 1:
        raise ValueError(f"Expected LoRA layers of one scale in {model.name}; found scales {sorted(scales)}.")
    return scales.pop()


def merged_weights(model) -> dict[str, np.ndarray]:
    """`{path: value}` of `model`'s weights with each adapter pair merged into its base weight.

    The merged kernel is `W + (lora_alpha / rank) * A @ B` in `W`'s dtype, what Keras's
    own saving writes for a LoRA layer; the adapter variables are left out. A weight
    split between processes (`ModelParallel`) is gathered (`compat.sharded.host_value`):
    every process must then call this.

    Example:
    >>> w = merged_weights(model)  # doctest: +SKIP
    >>> any("lora" in p for p in w)  # doctest: +SKIP
    False
    """
    values = {v.path: v for v in model.weights}
    scale = lora_scale(model) if any("lora_" in p for p in values) else 1.0
    out = {}
    for path, v in values.items():
        leaf = path.rsplit("/", 1)[-1]
        if leaf.startswith("lora_"):
            continue
        value = host_value(v)
        if leaf in _ADAPTERS:
            prefix = path[: -len(leaf)]
            a_name, b_name = _ADAPTERS[leaf]
            if prefix + a_name in values:
                a = host_value(values[prefix + a_name]).astype(np.float32)
                b = host_value(values[prefix + b_name]).astype(np.float32)
                value = (value.astype(np.float32) + scale * np.matmul(a, b)).astype(value.dtype)
        out[path] = value
    return out


def merged_copy(model):
    """A new model of `model`'s class and config, without LoRA, holding the merged weights.

    keras-hub builds a backbone's layers from its hyperparameters, so the copy has no
    adapters; it loads and predicts with plain keras-hub. Works on a model without
    LoRA too (a plain copy).

    Raises:
        ValueError: A weight of the copy has no counterpart in `model`.

    Example:
    >>> plain = merged_copy(model)  # doctest: +SKIP
    >>> np.allclose(plain.predict(x), model.predict(x), atol=1e-5)  # doctest: +SKIP
    True
    """
    weights = merged_weights(model)
    clean = type(model).from_config(model.get_config())
    missing = [v.path for v in clean.weights if v.path not in weights]
    if missing:
        raise ValueError(f"Cannot merge {model.name}: no weight for {missing[:3]} in the trained model.")
    for v in clean.weights:
        v.assign(weights[v.path])
    return clean
