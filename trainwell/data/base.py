"""What every data module shares: its errors and how a path the user wrote is read.

`trainwell.data.sources` (checks), `embedded`, `images` and `text` (pipelines) all
import from here, and nothing here imports them, so they never import each other in
a circle.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterator


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


def json_lines(path: Path, bad_line: Callable[[int, str, str], str]) -> Iterator[tuple[int, object, str]]:
    """`(line number, value, line)` of each non-blank line of a JSON-lines file (UTF-8, a BOM allowed).

    A line that is not JSON raises `DataError` with `bad_line(n, reason, line)`
    (each reader words it for its format); a file that is not UTF-8 raises
    `UnicodeDecodeError`, which the reader reports.

    Example:
    >>> import tempfile; p = Path(tempfile.mkdtemp(), "a.jsonl"); _ = p.write_text('{"a": 1}\\n\\n[2]\\n')
    >>> [(n, value) for n, value, _ in json_lines(p, lambda n, why, line: f"line {n}: {why}")]
    [(1, {'a': 1}), (3, [2])]
    """
    with Path(path).open(encoding="utf-8-sig") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as e:
                raise DataError(bad_line(n, getattr(e, "msg", "nested too deeply"), line.strip())) from None
            yield n, value, line.strip()
