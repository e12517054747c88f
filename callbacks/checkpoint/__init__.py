"""`Checkpoint`: atomic checkpoints that resume a `fit` exactly, and the public reader of its files.

The package holds one job per module: `files` (the on-disk format, index and
checksums, and reading them back), `state` (a model's arrays in and out),
`writer` (snapshot to committed files, in the background if asked), `resume`
(restore, and the resumed epoch's start at the exact batch), `preemption` (SIGTERM -> checkpoint ->
exit) and `callback` (the `Checkpoint` callback that decides when). What a user
or a tool needs is importable from here: the callback, the reader
(`read_checkpoint`, `list_checkpoints`, `latest_checkpoint`,
`resume_checkpoint`, `load_checkpoint`), the file names and the errors. The
guide is `docs/checkpoint.md`.

Example:
>>> import tempfile
>>> directory = tempfile.mkdtemp()
>>> Checkpoint(directory, save_every=100).get_config()["save_every"]
100
>>> list_checkpoints(directory), resume_checkpoint(directory)
([], None)
"""

from trainwell.callbacks.checkpoint.callback import Checkpoint
from trainwell.callbacks.checkpoint.files import (
    ARRAYS_FILE,
    FORMAT_VERSION,
    INDEX_FILE,
    STATE_FILE,
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointSaveError,
    latest_checkpoint,
    list_checkpoints,
    read_checkpoint,
    resume_checkpoint,
)
from trainwell.callbacks.checkpoint.state import load_checkpoint

__all__ = [
    "Checkpoint",
    "read_checkpoint",
    "list_checkpoints",
    "latest_checkpoint",
    "resume_checkpoint",
    "load_checkpoint",
    "STATE_FILE",
    "ARRAYS_FILE",
    "INDEX_FILE",
    "FORMAT_VERSION",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
]
