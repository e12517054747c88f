"""Architecture tables, without Keras: checking a config (`resnet_imagenet.Config.validate`)
must not import Keras or TensorFlow, so the names a config may hold live here.

Example:
>>> sorted(RESNET_DEPTHS)
[18, 34, 50, 101, 152]
"""

from __future__ import annotations

__all__ = ["RESNET_DEPTHS"]

# depth -> (block kind, blocks per stage). He et al. 2016, Table 1.
RESNET_DEPTHS: dict[int, tuple[str, tuple[int, int, int, int]]] = {
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
}
