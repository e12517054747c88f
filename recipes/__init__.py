"""trainwell.recipes: one module per training recipe.

Recipe modules are imported lazily (`from trainwell.recipes import resnet_imagenet`)
so importing the package does not pull in TensorFlow.
"""

from __future__ import annotations

import importlib

RECIPES = {
    "resnet-imagenet": "resnet_imagenet",
    "transformer-finetune": "transformer_finetune",
    "causal-lm": "causal_lm",
}

__all__ = ["RECIPES", "get", *RECIPES.values()]


def get(name: str):
    """Imports a recipe module by its command-line name or module name.

    Example:
    >>> get("resnet-imagenet").__name__  # doctest: +SKIP
    'trainwell.recipes.resnet_imagenet'
    """
    module = RECIPES.get(name, name.replace("-", "_"))
    if module not in RECIPES.values():
        raise ValueError(
            f"Unknown recipe {name!r}. Expected one of: {', '.join(RECIPES)}."
        )
    return importlib.import_module(f"trainwell.recipes.{module}")


def __getattr__(name: str):
    if name in RECIPES.values():
        return importlib.import_module(f"trainwell.recipes.{name}")
    raise AttributeError(f"module 'trainwell.recipes' has no attribute {name!r}")
