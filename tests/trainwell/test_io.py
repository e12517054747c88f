"""trainwell.io's atomic writes: files get the mode `open()` would give them, not mkstemp's 0600."""

import os
import stat

from trainwell import io, storage


def test_atomically_written_files_are_readable_as_the_umask_allows(tmp_path):
    mask = os.umask(0o022)
    os.umask(mask)
    assert io.FILE_MODE == 0o666 & ~mask
    written = [io.atomic_write_bytes(tmp_path / "metrics.json", b"{}")]
    storage.write_json_replace(tmp_path, "index.json", {"a": 1})
    written.append(tmp_path / "index.json")
    for path in written:  # 0600 hid a run's files from the other users of a shared directory
        assert stat.S_IMODE(path.stat().st_mode) == io.FILE_MODE, path
