"""The index of a folder of prepared image shards (`trainwell.data.prepare`): read and checked.

`trainwell prepare-images` writes `index.json` last, beside its `train-NNNNN-of-NNNNN`
TFRecord shards: shard names, record counts, SHA-256 checksums, `max_side`, class names.
The TFRecord reader (`trainwell.data.image_sources`) takes the classes and the label
offset from it, so `dataset="tfrecord:DST"` trains on a prepared folder with its own
class names instead of ImageNet's 1,000 numbered ones. This module imports nothing
of the readers, so both they and the writer can use it.

Example:
>>> import tempfile
>>> read_index(tempfile.mkdtemp()) is None  # no index: not a prepared folder
True
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from trainwell.data.sources import DataError

__all__ = ["INDEX_FORMAT", "INDEX_NAME", "read_index", "sha256_of"]

#: The index's file name: it must not start with `train`, `val` or `test` (the TFRecord
#: reader would take it for a shard).
INDEX_NAME = "index.json"
#: The `format` field of an index this version writes and reads.
INDEX_FORMAT = "trainwell-prepared-images/1"


def sha256_of(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks.

    Example:
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "a"); _ = open(p, "wb").write(b"abc")
    >>> sha256_of(p)[:16]
    'ba7816bf8f01cfea'
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_index(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The index of a prepared folder, or `None` when `directory` has none (or is not a local folder).

    Args:
        directory: The folder `trainwell prepare-images` wrote.

    Returns:
        The index as a dict (`format`, `shards`, `count`, `num_classes`, `class_names`,
        `label_offset`, `max_side`, ...), or `None`.

    Raises:
        DataError: an index that is not JSON or not of this format, naming the file.

    Example:
    >>> import tempfile
    >>> read_index(tempfile.mkdtemp()) is None
    True
    """
    path = os.path.join(os.fspath(directory), INDEX_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"Unreadable index of prepared images {path!r}: {e}.") from None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        found = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise DataError(f"{path!r} is not an index of prepared images (format {found!r}, expected {INDEX_FORMAT!r}).")
    return index
