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
