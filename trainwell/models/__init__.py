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
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the same names for editors and static analysis, which never run `__getattr__`
    from trainwell.models.layers import FusedBatchNormalization
    from trainwell.models.resnet import build_resnet, build_resnet_from_name
    from trainwell.models.specs import RESNET_DEPTHS

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
