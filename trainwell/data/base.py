"""What every data module shares: its errors and how a path the user wrote is read.

`trainwell.data.sources` (checks), `embedded`, `images` and `text` (pipelines) all
import from here, and nothing here imports them, so they never import each other in
a circle.
"""

from __future__ import annotations

import os


class DataError(ValueError):
    """Data that cannot be trained on: missing, empty, unreadable, one class, ... One line.

    The `trainwell` command prints the message and exits with status 2 (no traceback).

    Example:
    >>> raise DataError("Empty file: 'train.csv' has no rows.")  # doctest: +SKIP
    """


class DataNotFoundError(DataError, FileNotFoundError):
    """A data file, folder or dataset that does not exist (or is not prepared).

    Example:
    >>> isinstance(DataNotFoundError("x"), FileNotFoundError)
    True
    """


def resolve_path(path: str, data_dir: str | None = None) -> str:
    """`path` with `~` expanded, under `data_dir` when relative (a string: `gs://` paths stay intact).

    Args:
        path: A path or URL as the user wrote it.
        data_dir: Base of a relative path. Defaults to `None`.

    Example:
    >>> resolve_path("train.csv", "/data")
    '/data/train.csv'
    """
    path = os.path.expanduser(path.strip())
    if data_dir and not os.path.isabs(path) and "://" not in path:
        path = os.path.join(os.path.expanduser(data_dir), path)
    return path


def open_tfds_builder(name: str, data_dir: str | None = None):
    """`tfds.builder(name, data_dir=...)`, or one line naming the source when TFDS does not know it.

    TFDS's own errors (`DatasetNotFoundError` and friends) run to many lines with a
    list of every registered name; the loaders want one `DataError` line instead.

    Args:
        name: A registered TFDS name, e.g. `"mnist"` or `"imdb_reviews/plain_text"`.
        data_dir: Where TFDS keeps prepared datasets. Defaults to `None` (TFDS's own default).

    Returns:
        The `tfds.core.DatasetBuilder`.

    Example:
    >>> open_tfds_builder("no_such_dataset")
    Traceback (most recent call last):
    ...
    trainwell.data.base.DataError: Unknown TFDS dataset 'no_such_dataset' (source 'tfds:no_such_dataset'): ...
    """
    # lazy: TFDS loads on first use, not with this module
    import tensorflow_datasets as tfds

    try:
        return tfds.builder(name, data_dir=data_dir)
    except Exception as e:  # DatasetNotFoundError and friends
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(f"Unknown TFDS dataset {name!r} (source 'tfds:{name}'): {first}") from None
