"""The version gate every private access in `trainwell.compat` goes through.

A private Keras or TensorFlow name is read only here, in this package, and each
accessor calls `gate(name)` first. The versions the accessors were written and
tested against are `TESTED_KERAS` and `TESTED_TF` (`lo <= version < hi`; the
same ranges `pyproject.toml` allows, checked with Keras 3.15.1 / TF 2.21). On a
version outside them the accessor still runs, after one warning per name that
says which test to run (`tests/trainwell/compat/`, which fails when an upstream
name moves); a name that is gone raises `UpstreamChanged`, never a bare
`AttributeError` from deep inside a callback.

Example:
>>> keras_version() >= (3, 0)
True
>>> in_range((3, 15), TESTED_KERAS), in_range((3, 16), TESTED_KERAS)
(True, False)
"""

from __future__ import annotations

import re
import threading
import warnings

import keras

#: Keras versions the private accesses are tested with, as `(lo, hi)`: `lo <= v < hi`.
TESTED_KERAS = ((3, 8), (3, 16))
#: TensorFlow versions the private accesses are tested with, as `(lo, hi)`.
TESTED_TF = ((2, 18), (2, 22))
#: keras-hub versions its private accesses are tested with (one: `preset_backbone_class`).
TESTED_KERAS_HUB = ((0, 32), (0, 33))

_warned: set[str] = set()
_lock = threading.Lock()


class UpstreamChanged(RuntimeError):
    """A private Keras/TensorFlow name trainwell relies on is not where it was.

    The message names it, the installed version and the tested range.
    """


def _major_minor(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def keras_version() -> tuple[int, int]:
    """The installed Keras version as `(major, minor)`.

    Example:
    >>> keras_version() >= (3, 0)
    True
    """
    return _major_minor(keras.__version__)


def tf_version() -> tuple[int, int]:
    """The installed TensorFlow version as `(major, minor)`, `(0, 0)` without TensorFlow.

    Example:
    >>> tf_version() >= (2, 0)
    True
    """
    try:
        import tensorflow as tf  # here: the JAX backend runs without TensorFlow
    except ImportError:  # pragma: no cover - no TensorFlow installed
        return (0, 0)
    return _major_minor(tf.__version__)


def keras_hub_version() -> tuple[int, int]:
    """The installed keras-hub version as `(major, minor)`, `(0, 0)` without keras-hub.

    Example:
    >>> keras_hub_version() >= (0, 20)
    True
    """
    try:
        import keras_hub  # here: imported only when a keras-hub accessor runs
    except ImportError:  # pragma: no cover - keras-hub is a dependency
        return (0, 0)
    return _major_minor(keras_hub.__version__)


def _installed(library: str) -> tuple[tuple[int, int], tuple[tuple[int, int], tuple[int, int]]]:
    """`(installed version, tested bounds)` of `library`: "keras", "tensorflow" or "keras_hub"."""
    if library == "keras":
        return keras_version(), TESTED_KERAS
    if library == "keras_hub":
        return keras_hub_version(), TESTED_KERAS_HUB
    return tf_version(), TESTED_TF


def in_range(version: tuple[int, int], bounds: tuple[tuple[int, int], tuple[int, int]]) -> bool:
    """Whether `lo <= version < hi` for `bounds = (lo, hi)`.

    Args:
        version: `(major, minor)`. Required.
        bounds: `(lo, hi)`. Required.

    Example:
    >>> in_range((2, 21), TESTED_TF)
    True
    """
    lo, hi = bounds
    return lo <= tuple(version) < hi


def gate(name: str, library: str = "keras") -> None:
    """Warns once per `name` when the installed `library` is outside its tested range.

    Args:
        name: The private name about to be used, e.g. `"Model._symbolic_build"`. Required.
        library: `"keras"`, `"tensorflow"` or `"keras_hub"`. Defaults to `"keras"`.

    Example:
    >>> gate("Model._symbolic_build")  # silent on a tested Keras
    """
    version, bounds = _installed(library)
    if in_range(version, bounds) or name in _warned:
        return
    with _lock:
        if name in _warned:
            return
        _warned.add(name)
    warnings.warn(
        f"trainwell uses the private {library} name `{name}`, tested with {library} "
        f"{_fmt(bounds[0])} to below {_fmt(bounds[1])}; {library} {_fmt(version)} is installed. "
        "Run tests/trainwell/compat/ with it to check it still holds.",
        stacklevel=3,
    )


def upstream_changed(name: str, library: str = "keras", detail: str = "") -> UpstreamChanged:
    """The error for a private name that is gone (see `UpstreamChanged`).

    Example:
    >>> str(upstream_changed("Model._foo")).startswith("trainwell needs the private keras name")
    True
    """
    version, bounds = _installed(library)
    return UpstreamChanged(
        f"trainwell needs the private {library} name `{name}`, which {library} {_fmt(version)} does not have"
        f"{f' ({detail})' if detail else ''}; trainwell is tested with {library} {_fmt(bounds[0])} to below "
        f"{_fmt(bounds[1])}. Install a tested version, or update `trainwell.compat`."
    )


def _fmt(v: tuple[int, int]) -> str:
    return ".".join(str(x) for x in v)
