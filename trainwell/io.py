"""Small filesystem helpers shared by the run directory and the checkpoints.

Every file trainwell writes that a restart reads back (config, manifest, callback
state, checkpoint index) is written atomically: to a temporary file in the same
directory, flushed and fsynced, then renamed over the target. A reader therefore
sees either the old file or the new one, never a torn write.
"""

from __future__ import annotations

import io as _io
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def fsync_dir(path: str | os.PathLike) -> None:
    """Fsyncs a directory so a rename inside it survives a power loss.

    Example:
    >>> fsync_dir(".")
    """
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:  # e.g. Windows: directories cannot be opened.
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _file_mode() -> int:
    """What `open()` gives a new file under this process's umask (`0o644` under the usual `022`)."""
    mask = os.umask(0o022)  # reading the umask means setting it: put back at once
    os.umask(mask)
    return 0o666 & ~mask


#: The mode of files written through a temporary: `mkstemp` makes them 0600, which left run
#: files (metrics.json, a checkpoint's state.json, a prepared folder's index.json) unreadable
#: to the other users of a shared directory.
FILE_MODE = _file_mode()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Writes `data` to `path` atomically (temp file in the same directory, fsync, rename).

    Args:
        path: Target file. Its directory is created if missing.
        data: Bytes to write.

    Returns:
        The target path.

    Example:
    >>> import tempfile, os
    >>> atomic_write_bytes(os.path.join(tempfile.mkdtemp(), "a.bin"), b"hi").read_bytes()
    b'hi'
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Writes `text` (UTF-8) to `path` atomically. See `atomic_write_bytes`.

    Example:
    >>> import tempfile, os
    >>> atomic_write_text(os.path.join(tempfile.mkdtemp(), "a.txt"), "hi").read_text()
    'hi'
    """
    return atomic_write_bytes(path, text.encode("utf-8"))


def new_figure(nrows: int = 1, ncols: int = 1, figsize=(6.0, 3.5)):
    """`(figure, axes)`: a matplotlib figure on the Agg canvas, without pyplot.

    Library plots use this instead of `plt.subplots` so they never switch the global
    backend (`matplotlib.use("Agg")` would stop a notebook's inline plots) and never
    register the figure with pyplot. `axes` is a 2-D array (`squeeze=False`).

    Example:
    >>> fig, axes = new_figure(1, 2, figsize=(8, 3))
    >>> axes.shape
    (1, 2)
    """
    # lazy: matplotlib loads on first use, not with this module
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def save_figure(fig, path: str | os.PathLike, dpi: int = 100) -> Path:
    """Saves a matplotlib figure as PNG atomically (and closes it if pyplot holds it).

    Example:
    >>> import tempfile, os
    >>> fig, _ = new_figure()
    >>> save_figure(fig, os.path.join(tempfile.mkdtemp(), "f.png")).suffix
    '.png'
    """

    buf = _io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is not None:
        plt.close(fig)  # a no-op for figures pyplot does not manage
    return atomic_write_bytes(path, buf.getvalue())


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Writes `obj` as indented JSON, atomically. See `atomic_write_text`.

    Example:
    >>> import tempfile, os
    >>> p = atomic_write_json(os.path.join(tempfile.mkdtemp(), "a.json"), {"a": 1})
    >>> json.loads(p.read_text())
    {'a': 1}
    """
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")


def _json_default(o: Any) -> Any:
    try:

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(o, Path):
        return str(o)
    return repr(o)


#: What `atomic_write_bytes` names its temporary files: `.<target name>.<random>.tmp`.
_TEMP_RE = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$")


def remove_stale_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Removes the temporary files a killed `atomic_write_bytes` left in `directory`.

    A process killed between the temporary file's creation and its rename leaves
    `.<name>.<random>.tmp` behind (the target itself is intact). Call this only
    while no other process writes to `directory` (the run directory's lock, or the
    chief's `Checkpoint` at the start of `fit`).

    Args:
        directory: The directory to clean (not recursive).

    Returns:
        The files removed.

    Example:
    >>> import tempfile
    >>> remove_stale_temporaries(tempfile.mkdtemp())
    []
    """
    removed = []
    try:
        children = list(Path(directory).iterdir())
    except OSError:
        return removed
    for child in children:
        if _TEMP_RE.match(child.name) and child.is_file():
            try:
                child.unlink()
                removed.append(child)
            except OSError:
                pass
    return removed
