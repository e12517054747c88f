"""Models of the recipes: ResNet v1.5 (`trainwell.models.resnet`) and its fused BatchNorm (`layers`).

Names are imported lazily so `import trainwell.models` does not import Keras;
`trainwell.models.specs` (`RESNET_DEPTHS`) never does.

Example:
>>> from trainwell.models import build_resnet
>>> build_resnet(18, 10, (32, 32, 3), small_stem=True).name
'resnet18'
"""

from __future__ import annotations

import importlib

_LAZY = {
    "RESNET_DEPTHS": "specs",
    "build_resnet": "resnet",
    "build_resnet_from_name": "resnet",
    "FusedBatchNormalization": "layers",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"trainwell.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'trainwell.models' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
